"""`latest`: the newest step of a run folder that is whole, for a resume script to use.

A run folder holds one checkpoint per step (`step-900/`, `global_step12/`, `checkpoint-10/`,
Lightning's `epoch=0-step=10.ckpt`, ... as `readers.step_of` reads their names). The
steps are looked at newest first, by the step number in their names (any padding:
`step-900` before `step-1000`), never by name order, and the first one that is whole is the
answer; older steps are not read at all. Whole means what `validate` checks without
`--deep`: the metadata reads and every chunk lies in a file of the right size. `deep` adds
validate's `--deep` (every blob decoded, CRC-32 checked); `numerics` also refuses a step
whose model tensors hold NaN or Inf (`check.numbers.scan_numbers`).

Example:
    >>> report = latest("runs/x")
    >>> report.chosen
    PosixPath('runs/x/step-900')
    >>> [(s.name, s.verdict) for s in report.steps]
    [('step-1200', 'no-metadata'), ('step-1100', 'beyond-eof'), ('step-900', 'whole')]
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckpttool.check.integrity import ERROR, Problem
from ckpttool.commands.validate import validate
from ckpttool.core.checkpoint import as_path
from ckpttool.core.errors import CheckpointError, NotACheckpoint
from ckpttool.formats.dcp import METADATA_FILENAME
from ckpttool.readers.detect import (MAX_LISTED, NEMO_UNFINISHED_SUFFIX, detect, nemo_unfinished, newest_checkpoint,
                                     run_checkpoints, run_entry_order, search, step_of)
from ckpttool.source_options import SourceOptions
from ckpttool.store import storage

if TYPE_CHECKING:
    from ckpttool.check.numbers import TensorNumbers

WHOLE = "whole"
NO_METADATA = "no-metadata"  # core.errors.NotACheckpoint's code: what validate says of such a folder
NON_FINITE = "non-finite"  # validate --deep's code for NaN/Inf counts
DATA_SUFFIX = ".distcp"  # torch's FileSystemWriter data files (`__{rank}_{n}.distcp`)


@dataclass(frozen=True)
class StepVerdict:
    """One step looked at: its folder's name and path, the step its name carries, and what
    was found (`problems`: the errors that make it not whole; empty when whole)."""

    name: str
    step: int
    path: Path
    problems: tuple[Problem, ...] = ()
    layout: str | None = None  # what the step holds, as `inspect` names it; None when nothing was found
    seconds: float = 0.0

    @property
    def whole(self) -> bool:
        return not self.problems

    @property
    def codes(self) -> tuple[str, ...]:
        """Return the distinct codes of the problems, in the order first found."""
        return tuple(dict.fromkeys(problem.code for problem in self.problems))

    @property
    def verdict(self) -> str:
        """Return `whole`, or the first problem's code (`no-metadata`, `beyond-eof`, ...)."""
        return self.codes[0] if self.problems else WHOLE

    def reason(self) -> str:
        """Return one line: why the step is not whole (the first problem, and how many more)."""
        if not self.problems:
            return "whole"
        more = len(self.problems) - 1
        return self.problems[0].message + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else "")


@dataclass(frozen=True)
class LatestReport:
    """The steps `latest` looked at, newest first, ending at the chosen one (or at the
    oldest, when none is whole), and how many older steps it had no need to look at."""

    run: Path
    deep: bool
    numerics: bool
    steps: tuple[StepVerdict, ...]
    not_looked_at: int = 0
    pointer: tuple[str, str] | None = None  # (pointer file, the step folder it names), when the run has one
    seconds: float = 0.0

    @property
    def chosen(self) -> Path | None:
        """Return the path of the newest whole step, or None when no step is whole."""
        return next((step.path for step in self.steps if step.whole), None)

    @property
    def total(self) -> int:
        return len(self.steps) + self.not_looked_at


def latest(run: str | os.PathLike, *, deep: bool = False, numerics: bool = False,
           source: SourceOptions = SourceOptions()) -> LatestReport:
    """Return the steps of the run folder `run` looked at, newest first, and the newest whole one
    (`LatestReport.chosen`, None when no step is whole: a run with no step at all, too).

    `run` is a run folder, or a folder holding exactly one run a few levels down
    (`lightning_logs/version_0/checkpoints`, as `search` finds it). Never raises for a
    broken step: each one's problems are in its verdict. Raises NotACheckpoint when `run` does
    not exist, and AmbiguousSource when it holds several runs.
    """
    started = time.perf_counter()
    root = as_path(source.locate(run))
    if not _lexists(root):
        raise NotACheckpoint(f"{root}: no such file or directory")
    root = _run_folder(root)
    entries = step_entries(root)
    checkpoints = frozenset(run_checkpoints(root)) if entries else frozenset()
    verdicts: list[StepVerdict] = []
    for name in entries:
        verdict = _look_at(root, name, name in checkpoints, deep, numerics, source)
        verdicts.append(verdict)
        if verdict.whole:
            break
    return LatestReport(run=root, deep=deep, numerics=numerics, steps=tuple(verdicts),
                        not_looked_at=len(entries) - len(verdicts), pointer=_pointer(root, entries),
                        seconds=time.perf_counter() - started)


def step_entries(run: Path) -> list[str]:
    """Return the names of the run's step folders (and Lightning's `.ckpt` files), newest
    first: by the step their names carry (then Lightning's `-vN`, then NeMo's `-last`, then the name), never by
    name order. A folder named as a step that holds no checkpoint (a save killed before its
    metadata was written) is one of them: it is looked at, and found not whole."""
    try:
        names = [entry.name for entry in (run.iterdir() if storage.is_remote(run) else os.scandir(run))]
    except OSError:
        return []
    return sorted((name for name in names if step_of(name) is not None and not name.endswith(NEMO_UNFINISHED_SUFFIX)),
                  key=run_entry_order, reverse=True)


def _run_folder(root: Path) -> Path:
    """Return `root` when it holds steps, else the one run folder `search` finds below it
    (AmbiguousSource when there are several), else `root` (a run with no step yet)."""
    if not root.is_dir() or step_entries(root):
        return root
    runs = [path for path in search(root) if run_checkpoints(path)]
    if len(runs) > 1:
        from ckpttool.core.errors import AmbiguousSource

        raise AmbiguousSource(f"{root}: holds {len(runs)} run folders, not one: "
                              f"{'; '.join(str(path) for path in runs[:MAX_LISTED])}; name one of them")
    return runs[0] if runs else root


def _look_at(run: Path, name: str, is_checkpoint: bool, deep: bool, numerics: bool,
             source: SourceOptions) -> StepVerdict:
    """Return the verdict on one step: validate's errors, else (`numerics`) its model's NaN/Inf.
    `is_checkpoint`: `run_checkpoints` found checkpoint files in the folder."""
    started = time.perf_counter()
    path = run / name
    step = step_of(name)
    assert step is not None
    if not is_checkpoint and path.is_dir():
        problem = Problem(ERROR, NO_METADATA, _not_a_checkpoint(path))
        return StepVerdict(name, step, path, (problem,), None, time.perf_counter() - started)
    try:
        problems = tuple(validate(path, deep=deep, source=source).errors)
    except NotACheckpoint as error:  # removed since the listing: a keep-latest-K cleanup, running now
        problems = (Problem(ERROR, error.code, str(error)),)
    if not problems and numerics:
        problems = _non_finite(path, source)
    try:
        layout: str | None = detect(path, read_metadata=False).layout  # folder listings only
    except CheckpointError:
        layout = None
    return StepVerdict(name, step, path, problems, layout, time.perf_counter() - started)


def _not_a_checkpoint(path: Path) -> str:
    """One line on a step folder that holds no checkpoint: a DCP save killed before it wrote
    `.metadata` (torch writes it last, after every rank's data files), NeMo's save still marked
    unfinished, or an empty folder."""
    if nemo_unfinished(path):
        return f"NeMo's {path.name}{NEMO_UNFINISHED_SUFFIX} marker beside it: the save did not finish"
    try:
        names = [entry.name for entry in path.iterdir()]
    except OSError as error:
        return f"unreadable ({error.strerror or error})"
    data = [name for name in names if name.endswith(DATA_SUFFIX)]
    if data:
        return (f"{len(data)} {DATA_SUFFIX} data file{'s' if len(data) > 1 else ''} but no {METADATA_FILENAME}: "
                "the save was killed before it finished")
    if not names:
        return "empty: a save that never wrote anything"
    return f"holds no checkpoint ckpttool knows ({len(names)} file{'s' if len(names) > 1 else ''})"


def _non_finite(path: Path, source: SourceOptions) -> tuple[Problem, ...]:
    """Return one problem per model tensor of the step holding NaN or Inf, or whose bytes
    cannot be read (empty: every floating model tensor is finite). Stops at the first bad block."""
    from ckpttool import readers
    from ckpttool.check.numbers import floating, scan_numbers
    from ckpttool.model.model_view import find_model

    checkpoint = readers.open_checkpoint(path, source.follow_symlinks)
    view = find_model(checkpoint, source.model_prefix).require()
    scanned = floating(checkpoint)
    if view.prefix is not None:  # no model found: every floating tensor is read
        scanned = [fqn for fqn in scanned if fqn in view.keys]
    unreadable: list[Problem] = []

    def on_error(fqn: str, error: CheckpointError) -> None:
        unreadable.append(Problem(ERROR, error.code, str(error), fqn=fqn))

    found = scan_numbers(checkpoint, scanned, follow_symlinks=source.follow_symlinks, stop_at_first_bad=True,
                         on_error=on_error)
    bad = [Problem(ERROR, NON_FINITE, _numbers_line(numbers), file=numbers.file, fqn=numbers.fqn)
           for numbers in found if numbers.bad]
    return tuple(unreadable + bad)


def _numbers_line(numbers: TensorNumbers) -> str:
    counts = " and ".join(f"{what}" for count, what in ((numbers.nan, "NaN"), (numbers.inf, "Inf")) if count)
    return (f"{numbers.fqn} holds {counts} ({numbers.dtype}, {numbers.numel} elements; one at flat index "
            f"{numbers.first_bad}; the scan stops at the first bad block)")


def _pointer(run: Path, entries: list[str]) -> tuple[str, str] | None:
    """Return (pointer file, step folder) when a `latest` pointer of the run names one of its steps."""
    found = sorted(entries, key=run_entry_order)
    if not found:
        return None
    newest, by = newest_checkpoint(run, found)
    return (by, newest) if not by.startswith("highest number") else None


def _lexists(path: Path) -> bool:
    return path.exists() if storage.is_remote(path) else os.path.lexists(path)
