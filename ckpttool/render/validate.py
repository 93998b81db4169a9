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
    from ckpttool.check.numbers import TensorNumbers
    from ckpttool.commands.validate import ValidationReport

NUMBERS_LISTED = 5  # tensors named per line of the --numerics summary (--json lists every one)
LARGEST_LISTED = 3  # tensors named on its largest |x| line

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
        **({"numbers": [numbers_document(n) for n in report.numbers]} if report.numbers is not None else {}),
    }


def numbers_document(found: TensorNumbers) -> dict[str, Any]:
    """Return one tensor's `--numerics` figures as `validate --json` lists them."""
    return {"fqn": found.fqn, "dtype": found.dtype, "numel": found.numel, "nan": found.nan, "inf": found.inf,
            "first_bad": found.first_bad, "file": found.file, "all_zero": found.all_zero,
            "subnormal": found.subnormal, "subnormal_share": found.subnormal_share, "max_abs": found.max_abs}


def validate_text(report: ValidationReport) -> str:
    """Return the human view of a validation report."""
    lines = problem_lines(report.problems)
    checked = f"{report.tensors} tensors, {report.chunks} chunks, {report.objects} other entries in {report.files} files"
    if report.deep:
        depth = f", {human_bytes(report.bytes_read)} read and checksummed"
    elif report.numbers is not None:
        depth = f", {human_bytes(report.bytes_read)} of floating tensors scanned"
    else:
        depth = " (metadata and file sizes; --deep reads every byte)"
    verdict = "VALID" if report.valid else f"INVALID: {len(report.errors)} error(s)"
    warnings = f", {len(report.warnings)} warning(s)" if report.warnings else ""
    lines.append(f"{verdict}{warnings}: {report.path}: {checked}{depth}, {report.seconds:.2f} s")
    if getattr(report, "manifest", None) is not None:  # validate --manifest (issue 34)
        check_lines = manifest_check_text(report.manifest, limit=1).splitlines()
        lines += ["  " + line.strip() for line in check_lines if line is check_lines[0] or line.lstrip().startswith("tied:")]
    if report.numbers is not None:
        lines += numbers_lines(report.numbers)
    return "\n".join(lines)


def numbers_lines(numbers: list[TensorNumbers]) -> list[str]:
    """Return the `--numerics` summary: counts, then at most NUMBERS_LISTED tensors per line
    (all-zero ones, those with the largest share of subnormals), and the LARGEST_LISTED
    largest max |x|; the
    NaN/Inf tensors are the problems above it, one line each."""
    bad = [n for n in numbers if n.bad]
    zero = [n for n in numbers if n.all_zero]
    subnormal = sorted((n for n in numbers if n.subnormal), key=lambda n: (-n.subnormal_share, n.fqn))
    largest = sorted((n for n in numbers if n.max_abs), key=lambda n: (-n.max_abs, n.fqn))
    lines = [f"  numerics: {len(numbers)} floating tensors, {sum(n.numel for n in numbers):,} elements: "
             f"{len(bad)} with NaN/Inf, {len(zero)} all zero, {len(subnormal)} with subnormals"]
    if zero:
        lines.append("    all zero: " + _listed([n.fqn for n in zero]))
    if subnormal:
        lines.append("    subnormals: " + _listed([f"{n.fqn} {n.subnormal:,} ({n.subnormal_share:.2%})" for n in subnormal]))
    if largest:
        lines.append("    largest |x|: " + _listed([f"{n.fqn} {n.max_abs:.4g}" for n in largest], LARGEST_LISTED))
    return lines


def _listed(items: list[str], limit: int = NUMBERS_LISTED) -> str:
    """Return the first `limit` items joined, and how many more there are."""
    more = len(items) - limit
    return ", ".join(items[:limit]) + (f" (and {more} more: --json lists every tensor)" if more > 0 else "")
