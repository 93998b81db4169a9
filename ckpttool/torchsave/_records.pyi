# Type stub of the optional C builder of torch.save records (_records.c, built by setup.py when a compiler is there).
from typing import Any, Sequence

def assemble(out: Any, source: Any, kinds: Sequence[int], positions: Sequence[int], layouts: tuple[Any, ...],
             first: int, limit: int) -> tuple[int, int]:
    """Records end to end into `out` (see _records.c and torchsave.assembly.assemble)."""

def spans(files: Sequence[str], offsets: Sequence[int], kinds: Sequence[int], lengths: Sequence[int], read_gap: int,
          read_span: int, gap_budget: int) -> tuple[list[tuple[str, int, int]], list[int], list[int]]:
    """record_writes.source_spans over a Records operation's columns (see _records.c)."""

def match(block: Any, starts: Any, runs: list[tuple[int, int, Any, Any]]) -> bytes:
    """Which records of `block` hold a parsed layout's words (record.ParsedRecords.match_block)."""

def encode_rows(spec: list[Any], rows: int, starts: Any) -> bytes:
    """`.metadata` rows from int64 columns (see _records.c and dcp.writer.encoded_rows); `starts`
    (a writable int64 array of rows + 1, or None) gets where each row starts."""

def serialization_id_of(packed_crcs: Any) -> bytes:
    """archive.serialization_id_of in C."""
