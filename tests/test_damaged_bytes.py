"""Damaged bytes anywhere never produce a traceback: every command either succeeds or exits 1
with one line naming the problem, and leaves nothing half-written.

Seeded mutations of the bundled checkpoints: bytes flipped in `.metadata` or in a data file,
a file cut short, junk appended. Each damaged copy goes through `inspect`, `validate` and
`validate --deep`, `consolidate` (.safetensors and --all .pt) and `reshard`. A run that
succeeds despite the damage (the bytes hit padding or a CRC-less record field) is fine; a
crash is not.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from conftest import FIXTURES, assert_same_bytes, flatten

from ckpttool.outputs.temps import TEMP_PREFIX

CASES = 48  # seeded mutations; each costs ~0.1 s through every command


def mutate(path: Path, seed: int) -> str:
    """Damage one file of the checkpoint at `path`; return what was done."""
    rng = random.Random(seed)
    files = sorted(p for p in path.iterdir() if p.is_file())
    target = files[seed % len(files)]  # .metadata and every data file in turn
    data = bytearray(target.read_bytes())
    kind = ("flip", "truncate", "append", "zero-run")[(seed // len(files)) % 4]
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(len(data))
            data[at] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        data = data[:rng.randrange(len(data))]
    elif kind == "append":
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    else:
        at = rng.randrange(len(data))
        data[at:at + 64] = bytes(len(data[at:at + 64]))
    target.write_bytes(bytes(data))
    return f"{kind} {target.name}"


@pytest.mark.parametrize("seed", range(CASES))
def test_damaged_checkpoints_fail_cleanly_in_every_command(cli, tmp_path, seed):
    name = ("fsdp2_world2_adamw", "fsdp2_world3_uneven")[seed % 2]
    source = tmp_path / name
    shutil.copytree(FIXTURES / name, source)
    what = mutate(source, seed)
    out = tmp_path / "out"
    out.mkdir()
    commands = [
        ("inspect", source, "--json"),
        ("validate", source),
        ("validate", source, "--deep"),
        ("consolidate", source, out / "model.safetensors", "--quiet"),
        ("consolidate", source, out / "all.pt", "--all", "--quiet"),
        ("reshard", source, out / "world5", "--world", "5", "--verify", "--quiet"),
    ]
    for command in commands:
        result = cli(*command)  # an unexpected exception fails the test with its traceback
        assert result.exit_code in (0, 1), f"{what}: {command[0]} exited {result.exit_code}: {result.output}"
        if result.exit_code == 1 and command[0] != "validate":
            assert result.stderr.startswith("error: "), f"{what}: {command[0]}: {result.stderr}"
    assert not [p.name for p in out.iterdir() if p.name.startswith(TEMP_PREFIX)], what


def test_whatever_validate_deep_accepts_torch_loads_to_the_same_values(tmp_path, reference):
    """`validate --deep` is no weaker than torch's own loader: on 96 seeded damages, each
    checkpoint it calls valid loads with `dcp_to_torch_save` to exactly the original values
    (damage to padding, unused header fields and the like is harmless). It may be stricter:
    a changed byte torch never checks (a record's serialization id, say) is still reported."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ckpttool.commands.validate import validate

    verdicts = {"valid": 0, "invalid": 0}
    for seed in range(1000, 1096):
        name = ("fsdp2_world2_adamw", "fsdp2_world3_uneven")[seed % 2]
        source = tmp_path / f"{seed}"
        shutil.copytree(FIXTURES / name, source)
        what = mutate(source, seed)
        if not validate(source, deep=True).valid:
            verdicts["invalid"] += 1
            continue
        verdicts["valid"] += 1
        dcp_to_torch_save(source, tmp_path / "loaded.pt")
        loaded = flatten(torch.load(tmp_path / "loaded.pt", weights_only=False))  # torch just wrote it
        expected = reference(FIXTURES / name)
        assert set(loaded) == set(expected), what
        for fqn, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert_same_bytes(loaded[fqn], value, f"{what}: {fqn}")
            else:
                assert loaded[fqn] == value, f"{what}: {fqn}"
    assert verdicts["valid"] >= 10 and verdicts["invalid"] >= 30, verdicts
