"""A crafted `.metadata` never crashes, hangs or costs much memory: every command refuses it in
one line, well within 10 s and 200 MB, and nothing from it runs.

The hostile files are written here, in tmp_path: deep nesting (a MB of nested tuples, lists,
dicts), shared references that unfold to 2**200 (hash and repr bombs), a 9-byte memo bomb, an
out-of-range GET, a billion-laughs list, colliding dict keys, a sparse 5 GB file, a FIFO and a
pickle that would run `posix.system`. The same pickles, as a torch.save record's `data.pkl`,
go through `RestrictedUnpickler` with a tiny allowlist.
"""

from __future__ import annotations

import io
import os
import signal
import pickle
import re
import struct
import subprocess
import sys
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ckpttool.core.checkpoint import Checkpoint, paused_gc
from ckpttool.formats.dcp import METADATA_FILENAME
from ckpttool.readers.dcp import _convert, read_checkpoint
from ckpttool.safepickle import PickleRefused, RestrictedUnpickler
from ckpttool.safepickle.allowlist import _ALLOWED, _find_allowed
from ckpttool.safepickle.loader import MAX_NESTING, _Loader
from ckpttool.safepickle.nodes import _Fallback
from ckpttool.core.errors import CorruptMetadata, UnsafeMetadata

from conftest import FIXTURES, FIXTURE_NAMES

TIMEOUT_S = 10
MAX_RSS_MB = 200


# ---------------------------------------------------------------------------------------------
# Hostile pickles


def _get(slot: int) -> bytes:
    return b"h" + bytes([slot]) if slot < 256 else b"j" + struct.pack("<I", slot)


def deep_tuples() -> bytes:
    """A MB of TUPLE1: a million nested tuples, whose hash recursed in C until it segfaulted."""
    return b"\x80\x04N" + b"\x85" * (1 << 20) + b"."


def deep_lists() -> bytes:
    return b"\x80\x02" + b"(" * (1 << 19) + b"N" + b"l" * (1 << 19) + b"."


def deep_dicts() -> bytes:
    return b"\x80\x02" + b"(K\x01" * (1 << 18) + b"N" + b"d" * (1 << 18) + b"."


def shared_halves(levels: int = 200) -> bytes:
    """x = (m, m), m2 = (x, x), ...: 1 KB that unfolds to 2**200, then hashed as a dict key."""
    out = bytearray(b"\x80\x04N\x94")
    for level in range(levels):
        out += _get(level) * 2 + b"\x86\x94"
    return bytes(out + b"}" + _get(levels) + b"Ns.")


def memo_bomb() -> bytes:
    """9 bytes: a LONG_BINPUT to slot 2**31 - 1 made the C unpickler grow its memo to gigabytes."""
    return b"\x80\x02Nr\xff\xff\xff\x7f."


def far_get() -> bytes:
    return b"\x80\x02j\xff\xff\xff\x7f."


def billion_laughs(levels: int = 12, width: int = 10) -> bytes:
    """Each list holds the previous one ten times: 10**12 strings when walked."""
    out = bytearray(b"\x80\x04\x8c\x03lol\x94")
    for level in range(levels):
        out += b"](" + _get(level) * width + b"e\x94"
    return bytes(out + b".")


def colliding_keys(count: int = 20_000) -> bytes:
    """A dict whose int keys all hash alike (k * (2**61 - 1)): quadratic to build."""
    out = bytearray(b"\x80\x02}(")
    for k in range(1, count + 1):
        encoded = pickle.encode_long(k * ((1 << 61) - 1))
        out += b"\x8a" + bytes([len(encoded)]) + encoded + b"N"
    return bytes(out + b"u.")


def huge_bytes() -> bytes:
    """BINBYTES8 claiming 2**40 bytes: the C unpickler allocated the claim before reading."""
    return b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b"."


def runs_code(marker: Path) -> bytes:
    command = f"touch {marker}".encode()
    return b"\x80\x02cposix\nsystem\nX" + struct.pack("<I", len(command)) + command + b"\x85R."


PICKLES = {
    "deep-tuples": deep_tuples,
    "deep-lists": deep_lists,
    "deep-dicts": deep_dicts,
    "shared-halves": shared_halves,
    "memo-bomb": memo_bomb,
    "far-get": far_get,
    "billion-laughs": billion_laughs,
    "colliding-keys": colliding_keys,
    "huge-bytes": huge_bytes,
}


def hostile_checkpoint(root: Path, case: str) -> Path:
    """Write the checkpoint directory of one hostile case under `root` and return it."""
    checkpoint = root / case
    checkpoint.mkdir()
    path = checkpoint / METADATA_FILENAME
    if case in PICKLES:
        path.write_bytes(PICKLES[case]())
    elif case == "runs-code":
        path.write_bytes(runs_code(root / "MARKER"))
    elif case == "sparse-5gb":
        with open(path, "wb") as handle:
            handle.write(b"\x80\x04")
        os.truncate(path, 5 << 30)  # no disk used
    elif case == "fifo":
        os.mkfifo(path)
    else:
        raise AssertionError(case)
    return checkpoint


CASES = [*PICKLES, "runs-code", "sparse-5gb", "fifo"]
FULL = ("deep-tuples", "shared-halves", "memo-bomb", "runs-code")  # cases every command reads
COMMANDS = {
    "inspect": lambda src, out: ["inspect", src],
    "validate": lambda src, out: ["validate", src],
    "validate-deep": lambda src, out: ["validate", "--deep", src],
    "consolidate-safetensors": lambda src, out: ["consolidate", src, f"{out}.safetensors"],
    "consolidate-dir": lambda src, out: ["consolidate", src, str(out)],
    "consolidate-pt-all": lambda src, out: ["consolidate", src, f"{out}.pt", "--all"],
    "reshard": lambda src, out: ["reshard", src, str(out), "--world", "2"],
    "diff": lambda src, out: ["diff", src, src],
    "export": lambda src, out: ["export", src, str(out)],
    "push-dry-run": lambda src, out: ["push", src, "me/model", "--dry-run"],
}


# A fresh, small interpreter starts the command and reports the command's own peak RSS: a
# child forked straight from pytest would count pytest's resident pages (torch, once another
# test imported it) in its ru_maxrss.
_MEASURE = ("import os, subprocess, sys\n"
            "process = subprocess.Popen(sys.argv[2:])\n"
            "_, status, usage = os.wait4(process.pid, 0)\n"
            "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
            "sys.exit(os.waitstatus_to_exitcode(status))\n")


def run_cli(args: list[str], cwd: Path, timeout: float = TIMEOUT_S) -> tuple[int, str, str, float, float]:
    """Run `python -m ckpttool ARGS`, killed after `timeout` seconds; return (exit code, stdout,
    stderr, seconds, peak RSS MB)."""
    stdout_path, stderr_path, rss_path = cwd / "stdout.txt", cwd / "stderr.txt", cwd / "rss.txt"
    with open(stderr_path, "wb") as stderr, open(stdout_path, "wb") as stdout:
        started = time.monotonic()
        process = subprocess.Popen([sys.executable, "-c", _MEASURE, str(rss_path), sys.executable, "-m", "ckpttool", *args],
                                   stdout=stdout, stderr=stderr, cwd=cwd, start_new_session=True)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        elapsed = time.monotonic() - started
    output = stdout_path.read_text(errors="replace"), stderr_path.read_text(errors="replace")
    rss_kib = int(rss_path.read_text() or 0) if rss_path.exists() else 0
    return process.returncode, *output, elapsed, rss_kib / 1024


# ---------------------------------------------------------------------------------------------
# Every command refuses each hostile checkpoint in one line, in time and memory


@pytest.mark.parametrize("case", CASES)
def test_every_command_refuses_a_hostile_metadata_in_one_line_within_10s_and_200mb(tmp_path, case):
    checkpoint = hostile_checkpoint(tmp_path, case)
    commands = list(COMMANDS) if case in FULL else ["inspect", "validate"]  # every command on a few
    runs = {}
    for command in commands:
        (tmp_path / command).mkdir()
    with ThreadPoolExecutor(max_workers=2) as pool:  # the two cores
        for command in commands:
            work = tmp_path / command
            runs[command] = pool.submit(run_cli, COMMANDS[command](str(checkpoint), work / "out"), work)
    for command, run in runs.items():
        code, stdout, stderr, elapsed, rss = run.result()
        assert code in (1, 2), (command, code, stderr)
        assert elapsed < TIMEOUT_S, command
        assert rss < MAX_RSS_MB, f"{command}: peak RSS {rss:.0f} MB"
        assert "Traceback" not in stdout + stderr, command
        assert len(stderr.strip().splitlines()) <= 1, (command, stderr)
        # the refusal is one line naming the file (on stderr, or in validate's report)
        path = str(checkpoint / METADATA_FILENAME)
        assert len([line for line in (stdout + stderr).splitlines() if path in line]) == 1, (command, stdout + stderr)
        assert sorted(p.name for p in (tmp_path / command).iterdir()) == ["rss.txt", "stderr.txt", "stdout.txt"], command
    assert not (tmp_path / "MARKER").exists()


# ---------------------------------------------------------------------------------------------
# The reader, in process


@pytest.mark.parametrize("case", CASES)
def test_read_checkpoint_refuses_each_hostile_metadata_with_a_one_line_error_naming_the_file(tmp_path, case):
    checkpoint = hostile_checkpoint(tmp_path, case)
    started = time.monotonic()
    with pytest.raises((CorruptMetadata, UnsafeMetadata)) as raised:
        read_checkpoint(checkpoint)
    assert time.monotonic() - started < 5
    message = str(raised.value)
    assert "\n" not in message and len(message) < 600
    assert str(checkpoint / METADATA_FILENAME) in message
    assert not (tmp_path / "MARKER").exists()


@pytest.mark.parametrize(
    "case, says",
    [
        ("deep-tuples", "nest deeper than 16 levels"),
        ("deep-lists", "nest deeper than 16 levels"),
        ("deep-dicts", "nest deeper than 16 levels"),
        ("shared-halves", "unfolds to more than"),
        ("billion-laughs", "unfolds to more than"),
        ("memo-bomb", "LONG_BINPUT to memo slot 2147483647, but only 0 are filled"),
        ("far-get", "GET of memo slot 2147483647, but only 0 are filled"),
        ("colliding-keys", "more than 4096 int, float or tuple dict keys"),
        ("huge-bytes", "BINBYTES8 of 1099511627776 bytes runs past the end"),
        ("runs-code", "refuses to load `posix.system`"),
        ("sparse-5gb", "5368709120 bytes is implausibly large"),
        ("fifo", "a FIFO, not a regular file"),
    ],
)
def test_the_error_says_which_budget_or_rule_the_metadata_breaks(tmp_path, case, says):
    with pytest.raises((CorruptMetadata, UnsafeMetadata), match=re.escape(says)):
        read_checkpoint(hostile_checkpoint(tmp_path, case))


def test_a_metadata_that_is_a_directory_is_refused_as_not_a_regular_file(tmp_path):
    (tmp_path / METADATA_FILENAME).mkdir()
    with pytest.raises(CorruptMetadata, match="a directory, not a regular file"):
        read_checkpoint(tmp_path)


def test_metadata_nested_as_deep_as_the_budget_allows_is_read_but_one_level_more_is_refused():
    def nested(depth: int) -> bytes:
        return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."

    loader = _Loader(nested(MAX_NESTING), None, build=True)
    value = loader.load()
    for _ in range(MAX_NESTING - 1):
        value = value[0]
    assert value == []
    with pytest.raises(PickleRefused, match="nest deeper"):
        _Loader(nested(MAX_NESTING + 1), None, build=True).load()


# ---------------------------------------------------------------------------------------------
# The same pickles as a torch.save record's data.pkl


TINY_ALLOWLIST = {("collections", "OrderedDict"): dict}


@pytest.mark.parametrize("case", list(PICKLES))
def test_restricted_unpickler_refuses_each_hostile_data_pkl_in_bounded_time(case):
    data = PICKLES[case]()
    started = time.monotonic()
    with pytest.raises((PickleRefused, UnsafeMetadata)):
        RestrictedUnpickler(io.BytesIO(data), TINY_ALLOWLIST, "x/data.pkl", persistent=lambda pid: pid).load()
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("case", ["memo-bomb", "far-get", "huge-bytes", "shared-halves", "billion-laughs"])
def test_restricted_unpickler_refuses_a_small_memory_bomb_without_allocating(case):
    data = PICKLES[case]()
    tracemalloc.start()
    try:
        with pytest.raises(PickleRefused):
            RestrictedUnpickler(io.BytesIO(data), TINY_ALLOWLIST, "x/data.pkl").load()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak >> 20} MB for a {len(data)}-byte pickle"


def test_restricted_unpickler_refuses_code_in_a_data_pkl_and_runs_nothing(tmp_path):
    marker = tmp_path / "MARKER"
    with pytest.raises(UnsafeMetadata, match="posix.system"):
        RestrictedUnpickler(io.BytesIO(runs_code(marker)), TINY_ALLOWLIST, "x/data.pkl").load()
    assert not marker.exists()


def test_restricted_unpickler_still_reads_plain_values_and_persistent_ids():
    class Persistent:
        def __reduce__(self):
            return (dict, ())

    value = {"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1, 2], "name": b"adam", "on": True, "n": None}
    for protocol in (3, 4, 5):
        assert RestrictedUnpickler(io.BytesIO(pickle.dumps(value, protocol)), TINY_ALLOWLIST, "x").load() == value
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, 2)
    pickler.persistent_id = lambda obj: ("storage", 7) if isinstance(obj, Persistent) else None
    pickler.dump([Persistent(), 3])
    loaded = RestrictedUnpickler(io.BytesIO(buffer.getvalue()), TINY_ALLOWLIST, "x", persistent=lambda pid: pid).load()
    assert loaded == [("storage", 7), 3]


# ---------------------------------------------------------------------------------------------
# The loader's fast paths build what the opcode-by-opcode path builds


def _find_class(module: str, name: str):
    return _find_allowed(_ALLOWED, "x", module, name)


def _read(checkpoint: Path, fast: bool) -> tuple[Checkpoint, int, int, int]:
    """Return the checkpoint read with or without the loader's fast paths, and the objects,
    work and memo slots the loader counted."""
    loader = _Loader((checkpoint / METADATA_FILENAME).read_bytes(), _find_class, build=True)
    if not fast:
        loader.records = None
    with paused_gc():
        converted = _convert(checkpoint, checkpoint / METADATA_FILENAME, loader.load())
    return converted, loader.objects, loader.work, len(loader.memo)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fast_paths_give_the_same_checkpoint_and_budgets_as_the_opcode_by_opcode_path(name):
    fast, slow = _read(FIXTURES / name, fast=True), _read(FIXTURES / name, fast=False)
    assert fast[0] == slow[0]
    assert fast[1:] == slow[1:]  # objects, work and memo slots spent alike


def test_a_record_fetched_again_from_the_memo_is_read_by_the_general_path(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )

    # one chunk object in two tensors: pickle writes the second as a GET of the first, whose
    # memo slot the fast path did not keep
    shared = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))
    state, storage = {}, {}
    for i, fqn in enumerate(["model.a", "model.b", "model.c"]):
        chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4])) if i == 0 else shared
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]), [chunk])
        storage[MetadataIndex(fqn, torch.Size([0]))] = _StorageInfo("__0_0.distcp", 16 * i, 16)
    data = pickle.dumps(Metadata(state, storage_data=storage))
    (tmp_path / METADATA_FILENAME).write_bytes(data)
    with pytest.raises(_Fallback):
        _Loader(data, _find_class, build=True).load()
    checkpoint = read_checkpoint(tmp_path)
    assert [t.chunks[0].blob.offset for t in checkpoint.tensors.values()] == [0, 16, 32]
