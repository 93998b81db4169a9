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
environment variables, `AWS_ENDPOINT_URL`, `~/.aws`, as `s3.py` lists; for Google Cloud Storage:
Application Default Credentials, `STORAGE_EMULATOR_HOST`; for Azure: `AZURE_STORAGE_*`) plus the
storage options given to `location(url, {"key": value})` (the CLI's `--storage-option key=value`),
which the location, and every path joined under it, carries. An Azure URL may name its account,
as the portal writes it (`abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/path`): that account is
the one read.

Example:
    >>> root = location("s3://bucket/runs/x/step-100")
    >>> is_remote(root), str(root / ".metadata")
    (True, 's3://bucket/runs/x/step-100/.metadata')
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
from collections import OrderedDict
from pathlib import Path, PurePosixPath
from typing import Any, Iterator, Mapping, Sequence

from ckpttool.core.errors import StorageError

# protocol -> (package, ckpttool extra); the fsspec protocol names of each backend
BACKENDS = {
    "s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"), "abfs": ("adlfs", "azure"), "abfss": ("adlfs", "azure"),
}
# `s3://b/k`, and `s3:/b/k`: what pathlib makes of a URL (`Path("s3://b/k")`) on its way through code that wraps paths
_URL = re.compile(r"^(?P<protocol>" + "|".join(BACKENDS) + r"):/{1,2}(?P<key>[^/].*)?$")
S3_PROTOCOLS = frozenset({"s3", "s3a"})  # read by `s3.S3Client`, not s3fs
GCS_PROTOCOLS = frozenset({"gs", "gcs"})
AZURE_PROTOCOLS = frozenset({"az", "abfs", "abfss"})
# `CONTAINER@ACCOUNT.dfs.core.windows.net` (or `.blob.`): the first segment of an Azure URL as the portal
# copies it; account names are 3-24 lowercase letters and digits (Azure's rule)
_AZURE_AUTHORITY = r"^(?P<container>[^@/]+)@(?P<host>(?P<account>[a-z0-9]{3,24})\.(?:dfs|blob)\.(?P<suffix>[^/]+))$"  # compiled when first matched (re's cache)
AZURE_CLOUD = "core.windows.net"  # the public cloud's host suffix; others (sovereign clouds) are named as account_host
CONNECT_ATTEMPTS = 3  # tries of an endpoint that refuses connections or does not resolve (~3 s), not gcsfs's 6 (~35 s)
AZURE_CONNECT_RETRIES = 0  # the Azure SDK waits 15 s and more before each retry: fail at once instead
CONNECT_TIMEOUT = 10  # seconds to open a connection to Google Cloud Storage (aiohttp's default waits 300 s)
S3_ATTEMPTS = 5  # botocore tries of one S3 request (standard mode; its default, legacy mode, retries fewer errors)
S3_RETRIES = 3  # s3fs's tries of a call whose answer was cut short (each of them S3_ATTEMPTS requests at most)
S3_READ_TIMEOUT = 60  # seconds a socket read may block (botocore's default; a stall past it is retried)
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
        from ckpttool.core.errors import UsageError

        raise UsageError(f"--storage-option {text!r}: expected key=value, e.g. endpoint_url=http://127.0.0.1:9000")
    key = key.strip()
    if key in TEXT_OPTIONS:
        return key, value
    import json  # on use: `inspect` of a local path never parses an option

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
    parsed = _parse_url(text)
    if parsed is not None:
        protocol, host, parts = parsed
        options = dict(storage_options or {})
        native = _s3_client(options) if protocol in S3_PROTOCOLS else None
        url = _format_url(protocol, host, parts)
        # s3fs only when something is written
        fs = None if native is not None else open_filesystem(protocol, options, host=host, url=url)
        cls = type(f"{protocol.upper()}Path", (RemotePath,), {"_fs": fs, "_s3": native, "_protocol": protocol, "_host": host,
                                                              "_listing": _Listing(), "_options": options})
        return cls(f"{protocol}:", *parts)
    match = _FILE_URL.match(text)
    return Path(match["path"]) if match else Path(path)


def _parse_url(text: str) -> tuple[str, str, list[str]] | None:
    """Return (protocol, Azure account host or "", [bucket, *key parts]) of a storage URL, None
    for anything else; StorageError for an Azure `CONTAINER@HOST` whose host names no account.

    Example:
        >>> _parse_url("abfs://ckpts@acct.dfs.core.windows.net/run/step-1")
        ('abfs', 'acct.dfs.core.windows.net', ['ckpts', 'run', 'step-1'])
    """
    match = _URL.match(text)
    if not match:
        return None
    protocol, parts = match["protocol"], (match["key"] or "").strip("/").split("/")
    host = ""
    if protocol in AZURE_PROTOCOLS and "@" in parts[0]:
        authority = re.match(_AZURE_AUTHORITY, parts[0])
        if authority is None:
            raise StorageError(f"{text}: expected {protocol}://CONTAINER@ACCOUNT.dfs.{AZURE_CLOUD}/PATH (the account "
                               "name is 3-24 lowercase letters and digits)", "bad-url")
        parts[0], host = authority["container"], authority["host"]
    return protocol, host, parts


def _format_url(protocol: str, host: str, parts: Sequence[str]) -> str:
    """The URL of `parts` (bucket first), the Azure account host kept where the URL had it."""
    bucket, rest = (parts[0] if parts else ""), "/".join(parts[1:])
    return f"{protocol}://{bucket}{'@' + host if host else ''}{'/' + rest if rest else ''}"


def open_filesystem(protocol: str, storage_options: Mapping[str, Any] | None = None, host: str = "",
                    url: str | None = None) -> Any:
    """Return the fsspec filesystem for `protocol`, configured by `storage_options` (and for
    Azure, the account that `host`, the `ACCOUNT.dfs.core.windows.net` of the URL, names); raise
    StorageError naming the extra to install when its backend is missing, and a one-line
    StorageError naming `url` when the backend refuses the configuration (no credentials)."""
    import fsspec

    package, extra = BACKENDS[protocol]
    url = url or f"{protocol}://"
    try:
        __import__(package)
    except ImportError:
        raise StorageError(f"{protocol}:// needs the `{package}` package: pip install 'ckpttool[{extra}]'",
                           "backend-missing") from None
    options = dict(storage_options or {})
    if protocol in GCS_PROTOCOLS:
        options.setdefault("requests_timeout", _gcs_timeout())
        # gcsfs would try gcloud's old token cache and the metadata server again (14-50 s without a network),
        # then go on anonymously: Application Default Credentials or a one-line error. An emulator checks no
        # credentials: with STORAGE_EMULATOR_HOST, anonymous, as gcsfs ends up and Google's client libraries start
        options.setdefault("token", "anon" if _gcs_emulator_host() else "google_default")
        cls = _gcs_filesystem_class()
    elif protocol in AZURE_PROTOCOLS:
        options = _azure_options(url, host, options)
        cls = _azure_filesystem_class()
    elif protocol in S3_PROTOCOLS:
        options = _s3_write_options(options)
        cls = fsspec.get_filesystem_class(protocol)
    else:
        cls = fsspec.get_filesystem_class(protocol)
    try:
        filesystem = cls(**options)
        if protocol in S3_PROTOCOLS:
            filesystem.retries = S3_RETRIES  # s3fs's tries of a call, each of them botocore's S3_ATTEMPTS requests
        return filesystem
    except Exception as error:
        if protocol in GCS_PROTOCOLS and type(error).__name__ == "DefaultCredentialsError":
            raise StorageError(f"{url}: no Google Cloud credentials found; run `gcloud auth application-default login` "
                               "or set GOOGLE_APPLICATION_CREDENTIALS (for a public bucket or an emulator: "
                               "--storage-option token=anon)", "storage-denied") from None
        if not isinstance(error, ValueError):
            raise
        if protocol in AZURE_PROTOCOLS and "connection_string or account_name" in str(error):
            raise StorageError(f"{url}: no Azure credentials; set AZURE_STORAGE_CONNECTION_STRING (or "
                               "AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY), or pass --storage-option "
                               "connection_string=... (or account_name=... account_key=...)", "storage-denied") from None
        raise StorageError(f"{url}: cannot open {protocol}:// ({_first_line(error)})") from None


def _s3_write_options(options: dict[str, Any]) -> dict[str, Any]:
    """s3fs's options with botocore's retries and timeouts bounded (what the options name wins):
    every request (LIST, HEAD, PUT, multipart create/part/complete/abort, DELETE) is tried
    S3_ATTEMPTS times in botocore's standard mode (5xx, SlowDown, resets, timeouts; backoff
    up to 2**n s), within s3fs's own S3_RETRIES tries of a body cut short or unparsable."""
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"max_attempts": S3_ATTEMPTS, "mode": "standard"})
    config.setdefault("connect_timeout", CONNECT_TIMEOUT)
    config.setdefault("read_timeout", S3_READ_TIMEOUT)
    return {**options, "config_kwargs": config}


def _azure_options(url: str, host: str, options: dict[str, Any]) -> dict[str, Any]:
    """adlfs's options for `url`: the account its host names, which a configured account of
    another name may not silently replace (a connection string names its own account, and adlfs
    prefers it to `account_name`)."""
    authority = re.match(_AZURE_AUTHORITY, f"container@{host}") if host else None
    if authority is None:
        return options
    account = authority["account"]
    given = options.get("account_name")
    connection = options.get("connection_string") or os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    if connection:
        given, source = _connection_account(connection), ("--storage-option connection_string"
                                                          if options.get("connection_string") else "AZURE_STORAGE_CONNECTION_STRING")
    else:
        source = "--storage-option account_name"
    if given and given != account:
        raise StorageError(f"{url}: the URL names the storage account {account!r}, but {source} is for {given!r}; "
                           f"pass the credentials of {account!r} (--storage-option connection_string=... or account_key=...)",
                           "storage-denied")
    if not connection:
        options["account_name"] = account
        if authority["suffix"] != AZURE_CLOUD:
            options.setdefault("account_host", f"{account}.blob.{authority['suffix']}")
    return options


def _connection_account(connection: str) -> str | None:
    """The AccountName of an Azure connection string."""
    fields = dict(part.split("=", 1) for part in connection.split(";") if "=" in part)
    return fields.get("AccountName")


def _gcs_emulator_host() -> str | None:
    """The emulator STORAGE_EMULATOR_HOST names (gcsfs sends every request there), or None when
    unset or "default" (gcsfs's word for Google's own endpoint)."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "")
    return None if host in ("", "default") else host


def _gcs_timeout() -> Any:
    """aiohttp's timeout for gcsfs: connecting is bounded, a long transfer is not."""
    import aiohttp

    return aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT)


_classes: dict[str, Any] = {}  # "gcs", "azure" -> the filesystem class built for it, once per process


def _azure_filesystem_class() -> Any:
    """adlfs's filesystem, not retrying a connection it cannot open: the Azure SDK retries it 3
    times after 15, 18 and 24 s (a stopped Azurite or no network: 3 minutes of silence). Reads
    cut short and throttled or failed requests (5xx) keep the SDK's retries."""
    if "azure" in _classes:
        return _classes["azure"]
    from adlfs import AzureBlobFileSystem

    class BoundedAzureBlobFileSystem(AzureBlobFileSystem):
        def do_connect(self) -> None:
            super().do_connect()
            # the SDK offers `retry_connect` only when building the client, which adlfs does; the policy
            # object its pipelines share is the client's configured one
            policy = getattr(getattr(self.service_client, "_config", None), "retry_policy", None)
            if policy is not None and hasattr(policy, "connect_retries"):
                policy.connect_retries = AZURE_CONNECT_RETRIES

    _classes["azure"] = BoundedAzureBlobFileSystem
    return BoundedAzureBlobFileSystem


def _gcs_filesystem_class() -> Any:
    """gcsfs's JSON-API filesystem, giving up on an endpoint it cannot connect to after
    CONNECT_ATTEMPTS tries (gcsfs retries every error 6 times, ~35 s: a command with no network or
    a stopped emulator seemed to hang). Not gcsfs's default `ExtendedGcsFileSystem`: that first asks
    each bucket's type over gRPC, which an emulator or proxy cannot answer (60 s, and a "Could not
    determine bucket type" warning on stderr, per bucket); ranged GETs and object writes, all
    ckpttool sends, are served by the JSON API for every bucket type."""
    if "gcs" in _classes:
        return _classes["gcs"]
    import asyncio
    import random

    import aiohttp
    from gcsfs.core import GCSFileSystem
    from gcsfs.retry import is_retriable

    send_once = GCSFileSystem._request.__wrapped__  # gcsfs's request without its retry decorator

    class BoundedGCSFileSystem(GCSFileSystem):
        protocol = ("gs", "gcs")

        async def _request(self, *args: Any, **kwargs: Any) -> Any:
            refused = 0
            for attempt in range(GCSFileSystem.retries):
                if attempt:
                    await asyncio.sleep(min(random.random() + 2 ** (attempt - 1), 32) if not refused else 0.5 * refused)
                try:
                    return await send_once(self, *args, **kwargs)
                except aiohttp.ClientConnectorError:
                    refused += 1
                    if refused >= CONNECT_ATTEMPTS:
                        raise
                except Exception as error:
                    if not is_retriable(error) or attempt == GCSFileSystem.retries - 1:  # 404: FileNotFoundError, not retried
                        raise
            raise AssertionError("unreachable")

    _classes["gcs"] = BoundedGCSFileSystem
    return BoundedGCSFileSystem


_s3_clients: dict[str, Any] = {}  # storage options and AWS_* environment -> the S3Client made for them


def _s3_client(options: Mapping[str, Any]) -> Any:
    """The `s3.S3Client` of these storage options and the environment (one per setting, so
    every location opened with them shares its connections)."""
    import json

    from ckpttool.store import s3

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
    """Turn what a backend raises for refused credentials, permissions, an unreachable endpoint or
    the network into a one-line StorageError; FileNotFoundError passes through (callers say what
    is missing), and so does what no backend raised (a real bug names itself)."""
    try:
        yield
    except FileNotFoundError:
        raise
    except Exception as error:
        one_line = _one_line(url, error)
        if one_line is None:
            raise
        raise one_line from None


_UNREACHABLE = ("ClientConnectorError", "ClientConnectorDNSError", "ServiceRequestError")  # aiohttp's (gcsfs), Azure SDK's


def _one_line(url: str, error: Exception) -> StorageError | None:
    """The StorageError `request_errors` raises for `error`, None for one it lets through."""
    name, detail = type(error).__name__, _first_line(error)
    if name in _UNREACHABLE:
        return StorageError(f"{url}: cannot reach the storage endpoint ({detail}); check the endpoint "
                            "(--storage-option endpoint_url=..., STORAGE_EMULATOR_HOST, the connection string's "
                            "BlobEndpoint) and the network", "storage-unreachable")
    if isinstance(error, PermissionError):
        return StorageError(f"{url}: access denied ({detail}); check the credentials (AWS_* environment "
                            "variables, --storage-option key=... secret=...)", "storage-denied")
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return StorageError(f"{url}: no credentials ({detail}); set AWS_ACCESS_KEY_ID and "
                            "AWS_SECRET_ACCESS_KEY or pass --storage-option key=... secret=...", "storage-denied")
    if name == "ClientAuthenticationError":
        return StorageError(f"{url}: credentials refused ({detail}); set AZURE_STORAGE_CONNECTION_STRING or pass "
                            "--storage-option connection_string=... (or account_name=... account_key=...)", "storage-denied")
    if isinstance(error, (OSError, ValueError)) or \
            type(error).__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp", "google", "azure"):
        from ckpttool.store.s3 import AGAIN

        full = _first_line(error, limit=400)
        advice = AGAIN if AGAIN in full else "; check the endpoint and the network, then run the command again"
        return StorageError(f"{url}: request failed ({name}: {full.replace(AGAIN, '')[:200]}){advice}")
    return None


def _first_line(error: BaseException, limit: int = 200) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]


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
    _host = ""  # an Azure URL's `ACCOUNT.dfs.core.windows.net`, kept in its str, not in its key
    _listing: _Listing
    _options: Mapping[str, Any] = {}  # the storage options `location` was given

    def __str__(self) -> str:
        return _format_url(self._protocol, self._host, self.parts[1:])

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
            cls._fs = open_filesystem(self._protocol, self._options, host=self._host, url=str(self))
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
        if not found and self._s3 is None:
            self._check_bucket(key.split("/", 1)[0])
        listing.roots.append(key)

    def _check_bucket(self, bucket: str) -> None:
        """Raise StorageError when `bucket` does not exist (asked only when nothing was found:
        "no such file" would send the user looking for the wrong mistake)."""
        kind = "container" if self._protocol in AZURE_PROTOCOLS else "bucket"
        with request_errors(str(self)), contextlib.suppress(PermissionError):  # may read, not look at buckets
            if not self._fs.exists(bucket):
                raise StorageError(f"{self}: the {kind} {_format_url(self._protocol, self._host, [bucket])} does not "
                                   "exist (check its name and the endpoint)", "no-bucket")

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
            from ckpttool.core.errors import CorruptBlob

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
        from ckpttool.store import s3

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
        from ckpttool.core.errors import MissingFile

        raise MissingFile(f"{url}: vanished while being read") from None


@contextlib.contextmanager
def _changed(url: str) -> Iterator[None]:
    from ckpttool.store import s3

    try:
        yield
    except s3.ObjectChanged as error:
        from ckpttool.core.errors import CorruptBlob

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
    parsed = _parse_url(text)
    if parsed is not None:
        return _format_url(*parsed)
    match = _FILE_URL.match(text)
    return str(Path(match["path"]) if match else Path(text))
