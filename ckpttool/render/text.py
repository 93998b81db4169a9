"""What every command's output is made of: text made safe for a terminal, sizes and counts
for people, aligned tables, problems as lines and as JSON, and the one JSON writer.

Example:
    >>> human_bytes(1_500_000_000), human_count(124_400_000)
    ('1.5 GB', '124.4M')
"""

from __future__ import annotations

import codecs
import os
import re
import sys
from typing import TYPE_CHECKING, AbstractSet, Any, Iterable, TextIO

if TYPE_CHECKING:
    from ckpttool.check.integrity import Problem


# Never sent raw to a terminal: C0 and C1 controls (ESC starts ANSI sequences; CR and BS
# overwrite), DEL, bidirectional controls (they reorder what is shown) and unpaired surrogates.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def shown(text: Any) -> str:
    """`text` made inert for a terminal, on one line: `model.\x1b[31mw` for an ESC, `\n` escaped."""
    text = str(text)
    return text if text.isprintable() else _UNSAFE.sub(_escape, text)


def terminal_text(text: str) -> str:
    """`shown` line by line: keeps the line breaks of multi-line output, escapes the rest."""
    return text if text.isprintable() else "\n".join(map(shown, text.split("\n")))


def human_bytes(count: int) -> str:
    """Return `count` bytes as e.g. `1.5 GB` (decimal units, as disks and the Hub count)."""
    value = float(count)
    for unit in ("B", "kB", "MB", "GB"):
        if abs(value) < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def human_count(count: int) -> str:
    """Return a count as e.g. `124.4M`."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


class ColumnRows(list):
    """A list in a JSON document that writes its own JSON from columns (`json_blocks`, as ASCII
    bytes; `json_text`) instead of one dict per row being built and encoded; `emit_json` asks it
    for that text (`chunk_tables.ChunkRows` is the one kind). Never given to `json.dumps`
    directly: the C encoder would see an empty list."""

    def json_text(self, cache: dict[Any, Any]) -> str:
        """Return `json.dumps(list(self))`; `cache` is shared by the rows of one document."""
        raise NotImplementedError

    def json_blocks(self, cache: dict[Any, Any]) -> Iterable[bytes]:
        """Yield `json.dumps(list(self))` as ASCII bytes, in pieces."""
        yield self.json_text(cache).encode("ascii")


def emit_json(document: dict[str, Any], out: TextIO | None = None) -> None:
    """Write one JSON document on one line (stdout by default); pipe to `jq` to read it.

    `json.dumps` without indent uses the C encoder (`json.dump` to a stream does not):
    100k chunks encode in 0.2 s instead of 4 s. A tensor's `chunks` that are `ColumnRows` (a
    ChunkTable's, in an inspect document) are written straight from its columns, tensor by
    tensor, in place of a placeholder: the same bytes as encoding their dicts, without building
    them, and as bytes to the stream's binary buffer when it has one (7M chunks are 900 MB of
    JSON: never a str, never held whole).
    """
    import json  # on use: text output never loads the encoder

    out = out or sys.stdout
    rows: list[ColumnRows] = []
    tensors = document.get("tensors")
    if isinstance(tensors, list) and any(isinstance(t, dict) and isinstance(t.get("chunks"), ColumnRows) for t in tensors):
        marker = f"\x00ckpttool chunks {os.urandom(16).hex()} "

        def placeholder(tensor: Any) -> Any:
            if not (isinstance(tensor, dict) and isinstance(tensor.get("chunks"), ColumnRows)):
                return tensor
            rows.append(tensor["chunks"])
            return {**tensor, "chunks": f"{marker}{len(rows) - 1}"}

        document = {**document, "tensors": [placeholder(t) for t in tensors]}
    text = json.dumps(document)  # ASCII: ensure_ascii
    if rows:
        parts = re.split(re.escape(json.dumps(marker)[:-1]) + r'(\d+)"', text)
        file_texts: dict[Any, Any] = {}  # tables mostly share their files
        if (binary := _ascii_buffer(out)) is None:
            for at in range(0, len(parts) - 1, 2):
                out.write(parts[at])
                out.write(rows[int(parts[at + 1])].json_text(file_texts))
        else:
            out.flush()  # what was written as text goes first
            for at in range(0, len(parts) - 1, 2):
                binary.write(parts[at].encode("ascii"))
                for block in rows[int(parts[at + 1])].json_blocks(file_texts):
                    binary.write(block)
        text = parts[-1]
    out.write(text)
    out.write("\n")


def _ascii_buffer(out: TextIO) -> Any:
    """The binary stream under a text stream whose encoding writes ASCII as it is (stdout's), or None."""
    binary, encoding = getattr(out, "buffer", None), getattr(out, "encoding", None)
    if binary is None or not isinstance(encoding, str):
        return None
    try:
        return binary if codecs.lookup(encoding).name in _ASCII_AS_IS else None
    except LookupError:
        return None


_ASCII_AS_IS = frozenset({"utf-8", "ascii", "iso8859-1"})  # codecs.lookup names


def table(rows: Iterable[tuple], headers: tuple[str, ...], right: AbstractSet[int] = frozenset()) -> list[str]:
    """Return aligned text lines; columns in `right` are right-aligned."""
    shown_rows = [tuple(shown(c) for c in row) for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in shown_rows]) for i, h in enumerate(headers)]

    def line(cells: tuple[str, ...]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    return [line(headers)] + [line(r) for r in shown_rows]


def problems_document(problems: Iterable[Problem]) -> list[dict[str, Any]]:
    """Return problems as the JSON list every document shares."""
    return [
        {"severity": p.severity, "code": p.code, "file": p.file, "fqn": p.fqn, "message": p.message}
        for p in problems
    ]


def problem_lines(problems: Iterable[Problem]) -> list[str]:
    """Return one `severity: [code] message` line per problem (warnings of a write go to stderr)."""
    return [f"{p.severity}: [{p.code}] {shown(p.message)}" for p in problems]


def model_view_document(view) -> dict[str, Any] | None:
    """Return where the model was found and why: `{"prefix", "selected", "reason", "candidates"}`."""
    if view is None:
        return None
    return {"prefix": view.prefix, "selected": view.selected, "reason": view.reason,
            "candidates": list(view.candidates)}
