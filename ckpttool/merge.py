"""Runs a `plan.merge.MergePlan` on written outputs: one LoRA module at a time, each base
weight read back from the output, `W += delta` computed exactly as PEFT's
`peft/tuners/lora/layer.py` computes it (`get_delta_weight`, then `merge` without safe_merge,
on an adapter loaded as `PeftModel.from_pretrained` loads it: the same torch ops in the same
dtypes, so the result is bit-identical to `merge_and_unload`),
and written back in place. Memory holds one module: its base weight, the delta, A and B.

Example:
    >>> with DataFiles(checkpoint.path) as files:
    ...     run_merge(merge_plan, checkpoint, files, {"model.safetensors": fd})
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from ckpttool.checkpoint import Checkpoint, Tensor
from ckpttool.dcp.blobs import DataFiles, read_chunk
from ckpttool.formats import bnb4bit
from ckpttool.io import write_at
from ckpttool.plan.merge import MergePlan, MergeStep, Target


def run_merge(plan: MergePlan, checkpoint: Checkpoint, files: DataFiles, fds: Mapping[str, int],
              on_done: Any = None) -> None:
    """Apply every step of `plan` to the outputs `fds` (output file name -> fd open for read and write)."""
    import torch

    for step in plan.steps:
        _merge_one(torch, step, checkpoint, files, fds)
        if on_done is not None:
            on_done(step)


def _merge_one(torch: Any, step: MergeStep, checkpoint: Checkpoint, files: DataFiles, fds: Mapping[str, int]) -> None:
    weight = _read_output(torch, step.weight, fds) if step.quantised is None else _dequantise(torch, step, checkpoint, files)
    if step.a_fqn is None:  # a 4-bit weight outside the adapter: dequantised only
        _write_output(step.weight, weight, fds)
        return
    # PeftModel.from_pretrained(autocast_adapter_dtype=True) holds a float16/bfloat16 adapter in
    # float32 (peft.tuners.tuners_utils cast_adapter_dtype); get_delta_weight then computes in it
    a = _adapter_dtype(torch, read_tensor(torch, files, checkpoint.tensors[step.a_fqn]))
    b = _adapter_dtype(torch, read_tensor(torch, files, checkpoint.tensors[step.b_fqn]))
    delta = b @ a
    if step.kind == "embedding" or step.fan_in_fan_out:
        delta = delta.T
    delta.mul_(step.scaling)  # PEFT's `* scaling`, the same elementwise op, without a second delta in memory
    del a, b
    weight += delta  # Linear.merge / Embedding.merge: base_layer.weight.data += delta_weight
    del delta
    _write_output(step.weight, weight, fds)
    if step.bias is not None:
        bias = _read_output(torch, step.bias, fds)
        bias += _adapter_dtype(torch, read_tensor(torch, files, checkpoint.tensors[step.bias_fqn])) * step.scaling
        _write_output(step.bias, bias, fds)


def _adapter_dtype(torch: Any, tensor: Any) -> Any:
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def _dequantise(torch: Any, step: MergeStep, checkpoint: Checkpoint, files: DataFiles) -> Any:
    """Return a 4-bit base weight dequantised (formats.bnb4bit), in the dtype the output holds."""
    quant = step.quantised
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


def _read_output(torch: Any, target: Target, fds: Mapping[str, int]) -> Any:
    dtype = getattr(torch, target.dtype)
    count = dtype.itemsize
    for size in target.shape:
        count *= size
    data = bytearray(count)
    view, at = memoryview(data), 0
    while at < count:
        read = os.preadv(fds[target.file], [view[at:]], target.offset + at)
        if read <= 0:
            raise OSError(f"{target.file}: short read of {target.key}")
        at += read
    return torch.frombuffer(data, dtype=dtype).reshape(target.shape) if count else torch.empty(target.shape, dtype=dtype)


def _write_output(target: Target, value: Any, fds: Mapping[str, int]) -> None:
    flat = value.contiguous().reshape(-1)
    import torch

    write_at(fds[target.file], memoryview(flat.view(torch.uint8).numpy()), target.offset)
