"""`diff`: are two checkpoints the same, entry by entry and byte by byte?

A and B may be any layouts `open_checkpoint` reads, sharded any way (world 2 against world 3,
a DCP directory against its consolidated .safetensors). Each pair of tensors is compared over
the intersections of the two chunkings, in slabs of at most `block_size` bytes per side, so
memory stays bounded however large a tensor is. Bytes decide (bit-exact, so -0.0 differs from
0.0 and NaN payloads count); for floating dtypes the largest absolute and relative differences
are reported too, and `atol`/`rtol`, only when given, accept elements with
`|a - b| <= atol + rtol * |b|` (numpy's `isclose`; B is the reference). Non-tensor entries are
compared as decoded values (plain ones without torch, through the allowlist).

Example:
    >>> report = diff("ckpt/step-00000100", "model.safetensors", normalize=True)
    >>> report.verdict, [t.key for t in report.different]
    ('different', ['layers.0.fc1.weight'])
"""

from __future__ import annotations

import fnmatch
import math
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ckpttool.check import integrity
from ckpttool.core import dtypes, numerics
from ckpttool.core.checkpoint import Checkpoint, Chunk, Object, Tensor
from ckpttool.dcp.blobs import DataFiles, RawData, decode_object, locate, object_bytes, read_chunk
from ckpttool.core.errors import KeyCollision, UsageError
from ckpttool.check.integrity import Problem
from ckpttool.store.io import ProgressFactory, no_progress
from ckpttool.model.keys import Rename, normalise
from ckpttool.core.geometry import Box, overlapping_boxes, row_major_runs, slabs, volume
from ckpttool.model.model_view import ModelView, find_model
from ckpttool.options import SourceOptions
from ckpttool.readers import open_checkpoint
from ckpttool.store.safepaths import read_json_object
from ckpttool.store.storage import RemotePath
from ckpttool.torchsave.archive import tensor_bytes

GROUPS = ("model", "optimizer", "other")  # as `inspect` groups entries
BLOCK_SIZE = 4 << 20  # bytes per side compared at a time (a multiple of every itemsize)



@dataclass(frozen=True)
class Only:
    """An entry that one side has and the other does not."""

    key: str
    fqn: str
    kind: str  # "tensor" or "object"
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Mismatch:
    """A key both sides have, with a different dtype, shape, or kind (tensor vs object)."""

    key: str
    fqn_a: str
    fqn_b: str
    field: str  # "dtype", "shape" or "kind"
    a: str
    b: str


@dataclass(frozen=True)
class TensorDiff:
    """Two tensors of one dtype and shape, compared element by element."""

    key: str
    fqn_a: str
    fqn_b: str
    dtype: str
    shape: tuple[int, ...]
    differing: int = 0  # elements whose bytes differ
    first_index: tuple[int, ...] | None = None  # row-major first differing element
    max_abs: float | None = None  # floating dtypes: over differing elements finite on both sides
    max_rel: float | None = None  # |a - b| / |b| over the same elements (inf where b == 0)
    non_finite: int = 0  # differing elements that are NaN or Inf on either side
    within_tolerance: bool = False  # differs, but every element passes --atol/--rtol

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def status(self) -> str:
        """`equal`, `close` (within the tolerances asked for) or `different`."""
        return "equal" if not self.differing else "close" if self.within_tolerance else "different"


@dataclass(frozen=True)
class ObjectDiff:
    """Two non-tensor entries, compared as decoded python values."""

    key: str
    fqn_a: str
    fqn_b: str
    equal: bool
    a: str  # short repr of each value
    b: str


@dataclass(frozen=True)
class DiffReport:
    """What differs between checkpoints A and B; entries sorted by key."""

    a: Path | RemotePath  # as given (a file, a directory, a run directory, a URL)
    b: Path | RemotePath
    normalize: bool
    only: tuple[str, ...]
    filters: tuple[str, ...]
    atol: float | None
    rtol: float | None
    only_a: tuple[Only, ...]
    only_b: tuple[Only, ...]
    mismatches: tuple[Mismatch, ...]
    tensors: tuple[TensorDiff, ...]  # every tensor pair compared, equal ones included
    objects: tuple[ObjectDiff, ...]
    bytes_compared: int  # element bytes read and compared (per side)
    bytes_shared: int  # element bytes both sides hold in the very same file range (not read)
    seconds: float
    problems_a: tuple[Problem, ...] = ()  # the integrity gate's warnings
    problems_b: tuple[Problem, ...] = ()
    hint: str | None = None
    model_views: str | None = None  # said when the model views were compared, not every entry

    @property
    def different(self) -> tuple[TensorDiff, ...]:
        return tuple(t for t in self.tensors if t.status == "different")

    @property
    def close(self) -> tuple[TensorDiff, ...]:
        return tuple(t for t in self.tensors if t.status == "close")

    @property
    def different_objects(self) -> tuple[ObjectDiff, ...]:
        return tuple(o for o in self.objects if not o.equal)

    @property
    def verdict(self) -> str:
        """`identical`, `within-tolerance` (some bytes differ, all within atol/rtol) or `different`."""
        if self.only_a or self.only_b or self.mismatches or self.different or self.different_objects:
            return "different"
        return "within-tolerance" if self.close else "identical"

    @property
    def same(self) -> bool:
        """True when the CLI exits 0: identical, or within the tolerances asked for."""
        return self.verdict != "different"


def diff(
    a: str | os.PathLike,
    b: str | os.PathLike,
    *,
    normalize: bool = False,
    only: Sequence[str] = (),
    filters: Sequence[str] = (),
    renames: Sequence[str] = (),
    renames_a: Sequence[str] = (),
    renames_b: Sequence[str] = (),
    atol: float | None = None,
    rtol: float | None = None,
    block_size: int = BLOCK_SIZE,
    progress: ProgressFactory | None = None,
    exact_names: bool = False,
    source: SourceOptions = SourceOptions(),
    assets: str | os.PathLike | None = None,
) -> DiffReport:
    """Return what differs between the checkpoints at `a` and `b`, reading every tensor byte
    of the entries both hold (each side passes the integrity gate first).

    Keys match exactly unless `normalize` (model subtree and wrapper names stripped, as
    consolidate names its keys); `renames` (`REGEX=REPL`) rewrite keys of both sides, then
    `renames_a`/`renames_b` of one. `only` keeps groups (model, optimizer, other; a bare weights
    file is all model), `filters` globs on the fqn or the key of either side. Given none of
    these, when the names do not meet but the model views do (a checkpoint against its
    consolidation or Hub export), the model views are compared (`model_views` says so) unless
    `exact_names`. `source.model_prefix` names the model subtree of each side whose layout does not
    fix it (a weights file's model is its top level). With `assets` (a folder with the model's
    config.json), a side that uses a framework's names (torchtitan, Megatron-Core) is compared as
    export converts it to transformers' names (`consolidate.as_transformers`).

    Example:
        >>> diff("run/step-100", "run/step-100-world3").verdict
        'identical'
    """
    started = time.perf_counter()
    _check_options(only, atol, rtol, block_size)
    shared = tuple(Rename.parse(r) for r in renames)
    rules_a, rules_b = shared + tuple(Rename.parse(r) for r in renames_a), shared + tuple(Rename.parse(r) for r in renames_b)
    follow_symlinks, model_prefix = source.follow_symlinks, source.model_prefix
    path_a, path_b = source.locate(a), source.locate(b)  # a URL stays one (Path("gs://b/k") prints gs:/b/k)
    checkpoint_a = open_checkpoint(path_a, follow_symlinks)
    checkpoint_b = open_checkpoint(path_b, follow_symlinks)
    warnings_a = tuple(integrity.gate(checkpoint_a, follow_symlinks).problems)
    warnings_b = tuple(integrity.gate(checkpoint_b, follow_symlinks).problems)
    if assets is not None:  # framework names compared as transformers' (what export writes)
        from ckpttool.commands.consolidate import as_transformers

        config = read_json_object(Path(assets) / "config.json") if (Path(assets) / "config.json").exists() else None
        checkpoint_a = as_transformers(checkpoint_a, config, follow_symlinks, model_prefix) or checkpoint_a
        checkpoint_b = as_transformers(checkpoint_b, config, follow_symlinks, model_prefix) or checkpoint_b
    elif not (exact_names or normalize or only or renames or renames_a or renames_b):
        # a Megatron save against its export (transformers' names): compared as export names it
        if _keeps_megatron_args(checkpoint_a) and _transformers_named(checkpoint_b, model_prefix):
            from ckpttool.commands.consolidate import as_transformers

            checkpoint_a = as_transformers(checkpoint_a, None, follow_symlinks, model_prefix) or checkpoint_a
        elif _keeps_megatron_args(checkpoint_b) and _transformers_named(checkpoint_a, model_prefix):
            from ckpttool.commands.consolidate import as_transformers

            checkpoint_b = as_transformers(checkpoint_b, None, follow_symlinks, model_prefix) or checkpoint_b
    view_a, view_b = (find_model(c, model_prefix if c.model_prefix is None else None) for c in (checkpoint_a, checkpoint_b))
    keys_a = entry_keys(checkpoint_a, normalize, rules_a, tuple(only), tuple(filters), view_a)
    keys_b = entry_keys(checkpoint_b, normalize, rules_b, tuple(only), tuple(filters), view_b)
    model_views = None
    if not (exact_names or normalize or only or renames or renames_a or renames_b) and keys_a.keys() != keys_b.keys():
        compared = _model_views(checkpoint_a, checkpoint_b, view_a, view_b, keys_a, keys_b, tuple(filters))
        if compared is not None:
            model_views, keys_a, keys_b = compared
    common = sorted(keys_a.keys() & keys_b.keys())
    only_a = tuple(_only(checkpoint_a, key, keys_a[key]) for key in sorted(keys_a.keys() - keys_b.keys()))
    only_b = tuple(_only(checkpoint_b, key, keys_b[key]) for key in sorted(keys_b.keys() - keys_a.keys()))
    hint = None
    if not normalize and model_views is None and keys_a and keys_b and not common:
        hint = _normalize_hint(checkpoint_a, checkpoint_b, rules_a, rules_b, tuple(only), tuple(filters), view_a, view_b)

    mismatches, pairs, object_pairs = _pairs(common, checkpoint_a, checkpoint_b, keys_a, keys_b)
    tolerance = (atol or 0.0, rtol or 0.0) if atol is not None or rtol is not None else None
    with DataFiles(checkpoint_a.path, follow_symlinks) as files_a, DataFiles(checkpoint_b.path, follow_symlinks) as files_b:
        side_a, side_b = _Side(files_a), _Side(files_b)
        counter = _Counter()
        with (progress or no_progress)("diff", sum(t.nbytes for _, t, _ in pairs)) as bar:
            tensors = tuple(
                compare_tensors(key, ta, tb, side_a, side_b, tolerance, block_size, counter, bar.update)
                for key, ta, tb in pairs
            )
        objects = tuple(_compare_objects(key, oa, ob, files_a, files_b) for key, oa, ob in object_pairs)
    return DiffReport(
        a=path_a, b=path_b, normalize=normalize, only=tuple(only), filters=tuple(filters),
        atol=atol, rtol=rtol, only_a=only_a, only_b=only_b, mismatches=tuple(mismatches), tensors=tensors,
        objects=objects, bytes_compared=counter.compared, bytes_shared=counter.shared,
        seconds=time.perf_counter() - started, problems_a=warnings_a, problems_b=warnings_b, hint=hint,
        model_views=model_views,
    )


def _keeps_megatron_args(checkpoint: Checkpoint) -> bool:
    """True for a local Megatron-LM checkpoint whose arguments give its config.json (a
    `torch_dist` save's common.pt, a legacy save's rank files): export needs no --assets for it,
    and neither does diff against that export. File names only."""
    from ckpttool.naming import megatron_config

    return not isinstance(checkpoint.path, RemotePath) and megatron_config.args_file_beside(checkpoint.path) is not None


def _transformers_named(checkpoint: Checkpoint, model_prefix: str | None) -> bool:
    """True when the checkpoint's model keys are no framework family's names (transformers' own)."""
    from ckpttool import naming

    view = find_model(checkpoint, model_prefix if checkpoint.model_prefix is None else None)
    return view.prefix is not None and not naming.candidates(view.keys.values())


def _check_options(only: Sequence[str], atol: float | None, rtol: float | None, block_size: int) -> None:
    unknown = sorted(set(only) - set(GROUPS))
    if unknown:
        raise UsageError(f"--only {unknown[0]!r}: choose from {', '.join(GROUPS)}")
    for name, value in (("--atol", atol), ("--rtol", rtol)):
        if value is not None and not value >= 0:
            raise UsageError(f"{name} {value}: must be a number >= 0")
    if block_size < 16 or block_size % 16:
        raise UsageError(f"block size {block_size}: must be a positive multiple of 16 bytes")


def _pairs(common: Sequence[str], checkpoint_a: Checkpoint, checkpoint_b: Checkpoint, keys_a: dict[str, str],
           keys_b: dict[str, str]) -> tuple[list, list, list]:
    """Return (mismatched entries, tensor pairs, object pairs) of the keys both sides hold."""
    mismatches, pairs, object_pairs = [], [], []
    for key in common:
        entry_a, entry_b = _entry(checkpoint_a, keys_a[key]), _entry(checkpoint_b, keys_b[key])
        found = _mismatch(key, entry_a, entry_b)
        if found:
            mismatches.append(found)
        elif isinstance(entry_a, Tensor):
            pairs.append((key, entry_a, entry_b))
        else:
            object_pairs.append((key, entry_a, entry_b))
    return mismatches, pairs, object_pairs


def entry_keys(checkpoint: Checkpoint, normalize: bool, renames: Sequence[Rename] = (),
               only: Sequence[str] = (), filters: Sequence[str] = (), view: ModelView | None = None) -> dict[str, str]:
    """Return {key: fqn} of the checkpoint's selected entries, the keys the two sides match on
    (`view`: the checkpoint's model, default `find_model`'s).

    Raises KeyCollision when two entries of one side end up with one key.

    Example:
        >>> entry_keys(dcp, normalize=True)["layers.0.fc1.weight"]
        'model.layers.0._orig_mod.fc1.weight'
    """
    names = sorted(set(checkpoint.tensors) | set(checkpoint.objects))
    view = view or find_model(checkpoint)
    chosen: dict[str, str] = {}
    for fqn in names:
        if only and view.group(fqn) not in only:
            continue
        key = fqn
        if normalize:
            key = normalise(view.keys.get(fqn) or fqn)
        for rename in renames:
            key = rename.apply(key)
        if filters and not any(fnmatch.fnmatchcase(fqn, g) or fnmatch.fnmatchcase(key, g) for g in filters):
            continue
        if key in chosen:
            raise KeyCollision(f"{checkpoint.path}: {chosen[key]} and {fqn} both become {key!r}; "
                               "adjust --rename, or leave out --normalize if it caused this")
        chosen[key] = fqn
    return chosen


def _model_views(a: Checkpoint, b: Checkpoint, view_a: ModelView, view_b: ModelView, keys_a: dict[str, str],
                 keys_b: dict[str, str], filters: tuple[str, ...]) -> tuple[str, dict[str, str], dict[str, str]] | None:
    """Return (the line saying the model views are compared, A's and B's model keys) when the
    names do not meet (or one side is a bare model the other holds with more) but the model
    views do; else None."""
    if view_a.prefix is None or view_b.prefix is None:
        return None
    bare = any(len(view.keys) == len(c.tensors) + len(c.objects) for view, c in ((view_a, a), (view_b, b)))
    if keys_a.keys() & keys_b.keys() and not bare:
        return None
    try:
        model_a = entry_keys(a, True, (), ("model",), filters, view_a)
        model_b = entry_keys(b, True, (), ("model",), filters, view_b)
    except KeyCollision:
        return None
    if not model_a.keys() & model_b.keys():
        return None
    where = " and ".join(f"{side}'s under {view.prefix}." if view.prefix else f"{side}'s at the top level"
                         for side, view in (("A", view_a), ("B", view_b)))
    return (f"compared the model views ({where}, keys as model.state_dict() names them); "
            "--exact-names compares every entry by its full name"), model_a, model_b


def _normalize_hint(a: Checkpoint, b: Checkpoint, rules_a, rules_b, only, filters, view_a=None, view_b=None) -> str | None:
    try:
        keys_a = entry_keys(a, True, rules_a, only, filters, view_a)
        keys_b = entry_keys(b, True, rules_b, only, filters, view_b)
    except KeyCollision:
        return None
    common = sorted(keys_a.keys() & keys_b.keys())
    if not common:
        return None
    return (f"no entry names in common; --normalize matches {len(common)} of them "
            f"(e.g. {keys_a[common[0]]} with {keys_b[common[0]]})")


def _entry(checkpoint: Checkpoint, fqn: str) -> Tensor | Object:
    return checkpoint.tensors.get(fqn) or checkpoint.objects[fqn]


def _only(checkpoint: Checkpoint, key: str, fqn: str) -> Only:
    entry = _entry(checkpoint, fqn)
    if isinstance(entry, Tensor):
        return Only(key, fqn, "tensor", entry.dtype, entry.shape)
    return Only(key, fqn, "object")


def _describe(entry: Tensor | Object) -> str:
    return f"tensor {entry.dtype} {list(entry.shape)}" if isinstance(entry, Tensor) else "object"


def _mismatch(key: str, a: Tensor | Object, b: Tensor | Object) -> Mismatch | None:
    if isinstance(a, Tensor) != isinstance(b, Tensor):
        return Mismatch(key, a.fqn, b.fqn, "kind", _describe(a), _describe(b))
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        return None
    if a.dtype != b.dtype:
        return Mismatch(key, a.fqn, b.fqn, "dtype", a.dtype, b.dtype)
    if a.shape != b.shape:
        return Mismatch(key, a.fqn, b.fqn, "shape", str(list(a.shape)), str(list(b.shape)))
    return None


# ---------------------------------------------------------------------------------------------
# Tensors: regions where a chunk of A meets a chunk of B, read slab by slab


class _Counter:
    compared = 0
    shared = 0


class _Side:
    """One checkpoint's data files; fills a buffer with a region's row-major bytes."""

    def __init__(self, files: DataFiles):
        self.files = files
        self._decoded: tuple[tuple, bytes] | None = None  # the last chunk that had to be decoded

    def identity(self, raw: RawData) -> tuple:
        """(device, inode, offset): equal on both sides only for the very same bytes on disk
        (for object storage: the object's URL and the offset)."""
        if not self.files.local:
            return str(self.files.path(raw.file)), raw.offset
        status = os.fstat(self.files.fd(raw.file))
        return status.st_dev, status.st_ino, raw.offset

    def fill(self, tensor: Tensor, chunk: Chunk, raw: RawData | None, region: Box, view: memoryview) -> None:
        position = 0
        runs = row_major_runs((chunk.offsets, chunk.sizes), region, tensor.itemsize)
        if raw is None:  # zstd, strided or big-endian blob: decoded whole (as validate --deep does)
            key = (tensor.fqn, chunk.offsets)
            if self._decoded is None or self._decoded[0] != key:
                self._decoded = None
                self._decoded = (key, read_chunk(self.files, tensor, chunk))
            data = self._decoded[1]
            for offset, length in runs:
                view[position:position + length] = data[offset:offset + length]
                position += length
            return
        for offset, length in runs:
            self.files.read_into(raw.file, raw.offset + offset, view[position:position + length])
            position += length


def compare_tensors(key: str, a: Tensor, b: Tensor, side_a: _Side, side_b: _Side,
                    tolerance: tuple[float, float] | None, block_size: int, counter: _Counter,
                    on_done=lambda count: None) -> TensorDiff:
    """Return how two tensors of one dtype and shape differ, reading both slab by slab."""
    found = _Elements(a.dtype, a.shape, tolerance)
    itemsize = a.itemsize
    buffer_a, buffer_b = bytearray(min(block_size, a.nbytes)), bytearray(min(block_size, a.nbytes))
    located_a: dict[int, RawData | None] = {}
    located_b: dict[int, RawData | None] = {}
    for i, j, region in overlapping_boxes([c[:2] for c in a.chunks], [c[:2] for c in b.chunks]):
        if i not in located_a:
            located_a[i] = locate(side_a.files, a, a.chunks[i])
        if j not in located_b:
            located_b[j] = locate(side_b.files, b, b.chunks[j])
        raw_a, raw_b = located_a[i], located_b[j]
        chunk_a, chunk_b = a.chunks[i], b.chunks[j]
        nbytes = volume(region[1]) * itemsize
        if (raw_a is not None and raw_b is not None and chunk_a[:2] == chunk_b[:2]
                and side_a.identity(raw_a) == side_b.identity(raw_b)):
            counter.shared += nbytes  # one byte range of one file: the same bytes, nothing to read
            on_done(nbytes)
            continue
        for slab in slabs(region, itemsize, block_size):
            length = volume(slab[1]) * itemsize
            view_a, view_b = memoryview(buffer_a)[:length], memoryview(buffer_b)[:length]
            side_a.fill(a, chunk_a, raw_a, slab, view_a)
            side_b.fill(b, chunk_b, raw_b, slab, view_b)
            found.add(view_a, view_b, slab)
            counter.compared += length
            on_done(length)
    return TensorDiff(key, a.fqn, b.fqn, a.dtype, a.shape, **found.result())


class _Elements:
    """Accumulates, slab by slab, which elements differ and by how much."""

    def __init__(self, dtype: str, shape: tuple[int, ...], tolerance: tuple[float, float] | None):
        self.dtype, self.shape, self.tolerance = dtype, shape, tolerance
        self.itemsize = dtypes.ITEMSIZE[dtype]
        self.floating = dtype in numerics.DECODED
        self.differing = self.non_finite = self.beyond = 0
        self.first: tuple[int, tuple[int, ...]] | None = None  # (flat index, index)
        self.max_abs: float | None = None
        self.max_rel: float | None = None

    def add(self, a: memoryview, b: memoryview, slab: Box) -> None:
        bits_a, bits_b = numerics.element_bits(a, self.itemsize), numerics.element_bits(b, self.itemsize)
        unequal = bits_a != bits_b
        if unequal.ndim > 1:  # 16-byte elements, compared as two 8-byte words
            unequal = unequal.any(axis=1)
        positions = np.flatnonzero(unequal)
        if not positions.size:
            return
        self.differing += int(positions.size)
        local = tuple(int(i) for i in np.unravel_index(int(positions[0]), slab[1])) if slab[1] else ()
        index = tuple(o + i for o, i in zip(slab[0], local))
        flat = sum(i * math.prod(self.shape[d + 1:]) for d, i in enumerate(index))
        if self.first is None or flat < self.first[0]:
            self.first = (flat, index)
        if not self.floating:
            self.beyond += int(positions.size)
            return
        x, y = numerics.as_float64(bits_a[positions], self.dtype), numerics.as_float64(bits_b[positions], self.dtype)
        finite = np.isfinite(x) & np.isfinite(y)
        self.non_finite += int(positions.size - np.count_nonzero(finite))
        x, y = x[finite], y[finite]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            gap = np.abs(x - y)
            relative = np.where(gap == 0, 0.0, gap / np.abs(y))
        if gap.size:
            self.max_abs = max(self.max_abs or 0.0, float(gap.max()))
            self.max_rel = max(self.max_rel or 0.0, float(relative.max()))
        if self.tolerance is None:
            self.beyond += int(positions.size)
        else:
            atol, rtol = self.tolerance
            self.beyond += int(positions.size - np.count_nonzero(gap <= atol + rtol * np.abs(y)))

    def result(self) -> dict[str, Any]:
        return {
            "differing": self.differing, "first_index": self.first[1] if self.first else None,
            "max_abs": self.max_abs, "max_rel": self.max_rel, "non_finite": self.non_finite,
            "within_tolerance": bool(self.differing) and self.tolerance is not None and not self.beyond,
        }


# ---------------------------------------------------------------------------------------------
# Objects: decoded values, compared bit-exactly


def _compare_objects(key: str, a: Object, b: Object, files_a: DataFiles, files_b: DataFiles) -> ObjectDiff:
    value_a, value_b = _object_value(files_a, a), _object_value(files_b, b)
    equal = same_value(value_a, value_b)
    return ObjectDiff(key, a.fqn, b.fqn, equal, "" if equal else _brief(value_a), "" if equal else _brief(value_b))


def _object_value(files: DataFiles, entry: Object) -> Any:
    where = f"{files.path(entry.blob.file) if entry.blob else files.root}: {entry.fqn}"
    return decode_object(object_bytes(files, entry), where)


def same_value(x: Any, y: Any) -> bool:
    """True when two decoded values are equal bit for bit: same types all the way down,
    floats by their bits (NaN equals NaN, -0.0 differs from 0.0), tensors by dtype, shape
    and bytes.

    Example:
        >>> same_value({"lr": 1e-3, "betas": (0.9, 0.95)}, {"lr": 1e-3, "betas": (0.9, 0.95)})
        True
    """
    if type(x) is not type(y):
        return False
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(same_value(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(same_value(p, q) for p, q in zip(x, y))
    if isinstance(x, float):
        return struct.pack("<d", x) == struct.pack("<d", y)
    if type(x).__module__.startswith("torch") and hasattr(x, "dtype") and hasattr(x, "shape"):
        return x.dtype == y.dtype and tuple(x.shape) == tuple(y.shape) and tensor_bytes(x) == tensor_bytes(y)
    if type(x).__module__ == "numpy" and hasattr(x, "tobytes"):  # arrays and scalars (an RNG state's)
        return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
    try:
        return bool(x == y)
    except Exception:  # a type whose == is elementwise or refuses: not provably equal
        return False


def _brief(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
