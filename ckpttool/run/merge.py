"""Runs a `plan.merge.MergePlan` on written outputs: one LoRA module at a time, each base
weight read back from the output, `W += delta` computed exactly as PEFT's
`peft/tuners/lora/layer.py` computes it (`get_delta_weight`, then `merge` without safe_merge,
on an adapter loaded as `PeftModel.from_pretrained` loads it: the same torch ops in the same
dtypes, so the result is bit-identical to `merge_and_unload`),
and written back in place. Memory holds one module: its delta (the size of its base weight),
A, B, and 16 MB of the base weight at a time (a 4-bit base: the whole dequantised weight; DoRA,
which needs each row's norm of the merged weight: the whole weight and its merged copy).

Example:
    >>> with DataFiles(checkpoint.path) as files:
    ...     run_merge(merge_plan, checkpoint, files, {"model.safetensors": fd})
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterator, Mapping

from ckpttool.core.checkpoint import Checkpoint, Tensor
from ckpttool.dcp.blobs import DataFiles, read_chunk
from ckpttool.formats import bnb4bit
from ckpttool.core.errors import VerificationFailed
from ckpttool.store.io import write_at
from ckpttool.plan.merge import MergePlan, MergeStep, Target

MERGE_BLOCK = 16 << 20  # bytes of a base weight read, added to and rewritten at once


def run_merge(plan: MergePlan, checkpoint: Checkpoint, files: DataFiles, fds: Mapping[str, int],
              on_done: Any = None, verify: bool = False) -> set[str]:
    """Apply every step of `plan` to the outputs `fds` (output file name -> fd open for read and
    write); return the output keys of the tensors rewritten. `verify` reads each write back
    and raises VerificationFailed naming the tensor when it differs."""
    import torch

    changed: set[str] = set()
    for step in plan.steps:
        _merge_one(torch, step, checkpoint, files, fds, verify)
        changed.update(target.key for target in (step.weight, step.bias) if target is not None)
        if on_done is not None:
            on_done(step)
    return changed


def _merge_one(torch: Any, step: MergeStep, checkpoint: Checkpoint, files: DataFiles, fds: Mapping[str, int],
               verify: bool) -> None:
    if step.a_fqn is None:  # a 4-bit weight outside the adapter: dequantised only
        _write_output(step.weight, _dequantise(torch, step, checkpoint, files), fds, verify=verify)
        return
    assert step.b_fqn is not None  # a LoRA step names both A and B
    # PeftModel.from_pretrained(autocast_adapter_dtype=True) holds a float16/bfloat16 adapter in
    # float32 (peft.tuners.tuners_utils cast_adapter_dtype); get_delta_weight then computes in it
    a = _adapter_dtype(torch, read_tensor(torch, files, checkpoint.tensors[step.a_fqn]))
    b = _adapter_dtype(torch, read_tensor(torch, files, checkpoint.tensors[step.b_fqn]))
    delta = b @ a
    if step.kind == "embedding" or step.fan_in_fan_out:
        delta = delta.T
    delta.mul_(step.scaling)  # PEFT's `* scaling`, the same elementwise op, without a second delta in memory
    del a, b
    if step.magnitude_fqn is not None:
        magnitude = _adapter_dtype(torch, read_tensor(torch, files, checkpoint.tensors[step.magnitude_fqn]))
        _write_output(step.weight, _dora(torch, _read_output(torch, step.weight, fds), delta, magnitude, step), fds,
                      verify=verify)
    elif step.quantised is not None:
        weight = _dequantise(torch, step, checkpoint, files)
        weight += delta  # peft/tuners/lora/bnb.py Linear4bit.merge: dequantised weight + delta
        _write_output(step.weight, weight, fds, verify=verify)
    else:
        # Linear.merge / Embedding.merge: base_layer.weight.data += delta_weight, elementwise, so
        # the written weight is read, added and rewritten a block of rows at a time
        for rows, weight in _row_blocks(torch, step.weight, fds):
            weight += delta[rows]
            _write_output(step.weight, weight, fds, rows.start, verify)
    del delta
    if step.bias is not None:
        assert step.bias_fqn is not None  # plan_merge sets the bias and its fqn together
        bias = _read_output(torch, step.bias, fds)
        bias += _adapter_dtype(torch, read_tensor(torch, files, checkpoint.tensors[step.bias_fqn])) * step.scaling
        _write_output(step.bias, bias, fds, verify=verify)


def _dora(torch: Any, weight: Any, delta: Any, magnitude: Any, step: MergeStep) -> Any:
    """Return DoRA's merged weight, as peft/tuners/lora/variants.py DoraLinearVariant.merge_unsafe
    computes it (with dora.py DoraLinearLayer.get_weight_norm, scaling 1): the whole weight."""
    def transpose(tensor: Any) -> Any:  # peft.utils.other.transpose(tensor, fan_in_fan_out)
        return tensor.T if step.fan_in_fan_out else tensor

    norm_input = transpose(weight) + 1 * transpose(delta)
    weight_norm = torch.linalg.norm(norm_input, dim=1).to(norm_input.dtype)
    del norm_input
    dora_factor = transpose((magnitude / weight_norm).view(-1, 1))
    return (dora_factor * (weight + delta)).to(weight.dtype)


def _row_blocks(torch: Any, target: Target, fds: Mapping[str, int]) -> Iterator[tuple[slice, Any]]:
    """Yield (rows, those rows of the written tensor), about MERGE_BLOCK bytes at a time."""
    rows = target.shape[0] if target.shape else 1
    row_bytes = getattr(torch, target.dtype).itemsize * math.prod(target.shape[1:])
    step = max(1, MERGE_BLOCK // max(1, row_bytes))
    for start in range(0, rows, step):
        block = slice(start, min(rows, start + step))
        yield block, _read_output(torch, target, fds, block)


def _adapter_dtype(torch: Any, tensor: Any) -> Any:
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def _dequantise(torch: Any, step: MergeStep, checkpoint: Checkpoint, files: DataFiles) -> Any:
    """Return a 4-bit base weight dequantised (formats.bnb4bit), in the dtype the output holds."""
    quant = step.quantised
    assert quant is not None  # a step without A and B, or with `quantised`, only
    siblings = {suffix: read_tensor(torch, files, checkpoint.tensors[fqn]) for suffix, fqn in quant.siblings.items()}
    return bnb4bit.dequantize(torch, read_tensor(torch, files, quant.packed), siblings, quant.state, step.weight.dtype,
                              f"{checkpoint.path}: {quant.fqn}")


def tensor_bytes(files: DataFiles, tensor: Tensor) -> bytes:
    """Return a small 1-D tensor's raw bytes (a quant state's packed JSON), chunks in order."""
    chunks = sorted(tensor.chunks, key=lambda chunk: chunk.offsets)
    return b"".join(read_chunk(files, tensor, chunk) for chunk in chunks)


def read_tensor(torch: Any, files: DataFiles, tensor: Tensor) -> Any:
    """Return the whole of a checkpoint tensor, assembled from its chunks."""
    dtype = getattr(torch, tensor.dtype)
    whole = torch.empty(tuple(tensor.shape), dtype=dtype)
    for chunk in tensor.chunks:
        data = bytearray(read_chunk(files, tensor, chunk))
        piece = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        box = tuple(slice(offset, offset + size) for offset, size in zip(chunk.offsets, chunk.sizes))
        whole[box] = piece.reshape(chunk.sizes)
    return whole


def _read_output(torch: Any, target: Target, fds: Mapping[str, int], rows: slice | None = None) -> Any:
    """Return the written tensor `target` (or its `rows`) as a torch tensor over fresh memory."""
    dtype = getattr(torch, target.dtype)
    row_bytes = dtype.itemsize * math.prod(target.shape[1:])
    shape = target.shape if rows is None else (rows.stop - rows.start, *target.shape[1:])
    count = dtype.itemsize * math.prod(shape)
    at_start = target.offset + (rows.start * row_bytes if rows is not None else 0)
    data = bytearray(count)
    view, at = memoryview(data), 0
    while at < count:
        read = os.preadv(fds[target.file], [view[at:]], at_start + at)
        if read <= 0:
            raise OSError(f"{target.file}: short read of {target.key}")
        at += read
    return torch.frombuffer(data, dtype=dtype).reshape(shape) if count else torch.empty(shape, dtype=dtype)


def _write_output(target: Target, value: Any, fds: Mapping[str, int], first_row: int = 0, verify: bool = False) -> None:
    import torch

    flat = value.to(getattr(torch, target.dtype)).contiguous().reshape(-1)
    row_bytes = getattr(torch, target.dtype).itemsize * math.prod(target.shape[1:])
    data = memoryview(flat.view(torch.uint8).numpy())
    write_at(fds[target.file], data, target.offset + first_row * row_bytes)
    if verify and os.pread(fds[target.file], len(data), target.offset + first_row * row_bytes) != data:
        raise VerificationFailed(f"{target.file}: {target.key} reads back other bytes than the merge wrote")
