"""A tensor's chunks read as a ChunkTable, rendered from the table's int64 columns: the
`--chunks` text (`chunk_table`) and the `chunks` list of inspect's JSON (`ChunkRows`), each
cell made once per column instead of one object per chunk (100k+ chunks at scale).

Example:
    >>> print("\n".join(chunk_table(report.tensors[0], {})))     # fixtures/fsdp2_world3_uneven, as tables
    OFFSETS  SIZES   FILE             AT  LENGTH
    [0, 0]   [5, 8]  __0_0.distcp   1577    1705
    [5, 0]   [5, 8]  __1_0.distcp   9463    1705
    [10, 0]  [3, 8]  __2_0.distcp  10088    1641
"""

from __future__ import annotations

import json
from typing import Any, Iterator

from ckpttool.commands.inspect import ChunkInfos, TensorInfo
from ckpttool.render.text import ColumnRows, shown, table


class ChunkRows(ColumnRows):
    """The `chunks` list of a tensor read as a ChunkTable in an inspect document: a list that
    iterates as the chunk dicts (built when asked for), and that `emit_json` writes from the
    table's columns (`json_text`)."""

    def __init__(self, chunks: ChunkInfos):
        super().__init__()
        self.chunks = chunks

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for c in self.chunks:
            yield {"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file, "offset": c.offset,
                   "length": c.length, "bytes": c.nbytes}

    def __len__(self) -> int:
        return len(self.chunks)

    def __bool__(self) -> bool:
        return len(self.chunks) > 0

    def __getitem__(self, index: Any) -> Any:
        return list(self)[index]

    def __eq__(self, other: object) -> bool:
        return list(self) == other

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]  # a list: unhashable, as list itself

    def __repr__(self) -> str:
        return f"ChunkRows({self.chunks!r})"

    def json_text(self, file_texts: dict[tuple[str, ...], list[str]] | None = None) -> str:
        """Return `json.dumps(list(self))`, formatted from the columns: one % per chunk, with
        the values a column holds in every row (FSDP: sizes, lengths) written into the format.
        `file_texts` keeps the JSON of each table's file names for the next table."""
        table = self.chunks.table
        if not len(table):
            return "[]"
        stored = bool((table.file >= 0).all())
        columns: list[list] = []

        def field(column: Any, text: list[str] | None = None) -> str:
            if column.min() == column.max() and (text is None or stored):
                return (str(int(column[0])) if text is None else text[0]).replace("%", "%%")
            columns.append(column.tolist() if text is None else text)
            return "%s"

        file_texts = {} if file_texts is None else file_texts
        if (files := file_texts.get(table.files)) is None:
            files = file_texts[table.files] = [json.dumps(name) for name in table.files] + ["null"]
        file_text = [files[i] for i in table.file.tolist()] if len(table.files) > 1 or not stored else files[:1]
        nulls = [] if stored else (table.file < 0).tolist()
        # fields in the order of the row: `columns` fills in that order
        offsets = ", ".join([field(c) for c in table.offsets.T])
        sizes = ", ".join([field(c) for c in table.sizes.T])
        file = field(table.file, file_text)
        offset, length = (field(c) if stored else field(c, ["null" if n else str(v) for v, n in zip(c.tolist(), nulls)])
                          for c in (table.blob_offset, table.blob_length))
        row = (f'{{"offsets": [{offsets}], "sizes": [{sizes}], "file": {file}, "offset": {offset}, "length": {length}, '
               f'"bytes": {field(self.chunks.nbytes)}}}')
        if not columns:  # every row the same (duplicate chunks)
            return "[" + ", ".join([row.replace("%%", "%")] * len(table)) + "]"
        return "[" + ", ".join(map(row.__mod__, zip(*columns))) + "]"


def chunk_table(tensor: TensorInfo, names: dict[tuple[str, ...], list[str]]) -> list[str]:
    """Return the `--chunks` table of one tensor: `table` of its chunks, from the columns of a
    ChunkTable (cells made once per column, not per chunk object; `names` keeps each table's
    file names as shown, for the next table)."""
    headers = ("OFFSETS", "SIZES", "FILE", "AT", "LENGTH")
    if not isinstance(tensor.chunks, ChunkInfos):
        rows = [(list(c.offsets), list(c.sizes), c.file, c.offset, c.length) for c in tensor.chunks]
        return table(rows, headers, {3, 4})
    chunks = tensor.chunks.table
    if (files := names.get(chunks.files)) is None:
        files = names[chunks.files] = [shown(name) for name in chunks.files] + ["None"]
    stored = (chunks.file >= 0).tolist()
    columns = [list(map(str, chunks.offsets.tolist())), list(map(str, chunks.sizes.tolist())),
               [files[i] for i in chunks.file.tolist()],
               [str(v) if s else "None" for v, s in zip(chunks.blob_offset.tolist(), stored)],
               [str(v) if s else "None" for v, s in zip(chunks.blob_length.tolist(), stored)]]
    widths = [max([len(h)] + [len(cell) for cell in column]) for h, column in zip(headers, columns)]
    line = "  ".join(f"%{'' if i in (3, 4) else '-'}{w}s" for i, w in enumerate(widths))
    # the last column is right-aligned and never empty: no line has trailing blanks to strip
    return [line % headers] + list(map(line.__mod__, zip(*columns)))
