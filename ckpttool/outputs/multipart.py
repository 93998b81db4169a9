"""One object on S3 written at offsets and uploaded while it is written: a multipart upload
to its final key (`MultipartSink`), parts sent as soon as they are filled, invisible until
completed; and `put`, a local file uploaded in bounded parts.

Example:
    >>> sink = MultipartSink(fs, "bucket/model.safetensors", "s3://bucket/model.safetensors")
    >>> sink.reserve(len(data)); sink.write_at(data, 0); sink.finish(); sink.complete()
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

from ckpttool.core import testpoints
from ckpttool.store.storage import request_errors

PART = 8 << 20  # smallest multipart part we send (S3 needs >= 5 MiB for all parts but the last)
MAX_PARTS = 9000  # of S3's 10,000: parts grow with the output to stay below


class MultipartSink:
    """One output object written at offsets (as `pwrite` would) and uploaded while it is
    written: one S3 multipart upload to its final key, a part sent by the thread that fills
    it. Writes must not overlap; bytes never written are zeros. Memory is the parts
    partly filled at once (about one per writing thread). Invisible until `complete`;
    `abort` discards it."""

    def __init__(self, fs: Any, key: str, url: str, upload_id: str | None = None, size: int = 0,
                 part_size: int | None = None):
        self.fs, self.key, self.url = fs, key, url
        self.bucket, self.path, _ = fs.split_path(key)
        self.size = size
        self.part_size = part_size or _part_size(size)
        self._open: dict[int, list] = {}  # part index -> [buffer, bytes written]
        self._etags: dict[int, str] = {}
        self._upload_id = upload_id  # given: a process joining an upload another one began
        self._lock = threading.Lock()

    def reserve(self, size: int) -> None:
        """Set the object's final size (before any write); parts grow to stay under MAX_PARTS."""
        self.size = size
        self.part_size = _part_size(size)

    def begin(self) -> str:
        """Begin the upload now and return its id (for other processes to join: `MultipartSink(...,
        upload_id, size, part_size)`); otherwise it begins with the first part sent."""
        with self._lock, request_errors(self.url):
            if self._upload_id is None:
                self._upload_id = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.path)["UploadId"]
            return self._upload_id

    def part_range(self, index: int) -> tuple[int, int]:
        """The object's bytes [start, end) that part `index` (numbered index + 1) holds."""
        return self._part(index)

    def unsent(self) -> dict[int, int]:
        """Part index -> bytes written, of the parts written in part and not sent: where other
        processes wrote the rest (`take` them to merge)."""
        with self._lock:
            return {index: part[1] for index, part in self._open.items()}

    def take(self, index: int) -> bytearray:
        """Remove part `index` from those being filled and return its buffer (zeros where
        this process wrote nothing); a zeroed buffer when it wrote nothing there."""
        with self._lock:
            part = self._open.pop(index, None)
        return part[0] if part else _part_buffer(self._part(index)[1] - self._part(index)[0])

    def send(self, index: int, data: bytearray) -> None:
        """Send part `index` whole (merged from the pieces several processes wrote)."""
        self._send(index, data)

    @property
    def sent(self) -> dict[int, str]:
        """Part index -> ETag of the parts this process sent."""
        with self._lock:
            return dict(self._etags)

    def record(self, sent: dict[int, str]) -> None:
        """Count parts other processes sent into this upload (so `complete` lists them)."""
        with self._lock:
            self._etags.update(sent)

    def _part(self, index: int) -> tuple[int, int]:
        start = index * self.part_size
        return start, min(start + self.part_size, self.size)

    def write_at(self, data: bytes | memoryview, offset: int) -> None:
        view = memoryview(data).cast("B")
        if offset + len(view) > self.size:
            raise OSError(f"{self.url}: write at {offset}..{offset + len(view)} past the reserved {self.size} bytes")
        while view:
            index = offset // self.part_size
            start, end = self._part(index)
            count = min(len(view), end - offset)
            with self._lock:
                if index in self._etags:  # a bug in a plan, never a case to upload twice
                    raise OSError(f"{self.url}: bytes {offset}..{offset + count} written after their part was sent")
                part = self._open.get(index)
                if part is None:
                    part = self._open[index] = [_part_buffer(end - start), 0]
            part[0][offset - start:offset - start + count] = view[:count]
            with self._lock:
                part[1] += count
                full = part[1] == end - start
                if full:
                    del self._open[index]
            if full:
                self._send(index, part[0])
            view, offset = view[count:], offset + count

    def _send(self, index: int, data: bytearray) -> None:
        self.begin()
        with request_errors(self.url):
            response = self.fs.call_s3("upload_part", Bucket=self.bucket, Key=self.path, UploadId=self._upload_id,
                                       PartNumber=index + 1, Body=data)
        with self._lock:
            self._etags[index] = response["ETag"]
        _free_parts.append(data)

    def finish(self) -> None:
        """Send every part not sent yet (a part with bytes never written is sent with zeros)."""
        for index in range(-(-self.size // self.part_size)):
            if index not in self._etags:
                part = self._open.pop(index, None)
                start, end = self._part(index)
                self._send(index, part[0] if part else _part_buffer(end - start))

    def complete(self) -> None:
        """Make the object visible at its key (after `finish`): one request."""
        with request_errors(self.url):
            if self._upload_id is None:  # an empty object: nothing was sent
                self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.path, Body=b"")
                return
            parts = [{"PartNumber": index + 1, "ETag": etag} for index, etag in sorted(self._etags.items())]
            self.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self.path,
                            UploadId=self._upload_id, MultipartUpload={"Parts": parts})
            self._upload_id = None

    def abort(self) -> None:
        if self._upload_id is not None:
            with contextlib.suppress(Exception), request_errors(self.url):
                self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.path, UploadId=self._upload_id)
            self._upload_id = None


def put(fs: Any, local: Path, key: str) -> None:
    """Upload a local file in parts of `_part_size`, at most 4 in flight (s3fs's defaults,
    50 MiB x 10, held a 1 GB output whole in memory); other backends their own way."""
    if hasattr(fs, "call_s3"):
        fs.put_file(str(local), key, chunksize=_part_size(local.stat().st_size), max_concurrency=4)
    else:
        fs.put_file(str(local), key)


def _part_size(size: int) -> int:
    """PART (or a test's `testpoints.smallest_part`), grown in MiB steps so `size` needs at most
    MAX_PARTS parts."""
    smallest = testpoints.smallest_part() or PART
    needed = -(-size // MAX_PARTS)
    return smallest if needed <= smallest else (needed + (1 << 20) - 1) >> 20 << 20


_free_parts: list[bytearray] = []  # sent parts' buffers, for the next parts (list.append/pop are atomic)


def _part_buffer(size: int) -> bytearray:
    """A zeroed buffer of `size` bytes, reusing a sent part's: a fresh multi-MiB buffer per
    part would grow the allocator's per-thread arenas with every part (as `io.thread_buffer`
    explains), and the process's memory with the output's size."""
    while True:
        try:
            buffer = _free_parts.pop()
        except IndexError:
            return bytearray(size)
        if len(buffer) == size:
            import ctypes  # only once a part is reused: most commands never need it

            ctypes.memset((ctypes.c_char * size).from_buffer(buffer), 0, size)  # in place: no second buffer
            return buffer
