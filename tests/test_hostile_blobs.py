"""Hostile data files: a tiny compressed blob must never expand to GBs, in any command.

Each checkpoint is a real one written by torch's `dcp.save`, then one blob is swapped for a
bomb (zstd-compressed as torch's ZStandard extension marks it, or a record with a deflated
entry): the metadata points at bytes appended to the data file, rewritten with
torch's own metadata classes and pickle.dump, as a hostile writer would. Every command runs
as a subprocess bounded in time (30 s: torch is imported to decode zstd tensors); its peak RSS (the child's own `ru_maxrss`) stays small.
"""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
import zipfile

import pytest

from test_reader import save_single_process

zstandard = pytest.importorskip("zstandard")

BOMB_BYTES = 96 << 20  # what each bomb expands to: beyond what any of its entries may hold (64 MiB)
MAX_RSS = 200 << 20
COMMANDS = [
    ("validate", "--deep"),
    ("consolidate", "{out}/m.safetensors"),
    ("consolidate", "{out}/all.pt", "--all"),
    ("reshard", "{out}/w2", "--world", "2"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import torch

    path = tmp_path_factory.mktemp("plain") / "ckpt"
    state = {"model": {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8)}, "extra": {"note": "hello"}}
    save_single_process(path, state)
    return path


def with_bomb(source, target, fqn: str, bomb: bytes, transforms) -> None:
    """Copy `source` to `target` with entry `fqn`'s blob replaced by `bomb` (appended to its file)."""
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    shutil.copytree(source, target)
    metadata = FileSystemReader(target).read_metadata()
    key = next(k for k in metadata.storage_data if k.fqn == fqn)
    info = metadata.storage_data[key]
    data_file = target / info.relative_path
    info.offset, info.length = data_file.stat().st_size, len(bomb)
    info.transform_descriptors = transforms
    with open(data_file, "ab") as handle:
        handle.write(bomb)
    with open(target / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)


def zstd_bomb() -> bytes:
    compressor = zstandard.ZstdCompressor(level=1).compressobj()
    zeros = bytes(16 << 20)
    return b"".join([*(compressor.compress(zeros) for _ in range(BOMB_BYTES // len(zeros))), compressor.flush()])


def deflate_bomb() -> bytes:
    """A torch.save-shaped zip whose data.pkl is deflated: 96 MB of pickle in ~100 kB."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02" + b"N" * BOMB_BYTES + b".")
        archive.writestr("archive/version", b"3\n", compress_type=zipfile.ZIP_STORED)
    return buffer.getvalue()


def run(*args) -> tuple[int, str, int]:
    code = ("import resource, subprocess, sys; "
            "p = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=30); "
            "sys.stderr.write(p.stderr); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(p.returncode)")
    result = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "ckpttool", *args],
                            capture_output=True, text=True, timeout=60)
    return result.returncode, result.stderr, int(result.stdout.strip() or 0) * 1024


@pytest.mark.parametrize("bomb_name, fqn", [("zstd tensor chunk", "model.w"), ("zstd object", "extra.note"),
                                             ("deflated record entry", "extra.note")])
def test_a_compression_bomb_is_refused_by_every_command_in_bounded_time_and_memory(checkpoint, tmp_path,
                                                                                   bomb_name, fqn):
    if bomb_name == "deflated record entry":
        bomb, transforms = deflate_bomb(), None
    else:
        bomb, transforms = zstd_bomb(), ["stream.zstd/1"]
    path = tmp_path / "bomb"
    with_bomb(checkpoint, path, fqn, bomb, transforms)
    for position, command in enumerate(COMMANDS):
        out = tmp_path / f"out{position}"
        args = [part.format(out=out) for part in command]
        status, stderr, rss = run(args[0], str(path), *args[1:], "--quiet" if args[0] != "validate" else "--json")
        relevant = fqn == "model.w" or "--all" in command or command[0] == "validate"
        if relevant:
            assert status == 1, (command, stderr)
            assert "Traceback" not in stderr
        assert rss < MAX_RSS, (command, rss)
        assert not out.exists() or status == 0  # nothing half-written, no parent left behind


def record_with(pickled: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickled)
        archive.writestr("archive/version", b"3\n")
    return buffer.getvalue()


@pytest.mark.parametrize("name, pickled", [
    ("1 MB of nested tuples", b"\x80\x02" + b"(" * 500_000 + b")" + b"t" * 500_000 + b"."),
    ("huge memo index", b"\x80\x02N" + b"r\xff\xff\xff\x7f" + b"."),
])
def test_an_object_blob_that_breaks_the_unpicklers_budget_is_refused_not_handed_to_torch(name, pickled):
    import time

    from ckpttool.dcp.blobs import decode_object
    from ckpttool.core.errors import CorruptBlob

    started = time.perf_counter()
    with pytest.raises(CorruptBlob):
        decode_object(record_with(pickled), f"blob {name}")
    assert time.perf_counter() - started < 5
