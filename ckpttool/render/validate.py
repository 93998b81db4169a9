"""`validate`'s output: the verdict and problems of a ValidationReport as text, and its
`ckpttool.validate/1` JSON document (with `--manifest`, the check's own document inside).

Example:
    >>> print(validate_text(validate("fixtures/fsdp2_world3_uneven")))
    VALID: fixtures/fsdp2_world3_uneven: 58 tensors, 142 chunks, 14 other entries in 3 files (metadata ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpttool.render.manifest import manifest_check_document, manifest_check_text
from ckpttool.render.text import human_bytes, problem_lines, problems_document

if TYPE_CHECKING:
    from ckpttool.commands.validate import ValidationReport

VALIDATE_SCHEMA = "ckpttool.validate/1"


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
