"""Shared test fixtures: the bundled checkpoints, torch's own reference output, byte compare.

Real checkpoints only: `fixtures/` holds checkpoints written by torch's `dcp.save` from FSDP2
runs (see fixtures/generate.py); tests that need other layouts write them once per session.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
FIXTURE_NAMES = ("fsdp2_world2", "fsdp2_world2_adamw", "fsdp2_world2_bf16", "fsdp2_world3_uneven")

sys.path.insert(0, str(Path(__file__).resolve().parent))


# The longest module (`--durations`: its seeded soak alone ~150 s on a loaded machine), started
# first: the worker that draws it has the rest of the run to even out, instead of the run
# ending with one worker idle while the other soaks. Its tests stay together (one soak).
FIRST = ("tests/test_soak.py::",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))  # stable: the rest keep their order


# CI sets it (README's test command): a C module that was not built fails its tests instead of
# skipping them, so an install that silently fell back to Python (no compiler) is seen
REQUIRE_NATIVE = "CKPTTOOL_REQUIRE_NATIVE"


def import_native(name: str):
    """Return the C module `name` (`ckpttool.readers._dcpscan`, `ckpttool.torchsave._records`);
    skip when it was not built (no compiler at install), or fail with CKPTTOOL_REQUIRE_NATIVE set."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        message = f"the C module {name} is not built (no compiler at install?): {error}"
        if os.environ.get(REQUIRE_NATIVE, "").lower() not in ("", "0", "false"):
            pytest.fail(f"{message}; {REQUIRE_NATIVE} is set, so the C modules must be built", pytrace=False)
        pytest.skip(f"{message}; set {REQUIRE_NATIVE}=1 to make this a failure", allow_module_level=True)


@pytest.fixture(params=FIXTURE_NAMES)
def fixture_checkpoint(request) -> Path:
    """Each bundled checkpoint in turn (read-only: copy it before corrupting)."""
    return FIXTURES / request.param


_reference_cache: dict[Path, dict] = {}


def torch_reference(checkpoint: Path, tmp_root: Path) -> dict:
    """Return torch's own `dcp_to_torch_save` result for a checkpoint, flattened to fqn -> value."""
    checkpoint = Path(checkpoint).resolve()
    if checkpoint not in _reference_cache:
        import torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        out = tmp_root / f"reference-{len(_reference_cache)}.pt"
        dcp_to_torch_save(checkpoint, out)
        _reference_cache[checkpoint] = flatten(torch.load(out, weights_only=False))  # we wrote it
    return _reference_cache[checkpoint]


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """`reference(path)` -> {fqn: tensor or object} as torch's dcp_to_torch_save produces it."""
    root = tmp_path_factory.mktemp("reference")
    return lambda checkpoint: torch_reference(checkpoint, root)


def flatten(state, prefix: str = "") -> dict:
    """Flatten nested dicts the way DCP names entries (`a.b.c`, list items by index when the
    list holds dicts, as in `optim.param_groups.0.lr`); other lists stay values."""
    items = state.items() if isinstance(state, dict) else enumerate(state)
    flat = {}
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, dict) or (isinstance(value, list) and any(isinstance(v, dict) for v in value)):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def tensor_bytes(tensor) -> bytes:
    """Raw row-major bytes of a tensor (any dtype, including bf16 and 0-d)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def assert_same_bytes(actual, expected, name: str = "") -> None:
    """Assert two tensors have the same dtype, shape and raw bytes (never allclose)."""
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert tensor_bytes(actual) == tensor_bytes(expected), f"{name}: bytes differ"


def built_once(tmp_path_factory, name: str, build: Callable[[Path], Path]) -> Path:
    """Return `build(directory)` for a new directory, built once for the whole run. Under
    pytest-xdist the first worker to ask builds it in the run's temporary root (above each
    worker's own) while the other waits on a file lock, then both read it (read-only); the
    path is recorded only once `build` returned, so a failed build is tried again."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return build(tmp_path_factory.mktemp(name))
    from filelock import FileLock  # a dependency of torch

    shared = tmp_path_factory.getbasetemp().parent  # this run's, made by the xdist controller
    record = shared / f"{name}.path"
    with FileLock(str(shared / f"{name}.lock")):
        if not record.exists():
            built = build(Path(tempfile.mkdtemp(prefix=f"{name}-", dir=shared)))
            record.write_text(str(built))
        return Path(record.read_text())


@pytest.fixture(scope="session")
def trainer_checkpoint(tmp_path_factory):
    """`trainer_checkpoint(*args, nproc=2)` -> the last step directory of a tiny 2-step run of
    the real trainer (`trainer_runs.run_trainer`) with `args`, run once per session for every
    file that asks for the same run (read-only: copy it before changing it). Safe to call from
    several threads at once, and from both xdist workers (`built_once`): a second caller of
    a run in progress waits for it."""
    from trainer_runs import latest_step, run_trainer

    runs: dict[tuple, Future] = {}
    lock = threading.Lock()

    def get(*args, nproc: int = 2) -> Path:
        key = (tuple(str(arg) for arg in args), nproc)
        with lock:
            started = key in runs
            future = runs.setdefault(key, Future())
        if not started:
            try:
                readable = "-".join(a.strip("-").replace("/", "_") for a in key[0])[:40]
                name = f"trainer-{readable}-{hashlib.sha1(repr(key).encode()).hexdigest()[:8]}"  # one name a run
                future.set_result(built_once(tmp_path_factory, name,
                                             lambda directory: latest_step(run_trainer(directory, *args, nproc=nproc))))
            except BaseException as error:
                future.set_exception(error)
        return future.result()

    return get


@pytest.fixture(scope="session")
def block_tied_buffers(tmp_path_factory) -> Path:
    """What the trainer does not write, saved once per session by torch's own dcp.save on 4 real
    gloo ranks (`dcp_world._layouts_rank`: 2-D block sharding, a tied head, int/bool buffers, a
    0-d bf16 tensor); test_consolidate.py and test_manifest.py read it (read-only), under
    xdist from either worker (`built_once`)."""
    from dcp_world import write_layouts_forked

    return built_once(tmp_path_factory, "layouts", lambda directory: write_layouts_forked(directory / "block_tied_buffers"))


@pytest.fixture(scope="module")
def run():
    """`run("inspect", path, "--json")` -> click Result, in-process; one runner per test module
    (for module-scoped fixtures that run the CLI once)."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    runner = CliRunner()
    return lambda *args: runner.invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def cli():
    """Run the ckpttool CLI in-process: `cli("inspect", path, "--json")` -> click Result."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    runner = CliRunner()

    def run(*args):
        return runner.invoke(main, [str(a) for a in args], catch_exceptions=False)

    return run


def save_with_writer_options(path: Path, writer_options: str) -> dict:
    """Write a small state with torch's own dcp.save in one of its other blob formats and
    return the state: "safetensors" (SerializationFormat.SAFETENSORS) or "zstd" (the
    ZStandard extension: blobs that must be decoded); skips without zstandard."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    if writer_options == "zstd":
        pytest.importorskip("zstandard")
        from torch.distributed.checkpoint._extension import ZStandard

        options = {"_extensions": [ZStandard()]}
    else:
        options = {"serialization_format": SerializationFormat.SAFETENSORS}
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(7, 5), "b": torch.randn(5).to(torch.bfloat16), "i": torch.arange(4),
                       "s": torch.tensor(3.0)}, "extra": {"step": 3}}
    dcp.save(state, storage_writer=FileSystemWriter(path, **options), no_dist=True)
    return state
