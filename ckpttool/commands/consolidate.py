"""`consolidate`: export a sharded DCP checkpoint to one full state dict, streaming.

The pipeline: read `.metadata` -> choose keys and dtypes -> locate each chunk's raw bytes in
the `.distcp` files -> plan (a `ConsolidatePlan`: output files, headers and the Copy / Convert
/ Gather operations) -> run the operations on a thread pool into temporary files -> optional
`--verify` -> fsync and rename. Memory holds only the buffers of running operations: FSDP's
dim-0 chunks move with `copy_file_range` and never enter user space.

Example:
    >>> report = consolidate("runs/gpt/step-00000200", "gpt.safetensors")
    >>> report.tensors, report.files
    (42, (PosixPath('gpt.safetensors'),))
"""

from __future__ import annotations

import errno
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ckpttool import dtypes, integrity
from ckpttool.dcp.blobs import DataFiles, RawData, blob_bytes, iter_blocks, load_torch_bytes, locate, read_chunk
from ckpttool.dcp.metadata import Checkpoint, Tensor, read_checkpoint
from ckpttool.errors import (
    CorruptBlob,
    CorruptMetadata,
    UsageError,
    VerificationFailed,
    WriteFailed,
)
from ckpttool.formats import hub, safetensors, torch_pt
from ckpttool.io import DEFAULT_MAX_MEMORY, DEFAULT_THREADS, ProgressFactory, Task, no_progress, atomic_directory, atomic_output, check_destination, copy_range, parse_size, run_tasks, thread_buffer, write_at
from ckpttool.keys import KeyRules, Rename, match_dtype, normalise, output_keys
from ckpttool.plan import (
    ConsolidatePlan,
    Convert,
    Copy,
    Gather,
    Operation,
    OutputFile,
    OutputObject,
    OutputTensor,
    Tie,
    plan_tensor,
    target_dtype,
    unique_chunks,
)

DTYPE_CHOICES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
VERIFY_BLOCK = 16 << 20

# Known tied pairs (embedding <-> output projection): transformers' `_tied_weights_keys`
# names the head side, which the Hub convention drops from the file.
EMBEDDING_KEY = re.compile(r"(^|\.)(embed\w*|wte|tok_emb\w*|word_embeddings|shared)\.weight$")
HEAD_KEY = re.compile(r"(^|\.)(lm_head|head|output|decoder|out_proj)\.weight$")


@dataclass(frozen=True)
class ConsolidateReport:
    """What consolidate wrote (or, with dry_run, would write)."""

    source: Path
    output: Path
    format: str
    files: tuple[Path, ...]
    tensors: int
    objects: int
    tensor_bytes: int
    seconds: float
    plan: ConsolidatePlan
    ties: tuple[Tie, ...] = ()
    dropped: tuple[str, ...] = ()
    dry_run: bool = False
    verified: bool = False

    @property
    def throughput(self) -> float:
        """Bytes per second of tensor data written."""
        return self.tensor_bytes / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class OutputFormat:
    kind: str  # "safetensors" | "torch"
    sharded: bool
    max_shard_size: int | None


def output_format(out: Path, max_shard_size: str | int | None) -> OutputFormat:
    """Return the format OUT asks for: `*.safetensors` one file, `*.pt`/`*.bin` torch.save,
    a directory (anything else) sharded safetensors with an index."""
    suffix = out.suffix.lower()
    if suffix == safetensors.SUFFIX:
        if max_shard_size is not None:
            raise UsageError(f"{out}: --max-shard-size writes shards into a directory; give a directory, not a .safetensors file")
        return OutputFormat("safetensors", False, None)
    if suffix in torch_pt.SUFFIXES:
        if max_shard_size is not None:
            raise UsageError(f"{out}: --max-shard-size applies to sharded safetensors output (a directory)")
        return OutputFormat("torch", False, None)
    size = parse_size(max_shard_size if max_shard_size is not None else hub.DEFAULT_MAX_SHARD_SIZE)
    if size <= 0:
        raise UsageError("--max-shard-size must be positive")
    return OutputFormat("safetensors", True, size)


def parse_dtype(name: str, option: str = "--dtype") -> str:
    """Return the torch dtype name for `bf16|fp16|fp32` (or a torch spelling of them)."""
    canonical = DTYPE_CHOICES.get(name.lower())
    if canonical is None:
        try:
            canonical = dtypes.canonical(name.lower())
        except KeyError:
            canonical = None
    if canonical not in DTYPE_CHOICES.values():
        raise UsageError(f"{option} {name!r}: choose one of {', '.join(DTYPE_CHOICES)}")
    return canonical


def parse_dtype_map(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """Return (glob, dtype) pairs from `GLOB=DTYPE` strings."""
    pairs = []
    for item in items:
        glob, separator, name = item.rpartition("=")
        if not separator or not glob:
            raise UsageError(f"--dtype-map {item!r}: expected 'GLOB=DTYPE', e.g. '*norm*=fp32'")
        pairs.append((glob, parse_dtype(name, "--dtype-map")))
    return tuple(pairs)


def consolidate(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    everything: bool = False,
    filters: Sequence[str] = (),
    keep_keys: bool = False,
    renames: Sequence[str] = (),
    dtype: str | None = None,
    dtype_map: Sequence[str] = (),
    drop_tied: bool = False,
    max_shard_size: str | int | None = None,
    max_memory: str | int = DEFAULT_MAX_MEMORY,
    threads: int = DEFAULT_THREADS,
    force: bool = False,
    dry_run: bool = False,
    verify: bool = False,
    progress: ProgressFactory | None = None,
) -> ConsolidateReport:
    """Return a report after writing the checkpoint at `src` as one full state dict at `out`.

    `out` ending in `.safetensors` is one file; `.pt`/`.bin` a torch.save nested dict; any
    other path a directory of `model-0000K-of-0000N.safetensors` shards plus
    `model.safetensors.index.json` (huggingface_hub's layout; one shard is `model.safetensors`).
    Model weights only, keys as `model.state_dict()` names them, unless `everything`.
    Nothing is left at `out` unless the whole export (and `verify`) succeeded.

    Example:
        >>> consolidate("ckpt/step-00000100", "model.safetensors", dtype="bf16").tensor_bytes
        1048576
    """
    started = time.perf_counter()
    source = Path(src)
    target = Path(out)
    kind = output_format(target, max_shard_size)
    memory_budget = parse_size(max_memory)
    rules = KeyRules(everything, not keep_keys, tuple(Rename.parse(r) for r in renames), tuple(filters))
    default_dtype = parse_dtype(dtype) if dtype else None
    per_key_dtype = parse_dtype_map(dtype_map)
    if not dry_run:
        check_destination(target, force)
    checkpoint = read_checkpoint(source)
    integrity.gate(checkpoint)
    progress = progress or no_progress

    with DataFiles(checkpoint.path) as files:
        plan = build_plan(
            checkpoint, files, target.name, kind, rules, default_dtype, per_key_dtype, drop_tied, threads
        )
        if dry_run:
            return _report(checkpoint, target, plan, started, dry_run=True)
        written = _execute(checkpoint, files, plan, target, force, kind, memory_budget, threads, verify, progress)
    return _report(checkpoint, target, plan, started, files=written, verified=verify)


def _report(checkpoint: Checkpoint, target: Path, plan: ConsolidatePlan, started: float, *,
            files: tuple[Path, ...] = (), dry_run: bool = False, verified: bool = False) -> ConsolidateReport:
    return ConsolidateReport(
        source=checkpoint.path, output=target, format=plan.format, files=files,
        tensors=len(plan.tensors), objects=len(plan.objects), tensor_bytes=plan.tensor_bytes,
        seconds=time.perf_counter() - started, plan=plan, ties=plan.ties, dropped=plan.dropped,
        dry_run=dry_run, verified=verified,
    )


# ---------------------------------------------------------------------------------------------
# Planning


def build_plan(
    checkpoint: Checkpoint,
    files: DataFiles,
    name: str,
    kind: OutputFormat,
    rules: KeyRules,
    dtype: str | None,
    dtype_map: tuple[tuple[str, str], ...],
    drop_tied: bool,
    threads: int = DEFAULT_THREADS,
) -> ConsolidatePlan:
    """Return the plan: keys, dtypes, output files and operations (reads only blob headers)."""
    source = str(checkpoint.path)
    fqns = list(checkpoint.tensors) + list(checkpoint.objects)
    chosen = output_keys(fqns, rules, checkpoint.nesting)
    # the order the state dict was saved in (planner_data keeps it: `model.state_dict()`
    # order), so shards group tensors as save_pretrained would; sorted when unknown
    saved_order = {fqn: position for position, fqn in enumerate(checkpoint.nesting)}
    chosen = dict(sorted(chosen.items(), key=lambda item: (saved_order.get(item[1], len(saved_order)), item[0])))
    tensor_keys = {key: fqn for key, fqn in chosen.items() if fqn in checkpoint.tensors}
    object_keys = {key: fqn for key, fqn in chosen.items() if fqn in checkpoint.objects}
    if not tensor_keys and not object_keys:
        what = "--filter matched nothing" if rules.filters else "the checkpoint has no `model` entries (use --all)"
        raise UsageError(f"{source}: nothing to export: {what}")
    if object_keys and kind.kind == "safetensors":
        names = ", ".join(sorted(object_keys)[:4]) + (", ..." if len(object_keys) > 4 else "")
        raise UsageError(
            f"{source}: {len(object_keys)} selected entries are python objects, not tensors ({names}); "
            "safetensors holds tensors only: write a .pt file, or leave them out with --filter"
        )
    located = locate_chunks(files, [checkpoint.tensors[f] for f in tensor_keys.values()], threads)
    ties = find_ties(files, {k: checkpoint.tensors[f] for k, f in tensor_keys.items()}, located)
    dropped = tuple(sorted(t.dropped for t in ties)) if drop_tied else ()
    for key in dropped:
        del tensor_keys[key]

    paths = _paths(checkpoint, chosen, rules, kind)
    wanted = {
        key: target_dtype(checkpoint.tensors[fqn].dtype, match_dtype(key, dtype_map, dtype))
        for key, fqn in tensor_keys.items()
    }
    shapes = {key: checkpoint.tensors[fqn].shape for key, fqn in tensor_keys.items()}

    output_files: list[OutputFile] = []
    offsets: dict[str, tuple[str, int]] = {}
    index_name = index = None
    zip_layouts: dict = {}
    if kind.kind == "safetensors":
        if kind.sharded:
            sizes = {key: dtypes.ITEMSIZE[wanted[key]] * _numel(shapes[key]) for key in tensor_keys}
            split = hub.plan_shards(sizes, kind.max_shard_size)
            groups = split.files
            index_name, index = split.index_name, split.index
        else:
            groups = {name: tuple(tensor_keys)}
        for file_name, keys in groups.items():
            layout = safetensors.layout_file([(k, wanted[k], shapes[k]) for k in keys])
            output_files.append(OutputFile(file_name, layout.size, layout.header, tuple(keys)))
            offsets.update({k: (file_name, layout.offsets[k]) for k in keys})
    else:
        values = load_objects(checkpoint, files, object_keys)
        pickled = torch_pt.pickle_state(
            [(paths[k], wanted[k], shapes[k]) for k in tensor_keys],
            [(paths[k], values[k]) for k in object_keys],
        )
        layout = torch_pt.layout_zip(pickled, [dtypes.ITEMSIZE[wanted[k]] * _numel(shapes[k]) for k in tensor_keys])
        output_files.append(OutputFile(name, layout.size, b"", tuple(tensor_keys)))
        offsets = {k: (name, layout.data_offsets[i]) for i, k in enumerate(tensor_keys)}
        zip_layouts[name] = layout

    tensors = []
    for key, fqn in tensor_keys.items():
        tensor = checkpoint.tensors[fqn]
        file_name, offset = offsets[key]
        operations = plan_tensor(tensor, located[fqn], wanted[key], file_name, offset)
        tensors.append(OutputTensor(key, fqn, paths[key], tensor.dtype, wanted[key], tensor.shape, file_name, offset, operations))
    objects = tuple(OutputObject(key, fqn, paths[key]) for key, fqn in object_keys.items())
    return ConsolidatePlan(
        source=source, format=kind.kind, files=tuple(output_files), tensors=tuple(tensors), objects=objects,
        index_name=index_name, index=index, ties=tuple(ties), dropped=dropped, zip_layouts=zip_layouts,
    )


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _paths(checkpoint: Checkpoint, chosen: dict[str, str], rules: KeyRules, kind: OutputFormat) -> dict[str, tuple]:
    """Return each key's place in the output: flat `(key,)`, or with --all to .pt the nested
    path torch saved (planner_data), wrapper names normalised in each part."""
    if not (rules.everything and kind.kind == "torch"):
        return {key: (key,) for key in chosen}
    if rules.renames:
        raise UsageError("--rename applies to flat keys; with --all a .pt keeps the nested structure as saved")
    paths: dict[str, tuple] = {}
    seen: dict[tuple, str] = {}
    for key, fqn in chosen.items():
        path = checkpoint.nesting.get(fqn) or tuple(fqn.split("."))
        if rules.normalise:
            path = tuple(normalise(part) if isinstance(part, str) else part for part in path)
        if path in seen:
            from ckpttool.errors import KeyCollision

            raise KeyCollision(f"{seen[path]} and {fqn} both become {path!r}; pass --keep-keys")
        seen[path] = fqn
        paths[key] = path
    return paths


def locate_chunks(files: DataFiles, tensors: Sequence[Tensor], threads: int) -> dict[str, dict[int, RawData | None]]:
    """Return fqn -> {chunk index: RawData or None (decode)} for each chunk read once.

    Also checks that every located range lies inside its data file (truncated files fail
    here, before anything is written)."""
    jobs = [(tensor, index, chunk) for tensor in tensors for index, chunk in unique_chunks(tensor)]

    def find(job):
        tensor, index, chunk = job
        raw = locate(files, tensor, chunk)
        if raw is not None and raw.offset + raw.length > files.size(raw.file):
            raise CorruptBlob(
                f"{files.path(raw.file)}: {tensor.fqn} chunk at {list(chunk.offsets)} ends at byte "
                f"{raw.offset + raw.length}, past the file's {files.size(raw.file)} bytes (truncated file?)"
            )
        return raw

    found: dict[str, dict[int, RawData | None]] = {tensor.fqn: {} for tensor in tensors}
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for (tensor, index, _), raw in zip(jobs, pool.map(find, jobs)):
            found[tensor.fqn][index] = raw
    return found


def find_ties(
    files: DataFiles, tensors: dict[str, Tensor], located: dict[str, dict[int, RawData | None]]
) -> list[Tie]:
    """Return pairs (embedding-like key, head-like key) that hold the same tensor.

    Names and geometry are compared first; only a matching pair has its bytes compared, block
    by block, stopping at the first difference (an untied pair differs in its first block).
    """
    embeddings = [k for k in tensors if EMBEDDING_KEY.search(k)]
    heads = [k for k in tensors if HEAD_KEY.search(k)]
    ties = []
    for head in heads:
        for embedding in embeddings:
            if embedding == head:
                continue
            a, b = tensors[embedding], tensors[head]
            if a.dtype != b.dtype or a.shape != b.shape:
                continue
            boxes_a = [(c.offsets, c.sizes) for _, c in unique_chunks(a)]
            boxes_b = [(c.offsets, c.sizes) for _, c in unique_chunks(b)]
            if sorted(boxes_a) != sorted(boxes_b):
                continue
            if _same_bytes(files, a, b, located):
                ties.append(Tie(embedding, head))
                break
    return ties


def _chunk_blocks(files: DataFiles, tensor: Tensor, index: int, raw: RawData | None) -> Iterator[bytes]:
    if raw is None:
        yield read_chunk(files, tensor, tensor.chunks[index])
    else:
        yield from iter_blocks(files, raw, VERIFY_BLOCK)


def _same_bytes(files: DataFiles, a: Tensor, b: Tensor, located: dict) -> bool:
    chunks_b = {(c.offsets, c.sizes): i for i, c in unique_chunks(b)}
    for index_a, chunk in unique_chunks(a):
        index_b = chunks_b[(chunk.offsets, chunk.sizes)]
        raw_a, raw_b = located[a.fqn][index_a], located[b.fqn][index_b]
        if raw_a is not None and raw_b is not None and (raw_a.file, raw_a.offset) == (raw_b.file, raw_b.offset):
            continue  # one blob stored for both names
        left = b"".join(_chunk_blocks(files, a, index_a, raw_a)) if raw_a is None else None
        right = b"".join(_chunk_blocks(files, b, index_b, raw_b)) if raw_b is None else None
        if left is not None or right is not None:
            left = left if left is not None else b"".join(_chunk_blocks(files, a, index_a, raw_a))
            right = right if right is not None else b"".join(_chunk_blocks(files, b, index_b, raw_b))
            if left != right:
                return False
            continue
        for block_a, block_b in zip(_chunk_blocks(files, a, index_a, raw_a), _chunk_blocks(files, b, index_b, raw_b)):
            if block_a != block_b:
                return False
    return True


def load_objects(checkpoint: Checkpoint, files: DataFiles, keys: dict[str, str]) -> dict[str, Any]:
    """Return key -> python value of each selected non-tensor entry (torch.load, weights_only)."""
    values = {}
    for key, fqn in keys.items():
        blob = checkpoint.objects[fqn].blob
        where = f"{files.path(blob.file) if blob else checkpoint.path}: {fqn}"
        if blob is None:
            raise CorruptMetadata(f"{where}: the metadata has no storage entry for this object")
        values[key] = load_torch_bytes(blob_bytes(files, blob, where), where)
    return values


# ---------------------------------------------------------------------------------------------
# Execution


def _execute(
    checkpoint: Checkpoint,
    files: DataFiles,
    plan: ConsolidatePlan,
    target: Path,
    force: bool,
    kind: OutputFormat,
    max_memory: int,
    threads: int,
    verify: bool,
    progress: ProgressFactory,
) -> tuple[Path, ...]:
    try:
        if kind.sharded:
            with atomic_directory(target, force=force) as directory:
                handles = {f.name: open(directory / f.name, "w+b") for f in plan.files}
                try:
                    _write_files(checkpoint, files, plan, handles, max_memory, threads, verify, progress)
                    if plan.index is not None:
                        with open(directory / plan.index_name, "wb") as index:
                            index.write(plan.index)
                            index.flush()
                            os.fsync(index.fileno())
                finally:
                    for handle in handles.values():
                        handle.close()
            names = [f.name for f in plan.files] + ([plan.index_name] if plan.index_name else [])
            return tuple(target / n for n in names)
        with atomic_output(target, force=force) as handle:
            _write_files(checkpoint, files, plan, {plan.files[0].name: handle}, max_memory, threads, verify, progress)
        return (target,)
    except OSError as error:
        raise WriteFailed(
            f"{target}: writing failed ({error.strerror or error}); nothing was left at the destination"
        ) from None


def _write_files(
    checkpoint: Checkpoint,
    files: DataFiles,
    plan: ConsolidatePlan,
    handles: dict[str, Any],
    max_memory: int,
    threads: int,
    verify: bool,
    progress: ProgressFactory,
) -> None:
    fds = {name: handle.fileno() for name, handle in handles.items()}
    for output in plan.files:
        fd = fds[output.name]
        _reserve(fd, output.size)
        if output.head:
            write_at(fd, output.head, 0)
    operations = sorted(plan.operations, key=lambda op: (op.dst, _dst_offset(op)))
    with progress("consolidate", plan.tensor_bytes) as bar:
        run_tasks(
            (Task(_runner(checkpoint, files, op, fds), _memory(op)) for op in operations),
            threads, max_memory, bar.update,
        )
    for name, layout in plan.zip_layouts.items():
        crcs = _storage_crcs(plan, fds[name], name)
        for offset, data in torch_pt.zip_records(layout, crcs):
            write_at(fds[name], data, offset)
    if verify:
        with progress("verify", plan.tensor_bytes) as bar:
            verify_output(checkpoint, files, plan, fds, threads, max_memory, bar.update)
    for fd in fds.values():
        os.fsync(fd)


def _reserve(fd: int, size: int) -> None:
    """Give the file its final size up front; allocating it makes a full disk fail now."""
    os.ftruncate(fd, size)
    if size and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise  # ENOSPC: the disk cannot hold the output; fail before copying


def _dst_offset(op: Operation) -> int:
    return op.runs[0][0] if isinstance(op, Gather) else op.dst_offset


def _memory(op: Operation) -> int:
    if isinstance(op, Copy):
        return 0
    if isinstance(op, Convert):
        return op.length + op.output_length
    return op.memory


def _runner(checkpoint: Checkpoint, files: DataFiles, op: Operation, fds: dict[str, int]) -> Callable[[], int]:
    def run() -> int:
        if isinstance(op, Copy):
            try:
                copy_range(files.fd(op.src), op.src_offset, fds[op.dst], op.dst_offset, op.length)
            except EOFError:
                raise CorruptBlob(f"{files.path(op.src)}: ends before byte {op.src_offset + op.length} (truncated file?)") from None
            return op.length
        if isinstance(op, Convert):
            buffer = thread_buffer(op.length)
            files.read_into(op.src, op.src_offset, memoryview(buffer)[:op.length])
            data = cast_in_place(buffer, op.length, op.source_dtype, op.dtype)
            write_at(fds[op.dst], data, op.dst_offset)
            return len(data)
        data = _gather_bytes(checkpoint, files, op)
        view = memoryview(data)
        at = 0
        for offset, length in op.runs:
            write_at(fds[op.dst], view[at:at + length], offset)
            at += length
        return at

    return run


def _gather_bytes(checkpoint: Checkpoint, files: DataFiles, op: Gather) -> bytes:
    tensor = checkpoint.tensors[op.fqn]
    if op.source is not None:
        data = files.read(op.source.file, op.source.offset, op.source.length)
    else:
        data = read_chunk(files, tensor, tensor.chunks[op.chunk])
    return cast(data, op.source_dtype, op.dtype)


def cast_in_place(buffer: bytearray, length: int, source_dtype: str, dtype: str) -> memoryview:
    """Return the first `length` bytes of `buffer` converted as `tensor.to(dtype)` converts
    them, as a view of this thread's reusable cast buffer.

    torch reads `buffer` where it is and `copy_` writes into the reused buffer: `.to(dtype)`
    is `empty` + `copy_` in torch (`_to_copy`), so the bytes are the same, without a fresh
    allocation per block.
    """
    import torch

    count = length // dtypes.ITEMSIZE[source_dtype]
    output_length = count * dtypes.ITEMSIZE[dtype]
    output = thread_buffer(output_length, "cast")
    values = torch.frombuffer(buffer, dtype=getattr(torch, source_dtype), count=count)
    torch.frombuffer(output, dtype=getattr(torch, dtype), count=count).copy_(values)
    return memoryview(output)[:output_length]


def cast(data: bytes, source_dtype: str, dtype: str) -> bytes:
    """Return the bytes of `data` (elements of `source_dtype`) converted as torch's
    `tensor.to(dtype)` converts them."""
    if source_dtype == dtype or not data:
        return data
    return bytes(cast_in_place(bytearray(data), len(data), source_dtype, dtype))


def _storage_crcs(plan: ConsolidatePlan, fd: int, name: str) -> dict[str, int]:
    """Return the CRC-32 of each storage entry of a .pt: combined from the CRCs torch.save
    stored for the source chunks when the tensor is made of whole-chunk copies laid end to
    end, else computed by reading the written bytes back."""
    import zlib

    crcs = {}
    for position, tensor in enumerate(t for t in plan.tensors if t.file == name):
        entry = f"{torch_pt.ARCHIVE}/data/{position}"
        copies = sorted(tensor.operations, key=_dst_offset)
        at, crc = tensor.offset, 0
        combined = True
        for op in copies:
            if not isinstance(op, Copy) or op.crc32 is None or op.dst_offset != at:
                combined = False
                break
            crc = torch_pt.crc32_combine(crc, op.crc32, op.length)
            at += op.length
        if not combined or at != tensor.offset + tensor.nbytes:
            crc = 0
            for start in range(tensor.offset, tensor.offset + tensor.nbytes, VERIFY_BLOCK):
                crc = zlib.crc32(os.pread(fd, min(VERIFY_BLOCK, tensor.offset + tensor.nbytes - start), start), crc)
        crcs[entry] = crc
    return crcs


def verify_output(
    checkpoint: Checkpoint,
    files: DataFiles,
    plan: ConsolidatePlan,
    fds: dict[str, int],
    threads: int,
    max_memory: int,
    on_done: Callable[[int], None] | None = None,
) -> None:
    """Read the output back and compare it with the source, operation by operation (each
    source chunk re-read, re-cast where a cast was asked); raise VerificationFailed."""
    tensors_by_op = {id(op): t for t in plan.tensors for op in t.operations}

    def check(op: Operation) -> Callable[[], int]:
        def run() -> int:
            tensor = tensors_by_op[id(op)]
            if isinstance(op, Copy):
                for done in range(0, op.length, VERIFY_BLOCK):
                    length = min(VERIFY_BLOCK, op.length - done)
                    expected = files.read(op.src, op.src_offset + done, length)
                    _compare(fds[op.dst], op.dst_offset + done, expected, tensor, plan)
                return op.length
            if isinstance(op, Convert):
                expected = cast(files.read(op.src, op.src_offset, op.length), op.source_dtype, op.dtype)
                _compare(fds[op.dst], op.dst_offset, expected, tensor, plan)
                return len(expected)
            expected = _gather_bytes(checkpoint, files, op)
            at = 0
            for offset, length in op.runs:
                _compare(fds[op.dst], offset, expected[at:at + length], tensor, plan)
                at += length
            return at

        return run

    tasks = (Task(check(op), 2 * _memory(op) or 2 * VERIFY_BLOCK) for op in plan.operations)
    run_tasks(tasks, threads, max_memory, on_done)


def _compare(fd: int, offset: int, expected: bytes, tensor: OutputTensor, plan: ConsolidatePlan) -> None:
    actual = os.pread(fd, len(expected), offset)
    if actual != expected:
        position = next((i for i, (x, y) in enumerate(zip(actual, expected)) if x != y), len(actual))
        raise VerificationFailed(
            f"{tensor.file}: {tensor.key} (from {tensor.fqn}) differs from the source at output byte "
            f"{offset + position}; the output was not kept"
        )


# ---------------------------------------------------------------------------------------------
# Text for the CLI


def summary_line(report: ConsolidateReport) -> str:
    """Return the one-line summary: tensors, bytes, time, throughput."""
    from ckpttool.render import human_bytes

    what = f"{report.tensors} tensors" + (f" and {report.objects} objects" if report.objects else "")
    checked = ", verified" if report.verified else ""
    return (
        f"wrote {what}, {human_bytes(report.tensor_bytes)} to {report.output} in {report.seconds:.2f} s "
        f"({human_bytes(int(report.throughput))}/s{checked})"
    )


def plan_text(report: ConsolidateReport) -> str:
    """Return the --dry-run listing: each output key, where it comes from, dtype, shape, file."""
    from ckpttool.render import human_bytes, table

    plan = report.plan
    rows = []
    for tensor in plan.tensors:
        dtype = tensor.dtype if tensor.dtype == tensor.source_dtype else f"{tensor.source_dtype}->{tensor.dtype}"
        shape = "x".join(map(str, tensor.shape)) or "scalar"
        rows.append((tensor.key, tensor.fqn, dtype, shape, tensor.file))
    for item in plan.objects:
        rows.append((item.key, item.fqn, "object", "", plan.files[0].name))
    lines = [
        f"{report.source} -> {report.output} ({plan.format}, {len(plan.files)} file(s)"
        f"{', index ' + plan.index_name if plan.index_name else ''}): {len(plan.tensors)} tensors, "
        f"{len(plan.objects)} objects, {human_bytes(plan.tensor_bytes)}",
        *table(rows, ("KEY", "FROM", "DTYPE", "SHAPE", "FILE")),
    ]
    lines += tie_lines(report)
    lines.append("dry run: nothing was written")
    return "\n".join(lines)


def tie_lines(report: ConsolidateReport) -> list[str]:
    """Return one line per tied pair found, saying what was done about it."""
    lines = []
    for tie in report.ties:
        action = "dropped" if tie.dropped in report.dropped else "both written (--drop-tied keeps one)"
        lines.append(f"tied: {tie.dropped} is the same tensor as {tie.kept}: {tie.dropped} {action}")
    return lines
