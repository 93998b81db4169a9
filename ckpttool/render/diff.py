"""`diff`'s output: the verdict and the differing entries as text, its `ckpttool.diff/1`
JSON document, and each side's gate warnings for stderr.

Example:
    >>> print(diff_text(diff("fixtures/fsdp2_world2", "fixtures/fsdp2_world3_uneven")).splitlines()[0])
    DIFFERENT: fixtures/fsdp2_world2 and fixtures/fsdp2_world3_uneven: 14 of 16 tensors differ, ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpttool.render.text import human_bytes, problem_lines, problems_document, shown

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
