"""Manifests: the SHA-256 of every tensor's logical bytes, the same whatever the layout.

A manifest names each tensor (as `model.state_dict()` names it: the model view, or every
entry with `--all`), its dtype, shape and the SHA-256 of its row-major bytes as stored (never
cast). Those bytes do not depend on how the tensor was split, so a DCP checkpoint at any world
size, its reshard, its consolidated `.safetensors` and its Hub export have equal manifests.

Hashing is planned as pure data (`plan_tensor`: per tensor the steps that produce its bytes
in row-major order), then run (`hash_tensors`) a tensor per task, tensors in parallel:

- `Stream`: a run of a chunk's raw bytes that is also a run of the row-major tensor (FSDP's
  dim-0 chunks: whole rows), hashed as it is read, `HASH_BLOCK` at a time;
- `Block`: rows of the tensor assembled in one buffer from the chunks that cross them (2-D
  or block sharding: each chunk's rows are one contiguous range of its raw bytes), then
  hashed. A block holds at most `--max-memory`'s share of rows (at least one row); a chunk
  whose blob must be decoded (zstd, strided) is read whole, as consolidate's `Gather` does.

Example:
    >>> plans = [plan_tensor(key, tensor, located[tensor.fqn]) for key, tensor in tensors.items()]
    >>> digests = hash_tensors(plans, files, threads=4, max_memory=512 << 20)
    >>> Manifest.of(tensors, digests).digest
    'sha256:5e1c...'
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from ckpttool.core.checkpoint import Tensor
from ckpttool.dcp.blobs import DataFiles, RawData, read_chunk
from ckpttool.core.errors import UsageError
from ckpttool.store.io import Task, run_tasks, thread_buffer
from ckpttool.plan import unique_chunks

SCHEMA = "ckpttool.manifest/1"
FILENAME = "manifest.json"  # what `export --manifest` writes into the folder
ALGORITHM = "sha256"
HASH_BLOCK = 8 << 20  # bytes read and hashed per step of a Stream (hashlib releases the GIL above 2 KiB)
BLOCK_BYTES = 16 << 20  # row-major bytes assembled per Block, unless the budget is smaller
MAX_MANIFEST_BYTES = 256 << 20  # a manifest read back: about a million tensors
ENTRIES = ("model", "all")  # what a manifest covers: the model view, or every tensor entry (--all)
_HEX = frozenset("0123456789abcdef")


# ---------------------------------------------------------------------------------------------
# The plan: per tensor, the steps that give its bytes in row-major order


@dataclass(frozen=True)
class Stream:
    """`length` raw bytes at `offset` of data file `file`: the next run of the tensor's bytes."""

    file: str
    offset: int
    length: int

    @property
    def nbytes(self) -> int:
        return self.length

    @property
    def memory(self) -> int:
        return min(self.length, HASH_BLOCK)


@dataclass(frozen=True)
class Part:
    """Rows [start, stop) of chunk `chunk` (counted from the chunk's first row): a contiguous
    range of its raw bytes at `source`, or of its decoded bytes when `source` is None."""

    chunk: int
    source: RawData | None
    start: int
    stop: int


@dataclass(frozen=True)
class Block:
    """Rows [start, stop) of the tensor, assembled from `parts` (together they cover them)."""

    start: int
    stop: int
    row_bytes: int
    parts: tuple[Part, ...]

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.row_bytes


@dataclass(frozen=True)
class TensorPlan:
    """How to hash one tensor: `steps` in row-major order; `decoded` the bytes of chunks read whole."""

    key: str
    tensor: Tensor
    steps: tuple[Stream | Block, ...]
    decoded: int = 0

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    @property
    def memory(self) -> int:
        """The buffer bytes hashing it holds at once: a block and one part of it, or a stream's
        read buffer, and the chunks decoded whole."""
        most = max((2 * s.nbytes if isinstance(s, Block) else s.memory for s in self.steps), default=0)
        return most + self.decoded


def _box(tensor: Tensor, index: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return a chunk's (offsets, sizes), a 0-d tensor's as one row of one element."""
    chunk = tensor.chunks[index]
    return ((0,), (1,)) if not tensor.shape else (tuple(chunk.offsets), tuple(chunk.sizes))


def plan_tensor(key: str, tensor: Tensor, located: Mapping[int, RawData | None],
                block_bytes: int = BLOCK_BYTES) -> TensorPlan:
    """Return the plan that hashes `tensor`'s row-major bytes (pure: reads nothing).

    `located` holds each distinct chunk's raw bytes (`locating.locate_chunks`; None: decode).
    The rows are cut where any chunk starts or ends on dim 0; a band of rows that one chunk
    holds whole (all of dims 1..) is a `Stream` of its raw bytes, any other band `Block`s of
    at most `block_bytes` (and at least one row).

    Example:
        >>> plan_tensor("w", fsdp_tensor, located).steps        # 3 ranks, dim-0 shards
        (Stream('__0_0.distcp', 1216, 160), Stream('__1_0.distcp', 1216, 160), Stream('__2_0.distcp', 1216, 96))
    """
    if tensor.numel == 0:
        return TensorPlan(key, tensor, ())
    shape = tensor.shape or (1,)
    row_bytes = math.prod(shape[1:]) * tensor.itemsize
    indices = unique_chunks(tensor)
    boxes = {index: _box(tensor, index) for index in indices}
    cuts = sorted({0, shape[0], *(o[0] for o, _ in boxes.values()), *(o[0] + s[0] for o, s in boxes.values())})
    by_start = sorted(indices, key=lambda index: boxes[index][0][0])
    steps: list[Stream | Block] = []
    decoded: dict[int, int] = {}
    active: list[int] = []
    upcoming = 0
    for low, high in zip(cuts, cuts[1:]):
        while upcoming < len(by_start) and boxes[by_start[upcoming]][0][0] <= low:
            active.append(by_start[upcoming])
            upcoming += 1
        active = [index for index in active if boxes[index][0][0] + boxes[index][1][0] > low]
        if len(active) == 1 and boxes[active[0]][1][1:] == tuple(shape[1:]) and (raw := located[active[0]]) is not None:
            first = boxes[active[0]][0][0]
            _add_stream(steps, Stream(raw.file, raw.offset + (low - first) * row_bytes, (high - low) * row_bytes))
            continue
        rows = max(1, block_bytes // max(1, row_bytes))
        for start in range(low, high, rows):
            stop = min(high, start + rows)
            parts = []
            for index in sorted(active, key=lambda index: boxes[index][0]):
                first = boxes[index][0][0]
                parts.append(Part(index, located[index], start - first, stop - first))
                if located[index] is None:
                    decoded[index] = tensor.chunks[index].numel * tensor.itemsize
            steps.append(Block(start, stop, row_bytes, tuple(parts)))
    return TensorPlan(key, tensor, tuple(steps), sum(decoded.values()))


def _add_stream(steps: list[Stream | Block], stream: Stream) -> None:
    """Append `stream`, joined to the previous step when it continues it in the same file."""
    last = steps[-1] if steps else None
    if isinstance(last, Stream) and last.file == stream.file and last.offset + last.length == stream.offset:
        steps[-1] = Stream(last.file, last.offset, last.length + stream.length)
    else:
        steps.append(stream)


# ---------------------------------------------------------------------------------------------
# Running the plans


def hash_tensors(plans: Iterable[TensorPlan], files: DataFiles, *, threads: int, max_memory: int,
                 on_done: Callable[[int], None] | None = None) -> dict[str, str]:
    """Return key -> SHA-256 (hex) of each plan's tensor, hashed `threads` tensors at a time
    under `max_memory` bytes of buffers (`io.run_tasks`), the largest first; `on_done(bytes)`
    after each tensor."""
    digests: dict[str, str] = {}

    def task(plan: TensorPlan) -> Task:
        def run() -> int:
            digests[plan.key] = hash_plan(plan, files).hexdigest()
            return plan.nbytes

        return Task(run, plan.memory)

    ordered = sorted(plans, key=lambda plan: (-plan.nbytes, plan.key))
    run_tasks((task(plan) for plan in ordered), threads, max_memory, on_done)
    return digests


def hash_plan(plan: TensorPlan, files: DataFiles) -> Any:
    """Return the hashlib object fed with the tensor's row-major bytes, step by step."""
    digest = hashlib.sha256()
    decoded: dict[int, bytes] = {}
    for step in plan.steps:
        if isinstance(step, Stream):
            size = min(step.length, HASH_BLOCK)
            buffer = memoryview(thread_buffer(size, "hash"))[:size]
            for piece in files.pieces(step.file, step.offset, step.length, buffer):
                digest.update(piece)
            continue
        digest.update(_assemble(plan.tensor, step, files, decoded))
        for index in [index for index in decoded if _box(plan.tensor, index)[0][0] + _box(plan.tensor, index)[1][0] <= step.stop]:
            del decoded[index]  # its last rows are hashed
    return digest


def _byte_shape(rows: int, sizes: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Return the shape of `rows` rows of a box of `sizes`, as bytes (the last dim times itemsize)."""
    if len(sizes) <= 1:
        return (rows, itemsize)
    return (rows, *sizes[1:-1], sizes[-1] * itemsize)


def _assemble(tensor: Tensor, block: Block, files: DataFiles, decoded: dict[int, bytes]) -> memoryview:
    """Return the block's row-major bytes, built in this thread's block buffer from its parts."""
    import numpy as np

    shape, itemsize = tensor.shape or (1,), tensor.itemsize
    rows = block.stop - block.start
    window = memoryview(thread_buffer(block.nbytes, "hash-block"))[:block.nbytes]
    target = np.frombuffer(window, dtype=np.uint8).reshape(_byte_shape(rows, shape, itemsize))
    for part in block.parts:
        offsets, sizes = _box(tensor, part.chunk)
        chunk_row = math.prod(sizes[1:]) * itemsize
        count = part.stop - part.start
        if part.source is not None:
            piece = memoryview(thread_buffer(count * chunk_row, "hash-part"))[:count * chunk_row]
            files.read_into(part.source.file, part.source.offset + part.start * chunk_row, piece)
        else:
            if part.chunk not in decoded:
                decoded[part.chunk] = read_chunk(files, tensor, tensor.chunks[part.chunk])
            piece = memoryview(decoded[part.chunk])[part.start * chunk_row:part.stop * chunk_row]
        source = np.frombuffer(piece, dtype=np.uint8).reshape(_byte_shape(count, sizes, itemsize))
        at = offsets[0] + part.start - block.start
        where: tuple[slice, ...] = (slice(at, at + count),)
        if len(shape) > 1:
            where += tuple(slice(o, o + s) for o, s in zip(offsets[1:-1], sizes[1:-1]))
            where += (slice(offsets[-1] * itemsize, (offsets[-1] + sizes[-1]) * itemsize),)
        target[where] = source
    return window


def hash_file(files: DataFiles, relative: str) -> str:
    """Return the SHA-256 (hex) of a whole data file, streamed."""
    digest = hashlib.sha256()
    size = files.size(relative)
    buffer = memoryview(thread_buffer(min(max(size, 1), HASH_BLOCK), "hash"))[:min(max(size, 1), HASH_BLOCK)]
    for piece in files.pieces(relative, 0, size, buffer):
        digest.update(piece)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# The document


@dataclass(frozen=True)
class Entry:
    """One tensor of a manifest."""

    dtype: str
    shape: tuple[int, ...]
    sha256: str

    def document(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "sha256": self.sha256, "shape": list(self.shape)}


@dataclass(frozen=True)
class FileEntry:
    """One data file of a manifest made with --files."""

    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """Tensors by key (and, optionally, data files by name) with their SHA-256s; `entries`
    says what was covered ("model" or "all")."""

    tensors: Mapping[str, Entry]
    entries: str = "model"
    files: Mapping[str, FileEntry] | None = None
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", dict(sorted(self.tensors.items())))
        if self.files is not None:
            object.__setattr__(self, "files", dict(sorted(self.files.items())))
        object.__setattr__(self, "digest", tensors_digest(self.tensors))

    @classmethod
    def of(cls, tensors: Mapping[str, Tensor], digests: Mapping[str, str], entries: str = "model",
           files: Mapping[str, FileEntry] | None = None) -> "Manifest":
        """Return the manifest of `tensors` (key -> tensor) hashed to `digests` (key -> hex)."""
        return cls({key: Entry(t.dtype, tuple(t.shape), digests[key]) for key, t in tensors.items()}, entries, files)

    def document(self) -> dict[str, Any]:
        """Return the `ckpttool.manifest/1` document (what `to_json` writes)."""
        document: dict[str, Any] = {"schema": SCHEMA, "hash": ALGORITHM, "entries": self.entries, "digest": self.digest,
                                    "tensors": {key: entry.document() for key, entry in self.tensors.items()}}
        if self.files is not None:
            document["files"] = {name: {"bytes": f.bytes, "sha256": f.sha256} for name, f in self.files.items()}
        return document

    def to_json(self) -> bytes:
        """Return the manifest as stable JSON: sorted keys, one line per tensor and per file."""
        document = self.document()
        lines = ["{"]
        items = sorted(document.items())
        for position, (name, value) in enumerate(items):
            comma = "," if position < len(items) - 1 else ""
            if isinstance(value, dict):
                lines.append(f"  {json.dumps(name)}: {{")
                rows = list(value.items())
                lines += [f"    {json.dumps(key)}: {json.dumps(row, sort_keys=True)}" + ("," if i < len(rows) - 1 else "")
                          for i, (key, row) in enumerate(rows)]
                lines.append("  }" + comma)
            else:
                lines.append(f"  {json.dumps(name)}: {json.dumps(value)}{comma}")
        lines.append("}")
        return ("\n".join(lines) + "\n").encode("ascii")


def tensors_digest(tensors: Mapping[str, Entry]) -> str:
    """Return `sha256:` + the SHA-256 of the tensors' entries as canonical JSON (sorted keys, no
    spaces), the manifest's fingerprint: `python -c` can recompute it from the document."""
    canonical = json.dumps({key: entry.document() for key, entry in sorted(tensors.items())},
                           sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{ALGORITHM}:{hashlib.sha256(canonical.encode('ascii')).hexdigest()}"


def parse(data: bytes, where: str) -> Manifest:
    """Return the manifest in `data` (a `ckpttool.manifest/1` document), every field checked;
    UsageError naming `where` for anything else. A stated digest must match its tensors."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise UsageError(f"{where}: {len(data)} bytes, larger than any manifest ({MAX_MANIFEST_BYTES}); not a manifest")
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError) as error:
        raise UsageError(f"{where}: not JSON ({error}); expected a {SCHEMA} manifest (`ckpttool manifest`)") from None
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        raise UsageError(f"{where}: not a {SCHEMA} manifest (`ckpttool manifest SRC -o FILE` writes one)")
    tensors = document.get("tensors")
    if document.get("hash") != ALGORITHM or document.get("entries") not in ENTRIES or not isinstance(tensors, dict):
        raise UsageError(f"{where}: malformed manifest: needs hash {ALGORITHM!r}, entries in {ENTRIES}, a tensors object")
    entries = {key: _entry(key, value, where) for key, value in tensors.items()}
    files = document.get("files")
    if files is not None and not (isinstance(files, dict) and all(
            isinstance(f, dict) and type(f.get("bytes")) is int and _is_hex(f.get("sha256")) for f in files.values())):
        raise UsageError(f"{where}: malformed manifest: files must map names to {{bytes, sha256}}")
    manifest = Manifest(entries, document["entries"],
                        None if files is None else {name: FileEntry(f["bytes"], f["sha256"]) for name, f in files.items()})
    if document.get("digest") is not None and document["digest"] != manifest.digest:
        raise UsageError(f"{where}: its digest {str(document['digest'])[:80]} does not match its tensors "
                         f"({manifest.digest}): the manifest was edited or damaged")
    return manifest


def _entry(key: Any, value: Any, where: str) -> Entry:
    if not (isinstance(value, dict) and isinstance(value.get("dtype"), str) and _is_hex(value.get("sha256"))
            and isinstance(value.get("shape"), list) and all(type(d) is int and d >= 0 for d in value["shape"])):
        raise UsageError(f"{where}: malformed manifest entry {str(key)[:120]!r}: needs dtype, shape and a hex sha256")
    return Entry(value["dtype"], tuple(value["shape"]), value["sha256"])


def _is_hex(text: Any) -> bool:
    return isinstance(text, str) and len(text) == 64 and set(text) <= _HEX


# ---------------------------------------------------------------------------------------------
# Comparing


@dataclass(frozen=True)
class Difference:
    """A way a checkpoint differs from a manifest: `kind` is `sha256` (the bytes), `dtype`,
    `shape`, `missing` (in the manifest, not the checkpoint) or `extra` (the other way)."""

    key: str
    kind: str
    expected: str | None
    actual: str | None


@dataclass(frozen=True)
class TiedKey:
    """A key one side lacks whose bytes, dtype and shape equal another key both sides hold
    (a tied head the Hub convention leaves out): `absent` is "checkpoint" or "manifest"."""

    key: str
    same_as: str
    absent: str


def compare(expected: Manifest, actual: Manifest, may_tie: Callable[[str, str], bool] = lambda absent, kept: False,
            ) -> tuple[tuple[Difference, ...], tuple[TiedKey, ...]]:
    """Return how `actual` differs from `expected`, in key order, and the keys one side lacks
    that are tied to a key both sides hold equally (not differences): only pairs `may_tie(absent
    key, kept key)` accepts (an embedding and its head: equal bytes alone could be two zero biases).

    Example:
        >>> compare(manifest, manifest)
        ((), ())
    """
    differences: list[Difference] = []
    ties: list[TiedKey] = []
    shared: dict[Entry, list[str]] = {}
    for key in sorted(expected.tensors.keys() & actual.tensors.keys()):
        if expected.tensors[key] == actual.tensors[key]:
            shared.setdefault(expected.tensors[key], []).append(key)
    for key in sorted(expected.tensors.keys() | actual.tensors.keys()):
        want, got = expected.tensors.get(key), actual.tensors.get(key)
        if want is not None and got is not None:
            for kind in ("dtype", "shape", "sha256"):
                if getattr(want, kind) != getattr(got, kind):
                    differences.append(Difference(key, kind, _text(getattr(want, kind)), _text(getattr(got, kind))))
                    break
            continue
        entry = want if want is not None else got
        assert entry is not None  # the key is in one manifest or the other
        same = next((kept for kept in shared.get(entry, ()) if may_tie(key, kept)), None)
        absent = "checkpoint" if got is None else "manifest"
        if same is not None:
            ties.append(TiedKey(key, same, absent))
        else:
            differences.append(Difference(key, "missing" if got is None else "extra", _describe(want), _describe(got)))
    return tuple(differences), tuple(ties)


def _text(value: Any) -> str:
    return "x".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _describe(entry: Entry | None) -> str | None:
    return None if entry is None else f"{entry.dtype} {_text(entry.shape) or 'scalar'} sha256:{entry.sha256[:16]}"
