"""`inspect`'s output: the human view of an InspectReport and its `ckpttool.inspect/1` JSON
document (schema documented in README.md; fields are only ever added within a version).

A tensor read as a ChunkTable keeps its chunks as columns to the end: `chunk_tables` writes
its `--chunks` lines and its JSON `chunks` from them.

Example:
    >>> print(inspect_text(inspect("fixtures/fsdp2_world3_uneven")).splitlines()[2])
      58 tensors in 142 chunks, 14 other entries; 10.3 kB of tensor data in 3 files (249.2 kB on disk) ...
"""

from __future__ import annotations

from typing import Any

from ckpttool.core.checkpoint import paused_gc
from ckpttool.commands.inspect import GROUPS, ChunkInfos, InspectReport, QuantizationInfo, TensorInfo
from ckpttool.render.chunk_tables import ChunkRows, chunk_table
from ckpttool.render.lora import adapter_lines, adapters_document
from ckpttool.render.text import human_bytes, human_count, model_view_document, shown, table

INSPECT_SCHEMA = "ckpttool.inspect/1"


def inspect_document(report: InspectReport) -> dict[str, Any]:
    """Return the `ckpttool.inspect/1` JSON document of a report."""
    s = report.summary
    with paused_gc():  # one small dict per chunk: 100k+ of them, none in a cycle
        return {
            "schema": INSPECT_SCHEMA,
            "path": str(report.path),
            "layout": report.layout,
            "found": report.found,
            "notes": list(report.notes),
            "summary": {
                "dcp_version": s.dcp_version, "metadata_file": s.metadata_file,
                "tensors": s.tensors, "objects": s.objects, "chunks": s.chunks,
                "tensor_bytes": s.tensor_bytes, "file_bytes": s.file_bytes, "files": s.files,
                "ranks": list(s.ranks), "parameters": s.parameters,
            },
            "model_view": model_view_document(report.model_view),
            "adapters": adapters_document(report),
            "quantization": quantization_document(report.quantization),
            "family": {"name": report.family, "architectures": list(report.architectures),
                       "named_by": {"architecture": report.named_by[0], "config": report.named_by[1]}
                       if report.named_by else None} if report.family else None,
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
    if layout in ("dcp", "torchtitan", "accelerate", "lightning", "megatron-torch-dist", "olmo-core", "nemo2",
                  "megatron-fsdp-dtensor", "megatron-torch-dcp"):  # torch DCP inside
        return f"DCP {version or 'unversioned'}"
    return layout


def inspect_text(report: InspectReport, chunks: bool = False, by_file: bool = False) -> str:
    """Return the human view of an inspect report."""
    s = report.summary
    ranks = f"ranks {s.ranks[0]}..{s.ranks[-1]}" if len(s.ranks) > 1 else f"rank {s.ranks[0]}" if s.ranks else "no ranks"
    lines = [
        f"{report.path}  ({_format_name(report.layout, s.dcp_version)}, {s.metadata_file})",
        f"  layout: {report.layout}",
        *([f"  found: {shown(report.found)}"] if report.found else []),
        *(f"  note: {shown(note)}" for note in report.notes),
        f"  {s.tensors} tensors in {s.chunks} chunks, {s.objects} other entries; "
        f"{human_bytes(s.tensor_bytes)} of tensor data in {s.files} files ({human_bytes(s.file_bytes)} on disk) from {ranks}",
        f"  model parameters: {human_count(s.parameters)} ({s.parameters:,})",
    ]
    if report.model_view is not None:
        lines.append(f"  model: {report.model_view.describe()}")
    lines += adapter_lines(report)
    lines += quantization_lines(report.quantization)
    if report.family and report.named_by:
        lines.append(f"  names: {report.family}'s, not transformers'; `ckpttool export` writes them as {report.named_by[0]} "
                     f"names (the config: {report.named_by[1]}; `--json`: each tensor's `hf_names`)")
    elif report.family:
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
                lines += ["      " + line for line in chunk_table(t, names)]
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
