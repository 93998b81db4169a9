"""A small HTTP proxy on 127.0.0.1 in front of a loopback S3 server (moto), for tests and
benchmarks of how many requests a command makes and how it fares when each one is slow.

Every request is counted by method (`counts`, and `gets`: the GETs), logged (`log`: method,
path and Range header of each, in arrival order) and forwarded on a
keep-alive connection of its own handler thread after `latency` seconds, the first-byte
latency object storage adds; response bodies stream through in blocks, never held whole
(`Relay`, which `fault_proxy.FaultProxy` forwards with too).

Example:
    >>> with LatencyProxy("http://127.0.0.1:5000", latency=0.02) as proxy:
    ...     client = S3Client({"endpoint_url": proxy.endpoint, ...})
    ...     proxy.gets
"""

from __future__ import annotations

import http.client
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

BLOCK = 1 << 20  # bytes of a response body forwarded per step
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"})


class LatencyProxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, target: str, latency: float = 0.0):
        super().__init__(("127.0.0.1", 0), _Forward)
        parts = urlsplit(target)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.latency = latency
        self.counts: Counter[str] = Counter()
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range header) per request
        self.lock = threading.Lock()
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"
        self._thread: threading.Thread | None = None

    @property
    def gets(self) -> int:
        with self.lock:
            return self.counts["GET"]

    def reset(self) -> None:
        with self.lock:
            self.counts.clear()
            self.log.clear()

    def __enter__(self) -> "LatencyProxy":
        self._thread = threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()


class Relay(BaseHTTPRequestHandler):
    """What both proxies do with a request they pass on (this one and `fault_proxy.FaultProxy`):
    read its body (Content-Length or chunked), send it on a keep-alive connection of the handler
    thread to `server.target`, and relay the answer in BLOCK pieces, re-chunked when the server
    gave no length; an answer that has no body (HEAD, 1xx, 204, 304) gets none."""

    protocol_version = "HTTP/1.1"
    _upstream: http.client.HTTPConnection | None = None

    def _request_body(self) -> bytes | None:
        if "chunked" in (self.headers.get("transfer-encoding") or "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if not size:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length else None

    def _forward(self, body: bytes | None) -> http.client.HTTPResponse:
        """The server's answer to this request with `body` (one retry on a keep-alive
        connection the server closed meanwhile)."""
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS | {"expect"}}
        if body is not None:
            headers = {k: v for k, v in headers.items() if k.lower() != "content-length"}
            headers["Content-Length"] = str(len(body))
        for attempt in range(2):
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(*self.server.target, timeout=60)  # type: ignore[attr-defined]
            try:
                self._upstream.request(self.command, self.path, body=body, headers=headers)
                return self._upstream.getresponse()
            except (ConnectionError, http.client.HTTPException):
                self._upstream.close()
                self._upstream = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _headers(self, response: http.client.HTTPResponse, length: int | None) -> bytes:
        lines = [f"HTTP/1.1 {response.status} {response.reason}"]
        lines += [f"{name}: {value}" for name, value in response.getheaders()
                  if name.lower() not in HOP_HEADERS | {"content-length"}]
        if length is not None:
            lines.append(f"Content-Length: {length}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _bodiless(self, response: http.client.HTTPResponse) -> bool:
        return self.command == "HEAD" or response.status in (204, 304) or response.status < 200

    def _stream(self, response: http.client.HTTPResponse) -> None:
        declared = response.getheader("content-length")
        chunked = declared is None and not self._bodiless(response)
        head = self._headers(response, int(declared) if declared is not None else None)
        if chunked:
            head = head[:-2] + b"Transfer-Encoding: chunked\r\n\r\n"
        self.wfile.write(head)
        while not self._bodiless(response):
            block = response.read(BLOCK)
            if not block:
                break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block) if chunked else block)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        self._done_upstream(response)

    def _done_upstream(self, response: http.client.HTTPResponse) -> None:
        if response.will_close and self._upstream is not None:
            self._upstream.close()
            self._upstream = None

    def log_message(self, *args: object) -> None:
        pass


class _Forward(Relay):
    server: LatencyProxy

    def _count_and_forward(self) -> None:
        with self.server.lock:
            self.server.counts[self.command] += 1
            self.server.log.append((self.command, self.path, self.headers.get("range")))
        if self.server.latency:
            time.sleep(self.server.latency)
        self._stream(self._forward(self._request_body()))

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _count_and_forward
