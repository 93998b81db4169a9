"""torch.save records of one tensor each, built end to end into a buffer from their data.

Reshard writes hundreds of thousands of small records; each needs the CRC-32 of its data,
the serialization id made from it and that id's own CRC-32 (`record.RecordLayout.tail`).
`assemble` builds them in C (`_records.c`, built by setup.py with zlib: `native`) when the
module is there, else in Python (`assemble_in_python`); both give the same bytes, which are those of
`layout.head + data + layout.tail(zlib.crc32(data))` per record.

Example:
    >>> out = bytearray(2 * record_layout("float32", (4,)).length)
    >>> assemble(out, source, [0, 0], [0, 16], [record_layout("float32", (4,))], 0, len(out))
    (2, 1472)
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence

from ckpttool.torchsave import native
from ckpttool.torchsave.record import RecordLayout


def assemble(out: Any, source: Any, kinds: Sequence[int], positions: Sequence[int], layouts: Sequence[RecordLayout],
             first: int, limit: int) -> tuple[int, int]:
    """Return (next record, bytes written) after writing records `first`, `first + 1`, ...
    into the writable buffer `out` from its start, until `limit` bytes or more are written or
    the records end. Record i is `layouts[kinds[i]]` holding the `data_length` bytes at
    `positions[i]` of `source`. Raises ValueError (nothing written) when a record's data
    runs past `source` or the records do not fit `out`."""
    if native.records is None:
        return assemble_in_python(out, source, kinds, positions, layouts, first, limit)
    return native.records.assemble(out, source, kinds, positions, tuple(_parts(layout) for layout in layouts), first, limit)


def assemble_in_python(out: Any, source: Any, kinds: Sequence[int], positions: Sequence[int],
                       layouts: Sequence[RecordLayout], first: int, limit: int) -> tuple[int, int]:
    """`assemble` without the C module: the same bytes, the same checks."""
    stop, planned = first, 0
    while stop < len(kinds) and planned < limit:
        layout = layouts[kinds[stop]]
        if not 0 <= positions[stop] <= len(source) - layout.data_length:
            raise ValueError(f"record {stop}: data at {positions[stop]} runs past the source buffer")
        planned += layout.length
        stop += 1
    if planned > len(out):
        raise ValueError(f"{planned} bytes of records do not fit the {len(out)}-byte output buffer")
    view, source_view, at = memoryview(out), memoryview(source), 0
    for index in range(first, stop):
        layout = layouts[kinds[index]]
        data = source_view[positions[index]:positions[index] + layout.data_length]
        for piece in (layout.head, data, layout.tail(zlib.crc32(data))):
            view[at:at + len(piece)] = piece
            at += len(piece)
    return stop, planned


def _parts(layout: RecordLayout) -> tuple[bytes, int, tuple[bytes, ...], tuple[int, ...], bytes, bytes]:
    """What `_records.assemble` takes of a layout: head, data length, the tail's segments and
    fields, and the packed CRC-32s of the other entries (before and after the data's)."""
    patches = layout.tail_patches
    return (layout.head, layout.data_length, patches.segments, patches.fields, patches.crcs_before, patches.crcs_after)
