"""A fault-injecting HTTP proxy on 127.0.0.1 in front of a loopback S3 server (moto), for the
reliability soak (`benchmarks/soak.py`, `tests/soak_harness.py`) and the regression tests of
what object storage does to a command now and then.

Each request is classified by its S3 operation (`request_type`: LIST, HEAD, GET, PUT,
CREATE, PART, COMPLETE, ABORT, DELETE) and, drawn from a seeded RNG at `rate` (or as a
`script` orders), answered with one fault instead of the server's answer:

- `slowdown`: 503 with S3's `SlowDown` XML error body; `internal`: 500 `InternalError`
  (neither reaches the server);
- `reset`: the connection reset before any response (the server never saw the request);
- `reset-mid`: the server's answer forwarded in part (into its body, or into its headers when
  it has none), then the connection reset;
- `short`: the headers promise `Content-Length`, fewer bytes follow, then the connection is
  closed (a cut-short LIST body is issue 32);
- `stall`: nothing for `stall` seconds (longer than the client's read timeout), then a reset;
- `slow`: nothing for `slow` seconds (shorter than the read timeout), then the server's answer.

`injected` lists every fault as `(request type, fault, path)`; `counts` counts requests by type;
`active` is the number being answered.
Requests without a fault stream through as `s3_proxy.LatencyProxy` forwards them.

Example:
    >>> with FaultProxy("http://127.0.0.1:5000", seed=7, rate=0.3, stall=1.5) as proxy:
    ...     env = {"AWS_ENDPOINT_URL": proxy.endpoint}
    >>> with FaultProxy(moto, script={"LIST": ["short"]}) as proxy:   # the first LIST cut short, then none
    ...     ...
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
from collections import Counter
from http.server import ThreadingHTTPServer
from typing import Iterable, Mapping, Sequence
from urllib.parse import parse_qs, urlsplit

from s3_proxy import Relay

FAULTS = ("slowdown", "internal", "reset", "reset-mid", "short", "stall", "slow")
REQUEST_TYPES = ("LIST", "HEAD", "GET", "PUT", "CREATE", "PART", "COMPLETE", "ABORT", "DELETE")
_BEFORE = frozenset({"slowdown", "internal", "reset", "stall"})  # answered without asking the server
_ERRORS = {"slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
           "internal": (500, "Internal Server Error", "InternalError",
                        "We encountered an internal error. Please try again.")}


def request_type(method: str, path: str) -> str:
    """The S3 operation a path-style request is, as the proxy's rules name it.

    Example:
        >>> request_type("GET", "/ckpts?list-type=2&prefix=src%2F"), request_type("PUT", "/b/k?partNumber=2&uploadId=x")
        ('LIST', 'PART')
    """
    parts = urlsplit(path)
    query = parse_qs(parts.query, keep_blank_values=True)
    has_key = "/" in parts.path.strip("/")
    if method == "HEAD":
        return "HEAD"
    if method == "GET":
        return "GET" if has_key and "uploadId" not in query else "LIST"
    if method == "PUT":
        return "PART" if "partNumber" in query else "PUT"
    if method == "POST":
        return "CREATE" if "uploads" in query else "COMPLETE" if "uploadId" in query else "DELETE"
    if method == "DELETE":
        return "ABORT" if "uploadId" in query else "DELETE"
    return method


class FaultProxy(ThreadingHTTPServer):
    """The proxy; `rate` of the requests whose type is in `requests` get one of `faults`
    (uniformly, from `random.Random(seed)`); `script` maps a request type to the faults (or
    None: no fault) its first requests get, in order, before `rate` applies; `always` maps a
    request type to the fault every one of its requests gets."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, target: str, seed: int = 0, rate: float = 0.0, faults: Sequence[str] = FAULTS,
                 requests: Iterable[str] = REQUEST_TYPES, stall: float = 1.5, slow: float = 0.3,
                 script: Mapping[str, Sequence[str | None]] | None = None, always: Mapping[str, str] | None = None):
        super().__init__(("127.0.0.1", 0), _Handler)
        unknown = (set(faults) | set((always or {}).values())) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; expected some of {FAULTS}")
        parts = urlsplit(target)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.rng = random.Random(seed)
        self.rate, self.faults, self.requests, self.stall, self.slow = rate, tuple(faults), frozenset(requests), stall, slow
        self.active = 0
        self.script = {kind: list(plan) for kind, plan in (script or {}).items()}
        self.always = dict(always or {})
        self.counts: Counter[str] = Counter()
        self.injected: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"

    def configure(self, seed: int, rate: float, faults: Sequence[str] = FAULTS,
                  requests: Iterable[str] = REQUEST_TYPES, stall: float | None = None) -> None:
        """Start a new run of faults (the soak reuses one proxy for every point)."""
        with self.lock:
            self.rng = random.Random(seed)
            self.rate, self.faults, self.requests = rate, tuple(faults), frozenset(requests)
            self.stall = self.stall if stall is None else stall
            self.script, self.always = {}, {}
            self.counts.clear()
            self.injected.clear()

    def decide(self, kind: str, path: str) -> str | None:
        """The fault this request gets (and it is logged), or None."""
        with self.lock:
            self.counts[kind] += 1
            fault: str | None = None
            if kind in self.always:
                fault = self.always[kind]
            elif self.script.get(kind):
                fault = self.script[kind].pop(0)
            elif kind in self.requests and self.faults and self.rng.random() < self.rate:
                fault = self.rng.choice(self.faults)
            if fault is not None:
                self.injected.append((kind, fault, path))
            return fault

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that gave up on a stalled or cut answer closed its end: not worth a traceback."""

    def __enter__(self) -> "FaultProxy":
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.closing.set()
        self.shutdown()
        self.server_close()


class _Handler(Relay):
    server: FaultProxy

    def _handle(self) -> None:
        with self.server.lock:
            self.server.active += 1
        try:
            self._answer()
        finally:
            with self.server.lock:
                self.server.active -= 1

    def _answer(self) -> None:
        body = self._request_body()
        kind = request_type(self.command, self.path)
        fault = self.server.decide(kind, f"{self.command} {self.path}")
        if fault in _ERRORS:
            self._error(*_ERRORS[fault])
            return
        if fault in ("stall", "slow"):
            self.server.closing.wait(self.server.stall if fault == "stall" else self.server.slow)
        if fault in ("reset", "stall"):
            self._reset()
            return
        response = self._forward(body)
        if fault in (None, "slow"):
            self._stream(response)
        else:
            self._cut(response, reset=fault == "reset-mid")

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    def _cut(self, response: http.client.HTTPResponse, reset: bool) -> None:
        """Send the response in part (into the body when it has one, else into the headers),
        then reset (`reset`) or close the connection."""
        body = b"" if self._bodiless(response) else response.read()
        declared = response.getheader("content-length")
        head = self._headers(response, int(declared) if declared is not None
                             else None if self._bodiless(response) else len(body))
        self._done_upstream(response)
        with self.server.lock:
            if body:
                sent = head + body[:self.server.rng.randrange(len(body))]
            else:
                sent = head[:self.server.rng.randrange(1, len(head) - 4)]
        self.wfile.write(sent)
        self.wfile.flush()
        if reset:
            self._reset()
        else:
            self.close_connection = True

    def _error(self, status: int, reason: str, code: str, message: str) -> None:
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
                f"<RequestId>soak</RequestId></Error>").encode()
        self.send_response_only(status, reason)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _reset(self) -> None:
        """Close with a TCP reset (SO_LINGER 0), as a dropped connection looks to the client."""
        try:
            self.wfile.flush()
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.close_connection = True

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
