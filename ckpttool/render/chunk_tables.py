"""A tensor's chunks read as a ChunkTable, rendered from the table's int64 columns: the
`--chunks` text (`chunk_table`, each cell made once per column) and the `chunks` list of
inspect's JSON (`ChunkRows`, written by the C reader's `json_rows`: 7M chunks are 900 MB of
JSON), instead of one object per chunk.

Example:
    >>> print("\n".join(chunk_table(report.tensors[0], {})))     # fixtures/fsdp2_world3_uneven, as tables
    OFFSETS  SIZES   FILE             AT  LENGTH
    [0, 0]   [5, 8]  __0_0.distcp   1577    1705
    [5, 0]   [5, 8]  __1_0.distcp   9463    1705
    [10, 0]  [3, 8]  __2_0.distcp  10088    1641
"""

from __future__ import annotations

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

    def json_text(self, file_texts: dict[int, tuple[tuple[str, ...], tuple[bytes, ...]]] | None = None) -> str:
        """Return `json.dumps(list(self))` (`json_blocks` joined, as text)."""
        return b"".join(self.json_blocks(file_texts)).decode("ascii")

    def json_blocks(self, file_texts: dict[int, tuple[tuple[str, ...], tuple[bytes, ...]]] | None = None) -> Iterator[bytes]:
        """Yield `json.dumps(list(self))` as ASCII bytes in pieces, written from the columns where
        they are by the C reader's `json_rows`, a block of rows at a time (no object per row, no
        copy of a column). `file_texts` keeps the JSON of each table's file names for the next
        table."""
        import json  # on use: `--chunks` as text never loads the encoder

        table = self.chunks.table
        if not len(table):
            yield b"[]"
            return
        try:
            from ckpttool.readers._dcpscan import json_rows
        except ImportError:  # not built (no compiler at install): no .metadata is read into a table either
            yield json.dumps(list(self)).encode("ascii")
            return
        file_texts = {} if file_texts is None else file_texts
        # by the tuple's id (the tuple kept beside its texts): hashing 10k names a table costs
        if (found := file_texts.get(id(table.files))) is None or found[0] is not table.files:
            found = file_texts[id(table.files)] = (table.files, tuple(json.dumps(name).encode() for name in table.files))
        files, ndim, count = found[1], table.offsets.shape[1], len(table)
        yield b"["
        for start in range(0, count, ROWS_PER_BLOCK):
            rows = slice(start, start + ROWS_PER_BLOCK)  # the whole table (views, no copies) when it is one block
            offsets, sizes, file, offset, length, nbytes = (
                column[rows] for column in
                (table.offsets, table.sizes, table.file, table.blob_offset, table.blob_length, self.chunks.nbytes))
            yield json_rows(len(file), ndim, offsets, sizes, file, offset, length, nbytes, files,
                            start + ROWS_PER_BLOCK >= count)
        yield b"]"


ROWS_PER_BLOCK = 1 << 16  # rows written at once: at most ~30 MB of text at 8 dims


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
