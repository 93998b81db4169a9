"""Human tables and stable `--json` documents for command reports.

JSON documents carry a `schema` name with a version; fields are only ever added within a
version. The schemas are documented in README.md.
"""

from __future__ import annotations

import json
import os
import re
import sys
import uuid
from pathlib import Path
from typing import AbstractSet, Any, Iterable, Iterator, TextIO

from ckpttool import render_lora
from ckpttool.checkpoint import paused_gc
from ckpttool.commands.consolidate import ConsolidateReport
from ckpttool.commands.inspect import GROUPS, ChunkInfos, InspectReport, QuantizationInfo, TensorInfo
from ckpttool.commands.reshard import ReshardReport
from ckpttool.commands.validate import ValidationReport
from ckpttool.integrity import Problem

INSPECT_SCHEMA = "ckpttool.inspect/1"
VALIDATE_SCHEMA = "ckpttool.validate/1"
CONSOLIDATE_SCHEMA = "ckpttool.consolidate/1"
RESHARD_SCHEMA = "ckpttool.reshard/1"


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


def emit_json(document: dict[str, Any], out: TextIO | None = None) -> None:
    """Write one JSON document on one line (stdout by default); pipe to `jq` to read it.

    `json.dumps` without indent uses the C encoder (`json.dump` to a stream does not):
    100k chunks encode in 0.2 s instead of 4 s. The chunks of a ChunkTable (`ChunkRows` in an
    inspect document) are written straight from its columns, tensor by tensor, in place of a
    placeholder: the same bytes as encoding their dicts, without building them.
    """
    out = out or sys.stdout
    rows: list[ChunkRows] = []
    tensors = document.get("tensors")
    if isinstance(tensors, list) and any(isinstance(t, dict) and isinstance(t.get("chunks"), ChunkRows) for t in tensors):
        marker = f"\x00ckpttool chunks {uuid.uuid4().hex} "

        def placeholder(tensor: Any) -> Any:
            if not (isinstance(tensor, dict) and isinstance(tensor.get("chunks"), ChunkRows)):
                return tensor
            rows.append(tensor["chunks"])
            return {**tensor, "chunks": f"{marker}{len(rows) - 1}"}

        document = {**document, "tensors": [placeholder(t) for t in tensors]}
    text = json.dumps(document)
    if rows:
        parts = re.split(re.escape(json.dumps(marker)[:-1]) + r'(\d+)"', text)
        file_texts: dict[tuple[str, ...], list[str]] = {}  # tables mostly share their files
        for at in range(0, len(parts) - 1, 2):
            out.write(parts[at])
            out.write(rows[int(parts[at + 1])].json_text(file_texts))
        text = parts[-1]
    out.write(text)
    out.write("\n")


class ChunkRows(list):
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

    __hash__ = None

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


def table(rows: Iterable[tuple], headers: tuple[str, ...], right: AbstractSet[int] = frozenset()) -> list[str]:
    """Return aligned text lines; columns in `right` are right-aligned."""
    shown_rows = [tuple(shown(c) for c in row) for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in shown_rows]) for i, h in enumerate(headers)]

    def line(cells: tuple[str, ...]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    return [line(headers)] + [line(r) for r in shown_rows]


def inspect_document(report: InspectReport) -> dict[str, Any]:
    """Return the `ckpttool.inspect/1` JSON document of a report."""
    s = report.summary
    with paused_gc():  # one small dict per chunk: 100k+ of them, none in a cycle
        return {
            "schema": INSPECT_SCHEMA,
            "path": str(report.path),
            "layout": report.layout,
            "summary": {
                "dcp_version": s.dcp_version, "metadata_file": s.metadata_file,
                "tensors": s.tensors, "objects": s.objects, "chunks": s.chunks,
                "tensor_bytes": s.tensor_bytes, "file_bytes": s.file_bytes, "files": s.files,
                "ranks": list(s.ranks), "parameters": s.parameters,
            },
            "model_view": model_view_document(report.model_view),
            "adapters": render_lora.adapters_document(report),
            "quantization": quantization_document(report.quantization),
            "family": {"name": report.family, "architectures": list(report.architectures)} if report.family else None,
            "groups": {
                name: {"tensors": g.tensors, "objects": g.objects, "numel": g.numel, "bytes": g.nbytes}
                for name, g in report.groups.items()
            },
            "filters": list(report.filters),
            "tensors": [_tensor_document(t, report.hf_names) for t in report.tensors],
            "objects": [{"fqn": o.fqn, "group": o.group, "file": o.file, "length": o.length} for o in report.objects],
            "files": [
                {"file": f.file, "rank": f.rank, "size": f.size, "referenced_bytes": f.referenced_bytes,
                 "tensor_bytes": {g: f.tensor_bytes.get(g, 0) for g in GROUPS}}
                for f in report.files
            ],
        }


def quantization_document(info: QuantizationInfo | None) -> dict[str, Any] | None:
    """Return inspect's `quantization` object (None: the model holds no quantised weights)."""
    if info is None:
        return None
    return {"scheme": info.scheme, "layouts": list(info.layouts), "block_size": list(info.block) if info.block else None,
            "quantized_tensors": info.weights, "packed_bytes": info.packed_bytes, "scale_bytes": info.scale_bytes,
            "dequantized_parameters": info.parameters, "problems": list(info.problems)}


def quantization_lines(info: QuantizationInfo | None) -> list[str]:
    """Return inspect's lines on the model's quantised weights."""
    if info is None:
        return []
    kinds = {"fp8-block": f"{info.block[0]}x{info.block[1]} blocks" if info.block else "blocks",
             "fp8-tensor": "per-tensor scales", "fp8-channel": "per-channel scales", "mxfp4": "groups of 32"}
    how = ", ".join(kinds.get(layout, layout) for layout in info.layouts) or "no weights recognised"
    count = f"{info.weights} weight{'s' if info.weights != 1 else ''}"
    lines = [f"  quantized: {info.scheme}, {how}: {count} in {human_bytes(info.packed_bytes)} "
             f"({human_bytes(info.scale_bytes)} of scales); `--dtype bf16` dequantizes them"]
    lines += [f"  quantization problem: {shown(problem)}" for problem in info.problems[:5]]
    if len(info.problems) > 5:
        lines.append(f"  ... and {len(info.problems) - 5} more (`ckpttool validate` lists them)")
    return lines


def _tensor_document(tensor: TensorInfo, hf_names: dict[str, tuple[str, ...]] | None = None) -> dict[str, Any]:
    document = {
        "fqn": tensor.fqn, "group": tensor.group, "dtype": tensor.dtype, "shape": list(tensor.shape),
        "numel": tensor.numel, "bytes": tensor.nbytes,
        "sharding": tensor.sharding.kind, "uneven": tensor.sharding.uneven,
        "empty_chunks": tensor.sharding.empty_chunks, "chunk_count": len(tensor.chunks),
        "chunks": ChunkRows(tensor.chunks) if isinstance(tensor.chunks, ChunkInfos) else [
            {"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file, "offset": c.offset,
             "length": c.length, "bytes": c.nbytes}
            for c in tensor.chunks
        ],
    }
    if hf_names is not None:
        document["hf_names"] = list(hf_names.get(tensor.fqn, ()))
    return document


def _format_name(layout: str, version: str | None) -> str:
    if layout in ("dcp", "torchtitan", "accelerate", "lightning", "megatron-torch-dist", "olmo-core"):  # torch DCP inside
        return f"DCP {version or 'unversioned'}"
    return layout


def inspect_text(report: InspectReport, chunks: bool = False, by_file: bool = False) -> str:
    """Return the human view of an inspect report."""
    s = report.summary
    ranks = f"ranks {s.ranks[0]}..{s.ranks[-1]}" if len(s.ranks) > 1 else f"rank {s.ranks[0]}" if s.ranks else "no ranks"
    lines = [
        f"{report.path}  ({_format_name(report.layout, s.dcp_version)}, {s.metadata_file})",
        f"  layout: {report.layout}",
        f"  {s.tensors} tensors in {s.chunks} chunks, {s.objects} other entries; "
        f"{human_bytes(s.tensor_bytes)} of tensor data in {s.files} files ({human_bytes(s.file_bytes)} on disk) from {ranks}",
        f"  model parameters: {human_count(s.parameters)} ({s.parameters:,})",
    ]
    if report.model_view is not None:
        lines.append(f"  model: {report.model_view.describe()}")
    lines += render_lora.adapter_lines(report)
    lines += quantization_lines(report.quantization)
    if report.family:
        lines.append(f"  names: {report.family}'s, not transformers'; `ckpttool export --assets DIR` writes them as "
                     f"{' or '.join(report.architectures)} names (`--json`: each tensor's `hf_names`)")
    if report.filters:
        lines.append(f"  showing entries matching {', '.join(report.filters)}")
    for group in GROUPS:
        members = [t for t in report.tensors if t.group == group]
        objects = [o for o in report.objects if o.group == group]
        if not members and not objects:
            continue
        info = report.groups[group]
        lines += ["", f"{group}: {info.tensors} tensors, {human_count(info.numel)} elements, {human_bytes(info.nbytes)}"
                  + (f", {info.objects} other entries" if info.objects else "")]
        rows = [
            (t.fqn, t.dtype, "x".join(map(str, t.shape)) or "scalar", len(t.chunks), str(t.sharding), human_bytes(t.nbytes))
            for t in members
        ]
        if rows:
            lines += ["  " + line for line in table(rows, ("TENSOR", "DTYPE", "SHAPE", "CHUNKS", "SHARDING", "BYTES"), {3, 5})]
        if chunks:
            names: dict[tuple[str, ...], list[str]] = {}  # tables mostly share their files
            for t in members:
                lines.append(f"  {shown(t.fqn)}:")
                lines += ["      " + line for line in _chunk_table(t, names)]
        if objects:
            lines.append("  other: " + ", ".join(shown(o.fqn) for o in objects[:8]) + (" ..." if len(objects) > 8 else ""))
    if by_file:
        file_rows = [
            (f.file, "" if f.rank is None else f.rank, human_bytes(f.size) if f.size is not None else "MISSING",
             human_bytes(f.tensor_bytes.get("model", 0)), human_bytes(f.tensor_bytes.get("optimizer", 0)),
             human_bytes(f.tensor_bytes.get("other", 0)))
            for f in report.files
        ]
        headers = ("FILE", "RANK", "SIZE", "MODEL", "OPTIMIZER", "OTHER")
        lines += ["", "files:"] + ["  " + line for line in table(file_rows, headers, {1, 2, 3, 4, 5})]
    return "\n".join(lines)


def _chunk_table(tensor: TensorInfo, names: dict[tuple[str, ...], list[str]]) -> list[str]:
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


def problems_document(problems: Iterable[Problem]) -> list[dict[str, Any]]:
    """Return problems as the JSON list every document shares."""
    return [
        {"severity": p.severity, "code": p.code, "file": p.file, "fqn": p.fqn, "message": p.message}
        for p in problems
    ]


def problem_lines(problems: Iterable[Problem]) -> list[str]:
    """Return one `severity: [code] message` line per problem (warnings of a write go to stderr)."""
    return [f"{p.severity}: [{p.code}] {shown(p.message)}" for p in problems]


def validate_document(report: ValidationReport) -> dict[str, Any]:
    """Return the `ckpttool.validate/1` JSON document of a report."""
    return {
        "schema": VALIDATE_SCHEMA,
        "path": str(report.path),
        "valid": report.valid,
        "deep": report.deep,
        "errors": len(report.errors),
        "warnings": len(report.warnings),
        "checked": {"tensors": report.tensors, "chunks": report.chunks, "objects": report.objects,
                    "files": report.files, "bytes_read": report.bytes_read},
        "seconds": round(report.seconds, 3),
        "problems": problems_document(report.problems),
        "numerics": [{"fqn": n.fqn, "nan": n.nan, "inf": n.inf} for n in report.numerics],
        **({"manifest": manifest_check_document(report.manifest)} if getattr(report, "manifest", None) else {}),
    }


def validate_text(report: ValidationReport) -> str:
    """Return the human view of a validation report."""
    lines = problem_lines(report.problems)
    checked = f"{report.tensors} tensors, {report.chunks} chunks, {report.objects} other entries in {report.files} files"
    depth = f", {human_bytes(report.bytes_read)} read and checksummed" if report.deep else " (metadata and file sizes; --deep reads every byte)"
    verdict = "VALID" if report.valid else f"INVALID: {len(report.errors)} error(s)"
    warnings = f", {len(report.warnings)} warning(s)" if report.warnings else ""
    lines.append(f"{verdict}{warnings}: {report.path}: {checked}{depth}, {report.seconds:.2f} s")
    if getattr(report, "manifest", None) is not None:  # validate --manifest (issue 34)
        check_lines = manifest_check_text(report.manifest, limit=1).splitlines()
        lines += ["  " + line.strip() for line in check_lines if line is check_lines[0] or line.lstrip().startswith("tied:")]
    return "\n".join(lines)


def consolidate_document(report: ConsolidateReport) -> dict[str, Any]:
    """Return the `ckpttool.consolidate/1` JSON document: what was (or would be) written."""
    plan = report.plan
    return {
        "schema": CONSOLIDATE_SCHEMA,
        "source": str(report.source),
        "output": str(report.output),
        "format": plan.format,
        "layout": report.layout,
        "selected": report.selected,
        "model_view": model_view_document(report.model_view),
        "dry_run": report.dry_run,
        "verified": report.verified,
        "files": [
            {"file": f.name, "path": str(_output_path(report, f.name)), "bytes": f.size, "tensors": len(f.keys)}
            for f in plan.files
        ] + ([{"file": plan.index_name, "path": str(report.output / plan.index_name), "bytes": len(plan.index),
               "tensors": 0}] if plan.index_name and plan.index is not None else []),
        "tensors": [
            {"key": t.key, "fqn": t.fqn, "dtype": t.dtype, "source_dtype": t.source_dtype, "shape": list(t.shape),
             "file": t.file, "bytes": t.nbytes}
            for t in plan.tensors
        ],
        "objects": [{"key": o.key, "fqn": o.fqn} for o in plan.objects],
        "ties": [{"kept": t.kept, "dropped": t.dropped, "written": t.dropped not in report.dropped} for t in report.ties],
        "tensor_bytes": plan.tensor_bytes,
        "output_bytes": plan.output_bytes,
        "seconds": round(report.seconds, 3),
        "requests": report.requests,
        "merged_adapter": report.merged or None,
        "quantization": report.quantization or None,
        "problems": problems_document(report.problems),
        "processes": processes_document(report.processes),
    }


def model_view_document(view) -> dict[str, Any] | None:
    """Return where the model was found and why: `{"prefix", "selected", "reason", "candidates"}`."""
    if view is None:
        return None
    return {"prefix": view.prefix, "selected": view.selected, "reason": view.reason,
            "candidates": list(view.candidates)}


def processes_document(processes) -> list[dict[str, Any]]:
    """Return one entry per process that wrote (several under torchrun): rank, bytes, seconds."""
    return [{"rank": p.rank, "bytes": p.bytes, "seconds": round(p.seconds, 3)} for p in processes]


def processes_line(processes) -> str:
    """Return the text line showing the torchrun split ('' for a single process)."""
    if len(processes) < 2:
        return ""
    shares = ", ".join(f"rank {p.rank} {human_bytes(p.bytes)} in {p.seconds:.2f} s" for p in processes)
    return f"\n  {len(processes)} processes: {shares}"


def _output_path(report: ConsolidateReport, name: str):
    # a single-file output is OUT itself; shards (and their index) go inside the OUT directory
    return report.output if name == report.output.name and not report.plan.index_name else report.output / name


def consolidate_text(report: ConsolidateReport) -> str:
    """Return the human view: the plan for a dry run, else one summary line."""
    if report.dry_run:
        return _consolidate_plan_text(report)
    what = f"{report.tensors} tensors" + (f" and {report.objects} objects" if report.objects else "")
    checked = ", verified" if report.verified else ""
    return (
        f"wrote {what}, {human_bytes(report.tensor_bytes)} to {report.output} in {report.seconds:.2f} s "
        f"({human_bytes(int(report.throughput))}/s{checked})\n"
        f"  {_selection_line(report)}{processes_line(report.processes)}"
    )


def _selection_line(report: ConsolidateReport) -> str:
    return f"read {shown(report.layout)}; exported {report.selected}"


def consolidate_notes(report: ConsolidateReport) -> list[str]:
    """Return the lines for stderr: gate warnings and one line per tied pair found."""
    lines = problem_lines(report.problems)
    for tie in report.ties:
        action = "dropped" if tie.dropped in report.dropped else "both written (--drop-tied keeps one)"
        lines.append(f"tied: {shown(tie.dropped)} is the same tensor as {shown(tie.kept)}: {shown(tie.dropped)} {action}")
    return lines + ([report.merged] if report.merged else []) + ([report.quantization] if report.quantization else [])


def _consolidate_plan_text(report: ConsolidateReport) -> str:
    plan = report.plan
    rows = []
    for tensor in plan.tensors:
        dtype = tensor.dtype if tensor.dtype == tensor.source_dtype else f"{tensor.source_dtype}->{tensor.dtype}"
        shape = "x".join(map(str, tensor.shape)) or "scalar"
        rows.append((tensor.key, tensor.fqn, dtype, shape, tensor.file))
    for item in plan.objects:
        rows.append((item.key, item.fqn, "object", "", plan.files[0].name))
    lines = [
        f"{report.source} -> {report.output} ({plan.format}, {len(plan.files)} file(s)"
        f"{', index ' + plan.index_name if plan.index_name else ''}): {len(plan.tensors)} tensors, "
        f"{len(plan.objects)} objects, {human_bytes(plan.tensor_bytes)}",
        _selection_line(report),
        *table(rows, ("KEY", "FROM", "DTYPE", "SHAPE", "FILE")),
        "dry run: nothing was written",
    ]
    return "\n".join(lines)


RULE_TEXT = {
    "source": "sharded as in the source; single-chunk tensors sharded only if they have optimizer state",
    "optimizer-state": "single-rank source: tensors with optimizer state (and that state) sharded, the rest whole",
    "every-tensor": "single-rank source without optimizer state: every tensor of 1+ dims sharded along dim 0",
}


def default_destination_line(report: ReshardReport) -> str:
    """The stderr line saying where reshard writes when no DST was given."""
    where = report.destination if not isinstance(report.destination, Path) else os.path.relpath(report.destination)
    return f"no DST given: {'would write' if report.dry_run else 'writing'} {shown(where)} (SRC-world{report.world_size} beside SRC)"


def reshard_document(report: ReshardReport) -> dict[str, Any]:
    """Return the `ckpttool.reshard/1` JSON document: what was (or would be) written."""
    plan = report.plan
    return {
        "schema": RESHARD_SCHEMA,
        "source": str(report.source),
        "destination": str(report.destination),
        "world_size": plan.world_size,
        "mesh": {"replicas": plan.mesh.replicas, "shards": plan.mesh.shards},
        "rule": plan.rule,
        "model_view": model_view_document(report.model_view),
        "keep_whole": list(plan.keep_whole),
        "dry_run": report.dry_run,
        "verified": report.verified,
        "files": [
            {"rank": f.rank, "file": f.name, "chunks": len(f.chunks), "tensors": f.tensors, "objects": len(f.objects),
             "tensor_bytes": f.nbytes}
            for f in plan.files
        ],
        "tensors": [
            {"fqn": t.fqn, "dtype": t.dtype, "shape": list(t.shape), "sharded": t.sharded, "chunks": len(t.chunks)}
            for t in plan.tensors
        ],
        "tensor_bytes": report.tensor_bytes,
        "file_bytes": report.file_bytes,
        "seconds": round(report.seconds, 3),
        "requests": report.requests,
        "problems": problems_document(report.problems),
        "processes": processes_document(report.processes),
    }


def reshard_text(report: ReshardReport) -> str:
    """Return the human view: the plan per target rank for a dry run, else one summary line."""
    plan = report.plan
    sharded = sum(t.sharded for t in plan.tensors)
    if not report.dry_run:
        checked = ", verified" if report.verified else ""
        return (
            f"wrote {report.destination}: {report.world_size} ranks (mesh {plan.mesh}), "
            f"{len(plan.tensors)} tensors ({sharded} sharded), {report.tensor_bytes} bytes of tensor data in "
            f"{report.seconds:.2f} s{checked}{processes_line(report.processes)}"
        )
    lines = [
        f"reshard to {plan.world_size} ranks (mesh {plan.mesh}): {len(plan.tensors)} tensors "
        f"({sharded} sharded, {len(plan.tensors) - sharded} whole), {plan.nbytes} bytes of tensor data",
        f"  rule: {plan.rule} ({RULE_TEXT[plan.rule]})"
        + (f"; kept whole: {', '.join(plan.keep_whole)}" if plan.keep_whole else ""),
    ]
    for f in plan.files:
        lines.append(
            f"  rank {f.rank:>3}  {f.name}: {len(f.chunks)} chunks of {f.tensors} tensors, "
            f"{f.nbytes} bytes, {len(f.objects)} objects"
        )
    whole = [shown(t.fqn) for t in plan.tensors if not t.sharded and t.shape]
    if whole:
        lines.append(f"  whole: {', '.join(whole[:8])}{' ...' if len(whole) > 8 else ''}")
    lines.append(f"(dry run: nothing written to {report.destination})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# diff

from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:  # the diff module brings numpy; only the diff command pays for its import
    from ckpttool.commands.diff import DiffReport, TensorDiff

DIFF_SCHEMA = "ckpttool.diff/1"


def _json_number(value: float | None) -> float | str | None:
    # JSON has no Inf/NaN: they are spelled "inf", "-inf", "nan"
    if value is None or value == value and abs(value) != float("inf"):
        return value
    return "nan" if value != value else "inf" if value > 0 else "-inf"


def diff_document(report: "DiffReport") -> dict[str, Any]:
    """Return the `ckpttool.diff/1` JSON document: every entry of either side and how it compares."""
    def only(entries) -> list[dict[str, Any]]:
        return [{"key": o.key, "fqn": o.fqn, "kind": o.kind, "dtype": o.dtype,
                 "shape": None if o.shape is None else list(o.shape)} for o in entries]

    return {
        "schema": DIFF_SCHEMA,
        "a": str(report.a),
        "b": str(report.b),
        "verdict": report.verdict,
        "same": report.same,
        "normalize": report.normalize,
        "only": list(report.only),
        "filters": list(report.filters),
        "atol": report.atol,
        "rtol": report.rtol,
        "summary": {
            "tensors": len(report.tensors), "equal": sum(t.status == "equal" for t in report.tensors),
            "close": len(report.close), "different": len(report.different),
            "objects": len(report.objects), "objects_different": len(report.different_objects),
            "only_a": len(report.only_a), "only_b": len(report.only_b), "mismatches": len(report.mismatches),
            "bytes_compared": report.bytes_compared, "bytes_shared": report.bytes_shared,
        },
        "only_a": only(report.only_a),
        "only_b": only(report.only_b),
        "mismatches": [{"key": m.key, "fqn_a": m.fqn_a, "fqn_b": m.fqn_b, "field": m.field, "a": m.a, "b": m.b}
                       for m in report.mismatches],
        "tensors": [
            {"key": t.key, "fqn_a": t.fqn_a, "fqn_b": t.fqn_b, "dtype": t.dtype, "shape": list(t.shape),
             "status": t.status, "numel": t.numel, "differing": t.differing,
             "first_index": None if t.first_index is None else list(t.first_index),
             "max_abs": _json_number(t.max_abs), "max_rel": _json_number(t.max_rel), "non_finite": t.non_finite}
            for t in report.tensors
        ],
        "objects": [{"key": o.key, "fqn_a": o.fqn_a, "fqn_b": o.fqn_b, "equal": o.equal, "a": o.a, "b": o.b}
                    for o in report.objects],
        "hint": report.hint,
        "model_views": report.model_views,
        "seconds": round(report.seconds, 3),
        "problems": [dict(entry, side=side) for side, problems in (("a", report.problems_a), ("b", report.problems_b))
                     for entry in problems_document(problems)],
    }


def _tensor_difference(t: "TensorDiff") -> str:
    text = f"{t.differing} of {t.numel} elements"
    if t.first_index is not None:
        text += f" (first at {list(t.first_index)})"
    if t.max_abs is not None:
        text += f", max abs {t.max_abs:.6g}, max rel {t.max_rel:.6g}"
    if t.non_finite:
        text += f", {t.non_finite} NaN/Inf"
    return text


def diff_text(report: "DiffReport", limit: int = 20) -> str:
    """Return the human view: a one-line verdict, then the differing entries (at most `limit`,
    0 for all)."""
    sides = f"{shown(report.a)} and {shown(report.b)}"
    compared = human_bytes(report.bytes_compared + report.bytes_shared)
    equal = sum(t.status == "equal" for t in report.tensors)
    if report.verdict == "identical":
        lines = [f"IDENTICAL: {sides}: {len(report.tensors)} tensors ({compared}) and {len(report.objects)} "
                 "objects, byte for byte"]
    elif report.verdict == "within-tolerance":
        lines = [f"WITHIN TOLERANCE (atol {report.atol or 0}, rtol {report.rtol or 0}): {sides}: "
                 f"{len(report.close)} of {len(report.tensors)} tensors differ within it, {equal} identical "
                 f"({compared}); {len(report.objects)} objects equal"]
    else:
        lines = [f"DIFFERENT: {sides}: {len(report.different)} of {len(report.tensors)} tensors differ"
                 + (f" ({len(report.close)} more within tolerance)" if report.close else "")
                 + f", {len(report.mismatches)} dtype/shape changes, {len(report.only_a)} only in A, "
                 f"{len(report.only_b)} only in B, {len(report.different_objects)} of {len(report.objects)} "
                 f"objects differ ({compared} compared)"]
    items = [f"only in A: {shown(o.key)}" + (f" ({shown(o.fqn)})" if o.fqn != o.key else "") for o in report.only_a]
    items += [f"only in B: {shown(o.key)}" + (f" ({shown(o.fqn)})" if o.fqn != o.key else "") for o in report.only_b]
    items += [f"{m.field} differs: {shown(m.key)}: {shown(m.a)} -> {shown(m.b)}" for m in report.mismatches]
    items += [f"{'differs' if t.status == 'different' else 'close'}: {shown(t.key)}: {_tensor_difference(t)}"
              for t in report.tensors if t.status != "equal"]
    items += [f"object differs: {shown(o.key)}: {shown(o.a)} -> {shown(o.b)}" for o in report.different_objects]
    shown_items = items if not limit else items[:limit]
    lines += ["  " + item for item in shown_items]
    if len(items) > len(shown_items):
        lines.append(f"  ... and {len(items) - len(shown_items)} more (--limit 0 lists all; --json has every entry)")
    if report.model_views:
        lines.insert(1, f"  {shown(report.model_views)}")
    if report.hint:
        lines.append(f"hint: {shown(report.hint)}")
    return "\n".join(lines)


def diff_notes(report: "DiffReport") -> list[str]:
    """Return the gate's warnings of each side, for stderr."""
    return [f"A: {line}" for line in problem_lines(report.problems_a)] + \
        [f"B: {line}" for line in problem_lines(report.problems_b)]


# ---------------------------------------------------------------------------------------------
# manifest (issue 34): `ckpttool manifest`, `validate --manifest`, `diff SRC FILE.json`

MANIFEST_CHECK_SCHEMA = "ckpttool.manifest-check/1"


def manifest_text(report: Any) -> str:
    """Return the summary of `ckpttool manifest`: what was hashed, how fast, the fingerprint."""
    made = report.manifest
    where = f"wrote {shown(report.output)}: " if report.output is not None else ""
    files = f" and {len(made.files)} data files" if made.files is not None else ""
    speed = f", {human_bytes(int(report.throughput))}/s" if report.seconds > 0 else ""
    return (f"{where}manifest of {len(made.tensors)} tensors{files} ({made.entries}) of {shown(report.source)}: "
            f"{human_bytes(report.bytes_hashed)} hashed in {report.seconds:.2f} s{speed}\n  digest {made.digest}")


def _difference_line(difference: Any) -> str:
    if difference.kind == "missing":
        return f"missing: {shown(difference.key)} (the manifest has {difference.expected})"
    if difference.kind == "extra":
        return f"extra: {shown(difference.key)} ({difference.actual}; not in the manifest)"
    if difference.kind == "sha256":
        return f"differs: {shown(difference.key)}: sha256 {difference.actual[:16]}..., the manifest says {difference.expected[:16]}..."
    return f"{difference.kind} differs: {shown(difference.key)}: {difference.actual}, the manifest says {difference.expected}"


def manifest_check_text(check: Any, limit: int = 20) -> str:
    """Return the human view of a manifest check: a verdict naming the first difference, then
    the differences (at most `limit`, 0 for all) and the tied keys one side leaves out."""
    sides = f"{shown(check.source)} against the manifest {shown(check.expected_from)}"
    if check.same:
        lines = [f"MATCHES: {sides}: {len(check.expected.tensors)} tensors, {check.expected.digest}"]
    else:
        lines = [f"DIFFERENT: {sides}: {len(check.differences)} difference(s), first: {_difference_line(check.first)}"]
    items = [_difference_line(d) for d in check.differences]
    shown_items = items if not limit else items[:limit]
    lines += ["  " + item for item in shown_items]
    if len(items) > len(shown_items):
        lines.append(f"  ... and {len(items) - len(shown_items)} more (--limit 0 lists all; --json has every entry)")
    lines += [f"  tied: {shown(t.key)} is not in the {t.absent}; its bytes are {shown(t.same_as)}'s" for t in check.ties]
    return "\n".join(lines)


def manifest_check_document(check: Any) -> dict[str, Any]:
    """Return the `ckpttool.manifest-check/1` JSON document of a manifest check."""
    return {
        "schema": MANIFEST_CHECK_SCHEMA,
        "source": str(check.source),
        "manifest": str(check.expected_from),
        "same": check.same,
        "expected_digest": check.expected.digest,
        "actual_digest": check.actual.digest,
        "tensors": len(check.expected.tensors),
        "differences": [{"key": d.key, "kind": d.kind, "expected": d.expected, "actual": d.actual}
                        for d in check.differences],
        "ties": [{"key": t.key, "same_as": t.same_as, "absent_from": t.absent} for t in check.ties],
        "bytes_hashed": check.bytes_hashed,
        "seconds": round(check.seconds, 3),
        "problems": problems_document(check.problems),
    }
# --- end of manifest ----------------------------------------------------------------------------
