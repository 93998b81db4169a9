"""Outputs on object storage: what `io.atomic_output`/`atomic_directory` do for a URL.

Outputs (`remote_output`) become visible only when complete, in one of two ways:

- streamed (S3 through s3fs, for outputs written in order: `.safetensors`, Hub folders,
  DCP): each data file is a multipart upload to its final key, parts sent as soon as they
  are filled (`MultipartSink`), so no local copy of the output is needed and at most a few
  parts are in memory. Nothing is visible until the commit completes the uploads (small
  files such as `.metadata` and indexes are put last); any failure or SIGTERM aborts them.
- staged (torch.save `.pt` outputs, whose zip headers are written after the data; `--verify`,
  which reads the output back; backends other than s3fs): built in a local temporary
  directory, uploaded to a temporary key `.ckpttool-tmp-NAME.HOST.PID.TOKEN` beside the
  destination, then copied to the final keys (data files first, `.metadata` and indexes last)
  and the temporary keys deleted; any failure or SIGTERM deletes them instead.

A killed run's leftovers (temporary keys, a streamed run's marker key and unfinished uploads)
are removed by the next run that writes the same destination (`remove_stale_temps`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

from ckpttool.errors import OutputExists, StorageError
from ckpttool.storage import RemotePath, _requests

PART = 8 << 20  # smallest multipart part we send (S3 needs >= 5 MiB for all parts but the last)
MAX_PARTS = 9000  # of S3's 10,000: parts grow with the output to stay below
LAST_KEYS = (".metadata", ".index.json")  # copied last: a reader sees the checkpoint only when all else is there


def check_destination(path: RemotePath, force: bool) -> None:
    """Raise OutputExists when something is at `path` (an object or a prefix) and `force` is
    off, and StorageError when its bucket does not exist: before any work is done. First
    removes the temporary keys that killed runs on this host left beside `path`
    (`remove_stale_temps`)."""
    fs, bucket = path.filesystem, path.key.split("/", 1)[0]
    with _requests(str(path)):
        fs.invalidate_cache(path.key)  # an earlier run in this process may have written it
        from ckpttool import io

        for stale in remove_stale_temps(path):
            for listener in io._stale_listeners:
                listener(stale)
        exists = fs.exists(path.key)
        with contextlib.suppress(PermissionError):  # a role that may write but not list buckets: the upload will tell
            if not exists and not fs.exists(bucket):
                raise StorageError(f"{path}: the bucket {path._protocol}://{bucket} does not exist (create it "
                                   "first, or check the endpoint)", "no-bucket")
    if exists and not force:
        raise OutputExists(f"{path}: already exists; pass --force to replace it")


def remove_stale_temps(target: RemotePath) -> list:
    """Remove and return (as `io.StaleTemp`s) the `.ckpttool-tmp-NAME.HOST.PID.TOKEN` keys
    beside `target` whose run, on this host, is gone: what a SIGKILL leaves (a staged run's
    temporary upload, or a streamed run's empty marker key, whose unfinished multipart
    uploads to `target` are aborted too when no live run writes there). Keys of live runs
    and of other hosts are left alone."""
    from ckpttool import io

    fs, parent = target.filesystem, target.parent.key
    try:
        names = [name.rstrip("/").rsplit("/", 1)[-1] for name in fs.ls(parent, detail=False, refresh=True)]
    except FileNotFoundError:
        return []
    found = [(name, match) for name in sorted(set(names))
             if (match := io._ENTRY.fullmatch(name)) and match["kind"] == "tmp" and match["name"] == target.name]
    dead = [(name, match) for name, match in found if io._is_dead(match["host"], int(match["pid"]), match["token"])]
    removed = []
    for name, match in dead:
        if len(dead) == len(found):  # no live run writes `target`: unfinished uploads there are the dead runs'
            _abort_uploads(target, f"{parent}/{name}")
        fs.rm(f"{parent}/{name}", recursive=True)
        removed.append(io.StaleTemp(target.parent / name, target, int(match["pid"])))
    return removed


def _abort_uploads(target: RemotePath, marker: str) -> None:
    """Abort the unfinished multipart uploads to `target` (or keys under it), when `marker`
    is the empty key a killed streamed run put beside it."""
    fs = target.filesystem
    if not hasattr(fs, "call_s3") or not fs.isfile(marker) or fs.size(marker):
        return
    bucket, key, _ = fs.split_path(target.key)
    listing = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
    for upload in listing.get("Uploads", []):
        if upload["Key"] == key or upload["Key"].startswith(key + "/"):
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])


def _temp_key(target: RemotePath) -> str:
    from ckpttool import io

    return f"{target.parent.key}/{io._entry(Path(target.name), 'tmp', io._new_token()).name}"


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
        with self._lock, _requests(self.url):
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
        with _requests(self.url):
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
        with _requests(self.url):
            if self._upload_id is None:  # an empty object: nothing was sent
                self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.path, Body=b"")
                return
            parts = [{"PartNumber": index + 1, "ETag": etag} for index, etag in sorted(self._etags.items())]
            self.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self.path,
                            UploadId=self._upload_id, MultipartUpload={"Parts": parts})
            self._upload_id = None

    def abort(self) -> None:
        if self._upload_id is not None:
            with contextlib.suppress(Exception), _requests(self.url):
                self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.path, UploadId=self._upload_id)
            self._upload_id = None


def _put(fs: Any, local: Path, key: str) -> None:
    """Upload a local file in parts of `_part_size`, at most 4 in flight (s3fs's defaults,
    50 MiB x 10, held a 1 GB output whole in memory); other backends their own way."""
    if hasattr(fs, "call_s3"):
        fs.put_file(str(local), key, chunksize=_part_size(local.stat().st_size), max_concurrency=4)
    else:
        fs.put_file(str(local), key)


def _part_size(size: int) -> int:
    """PART (or CKPTTOOL_PART_SIZE), grown in MiB steps so `size` needs at most MAX_PARTS parts."""
    smallest = int(os.environ.get("CKPTTOOL_PART_SIZE") or PART)
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
            import ctypes

            ctypes.memset((ctypes.c_char * size).from_buffer(buffer), 0, size)  # in place: no second buffer
            return buffer


class _Streams:
    """The multipart uploads of one streamed output, by file name (`opened` gives them out)."""

    def __init__(self, target: RemotePath, directory: bool):
        self.target, self.directory = target, directory
        self.sinks: dict[str, MultipartSink] = {}

    def key(self, name: str) -> str:
        return f"{self.target.key}/{name}" if self.directory else self.target.key

    def sink(self, name: str) -> MultipartSink:
        sink = self.sinks[name] = MultipartSink(self.target.filesystem, self.key(name), f"{self.target}/{name}")
        return sink

    def commit(self, local: Path, force: bool) -> None:
        """Send what is left, then, with signals deferred and the old output replaced as
        `_replacing` says: complete every upload, then put the small local files (`.metadata`
        and indexes last)."""
        from ckpttool import io

        for sink in self.sinks.values():
            sink.finish()
            io._test_pause("upload")  # on the main thread, where signals arrive
        small = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()) if self.directory else []
        small.sort(key=lambda name: name.endswith(LAST_KEYS))
        fs, target = self.target.filesystem, self.target
        with _requests(str(target)), io._signals_deferred(), _replacing(target, force, self.directory) as made:
            for name, sink in self.sinks.items():
                sink.complete()
                made.append(self.key(name))
            for name in small:
                _put(fs, local / name, self.key(name))
                made.append(self.key(name))

    def abort(self) -> None:
        for sink in self.sinks.values():
            sink.abort()


_streams: dict[Path, _Streams] = {}  # local stand-in directory of a streamed output -> its uploads


def streamed_outputs(directory: Path) -> _Streams | None:
    """The uploads that stand behind `directory` when it is the local stand-in of a streamed
    remote output (`remote_output(..., streamed=True)`), else None."""
    return _streams.get(Path(directory))


@contextlib.contextmanager
def remote_output(target: RemotePath, force: bool, directory: bool, streamed: bool = False) -> Iterator[Any]:
    """Yield where to write `target`; when the block succeeds, make it visible at `target` as
    the module docstring describes.

    Staged: yields a local temporary file path (or directory, with `directory`) under
    $TMPDIR. Streamed (`streamed` and the backend is s3fs): yields a `MultipartSink` for one
    file, or for a directory a local stand-in directory for small files, whose data files
    `execute.opened_outputs` opens as sinks. On any exception (SIGTERM and Ctrl-C included)
    the uploads are aborted, local files and temporary keys removed, and `target` is left as
    it was. After SIGKILL, unfinished multipart uploads (invisible; an S3 lifecycle rule
    `AbortIncompleteMultipartUpload` removes them) or temporary keys may remain, never an
    object at the destination key.
    """
    from ckpttool import io

    check_destination(target, force)
    local = Path(tempfile.mkdtemp(prefix=io.WRITING_PREFIX))
    fs, temp = target.filesystem, _temp_key(target)
    streams = _Streams(target, directory) if streamed and hasattr(fs, "call_s3") else None
    output = local / target.name
    try:
        if streams is not None:  # an empty key naming this run: a later run aborts our uploads if we are killed
            with _requests(str(target)):
                fs.pipe_file(temp, b"")
        if directory:
            output.mkdir()
        if streams is not None and directory:
            _streams[output] = streams
        io._test_pause("start")
        yield output if streams is None or directory else streams.sink(target.name)
        io._test_pause("commit")
        if streams is not None:
            streams.commit(output, force)
            with _requests(str(target)):
                fs.rm_file(temp)
        else:
            _upload(output, target, temp, force, directory)
    except BaseException:
        with io._signals_deferred():  # network calls: a signal now (torchrun stopping us) must not cut them short
            if streams is not None:
                streams.abort()
            with contextlib.suppress(Exception), _requests(str(target)):
                fs.invalidate_cache(target.parent.key)
                if fs.exists(temp):
                    fs.rm(temp, recursive=True)
        raise
    finally:
        _streams.pop(output, None)
        shutil.rmtree(local, ignore_errors=True)


@contextlib.contextmanager
def _replacing(target: RemotePath, force: bool, directory: bool) -> Iterator[list[str]]:
    """Yield the list the block appends each key it makes visible at `target` to (both commit
    paths). Before: with `force`, the old output's index keys are removed (so no reader pairs
    them with new data; the old checkpoint is unreadable, never mixed), an old directory where
    one file goes removed. After: what is left of the old output is removed. Should the block
    fail, the keys it made are deleted again, so a new destination stays empty."""
    fs = target.filesystem
    old = set(fs.find(target.key)) if force and directory else set()
    made: list[str] = []
    try:
        for stale in sorted(k for k in old if k.endswith(LAST_KEYS)):
            fs.rm_file(stale)
        if force and not directory and fs.isdir(target.key):
            fs.rm(target.key, recursive=True)
        yield made
    except BaseException:
        for key in made:
            with contextlib.suppress(Exception):
                fs.rm_file(key)
        raise
    for stale in sorted(old - set(made) - {k for k in old if k.endswith(LAST_KEYS)}):
        fs.rm_file(stale)
    fs.invalidate_cache()


def _upload(local: Path, target: RemotePath, temp: str, force: bool, directory: bool) -> None:
    from ckpttool import io

    fs = target.filesystem
    if directory:
        names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
        names.sort(key=lambda name: name.endswith(LAST_KEYS))  # stable: data files first
    else:
        names = [""]
    with _requests(str(target)):
        for position, name in enumerate(names):
            _put(fs, local / name if name else local, f"{temp}/{name}" if name else temp)
            if position == 0:
                io._test_pause("upload")
        with io._signals_deferred():  # from here the destination changes: finish before any signal is handled
            with _replacing(target, force, directory) as made:
                for name in names:
                    final = f"{target.key}/{name}" if name else target.key
                    fs.copy(f"{temp}/{name}" if name else temp, final)
                    made.append(final)
            fs.rm(temp, recursive=True)


