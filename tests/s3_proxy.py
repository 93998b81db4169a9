"""A small HTTP proxy on 127.0.0.1 in front of a loopback S3 server (moto), for tests and
benchmarks of how many requests a command makes and how it fares when each one is slow.

Every request is counted by method (`counts`, and `gets`: the GETs), logged (`log`: method,
path and Range header of each, in arrival order) and forwarded on a
keep-alive connection of its own handler thread after `latency` seconds, the first-byte
latency object storage adds; response bodies stream through in blocks, never held whole.

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


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: LatencyProxy

    def _forward(self) -> None:
        with self.server.lock:
            self.server.counts[self.command] += 1
            self.server.log.append((self.command, self.path, self.headers.get("range")))
        if self.server.latency:
            time.sleep(self.server.latency)
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
        conn = getattr(self, "_upstream", None)
        for attempt in range(2):
            if conn is None:
                conn = self._upstream = http.client.HTTPConnection(*self.server.target, timeout=60)
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                break
            except (ConnectionError, http.client.HTTPException):
                conn.close()
                conn = self._upstream = None
                if attempt:
                    raise
        self.send_response_only(response.status, response.reason)
        chunked = response.getheader("content-length") is None and self.command != "HEAD"
        for name, value in response.getheaders():
            if name.lower() not in HOP_HEADERS:
                self.send_header(name, value)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while self.command != "HEAD":
            block = response.read(BLOCK)
            if not block:
                break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block) if chunked else block)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        if response.will_close:
            conn.close()
            self._upstream = None

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    def log_message(self, *args) -> None:
        pass
