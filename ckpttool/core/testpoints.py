"""What tests set through the environment of a real `ckpttool` process; nothing happens unless
they do.

`tests/test_interrupts.py` pauses a run at a known point to send it a signal there,
`tests/test_distributed.py` makes one torchrun rank fail half-way through its share,
`tests/test_distributed_faults.py` makes one die at a named step of the commit protocol, and
`tests/test_remote.py` makes multipart uploads of a few bytes send many parts. Production
code only names the point (`pause("commit")`); how a test uses it lives here, in one place.

Example:
    $ CKPTTOOL_TEST_PAUSE=commit:30 ckpttool reshard ckpt out --world 2
    ckpttool-test: paused at commit
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from typing import Any, Callable

PAUSE_ENV = "CKPTTOOL_TEST_PAUSE"  # `<phase>:<seconds>`, see `pause`
FAIL_ENV = "CKPTTOOL_TEST_FAIL"  # `<rank>:error`, `<rank>:kill` or `<rank>:term`, see `run_share`
DIE_ENV = "CKPTTOOL_TEST_DIE"  # `<rank>:<step>:error|kill|term`, see `die`
PART_SIZE_ENV = "CKPTTOOL_PART_SIZE"  # bytes, see `smallest_part`

_paused: set[str] = set()


def pause(phase: str) -> None:
    """With `CKPTTOOL_TEST_PAUSE=<phase>:<seconds>` set, print `ckpttool-test: paused at
    <phase>` on stderr and sleep, the first time `phase` is reached. Phases: `start`
    (temporary output created), `copy` (first IO task done), `commit` (written and fsynced,
    before the rename), `remove-old` (a replaced directory partly removed), `upload` (a remote
    output's first file uploaded to its temporary key, or all parts of a streamed one's first
    file sent), `commit-key` (a remote output's first key made visible by its commit) and
    `committed` (its last, before its commit record is removed)."""
    setting = os.environ.get(PAUSE_ENV)
    if not setting or phase in _paused:
        return
    wanted, _, seconds = setting.partition(":")
    if wanted != phase:
        return
    _paused.add(phase)
    print(f"ckpttool-test: paused at {phase}", file=sys.stderr, flush=True)
    time.sleep(float(seconds or 60))


def run_share(rank: int, share: list, outputs: Any, run: Callable[[list, Any], None]) -> None:
    """Run `run(share, outputs)`; with `CKPTTOOL_TEST_FAIL=<rank>:error|kill|term` naming this
    rank, run only the first half of the share, then fail (`_fail`)."""
    wanted, _, how = os.environ.get(FAIL_ENV, "").partition(":")
    if wanted != str(rank):
        run(share, outputs)
        return
    half = len(share) // 2
    run(share[:half], outputs)
    _fail(rank, how, "fails", FAIL_ENV)


def die(rank: int, step: str) -> None:
    """With `CKPTTOOL_TEST_DIE=<rank>:<step>:<how>` naming this rank and `step`, print
    `ckpttool-test: rank <rank> dies at <step> (<how>)` on stderr and fail (`_fail`). Steps of
    a torchrun write (`distributed.write`): `join` (before joining the process group), `start`
    (before the first collective of the write: rank 0 has created the temporary output),
    `commit` (every share written and gathered; on rank 0 after `finish`, before the vote that
    lets it rename)."""
    wanted, _, rest = os.environ.get(DIE_ENV, "").partition(":")
    where, _, how = rest.partition(":")
    if wanted == str(rank) and where == step:
        _fail(rank, how, f"dies at {step}", DIE_ENV)


def _fail(rank: int, how: str, what: str, setting: str) -> None:
    """Print what happens, then fail: `error` raises an EIO, `kill` sends this process SIGKILL,
    `term` SIGTERM (under the CLI's `signals.interruptible` that raises `Interrupted`)."""
    print(f"ckpttool-test: rank {rank} {what} ({how or 'error'})", file=sys.stderr, flush=True)
    if how in ("kill", "term"):
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGTERM)
        time.sleep(5)  # a signal handler runs between bytecodes: SIGTERM's raises in here
    raise OSError(errno.EIO, f"test failure on rank {rank} ({setting})")


def smallest_part() -> int | None:
    """Return the multipart part size `CKPTTOOL_PART_SIZE` asks for (so a small test output is
    sent in many parts), or None."""
    setting = os.environ.get(PART_SIZE_ENV)
    return int(setting) if setting else None
