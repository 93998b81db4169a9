"""Reads of `s3://` objects (listings, ranged GETs) with the standard library only.

Why not s3fs here: importing s3fs and aiobotocore and connecting costs about 64 MB of resident
memory before a byte moves, more than a whole consolidate from local disk. This client is
`http.client` + AWS Signature Version 4 (`hmac`, `hashlib`) + `xml.etree`: one keep-alive
connection per thread, retries with backoff, region redirects followed. Writes still go
through s3fs (`storage.remote_output`).

Configuration, in fsspec/s3fs spelling first (the options `storage.location` was given: `--storage-option`), then
the environment as botocore reads it:

- credentials: `key`/`secret`/`token`; `anon=true` for unsigned requests; `AWS_ACCESS_KEY_ID`,
  `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`; the profile (`profile`, `AWS_PROFILE`, else
  `default`) in `AWS_SHARED_CREDENTIALS_FILE` (~/.aws/credentials), then `AWS_CONFIG_FILE`
  (~/.aws/config); else botocore's own chain (instance roles, SSO, web identity,
  credential_process), imported only then and asked again when its credentials expire.
- region: `client_kwargs.region_name`, `AWS_REGION`, `AWS_DEFAULT_REGION`, the profile's `region`,
  else us-east-1; a bucket elsewhere answers with `x-amz-bucket-region`, followed and remembered.
- endpoint: `endpoint_url`, `client_kwargs.endpoint_url`, `AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`,
  the profile's `endpoint_url` (path-style URLs); else AWS itself, virtual-hosted
  (`https://BUCKET.s3.REGION.amazonaws.com/KEY`) when the bucket name is a DNS label.
- TLS: `client_kwargs.verify` (False, or a CA bundle path), `AWS_CA_BUNDLE`.
- timeout: `config_kwargs.read_timeout` (botocore's `Config` spelling, as s3fs takes it), else 60 s.

Errors are the standard exceptions `storage.request_errors` turns into one line: PermissionError
(403, refused or missing credentials), FileNotFoundError (NoSuchKey, NoSuchBucket), OSError
(anything else, with the status and the S3 error code); `ObjectChanged` (an OSError) when the
object no longer holds the bytes asked for.

Example:
    >>> client = S3Client({"endpoint_url": "http://127.0.0.1:9000", "key": "k", "secret": "s"})
    >>> client.url("bucket", "runs/step 1/.metadata")
    'http://127.0.0.1:9000/bucket/runs/step%201/.metadata'
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import os
import random
import re
import threading
import time
import urllib.parse
from typing import Any, Iterator, Mapping, NamedTuple, Sequence

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()  # x-amz-content-sha256 of a request without a body
ATTEMPTS = 5  # tries of one request (connection errors, 5xx, SlowDown), as botocore's standard retry mode
RETRY_DELAY = 0.2  # seconds before the second try, doubled before each next one (plus jitter)
TIMEOUT = 60  # seconds a connect or a socket read may block (botocore's default; `config_kwargs.read_timeout` sets it)
# One request takes at most ATTEMPTS tries to get an answer (each <= the timeout, sleeps <= 4.5 s in all), and its
# body (a cut-short LIST page, a dropped GET) at most ATTEMPTS such requests; then one line ending with AGAIN.
AGAIN = "; the endpoint kept failing (retried with backoff): check it and the network, then run the command again"
RETRY_STATUS = frozenset({500, 502, 503, 504})
RETRY_CODES = frozenset({"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling"})
MAX_ERROR_BODY = 64 << 10  # bytes of an error response read (its XML names the code and message)
MAX_LIST_PAGE = 32 << 20  # bytes of one ListObjectsV2 page (1000 keys of <= 1 KiB: ~1.5 MB in practice)
MAX_LISTED = 10_000_000  # keys one `find` may return: a hostile or huge bucket must not exhaust memory
DEFAULT_REGION = "us-east-1"
_DNS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")  # may be a host name label (no dots: TLS wildcards)
_clock = time.time  # the signing time source (tests fix it)


class ObjectChanged(OSError):
    """The object no longer holds the bytes asked for (shorter now, or replaced mid-read)."""


class Credentials(NamedTuple):
    access_key: str
    secret_key: str
    token: str | None = None


class S3Client:
    """Listings and ranged GETs of one S3 endpoint, configured as the module docstring says.

    Thread-safe: each thread keeps its own keep-alive connection per host.

    Example:
        >>> client = S3Client({"anon": True, "client_kwargs": {"region_name": "eu-west-1"}})
        >>> client.url("my-bucket", "a+b=c.txt"), client.url("my.bucket", "k")
        ('https://my-bucket.s3.eu-west-1.amazonaws.com/a%2Bb%3Dc.txt', 'https://s3.eu-west-1.amazonaws.com/my.bucket/k')
    """

    def __init__(self, options: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None):
        options = dict(options or {})
        environ = os.environ if environ is None else environ
        client_kwargs = dict(options.get("client_kwargs") or {})
        self._profile_name = options.get("profile") or environ.get("AWS_PROFILE") or environ.get("AWS_DEFAULT_PROFILE")
        self._profile = _profile(environ, self._profile_name or "default")
        self.anon = bool(options.get("anon"))
        self.region = (client_kwargs.get("region_name") or environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION")
                       or self._profile.get("region") or DEFAULT_REGION)
        endpoint = options.get("endpoint_url") or client_kwargs.get("endpoint_url")
        if not endpoint and environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() != "true":
            endpoint = (environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL")
                        or self._profile.get("s3.endpoint_url") or self._profile.get("endpoint_url"))
        self.endpoint = str(endpoint).rstrip("/") if endpoint else None
        if self.endpoint and urllib.parse.urlsplit(self.endpoint).scheme not in ("http", "https"):
            raise ValueError(f"endpoint_url {self.endpoint!r}: expected http://HOST[:PORT] or https://HOST[:PORT]")
        self._verify = client_kwargs.get("verify", environ.get("AWS_CA_BUNDLE") or True)
        self._static = _static_credentials(options, client_kwargs, environ, self._profile)
        self._provider: Any = None  # botocore's credentials, when nothing above gave any
        self._regions: dict[str, str] = {}  # bucket -> the region it answered from (x-amz-bucket-region)
        self._keys: dict[tuple, bytes] = {}  # (secret, date, region) -> SigV4 signing key
        self._lock = threading.Lock()
        self._local = threading.local()
        self._ssl: Any = None
        self.timeout = float((options.get("config_kwargs") or {}).get("read_timeout") or TIMEOUT)

    # -- public ---------------------------------------------------------------------------

    def url(self, bucket: str, key: str = "", region: str | None = None) -> str:
        """Return the URL a request for `bucket`/`key` goes to (key URI-encoded as SigV4 wants)."""
        scheme, host, path = self._where(bucket, key, region or self._regions.get(bucket, self.region))
        return f"{scheme}://{host}{path}"

    def find(self, bucket_key: str) -> dict[str, dict[str, Any]]:
        """Return `{"bucket/key": {"size": int, "type": "file"}}` for the object at `bucket_key` and
        every object under `bucket_key + "/"` (not siblings such as `keyX`); `{}` when there are
        none. Folder markers (keys ending in `/`) come as `{"size": 0, "type": "directory"}`
        without the slash. FileNotFoundError when the bucket does not exist.

        Example:
            >>> client.find("bucket/step-100")  # doctest: +SKIP
            {'bucket/step-100/.metadata': {'size': 1234, 'type': 'file'}, ...}
        """
        bucket, key = _split(bucket_key)
        found: dict[str, dict[str, Any]] = {}
        for name, size in self._list(bucket, key + "/" if key else ""):
            _add(found, bucket, name, size)
        if key:
            # the object at `key` itself is the first key of the prefix `key`, if it exists
            for name, size in self._list(bucket, key, limit=1):
                if name == key:
                    _add(found, bucket, name, size)
        return found

    def cat_file(self, bucket_key: str, start: int, end: int) -> bytes:
        """Return exactly the bytes [start, end) of the object, by one ranged GET (retried whole
        when the connection drops); ObjectChanged when the object no longer holds them."""
        bucket, key = _split(bucket_key)
        if end <= start:
            return b""
        for attempt in range(1, ATTEMPTS + 1):
            conn, response, origin = self._open("GET", bucket, key, headers={"range": f"bytes={start}-{end - 1}"})
            _check_range(response, bucket, key, start, end)
            try:
                data = response.read(end - start)
            except (OSError, http.client.HTTPException):
                data = b""
            if len(data) == end - start and response.isclosed():
                self._release(origin, conn)
                return data
            conn.close()
            if attempt < ATTEMPTS:
                _sleep(attempt)
        raise OSError(f"GET s3://{bucket}/{key} bytes {start}..{end}: the connection ended early {ATTEMPTS} times{AGAIN}")

    def pieces(self, bucket_key: str, offset: int, length: int, buffer: memoryview) -> Iterator[memoryview]:
        """Yield the `length` bytes at `offset` as consecutive fills of `buffer`, each view valid
        until the next is asked for: ONE ranged GET whose body is read into `buffer` as it
        arrives (memory: `len(buffer)`, whatever `length`). A connection dropped mid-body is
        resumed where it stopped, with If-Match on the ETag so a replaced object is noticed
        (ObjectChanged) instead of mixed.

        Example:
            >>> buffer = memoryview(bytearray(1 << 20))
            >>> sum(len(view) for view in client.pieces("bucket/key", 0, 3 << 20, buffer))  # doctest: +SKIP
            3145728
        """
        bucket, key = _split(bucket_key)
        buffer = memoryview(buffer).cast("B")
        if length <= 0:
            return
        if not len(buffer):
            raise ValueError("pieces: empty buffer")
        done, fill, etag, failures = 0, 0, None, 0
        conn: http.client.HTTPConnection | None = None
        response: http.client.HTTPResponse | None = None
        origin: tuple[str, str] | None = None
        try:
            while done < length:
                if response is None:
                    headers = {"range": f"bytes={offset + done + fill}-{offset + length - 1}"}
                    if etag:
                        headers["if-match"] = etag
                    conn, response, origin = self._open("GET", bucket, key, headers=headers)
                    _check_range(response, bucket, key, offset + done + fill, offset + length)
                    etag = etag or response.getheader("etag")
                assert conn is not None and origin is not None  # set with `response`, above
                view = buffer[:min(len(buffer), length - done)]
                try:
                    while fill < len(view):
                        got = response.readinto(view[fill:])
                        if not got:
                            raise http.client.IncompleteRead(b"", len(view) - fill)
                        fill += got
                except (OSError, http.client.HTTPException) as error:
                    conn.close()
                    response = None
                    failures += 1
                    if failures >= ATTEMPTS:
                        raise OSError(f"GET s3://{bucket}/{key} bytes {offset}..{offset + length}: "
                                      f"{type(error).__name__} after {done + fill} bytes, {failures} times{AGAIN}") from None
                    _sleep(failures)
                    continue
                done, fill = done + len(view), 0
                if done == length:
                    if response.isclosed():
                        self._release(origin, conn)
                    else:
                        conn.close()
                    response = None
                yield view
        finally:
            if response is not None and conn is not None:  # abandoned mid-body: the connection cannot carry another request
                conn.close()

    def close(self) -> None:
        """Close this thread's connections."""
        for conn in getattr(self._local, "pool", {}).values():
            conn.close()
        self._local.pool = {}

    # -- listing --------------------------------------------------------------------------

    def _list(self, bucket: str, prefix: str, limit: int | None = None) -> Iterator[tuple[str, int]]:
        """Yield (key, size) of the keys starting with `prefix`, in S3's order (ListObjectsV2 pages)."""
        import xml.etree.ElementTree as ElementTree

        token, listed = None, 0
        while True:
            query = {"list-type": "2", "prefix": prefix, "encoding-type": "url"}
            if limit:
                query["max-keys"] = str(limit)
            if token:
                query["continuation-token"] = token
            for attempt in range(1, ATTEMPTS + 1):
                body = self._call("GET", bucket, "", query, limit=MAX_LIST_PAGE)
                try:
                    root = ElementTree.fromstring(body)
                    break
                except ElementTree.ParseError as error:  # a page cut short without a length to tell: ask again
                    if attempt == ATTEMPTS:
                        raise OSError(f"LIST s3://{bucket}/{prefix}: the server answered with malformed XML "
                                      f"{ATTEMPTS} times ({error}){AGAIN}") from None
                    _sleep(attempt)
            space = root.tag[:root.tag.index("}") + 1] if root.tag.startswith("{") else ""
            url_encoded = (root.findtext(f"{space}EncodingType") or "").lower() == "url"
            for item in root.iterfind(f"{space}Contents"):
                name = item.findtext(f"{space}Key") or ""
                if url_encoded:
                    name = urllib.parse.unquote_plus(name)
                try:
                    size = int(item.findtext(f"{space}Size") or "")
                except ValueError:
                    raise OSError(f"LIST s3://{bucket}/{prefix}: key {name!r} has no valid Size") from None
                listed += 1
                if listed > MAX_LISTED:
                    raise OSError(f"LIST s3://{bucket}/{prefix}: more than {MAX_LISTED} keys; list a narrower prefix")
                yield name, size
            token = root.findtext(f"{space}NextContinuationToken")
            if limit or (root.findtext(f"{space}IsTruncated") or "").lower() != "true" or not token:
                return

    # -- requests -------------------------------------------------------------------------

    def _call(self, method: str, bucket: str, key: str, query: Mapping[str, str], limit: int) -> bytes:
        """Return the whole body of a request (at most `limit` bytes), retried as `_open` says."""
        for attempt in range(1, ATTEMPTS + 1):
            conn, response, origin = self._open(method, bucket, key, query)
            try:
                body = response.read(limit + 1)
                if response.length and len(body) <= limit:  # Content-Length promised more than arrived
                    raise http.client.IncompleteRead(body, response.length)
                complete = response.isclosed() or (response.length is None and not response.read(1))
            except (OSError, http.client.HTTPException):
                conn.close()
                if attempt < ATTEMPTS:
                    _sleep(attempt)
                    continue
                raise OSError(f"{method} {_named(bucket, key, query)}: the connection ended early {ATTEMPTS} times{AGAIN}") from None
            if len(body) > limit:
                conn.close()
                raise OSError(f"{method} s3://{bucket}/{key}: response larger than {limit} bytes")
            if complete:
                self._release(origin, conn)
            else:
                conn.close()
            return body
        raise AssertionError("unreachable")

    def _open(self, method: str, bucket: str, key: str, query: Mapping[str, str] | None = None,
              headers: Mapping[str, str] | None = None
              ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, tuple[str, str]]:
        """Send one request and return (connection, 2xx response with its body unread, origin):
        retried on connection errors, 5xx and SlowDown, redirected once to the bucket's region,
        other errors raised as the module docstring says."""
        failures, redirected = 0, False
        while True:
            region = self._regions.get(bucket, self.region)
            scheme, host, path = self._where(bucket, key, region)
            query_string = _canonical_query(query or {})
            signed = self._sign(method, host, path, query_string, dict(headers or {}), region)
            origin = (scheme, host)
            conn = self._connection(origin)
            reused = getattr(conn, "ckpttool_used", False)
            try:
                conn.request(method, path + ("?" + query_string if query_string else ""), headers=signed)
                response = conn.getresponse()
            except (OSError, http.client.HTTPException) as error:
                conn.close()
                if reused and isinstance(error, (ConnectionError, http.client.RemoteDisconnected)):
                    continue  # a keep-alive connection the server had closed: reconnect at once
                failures += 1
                if failures >= ATTEMPTS:
                    raise OSError(f"{method} {_named(bucket, key, query)}: {type(error).__name__}: {error} "
                                  f"({failures} attempts to {scheme}://{host}){AGAIN}") from None
                _sleep(failures)
                continue
            # our mark on http.client's connection (a later request from the pool knows it reused one)
            conn.ckpttool_used = True  # type: ignore[attr-defined]
            if 200 <= response.status < 300:
                return conn, response, origin
            body = b"" if method == "HEAD" else _read_bounded(response, MAX_ERROR_BODY)
            if response.isclosed():
                self._release(origin, conn)
            else:
                conn.close()
            code, message = _error_fields(body)
            moved = response.getheader("x-amz-bucket-region")
            if moved and moved != region and not redirected and response.status in (301, 307, 400):
                self._regions[bucket] = moved
                redirected = True
                continue
            if response.status in RETRY_STATUS or code in RETRY_CODES:
                failures += 1
                if failures < ATTEMPTS:
                    _sleep(failures)
                    continue
                message = f"{message} ({failures} attempts){AGAIN}"
            raise _error(method, response.status, code, message, bucket, key)

    def _where(self, bucket: str, key: str, region: str) -> tuple[str, str, str]:
        """Return (scheme, Host header, URI-encoded path) of `bucket`/`key`."""
        encoded = urllib.parse.quote(key, safe="/")  # SigV4 for S3: each segment encoded once, RFC 3986 unreserved kept
        if self.endpoint:
            parts = urllib.parse.urlsplit(self.endpoint)
            return parts.scheme, _host(parts), f"{parts.path}/{bucket}" + (f"/{encoded}" if key else "")
        domain = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
        if _DNS_BUCKET.match(bucket):
            return "https", f"{bucket}.s3.{region}.{domain}", f"/{encoded}"
        return "https", f"s3.{region}.{domain}", f"/{bucket}" + (f"/{encoded}" if key else "")

    def _sign(self, method: str, host: str, path: str, query_string: str, headers: dict[str, str],
              region: str) -> dict[str, str]:
        """Return `headers` with host, x-amz-date, x-amz-content-sha256 and (unless anonymous)
        the SigV4 Authorization header and session token."""
        headers = {name.lower(): str(value) for name, value in headers.items()}
        headers["host"] = host
        credentials = self._credentials()
        if credentials is None:
            return headers
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(_clock()))
        headers["x-amz-date"] = stamp
        headers["x-amz-content-sha256"] = EMPTY_SHA256  # UNSIGNED-PAYLOAD is refused for GET by some endpoints
        if credentials.token:
            headers["x-amz-security-token"] = credentials.token
        names = sorted(headers)
        canonical = "\n".join([method, path, query_string,
                               "".join(f"{name}:{' '.join(headers[name].split())}\n" for name in names),
                               ";".join(names), EMPTY_SHA256])
        scope = f"{stamp[:8]}/{region}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.new(self._signing_key(credentials.secret_key, stamp[:8], region), to_sign.encode(),
                             hashlib.sha256).hexdigest()
        headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={credentials.access_key}/{scope}, "
                                    f"SignedHeaders={';'.join(names)}, Signature={signature}")
        return headers

    def _signing_key(self, secret: str, date: str, region: str) -> bytes:
        cached = self._keys.get((secret, date, region))
        if cached is None:
            cached = ("AWS4" + secret).encode()
            for part in (date, region, "s3", "aws4_request"):
                cached = hmac.new(cached, part.encode(), hashlib.sha256).digest()
            self._keys = {(secret, date, region): cached}  # one entry: a new day or region replaces it
        return cached

    def _credentials(self) -> Credentials | None:
        if self.anon:
            return None
        if self._static is not None:
            return self._static
        with self._lock:
            if self._provider is None:
                self._provider = _botocore_credentials(self._profile_name)
        frozen = self._provider.get_frozen_credentials()  # refreshes temporary credentials near their expiry
        return Credentials(frozen.access_key, frozen.secret_key, frozen.token)

    # -- connections ----------------------------------------------------------------------

    def _connection(self, origin: tuple[str, str]) -> http.client.HTTPConnection:
        """This thread's idle connection to `origin`, taken out of the pool while in use (so a
        request made while a `pieces` body is open gets its own), or a new one."""
        pool = self._local.__dict__.setdefault("pool", {})
        conn = pool.pop(origin, None)
        if conn is not None:
            return conn
        scheme, host = origin
        if scheme == "http":
            return http.client.HTTPConnection(host, timeout=self.timeout)
        return http.client.HTTPSConnection(host, timeout=self.timeout, context=self._ssl_context())

    def _release(self, origin: tuple[str, str], conn: http.client.HTTPConnection) -> None:
        pool = self._local.__dict__.setdefault("pool", {})
        if origin in pool:
            conn.close()
        else:
            pool[origin] = conn

    def _ssl_context(self) -> Any:
        import ssl

        with self._lock:
            if self._ssl is None:
                if self._verify is False or str(self._verify).lower() == "false":
                    context = ssl.create_default_context()
                    context.check_hostname = False
                    context.verify_mode = ssl.CERT_NONE
                else:
                    context = ssl.create_default_context(cafile=None if self._verify is True else str(self._verify))
                self._ssl = context
            return self._ssl


# ---------------------------------------------------------------------------------------------
# Configuration


class _Profile:
    """One profile's settings: the credentials file's section, then the config file's."""

    def __init__(self, sections: Sequence[Mapping[str, str]]):
        self.sections = sections

    def get(self, name: str) -> str | None:
        """The setting `name` (`s3.endpoint_url`: the `endpoint_url` of the nested `s3 =` block)."""
        group, _, setting = name.rpartition(".")
        for section in self.sections:
            if group:
                nested = dict(_nested(section.get(group, "")))
                if nested.get(setting):
                    return nested[setting]
            elif section.get(setting):
                return section[setting].strip()
        return None


def _profile(environ: Mapping[str, str], name: str) -> _Profile:
    import configparser

    home = os.path.expanduser("~")
    files = ((environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials"), name),
             (environ.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config"),
              name if name == "default" else f"profile {name}"))
    sections = []
    for path, section in files:
        parser = configparser.RawConfigParser()
        try:
            parser.read(os.path.expanduser(path), encoding="utf-8")
        except (configparser.Error, UnicodeDecodeError, OSError) as error:
            raise ValueError(f"{path}: not a readable AWS configuration file ({error})") from None
        if parser.has_section(section):
            sections.append(dict(parser.items(section)))
    return _Profile(sections)


def _nested(text: str) -> Iterator[tuple[str, str]]:
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep:
            yield name.strip(), value.strip()


def _static_credentials(options: Mapping[str, Any], client_kwargs: Mapping[str, Any], environ: Mapping[str, str],
                        profile: _Profile) -> Credentials | None:
    """The first complete (access key, secret) of the options, the environment, the profile (a
    profile named in the options comes before the environment, as botocore's `profile=` does)."""
    environment = (environ.get("AWS_ACCESS_KEY_ID"), environ.get("AWS_SECRET_ACCESS_KEY"),
                   environ.get("AWS_SESSION_TOKEN") or environ.get("AWS_SECURITY_TOKEN"))
    for access, secret, token in (
            (options.get("key"), options.get("secret"), options.get("token")),
            (client_kwargs.get("aws_access_key_id"), client_kwargs.get("aws_secret_access_key"),
             client_kwargs.get("aws_session_token")),
            (None, None, None) if options.get("profile") else environment,
            (profile.get("aws_access_key_id"), profile.get("aws_secret_access_key"), profile.get("aws_session_token"))):
        if access and secret:
            return Credentials(str(access), str(secret), str(token) if token else None)
    return None


def _botocore_credentials(profile: str | None) -> Any:
    """botocore's credential chain (instance role, SSO, web identity, credential_process)."""
    try:
        import botocore.session
    except ImportError:
        raise PermissionError("no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile "
                              "in ~/.aws/credentials, or --storage-option key=... secret=... (anon=true for public "
                              "buckets); instance roles and SSO need botocore: pip install 'ckpttool[s3]'") from None
    session = botocore.session.Session(profile=profile)
    try:
        credentials = session.get_credentials()
    except Exception as error:  # botocore's own errors (a broken SSO cache, a failing credential_process)
        raise PermissionError(f"AWS credentials could not be loaded ({type(error).__name__}: {error})") from None
    if credentials is None:
        raise PermissionError("no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile "
                              "in ~/.aws/credentials, or --storage-option key=... secret=... (anon=true for public buckets)")
    return credentials


# ---------------------------------------------------------------------------------------------
# Small pieces


def _split(bucket_key: str) -> tuple[str, str]:
    bucket, _, key = bucket_key.strip("/").partition("/")
    if not bucket:
        raise ValueError(f"{bucket_key!r}: expected bucket/key")
    return bucket, key


def _named(bucket: str, key: str, query: Mapping[str, str] | None) -> str:
    """The URL a request is about, for its error: the object, or the prefix a listing asked for."""
    return f"s3://{bucket}/{key or (query or {}).get('prefix', '')}"


def _add(found: dict[str, dict[str, Any]], bucket: str, name: str, size: int) -> None:
    if name.endswith("/"):
        found.setdefault(f"{bucket}/{name.rstrip('/')}", {"size": 0, "type": "directory"})
    else:
        found[f"{bucket}/{name}"] = {"size": size, "type": "file"}


def _host(parts: urllib.parse.SplitResult) -> str:
    """The Host header of a URL as botocore signs it: lower case, the port unless the scheme's default."""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None and parts.port != {"http": 80, "https": 443}[parts.scheme]:
        host = f"{host}:{parts.port}"
    return host


def _canonical_query(query: Mapping[str, str]) -> str:
    """Sorted `name=value` pairs, each part percent-encoded with only RFC 3986 unreserved kept."""
    pairs = sorted((urllib.parse.quote(str(k), safe=""), urllib.parse.quote(str(v), safe="")) for k, v in query.items())
    return "&".join(f"{k}={v}" for k, v in pairs)


def _sleep(failures: int) -> None:
    time.sleep(RETRY_DELAY * 2 ** (failures - 1) * (0.5 + random.random()))


def _read_bounded(response: http.client.HTTPResponse, limit: int) -> bytes:
    try:
        return response.read(limit)
    except (OSError, http.client.HTTPException):
        return b""


def _error_fields(body: bytes) -> tuple[str, str]:
    """(Code, Message) of an S3 XML error body; empty strings when it has none."""
    if not body:
        return "", ""
    import xml.etree.ElementTree as ElementTree

    try:
        root = ElementTree.fromstring(body)
    except ElementTree.ParseError:
        return "", body[:200].decode("utf-8", "replace").strip()
    return (root.findtext("Code") or "").strip(), (root.findtext("Message") or "").strip()


def _error(method: str, status: int, code: str, message: str, bucket: str, key: str) -> OSError:
    url = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
    detail = f"{code or f'HTTP {status}'}" + (f": {message}" if message else "")
    if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                                 "InvalidToken"):
        return PermissionError(13, detail, url)
    if code == "NoSuchBucket" or (status == 404 and not key):
        return FileNotFoundError(2, f"no bucket {bucket!r} ({detail})", f"s3://{bucket}")
    if status == 404:
        return FileNotFoundError(2, f"no object {key!r} ({detail})", url)
    if status in (412, 416):  # If-Match failed (replaced), or the range starts past the end (shrunk)
        return ObjectChanged(f"{method} {url}: the object changed while being read ({detail})")
    return OSError(f"{method} {url}: HTTP {status} {detail}")


def _check_range(response: http.client.HTTPResponse, bucket: str, key: str, start: int, end: int) -> None:
    """Raise ObjectChanged unless the response carries the bytes [start, end) of the object."""
    expected = f"bytes {start}-{end - 1}/"
    content_range = response.getheader("content-range") or ""
    whole = response.status == 200 and start == 0 and response.length == end - start
    if not (content_range.startswith(expected) or whole):
        response.close()
        raise ObjectChanged(f"GET s3://{bucket}/{key}: asked for bytes {start}..{end}, the server sent "
                            f"{content_range or f'HTTP {response.status} without Content-Range'} (object changed?)")
