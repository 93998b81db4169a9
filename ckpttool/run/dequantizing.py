"""Running a `Dequantize` operation: the rows it needs read from the checkpoint's chunks, then
dequantised by the format's own rule (formats.fp8, formats.mxfp4) into output bytes.

A Hub folder's weight is one chunk, so its rows are one ranged read; a DCP weight's rows come
from each chunk they cross (a dim-0 slab's rows as a ranged read of its raw bytes, any other
chunk read whole and its box placed).

Example:
    >>> with DataFiles(checkpoint.path) as files:
    ...     data = dequantized_bytes(op, files)
    >>> len(data) == op.output_length
    True
"""

from __future__ import annotations

import math
from typing import Any, Iterator

from ckpttool.core import dtypes
from ckpttool.dcp.blobs import DataFiles, RawData, read_chunk
from ckpttool.core.errors import CorruptBlob
from ckpttool.store.io import thread_buffer
from ckpttool.formats import fp8, mxfp4
from ckpttool.plan.operations import Dequantize, Quantize, Rows


def dequantized_bytes(op: Dequantize, files: DataFiles) -> memoryview:
    """Return the output bytes of `op`: its rows dequantised to its dtype (fine-grained FP8 in
    numpy, without importing torch; the other layouts with torch's own operations)."""
    if op.layout == fp8.BLOCK and len(op.shape) == 2 and op.scale.tensor.dtype in _SCALE_DTYPES:
        return _fp8_blocks(op, files)
    import torch

    dtype = getattr(torch, op.dtype)
    codes = _tensor(torch, op.codes, files, "dequantize-codes")
    scale = _tensor(torch, op.scale, files, "dequantize-scale")
    where = f"{files.root}: {op.name}"
    if op.layout == mxfp4.METHOD:
        if scale.shape != codes.shape[:-1]:
            raise CorruptBlob(f"{where}: scales {list(scale.shape)} do not fit blocks {list(codes.shape)}")
        out = mxfp4.dequantize_experts(torch, codes, scale, dtype)
    else:
        # this thread's buffers, reused op after op: fresh multi-MiB tensors per op cost page
        # faults (a third of the time) and grow the allocator's arenas with the threads
        out = _scratch(torch, "dequantize-out", codes.shape, dtype)
        if codes.dim() == 2:
            index = _scratch(torch, "dequantize-index", (min(codes.shape[0], op.block[0]), codes.shape[1]), torch.int32)
            fp8.dequantize_rows(torch, codes, scale, op.layout, op.block, dtype, out, index)
        else:  # leading dims (grouped experts): each matrix with its own scales
            lead = codes.reshape(-1, *codes.shape[-2:])
            scales = scale.reshape(-1, *scale.shape[-2:]) if op.layout != fp8.TENSOR else None
            for index in range(lead.shape[0]):
                fp8.dequantize_rows(torch, lead[index], scale if scales is None else scales[index], op.layout,
                                    op.block, dtype, out.view(-1, *codes.shape[-2:])[index])
    data = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    if len(data) != op.output_length:
        raise CorruptBlob(f"{where}: dequantised {len(data)} bytes where {op.output_length} were planned")
    return data


def quantized_bytes(op: Quantize, files: DataFiles) -> memoryview:
    """Return the output bytes of `op`: its rows quantised to FP8, the codes or the scales."""
    import torch

    values = _tensor(torch, op.source, files, "quantize-values")
    rows, cols = values.shape
    codes = torch.empty((rows, cols), dtype=torch.float8_e4m3fn)
    scale = torch.empty((-(-rows // op.block[0]), -(-cols // op.block[1])), dtype=torch.float32)
    fp8.quantize_rows(torch, values, op.block, codes, scale)
    out = codes if op.part == "codes" else scale
    return out.reshape(-1).view(torch.uint8).numpy().data


_SCALE_DTYPES = ("float32", "bfloat16", "float16")  # scales the numpy path widens to float32 exactly


def _fp8_blocks(op: Dequantize, files: DataFiles) -> memoryview:
    """Dequantize fine-grained FP8 rows (formats.fp8.dequantize_block_rows) in this thread's buffers."""
    import numpy as np

    rows, cols = op.codes.stop - op.codes.start, op.shape[1]
    count = rows * cols
    codes_buffer = thread_buffer(count, "dequantize-codes")
    read_rows(files, op.codes, memoryview(codes_buffer)[:count])
    codes = np.frombuffer(codes_buffer, dtype=np.uint8, count=count).reshape(rows, cols)
    scale_rows = op.scale.stop - op.scale.start
    scale_shape = (scale_rows, *op.scale.tensor.shape[1:])
    raw = np.frombuffer(read_rows(files, op.scale), dtype={"float32": np.float32, "bfloat16": np.uint16,
                                                            "float16": np.float16}[op.scale.tensor.dtype])
    if op.scale.tensor.dtype == "bfloat16":  # bfloat16 is float32's top half: widened exactly
        scale = (raw.astype(np.uint32) << 16).view(np.float32)
    else:
        scale = raw.astype(np.float32)
    scale = scale.reshape(scale_shape)
    if scale.shape != (scale_rows, -(-cols // op.block[1])):
        raise CorruptBlob(f"{files.root}: {op.name}: scale rows {list(scale.shape)} do not fit the weight's blocks")
    itemsize = dtypes.ITEMSIZE[op.dtype]
    out_buffer = thread_buffer(count * itemsize, "dequantize-out")
    out = np.frombuffer(out_buffer, dtype=fp8.BITS[op.dtype], count=count).reshape(rows, cols)
    block_rows = min(rows, op.block[0])
    index = np.frombuffer(thread_buffer(block_rows * cols * np.dtype(np.intp).itemsize, "dequantize-index"),
                          dtype=np.intp, count=block_rows * cols).reshape(block_rows, cols)
    fp8.dequantize_block_rows(codes, op.codes.tensor.dtype, scale, op.block, op.dtype, out, index)
    return memoryview(out_buffer)[:count * itemsize]


def _scratch(torch: Any, role: str, shape: tuple[int, ...], dtype: Any) -> Any:
    """Return a tensor of `shape` over this thread's reusable buffer for `role` (io.thread_buffer)."""
    count = math.prod(shape)
    if not count:
        return torch.empty(shape, dtype=dtype)
    buffer = thread_buffer(count * dtype.itemsize, role)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


def _tensor(torch: Any, rows: Rows, files: DataFiles, role: str) -> Any:
    """Return rows [start, stop) of dim 0 of `rows.tensor` (the whole of a 0-d one), over this
    thread's buffer for `role`."""
    tensor = rows.tensor
    dtype = getattr(torch, tensor.dtype)
    if not tensor.shape:
        (index, raw), = rows.located or ((0, None),)
        data = files.read(raw.file, raw.offset, raw.length) if raw is not None else read_chunk(files, tensor, tensor.chunks[0])
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(())
    shape = (rows.stop - rows.start, *tensor.shape[1:])
    length = math.prod(shape) * tensor.itemsize
    if not length:
        return torch.empty(shape, dtype=dtype)
    buffer = thread_buffer(length, role)
    read_rows(files, rows, memoryview(buffer)[:length])
    return torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape)).view(shape)


def _crossings(rows: Rows) -> Iterator[tuple[Any, RawData | None, int, int, bool]]:
    """Yield (chunk, its raw bytes or None, first row, end row, whether it spans whole rows) for
    each distinct chunk of `rows.tensor` (≥ 1-d) that holds part of rows [start, stop)."""
    tensor = rows.tensor
    for index, raw in rows.located:
        chunk = tensor.chunks[index]
        first = chunk.offsets[0]
        begin, end = max(first, rows.start), min(first + chunk.sizes[0], rows.stop)
        if begin < end:
            full_width = all(o == 0 for o in chunk.offsets[1:]) and tuple(chunk.sizes[1:]) == tuple(tensor.shape[1:])
            yield chunk, raw, begin, end, full_width


def read_rows(files: DataFiles, rows: Rows, view: memoryview | None = None) -> bytearray | memoryview:
    """Return the row-major bytes of rows [start, stop) of dim 0 of `rows.tensor`, from every
    chunk that holds part of them (into `view` when given)."""
    tensor = rows.tensor
    shape, itemsize = tensor.shape, tensor.itemsize
    row_bytes = math.prod(shape[1:]) * itemsize
    out = bytearray((rows.stop - rows.start) * row_bytes) if view is None else view
    view = memoryview(out)
    filled = 0
    for chunk, raw, begin, end, full_width in _crossings(rows):
        first = chunk.offsets[0]
        if raw is not None and full_width:
            files.read_into(raw.file, raw.offset + (begin - first) * row_bytes,
                            view[(begin - rows.start) * row_bytes:(end - rows.start) * row_bytes])
            filled += (end - begin) * row_bytes
            continue
        data = files.read(raw.file, raw.offset, raw.length) if raw is not None else read_chunk(files, tensor, chunk)
        filled += _place(data, chunk, shape, itemsize, begin, end, rows.start, view)
    if filled < len(out):
        raise CorruptBlob(f"{files.root}: {tensor.fqn}: the chunks cover only {filled} of the {len(out)} bytes of "
                          f"rows {rows.start}..{rows.stop}")
    return out


def _place(data: bytes, chunk: Any, shape: tuple[int, ...], itemsize: int, begin: int, end: int, start: int,
           view: memoryview) -> int:
    """Copy rows [begin, end) of a whole chunk's bytes into their box of the rows buffer."""
    import numpy as np

    sizes = chunk.sizes
    box = np.frombuffer(data, dtype=np.uint8).reshape(*sizes[:-1], sizes[-1] * itemsize)
    target = np.frombuffer(view, dtype=np.uint8).reshape(-1, *shape[1:-1], shape[-1] * itemsize) if len(shape) > 1 \
        else np.frombuffer(view, dtype=np.uint8).reshape(-1, itemsize)
    inner = tuple(slice(o, o + s) for o, s in zip(chunk.offsets[1:-1], sizes[1:-1]))
    last = slice(chunk.offsets[-1] * itemsize, (chunk.offsets[-1] + sizes[-1]) * itemsize) if len(shape) > 1 \
        else slice(0, itemsize)
    source = box[begin - chunk.offsets[0]:end - chunk.offsets[0]]
    if len(shape) == 1:
        source = source.reshape(-1, itemsize)
    target[(slice(begin - start, end - start), *inner, last)] = source
    return source.size


def row_ranges(rows: Rows) -> list[tuple[str, int, int]]:
    """Return the (file, start, end) byte ranges of the source that `read_rows` reads."""
    tensor = rows.tensor
    if not tensor.shape:  # a 0-d scale: its one chunk whole
        return [(raw.file, raw.offset, raw.offset + raw.length) for _, raw in rows.located if raw is not None]
    row_bytes = math.prod(tensor.shape[1:]) * tensor.itemsize
    ranges = []
    for chunk, raw, begin, end, full_width in _crossings(rows):
        if raw is None:
            if chunk.blob is not None:
                ranges.append((chunk.blob.file, chunk.blob.offset, chunk.blob.offset + chunk.blob.length))
        elif full_width:
            first = chunk.offsets[0]
            ranges.append((raw.file, raw.offset + (begin - first) * row_bytes, raw.offset + (end - first) * row_bytes))
        else:
            ranges.append((raw.file, raw.offset, raw.offset + raw.length))
    return ranges
