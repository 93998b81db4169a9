"""Coalesced reads of object storage: the byte spans of remote files a command will read,
each fetched by one ranged GET on a small pool of threads, held under a memory budget and
served to the reads that fall inside them.

A request to S3 costs its first-byte latency (tens of milliseconds) whatever its size, so a
checkpoint read one record header and one copy at a time is bound by requests, not bytes.
Here the ranges a command needs are merged per file (`coalesce`: neighbours joined, gaps of
up to `GAP` read through, runs cut into `SPAN`-sized pieces, so a file of B needed bytes
costs about 1 + B / SPAN requests), and `SpanStore` fetches them ahead of the readers,
`IN_FLIGHT` at a time.

Two kinds of reader use a store, in this order (`dcp.blobs.DataFiles` wires them):

- a walker of one file's records in offset order (locating record headers) registers its
  spans with `walk` and starts them as it reaches them, `LOOKAHEAD` ahead; a span it has
  passed is kept for the copies while the kept bytes fit the budget, else dropped. Most
  records are not walked: `locating` reads one record per layout from the spans the copies
  will read it from (`expect`ed early, and kept), and the others' headers with their data;
- the copies: `expect` is given every range they will read, in the order they will run; a
  kept span is trimmed to what they need, the rest is coalesced into new spans fetched in
  order of first use while the budget allows, and each span is freed once its bytes have
  been served. A reader that reaches a span not started yet starts it at once (over the
  budget by at most a span per reader thread, and such a span is not kept past its read).
  Copies into local files run in file order (`execute.in_source_order`), so each file's
  spans are SPAN bytes, read through one after another: a file of B bytes costs at most
  1 + B / SPAN GETs at any budget of 2 x SPAN or more (`span_limit`); copies that visit the
  files side by side get spans small enough that two per file fit the budget.

A read no span covers returns None: the caller reads it with its own GET, as without a store.

Example:
    >>> coalesce([("a", 0, 100), ("a", 150, 300), ("b", 0, 10)], gap=64, limit=1 << 20)
    [Span(file='a', start=0, end=300), Span(file='b', start=0, end=10)]
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

SPAN = 8 << 20  # most bytes one GET fetches: a file of B needed bytes costs ceil(B / SPAN) requests per run
GAP = 1 << 20  # a gap between needed ranges read through rather than paid for with another request
IN_FLIGHT = 8  # GETs at once: at 20 ms to the first byte, eight 8 MiB responses keep a link busy
LOOKAHEAD = 2  # spans a walker starts beyond the one it reads
MIN_SPAN = 1 << 20  # the smallest span `fit` makes: below it a request costs more than its bytes

Range = tuple[str, int, int]  # (file, start, end): bytes [start, end) of a data file
Fetch = Callable[[str, int, int], bytes]  # (file, start, end) -> exactly those bytes, by one GET


@dataclass(frozen=True)
class Span:
    """Bytes [start, end) of `file`, fetched by one GET."""

    file: str
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def coalesce(ranges: Iterable[Range], gap: int | None = None, limit: int | None = None) -> list[Span]:
    """Return the spans that cover `ranges`, sorted by (file, start): ranges of a file that
    overlap, touch or lie at most `gap` bytes apart are merged, and a merged run longer than
    `limit` is cut into equal pieces of at most `limit` bytes (defaults: GAP, SPAN).

    Example:
        >>> [s.length for s in coalesce([("f", 0, 20 << 20)], limit=8 << 20)]
        [6990507, 6990507, 6990506]
    """
    gap = GAP if gap is None else gap
    limit = SPAN if limit is None else limit
    runs: list[list] = []
    for file, start, end in sorted(r for r in ranges if r[2] > r[1]):
        if runs and runs[-1][0] == file and start - runs[-1][2] <= gap:
            runs[-1][2] = max(runs[-1][2], end)
        else:
            runs.append([file, start, end])
    spans: list[Span] = []
    for file, start, end in runs:
        count = -(-(end - start) // limit)
        size = -(-(end - start) // count)
        spans.extend(Span(file, at, min(at + size, end)) for at in range(start, end, size))
    return spans


def subtract(ranges: Iterable[Range], spans: Iterable[Span]) -> list[Range]:
    """Return the parts of `ranges` that no span in `spans` covers (spans must not overlap).

    Example:
        >>> subtract([("f", 0, 100)], [Span("f", 10, 20), Span("f", 50, 200)])
        [('f', 0, 10), ('f', 20, 50)]
    """
    covered = _by_file(spans)
    left = []
    for file, start, end in ranges:
        pieces, starts = covered.get(file, ([], []))
        at = start
        for span in pieces[max(0, bisect.bisect_right(starts, start) - 1):]:
            if span.start >= end:
                break
            if span.end <= at:
                continue
            if span.start > at:
                left.append((file, at, span.start))
            at = span.end
        if at < end:
            left.append((file, at, end))
    return left


def overlapping(spans: Sequence[Span], ranges: Iterable[Range]) -> list[bool]:
    """Return, for each of `spans` (not overlapping each other), whether any of `ranges` overlaps it.

    Example:
        >>> overlapping([Span("f", 0, 10), Span("f", 10, 20)], [("f", 12, 13)])
        [False, True]
    """
    index = {span: position for position, span in enumerate(spans)}
    found = [False] * len(spans)
    by_file = _by_file(spans)
    for file, start, end in ranges:
        pieces, starts = by_file.get(file, ([], []))
        for span in pieces[max(0, bisect.bisect_right(starts, start) - 1):]:
            if span.start >= end:
                break
            if span.end > start:
                found[index[span]] = True
    return found


def _by_file(spans: Iterable[Span]) -> dict[str, tuple[list[Span], list[int]]]:
    """file -> (its spans sorted by start, their starts)."""
    grouped: dict[str, list[Span]] = {}
    for span in spans:
        grouped.setdefault(span.file, []).append(span)
    return {file: (found, [span.start for span in found])
            for file, found in ((file, sorted(found, key=lambda span: span.start)) for file, found in grouped.items())}


class _Entry:
    """One span in a store: not started, in flight (`future`), or held (`data`)."""

    __slots__ = ("span", "future", "data", "need", "walked", "counted", "keep")

    def __init__(self, span: Span, need: int | None, keep: bool = True):
        self.span = span
        self.keep = keep  # a walker's span the copies will read: kept once passed, if it fits
        self.future: Future | None = None
        self.data: bytes | None = None
        self.need = need  # bytes the copies will still read from it; None: kept until `expect`
        self.walked = need is None  # registered by a walker that has not passed it yet
        self.counted = False  # its bytes are in the store's `used`


class SpanStore:
    """Spans of remote files fetched ahead of their readers (see the module docstring).

    Thread-safe. `budget` bounds the bytes of spans kept or fetched for the copies (a walker's
    spans in use and the spans readers start beyond the queue come on top, at most twice the
    budget). `requests` counts the GETs it made. Close it to stop fetching.

    Example:
        >>> store = SpanStore(lambda file, start, end: data[file][start:end], budget=64 << 20)
        >>> store.expect([("a", 0, 10), ("a", 20, 30)])
        >>> bytes(store.read("a", 20, 5))  # served from the one span [0, 30)
    """

    def __init__(self, fetch: Fetch, budget: int, in_flight: int = IN_FLIGHT):
        self._fetch = fetch
        self.budget = budget
        self._pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="ckpttool-get")
        self._lock = threading.Lock()
        self._entries: dict[str, list[_Entry]] = {}  # file -> entries sorted by start (never overlapping)
        self._starts: dict[str, list[int]] = {}
        self._queue: deque[_Entry] = deque()  # the copies' spans not started, in order of first use
        self._used = 0  # bytes of the spans kept, or in flight or held for the copies
        self.requests = 0

    def close(self) -> None:
        """Stop fetching and forget every span."""
        with self._lock:
            self._queue.clear()
            self._entries.clear()
            self._starts.clear()
            self._used = 0
        self._pool.shutdown(wait=True, cancel_futures=True)

    # -- registering ----------------------------------------------------------------------

    def fit(self, files: int) -> int:
        """Return the size of the spans walkers of `files` files read side by side (`span_limit`).

        Example:
            >>> SpanStore(fetch, budget=64 << 20).fit(8)  # 4 MiB: 8 files x 2 spans in 64 MiB
            4194304
        """
        return self.span_limit(files)

    def span_limit(self, files: int = 1) -> int:
        """Return the size of spans read from `files` files side by side: SPAN, or less when
        two spans per file would not fit the budget (one read while the next is fetched;
        larger spans would not stay until read, and be fetched again), never below MIN_SPAN.
        The copies into local files run in file order (`execute.in_source_order`): one file
        at a time, so spans of SPAN bytes from 64MB of --max-memory on.

        Example:
            >>> SpanStore(fetch, budget=32 << 20).span_limit()  # --max-memory 64MB
            8388608
        """
        return min(SPAN, max(MIN_SPAN, self.budget // (2 * max(1, files))))

    def walk(self, spans: Sequence[Span], keep: Sequence[bool] | None = None) -> None:
        """Register the spans walkers will read, in offset order per file (`keep`: whether
        each is worth keeping for the copies once passed; default all); nothing starts until
        a walker reaches them (`read`)."""
        with self._lock:
            for position, span in enumerate(spans):
                if not self._overlapping(span.file, span.start, span.end):
                    self._insert(_Entry(span, None, True if keep is None else keep[position]))

    def passed(self, file: str, offset: int) -> None:
        """Say the walker of `file` reads nothing below `offset` any more: the spans it passed
        are kept for the copies while they fit the budget, else dropped."""
        with self._lock:
            for entry in self._walked_below(file, offset):
                if entry.walked:
                    entry.walked = False
                    if entry.keep and entry.future is not None and self._used + entry.span.length <= self.budget:
                        self._count(entry)
                    else:
                        self._remove(entry)

    def expect(self, ranges: Sequence[Range]) -> None:
        """Prepare for reads of exactly `ranges` (repeats count), in the order they will run:
        the spans already here keep what the ranges need of them, the rest is fetched."""
        with self._lock:
            held = []
            for entry in [entry for entries in self._entries.values() for entry in entries]:
                if entry.future is None:
                    self._remove(entry)  # a walker never reached it: fetched below if needed
                    continue
                if entry.walked:
                    entry.walked = False
                    self._count(entry)
                entry.need = 0
                held.append(entry)
            kept = [entry.span for entry in held]
            merged = coalesce(subtract(ranges, kept), limit=self.span_limit(_side_by_side(ranges)))
            new = _first_use(ranges, [Span(*piece) for piece in subtract(
                [(s.file, s.start, s.end) for s in merged], kept)])  # a gap read through stops at a kept span
            fresh = [_Entry(span, 0) for span in new]
            for entry in fresh:
                self._insert(entry)
            for file, start, end in ranges:
                for entry in self._overlapping(file, start, end):
                    if entry.need is not None:  # None: kept until `expect` anyway
                        entry.need += min(end, entry.span.end) - max(start, entry.span.start)
            for entry in held:
                if entry.need == 0:
                    self._remove(entry)
            self._queue.extend(fresh)
            self._pump()

    # -- reading --------------------------------------------------------------------------

    def read(self, file: str, offset: int, length: int) -> bytes | memoryview | None:
        """Return the `length` bytes at `offset` from the spans that cover them, waiting for
        those in flight and starting those not started; None when a byte is not covered."""
        found = list(self.pieces(file, offset, length))  # once: serving them moves the read-ahead
        parts = [part for part in found if part is not None]
        if len(parts) != len(found):
            return None
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def pieces(self, file: str, offset: int, length: int, most: int | None = None) -> Iterator[memoryview | None]:
        """Yield the `length` bytes at `offset` in order, as views of at most `most` bytes;
        a single None (and nothing else) when a byte is not covered."""
        end = offset + length
        with self._lock:
            entries = self._covering(file, offset, end)
            if entries is None:
                for entry in self._overlapping(file, offset, end):
                    self._served(entry, offset, end)  # the caller reads these bytes itself
            else:
                for entry in entries:
                    if entry.future is None:
                        self._start(entry)
                    if entry.walked:
                        self._ahead(entry)
        if entries is None:
            yield None
            return
        at = offset
        for entry in entries:
            data = memoryview(self._wait(entry))
            stop = min(end, entry.span.end)
            while at < stop:
                step = stop - at if most is None else min(most, stop - at)
                yield data[at - entry.span.start:at - entry.span.start + step]
                at += step
            with self._lock:
                self._served(entry, max(offset, entry.span.start), stop)

    # -- inside, under the lock -----------------------------------------------------------

    def _walked_below(self, file: str, offset: int) -> list[_Entry]:
        """The walked entries of `file` ending at or below `offset`, in order: those since the
        walker's last `passed` (its offsets only grow, so they lie just below `offset`)."""
        entries = self._entries.get(file, [])
        index = bisect.bisect_right(self._starts.get(file, []), offset) - 1
        found = []
        while index >= 0:
            entry = entries[index]
            index -= 1
            if entry.span.end > offset:
                continue
            if not entry.walked:
                break
            found.append(entry)
        return found[::-1]

    def _overlapping(self, file: str, start: int, end: int) -> list[_Entry]:
        starts = self._starts.get(file, [])
        index = max(0, bisect.bisect_right(starts, start) - 1)
        found = []
        for entry in self._entries.get(file, [])[index:]:
            if entry.span.start >= end:
                break
            if entry.span.end > start:
                found.append(entry)
        return found

    def _covering(self, file: str, start: int, end: int) -> list[_Entry] | None:
        """The entries that together cover [start, end) with no hole, else None."""
        entries, at = [], start
        for entry in self._overlapping(file, start, end):
            if entry.span.start > at:
                return None
            entries.append(entry)
            at = entry.span.end
        return entries if at >= end and entries else None

    def _insert(self, entry: _Entry) -> None:
        starts = self._starts.setdefault(entry.span.file, [])
        index = bisect.bisect_left(starts, entry.span.start)
        starts.insert(index, entry.span.start)
        self._entries.setdefault(entry.span.file, []).insert(index, entry)

    def _remove(self, entry: _Entry) -> None:
        entries = self._entries.get(entry.span.file, [])
        index = bisect.bisect_left(self._starts.get(entry.span.file, []), entry.span.start)
        if index < len(entries) and entries[index] is entry:
            del entries[index]
            del self._starts[entry.span.file][index]
        if entry.counted:
            entry.counted = False
            self._used -= entry.span.length
        if entry.future is None and entry in self._queue:
            self._queue.remove(entry)
        entry.data = None

    def _count(self, entry: _Entry) -> None:
        if not entry.counted:
            entry.counted = True
            self._used += entry.span.length

    def _start(self, entry: _Entry) -> None:
        if self._queue and self._queue[0] is entry:
            self._queue.popleft()
        elif entry.need is not None and not entry.walked and entry in self._queue:  # a reader's, ahead of its turn
            self._queue.remove(entry)
        if not entry.walked:
            self._count(entry)
        self.requests += 1
        span = entry.span
        entry.future = self._pool.submit(self._fetch, span.file, span.start, span.end)

    def _ahead(self, entry: _Entry) -> None:
        """Start the next LOOKAHEAD spans of the walker reading `entry`."""
        following = self._entries[entry.span.file]
        index = bisect.bisect_left(self._starts[entry.span.file], entry.span.start)
        for ahead in following[index + 1:index + 1 + LOOKAHEAD]:
            if ahead.walked and ahead.future is None:
                self._start(ahead)

    def _served(self, entry: _Entry, start: int, end: int) -> None:
        if entry.need is None or entry.walked:
            return
        entry.need -= max(0, min(end, entry.span.end) - max(start, entry.span.start))
        if entry.need <= 0 or self._used > 2 * self.budget:  # over twice the budget: not kept for later reads
            self._remove(entry)
            self._pump()

    def _pump(self) -> None:
        while self._queue and (self._used == 0 or self._used + self._queue[0].span.length <= self.budget):
            self._start(self._queue[0])

    def _wait(self, entry: _Entry) -> bytes:
        data = entry.data
        if data is None:
            assert entry.future is not None  # started before anyone waits on it
            data = entry.future.result()  # raises what the GET raised (the fetch names the file)
            entry.data = data
        return data


def _side_by_side(ranges: Sequence[Range]) -> int:
    """Return how many files `ranges` read at once: 1 when each file's ranges come together
    (one file read through after another), else every file they read.

    Example:
        >>> _side_by_side([("a", 0, 1), ("a", 5, 9), ("b", 0, 1)]), _side_by_side([("a", 0, 1), ("b", 0, 1), ("a", 5, 9)])
        (1, 2)
    """
    files = len({file for file, _, _ in ranges})
    switches = sum(1 for before, after in zip(ranges, ranges[1:]) if before[0] != after[0])
    return 1 if switches < files else files


def _first_use(ranges: Sequence[Range], spans: Sequence[Span]) -> list[Span]:
    """Return `spans` (not overlapping) in the order the first of `ranges` overlapping each comes."""
    by_file = _by_file(spans)
    first: dict[Span, int] = {}
    for position, (file, start, end) in enumerate(ranges):
        pieces, starts = by_file.get(file, ([], []))
        for span in pieces[max(0, bisect.bisect_right(starts, start) - 1):]:
            if span.start >= end:
                break
            if span.end > start:
                first.setdefault(span, position)
    return sorted(first, key=lambda span: first[span])
