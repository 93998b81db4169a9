"""Read safetensors headers (never their data) into our Checkpoint types, without torch.

A safetensors file (safetensors format spec) is an 8-byte little-endian header length N, N
bytes of JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}`, then the data section; `data_offsets` count from the data section's start.

Each tensor becomes one chunk per file that holds it, whose blob starts at the file's first
byte with the chunk's element bytes as its length: the convention torch's SAFETENSORS
FileSystemWriter uses, which `blobs.locate` resolves through the header by fqn and
`integrity` checks. Every size and offset is checked against the file before use.

Example:
    >>> checkpoint = read_safetensors("model.safetensors")
    >>> checkpoint.tensors["lm_head.weight"].chunks[0].blob
    Blob(file='model.safetensors', offset=0, length=131072, transforms=())
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, cast

from ckpttool.core import dtypes
from ckpttool.store import storage
from ckpttool.core.checkpoint import Blob, Checkpoint, Chunk, Tensor, as_path, refuse_bad_names
from ckpttool.store.safepaths import check_data_file, containment_root, safe_relative_path
from ckpttool.core.errors import CorruptMetadata, MissingFile
from ckpttool.formats.safetensors import MAX_HEADER_BYTES, METADATA_KEY, SUFFIX, HeaderError, read_header as read_raw_header

MAX_INDEX_BYTES = 64 << 20  # a `*.index.json` weight map; 100k tensors take ~10 MB


@dataclass(frozen=True)
class Entry:
    """One tensor of a header: torch dtype name (the raw code if unknown), shape, and its
    byte range in the file (absolute)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A file's parsed header: its entries in header order and its `__metadata__` map."""

    file: str  # relative to the checkpoint root
    size: int
    data_start: int
    entries: tuple[Entry, ...]
    metadata: Mapping[str, str]


def _open_regular(path: Path, inside: Path | None) -> int:
    try:
        check_data_file(path, os.stat(path).st_mode, inside)  # before open: devices may act on it
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise MissingFile(f"{path}: listed by the checkpoint but missing (was the copy partial?)") from None
    except OSError as error:
        raise CorruptMetadata(f"{path}: cannot open ({error.strerror or error})") from None
    try:
        check_data_file(path, os.fstat(fd).st_mode, inside)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pread_exact(fd: int, length: int, offset: int, path: Path) -> bytes:
    parts, got = [], 0
    while got < length:
        try:
            part = os.pread(fd, length - got, offset + got)
        except OSError as error:
            raise CorruptMetadata(f"{path}: cannot read ({error.strerror or error})") from None
        if not part:
            raise CorruptMetadata(f"{path}: ends at byte {offset + got}, inside the safetensors header")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def read_header(root: Path, name: str, inside: Path | None) -> Header:
    """Return the parsed header of `root/name`, every entry checked against the file's size.

    Raises CorruptMetadata naming the file (and tensor) for anything a safetensors reader
    would refuse: a header longer than the file or MAX_HEADER_BYTES, bad JSON, a
    shape or range that does not fit, a range whose size disagrees with dtype and shape.
    """
    path = root / safe_relative_path(name, f"{root}: ")
    if storage.is_remote(path):
        try:
            objects = storage.reader(cast(storage.RemotePath, path))  # is_remote: a RemotePath (as_path)
        except (FileNotFoundError, IsADirectoryError):
            raise MissingFile(f"{path}: listed by the checkpoint but missing, or not a file (was the copy partial?)") from None
        fd, size = None, objects.size
    else:
        fd = _open_regular(path, inside)
        size = os.fstat(fd).st_size

    def read(offset: int, length: int) -> bytes:
        return objects.read(offset, length) if fd is None else _pread_exact(fd, length, offset, path)

    try:
        document, data_start = read_raw_header(read, size)
    except HeaderError as error:
        raise CorruptMetadata(_header_problem(path, size, error)) from None
    finally:
        if fd is not None:
            os.close(fd)
    metadata = document.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptMetadata(f"{path}: {METADATA_KEY} is not a map of strings")
    entries = tuple(_entry(path, tensor, info, size - data_start, data_start) for tensor, info in document.items())
    return Header(name, size, data_start, entries, metadata)


def _header_problem(path: Path, size: int, error: HeaderError) -> str:
    if error.kind == "short":
        return f"{path}: {size} bytes, too short for a safetensors header"
    if error.kind == "length":
        return (f"{path}: safetensors header of {error.length} bytes does not fit the file's {size} bytes "
                f"(at most {MAX_HEADER_BYTES}); not a safetensors file or truncated")
    if error.kind == "json":
        return f"{path}: unreadable safetensors header ({type(error.error).__name__})"
    return f"{path}: the safetensors header is not a JSON object"


def _entry(path: Path, name: str, info: object, data_size: int, data_start: int) -> Entry:
    where = f"{path}: {name}"
    if not isinstance(info, dict):
        raise CorruptMetadata(f"{where}: header entry is not a JSON object")
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(code, str):
        raise CorruptMetadata(f"{where}: dtype is not a string")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise CorruptMetadata(f"{where}: shape {str(shape)[:80]} is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(n) is int for n in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_size):
        raise CorruptMetadata(f"{where}: data_offsets {str(offsets)[:80]} do not lie in the file's "
                              f"{data_size}-byte data section (truncated file?)")
    dtype = dtypes.FROM_SAFETENSORS_NAME.get(code, code)
    itemsize = dtypes.ITEMSIZE.get(dtype)
    if itemsize is not None and math.prod(shape) * itemsize != offsets[1] - offsets[0]:
        raise CorruptMetadata(f"{where}: {offsets[1] - offsets[0]} bytes for {dtype} of shape {shape} "
                              f"(expected {math.prod(shape) * itemsize})")
    return Entry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def zero_offsets(header: Header) -> dict[str, tuple[int, ...]]:
    """Every tensor of the file whole, at the origin (plain safetensors files)."""
    return {entry.name: (0,) * len(entry.shape) for entry in header.entries}


def build_checkpoint(root: Path, headers: Iterable[Header], metadata_file: str,
                     offsets_of: Callable[[Header], Mapping[str, tuple[int, ...]]] = zero_offsets,
                     names: Mapping[str, str] | None = None, version: str | None = None) -> Checkpoint:
    """Return a Checkpoint with one chunk per (tensor, file): `offsets_of(header)` places each
    entry in its global tensor, whose shape is the largest extent of its chunks (as torch's
    HuggingFaceStorageReader computes it). `names`, if given, is a weight map: only its
    tensors are taken, each from the file it names."""
    found: dict[str, list[tuple[str, Chunk]]] = {}
    for header in headers:
        placement = offsets_of(header)
        for entry in header.entries:
            if names is not None and names.get(entry.name) != header.file:
                continue
            offsets = placement[entry.name]
            blob = Blob(header.file, 0, entry.end - entry.begin)
            found.setdefault(entry.name, []).append((entry.dtype, Chunk(tuple(offsets), entry.shape, blob)))
    if names is not None:
        missing = sorted(set(names) - set(found))
        if missing:
            raise CorruptMetadata(f"{root / metadata_file}: {missing[0]} is mapped to {names[missing[0]]}, whose "
                                  f"safetensors header does not hold it ({len(missing)} such tensors)")
    tensors: dict[str, Tensor] = {}
    notes = []
    for fqn in sorted(found):
        kinds = {dtype for dtype, _ in found[fqn]}
        if len(kinds) > 1:
            raise CorruptMetadata(f"{root}: {fqn}: shards disagree on the dtype ({', '.join(sorted(kinds))})")
        dtype = kinds.pop()
        chunks = tuple(sorted((chunk for _, chunk in found[fqn]), key=lambda c: c.offsets))
        if len({len(c.offsets) for c in chunks}) > 1:
            raise CorruptMetadata(f"{root}: {fqn}: shards disagree on the number of dimensions")
        shape = _extent(chunks)
        tensors[fqn] = Tensor(fqn, dtype, shape, chunks)
        if dtype not in dtypes.ITEMSIZE:
            notes.append(f"{fqn}: unknown dtype {dtype[:64]!r}")
    refuse_bad_names(root / metadata_file, list(tensors), set(), tensors, {})
    return Checkpoint(path=root, metadata_file=metadata_file, version=version, tensors=tensors, objects={},
                      notes=tuple(notes))


def _extent(chunks: tuple[Chunk, ...]) -> tuple[int, ...]:
    ndim = len(chunks[0].offsets)
    return tuple(max(c.offsets[d] + c.sizes[d] for c in chunks) for d in range(ndim))


def read_safetensors(path: str | os.PathLike, follow_symlinks: bool = False) -> Checkpoint:
    """Return one `.safetensors` file as a Checkpoint rooted at its directory, one chunk per
    tensor (the file's own name is its `metadata_file`)."""
    file = as_path(storage.location(path))
    root = file.parent
    inside = None if follow_symlinks else containment_root(root)
    header = read_header(root, file.name, inside)
    return build_checkpoint(root, [header], file.name)


def read_index(path: Path) -> dict[str, str]:
    """Return the weight map (tensor -> file) of a `*.index.json`, checked: bounded size,
    a JSON object whose `weight_map` maps strings to safe relative `.safetensors` paths."""
    try:
        status = path.stat() if storage.is_remote(path) else os.stat(path)
    except OSError as error:
        raise CorruptMetadata(f"{path}: cannot stat ({error.strerror or error})") from None
    if not stat.S_ISREG(status.st_mode) or status.st_size > MAX_INDEX_BYTES:
        raise CorruptMetadata(f"{path}: not a regular file of at most {MAX_INDEX_BYTES} bytes")
    try:
        document = json.loads(path.read_bytes())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as error:
        raise CorruptMetadata(f"{path}: unreadable index ({type(error).__name__})") from None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CorruptMetadata(f"{path}: no `weight_map` object mapping tensor names to files")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file.endswith(SUFFIX):
            raise CorruptMetadata(f"{path}: {name} maps to {str(file)[:80]!r}, not a .safetensors file")
        safe_relative_path(file, f"{path}: {name}: ")
    return weight_map
