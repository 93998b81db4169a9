"""`latest`'s output: the chosen step's path alone on stdout (for `$(ckpttool latest runs/x)`),
one line on stderr per newer step skipped and why, one line when no step is whole, and the
`ckpttool.latest/1` JSON document.

Example:
    >>> report = latest("runs/x")
    >>> latest_text(report), latest_notes(report)
    ('runs/x/step-900', ['skipped runs/x/step-1000: 2 .distcp data files but no .metadata: the save was killed before it finished'])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpttool.render.text import problems_document

if TYPE_CHECKING:
    from ckpttool.commands.latest import LatestReport, StepVerdict

LATEST_SCHEMA = "ckpttool.latest/1"
MAX_PROBLEMS_LISTED = 20  # per step in the JSON document; `problem_count` has them all


def latest_text(report: LatestReport) -> str | None:
    """Return the chosen step's path (what stdout shows), or None when no step is whole."""
    return None if report.chosen is None else str(report.chosen)


def latest_notes(report: LatestReport) -> list[str]:
    """Return a line per step skipped (newest first, why), and one when the run's `latest`
    pointer names an older step than the one chosen."""
    notes = [f"skipped {_where(step)}{step.reason()}" for step in report.steps if not step.whole]
    if report.pointer is not None and report.chosen is not None:
        file, named = report.pointer
        chosen = next(step for step in report.steps if step.whole)
        if named != chosen.name and named not in {step.name for step in report.steps}:
            notes.append(f"note: {file} names {named}, older than {chosen.name} (a save it was not updated after, "
                         "or a run resumed from an older step)")
    return notes


def latest_failure(report: LatestReport) -> str:
    """Return the one line saying why no step is whole: the newest step's first problem."""
    if not report.steps:
        return (f"{report.run}: no step folders (step-N, iter_N, global_stepN, checkpoint-N, epoch=E-step=S, ...): "
                "no step to resume from")
    newest = report.steps[0]
    count = len(report.steps)
    return (f"{report.run}: none of its {count} step{'s is' if count > 1 else ' is'} whole; the newest: "
            f"{_where(newest)}{newest.reason()}")


def _where(step: StepVerdict) -> str:
    """`path: ` before a step's reason, unless the reason starts with it already."""
    return "" if step.reason().startswith(f"{step.path}: ") else f"{step.path}: "


def step_document(step: StepVerdict) -> dict[str, Any]:
    """Return one step's entry in the document: its step, path and verdict (the problems' codes)."""
    return {
        "step": step.step,
        "name": step.name,
        "path": str(step.path),
        "whole": step.whole,
        "verdict": step.verdict,
        "codes": list(step.codes),
        "layout": step.layout,
        "reason": None if step.whole else step.reason(),
        "problem_count": len(step.problems),
        "problems": problems_document(step.problems[:MAX_PROBLEMS_LISTED]),
        "seconds": round(step.seconds, 4),
    }


def latest_document(report: LatestReport) -> dict[str, Any]:
    """Return the `ckpttool.latest/1` JSON document: every step looked at, newest first."""
    return {
        "schema": LATEST_SCHEMA,
        "run": str(report.run),
        "chosen": latest_text(report),
        "deep": report.deep,
        "numerics": report.numerics,
        "steps": [step_document(step) for step in report.steps],
        "steps_in_run": report.total,
        "not_looked_at": report.not_looked_at,
        "pointer": None if report.pointer is None else {"file": report.pointer[0], "names": report.pointer[1]},
        "seconds": round(report.seconds, 3),
    }
