"""The uncompressed zip torch.save writes: reading its directory, and laying one out to write.

Reading takes a `read(offset, length)` of the archive's bytes (it may be a blob inside a
larger file) and trusts nothing: every offset is checked against the archive's length.

Writing lays entries out one after another: a local header whose padding extra field makes
the data start 64-byte aligned (torch.save's storage alignment, so torch can mmap it), the
data, then a data descriptor carrying the CRC-32. The headers do not depend on the data, so
they can be written before it; the descriptors and the central directory (always closed by
zip64 end records, as torch's writer does) follow once the CRCs are known.

Example:
    >>> entries = place([("archive/data.pkl", 5), ("archive/data/0", 160)])
    >>> [entry.data_offset % ALIGNMENT for entry in entries]
    [0, 0]
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Sequence

from ckpttool.core.errors import CorruptBlob, UnsupportedFormat

# APPNOTE.TXT (PKWARE's zip specification) record layouts, signature first
LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header, 46 bytes
DESCRIPTOR = struct.Struct("<IIII")  # data descriptor: signature, crc, sizes
DESCRIPTOR64 = struct.Struct("<IIQQ")
EOCD = struct.Struct("<IHHHHIIH")  # end of central directory, 22 bytes
EOCD64 = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory, 56 bytes
EOCD64_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
LOCAL_MAGIC = b"PK\x03\x04"
LOCAL_SIGNATURE, CENTRAL_SIGNATURE, DESCRIPTOR_SIGNATURE = 0x04034B50, 0x02014B50, 0x08074B50
EOCD_SIGNATURE, EOCD64_SIGNATURE, EOCD64_LOCATOR_SIGNATURE = 0x06054B50, 0x06064B50, 0x07064B50
ZIP64_TAG = 0x0001
PADDING_TAG = 0x4246  # "FB": the padding extra field torch's writer (caffe2 inline_container.cc) uses
UINT32_MAX = 0xFFFFFFFF  # a field at this value says "see the zip64 extra field"
UTF8_NAMES_AND_DESCRIPTOR = 0x0808  # general purpose flags: bit 11 (UTF-8 names), bit 3 (descriptor)
UNSUPPORTED_FLAGS = 0x0001 | 0x0020 | 0x0040  # encrypted, compressed patch, strong encryption (miniz refuses)
VERSION, ZIP64_VERSION = 20, 45  # "version needed to extract": 2.0, or 4.5 for zip64 fields
DOS_DIRECTORY = 0x10  # external attributes: MS-DOS directory bit (miniz then treats the entry as a directory)
ALIGNMENT = 64  # caffe2/serialize/inline_container.h kFieldAlignment

Read = Callable[[int, int], bytes]  # (offset, length) -> exactly those bytes of the archive


@dataclass(frozen=True)
class Entry:
    """A file of the archive, as its central directory describes it."""

    name: str
    local_offset: int
    size: int  # stored (compressed) size
    crc32: int
    method: int
    uncompressed_size: int = 0
    flags: int = 0
    disk: int = 0  # the disk its local header is on: 0 in any archive torch can read
    central_offset: int = -1  # where its central directory header starts in the archive


def read_directory(read: Read, length: int, where: str) -> dict[str, Entry]:
    """Return the archive's entries by name, from its end records and central directory."""
    # the end record is the last signature that leaves room for it: at length - 22 when the
    # archive has no comment (as torch writes it), then the last bytes (with the zip64
    # locator before it) are all there is to read; else search the last 64 KiB
    tail_length = min(length, EOCD.size + EOCD64_LOCATOR.size)
    tail = read(length - tail_length, tail_length)
    if tail[-EOCD.size:-EOCD.size + 4] != b"PK\x05\x06" or len(tail) < EOCD.size:
        tail_length = min(length, 65536)
        tail = read(length - tail_length, tail_length)
    position = tail.rfind(b"PK\x05\x06", 0, len(tail) - EOCD.size + 4)
    if position < 0:
        raise CorruptBlob(f"{where}: torch.save record has no zip directory (truncated blob?)")
    (_, disk, directory_disk, on_disk, count, cd_size, cd_offset, _) = EOCD.unpack_from(tail, position)
    if disk not in (0, 0xFFFF) or directory_disk not in (0, 0xFFFF) or on_disk != count:
        raise CorruptBlob(f"{where}: torch.save record's zip end record is damaged")
    locator = position - EOCD64_LOCATOR.size
    if locator >= 0 and tail[locator:locator + 4] == b"PK\x06\x07":
        # torch writes zip64 end records (miniz) and its reader trusts them over the classic one
        (_, _, eocd64_offset, disks) = EOCD64_LOCATOR.unpack_from(tail, locator)
        if eocd64_offset + EOCD64.size > length:
            raise CorruptBlob(f"{where}: zip64 end record lies outside the blob")
        fields = EOCD64.unpack(read(eocd64_offset, EOCD64.size))
        if fields[0] != EOCD64_SIGNATURE or fields[6] != fields[7] or fields[1] < EOCD64.size - 12:
            raise CorruptBlob(f"{where}: torch.save record's zip64 end record is damaged")
        # miniz (torch's zip reader) refuses what looks like a multi-disk archive
        if disks != 1 or (fields[4], fields[5]) not in ((0, 0), (1, 1)):
            raise CorruptBlob(f"{where}: torch.save record's zip64 end records name several disks (damaged)")
        classic = (count, cd_size, cd_offset)
        count, cd_size, cd_offset = fields[7], fields[8], fields[9]
        saturated = (0xFFFF, UINT32_MAX, UINT32_MAX)
        if any(old != new and old != cap for old, new, cap in zip(classic, (count, cd_size, cd_offset), saturated)):
            raise CorruptBlob(f"{where}: torch.save record's zip end records disagree")
    elif count == 0xFFFF or cd_size == UINT32_MAX or cd_offset == UINT32_MAX:
        raise CorruptBlob(f"{where}: zip64 record locator missing")
    if cd_offset + cd_size > length:
        raise CorruptBlob(f"{where}: zip directory lies outside the blob")
    directory = read(cd_offset, cd_size)
    entries: dict[str, Entry] = {}
    at = 0
    for _ in range(count):
        if directory[at:at + 4] != b"PK\x01\x02":
            raise CorruptBlob(f"{where}: damaged zip directory")
        fields = CENTRAL.unpack_from(directory, at)
        method, crc, csize, usize = fields[4], fields[7], fields[8], fields[9]
        name_length, extra_length, comment_length, local_offset = fields[10], fields[11], fields[12], fields[16]
        name_start = at + CENTRAL.size
        if name_start + name_length + extra_length + comment_length > cd_size:
            raise CorruptBlob(f"{where}: damaged zip directory (an entry runs past its end)")
        name = directory[name_start:name_start + name_length].decode("utf-8", "replace")
        extra = directory[name_start + name_length:name_start + name_length + extra_length]
        usize, csize, local_offset = _zip64_values(extra, usize, csize, local_offset)
        if fields[15] & DOS_DIRECTORY or name.endswith("/"):
            raise CorruptBlob(f"{where}: zip entry {name} is marked as a directory (torch's reader returns no bytes for it)")
        entries[name] = Entry(name, local_offset, csize, crc, method, usize, fields[3], fields[13], cd_offset + at)
        at = name_start + name_length + extra_length + comment_length
    return entries


def _zip64_values(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    """Return the sizes and offset with the saturated ones taken from the zip64 extra field."""
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, at)
        if tag == ZIP64_TAG:
            values = iter(struct.unpack_from(f"<{length // 8}Q", extra, at + 4))
            if usize == UINT32_MAX:
                usize = next(values)
            if csize == UINT32_MAX:
                csize = next(values)
            if offset == UINT32_MAX:
                offset = next(values)
            break
        at += 4 + length
    return usize, csize, offset


def entry_data_offset(read: Read, length: int, entry: Entry, where: str) -> int:
    """Return where an uncompressed entry's bytes start, from its local header."""
    fields = LOCAL.unpack(read(entry.local_offset, LOCAL.size))
    if fields[0] != LOCAL_SIGNATURE:
        raise CorruptBlob(f"{where}: zip entry {entry.name} has a damaged header")
    start = entry.local_offset + LOCAL.size + fields[9] + fields[10]
    if entry.method != 0:
        raise UnsupportedFormat(f"{where}: zip entry {entry.name} is compressed (method {entry.method})")
    if start + entry.size > length:
        raise CorruptBlob(f"{where}: zip entry {entry.name} runs past the end of its blob")
    return start


def entry_bytes(read: Read, length: int, entry: Entry, where: str, limit: int) -> bytes:
    """Return an entry's stored bytes, refusing entries larger than `limit`."""
    if entry.size > limit:
        raise CorruptBlob(f"{where}: zip entry {entry.name} is implausibly large ({entry.size} bytes)")
    return read(entry_data_offset(read, length, entry, where), entry.size)


def find_entry(entries: dict[str, Entry], suffix: str) -> Entry | None:
    """Return the entry named `suffix` or `<folder>/.../suffix` (torch.save names the folder
    after the file), or None."""
    return next((entry for name, entry in entries.items() if name == suffix or name.endswith("/" + suffix)), None)


def entry_in(buffers: list[tuple[int, bytes]], entry: Entry) -> bytes | None:
    """Return an entry's stored bytes from the (offset, bytes) buffer holding its local header
    and data, or None when that header is damaged or names another entry."""
    name = entry.name.encode("utf-8")
    for start, buffer in buffers:
        at = entry.local_offset - start
        if 0 <= at and at + LOCAL.size <= len(buffer):
            fields = LOCAL.unpack_from(buffer, at)
            name_start = at + LOCAL.size
            if fields[0] != LOCAL_SIGNATURE or buffer[name_start:name_start + fields[9]] != name:
                return None
            begin = name_start + fields[9] + fields[10]
            return buffer[begin:begin + entry.size] if begin + entry.size <= len(buffer) else None
    return None


@dataclass(frozen=True)
class Placed:
    """An entry placed in an archive being written: its local header, then its data at
    `data_offset`, then a data descriptor."""

    name: str
    offset: int  # of the local header, from the start of the archive
    header: bytes  # the local header: name, zip64 sizes when needed, alignment padding
    size: int

    @property
    def data_offset(self) -> int:
        return self.offset + len(self.header)

    @property
    def zip64_size(self) -> bool:
        return self.size >= UINT32_MAX

    @property
    def end(self) -> int:
        """Where the next entry starts (after the data descriptor)."""
        descriptor = DESCRIPTOR64 if self.zip64_size else DESCRIPTOR
        return self.data_offset + self.size + descriptor.size


def place(entries: Sequence[tuple[str, int]], start: int = 0) -> list[Placed]:
    """Return where each (name, size) entry goes, written one after the other from `start`.

    Example:
        >>> [(e.offset, e.data_offset, e.end) for e in place([("a", 3), ("b", 0)])]
        [(0, 64, 83), (83, 128, 144)]
    """
    placed = []
    at = start
    for name, size in entries:
        encoded = name.encode("utf-8")
        zip64 = struct.pack("<HHQQ", ZIP64_TAG, 16, size, size) if size >= UINT32_MAX else b""
        unpadded = at + LOCAL.size + len(encoded) + len(zip64) + 4  # 4: the padding field's tag and length
        padding = -unpadded % ALIGNMENT
        extra = zip64 + struct.pack("<HH", PADDING_TAG, padding) + b"Z" * padding
        version, sizes = (ZIP64_VERSION, UINT32_MAX) if zip64 else (VERSION, 0)
        # the crc (and sizes, unless in the zip64 field) are left zero: the data descriptor
        # after the data carries them
        header = LOCAL.pack(
            LOCAL_SIGNATURE, version, UTF8_NAMES_AND_DESCRIPTOR, 0, 0, 0, 0, sizes, sizes, len(encoded), len(extra)
        )
        entry = Placed(name, at, header + encoded + extra, size)
        placed.append(entry)
        at = entry.end
    return placed


def descriptor(entry: Placed, crc32: int) -> bytes:
    """Return the data descriptor that follows the entry's data."""
    layout = DESCRIPTOR64 if entry.zip64_size else DESCRIPTOR
    return layout.pack(DESCRIPTOR_SIGNATURE, crc32, entry.size, entry.size)


def directory(entries: Sequence[Placed], crcs: Sequence[int]) -> bytes:
    """Return the central directory and end records, which start at the last entry's end."""
    start = entries[-1].end if entries else 0
    out = bytearray()
    for entry, crc in zip(entries, crcs, strict=True):
        name = entry.name.encode("utf-8")
        zip64 = [entry.size, entry.size] if entry.zip64_size else []
        if entry.offset >= UINT32_MAX:
            zip64.append(entry.offset)
        extra = struct.pack(f"<HH{len(zip64)}Q", ZIP64_TAG, 8 * len(zip64), *zip64) if zip64 else b""
        version = ZIP64_VERSION if zip64 else VERSION
        size = min(entry.size, UINT32_MAX)
        out += CENTRAL.pack(
            CENTRAL_SIGNATURE, ZIP64_VERSION, version, UTF8_NAMES_AND_DESCRIPTOR, 0, 0, 0,
            crc, size, size, len(name), len(extra), 0, 0, 0, 0, min(entry.offset, UINT32_MAX),
        )
        out += name + extra
    count, length, end64 = len(entries), len(out), start + len(out)
    out += EOCD64.pack(
        EOCD64_SIGNATURE, EOCD64.size - 12, ZIP64_VERSION, ZIP64_VERSION, 0, 0, count, count, length, start
    )
    out += EOCD64_LOCATOR.pack(EOCD64_LOCATOR_SIGNATURE, 0, end64, 1)
    out += EOCD.pack(
        EOCD_SIGNATURE, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
        min(length, UINT32_MAX), min(start, UINT32_MAX), 0,
    )
    return bytes(out)


def directory_length(entries: Sequence[Placed]) -> int:
    """Return the length of `directory(entries, ...)`, which does not depend on the CRCs."""
    return len(directory(entries, [0] * len(entries)))
