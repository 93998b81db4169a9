"""The integrity gate's overlap check of a small checkpoint, in pure Python: no numpy import.

`integrity` proves the byte ranges of a large checkpoint disjoint with numpy. A checkpoint of a
few hundred chunks held as tuples (the bundled example has 142) is checked here instead: importing
numpy would cost far more than the whole check (about 0.13 s against a millisecond), and
`validate` of a small checkpoint is what people run in loops. The findings are the same as the
numpy path's: per file, in the order of its first claim, the file's claims sorted by (start,
end), ties in claim order, each compared with the next.

Example:
    >>> claims = [(0, 0, 10, True), (1, 0, 4, True), (0, 8, 12, True)]  # (file, start, end, owned)
    >>> file_claims(claims)
    [(0, [(0, 10, 0, True), (8, 12, 2, True)]), (1, [(0, 4, 1, True)])]
    >>> adjacent(file_claims(claims)[0][1])
    (False, [0])
"""

from __future__ import annotations

from typing import Sequence

SMALL_CLAIMS = 100_000  # claims checked here when no chunk table holds any (numpy's import costs more below)

Claim = tuple[int, int, int, bool]  # (file number, start, end, owned by a tensor chunk), in claim order
Row = tuple[int, int, int, bool]  # (start, end, claim id, owned): one claim within its file


def file_claims(claims: Sequence[Claim]) -> list[tuple[int, list[Row]]]:
    """Return (file number, its claims sorted by start, end and claim id) per file, the files
    in the order of their first claim (a claim's id is its position in `claims`)."""
    by_file: dict[int, list[Row]] = {}
    for claim, (file, start, end, owned) in enumerate(claims):
        by_file.setdefault(file, []).append((start, end, claim, owned))
    for rows in by_file.values():
        rows.sort()  # claim ids are distinct: `owned` is never compared
    return list(by_file.items())


def adjacent(rows: Sequence[Row]) -> tuple[bool, list[int]]:
    """Return, for one file's sorted claims, whether it must be swept with the blobs resolved
    (two claims start together and either end together or are both tensor blobs:
    `integrity._sweep_file`), and the positions whose next claim starts before they end."""
    pairs = list(zip(rows, rows[1:]))
    sweep = any(a[0] == b[0] and (a[1] == b[1] or (a[3] and b[3])) for a, b in pairs)
    return sweep, [i for i, (a, b) in enumerate(pairs) if b[0] < a[1]]
