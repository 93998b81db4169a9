"""Regenerate the framework fixtures with the frameworks themselves and cross-check them.

Optional (marker `frameworks`): runs only when CKPTTOOL_FRAMEWORKS_PYTHON names a Python
that has torchtitan, accelerate, Lightning, verl, megatron-core and ai2-olmo-core installed (the
versions each `fixtures/frameworks/generate_*.py` names), e.g.

    CKPTTOOL_FRAMEWORKS_PYTHON=/work/fwvenv/bin/python python -m pytest -m frameworks

Composer pins an older torch, so it has its own venv (generate_composer.py says how it is made):
CKPTTOOL_COMPOSER_PYTHON names its Python (default: CKPTTOOL_FRAMEWORKS_PYTHON).

Each generator runs on a copy of the scripts in a temporary directory, so the committed
fixtures are untouched. The regenerated tensors must be the committed ones (names, shapes,
dtypes, sha256 of their bytes), and ckpttool must consolidate the regenerated checkpoint to
exactly those tensors: a new framework release that changes its layout shows up here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import FIXTURES, tensor_bytes

FRAMEWORKS_PYTHON = os.environ.get("CKPTTOOL_FRAMEWORKS_PYTHON")
PYTHONS = {"composer": os.environ.get("CKPTTOOL_COMPOSER_PYTHON", FRAMEWORKS_PYTHON)}
GENERATORS = FIXTURES / "frameworks"
# layout -> (checkpoint inside the generated folder, consolidate options giving expected.json's bytes)
CASES = {
    "torchtitan": ("checkpoint/step-20", []),
    "accelerate": ("checkpoints/checkpoint_0", []),
    "lightning": ("checkpoints/epoch=0-step=2.ckpt", []),
    "megatron": ("checkpoints", []),
    "verl": ("checkpoints/global_step_2/actor", ["--dtype", "bf16"]),
    "torchtitan_model_only": ("checkpoint/step-2", []),
    "olmo_core": ("run/step2/model_and_optim", []),
    "composer": ("checkpoints/ep0-ba2", []),
}

pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.skipif(not FRAMEWORKS_PYTHON, reason="set CKPTTOOL_FRAMEWORKS_PYTHON to a Python with the frameworks"),
]


def tensors_of(expected: Path) -> dict:
    return json.loads(expected.read_text())["tensors"]


@pytest.mark.parametrize("layout", sorted(CASES))
def test_regenerated_fixture_matches_the_committed_one_and_consolidates_to_it(layout, tmp_path, cli):
    import hashlib

    from safetensors.torch import load_file

    for script in GENERATORS.glob("*.py"):
        shutil.copy(script, tmp_path / script.name)
    python = PYTHONS.get(layout, FRAMEWORKS_PYTHON)
    run = subprocess.run([python, str(tmp_path / f"generate_{layout}.py")], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]

    committed, regenerated = tensors_of(GENERATORS / layout / "expected.json"), tensors_of(tmp_path / layout / "expected.json")
    assert regenerated == committed

    checkpoint, options = CASES[layout]
    out = tmp_path / "model.safetensors"
    result = cli("consolidate", tmp_path / layout / checkpoint, out, "--quiet", *options)
    assert result.exit_code == 0, result.output
    written = {key: hashlib.sha256(tensor_bytes(value)).hexdigest() for key, value in load_file(out).items()}
    assert written == {name: info["sha256"] for name, info in committed.items()}
