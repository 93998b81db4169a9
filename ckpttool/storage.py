"""Local paths and object-storage URLs (`s3://`, `gs://`, `az://`) behind one small interface.

A remote location is a `RemotePath`: a pure path whose `str` is its URL and which answers
the few `pathlib.Path` questions the readers ask (`exists`, `is_file`, `is_dir`, `stat`,
`iterdir`, `rglob`, `read_bytes`) from one recursive listing of the prefix, so detection
and the integrity gate run unchanged. Bytes are read by `RangeReader`: one ranged GET per
run of bytes, small reads served from a read-ahead block, never a whole-object download.
`s3://` is listed and read by `s3.S3Client` (the standard library only: s3fs and aiobotocore
cost 64 MB before a byte moves); other protocols, and all writes, by fsspec. Outputs to object
storage are `outputs/`'s.

Credentials and endpoints come from the backend's own configuration (for S3: `AWS_*`
environment variables, `AWS_ENDPOINT_URL`, `~/.aws`, as `s3.py` lists) plus the storage options
given to `location(url, {"key": value})` (the CLI's `--storage-option key=value`), which the
location, and every path joined under it, carries.

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
import stat
import threading
from collections import OrderedDict
from pathlib import Path, PurePosixPath
from typing import Any, Iterator, Mapping

from ckpttool.errors import StorageError

# protocol -> (package, ckpttool extra); the fsspec protocol names of each backend
BACKENDS = {
    "s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"), "abfs": ("adlfs", "azure"), "abfss": ("adlfs", "azure"),
}
# `s3://b/k`, and `s3:/b/k`: what pathlib makes of a URL (`Path("s3://b/k")`) on its way through code that wraps paths
_URL = re.compile(r"^(?P<protocol>" + "|".join(BACKENDS) + r"):/{1,2}(?P<key>[^/].*)?$")
S3_PROTOCOLS = frozenset({"s3", "s3a"})  # read by `s3.S3Client`, not s3fs
_FILE_URL = re.compile(r"^file:(//)?(?P<path>/.*)$")
PIECE = 1 << 20  # bytes of a streamed GET's body held at once (`RangeReader.pieces`)
READ_AHEAD = 256 << 10  # a small read (record header, safetensors length) fetches this much, so its neighbours are served from memory
CACHED_BLOCKS = 16  # read-ahead blocks kept per reader (4 MiB)

TEXT_OPTIONS = frozenset({"key", "secret", "token", "password", "account_key", "sas_token", "account_name"})  # never decoded: a secret may look like a number


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


def is_remote(path: Any) -> bool:
    """True for an object-storage URL (or a `RemotePath`), False for a local path or `file://`."""
    return isinstance(path, RemotePath) or bool(_URL.match(str(path)))


def location(path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> Path | "RemotePath":
    """Return `path` as a `RemotePath` for a storage URL, else as a local `Path` (`file://` URLs too).

    A RemotePath carries `storage_options` (fsspec's, e.g. `endpoint_url`, `key`, `secret`,
    `client_kwargs`), and so does every path joined under it; a RemotePath passed in is
    returned as it is, with the options it was made with.
    """
    if isinstance(path, RemotePath):
        return path
    text = os.fspath(path)
    match = _URL.match(text)
    if match:
        protocol, options = match["protocol"], dict(storage_options or {})
        native = _s3_client(options) if protocol in S3_PROTOCOLS else None
        fs = None if native is not None else open_filesystem(protocol, options)  # s3fs only when something is written
        cls = type(f"{protocol.upper()}Path", (RemotePath,), {"_fs": fs, "_s3": native, "_protocol": protocol,
                                                              "_listing": _Listing(), "_options": options})
        return cls(f"{match['protocol']}:", *(match["key"] or "").strip("/").split("/"))
    match = _FILE_URL.match(text)
    return Path(match["path"]) if match else Path(path)


def open_filesystem(protocol: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """Return the fsspec filesystem for `protocol`, configured by `storage_options`;
    raise StorageError naming the extra to install when its backend is missing."""
    import fsspec

    package, extra = BACKENDS[protocol]
    try:
        __import__(package)
    except ImportError:
        raise StorageError(f"{protocol}:// needs the `{package}` package: pip install 'ckpttool[{extra}]'",
                           "backend-missing") from None
    return fsspec.filesystem(protocol, **(storage_options or {}))


_s3_clients: dict[str, Any] = {}  # storage options and AWS_* environment -> the S3Client made for them


def _s3_client(options: Mapping[str, Any]) -> Any:
    """The `s3.S3Client` of these storage options and the environment (one per setting, so
    every location opened with them shares its connections)."""
    from ckpttool import s3

    setting = json.dumps([options, {k: v for k, v in os.environ.items() if k.startswith("AWS_")}],
                         sort_keys=True, default=str)
    client = _s3_clients.get(setting)
    if client is None:
        try:
            client = _s3_clients[setting] = s3.S3Client(options)
        except ValueError as error:
            raise StorageError(f"s3://: {error}") from None
    return client


@contextlib.contextmanager
def request_errors(url: str) -> Iterator[None]:
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
    _s3: Any = None  # s3.S3Client for s3://: listings and reads without s3fs
    _protocol = ""
    _listing: _Listing
    _options: Mapping[str, Any] = {}  # the storage options `location` was given

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
        """The fsspec filesystem, opened on first use (s3:// reads never need it, writes do)."""
        cls = type(self)
        if cls._fs is None:
            cls._fs = open_filesystem(self._protocol, self._options)
        return cls._fs

    @property
    def objects(self) -> Any:
        """What lists and reads objects: the S3Client for s3://, else the fsspec filesystem."""
        return self._s3 if self._s3 is not None else self.filesystem

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
        with request_errors(str(self)):
            try:
                found = (self._s3.find(key) if self._s3 is not None
                         else self._fs.find(key, detail=True, withdirs=True))
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

    def relative_to(self, other: Any, *more: Any) -> PurePosixPath:  # type: ignore[override]
        """A plain relative path (`.metadata`), not a RemotePath that would print as a URL."""
        base = other.parts if isinstance(other, PurePosixPath) else location(other, self._options).parts
        return PurePosixPath(*self.parts).relative_to(PurePosixPath(*base), *more)

    def resolve(self, strict: bool = False) -> "RemotePath":
        return self

    absolute = resolve

    def read_bytes(self) -> bytes:
        """The object's bytes, by ranged GETs (callers check the size first)."""
        size = self.stat().st_size
        return RangeReader(self.objects, self.key, size, str(self)).read(0, size)

    def read_text(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.read_bytes().decode(encoding, errors)


class RangeReader:
    """Ranged reads of one object: a read of at least READ_AHEAD bytes is one GET of exactly
    that range; a smaller one fetches a READ_AHEAD block, kept (CACHED_BLOCKS per reader) so
    the neighbouring small reads of a record's header cost no further request. `fs` is the
    fsspec filesystem, or for s3:// the `s3.S3Client`."""

    def __init__(self, fs: Any, key: str, size: int, url: str):
        self.fs, self.key, self.size, self.url = fs, key, size, url
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.requests = 0  # ranged GETs sent (a retry inside one is not counted)

    def _counted(self) -> None:
        with self._lock:
            self.requests += 1

    def get(self, start: int, end: int) -> bytes:
        """Return exactly the bytes [start, end) by one ranged GET (no read-ahead block kept)."""
        return self._get(start, end)

    def _get(self, start: int, end: int) -> bytes:
        self._counted()
        with request_errors(self.url), _vanished(self.url), _changed(self.url):
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

        From S3 the response body is read into `buffer` as it arrives, so a copy of any
        size holds `len(buffer)` bytes (a whole-range `cat_file` would hold the range twice:
        the body's chunks and their join). Other backends get a `cat_file` per buffer.
        """
        from ckpttool import s3

        if isinstance(self.fs, s3.S3Client):
            self._counted()
            with request_errors(self.url), _vanished(self.url), _changed(self.url):
                yield from self.fs.pieces(self.key, offset, length, buffer)
            return
        for done in range(0, length, len(buffer)):
            view = buffer[:min(len(buffer), length - done)]
            view[:] = self.read(offset + done, len(view))
            yield view

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


@contextlib.contextmanager
def _vanished(url: str) -> Iterator[None]:
    try:
        yield
    except FileNotFoundError:
        from ckpttool.errors import MissingFile

        raise MissingFile(f"{url}: vanished while being read") from None


@contextlib.contextmanager
def _changed(url: str) -> Iterator[None]:
    from ckpttool import s3

    try:
        yield
    except s3.ObjectChanged as error:
        from ckpttool.errors import CorruptBlob

        raise CorruptBlob(f"{url}: {_first_line(error)}") from None


def reader(path: RemotePath) -> RangeReader:
    """Return a RangeReader of the object at `path`; FileNotFoundError when there is none."""
    size = path.stat().st_size
    if path.is_dir():
        raise IsADirectoryError(21, "Is a directory", str(path))
    return RangeReader(path.objects, path.key, size, str(path))


def overlaps(output: Any, source: Any) -> str | None:
    """Return how `output` relates to `source` ("is", "lies inside", "contains") when either is
    remote, compared as URLs; None when they are apart."""
    out, src = _url(output).rstrip("/"), _url(source).rstrip("/")
    if out == src:
        return "is"
    if out.startswith(src + "/"):
        return "lies inside"
    if src.startswith(out + "/"):
        return "contains"
    return None


def _url(path: Any) -> str:
    """The URL (or local path) `path` names, without opening a client for it."""
    if isinstance(path, RemotePath):
        return str(path)
    text = os.fspath(path)
    match = _URL.match(text)
    if match:
        return f"{match['protocol']}://{(match['key'] or '').strip('/')}"
    match = _FILE_URL.match(text)
    return str(Path(match["path"]) if match else Path(text))
