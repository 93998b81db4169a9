"""Run several ckpttool commands one after another in every process of one torchrun job.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/torchrun_cases.py CASES.json

Each worker pays seconds of CPU to import torch, so a test starts one job per process count
and every process runs all the cases in order, as `python -m ckpttool ARGS` would under
torchrun: through `distributed.run_main` (only rank 0 prints to stdout; the process group
made by the first command serves the later ones; the process ends through `os._exit`).

CASES.json holds `{"results": DIR, "cases": [{"name": ..., "args": [...], "after": PATH or
null, "env": {"*" or "<rank>": {NAME: VALUE}}}, ...]}`. Before each case rank 0 prints the
line `MARK + name` on stdout, so the test can cut stdout into one part per case; a case with
`after` starts once the file PATH exists (the test writes it when that case's source
checkpoint and reference are ready); `env` is set during the case on every rank ("*") or on
one (e.g. the test-only CKPTTOOL_TEST_FAIL and CKPTTOOL_TEST_PAUSE). Each rank writes
`DIR/rank<R>.json`: {case name: exit code} (rewritten after each case).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

MARK = "=== torchrun case: "
WAIT = 300  # seconds a case waits for its `after` file


def run_cases(spec: dict, rank: int) -> None:
    """Run every case of `spec` through the CLI; write this rank's exit codes."""
    from ckpttool.cli import main

    codes: dict[str, int] = {}
    for case in spec["cases"]:
        if case.get("after"):
            _wait_for(Path(case["after"]))
        print(MARK + case["name"], flush=True)
        environment = {**case.get("env", {}).get("*", {}), **case.get("env", {}).get(str(rank), {})}
        try:
            with _environment(environment):
                main.main(args=case["args"], prog_name="ckpttool")  # standalone mode: always SystemExit
            code = 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        except BaseException:  # a bug: show it, go on with the next case
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        codes[case["name"]] = code
        Path(spec["results"], f"rank{rank}.json").write_text(json.dumps(codes))  # so far, if a later case hangs


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {WAIT} s")
        time.sleep(0.05)


if __name__ == "__main__":
    from ckpttool.run import distributed

    spec = json.loads(Path(sys.argv[1]).read_text())
    world = distributed.environment()
    distributed.run_main(lambda: run_cases(spec, 0 if world is None else world.rank))
