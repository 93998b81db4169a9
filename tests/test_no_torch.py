"""Commands that move bytes as they are never import torch (~1.75 s and ~270 MB on its own):
reshard, and consolidate to every output kind unless a dtype cast is asked for (with --all,
python objects that hold torch types would still need it; plain ones do not).

Checked the way a user would: `python -X importtime -m ckpttool ...` lists every module the
process imported, on stderr."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import FIXTURES

SOURCE = FIXTURES / "fsdp2_world3_uneven"


def imported_modules(*args: str) -> set[str]:
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckpttool", *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("command", [
    ("reshard", str(SOURCE), "{out}/w2", "--world", "2", "--quiet"),
    ("reshard", str(SOURCE), "{out}/w5", "--world", "5", "--verify", "--quiet"),
    ("consolidate", str(SOURCE), "{out}/model.safetensors", "--quiet", "--verify"),
    ("consolidate", str(SOURCE), "{out}/hub", "--max-shard-size", "1kB", "--quiet"),
    ("consolidate", str(SOURCE), "{out}/model.pt", "--quiet"),
    ("consolidate", str(SOURCE), "{out}/everything.pt", "--all", "--quiet"),
    ("inspect", str(SOURCE), "--json"),
    ("validate", str(SOURCE), "--deep"),
    ("export", str(SOURCE), "{out}/exported", "--quiet"),
    ("import", str(SOURCE.parent / "dcp_hf_world2_consolidated"), "{out}/imported", "--world", "3", "--quiet"),
    ("push", str(SOURCE), "me/model", "--dry-run"),
    # framework names converted, config.json from Megatron-LM's pickled args: nothing left out needs reading
    ("export", str(FIXTURES / "frameworks" / "megatron_legacy" / "checkpoints"), "{out}/megatron", "--quiet"),
], ids=["reshard", "reshard-verify", "safetensors", "hub", "pt", "pt-all", "inspect", "validate-deep", "export", "import",
       "push-dry-run", "export-megatron-legacy"])
def test_command_never_imports_torch(tmp_path, command):
    modules = imported_modules(*(part.format(out=tmp_path) for part in command))
    assert "ckpttool.cli" in modules  # the listing is real
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}


def test_a_dtype_cast_is_what_brings_torch_in(tmp_path):
    modules = imported_modules("consolidate", str(SOURCE), str(tmp_path / "m.safetensors"), "--dtype", "bf16", "--quiet")
    assert "torch" in modules
