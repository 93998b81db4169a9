"""Tensors of any checkpoint in memory: `open` (a handle like `safetensors.safe_open`),
`load_state_dict` and `load_into`, without torch.distributed.

The handle reads the checkpoint the way the commands do: `readers.read` (any layout, local
or `s3://`), the integrity gate (a damaged checkpoint raises `InvalidCheckpoint` with the
problem code `validate` reports), `model_view.find_model` for the model's keys. A tensor is
assembled by consolidate's own plan (`plan.consolidate.plan_tensor`: copies of located raw
bytes, casts, gathers of decoded or strided chunks), and a slice by reshard's geometry
(`plan.reshard.fill_runs`: the byte runs of the chunks that meet the box); the executor's
readers (`execute.output_blocks`, `dcp.blobs`) move the bytes, with ranged reads straight
into the tensor's memory where the bytes lie as they are. Memory: the tensor itself, plus
the buffers of the running operations (bounded by `max_memory`).

Example:
    >>> import ckpttool
    >>> with ckpttool.open("runs/gpt/step-200") as f:
    ...     f.model_keys()[:2]
    ...     f.get_tensor("tok_emb.weight").shape
    ...     f.get_slice("tok_emb.weight")[:8].shape
    ['layers.0.attn.weight', 'tok_emb.weight']
    torch.Size([256, 64])
    torch.Size([8, 64])
"""

from __future__ import annotations

import functools
import math
import operator
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Iterable, Mapping, MutableMapping, NamedTuple, Sequence, overload

from ckpttool import readers
from ckpttool.check import integrity
from ckpttool.core import dtypes
from ckpttool.model import quantization
from ckpttool.run import execute, locating
from ckpttool.core.checkpoint import Checkpoint, ChunkTable, Tensor
from ckpttool.dcp.blobs import DataFiles, RawData, blob_bytes, decode_object, locate
from ckpttool.core.errors import CorruptMetadata, KeyCollision, MissingEntry, UsageError
from ckpttool.core.geometry import Box, intersect, volume
from ckpttool.store.io import DEFAULT_MAX_MEMORY, DEFAULT_THREADS, Task, parse_size, run_tasks
from ckpttool.model.keys import KeyRules, output_keys
from ckpttool.model.model_view import ModelView, find_model
from ckpttool.naming.fused import Slot, plan_fill
from ckpttool.options import SourceOptions
from ckpttool.formats.fp8 import FLOAT8
from ckpttool.plan.consolidate import OutputFormat, plan_dequantize, plan_tensor, select, target_dtype
from ckpttool.model.quantization import Quantization, QuantizedWeight
from ckpttool.plan.operations import STREAM_BLOCK, Copy, Gather, Operation, Record, Records
from ckpttool.plan.reshard import Run, fill_runs

if TYPE_CHECKING:
    import torch

FRAMEWORKS = ("pt", "np")  # safetensors' names: torch tensors, numpy arrays
OUTPUT = "memory"  # the name plans give the one output: the tensor being filled
# a chunk met by more runs than this, each shorter than SMALL_RUN on average, is read whole
# and scattered (one read instead of a syscall per row) when most of its bytes are wanted
MANY_RUNS = 64
SMALL_RUN = 64 << 10
INLINE_BYTES = 1 << 20  # a tensor smaller than this is read on the calling thread
_PLAN_KIND = OutputFormat("torch", False, None)  # select(): tensors and python objects alike


class CheckpointFile:
    """An open checkpoint of any layout ckpttool reads, local or remote, past the integrity
    gate; returned by `ckpttool.open`. Use it as a context manager (or call `close`).

    Names: `keys()` are the entries as stored (full fqns); `model_keys()` the model's own
    keys as consolidate names them (`model.state_dict()` names). `get_tensor`,
    `get_slice`, `get_object` and `metadata` take either; a stored fqn wins where a name is
    both. `layout` says what was found (`readers.detect`), `checkpoint` is the checkpoint as
    our types, `problems` the integrity gate's warnings. Not for use by several threads at
    once (each call reads on its own bounded pool).

    Example:
        >>> with CheckpointFile("ckpt/step-100") as f:
        ...     f.metadata("app.model.w").shape, f.get_tensor("w", dtype="bfloat16").dtype
        ((256, 64), torch.bfloat16)
    """

    def __init__(self, path: str | os.PathLike, *, framework: str = "pt", model_prefix: str | None = None,
                 storage_options: Mapping[str, Any] | None = None, follow_symlinks: bool = False,
                 threads: int = DEFAULT_THREADS, max_memory: int | str = DEFAULT_MAX_MEMORY,
                 assets: str | os.PathLike | None = None):
        if framework not in FRAMEWORKS:
            raise UsageError(f"framework {framework!r}: choose 'pt' (torch tensors) or 'np' (numpy arrays)")
        if threads < 1 or parse_size(max_memory) <= 0:
            raise UsageError("threads and max_memory must be positive")
        self.framework, self.threads, self.max_memory = framework, threads, parse_size(max_memory)
        self._source = SourceOptions(follow_symlinks, storage_options or {}, model_prefix)
        detection, checkpoint = readers.read(self._source.locate(path), follow_symlinks)
        self.layout: str = detection.describe()
        self.problems = tuple(integrity.gate(checkpoint, follow_symlinks).problems)  # warnings only
        if assets is not None:  # a framework's names (torchtitan, Megatron-Core) read as transformers'
            from ckpttool.commands.consolidate import as_transformers
            from ckpttool.store.safepaths import read_json_object

            config = read_json_object(Path(assets) / "config.json") if (Path(assets) / "config.json").exists() else None
            checkpoint = as_transformers(checkpoint, config, follow_symlinks, model_prefix) or checkpoint
        self.checkpoint: Checkpoint = checkpoint
        self._files = DataFiles(checkpoint.path, follow_symlinks)
        self._located: dict[str, MutableMapping[int, RawData | None]] = {}  # fqn -> every chunk located
        self._met: dict[str, MutableMapping[int, RawData | None]] = {}  # fqn -> the chunks slices met, located
        self._closed = False

    # -- names -------------------------------------------------------------------------------

    def __enter__(self) -> "CheckpointFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the data files (the handle reads nothing afterwards)."""
        self._closed = True
        self._files.close()

    def __repr__(self) -> str:
        return f"CheckpointFile({str(self.checkpoint.path)!r}, {self.layout}, {len(self.keys())} entries)"

    def keys(self) -> list[str]:
        """Return every entry's fqn as stored (tensors and python objects), sorted."""
        return sorted(self.checkpoint.tensors.keys() | self.checkpoint.objects.keys())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._resolve(key, raising=False) is not None

    def __iter__(self):
        return iter(self.keys())

    def model_view(self) -> ModelView:
        """Return where the model is in the checkpoint and why (see `model_view.find_model`)."""
        return self._view

    @functools.cached_property
    def _view(self) -> ModelView:
        return find_model(self.checkpoint, self._source.model_prefix)

    @functools.cached_property
    def _model(self) -> dict[str, str]:
        """Model key -> fqn, in the order the state dict was saved (consolidate's selection)."""
        selection = select(self.checkpoint, self._view, KeyRules(), _PLAN_KIND)
        return {**selection.tensors, **selection.objects}

    @functools.cached_property
    def _everything(self) -> dict[str, str]:
        """Key -> fqn of every entry as `consolidate --all` names them (wrapper names removed)."""
        return output_keys(self.keys(), KeyRules(everything=True), {})

    def model_keys(self) -> list[str]:
        """Return the model's keys as consolidate writes them (`model.state_dict()` names),
        in saved order; raises UsageError when no model (or two) is found: pass `model_prefix`."""
        return list(self._model)

    @overload
    def _resolve(self, key: str) -> str: ...

    @overload
    def _resolve(self, key: str, raising: bool) -> str | None: ...

    def _resolve(self, key: str, raising: bool = True) -> str | None:
        """Return the fqn `key` names: a stored fqn, else a model key, else an --all key."""
        checkpoint = self.checkpoint
        if key in checkpoint.tensors or key in checkpoint.objects:
            return key
        for names in ("_model", "_everything"):
            try:
                found = getattr(self, names).get(key)
            except (UsageError, KeyCollision):  # no model here, or names that collide: stored names only
                continue
            if found is not None:
                return found
        if raising:
            raise MissingEntry(f"{checkpoint.path}: no entry named {key!r} (see keys() and model_keys())")
        return None

    def metadata(self, key: str) -> Tensor:
        """Return the tensor entry `key` names: fqn, dtype (torch's name), global shape, and the
        chunks that tile it (each with the blob holding its bytes)."""
        fqn = self._resolve(key)
        tensor = self.checkpoint.tensors.get(fqn)
        if tensor is None:
            raise UsageError(f"{self.checkpoint.path}: {fqn} is a python object, not a tensor; use get_object")
        return tensor

    # -- reading -----------------------------------------------------------------------------

    def get_tensor(self, key: str, *, dtype: Any = None, device: Any = "cpu", dequantize: bool = False) -> Any:
        """Return the whole tensor `key` names, assembled from its chunks bit for bit (a torch
        tensor, or with `framework="np"` a numpy array).

        `dtype` casts floating tensors as consolidate's `--dtype` does (`tensor.to(dtype)`
        block by block; integer and bool tensors keep theirs): a torch dtype, a numpy one or
        a name (`"bf16"`). `device` moves a torch result after it is read on the CPU.
        `dequantize` returns a quantised weight (FP8 codes, MXFP4 `_blocks`, or the name they
        dequantise to) dequantised with its scales as `export --dtype` writes it, in `dtype`
        (default: the config's torch_dtype, else bfloat16, the references' default); a
        quantised weight is never cast without it.

        Example:
            >>> f.get_tensor("layers.0.attn.weight", dtype=torch.bfloat16).dtype
            torch.bfloat16
            >>> f.get_tensor("model.layers.0.mlp.experts.down_proj", dequantize=True).shape
            torch.Size([4, 64, 64])
        """
        weight = self._quantized(key) if dequantize else None
        if weight is not None:
            return self._to_device(self._dequantized(weight, dtype), device)
        tensor = self.metadata(key)
        wanted = target_dtype(tensor.dtype, _dtype_name(dtype))
        if wanted != tensor.dtype and self.quantization is not None and tensor.fqn in self.quantization.entries | set(
                self.quantization.unscaled):
            raise UsageError(f"{self.checkpoint.path}: {tensor.fqn} holds quantised codes or scales; casting them "
                             "alone is not the weight: pass dequantize=True")
        result, view = self._allocate(wanted, tensor.shape)
        self._fill(tensor, wanted, view)
        return self._to_device(result, device)

    @functools.cached_property
    def quantization(self) -> Quantization | None:
        """The checkpoint's quantised weights (FP8, MXFP4; `quantization.find`), or None."""
        return quantization.find(self.checkpoint, quantization.config_beside(self.checkpoint.path))

    def _quantized(self, key: str) -> QuantizedWeight | None:
        """Return the quantised weight `key` names (its codes' or its dequantised name), or None."""
        found = self.quantization
        if found is None:
            return None
        fqn = self._resolve(key, raising=False)
        weight = found.weights.get(fqn) if fqn is not None else None
        if weight is None:
            weight = next((w for w in found.weights.values() if key in (w.name, w.name.removeprefix(self._prefix()))), None)
        if weight is None and (fqn in found.unscaled or any(f == fqn for f, _ in found.problems)):
            quantization.require_dequantizable(found, self.checkpoint.path)
        return weight

    def _prefix(self) -> str:
        prefix = self._view.prefix if self._view.prefix else ""
        return prefix + "." if prefix else ""

    def _dequantized(self, weight: QuantizedWeight, dtype: Any) -> Any:
        """Return `weight` dequantised to `dtype` (default: the config's torch_dtype, else bfloat16)."""
        config_dtype = quantization.config_dtype(quantization.config_beside(self.checkpoint.path))
        wanted = _dtype_name(dtype) or config_dtype
        if wanted not in dtypes.FLOATING or wanted in FLOAT8:
            raise UsageError(f"{self.checkpoint.path}: {weight.name}: dequantise to bfloat16, float16 or float32, "
                             f"not {wanted}")
        codes, scale = self.checkpoint.tensors[weight.codes], self.checkpoint.tensors[weight.scale]
        self._check_open()
        self._locate([codes, scale])
        result, view = self._allocate(wanted, weight.shape)
        self._run(plan_dequantize(weight, codes, self._located[codes.fqn], scale, self._located[scale.fqn], wanted,
                                  OUTPUT, 0), view)
        return result

    def get_slice(self, key: str) -> "TensorSlice":
        """Return a lazy slice of tensor `key`: indexing it (`[i:j]`, `[:, 3]`, `[..., ::2]`)
        reads only the chunks the index meets, like safetensors' `get_slice`.

        Example:
            >>> f.get_slice("tok_emb.weight")[100:104].shape      # reads one chunk's rows
            torch.Size([4, 64])
        """
        return TensorSlice(self, self.metadata(key))

    def get_object(self, key: str) -> Any:
        """Return the python value of a non-tensor entry (param_groups, step, ...): plain values
        through ckpttool's allowlist unpickler, others through `torch.load(weights_only=True)`;
        never code from the checkpoint."""
        fqn = self._resolve(key)
        entry = self.checkpoint.objects.get(fqn)
        if entry is None:
            raise UsageError(f"{self.checkpoint.path}: {fqn} is a tensor, not a python object; use get_tensor")
        where = f"{self._files.path(entry.blob.file) if entry.blob else self.checkpoint.path}: {fqn}"
        if entry.blob is None:
            raise CorruptMetadata(f"{where}: the metadata has no storage entry for this object")
        return decode_object(blob_bytes(self._files, entry.blob, where), where)

    def read_into(self, key: str, out: Any) -> None:
        """Fill `out` (a contiguous CPU torch tensor or numpy array of the entry's shape and
        dtype, or of a floating dtype to cast to) with tensor `key`, without allocating it."""
        tensor = self.metadata(key)
        shape = tuple(out.shape)
        if shape != tensor.shape:
            raise UsageError(f"{self.checkpoint.path}: {tensor.fqn} has shape {list(tensor.shape)}, "
                             f"the destination {list(shape)}")
        wanted = target_dtype(tensor.dtype, _dtype_name(out.dtype))
        if wanted != _dtype_name(out.dtype):
            raise UsageError(f"{self.checkpoint.path}: {tensor.fqn} is {tensor.dtype}, the destination "
                             f"{_dtype_name(out.dtype)} (only floating tensors are cast)")
        self._fill(tensor, wanted, _bytes_of(out))

    def _fill(self, tensor: Tensor, dtype: str, view: memoryview) -> None:
        """Write `tensor` cast to `dtype` as row-major bytes into `view`, by consolidate's plan."""
        self._check_open()
        self._locate([tensor])
        self._run(plan_tensor(tensor, self._located[tensor.fqn], dtype, OUTPUT, 0), view)

    def _region(self, tensor: Tensor, box: Box) -> tuple[Any, memoryview]:
        """Return the box of `tensor` (its own dtype) and its bytes, reading only the chunks it meets."""
        self._check_open()
        result, view = self._allocate(tensor.dtype, box[1])
        if not volume(box[1]):
            return result, view
        met = chunks_meeting(tensor, box)
        part = Tensor(tensor.fqn, tensor.dtype, tensor.shape, tuple(tensor.chunks[i] for i in met))
        located = self._located.get(tensor.fqn) or self._met.setdefault(tensor.fqn, {})
        raw = {}
        for position, index in enumerate(met):
            if index not in located:
                located[index] = locate(self._files, tensor, tensor.chunks[index])
            raw[position] = located[index]
        self._run(region_operations(part, fill_runs(part, box), raw), view)
        return result, view

    def _run(self, operations: Sequence[Operation], view: memoryview) -> None:
        files = self._files
        if len(operations) == 1 or sum(op.output_length for op in operations) < INLINE_BYTES:
            for op in operations:  # a thread pool would cost more than the reads
                _apply(op, files, view)
            return
        # neighbouring small operations run as one task (execute.batches), as consolidate runs them
        tasks = (Task(functools.partial(_apply_all, batch, files, view), max(op.memory for op in batch))
                 for batch in execute.batches(operations))
        run_tasks(tasks, self.threads, self.max_memory)

    def _locate(self, tensors: Iterable[Tensor]) -> None:
        """Locate every chunk of `tensors` not located yet, in one walk of each data file (the
        record headers of neighbouring chunks come from one read)."""
        wanted = [tensor for tensor in tensors if tensor.fqn not in self._located]
        if wanted:
            self._located.update(locating.locate_chunks(self._files, wanted, self.threads))

    def _allocate(self, dtype: str, shape: Sequence[int]) -> tuple[Any, memoryview]:
        if self.framework == "np":
            import numpy as np

            if dtype not in NUMPY_DTYPES:
                raise UsageError(f"{self.checkpoint.path}: numpy has no {dtype}; open with framework='pt', "
                                 "or ask for a dtype numpy has (dtype='float32')")
            array = np.empty(tuple(shape), dtype=np.dtype(dtype))
            return array, _bytes_of(array)
        import torch

        result = torch.empty(tuple(shape), dtype=getattr(torch, dtype))
        return result, _bytes_of(result)

    def _to_device(self, result: Any, device: Any) -> Any:
        if self.framework == "np" or str(device) == "cpu":
            return result
        return result.to(device)

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError(f"{self.checkpoint.path}: the checkpoint handle is closed")


class TensorSlice:
    """A tensor entry not yet read; indexing reads the chunks the index meets (basic
    indexing: ints, slices with positive steps, `...`)."""

    def __init__(self, handle: CheckpointFile, tensor: Tensor):
        self._handle, self.tensor = handle, tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def get_dtype(self) -> str:
        return self.tensor.dtype

    def __getitem__(self, index: Any) -> Any:
        box, selection, strided = parse_index(index, self.tensor.shape)
        region, _ = self._handle._region(self.tensor, box)
        result = region[selection]
        if strided:
            import numpy as np

            result = np.ascontiguousarray(result) if isinstance(result, np.ndarray) else result.contiguous()
        return result


def parse_index(index: Any, shape: Sequence[int]) -> tuple[Box, tuple, bool]:
    """Return the box a basic index reads (`(offsets, sizes)`), the index that takes the
    result out of that box, and whether a step > 1 leaves it strided.

    Example:
        >>> parse_index((slice(2, 8, 3), 1), (10, 4))
        (((2, 1), (4, 1)), (slice(0, 4, 3), 0), True)
    """
    items = index if isinstance(index, tuple) else (index,)
    ellipses = sum(1 for item in items if item is Ellipsis)
    if ellipses > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if ellipses:
        at = next(i for i, item in enumerate(items) if item is Ellipsis)
        items = items[:at] + (slice(None),) * (len(shape) - len(items) + 1) + items[at + 1:]
    if len(items) > len(shape):
        raise IndexError(f"too many indices for a tensor of {len(shape)} dimensions")
    items = items + (slice(None),) * (len(shape) - len(items))
    offsets: list[int] = []
    sizes: list[int] = []
    selection: list[int | slice] = []
    strided = False
    for dim, (item, length) in enumerate(zip(items, shape)):
        if isinstance(item, slice):
            start, stop, step = item.indices(length)
            if step <= 0:
                raise UsageError(f"slice step {step}: steps must be positive (as in torch)")
            count = len(range(start, stop, step))
            span = (count - 1) * step + 1 if count else 0
            offsets.append(start if count else 0)
            sizes.append(span)
            strided |= step > 1 and count > 1
            selection.append(slice(0, span, step if step > 1 and count > 1 else 1))
        elif isinstance(item, bool) or not hasattr(item, "__index__"):
            raise UsageError(f"index {item!r}: get_slice takes ints, slices and '...' (basic indexing); "
                             "index the returned tensor for anything else")
        else:
            position = operator.index(item)
            if not -length <= position < length:
                raise IndexError(f"index {position} is out of bounds for dimension {dim} with size {length}")
            offsets.append(position % length)
            sizes.append(1)
            selection.append(0)
    return (tuple(offsets), tuple(sizes)), tuple(selection), strided


def chunks_meeting(tensor: Tensor, box: Box) -> list[int]:
    """Return the indices of the chunks that share elements with `box`, each box of
    elements once (replicas skipped), in offset order. A `ChunkTable` is searched on its
    sorted dim-0 offsets (`searchsorted`), tuples of chunks one by one."""
    chunks = tensor.chunks
    if isinstance(chunks, ChunkTable) and len(box[0]):
        import numpy as np

        starts, heights = chunks.offsets[:, 0], chunks.sizes[:, 0]
        tallest = int(heights.max()) if len(heights) else 0
        low = int(np.searchsorted(starts, box[0][0] - tallest, side="right"))
        high = int(np.searchsorted(starts, box[0][0] + box[1][0], side="left"))
        begin, end = np.asarray(box[0], dtype=np.int64), np.asarray(box[0], dtype=np.int64) + np.asarray(box[1])
        offsets, sizes = chunks.offsets[low:high], chunks.sizes[low:high]
        meets = ((offsets < end) & (offsets + sizes > begin) & (sizes > 0)).all(axis=1)
        candidates = (low + np.flatnonzero(meets)).tolist()
    else:
        candidates = [i for i, chunk in enumerate(chunks)
                      if chunk.numel and intersect((chunk.offsets, chunk.sizes), box) is not None]
    seen, met = set(), []
    for index in candidates:
        chunk = chunks[index]
        if (chunk.offsets, chunk.sizes) not in seen:
            seen.add((chunk.offsets, chunk.sizes))
            met.append(index)
    return met


def region_operations(tensor: Tensor, runs: Iterable[Run], located: Mapping[int, RawData | None]) -> list[Operation]:
    """Return the operations that write `runs` (reshard's geometry: byte runs of source
    chunks into a box) to the output: a Copy per run of raw bytes, or one Gather per chunk
    that must be decoded, or that is met by many short runs covering most of it."""
    by_chunk: dict[int, list[Run]] = {}
    for run in runs:
        by_chunk.setdefault(run.source_chunk, []).append(run)
    operations: list[Operation] = []
    for index, found in by_chunk.items():
        raw, chunk = located[index], tensor.chunks[index]
        wanted = sum(run.length for run in found)
        many_small = len(found) > MANY_RUNS and wanted < SMALL_RUN * len(found)
        if raw is None or (many_small and 2 * wanted >= chunk.numel * tensor.itemsize):
            pieces = tuple((run.source_offset, run.target_offset, run.length) for run in found)
            operations.append(Gather(tensor, index, raw, tensor.dtype, OUTPUT, pieces))
        else:
            operations.extend(Copy(raw.file, raw.offset + run.source_offset, OUTPUT, run.target_offset, run.length)
                              for run in found)
    return operations


def _apply_all(operations: list[Operation], files: DataFiles, view: memoryview) -> int:
    return sum(_apply(op, files, view) for op in operations)


def _apply(op: Operation, files: DataFiles, view: memoryview) -> int:
    """Run one operation into `view`: raw bytes of a local file are read straight into it;
    anything else (remote bytes, casts, decoded chunks) comes through the executor's blocks."""
    if isinstance(op, Copy) and files.local:
        files.read_into(op.src, op.src_offset, view[op.dst_offset:op.dst_offset + op.length])
        return op.length
    assert not isinstance(op, (Record, Records))  # reads plan no torch.save records
    for offset, block in execute.output_blocks(op, files, {}, STREAM_BLOCK):
        view[offset:offset + len(block)] = block
    return op.output_length


# numpy's dtypes among torch's (no bfloat16, float8 or complex32 in numpy)
NUMPY_DTYPES = frozenset({"float64", "float32", "float16", "complex128", "complex64", "int64", "int32", "int16",
                          "int8", "uint64", "uint32", "uint16", "uint8", "bool"})


def _dtype_name(dtype: Any) -> str | None:
    """Return torch's name of a dtype given as a torch dtype, numpy dtype or string, or None."""
    if dtype is None:
        return None
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if isinstance(dtype, type):  # a numpy scalar type (np.float32)
        import numpy as np

        name = np.dtype(dtype).name
    try:
        return dtypes.canonical(name)
    except KeyError:
        raise UsageError(f"dtype {dtype!r}: not a dtype ckpttool knows ({', '.join(sorted(dtypes.ITEMSIZE))})") from None


def _bytes_of(array: Any) -> memoryview:
    """Return a writable byte view of a contiguous CPU torch tensor or numpy array."""
    import numpy as np

    if isinstance(array, np.ndarray):
        if not array.flags.c_contiguous or not array.flags.writeable:
            raise UsageError("the destination array must be C-contiguous and writable")
        return array.reshape(-1).view(np.uint8).data
    import torch

    if array.device.type != "cpu" or not array.is_contiguous():
        raise UsageError("the destination tensor must be contiguous and on the CPU")
    flat = array.detach().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(bytearray())


# ---------------------------------------------------------------------------------------------
# Whole state dicts


def open(path: str | os.PathLike, *, framework: str = "pt", model_prefix: str | None = None,
         storage_options: Mapping[str, Any] | None = None, follow_symlinks: bool = False,
         threads: int = DEFAULT_THREADS, max_memory: int | str = DEFAULT_MAX_MEMORY,
         assets: str | os.PathLike | None = None) -> CheckpointFile:
    """Return an open handle on the checkpoint at `path` (any layout ckpttool reads: DCP and
    the frameworks on it, torch's HF writer, safetensors files, Hub folders, verl, torch.save
    files; local or `s3://...` with `storage_options`), after the integrity gate: a damaged
    checkpoint raises `InvalidCheckpoint` whose `code` is the problem code `validate` reports.

    `framework="np"` returns numpy arrays; `model_prefix` names the model's subtree when it
    cannot be found from the structure (`""`: the top level); `threads` and `max_memory`
    bound the reads of one tensor as `--threads` and `--max-memory` bound consolidate's.
    `assets` (a folder with the model's config.json) reads a checkpoint that uses a framework's
    names (torchtitan, Megatron-Core) under transformers' names, converted as `export` converts
    it (each tensor assembled from byte ranges of the source's chunks).

    Example:
        >>> with ckpttool.open("s3://bucket/run/step-200", storage_options={"endpoint_url": url}) as f:
        ...     f.get_tensor("model.tok_emb.weight")[:2]
    """
    return CheckpointFile(path, framework=framework, model_prefix=model_prefix, storage_options=storage_options,
                          follow_symlinks=follow_symlinks, threads=threads, max_memory=max_memory, assets=assets)


def load_state_dict(path: str | os.PathLike, *, model_only: bool = True, keys: Collection[str] | None = None,
                    dtype: Any = None, model_prefix: str | None = None, storage_options: Mapping[str, Any] | None = None,
                    follow_symlinks: bool = False, assets: str | os.PathLike | None = None) -> dict[str, Any]:
    """Return a flat state dict of the checkpoint at `path`, under consolidate's key names:
    the model's entries (`model.state_dict()` names) unless `model_only` is False (then every
    entry, as `consolidate --all` names it). `keys` loads only those; `dtype` casts floating
    tensors, and dequantises quantised weights (FP8, MXFP4) as `export --dtype` does: their
    dequantised names, scales left out. Python objects among them (a module's extra state)
    come decoded.

    Example:
        >>> model.load_state_dict(ckpttool.load_state_dict("runs/gpt/step-200"))
    """
    with open(path, model_prefix=model_prefix, storage_options=storage_options,
              follow_symlinks=follow_symlinks, assets=assets) as handle:
        names = handle._model if model_only else handle._everything
        if keys is not None:
            wanted = set(keys)
            unknown = sorted(wanted - names.keys())
            if unknown:
                raise MissingEntry(f"{handle.checkpoint.path}: no {'model ' if model_only else ''}entry named "
                                   f"{unknown[0]!r}{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}")
            names = {key: fqn for key, fqn in names.items() if key in wanted}
        quantized: dict[str, QuantizedWeight] = {}
        if dtype is not None and handle.quantization is not None:  # a cast of a quantised model dequantises it
            quantization.require_dequantizable(handle.quantization, handle.checkpoint.path)
            names, quantized = quantization.dequantized_names(names, handle.quantization)
        handle._locate(handle.checkpoint.tensors[fqn] for fqn in names.values() if fqn in handle.checkpoint.tensors)
        return {key: handle._dequantized(quantized[key], dtype) if key in quantized
                else handle.get_tensor(fqn, dtype=dtype) if fqn in handle.checkpoint.tensors else handle.get_object(fqn)
                for key, fqn in names.items()}


class LoadResult(NamedTuple):
    """What `load_into` could not match: module keys the checkpoint lacks, and the reverse."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_into(module: "torch.nn.Module", path: str | os.PathLike, *, strict: bool = True,
              model_prefix: str | None = None, storage_options: Mapping[str, Any] | None = None,
              follow_symlinks: bool = False, assets: str | os.PathLike | None = None) -> LoadResult:
    """Copy the checkpoint's model weights into `module`'s parameters and buffers, one tensor
    at a time, and return the keys that did not match; peak memory is the module plus one
    tensor (a CPU tensor of the stored dtype is read straight into its memory).

    With `strict`, a module key the checkpoint lacks (or the reverse) raises UsageError
    before any byte is read; a shape that differs always does. Floating tensors are cast to
    the module's dtype as `Tensor.copy_` casts. `assets` (the model's config.json folder) loads a
    transformers model straight from a torchtitan or Megatron-Core checkpoint (see `open`).
    transformers' fused-expert tensors (`mlp.experts.gate_up_proj` [E, 2F, D]) are filled from
    per-expert keys by the naming families' fused-expert layouts (naming/fused.py), one expert's
    part at a time, in place.

    Example:
        >>> model = transformers.AutoModelForCausalLM.from_config(config)
        >>> ckpttool.load_into(model, "runs/llama/step-200")
        LoadResult(missing_keys=[], unexpected_keys=[])
    """
    import torch

    with open(path, model_prefix=model_prefix, storage_options=storage_options,
              follow_symlinks=follow_symlinks, assets=assets) as handle:
        sources, tensors = handle._model, handle.checkpoint.tensors
        state = module.state_dict(keep_vars=True)
        where = handle.checkpoint.path
        plan = plan_fill({key: tuple(getattr(value, "shape", ())) for key, value in state.items()},
                         {key: tensors[fqn].shape if fqn in tensors else () for key, fqn in sources.items()}, str(where))
        loaded = {id(state[key]) for key in [*plan.direct, *plan.fused]}
        # a tied parameter (lm_head sharing the embedding's) is loaded through its other name
        missing = [key for key in plan.missing if id(state[key]) not in loaded]
        unexpected = plan.unexpected
        if strict and (missing or unexpected):
            raise UsageError(f"{where}: does not match the module: missing {_few(missing)}, unexpected "
                             f"{_few(unexpected)}; pass strict=False to load the rest")
        handle._locate(tensors[sources[key]] for key in [*plan.direct.values(), *(slot.key for slots in plan.fused.values()
                                                                                   for slot in slots)]
                       if sources[key] in tensors)
        for key, target in state.items():
            if key in plan.fused:
                _fill_fused(handle, target, {slot: sources[slot.key] for slot in plan.fused[key]})
                continue
            fqn = sources.get(plan.direct.get(key, ""))
            if fqn is None:
                continue
            if fqn in handle.checkpoint.objects:
                module.load_state_dict({key: handle.get_object(fqn)}, strict=False)  # a module's extra state
                continue
            tensor = tensors[fqn]
            if not isinstance(target, torch.Tensor) or tuple(target.shape) != tensor.shape:
                raise UsageError(f"{where}: {fqn} has shape {list(tensor.shape)}, the module's {key} "
                                 f"{list(getattr(target, 'shape', ()))}")
            with torch.no_grad():
                name = _dtype_name(target.dtype)
                same = name is not None and name == target_dtype(tensor.dtype, name)
                if same and name is not None and target.device.type == "cpu" and target.is_contiguous():
                    handle._fill(tensor, name, _bytes_of(target))
                else:
                    target.copy_(handle.get_tensor(fqn))
        return LoadResult(missing, unexpected)


def _fill_fused(handle: CheckpointFile, target: "torch.Tensor", parts: Mapping[Slot, str]) -> None:
    """Fill a fused-expert tensor (naming.fused) one part at a time: each slot's rows of its
    expert's block are contiguous, so a same-dtype CPU tensor gets them read straight into its memory."""
    import torch

    name = _dtype_name(target.dtype)
    row_bytes = math.prod(target.shape[2:]) * target.element_size()
    view = _bytes_of(target) if target.device.type == "cpu" and target.is_contiguous() else None
    with torch.no_grad():
        for slot, fqn in parts.items():
            tensor = handle.checkpoint.tensors[fqn]
            if view is not None and name is not None and name == target_dtype(tensor.dtype, name):
                start = (slot.expert * target.shape[1] + slot.row) * row_bytes
                handle._fill(tensor, name, view[start:start + slot.rows * row_bytes])
            else:
                target[slot.expert, slot.row:slot.row + slot.rows].copy_(handle.get_tensor(fqn))


def _few(keys: list[str]) -> str:
    if not keys:
        return "none"
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
