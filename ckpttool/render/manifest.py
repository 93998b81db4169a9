"""The output of manifests (issue 34): `ckpttool manifest`'s summary, and a manifest check
(`validate --manifest`, `diff SRC FILE.json`) as text and as its `ckpttool.manifest-check/1`
JSON document.

Example:
    >>> print(manifest_check_text(check("fixtures/fsdp2_world3_uneven", "m.json")))   # its own manifest
    MATCHES: fixtures/fsdp2_world3_uneven against the manifest m.json: 16 tensors, sha256:00fb75b5...
"""

from __future__ import annotations

from typing import Any

from ckpttool.render.text import human_bytes, problems_document, shown

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
