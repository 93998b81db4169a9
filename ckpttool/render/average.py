"""The output of `average`: the plan of a dry run or one summary line, the notes for stderr, and
the `ckpttool.average/1` JSON document.

Example:
    >>> print(average_text(average(["a", "b"], "avg.safetensors")).splitlines()[0])
    wrote the average of 2 checkpoints to avg.safetensors: 16 tensors (14 averaged, 2 copied), 4.3 kB in 0.10 s
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpttool.render.convert import processes_document, processes_line
from ckpttool.render.text import human_bytes, model_view_document, problems_document, shown, table

if TYPE_CHECKING:
    from ckpttool.commands.average import AverageReport

AVERAGE_SCHEMA = "ckpttool.average/1"
FORMATS = {"safetensors": "safetensors", "torch": "torch.save", "dcp": "DCP"}


def average_document(report: AverageReport) -> dict[str, Any]:
    """Return the `ckpttool.average/1` JSON document: what was (or would be) written. Each
    weight is given as the float64 it is (`weight`) and its bits (`weight_bits`, 16 hex digits)."""
    from ckpttool.plan.average import float64_bits

    plan = report.plan
    return {
        "schema": AVERAGE_SCHEMA,
        "sources": [
            {"path": str(path), "weight": weight, "weight_bits": float64_bits(weight), "layout": layout,
             "selected": selected, "model_view": model_view_document(view)}
            for path, weight, layout, selected, view in zip(report.sources, report.weights, report.layouts,
                                                             report.selected, report.model_views)
        ],
        "output": str(report.output),
        "format": report.format,
        "world_size": report.world_size,
        "dry_run": report.dry_run,
        "verified": report.verified,
        "files": [str(path) for path in report.files],
        "tensors": [{"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
                     "averaged": t.dtype in ("float64", "float32", "float16", "bfloat16")} for t in plan.tensors],
        "averaged": report.averaged,
        "copied": report.copied,
        "tensor_bytes": report.tensor_bytes,
        "seconds": round(report.seconds, 3),
        "problems": [{"source": str(path), **entry}
                     for path, problem in report.problems for entry in problems_document([problem])],
        "processes": processes_document(report.processes),
    }


def average_text(report: AverageReport) -> str:
    """Return the human view: the sources, weights and tensors for a dry run, else one summary line."""
    what = (f"{report.tensors} tensors ({report.averaged} averaged, {report.copied} copied), "
            f"{human_bytes(report.tensor_bytes)}")
    form = FORMATS[report.format] + (f" for {report.world_size} ranks" if report.world_size else "")
    sources = [f"  {number}. {shown(path)}  weight {weight!r}  ({shown(layout)})"
               for number, (path, weight, layout) in enumerate(zip(report.sources, report.weights, report.layouts), 1)]
    if not report.dry_run:
        checked = ", verified" if report.verified else ""
        return "\n".join([f"wrote the average of {len(report.sources)} checkpoints to {shown(report.output)} ({form}): "
                          f"{what} in {report.seconds:.2f} s{checked}{processes_line(report.processes)}", *sources])
    rows = [(t.key, t.dtype, "x".join(map(str, t.shape)) or "scalar",
             "averaged" if t.dtype in ("float64", "float32", "float16", "bfloat16") else "copied (equal in every source)")
            for t in report.plan.tensors]
    return "\n".join([f"average of {len(report.sources)} checkpoints -> {shown(report.output)} ({form}): {what}",
                      *sources, *table(rows, ("KEY", "DTYPE", "SHAPE", "")), "dry run: nothing was written"])


def average_notes(report: AverageReport) -> list[str]:
    """Return the lines for stderr: each source's integrity-gate warnings, and weights that do
    not sum to 1 (allowed: extrapolation and task arithmetic use them)."""
    lines = [f"{p.severity}: [{p.code}] {shown(path)}: {shown(p.message)}" for path, p in report.problems]
    total = sum(report.weights)
    if abs(total - 1.0) > 1e-9:
        lines.append(f"note: the weights sum to {total!r}, not 1")
    return lines
