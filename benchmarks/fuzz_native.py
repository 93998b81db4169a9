"""Fuzz ckpttool's C modules, `_dcpscan` and `_records`, built with sanitizers (`.ci/sanitize`).

    python benchmarks/fuzz_native.py seeds DIR [--mapped]
    python benchmarks/fuzz_native.py run --build DIR --seeds DIR [--count 6000] [--seed 0] [--workers 2] [--only N]

`seeds` (no sanitizer; imports torch) writes the seed `.metadata` files: a varied state dict
saved by torch's own `dcp.save` (0-d to 5-d tensors, 10 dtypes, empty tensors, optimizer
state, bytes entries), the same Metadata pickled at protocols 2 and 5 and without memo PUTs
(`pickletools.optimize`), and "grown" ones past the size at which readers/dcp.py builds chunk
tables from the scanned columns (COLUMNS_FROM_BYTES, 2 MiB): torch's Metadata of that save with
its tensors copied under enough names (~450 copies) and split into 1 to 4 chunks on 4 ranks' files, pickled as
torch's FileSystemWriter pickles it (`pickle.dump`); with `--mapped`, one padded past
MAP_METADATA_BYTES (64 MiB), where the reader maps the file and the C reader hands pages back
(`release`). The repository's fixtures/**/.metadata (real FSDP, torchtitan, Megatron, ...
saves) are seeds too, when there.

`run` loads the two extension modules straight from the .so files in --build (importlib: no
ckpttool Python is imported, so this file does not follow the package's modules as they move)
and calls them with seeded inputs:

- scan: a seed with one to three mutations: bytes set or bit-flipped, truncation, length and
  size fields inflated or shrunk (strings, FRAME, LONG1, memo slots), ints set to edge values,
  opcodes dropped, doubled or swapped, runs of opcodes deleted or repeated (whole records),
  strings swapped for others of the file, opcode snippets spliced, ranges of another seed
  spliced in; most get their FRAME lengths set to what each frame then holds (else any
  truncated protocol-4 pickle ends the scan at its first FRAME). Half are of the seeds past
  2 MiB. Accepted results are checked against the invariants readers/columns.py indexes by.
- encode_rows, assemble, spans, match (`_records`), json_rows and file_sums (`_dcpscan`):
  random columns and layouts, in range and past it (edge ints, strided and aliased arrays,
  wrong dtypes and lengths), compared with a reference written here in Python from each
  function's documented contract (pickle's own int encoding, hashlib's BLAKE2b, zlib's CRC-32).

Every input is a function of (--seed, its number) alone: `--only N` runs input N in this
process. Workers are forked; one dying (a sanitizer report aborts it) is a failure, its input
is written to --out for replay. Exit status: 0 clean; 1 a worker died, a call raised what it
must not, or a result broke an invariant or differed from the reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.machinery
import importlib.util
import json
import mmap
import os
import pickle
import pickletools
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
import zlib
from collections import Counter
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
METADATA_FILENAME = ".metadata"  # torch's FileSystemWriter
COLUMNS_FROM_BYTES = 2 << 20  # readers/dcp.py: from here the scanned columns become chunk tables
MAP_METADATA_BYTES = 64 << 20  # readers/dcp.py: from here the file is mapped and scanned with mapped=True
# the C reader hands pages back once its cursor is 2 * 32 MiB past the last release (`release`)
MAPPED_SEED_BYTES = MAP_METADATA_BYTES + (8 << 20)
GROWN_SEED_BYTES = COLUMNS_FROM_BYTES + (256 << 10)  # the grown seeds: just past the tables' threshold

# the dtypes `scan` is given (readers/dcp.py's KNOWN_DTYPES: the names of core/dtypes.py's ITEMSIZE)
DTYPES = frozenset({
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32", "int64", "int32", "int16",
    "int8", "uint64", "uint32", "uint16", "uint8", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "float8_e8m0fnu",
})

EDGE_INTS = (0, 1, 0xFF, 0x100, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, -1, -0x80000000, -0x80000001,
             (1 << 55) - 1, 1 << 55, (1 << 63) - 1, -(1 << 63), -(1 << 55), 1 << 40, -(1 << 40))

# opcode snippets spliced into mutants: structure, memo and size edge cases
SNIPPETS = (
    b"(", b")", b"]", b"}", b"t", b"l", b"d", b"e", b"a", b"u", b"s", b"b", b"R", b"\x81", b"\x85", b"\x86",
    b"\x87", b"\x93", b"\x94", b"N", b"0", b"1", b"2", b".", b"\x88", b"\x89", b"h\x00", b"h\xff",
    b"j\x00\x00\x00\x00", b"j\xff\xff\xff\x7f", b"q\x00", b"q\xff", b"r\xff\xff\xff\x7f", b"K\xff",
    b"J\xff\xff\xff\xff", b"M\xff\xff", b"\x8a\x08" + b"\xff" * 8, b"\x8a\x09" + b"\x01" * 9, b"\x8a\x00",
    b"\x8c\xff", b"\x8c\x00", b"X\xff\xff\xff\x7f", b"\x95" + b"\xff" * 8, b"\x95" + b"\x00" * 8,
    b"\x80\x05", b"\x80\x02", b"\x8c\x05torch\x8c\x04Size\x93", b"\x8c\x05torch\x8c\x07float32\x93",
    b"ctorch\nSize\n", b"\x8c\x07offsets", b"\x8c\x05sizes", b"\x8c\x06chunks", b"\x8c\x03fqn",
    b"\x8c\x06offset", b"\x8c\x06length", b"\x8c\x0drelative_path", b"\x8c\x04\xff\xfe\xfd\xfc",
    b"(" * 64, b"K\x01" * 70 + b"t", b"\x8c\x01a" * 5,
)

# the width of the argument each opcode carries up front: a length, a memo slot or an int
ARGUMENT_WIDTHS = {
    0x8C: 1, ord("C"): 1, ord("X"): 4, ord("B"): 4, 0x8D: 8, 0x8E: 8, 0x96: 8, 0x95: 8, 0x8A: 1, 0x8B: 4,
    ord("q"): 1, ord("r"): 4, ord("h"): 1, ord("j"): 4, ord("K"): 1, ord("M"): 2, ord("J"): 4,
}


# ---- seeds (no sanitizer: torch's own dcp.save) ----

def write_seeds(out: Path, mapped: bool) -> None:
    """Write the seed `.metadata` files into `out` (see the module docstring)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

    import warnings
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # dcp.save in one process
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    state = {
        "model": {
            "embed.weight": torch.randn(13, 8, generator=generator),
            "norm.weight": torch.ones(8, dtype=torch.bfloat16),
            "scale": torch.tensor(3.0),
            "empty": torch.zeros(0, 4),
            "conv.weight": torch.zeros(2, 3, 2, 2, dtype=torch.float16),
            "deep": torch.zeros(1, 2, 1, 2, 1, dtype=torch.float64),
            "ids": torch.arange(5),
            "mask": torch.ones(3, dtype=torch.bool),
            "bytes": torch.zeros(6, dtype=torch.uint8),
            "small": torch.zeros(2, 2, dtype=torch.int8),
            "counts": torch.zeros(4, dtype=torch.int32),
            "complex": torch.zeros(2, dtype=torch.complex64),
        },
        "optim": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.zeros(13, 8)}},
                  "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": [0]}]},
        "extra": {"note": "a string", "blob": b"\x00\x01", "epoch": 3},
    }
    with tempfile.TemporaryDirectory(prefix="fuzz-native-save-") as directory:
        dcp.save(state, checkpoint_id=directory)
        data = (Path(directory) / METADATA_FILENAME).read_bytes()
    metadata = pickle.loads(data)  # the file torch just wrote; FileSystemReader.read_metadata does this
    (out / "dcp_save.metadata").write_bytes(data)
    (out / "dcp_save_protocol2.metadata").write_bytes(pickle.dumps(metadata, protocol=2))
    (out / "dcp_save_protocol5.metadata").write_bytes(pickle.dumps(metadata, protocol=5))
    (out / "dcp_save_no_memo.metadata").write_bytes(pickletools.optimize(data))

    # grown past COLUMNS_FROM_BYTES: each tensor under many names, split in dim 0 over 4 ranks' files
    def grown(copies: int) -> Any:
        tensors, storage, planner = {}, {}, {}
        entries: list[tuple[int, Any, Any]] = []  # (rank, index, info), written rank by rank as FSDP saves do
        for copy in range(copies):
            for fqn, value in metadata.state_dict_metadata.items():
                name = f"layers.{copy}.{fqn}"
                planner[name] = ("layers", str(copy), *metadata.planner_data.get(fqn, (fqn,)))
                if not isinstance(value, TensorStorageMetadata):
                    tensors[name] = value
                    entries.append((0, MetadataIndex(name), _StorageInfo("__0_0.distcp", 64 * copy, 5)))
                    continue
                size = tuple(value.size)
                rows = size[0] if size else 0
                parts = 1 if rows < 2 else min(rows, 1 + copy % 4)
                chunks = []
                for part in range(parts):
                    start, stop = rows * part // parts, rows * (part + 1) // parts
                    offsets = torch.Size((start,) + (0,) * (len(size) - 1)) if size else torch.Size(())
                    sizes = torch.Size((stop - start,) + size[1:]) if size else torch.Size(())
                    chunks.append(ChunkStorageMetadata(offsets, sizes))
                    info = _StorageInfo(f"__{part}_0.distcp", 4096 * copy + 8 * part, 8 * (stop - start))
                    entries.append((part, MetadataIndex(name, offsets, part), info))
                # its own properties and torch.Size, as each tensor of a save has (a fetched Size is declined)
                tensors[name] = dataclasses.replace(value, properties=dataclasses.replace(value.properties),
                                                    size=torch.Size(size), chunks=chunks)
        for _, index, info in sorted(entries, key=lambda entry: entry[0]):
            storage[index] = info
        return dataclasses.replace(metadata, state_dict_metadata=tensors, planner_data=planner, storage_data=storage)

    trial = len(pickle.dumps(grown(16)))
    large = grown(-(-16 * GROWN_SEED_BYTES // trial))
    for name, protocol in (("dcp_grown.metadata", pickle.DEFAULT_PROTOCOL), ("dcp_grown_protocol2.metadata", 2)):
        data = pickle.dumps(large, protocol=protocol)  # FileSystemWriter.finish: pickle.dump(metadata, file)
        assert len(data) > COLUMNS_FROM_BYTES, (name, len(data))
        (out / name).write_bytes(data)
    if mapped:  # padded past MAP_METADATA_BYTES: planner entries of long names before the storage entries
        padding = dict(large.planner_data)
        for number in range(MAPPED_SEED_BYTES // (1 << 20)):
            padding[f"padding.{number}." + "x" * (1 << 20)] = ("padding", str(number))
        data = pickle.dumps(dataclasses.replace(large, planner_data=padding))
        assert len(data) > MAPPED_SEED_BYTES
        (out / "dcp_grown_mapped.metadata").write_bytes(data)
    for path in sorted(out.iterdir()):
        print(f"  seed {path.name}: {path.stat().st_size} bytes")


# ---- the modules under test ----

def load_extension(build: Path, name: str) -> Any:
    """Return the extension module `name` from its .so file in `build` (not from the package)."""
    found = sorted(build.glob(f"{name}.*.so")) or sorted(build.glob(f"{name}.so"))
    if not found:
        raise SystemExit(f"fuzz_native: no {name}*.so in {build}")
    loader = importlib.machinery.ExtensionFileLoader(name, str(found[0]))
    spec = importlib.util.spec_from_file_location(name, found[0], loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def sanitizers_loaded() -> bool:
    """Return whether this process runs with AddressSanitizer's runtime (LD_PRELOAD)."""
    with open("/proc/self/maps") as maps:
        loaded = maps.read()
    return "libasan" in loaded or "libclang_rt.asan" in loaded


# ---- seeds, read in the sanitized process ----

@dataclasses.dataclass
class Seed:
    name: str
    data: bytes
    group: str  # "small", "fixture", "past 2 MiB" (chunk tables), "mapped" (past 64 MiB)
    ops: list  # (start, end, opcode byte) of each opcode
    strings: list  # (start, end) of each SHORT_BINUNICODE
    frames: list  # (start, length) of each FRAME (protocol 4+: 8-byte length, then that many bytes)


def read_seeds(directory: Path, fixtures: bool) -> tuple[list[Seed], Path | None]:
    """Return the seeds of `directory` (and the repository's fixtures), and the mapped seed's path."""
    paths = sorted(directory.glob("*.metadata"))
    if fixtures and (ROOT / "fixtures").is_dir():
        paths += sorted((ROOT / "fixtures").rglob(METADATA_FILENAME))
    seeds, mapped = [], None
    for path in paths:
        size = path.stat().st_size
        if size >= MAP_METADATA_BYTES:
            mapped = path
            continue
        data = path.read_bytes()
        ops, strings, frames = [], [], []
        try:
            found = [(position, op.code) for op, _, position in pickletools.genops(data)]
        except Exception as error:  # not a pickle: useless as a seed
            print(f"fuzz_native: skipping {path}: {error}", file=sys.stderr)
            continue
        ends = [position for position, _ in found[1:]] + [len(data)]
        for (start, code), end in zip(found, ends):
            ops.append((start, end, ord(code)))
            if code == "\x8c":
                strings.append((start, end))
            elif code == "\x95":
                frames.append((start, int.from_bytes(data[start + 1:start + 9], "little")))
        group = "past 2 MiB" if size > COLUMNS_FROM_BYTES else "fixture" if path.is_relative_to(ROOT / "fixtures") else "small"
        seeds.append(Seed(str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name), data, group, ops,
                          strings, frames))
    return seeds, mapped


# ---- mutations of a .metadata ----

def argument_edit(seed: Seed, rng: random.Random) -> tuple[int, int, bytes, str] | None:
    """An edit of an opcode's up-front argument: a length, memo slot or int made larger, smaller or an edge value."""
    candidates = [op for op in (seed.ops[rng.randrange(len(seed.ops))] for _ in range(8)) if op[2] in ARGUMENT_WIDTHS]
    if not candidates:
        return None
    start, end, code = candidates[0]
    width = ARGUMENT_WIDTHS[code]
    if start + 1 + width > len(seed.data):
        return None
    old = int.from_bytes(seed.data[start + 1:start + 1 + width], "little")
    top = (1 << (8 * width)) - 1
    new = rng.choice((old + 1, old + rng.randint(2, 300), max(old - 1, 0), 0, top, top >> 1, (top >> 1) + 1,
                      rng.randrange(top + 1), old * 2, old ^ (1 << rng.randrange(8 * width)))) & top
    return start + 1, start + 1 + width, new.to_bytes(width, "little"), "argument"


def boundary(seed: Seed, rng: random.Random) -> int:
    return seed.ops[rng.randrange(len(seed.ops))][0]


def int_opcode(value: int) -> bytes:
    """pickle's own encoding of an int (protocol 2+: BININT1, BININT2, BININT or LONG1)."""
    return pickle.dumps(value, 2)[2:-1]


def one_edit(seed: Seed, others: list[Seed], rng: random.Random) -> tuple[int, int, bytes, str] | None:
    """One mutation of `seed` as (start, stop, new bytes, name): data[start:stop] becomes the new bytes."""
    data, ops = seed.data, seed.ops
    kind = rng.choice(("set", "set", "bits", "truncate", "truncate", "argument", "argument", "argument", "int", "drop", "double",
                       "swap", "delete-run", "repeat-run", "string", "splice", "splice", "memo", "crossover"))
    n = len(data)
    if kind == "set":
        at = rng.randrange(n)
        return at, at + 1, bytes([rng.randrange(256)]), kind
    if kind == "bits":
        at = rng.randrange(n)
        return at, at + 1, bytes([data[at] ^ (1 << rng.randrange(8))]), kind
    if kind == "truncate":  # anywhere, between opcodes, or inside an opcode's argument
        at = rng.choice((rng.randrange(n), boundary(seed, rng), min(n - 1, boundary(seed, rng) + rng.randint(1, 12))))
        return at, n, b"", kind
    if kind == "argument":
        return argument_edit(seed, rng)
    if kind == "int":
        start, end, code = ops[rng.randrange(len(ops))]
        if code not in (ord("K"), ord("M"), ord("J"), 0x8A):
            return None
        return start, end, int_opcode(rng.choice(EDGE_INTS) + rng.choice((0, 0, 1, -1))), kind
    if kind in ("drop", "double", "swap"):
        number = rng.randrange(1, len(ops) - 1)
        start, end, _ = ops[number]
        if kind == "drop":
            return start, end, b"", kind
        if kind == "double":
            return start, start, data[start:end], kind
        _, after, _ = ops[number + 1]
        return start, after, data[end:after] + data[start:end], kind
    if kind in ("delete-run", "repeat-run"):
        first = rng.randrange(1, len(ops) - 1)
        last = min(len(ops) - 1, first + rng.randint(1, 60))
        start, end = ops[first][0], ops[last][0]
        if kind == "delete-run":
            return start, end, b"", kind
        at = boundary(seed, rng) if rng.random() < 0.5 else end
        return at, at, data[start:end] * rng.choice((1, 1, 2, 30)), kind
    if kind == "string":
        if not seed.strings:
            return None
        start, end = seed.strings[rng.randrange(len(seed.strings))]
        other_start, other_end = seed.strings[rng.randrange(len(seed.strings))]
        text = data[other_start + 2:other_end]
        text = rng.choice((text, b"../" + text, text[::-1], text + b"\xff", text[:-1], b"", b"torch.strided"))[:255]
        return start, end, b"\x8c" + bytes([len(text)]) + text, kind
    if kind == "splice":
        at = boundary(seed, rng)
        return at, at, b"".join(rng.choice(SNIPPETS) for _ in range(rng.randint(1, 4))), kind
    if kind == "memo":  # a GET of another slot, a PUT of the wrong one
        start, end, code = ops[rng.randrange(len(ops))]
        if code not in (ord("h"), ord("j"), ord("q"), ord("r"), 0x94):
            return None
        slot = rng.choice((0, 1, rng.randrange(1 << 16), (1 << 31) - 1, 255, 256, 4095, 4096, 1023, 1024))
        wide = slot > 255 or rng.random() < 0.3
        opcode = (b"j" if wide else b"h") if code in (ord("h"), ord("j")) else (b"r" if wide else b"q")
        return start, end, opcode + slot.to_bytes(4 if wide else 1, "little"), kind
    other = rng.choice(others)  # crossover: a run of another seed's opcodes
    first = rng.randrange(1, len(other.ops))
    last = min(len(other.ops) - 1, first + rng.randint(1, 200))
    at = boundary(seed, rng)
    return at, at if rng.random() < 0.5 else boundary(seed, rng), other.data[other.ops[first][0]:other.ops[last][0]], kind


def mutate(seed: Seed, others: list[Seed], rng: random.Random) -> tuple[bytearray, str]:
    """Return a mutant of `seed` (one to three edits, none overlapping) and the names of its edits."""
    edits: list[tuple[int, int, bytes, str]] = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        for _attempt in range(20):
            edit = one_edit(seed, others, rng)
            if edit is not None:
                break
        if edit is None:
            continue
        start, stop = min(edit[0], edit[1]), max(edit[0], edit[1])
        edit = (start, stop, edit[2], edit[3])
        if all(stop <= a or start >= b for a, b, _, _ in edits) and all(start != a for a, _, _, _ in edits):
            edits.append(edit)
    edits.sort(key=lambda edit: edit[0])
    view, at = memoryview(seed.data), 0
    pieces: list[Any] = []
    for start, stop, new, _ in edits:
        pieces += [view[at:start], new]
        at = stop
    data = bytearray().join(pieces + [view[at:]])
    if seed.frames and rng.random() < 0.85:
        reframe(data, seed.frames, edits)
    return data, "+".join(name for _, _, _, name in edits) or "none"


def reframe(data: bytearray, frames: list, edits: list) -> None:
    """Set each FRAME's length in `data` (a mutant) to the bytes its frame holds after `edits`
    (sorted), as pickle's framer would have: a frame whose length no longer fits ends every
    scan at its FRAME (the C reader checks the length against what is left), so a truncated
    or shrunk protocol-4 pickle would otherwise never be read past its first opcode. A FRAME
    an edit touched is left as it is."""
    for start, length in frames:
        if any((a < start + 9 and b > start) if a != b else start < a < start + 9 for a, b, _, _ in edits):
            continue
        shift = sum(len(new) - (b - a) for a, b, new, _ in edits if a <= start)
        inside = sum(len(new) - (b - a) for a, b, new, _ in edits if start + 9 <= a < start + 9 + length)
        at = start + shift
        if at < 0 or at + 9 > len(data):
            continue
        data[at + 1:at + 9] = max(0, min(length + inside, len(data) - at - 9)).to_bytes(8, "little")


# ---- what an accepted scan must hold (readers/columns.py indexes by these) ----

def check_scanned(scanned: tuple, length: int) -> None:
    """Raise AssertionError unless `scanned` (what `_dcpscan.scan` accepted) is consistent."""
    version, save_id, tensors, objects, planner, fqns, files, coords, chunks, storage = scanned
    assert version is None or isinstance(version, str)
    assert save_id is None or isinstance(save_id, str)
    assert isinstance(planner, dict) and all(isinstance(path, tuple) for path in planner.values())
    ncoords = len(coords) // 8
    assert len(coords) % 8 == 0 and ncoords <= length // 2 + 64, "coords past the budget"
    file32, offset64, length64, row32 = chunks
    nchunks = len(file32) // 4
    assert len(file32) == len(row32) == 4 * nchunks and len(offset64) == len(length64) == 8 * nchunks
    chunk_file = memoryview(file32).cast("i")
    nfiles, nfqns = len(files), len(fqns)
    assert all(-1 <= file < nfiles for file in chunk_file), "a chunk's file id past the files"
    assert all(-1 <= row for row in memoryview(row32).cast("i"))
    taken = 0
    names = set(objects)
    for fqn, dtype, shape, first, count, chunk0, clean in tensors:
        assert isinstance(fqn, str) and fqn not in names, "a name twice"
        names.add(fqn)
        assert dtype in DTYPES and isinstance(shape, tuple) and isinstance(clean, bool)
        assert chunk0 == taken and count >= 0, "chunks out of step"
        taken += count
        assert first >= 0 and first + 2 * len(shape) * count <= ncoords, "a tensor's coords past the column"
    assert taken == nchunks, "chunks not all owned"
    columns = [memoryview(column).cast("q") for column in storage]
    rows = len(columns[0])
    assert all(len(column) == rows for column in columns[:3] + columns[4:]), "storage columns of unequal rows"
    fqn_ids, ndims, starts, keys, file_ids = columns[0], columns[1], columns[2], columns[3], columns[4]
    for row in range(rows):
        assert 0 <= fqn_ids[row] < nfqns and 0 <= file_ids[row] < nfiles, "a storage entry's ids past the names"
        assert -1 <= ndims[row] and starts[row] + max(ndims[row], 0) <= len(keys), "a storage entry's key past the column"


# ---- references of _records and the table functions of _dcpscan, from their contracts ----

def tuple_bytes(values: list[int]) -> bytes:
    """`Writer._tuple` of ints: MARK ... TUPLE past 3 items, else TUPLE1..3 (EMPTY_TUPLE)."""
    ints = b"".join(map(int_opcode, values))
    return b"(" + ints + b"t" if len(values) > 3 else ints + b")\x85\x86\x87"[len(values):len(values) + 1]


def encode_rows_reference(spec: list, rows: int) -> tuple[bytes, list[int]]:
    out, starts = bytearray(), []
    for row in range(rows):
        starts.append(len(out))
        for part in spec:
            if isinstance(part, bytes):
                out += part
            elif part[0] == 0:
                out += int_opcode(int(part[1][row]))
            elif part[0] == 1:
                out += tuple_bytes([int(value) for value in part[1][row][:int(part[2][row])]])
            else:
                out += part[1][int(part[2][row])]
    return bytes(out), starts + [len(out)]


def record_reference(layout: tuple, data: bytes) -> bytes:
    """A torch.save record: head, data, the tail with its CRC-32 / serialization id / id CRC fields."""
    head, _, segments, fields, before, after = layout
    crc = zlib.crc32(data)
    digest = hashlib.blake2b(before + struct.pack("<I", crc) + after, digest_size=16).digest()
    identity = b"%040d" % int.from_bytes(digest, "little")
    values = (struct.pack("<I", crc), identity, struct.pack("<I", zlib.crc32(identity)))
    return head + data + b"".join(segment + values[field] for segment, field in zip(segments, fields)) + segments[5]


def layout_length(layout: tuple) -> int:
    head, data_length, segments, fields, _, _ = layout
    return len(head) + data_length + sum(map(len, segments)) + sum(40 if field == 1 else 4 for field in fields)


def spans_reference(files, offsets, kinds, lengths, read_gap, read_span, budget):
    """record_writes.source_spans_in_python over columns."""
    order = sorted(range(len(kinds)), key=lambda i: (files[i], offsets[i]))
    spans, span_of, start_in = [], [0] * len(kinds), [0] * len(kinds)
    file, start, end = None, 0, 0
    for i in order:
        if not files[i]:
            continue
        at = offsets[i]
        stop = at + lengths[kinds[i]]
        gap = at - end if at > end else 0
        if file == files[i] and gap <= read_gap and (stop if stop > end else end) - start <= read_span and gap <= budget:
            budget -= gap
            end = max(end, stop)
        else:
            if file is not None:
                spans.append((file, start, end))
            file, start, end = files[i], at, stop
        span_of[i] = len(spans)
        start_in[i] = at - start
    if file is not None:
        spans.append((file, start, end))
    return spans, span_of, start_in


def int64(value: int) -> int:
    """`value` wrapped to int64, as C's wrapping adds give it."""
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


# ---- inputs of the column functions ----

def edge_or(rng: random.Random, low: int, high: int, edge: float) -> int:
    return rng.choice(EDGE_INTS) if rng.random() < edge else rng.randint(low, high)


def int_column(np: Any, rng: random.Random, values: list[int], shape: tuple | None = None) -> Any:
    """`values` as an int64 array: C-contiguous, or a strided, reversed or aliased view of the same values."""
    array = np.array(values, np.int64)
    if shape is not None:
        array = array.reshape(shape)
    layout = rng.random()
    if layout < 0.15 and array.ndim == 1:
        wide = np.zeros(2 * len(array), np.int64)
        wide[::2] = array
        return wide[::2]
    if layout < 0.25 and array.ndim == 1:
        return np.ascontiguousarray(array[::-1])[::-1]
    if layout < 0.3 and array.ndim == 2:
        return np.asfortranarray(array)
    return array


def call_encode_rows(records: Any, np: Any, rng: random.Random) -> str:
    rows = rng.choice((0, 1, 2, rng.randint(3, 40), rng.randint(40, 400)))
    edge = rng.choice((0.0, 0.05, 0.5))
    spec: list = []
    bad = rng.random() < 0.1
    for _ in range(rng.randint(1, 8)):
        kind = rng.choice(("bytes", "int", "size", "fetch"))
        if kind == "bytes":
            spec.append(rng.randbytes(rng.choice((0, 1, 5, 16, 17, 40))))
        elif kind == "int":
            spec.append((0, np.array([edge_or(rng, 0, 70000, edge) for _ in range(rows)], np.int64)))
        elif kind == "size":
            width = rng.choice((0, 1, 2, 3, 4, 8, 64))
            values = np.array([edge_or(rng, -5, 1 << 33, edge) for _ in range(rows * width)], np.int64).reshape(rows, width)
            spec.append((1, values, np.array([rng.randint(0, width) for _ in range(rows)], np.int64)))
        else:
            table = tuple(rng.randbytes(rng.randint(0, 12)) for _ in range(rng.randint(1, 6)))
            spec.append((2, table, np.array([rng.randrange(len(table)) for _ in range(rows)], np.int64)))
    expected, expected_starts = encode_rows_reference(spec, rows)
    if bad:  # out of range: each must raise ValueError (or OverflowError) before writing anything
        number = rng.randrange(len(spec))
        part = spec[number]
        choice = rng.randrange(5)
        if isinstance(part, bytes) or choice == 0:
            spec[number] = rng.choice(((9, np.zeros(rows, np.int64)), (0,), "text", (0, np.zeros(rows + 1, np.int64))))
        elif choice == 1:
            spec[number] = (part[0], *(column.astype(np.int32) if hasattr(column, "astype") else column for column in part[1:]))
        elif choice == 2 and part[0] == 1 and rows:
            spec[number] = (1, part[1], np.full(rows, part[1].shape[1] + rng.choice((1, 100)), np.int64))
        elif choice == 3 and part[0] == 2 and rows:
            spec[number] = (2, part[1], np.full(rows, rng.choice((-1, len(part[1]), 1 << 40)), np.int64))
        else:
            spec[number] = (part[0], *(column[::2] if hasattr(column, "ndim") and len(column) > 1 else column
                                       for column in part[1:]))
            if all(not hasattr(column, "ndim") or len(column) <= 1 for column in part[1:]):
                spec[number] = (0,)
        try:
            records.encode_rows(spec, rows, None)
        except (ValueError, OverflowError, TypeError):
            return "refused"
        raise AssertionError("encode_rows took an out-of-range spec")
    starts = None
    if rng.random() < 0.5:
        starts = np.full(rows + 1, -7, np.int64)
        if rng.random() < 0.3 and spec and any(not isinstance(part, bytes) and part[0] == 0 for part in spec):
            # `starts` sharing memory with a column: the columns are read before it is written
            number = next(number for number, part in enumerate(spec) if not isinstance(part, bytes) and part[0] == 0)
            shared = np.empty(rows + 1, np.int64)
            shared[:rows] = spec[number][1]
            spec[number] = (0, shared[:rows])
            starts = shared
    got = records.encode_rows(spec, rows, starts)
    assert got == expected, "encode_rows differs from the reference"
    if starts is not None:
        assert starts.tolist() == expected_starts, "encode_rows' starts differ from the reference"
    return "ok"


def call_assemble(records: Any, np: Any, rng: random.Random) -> str:
    layouts: list[Any] = []
    for _ in range(rng.randint(1, 4)):
        crcs = rng.choice((0, 4, 8, 16, 40, 400))
        split = 4 * rng.randint(0, crcs // 4)
        layouts.append((rng.randbytes(rng.choice((0, 3, 64, 300))), rng.choice((0, 1, 4, 7, 64, 200)),
                        tuple(rng.randbytes(rng.choice((0, 1, 8, 30))) for _ in range(6)),
                        tuple(rng.randrange(3) for _ in range(5)), rng.randbytes(split), rng.randbytes(crcs - split)))
    source = rng.randbytes(rng.choice((0, 10, 300, 4000)))
    count = rng.choice((0, 1, 5, 60))
    kinds = [rng.randrange(len(layouts)) for _ in range(count)]
    positions = [rng.randint(0, max(0, len(source) - layouts[kind][1])) for kind in kinds]
    valid = all(layouts[kind][1] <= len(source) for kind in kinds)
    first = rng.randint(0, count)
    limit = rng.choice((0, 1, 500, 1 << 40, rng.randint(0, 20000)))
    stop, planned = first, 0
    while stop < count and planned < limit:
        planned += layout_length(layouts[kinds[stop]])
        stop += 1
    out = bytearray(planned + rng.choice((0, 0, 7)))
    if rng.random() < 0.15:  # out of range: a kind, a position, the first record, the layout or the output
        choice = rng.randrange(6)
        if choice == 0 and count:
            kinds[rng.randrange(count)] = rng.choice((-1, len(layouts), 1 << 40))
        elif choice == 1 and count:
            positions[rng.randrange(count)] = rng.choice((-1, len(source) + 1, (1 << 63) - 1))
        elif choice == 2:
            first = rng.choice((-1, count + 1))
        elif choice == 3:
            layout = list(layouts[0])
            layout[rng.randrange(6)] = rng.choice((-1, (b"",) * 5, (3, 0, 0, 0, 0), b"\0" * 2000, "text", 1 << 62))
            layouts[0] = tuple(layout)
        elif choice == 4 and planned:
            out = bytearray(planned - 1)
        else:
            layouts[0] = "not a tuple"
        try:
            result = records.assemble(out, source, kinds, positions, tuple(layouts), first, limit)
        except (ValueError, TypeError, OverflowError, SystemError):  # SystemError: a layout not a tuple (PyArg_ParseTuple)
            return "refused"
        # the change may have left the records this call writes valid: then it writes them
        assert isinstance(result, tuple), "assemble returned something else"
        return "ok"
    if not valid and stop > first and any(layouts[kinds[i]][1] > len(source) for i in range(first, stop)):
        try:
            records.assemble(out, source, kinds, positions, tuple(layouts), first, limit)
        except ValueError:
            return "refused"
        raise AssertionError("assemble read data past its source")
    result = records.assemble(out, source, kinds, positions, tuple(layouts), first, limit)
    expected = b"".join(record_reference(layouts[kinds[i]], source[positions[i]:positions[i] + layouts[kinds[i]][1]])
                        for i in range(first, stop))
    assert result == (stop, planned) and bytes(out[:planned]) == expected, "assemble differs from the reference"
    return "ok"


def call_spans(records: Any, np: Any, rng: random.Random) -> str:
    count = rng.choice((0, 1, 10, 200))
    names = ["", "__0_0.distcp", "__1_0.distcp", "a/b.distcp", "é"]
    files = [rng.choice(names) for _ in range(count)]
    lengths = [rng.choice((0, 1, 100, 5000, 1 << 20)) for _ in range(rng.randint(1, 5))]
    kinds = [rng.randrange(len(lengths)) for _ in range(count)]
    offsets = [rng.choice((0, rng.randrange(1 << 16), rng.randrange(1 << 24), rng.randrange(1 << 40))) for _ in range(count)]
    read_gap, read_span, budget = rng.choice((0, 64 << 10)), rng.choice((0, 1 << 20, 8 << 20)), rng.choice((0, 1 << 20, 1 << 62))
    if rng.random() < 0.1 and count:
        kinds[rng.randrange(count)] = rng.choice((-1, len(lengths)))
        try:
            records.spans(files, offsets, kinds, lengths, read_gap, read_span, budget)
        except ValueError:
            return "refused"
        raise AssertionError("spans took a kind past the lengths")
    got = records.spans(files, offsets, kinds, lengths, read_gap, read_span, budget)
    expected = spans_reference(files, offsets, kinds, lengths, read_gap, read_span, budget)
    assert got == expected, "spans differs from the reference"
    return "ok"


def call_match(records: Any, np: Any, rng: random.Random) -> str:
    block = rng.randbytes(rng.choice((0, 8, 100, 2000)))
    runs, reach = [], 0
    for _ in range(rng.randint(0, 4)):
        first = rng.randint(0, 12)
        end = first + rng.randint(0, 6)
        expected = rng.randbytes(8 * (end - first))
        mask = rng.randbytes(8 * (end - first)) if rng.random() < 0.5 else None
        runs.append((first, end, expected, mask))
        reach = max(reach, 8 * end)
    high = len(block) - reach
    starts = [rng.randint(0, high) for _ in range(rng.choice((0, 1, 30)))] if high >= 0 else []
    if starts and rng.random() < 0.3:  # a start whose words the block holds: sometimes equal, under the mask
        at = starts[0]
        for number, (first, end, _, mask) in enumerate(runs):
            words = block[at + 8 * first:at + 8 * end]
            if mask is not None:
                words = bytes(a & b for a, b in zip(words, mask))
            runs[number] = (first, end, words, mask)
    if rng.random() < 0.1:
        starts = starts + [rng.choice((-1, high + 1, 1 << 40))]
        try:
            records.match(block, np.array(starts, np.int64), runs)
        except IndexError:
            return "refused"
        raise AssertionError("match read a word past the block")
    got = records.match(block, np.array(starts, np.int64), runs)
    same = bytearray()
    for at in starts:
        equal = True
        for first, end, words, mask in runs:
            have = block[at + 8 * first:at + 8 * end]
            if mask is not None:
                have = bytes(a & b for a, b in zip(have, mask))
            equal = equal and have == words
        same.append(equal)
    assert got == bytes(same), "match differs from the reference"
    return "ok"


def call_json_rows(scanner: Any, np: Any, rng: random.Random) -> str:
    rows, ndim = rng.choice((0, 1, 7, 60)), rng.choice((0, 1, 2, 5, 64))
    edge = rng.choice((0.0, 0.3))
    files = tuple(json.dumps(f"__{number}_0.distcp" * rng.randint(1, 20)).encode() for number in range(rng.randint(0, 4)))
    shape = (rows, ndim)
    offsets = int_column(np, rng, [edge_or(rng, 0, 1 << 20, edge) for _ in range(rows * ndim)], shape)
    sizes = int_column(np, rng, [edge_or(rng, 0, 1 << 20, edge) for _ in range(rows * ndim)], shape)
    file = int_column(np, rng, [rng.randint(-1, len(files) - 1) for _ in range(rows)])
    if rng.random() < 0.3:
        file = file.astype(np.int32)
    offset, length, nbytes = (int_column(np, rng, [edge_or(rng, 0, 1 << 30, edge) for _ in range(rows)]) for _ in range(3))
    last = rng.random() < 0.5
    if rng.random() < 0.1:  # a file id past the files, a wrong dtype or shape
        choice = rng.randrange(3)
        if choice == 0 and rows:
            file = file.copy()
            file[rng.randrange(rows)] = len(files) + rng.choice((0, 5))
        elif choice == 1:
            offset = offset.astype(np.float64)
        else:
            sizes = np.zeros((rows, ndim + 1), np.int64)
        try:
            scanner.json_rows(rows, ndim, offsets, sizes, file, offset, length, nbytes, files, last)
        except (IndexError, ValueError):
            return "refused"
        raise AssertionError("json_rows took a file id, dtype or shape out of range")
    got = scanner.json_rows(rows, ndim, offsets, sizes, file, offset, length, nbytes, files, last)
    parts = []
    for row in range(rows):
        id = int(file[row])
        where = (b"null, \"offset\": null, \"length\": null" if id < 0 else
                 files[id] + b", \"offset\": %d, \"length\": %d" % (offset[row], length[row]))
        parts.append(b"{\"offsets\": [%s], \"sizes\": [%s], \"file\": %s, \"bytes\": %d}" % (
            b", ".join(b"%d" % value for value in offsets[row]), b", ".join(b"%d" % value for value in sizes[row]),
            where, nbytes[row]))
    expected = b", ".join(parts) + (b", " if parts and not last else b"")
    assert got == expected, "json_rows differs from the reference"
    return "ok"


def call_file_sums(scanner: Any, np: Any, rng: random.Random) -> str:
    rows, nfiles, groups = rng.choice((0, 1, 9, 100)), rng.randint(0, 4), rng.randint(1, 3)
    edge = rng.choice((0.0, 0.2))
    file = int_column(np, rng, [rng.randint(-1, nfiles - 1) for _ in range(rows)])
    if rng.random() < 0.3:
        file = file.astype(np.int32)
    length, nbytes = (int_column(np, rng, [edge_or(rng, 0, 1 << 30, edge) for _ in range(rows)]) for _ in range(2))
    bins = int_column(np, rng, [groups * number for number in range(nfiles)])
    group = rng.randrange(groups)
    totals = [np.zeros(groups * nfiles, np.int64) for _ in range(3)]
    if rng.random() < 0.1:  # a bin past the totals, or totals of another length
        if rng.random() < 0.5 and nfiles:
            bins = np.array([groups * nfiles + 1] * nfiles, np.int64)
            file = np.zeros(max(rows, 1), np.int64)
            rows = len(file)
            length, nbytes = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
        else:
            totals[2] = np.zeros(groups * nfiles + 1, np.int64)
        try:
            scanner.file_sums(rows, file, length, nbytes, bins, group, *totals)
        except (IndexError, ValueError):
            return "refused"
        raise AssertionError("file_sums took a bin past its totals")
    exact = scanner.file_sums(rows, file, length, nbytes, bins, group, *totals)
    counts, lengths, sums = [0] * (groups * nfiles), [0] * (groups * nfiles), [0] * (groups * nfiles)
    fits = True
    for row in range(rows):
        id = int(file[row])
        if id < 0:
            continue
        at = int(bins[id]) + group
        counts[at] += 1
        fits = fits and int64(lengths[at] + int(length[row])) == lengths[at] + int(length[row])
        fits = fits and int64(sums[at] + int(nbytes[row])) == sums[at] + int(nbytes[row])
        lengths[at], sums[at] = int64(lengths[at] + int(length[row])), int64(sums[at] + int(nbytes[row]))
    assert exact == fits and [total.tolist() for total in totals] == [counts, lengths, sums], "file_sums differs"
    return "ok"


TABLE_CALLS: dict[str, tuple[str, Callable]] = {  # name -> (module, caller), tried in this proportion
    "encode_rows": ("records", call_encode_rows), "assemble": ("records", call_assemble),
    "spans": ("records", call_spans), "match": ("records", call_match),
    "json_rows": ("scanner", call_json_rows), "file_sums": ("scanner", call_file_sums),
}


# ---- the run ----

@dataclasses.dataclass
class Fuzz:
    scanner: Any
    records: Any
    np: Any
    seeds: list[Seed]
    by_group: dict[str, list[Seed]]
    mapped: Path | None
    mapped_count: int
    seed: int
    scratch: Path

    def kind(self, number: int) -> str:
        """What input `number` is: a mapped mutant (the first few), a .metadata mutant, or a call of another function."""
        if self.mapped is not None and number < self.mapped_count:
            return "mapped"
        choice = random.Random(f"{self.seed}:{number}:kind").random()
        return "scan" if choice < 0.75 else random.Random(f"{self.seed}:{number}:call").choice(sorted(TABLE_CALLS))

    def mutant(self, number: int) -> tuple[Seed, bytearray, str]:
        rng = random.Random(f"{self.seed}:{number}")
        group = rng.choice(("small", "fixture", "past 2 MiB", "past 2 MiB"))
        seed = rng.choice(self.by_group.get(group) or self.seeds)
        data, mutations = mutate(seed, self.seeds, rng)
        return seed, data, mutations

    def write_mapped_mutant(self, number: int, path: Path) -> str:
        """Write the mapped seed with one edit past the first release (64 MiB in), or as it is
        (input 0), to `path` (a piece at a time: no copy of it in memory); return the edit's name."""
        assert self.mapped is not None
        size = self.mapped.stat().st_size
        rng = random.Random(f"{self.seed}:{number}")
        at = rng.randrange(MAP_METADATA_BYTES + (1 << 20), size)
        kind = "none" if number == 0 else rng.choice(("truncate", "set", "splice"))
        new, skip = {"none": (b"", 0), "truncate": (b"", size - at), "set": (bytes([rng.randrange(256)]), 1),
                     "splice": (rng.choice(SNIPPETS), 0)}[kind]
        with open(self.mapped, "rb") as source, open(path, "wb") as out:
            left = at if kind != "none" else size
            while left:
                left -= out.write(source.read(min(left, 1 << 20)))
            out.write(new)
            source.seek(at + skip if kind != "none" else size)
            shutil.copyfileobj(source, out, 1 << 20)
        return kind

    def run_one(self, number: int, stats: Counter) -> str:
        """Run input `number` and return its row of the table (a seed group or a function); raise
        AssertionError (or whatever a call raised) on a failure."""
        kind = self.kind(number)
        if kind == "mapped":
            path = self.scratch / f"mapped-{os.getpid()}.metadata"
            self.write_mapped_mutant(number, path)
            with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                scanned = self.scanner.scan(mapped, DTYPES, True, True)
                length = len(mapped)
            path.unlink()
            self.count_scan(stats, "mapped", scanned, length)
            return "mapped"
        if kind == "scan":
            seed, data, _ = self.mutant(number)
            scanned = self.scanner.scan(data, DTYPES, True, False)
            self.count_scan(stats, seed.group, scanned, len(data))
            if not isinstance(scanned, int) and random.Random(number).random() < 0.05:
                assert self.scanner.scan(bytes(data), DTYPES, True, False) == scanned, "scan is not deterministic"
            return seed.group
        module, call = TABLE_CALLS[kind]
        outcome = call(self.scanner if module == "scanner" else self.records, self.np,
                       random.Random(f"{self.seed}:{number}"))
        stats[f"{kind} {outcome}"] += 1
        return kind

    @staticmethod
    def count_scan(stats: Counter, group: str, scanned: Any, length: int) -> None:
        stats[f"scan {group}"] += 1
        if isinstance(scanned, int):
            assert 0 <= scanned <= length, "scan gave up past the input"
            stats[f"scan {group} declined"] += 1
            stats[f"scan {group} depth"] += scanned / max(length, 1)
        else:
            check_scanned(scanned, length)
            stats[f"scan {group} accepted"] += 1


def worker(fuzz: Fuzz, numbers: range, current: Any, slot: int, report: Path) -> None:
    """A forked worker: run `numbers`, noting each in `current[slot]` first; write the stats and
    failures to `report` (a file: a pipe would fill before the parent reads it); exit."""
    stats: Counter = Counter()
    failures = []
    status = 0
    try:
        for number in numbers:
            current[slot] = number
            started = time.process_time()
            try:
                row = fuzz.run_one(number, stats)
                stats[f"seconds {row}"] += time.process_time() - started
            except MemoryError:
                stats["memory"] += 1
            except Exception:
                failures.append((number, traceback.format_exc()[-3000:]))
        current[slot] = -1
        report.write_text(json.dumps({"stats": stats, "failures": failures}))
    except BaseException:
        traceback.print_exc()
        status = 3
    finally:
        os._exit(status)


def write_failure(fuzz: Fuzz, number: int, out: Path) -> str:
    """Write input `number`'s bytes (a .metadata mutant) to `out` for replay; return what was written."""
    kind = fuzz.kind(number)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{number}.metadata"
    if kind == "scan":
        seed, data, mutations = fuzz.mutant(number)
        path.write_bytes(data)
        return f"{path} (seed {seed.name}, {mutations})"
    if kind == "mapped":
        return f"{path} (the mapped seed, {fuzz.write_mapped_mutant(number, path)}; scanned through a map)"
    return f"a call of {kind}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("seeds", help="write the seed .metadata files (imports torch; no sanitizer)")
    make.add_argument("out", type=Path)
    make.add_argument("--mapped", action="store_true", help="also one past 64 MiB, scanned through a map")
    run = commands.add_parser("run", help="fuzz the two modules built in --build")
    run.add_argument("--build", type=Path, required=True, help="directory of the _dcpscan and _records .so files")
    run.add_argument("--seeds", type=Path, required=True, help="directory `seeds` wrote")
    run.add_argument("--count", type=int, default=6000, help="inputs to run (default 6000: ~80 s on 2 cores)")
    run.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    run.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="forked workers (default: cores)")
    run.add_argument("--mapped-count", type=int, default=3, help="inputs scanned through a map (default 3)")
    run.add_argument("--no-fixtures", action="store_true", help="leave out the repository's fixtures/**/.metadata")
    run.add_argument("--only", type=int, help="run input N alone, in this process")
    run.add_argument("--out", type=Path, help="where failing inputs go (default: a temporary directory)")
    run.add_argument("--expect-sanitizers", action="store_true", help="fail unless ASan's runtime is loaded")
    args = parser.parse_args()
    if args.command == "seeds":
        write_seeds(args.out, args.mapped)
        return

    if args.expect_sanitizers and not sanitizers_loaded():
        raise SystemExit("fuzz_native: AddressSanitizer's runtime is not loaded (run through .ci/sanitize)")
    import numpy as np

    started = time.perf_counter()
    scanner, records = load_extension(args.build, "_dcpscan"), load_extension(args.build, "_records")
    seeds, mapped = read_seeds(args.seeds, not args.no_fixtures)
    by_group: dict[str, list[Seed]] = {}
    for seed in seeds:
        by_group.setdefault(seed.group, []).append(seed)
    scratch = Path(tempfile.mkdtemp(prefix="fuzz-native-"))
    fuzz = Fuzz(scanner, records, np, seeds, by_group, mapped, args.mapped_count if mapped else 0, args.seed, scratch)
    out = args.out or scratch / "failures"

    # every seed torch's dcp.save made must be read whole by the C reader, or its mutants test little
    declined = []
    for seed in seeds:
        scanned = scanner.scan(seed.data, DTYPES, True, False)
        if isinstance(scanned, int):
            declined.append(f"{seed.name} (at byte {scanned} of {len(seed.data)})")
        else:
            check_scanned(scanned, len(seed.data))
    print(f"{len(seeds)} seeds ({', '.join(f'{len(group)} {name}' for name, group in sorted(by_group.items()))}"
          f"{', 1 mapped' if mapped else ''}); {len(seeds) - len(declined)} read whole by the C reader")
    for name in declined:
        print(f"  declined by the C reader: {name}")
    if any(not name.startswith("fixtures/") for name in declined):
        raise SystemExit("fuzz_native: the C reader declines a seed torch's dcp.save wrote: its mutants would not reach "
                         "the column code")

    if args.only is not None:
        stats: Counter = Counter()
        print(f"input {args.only}: {fuzz.kind(args.only)}")
        fuzz.run_one(args.only, stats)
        print(dict(stats))
        return

    current = mmap.mmap(-1, 8 * args.workers)  # shared with the workers: the input each is on
    slots = memoryview(current).cast("q")
    children: dict[int, int] = {}
    for slot in range(args.workers):
        slots[slot] = -1
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            worker(fuzz, range(slot, args.count, args.workers), slots, slot, scratch / f"report-{slot}.json")
        children[pid] = slot
    stats = Counter()
    failures: list[str] = []
    while children:
        pid, status = os.wait()
        slot = children.pop(pid)
        written = scratch / f"report-{slot}.json"
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and written.is_file():
            report = json.loads(written.read_text())
            stats.update(report["stats"])
            failures += [f"input {number}, {write_failure(fuzz, number, out)} (replay: --only {number}):\n{text}"
                         for number, text in report["failures"]]
            continue
        number = slots[slot]
        how = (f"killed by {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status)
               else f"exit status {os.WEXITSTATUS(status)}")
        failures.append(f"worker {slot} died ({how}, a sanitizer report above?) on input {number}: "
                        f"{write_failure(fuzz, number, out) if number >= 0 else 'between inputs'}; replay (sanitized): "
                        f"benchmarks/fuzz_native.py run --build {args.build} --seeds {args.seeds} --seed {args.seed} "
                        f"--only {number}")
    slots.release()
    current.close()
    elapsed = time.perf_counter() - started
    if not failures:
        shutil.rmtree(scratch, ignore_errors=True)

    print(f"{args.count} inputs (seed {args.seed}) in {elapsed:.1f} s on {args.workers} workers")
    print(f"  {'.metadata mutants':24} {'scanned':>8} {'accepted':>9} {'declined':>9} {'read before declining':>22} "
          f"{'CPU s':>6}")
    for group in ("small", "fixture", "past 2 MiB", "mapped"):
        total = stats[f"scan {group}"]
        if total:
            refused = stats[f"scan {group} declined"]
            depth = stats[f"scan {group} depth"] / refused if refused else 0
            print(f"  {group:24} {total:>8} {stats[f'scan {group} accepted']:>9} {refused:>9} {depth:>21.0%} "
                  f"{stats[f'seconds {group}']:>6.1f}")
    print(f"  {'calls':24} {'ok':>8} {'refused':>9} {'':>9} {'':>22} {'CPU s':>6}")
    for name in sorted(TABLE_CALLS):
        print(f"  {name:24} {stats[f'{name} ok']:>8} {stats[f'{name} refused']:>9} {'':>9} {'':>22} "
              f"{stats[f'seconds {name}']:>6.1f}")
    if stats["memory"]:
        print(f"  MemoryError: {stats['memory']}")
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    if failures:
        print(f"{len(failures)} failures; failing .metadata inputs in {out}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
