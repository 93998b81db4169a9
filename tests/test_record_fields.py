"""`validate --deep` refuses every torch.save record that torch's own reader refuses.

Each record is a real one, written by torch's `dcp.save` (a tensor chunk, and a python object
whose `data.pkl` is the record's largest entry). Every field of every zip structure in it
(local headers, central directory entries, zip64 end record, its locator, the end record) is
set in turn to 0, to all ones, to one more and to its lowest bit flipped, in place. For each
mutant, torch's reader (`torch.load(weights_only=True)` of the blob, as DCP's FileSystemReader
does) either returns the saved value or it does not; when it does not, `validate --deep` must
call the checkpoint INVALID. (validate may be stricter: torch ignores CRC-32s and the classic
end record's fields when a zip64 one is present; validate reports those as damage.)
"""

from __future__ import annotations

import io
import struct

import pytest

from ckpttool.commands.validate import validate
from ckpttool.torchsave.zip import CENTRAL, EOCD, EOCD64, EOCD64_LOCATOR, LOCAL

from test_reader import save_single_process

STRUCTURES = ((b"PK\x03\x04", LOCAL, "local header"), (b"PK\x01\x02", CENTRAL, "central entry"),
              (b"PK\x06\x06", EOCD64, "zip64 end record"), (b"PK\x06\x07", EOCD64_LOCATOR, "zip64 locator"),
              (b"PK\x05\x06", EOCD, "end record"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    path = tmp_path_factory.mktemp("records") / "ckpt"
    state = {"model": {"w": torch.arange(24, dtype=torch.float32).reshape(4, 6)}, "extra": {"note": ["hello"] * 50}}
    save_single_process(path, state)
    blobs = {key.fqn: info for key, info in FileSystemReader(path).read_metadata().storage_data.items()}
    return path, state, blobs


def fields(record: bytes):
    """Yield (name, offset, size) of every field of every zip structure in the record."""
    for signature, layout, label in STRUCTURES:
        at, number = record.find(signature), 0
        while at >= 0:
            position = at
            for index, code in enumerate(layout.format.lstrip("<")):
                size = struct.calcsize("<" + code)
                yield f"{label} {number} field {index}", position, size
                position += size
            at, number = record.find(signature, at + 4), number + 1


def torch_returns(record: bytes, expected) -> bool:
    import torch

    try:
        value = torch.load(io.BytesIO(record), map_location="cpu", weights_only=True)
    except Exception:
        return False
    if isinstance(expected, torch.Tensor):
        return isinstance(value, torch.Tensor) and value.dtype == expected.dtype and torch.equal(value, expected)
    return value == expected


@pytest.mark.parametrize("fqn", ["model.w", "extra.note"])
def test_validate_deep_refuses_every_header_mutation_torchs_reader_refuses(saved, fqn):
    path, state, blobs = saved
    expected = state["model"]["w"] if fqn == "model.w" else state["extra"]["note"]
    info = blobs[fqn]
    data_file = path / info.relative_path
    original = data_file.read_bytes()
    record = original[info.offset:info.offset + info.length]
    assert torch_returns(record, expected) and validate(path, deep=True).valid
    missed, torch_refused = [], 0
    try:
        for name, at, size in fields(record):
            value, top = int.from_bytes(record[at:at + size], "little"), (1 << 8 * size) - 1
            for new in sorted({0, top, (value + 1) & top, value ^ 1} - {value}):
                mutant = record[:at] + new.to_bytes(size, "little") + record[at + size:]
                if torch_returns(mutant, expected):
                    continue
                torch_refused += 1
                data_file.write_bytes(original[:info.offset] + mutant + original[info.offset + info.length:])
                if validate(path, deep=True).valid:
                    missed.append(f"{name} = {new:#x} (was {value:#x})")
    finally:
        data_file.write_bytes(original)
    assert torch_refused > 50  # the mutations do reach torch's checks
    assert not missed, f"validate --deep calls VALID what torch refuses: {missed}"
