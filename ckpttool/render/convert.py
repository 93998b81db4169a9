"""The output of the commands that write a checkpoint in another shape: `consolidate` (one
state dict, or Hub-style shards) and `reshard` (another world size): the plan of a dry run
or one summary line, the notes for stderr, and the `ckpttool.consolidate/1` and
`ckpttool.reshard/1` JSON documents.

Example:
    >>> dry_run = reshard("fixtures/fsdp2_world3_uneven", "w4", 4, write=WriteOptions(dry_run=True))
    >>> print(reshard_text(dry_run).splitlines()[0])
    reshard to 4 ranks (mesh 4): 58 tensors (42 sharded, 16 whole), 10275 bytes of tensor data
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.render.text import human_bytes, model_view_document, problem_lines, problems_document, shown, table

if TYPE_CHECKING:
    from ckpttool.commands.consolidate import ConsolidateReport
    from ckpttool.commands.reshard import ReshardReport

CONSOLIDATE_SCHEMA = "ckpttool.consolidate/1"
RESHARD_SCHEMA = "ckpttool.reshard/1"


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
        "source_choice": report.source_choice or None,
        "left_out": [{"key": key, "rule": rule} for key, rule in report.left_out],
        "problems": problems_document(report.problems),
        "processes": processes_document(report.processes),
    }


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
    left_out = [f"left out {shown(key)}: {shown(rule)}" for key, rule in report.left_out]
    return (([report.source_choice] if report.source_choice else []) + lines + left_out
            + ([report.merged] if report.merged else []) + ([report.quantization] if report.quantization else []))


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
    "every-tensor": ("every tensor of 1+ dims sharded along dim 0, as fully_shard shards them (a single-rank source "
                     "without optimizer state, or a migration: --to transformers)"),
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
