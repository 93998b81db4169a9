"""Local paths and object-storage URLs (`s3://`, `gs://`, `az://`) behind one small interface.

A remote location is a `RemotePath`: a pure path whose `str` is its URL and which answers
the few `pathlib.Path` questions the readers ask (`exists`, `is_file`, `is_dir`, `stat`,
`iterdir`, `rglob`, `read_bytes`) from one recursive listing of the prefix, so detection
and the integrity gate run unchanged. Bytes are read by `RangeReader`: one ranged GET per
run of bytes, small reads served from a read-ahead block, never a whole-object download.
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

Credentials and endpoints come from the backend's own configuration (for s3fs: `AWS_*`
environment variables, `AWS_ENDPOINT_URL`, `~/.aws`) plus `configure({"key": value})`,
which the CLI's `--storage-option key=value` sets.

Example:
    >>> root = location("s3://bucket/runs/x/step-100")
    >>> is_remote(root), str(root / ".metadata")
    (True, 's3://bucket/runs/x/step-100/.metadata')
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path, PurePosixPath
from typing import Any, Iterator, Mapping

from ckpttool.errors import OutputExists, StorageError

# protocol -> (package, ckpttool extra); the fsspec protocol names of each backend
BACKENDS = {
    "s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"), "abfs": ("adlfs", "azure"), "abfss": ("adlfs", "azure"),
}
# `s3://b/k`, and `s3:/b/k`: what pathlib makes of a URL (`Path("s3://b/k")`) on its way through code that wraps paths
_URL = re.compile(r"^(?P<protocol>" + "|".join(BACKENDS) + r"):/{1,2}(?P<key>[^/].*)?$")
_FILE_URL = re.compile(r"^file:(//)?(?P<path>/.*)$")
PART = 8 << 20  # smallest multipart part we send (S3 needs >= 5 MiB for all parts but the last)
MAX_PARTS = 9000  # of S3's 10,000: parts grow with the output to stay below
PIECE = 1 << 20  # bytes of a streamed GET's body held at once (`RangeReader.pieces`)
READ_AHEAD = 256 << 10  # a small read (record header, safetensors length) fetches this much, so its neighbours are served from memory
CACHED_BLOCKS = 16  # read-ahead blocks kept per reader (4 MiB)
LAST_KEYS = (".metadata", ".index.json")  # copied last: a reader sees the checkpoint only when all else is there

TEXT_OPTIONS = frozenset({"key", "secret", "token", "password", "account_key", "sas_token", "account_name"})  # never decoded: a secret may look like a number
_options: dict[str, Any] = {}


def parse_option(text: str) -> tuple[str, Any]:
    """Return (key, value) of a `--storage-option key=value`; JSON values (true, 3, {...}) are decoded.

    Example:
        >>> parse_option("endpoint_url=http://127.0.0.1:9000"), parse_option("anon=true")
        (('endpoint_url', 'http://127.0.0.1:9000'), ('anon', True))
    """
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        from ckpttool.errors import UsageError

        raise UsageError(f"--storage-option {text!r}: expected key=value, e.g. endpoint_url=http://127.0.0.1:9000")
    key = key.strip()
    if key in TEXT_OPTIONS:
        return key, value
    try:
        decoded = json.loads(value)
    except ValueError:
        decoded = value
    return key, decoded if isinstance(decoded, (bool, int, float, dict, list)) else value


def configure(options: Mapping[str, Any]) -> None:
    """Set the storage options every remote location opened from now on is given (fsspec's
    `storage_options`, e.g. `endpoint_url`, `key`, `secret`, `client_kwargs`)."""
    _options.clear()
    _options.update(options)


def is_remote(path: Any) -> bool:
    """True for an object-storage URL (or a `RemotePath`), False for a local path or `file://`."""
    return isinstance(path, RemotePath) or bool(_URL.match(str(path)))


def location(path: str | os.PathLike) -> Path | "RemotePath":
    """Return `path` as a `RemotePath` for a storage URL, else as a local `Path` (`file://` URLs too)."""
    if isinstance(path, RemotePath):
        return path
    text = os.fspath(path)
    match = _URL.match(text)
    if match:
        fs = open_filesystem(match["protocol"])
        cls = type(f"{match['protocol'].upper()}Path", (RemotePath,), {"_fs": fs, "_protocol": match["protocol"],
                                                                       "_listing": _Listing()})
        return cls(f"{match['protocol']}:", *(match["key"] or "").strip("/").split("/"))
    match = _FILE_URL.match(text)
    return Path(match["path"]) if match else Path(path)


def open_filesystem(protocol: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """Return the fsspec filesystem for `protocol`, configured by `configure` and `storage_options`;
    raise StorageError naming the extra to install when its backend is missing."""
    import fsspec

    package, extra = BACKENDS[protocol]
    try:
        __import__(package)
    except ImportError:
        raise StorageError(f"{protocol}:// needs the `{package}` package: pip install 'ckpttool[{extra}]'",
                           "backend-missing") from None
    return fsspec.filesystem(protocol, **{**_options, **(storage_options or {})})


@contextlib.contextmanager
def _requests(url: str) -> Iterator[None]:
    """Turn what a backend raises for refused credentials, permissions or the network into a
    one-line StorageError; FileNotFoundError passes through (callers say what is missing)."""
    try:
        yield
    except FileNotFoundError:
        raise
    except PermissionError as error:
        raise StorageError(f"{url}: access denied ({_first_line(error)}); check the credentials (AWS_* environment "
                           "variables, --storage-option key=... secret=...)", "storage-denied") from None
    except (OSError, ValueError) as error:
        raise StorageError(f"{url}: request failed ({type(error).__name__}: {_first_line(error)})") from None
    except Exception as error:  # botocore/aiohttp errors are not OSErrors; a real bug still names itself
        if type(error).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
            raise StorageError(f"{url}: no credentials ({_first_line(error)}); set AWS_ACCESS_KEY_ID and "
                               "AWS_SECRET_ACCESS_KEY or pass --storage-option key=... secret=...", "storage-denied") from None
        if type(error).__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp", "google", "azure"):
            raise StorageError(f"{url}: request failed ({type(error).__name__}: {_first_line(error)})") from None
        raise


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


class _Listing:
    """What one recursive listing of a prefix found: key -> size (None: a directory)."""

    def __init__(self) -> None:
        self.roots: list[str] = []
        self.entries: dict[str, int | None] = {}
        self.lock = threading.Lock()


class RemotePath(PurePosixPath):
    """An object-storage location that answers the questions readers ask of a `Path`.

    Subclassed once per `location()` call, carrying the filesystem and a listing cache:
    the first question about a prefix lists it whole (one paginated LIST), later ones are
    answered from that listing. Not for outputs: those go through `remote_output`.
    """

    _fs: Any = None
    _protocol = ""
    _listing: _Listing

    def __str__(self) -> str:
        return f"{self._protocol}://{self.key}"

    def __fspath__(self) -> str:  # os.* calls on it fail as "no such file" instead of reading a local look-alike
        return str(self)

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    @property
    def key(self) -> str:
        """The fsspec path: `bucket/key`, without the protocol."""
        return "/".join(self.parts[1:])

    @property
    def filesystem(self) -> Any:
        return self._fs

    def _entry(self, missing_ok: bool = True) -> tuple[bool, int | None]:
        """Return (exists, size or None for a directory)."""
        listing = self._listing
        key = self.key
        with listing.lock:
            if not any(key == root or key.startswith(root + "/") for root in listing.roots):
                self._scan(key)
            if key in listing.entries:
                return True, listing.entries[key]
            return (any(k.startswith(key + "/") for k in listing.entries)), None

    def _scan(self, key: str) -> None:
        """List everything under `key` once (the key itself, if it is an object)."""
        listing = self._listing
        with _requests(str(self)):
            try:
                found = self._fs.find(key, detail=True, withdirs=True)
            except FileNotFoundError:
                found = {}
        for name, info in found.items():
            name = name.rstrip("/")
            listing.entries[name] = int(info.get("size") or 0) if info.get("type") == "file" else None
            parent = name.rsplit("/", 1)[0]
            while parent.startswith(key + "/") and parent not in listing.entries:
                listing.entries[parent] = None
                parent = parent.rsplit("/", 1)[0]
        if found and key not in listing.entries:
            listing.entries[key] = None
        listing.roots.append(key)

    def exists(self) -> bool:
        return self._entry()[0]

    def is_file(self) -> bool:
        exists, size = self._entry()
        return exists and size is not None

    def is_dir(self) -> bool:
        exists, size = self._entry()
        return exists and size is None

    def is_symlink(self) -> bool:
        return False

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        exists, size = self._entry()
        if not exists:
            raise FileNotFoundError(2, "No such file or directory", str(self))
        mode = stat.S_IFDIR | 0o755 if size is None else stat.S_IFREG | 0o644
        return os.stat_result((mode, 0, 0, 1, 0, 0, size or 0, 0, 0, 0))

    lstat = stat

    def iterdir(self) -> Iterator["RemotePath"]:
        if not self.is_dir():
            raise NotADirectoryError(2, "Not a directory", str(self))
        prefix = self.key + "/"
        names = {k[len(prefix):].split("/", 1)[0] for k in self._listing.entries if k.startswith(prefix)}
        for name in sorted(names):
            yield self / name

    def rglob(self, pattern: str) -> Iterator["RemotePath"]:
        if pattern != "*":
            raise NotImplementedError("RemotePath.rglob supports '*' only")
        self._entry()
        prefix = self.key + "/"
        for name in sorted(k for k in self._listing.entries if k.startswith(prefix)):
            yield self / name[len(prefix):]

    def resolve(self, strict: bool = False) -> "RemotePath":
        return self

    absolute = resolve

    def read_bytes(self) -> bytes:
        """The object's bytes, by ranged GETs (callers check the size first)."""
        size = self.stat().st_size
        return RangeReader(self._fs, self.key, size, str(self)).read(0, size)

    def read_text(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.read_bytes().decode(encoding, errors)


class RangeReader:
    """Ranged reads of one object: a read of at least READ_AHEAD bytes is one GET of exactly
    that range; a smaller one fetches a READ_AHEAD block, kept (CACHED_BLOCKS per reader) so
    the neighbouring small reads of a record's header cost no further request."""

    def __init__(self, fs: Any, key: str, size: int, url: str):
        self.fs, self.key, self.size, self.url = fs, key, size, url
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def _get(self, start: int, end: int) -> bytes:
        with _requests(self.url), _vanished(self.url):
            data = self.fs.cat_file(self.key, start=start, end=end)
        if len(data) != end - start:
            from ckpttool.errors import CorruptBlob

            raise CorruptBlob(f"{self.url}: asked for bytes {start}..{end}, got {len(data)} bytes (object changed?)")
        return data

    def read(self, offset: int, length: int) -> bytes:
        """Return exactly `length` bytes at `offset` (the caller checked them against `size`)."""
        if length == 0:
            return b""
        if length >= READ_AHEAD:
            return self._get(offset, offset + length)
        start = offset - offset % READ_AHEAD
        parts = []
        while start < offset + length:
            parts.append(self._block(start))
            start += READ_AHEAD
        data = b"".join(parts) if len(parts) > 1 else parts[0]
        skip = offset % READ_AHEAD
        return data[skip:skip + length]

    def pieces(self, offset: int, length: int, buffer: memoryview) -> Iterator[memoryview]:
        """Yield the `length` bytes at `offset` from ONE ranged GET, as consecutive fills of
        `buffer` (each view valid until the next is asked for).

        With s3fs the response body is read into `buffer` as it arrives, so a copy of any
        size holds `len(buffer)` bytes (a whole-range `cat_file` would hold the range twice:
        the body's chunks and their join). Other backends get a `cat_file` per buffer.
        """
        if not hasattr(self.fs, "_call_s3"):
            for done in range(0, length, len(buffer)):
                view = buffer[:min(len(buffer), length - done)]
                view[:] = self.read(offset + done, len(view))
                yield view
            return
        from fsspec.asyn import sync

        bucket, key, version = self.fs.split_path(self.key)
        with _requests(self.url), _vanished(self.url):
            response = sync(self.fs.loop, self.fs._call_s3, "get_object", Bucket=bucket, Key=key,
                            Range=f"bytes={offset}-{offset + length - 1}", **({"VersionId": version} if version else {}))
        body = response["Body"]
        try:
            done = 0
            while done < length:
                view = buffer[:min(len(buffer), length - done)]
                with _requests(self.url):
                    got = sync(self.fs.loop, _fill, body, view)
                if got < len(view):
                    from ckpttool.errors import CorruptBlob

                    raise CorruptBlob(f"{self.url}: the server ended bytes {offset}..{offset + length} after "
                                      f"{done + got} bytes (object changed?)")
                done += got
                yield view
        finally:
            body.close()

    def _block(self, start: int) -> bytes:
        with self._lock:
            block = self._blocks.get(start)
            if block is not None:
                self._blocks.move_to_end(start)
                return block
        block = self._get(start, min(start + READ_AHEAD, self.size))
        with self._lock:
            self._blocks[start] = block
            while len(self._blocks) > CACHED_BLOCKS:
                self._blocks.popitem(last=False)
        return block


async def _fill(body: Any, view: memoryview) -> int:
    """Read a streaming response body into `view` until it is full or the body ends."""
    got = 0
    while got < len(view):
        chunk = await body.read(len(view) - got)
        if not chunk:
            break
        view[got:got + len(chunk)] = chunk
        got += len(chunk)
    return got


@contextlib.contextmanager
def _vanished(url: str) -> Iterator[None]:
    try:
        yield
    except FileNotFoundError:
        from ckpttool.errors import MissingFile

        raise MissingFile(f"{url}: vanished while being read") from None


def reader(path: RemotePath) -> RangeReader:
    """Return a RangeReader of the object at `path`; FileNotFoundError when there is none."""
    size = path.stat().st_size
    if path.is_dir():
        raise IsADirectoryError(21, "Is a directory", str(path))
    return RangeReader(path.filesystem, path.key, size, str(path))


# ---------------------------------------------------------------------------------------------
# Outputs


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
        """Send what is left, then, with signals deferred: remove the old output's index keys
        (so no reader pairs them with new data), complete every upload, put the small local
        files (`.metadata` and indexes last) and remove what is left of the old output."""
        from ckpttool import io

        for sink in self.sinks.values():
            sink.finish()
            io._test_pause("upload")  # on the main thread, where signals arrive
        small = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()) if self.directory else []
        small.sort(key=lambda name: name.endswith(LAST_KEYS))
        fs, target = self.target.filesystem, self.target
        with _requests(str(target)), io._signals_deferred():
            old = set(fs.find(target.key)) if force and self.directory else set()
            for stale in sorted(k for k in old if k.endswith(LAST_KEYS)):
                fs.rm_file(stale)
            if force and not self.directory and fs.isdir(target.key):
                fs.rm(target.key, recursive=True)
            for name, sink in self.sinks.items():
                sink.complete()
                old.discard(self.key(name))
            for name in small:
                fs.put_file(str(local / name), self.key(name))
                old.discard(self.key(name))
            for stale in sorted(old - {k for k in old if k.endswith(LAST_KEYS)}):
                fs.rm_file(stale)
            fs.invalidate_cache()

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
            fs.put_file(str(local / name) if name else str(local), f"{temp}/{name}" if name else temp)
            if position == 0:
                io._test_pause("upload")
        with io._signals_deferred():  # from here the destination changes: finish before any signal is handled
            old = set(fs.find(target.key)) if force and directory else set()
            if force and not directory and fs.isdir(target.key):
                fs.rm(target.key, recursive=True)
            for name in names:
                final = f"{target.key}/{name}" if name else target.key
                fs.copy(f"{temp}/{name}" if name else temp, final)
                old.discard(final)
            for stale in sorted(old):
                fs.rm_file(stale)
            fs.rm(temp, recursive=True)
        fs.invalidate_cache()


def overlaps(output: Any, source: Any) -> str | None:
    """Return how `output` relates to `source` ("is", "lies inside", "contains") when either is
    remote, compared as URLs; None when they are apart."""
    out, src = str(location(output)).rstrip("/"), str(location(source)).rstrip("/")
    if out == src:
        return "is"
    if out.startswith(src + "/"):
        return "lies inside"
    if src.startswith(out + "/"):
        return "contains"
    return None
