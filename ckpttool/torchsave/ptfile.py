"""A nested `.pt` file (what `torch.save(state_dict)` writes), laid out so tensor bytes can be
copied into place.

The pickle is made first (it needs only names, dtypes and shapes), so every storage's offset
is known before any tensor byte is read; tensor bytes are then copied to their offsets like
safetensors data, and the rest of the zip (headers, descriptors with each storage's CRC-32,
the directory) is written last. The result loads with `torch.load(weights_only=True)`, and
memory never holds more than the buffers of the copies.

Example:
    >>> pickled = pickle_state([(("w",), "float32", (2, 2))], objects=[])
    >>> layout = lay_out(pickled, [16])
    >>> layout.data_offsets[0] % 64
    0
"""

from __future__ import annotations

import importlib
import io
import pickle
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

from ckpttool.torchsave import archive
from ckpttool.torchsave.archive import tensor_bytes
from ckpttool.torchsave.crc32 import crc32_combine as crc32_combine  # its home is crc32.py; callers import it here too
from ckpttool.torchsave.pickle import PROTOCOL, Global, Opcodes, PersistentId, Reduce, dumps

SUFFIXES = (".pt", ".bin", ".pth")
ARCHIVE = archive.ARCHIVE
_PLAIN_ATOMS = (type(None), bool, int, float, str, bytes)


@dataclass(frozen=True)
class PickledState:
    """data.pkl, and the raw bytes of tensors found inside python objects (stored inline)."""

    data: bytes
    inline: tuple[bytes, ...]  # storages numbered after the planned tensors


def pickle_state(
    tensors: Sequence[tuple[tuple, str, tuple[int, ...]]],
    objects: Sequence[tuple[tuple, Any]],
) -> PickledState:
    """Return data.pkl for a nested dict: `tensors` are (path, dtype, shape), stored as
    storages "0", "1", ... in order; `objects` are (path, python value).

    A path is the tuple of keys (int keys make lists, as DCP's planner_data says). Plain
    python values are written by our own pickle writer; only values holding other types
    (torch.Size, tensors, sets, ...), which torch decoded, are pickled with torch's classes.
    """
    root = _Node()
    for position, (path, dtype, shape) in enumerate(tensors):
        _place(root, path, archive.tensor(str(position), dtype, tuple(shape)))
    inline: list[bytes] = []
    for path, value in objects:
        if not _is_plain(value):
            value = _python_pickled(value, len(tensors), inline)
        _place(root, path, value)
    return PickledState(dumps(_lists(root)), tuple(inline))


def _is_plain(value: Any) -> bool:
    """True when our writer can pickle `value` as it is."""
    kind = type(value)
    if kind in _PLAIN_ATOMS:
        return True
    try:
        if kind in (tuple, list):
            return all(_is_plain(item) for item in value)
        if kind is dict:
            return all(_is_plain(key) and _is_plain(item) for key, item in value.items())
    except RecursionError:  # a list that holds itself: Python's pickler keeps the cycle
        return False
    return False


class _Node(dict):
    """A dict made from a path; python objects from the checkpoint are never one."""


def _place(root: dict, path: tuple, value: Any) -> None:
    node = root
    for key in path[:-1]:
        node = node.setdefault(key, _Node())
    node[path[-1]] = value


def _lists(node: Any) -> Any:
    """Turn path dicts whose keys are exactly 0..n-1 (DCP's list positions) into lists, as
    torch's `unflatten_state_dict` does; values stored at a path stay as they are."""
    if type(node) is not _Node:
        return node
    converted = {key: _lists(value) for key, value in node.items()}
    keys = list(converted)
    if keys and all(type(k) is int for k in keys) and sorted(keys) == list(range(len(keys))):
        return [converted[k] for k in range(len(keys))]
    return converted


@dataclass(frozen=True)
class _Persistent:
    """A storage inside a python object holding torch types, pickled as its persistent id."""

    pid: tuple


def _real(value: Any) -> Any:
    """Return what a stand-in stands for, for Python's pickler (torch is imported already: it
    decoded the value being pickled)."""
    if isinstance(value, Global):
        return getattr(importlib.import_module(value.module), value.name)
    if isinstance(value, Reduce):
        return _real(value.function)(*_real(value.args))
    if isinstance(value, PersistentId):
        return _Persistent(_real(value.pid))
    if type(value) is tuple:
        return tuple(_real(item) for item in value)
    return value


class _ObjectPickler(pickle.Pickler):
    """Python's pickler; the tensors it meets become storages stored inline in the .pt, keys
    numbered from `first_key` on."""

    def __init__(self, file: io.BytesIO, first_key: int, inline: list[bytes]):
        super().__init__(file, protocol=PROTOCOL)
        self.first_key, self.inline = first_key, inline

    def reducer_override(self, obj: Any) -> Any:
        import torch

        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        key = str(self.first_key + len(self.inline))
        self.inline.append(tensor_bytes(obj))
        stand_in = archive.tensor(key, str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
        return _real(stand_in.function), _real(stand_in.args)

    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, _Persistent) else None


def _python_pickled(value: Any, first_key: int, inline: list[bytes]) -> Opcodes:
    buffer = io.BytesIO()
    _ObjectPickler(buffer, first_key, inline).dump(value)
    return Opcodes(buffer.getvalue()[2:-1])  # without PROTO 2 and STOP


@dataclass(frozen=True)
class PtLayout:
    """Where everything of a .pt goes: planned storages (copied in by the caller) first, then
    the pickled state's inline ones."""

    archive_layout: archive.Layout
    inline: tuple[bytes, ...]

    @property
    def size(self) -> int:
        return self.archive_layout.length

    @property
    def data_offsets(self) -> tuple[int, ...]:
        """Where each planned storage's bytes go, in key order."""
        planned = self.archive_layout.storages[:len(self.archive_layout.storages) - len(self.inline)]
        return tuple(entry.data_offset for entry in planned)


def lay_out(pickled: PickledState, storage_sizes: Sequence[int]) -> PtLayout:
    """Return where every zip entry goes, for planned storages of these byte sizes (in key
    order) followed by the pickled state's inline storages."""
    sizes = [*storage_sizes, *(len(data) for data in pickled.inline)]
    return PtLayout(archive.lay_out(pickled.data, sizes), pickled.inline)


def zip_records(layout: PtLayout, crcs: dict[str, int]) -> list[tuple[int, bytes]]:
    """Return (offset, bytes) of everything but the planned storages' data, given the CRC-32
    of each planned storage by entry name (`archive/data/<key>`)."""
    storages = layout.archive_layout.storages
    planned = storages[:len(storages) - len(layout.inline)]
    storage_crcs = [crcs[entry.name] for entry in planned] + [zlib.crc32(data) for data in layout.inline]
    inline_writes = [(entry.data_offset, data) for entry, data in zip(storages[len(planned):], layout.inline)]
    return archive.writes(layout.archive_layout, storage_crcs) + inline_writes
