"""torchrun: split a plan's byte ranges across processes, commit on rank 0 when all succeed.

Under `torchrun --nnodes H --nproc-per-node P -m ckpttool consolidate|reshard ...` every
process reads the metadata and makes the same plan (planning is pure and deterministic), then
`write` runs one protocol over a gloo process group (CPU only):

1. rank 0 creates the temporary output beside OUT under a name (a file, or a directory of
   files), gives every file its final size and writes the heads; it broadcasts the paths
   (or why it could not);
2. every process writes its share (`split`: disjoint byte ranges of about total/world bytes,
   a large tensor's run cut across processes) with pwrite/copy_file_range at the planned
   offsets, fsyncs, and all gather (ok, bytes, seconds) from everyone;
3. only when every process succeeded, rank 0 writes what depends on the whole (safetensors
   index, .pt zip records, `.metadata`) and fsyncs; then every process votes (an all-reduce)
   and rank 0 renames into place only after the vote, so a process that dies at any step
   before it leaves nothing at OUT; otherwise rank 0 removes the temporary output before it
   votes no.

Any failure on any rank makes every rank raise (and the CLI exit non-zero); nothing is left at
OUT. A process that dies never hangs the others: joining the group waits at most
`join_timeout()` (CKPTTOOL_JOIN_TIMEOUT, 120 s); a collective fails as soon as a peer's
connection closes; every wait runs beside the main thread, so torchrun's SIGTERM (it stops
the others when one fails) ends it at once. Each process notes in the rendezvous store who it
is (host, pid) and why it failed, so the others' one-line error names the process that failed
or died (`_culprit`), and a dead rank 0's temporary output is removed by the others. OUT must
be a path every process sees (local disk for one host, NFS/Lustre for many), or an S3 URL:
then the same steps run over multipart uploads (`_write_remote`).
`import torch` happens only here, and only under torchrun (`active`).

Example:
    >>> split([Copy("a.distcp", 0, "m.safetensors", 96, 1000)], 2)
    [[Copy(..., dst_offset=96, length=500)], [Copy(..., src_offset=500, dst_offset=596, length=500)]]
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, NoReturn, Sequence, TypeVar, cast

from ckpttool.core import dtypes, testpoints
from ckpttool.store import io, storage
from ckpttool.core.errors import UsageError, WriteFailed
from ckpttool.outputs import atomic_directory, atomic_output, signals, temps
from ckpttool.outputs.multipart import MultipartSink
from ckpttool.outputs.notices import Notify, ignore
from ckpttool.outputs.remote import remote_output
from ckpttool.plan.operations import Convert, Copy, Operation


class World(NamedTuple):
    """This process's place in a torchrun job."""

    rank: int
    world_size: int
    local_rank: int


@dataclass(frozen=True)
class ProcessStats:
    """What one process wrote: `bytes` of the plan's operations, in `seconds`."""

    rank: int
    bytes: int
    seconds: float


def environment() -> World | None:
    """Return this process's World when torchrun (or any env:// launcher) started it with
    WORLD_SIZE > 1, else None (a single process: no torch, no process group)."""
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None
    if world_size <= 1:
        return None
    return World(rank, world_size, int(os.environ.get("LOCAL_RANK", "0")))


_sharing = False  # set by `run_main` (the CLI under torchrun) and inside `sharing()`


def active() -> World | None:
    """Return this process's World when consolidate/reshard should split their writes across
    the torchrun job: under `torchrun -m ckpttool` or inside `sharing()`, else None.

    Not merely when WORLD_SIZE > 1: a training script that calls `ckpttool.consolidate` on
    rank 0 alone must not wait forever for ranks that never join.
    """
    return environment() if _sharing else None


@contextlib.contextmanager
def sharing() -> Iterator[World | None]:
    """Return a context in which library calls of consolidate/reshard, made on every rank of
    a torchrun job alike, split their writes across the job (a gloo group is created if the
    job has no process group yet; one that exists must support CPU tensors, e.g. gloo).

    Example:
        >>> with distributed.sharing():  # on every rank
        ...     consolidate("ckpt/step-00000100", "model.safetensors")
    """
    global _sharing
    previous, _sharing = _sharing, True
    try:
        yield environment()
    finally:
        _sharing = previous


def init() -> World:
    """Return this process's World after joining the gloo process group (once).

    The join waits at most `join_timeout()` seconds for every process, and a signal (torchrun
    stopping this process because another one died) stops the wait at once.
    """
    world = environment()
    if world is None:
        raise RuntimeError("ckpttool.run.distributed.init: not started by torchrun (WORLD_SIZE <= 1)")
    import torch.distributed as dist

    global _group
    if not dist.is_initialized():
        timeout = join_timeout()
        _waited(lambda: _join(world, timeout), timeout, lambda: _late(world, timeout))
    elif _group is None and "gloo" not in str(dist.get_backend()):
        _group = dist.new_group(backend="gloo")  # a trainer's NCCL group cannot carry CPU tensors
    return world


def join_timeout() -> float:
    """Return the seconds the processes wait for each other to join the process group:
    `CKPTTOOL_JOIN_TIMEOUT`, else JOIN_TIMEOUT."""
    setting = os.environ.get(JOIN_TIMEOUT_ENV, "")
    try:
        seconds = float(setting) if setting else JOIN_TIMEOUT
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise UsageError(f"{JOIN_TIMEOUT_ENV}={setting}: expected a number of seconds above 0")
    return seconds


JOIN_TIMEOUT_ENV = "CKPTTOOL_JOIN_TIMEOUT"
JOIN_TIMEOUT = 120.0  # s; torch's own default (30 min) would keep the others waiting for a process that died


def _join(world: World, timeout: float) -> None:
    """Join the gloo group through a rendezvous store we hold (torchrun's agent store, or one
    rank 0 serves, as torch's env:// rendezvous does), after noting this process in it
    (`_roster`: who is who, for naming a process that dies)."""
    import torch.distributed as dist
    from datetime import timedelta

    global _store
    store: Any = None
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world.world_size,
                              is_master=not agent and world.rank == 0,
                              timeout=timedelta(seconds=timeout + NOTES_TIMEOUT),  # `_waited` gives up first
                              multi_tenant=True, wait_for_workers=False)
        _store = store.clone()  # its own connection: the group's blocks while it waits for the others
        _store.set_timeout(timedelta(seconds=NOTES_TIMEOUT))
        with contextlib.suppress(Exception):  # the roster only names processes; joining does not need it
            _store.set(f"{_roster()}joined/{world.rank}", f"{temps.HOST} {os.getpid()}")
    testpoints.die(world.rank, "join")
    if store is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=world.rank,
                                world_size=world.world_size)  # the keys torch's own env:// rendezvous uses


NOTES_TIMEOUT = 5.0  # s for reading or leaving a note in the rendezvous store
_store: Any = None  # the notes' connection to the rendezvous store (a TCPStore; None: a group someone else made)
_writes = 0  # `write` calls so far: every rank makes the same calls, so the count names one write everywhere


def _roster(write: int | None = None) -> str:
    """Return the store prefix of this torchrun attempt's notes (of one `write`)."""
    attempt = f"ckpttool/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return attempt if write is None else f"{attempt}write{write}/"


def _late(world: World, timeout: float) -> WriteFailed:
    """The error of a join that took longer than `timeout`: naming the processes that died or never joined."""
    culprit = _culprit(world, None)
    if culprit is None and _store is None and world.rank != 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        culprit = 0, (f"process 0 of {world.world_size}, which serves the rendezvous store at "
                      f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}, was not there")
    return LostContact(f"the torchrun processes did not all join within {timeout:g} s "
                       f"({culprit[1] if culprit else 'some did not'}); nothing was committed; see the other processes' "
                       f"errors and rerun (set {JOIN_TIMEOUT_ENV} to wait longer)")


_group = None  # a gloo group of every rank, when the job's own group is not gloo


def run_main(main: Callable[[], object]) -> NoReturn:
    """Run the CLI `main` under torchrun and exit through `os._exit`: only rank 0 prints to
    stdout; stdout and stderr are flushed first. Gloo processes can abort at interpreter exit
    after finishing (pytorch#190489), which would turn a success into a failure."""
    world = environment()
    if world is not None and world.rank != 0:
        sys.stdout = open(os.devnull, "w")
    # torch's C++ warnings (a store connection reset when a process dies) would add lines to the one-line error
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    code = 1
    try:
        with sharing():
            main()
        code = 0
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            code = exit.code or 0
        else:
            print(exit.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# ---------------------------------------------------------------------------------------------
# Splitting a plan


def split(operations: Sequence[Operation], world_size: int) -> list[list[Operation]]:
    """Return `world_size` lists of operations that together write every byte `operations`
    write, exactly once, each about total/world_size bytes.

    The operations are laid end to end in the given order and cut at k*total/world_size:
    a Copy is cut at any byte, a Convert between output elements (its source offset follows),
    so one huge tensor is shared out too. A Gather, a Record (a torch.save record whose
    tail holds its data's CRC-32) or a Records (a run of them, written from one block of
    source reads) stays whole, on the rank its middle falls in: shares differ by at most the
    largest of those. Pure: every rank computes the same split.

    Example:
        >>> [sum(op.length for op in share) for share in split([Copy("a", 0, "b", 0, 10)], 3)]
        [3, 3, 4]
    """
    shares: list[list[Operation]] = [[] for _ in range(world_size)]
    total = sum(op.output_length for op in operations)
    start = 0
    for op in operations:
        size = op.output_length
        end = start + size
        if total == 0:
            shares[0].append(op)
        elif isinstance(op, (Copy, Convert)) and size:
            step = dtypes.ITEMSIZE[op.dtype] if isinstance(op, Convert) else 1
            cuts = [0] + [
                min(size, max(0, k * total // world_size - start)) // step * step for k in range(1, world_size)
            ] + [size]
            for rank in range(world_size):
                if cuts[rank + 1] > cuts[rank]:
                    shares[rank].append(_part(op, cuts[rank], cuts[rank + 1]))
        else:
            shares[min(world_size - 1, (start + end) * world_size // (2 * total))].append(op)
        start = end
    return shares


def _part(op: Copy | Convert, begin: int, end: int) -> Copy | Convert:
    """Return the operation writing output bytes [begin, end) of `op` (relative to its start)."""
    if begin == 0 and end == op.output_length:
        return op
    if isinstance(op, Copy):
        return replace(op, src_offset=op.src_offset + begin, dst_offset=op.dst_offset + begin, length=end - begin,
                       crc32=None)  # the recorded CRC-32 is of the whole run
    out_size, in_size = dtypes.ITEMSIZE[op.dtype], dtypes.ITEMSIZE[op.source_dtype]
    return replace(op, src_offset=op.src_offset + begin // out_size * in_size,
                   length=(end - begin) // out_size * in_size, dst_offset=op.dst_offset + begin)


# ---------------------------------------------------------------------------------------------
# Collectives (gloo, CPU)


class LostContact(WriteFailed):
    """Another torchrun process failed or died, so this one stopped: nothing was committed."""


def _lost(error: BaseException) -> LostContact:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    # gloo: "[.../pair.cc:537] Read error [127.0.0.1]:38062: Connection reset by peer. This is typically ..."
    reason = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is")[0]
    return LostContact(f"lost contact with the other torchrun processes ({reason}); nothing was committed")


_Result = TypeVar("_Result")


def _waited(call: Callable[[], _Result], timeout: float | None = None,
            late: Callable[[], BaseException] | None = None) -> _Result:
    """Return `call()` (a collective, or joining the group), run in a helper thread while the
    main thread waits for it, so that a signal stops the wait at once: Python runs signal
    handlers in the main thread between bytecodes, never inside a gloo call, and torchrun
    stops the other processes with SIGTERM when one dies. Raises `late()` after `timeout`
    seconds. A collective's error (a peer's connection closed) is raised as LostContact."""
    global _broken
    if _broken:  # an earlier call was abandoned mid-way: its peers no longer agree on what comes next
        raise LostContact("an earlier exchange between the torchrun processes was interrupted; nothing was committed")
    if threading.current_thread() is not threading.main_thread():
        return _translated(call)
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(_outcome(call)), name="ckpttool-gloo", daemon=True)
    thread.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while thread.is_alive():
            if deadline is not None and time.monotonic() > deadline and late is not None:
                raise late()
            thread.join(0.05)
    except BaseException:
        _broken = True  # the call goes on in its thread: no other may start on this group
        raise
    value, error = outcome[0]
    if error is not None:
        raise error
    return value


def _outcome(call: Callable[[], _Result]) -> tuple[_Result | None, BaseException | None]:
    try:
        return _translated(call), None
    except BaseException as error:  # noqa: BLE001 - raised in the main thread
        return None, error


def _translated(call: Callable[[], _Result]) -> _Result:
    try:
        return call()
    except RuntimeError as error:  # gloo: a peer died (connection closed) or timed out
        raise _lost(error) from None


_broken = False  # a collective was abandoned (a signal, a timeout): this group can carry no more


def broadcast(value: object) -> object:
    """Return rank 0's `value` on every rank."""
    import torch.distributed as dist

    box = [value]
    _waited(lambda: dist.broadcast_object_list(box, src=0, group=_group))
    return box[0]


_Row = TypeVar("_Row")


def gather_stats(row: _Row) -> list[_Row]:
    """Return every rank's `row` (builtins only, the same kind on every rank), in rank order, on every rank."""
    import torch.distributed as dist

    rows: list = [None] * dist.get_world_size(_group)
    _waited(lambda: dist.all_gather_object(rows, row, group=_group))
    return rows


def all_ok(flag: bool) -> bool:
    """Return True when `flag` is True on every rank (an all-reduce; also a barrier)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    _waited(lambda: dist.all_reduce(value, op=dist.ReduceOp.MIN, group=_group))
    return bool(value.item())


def checked_together(check: Callable[[], None], target: Path) -> None:
    """Run `check` (of the output `target`) on every rank, then wait for all: its error raised
    where it failed, OtherFailed on the other ranks. A command that creates `target` itself
    before the write (a run folder around its iteration folder) calls this first, so no rank
    finds the folder another rank just made."""
    init()
    try:
        check()
    except Exception:
        all_ok(False)
        raise
    if not all_ok(True):
        raise OtherFailed(f"{target}: another process refused the output (its error is on its own stderr); "
                          "nothing was written")


# ---------------------------------------------------------------------------------------------
# Naming a process that failed or died


class OtherFailed(WriteFailed):
    """Another torchrun process failed (its reason is in the message): nothing was committed."""


RERUN = "rerun the command once that is fixed (it removes what this run left)"


def _note(world: World, write: int, error: BaseException, target: Path | storage.RemotePath) -> BaseException:
    """Return what this process should raise for `error`, leaving a note in the rendezvous
    store first, so the others can name this process: its own failure, or that it stopped
    because another one failed. A LostContact, or a signal (torchrun stops the others with
    SIGTERM when one dies), becomes an OtherFailed naming the process that failed or died,
    when the notes or this host's processes tell (`_culprit`). Rank 0 being gone, another
    process removes what it left at the destination (`_remove_lead_leftovers`)."""
    culprit = _culprit(world, write) if isinstance(error, (LostContact, KeyboardInterrupt)) else None
    own = culprit is None and not isinstance(error, (LostContact, OtherFailed))
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if _store is not None:
        with contextlib.suppress(Exception):
            _store.set(f"{_roster(write)}{'failed' if own else 'lost'}/{world.rank}", reason if own else "")
    if culprit is None:
        return error
    rank, text = culprit
    removed = rank == 0 and world.rank != 0 and _remove_lead_leftovers(target)
    how = ("lost contact with the other torchrun processes" if isinstance(error, LostContact)
           else f"{error} (torchrun stops every process when one fails)")
    return OtherFailed(f"{target}: {how}: {text}; nothing was committed{' (its temporary output removed)' if removed else ''}"
                       f"; {RERUN}")


def _culprit(world: World, write: int | None) -> tuple[int, str] | None:
    """Return (rank, what happened to it) for another process that failed (a note in the
    store) or, on this host, died without one (SIGKILL, the OOM killer) or never joined;
    None when nothing tells."""
    if _store is None:
        return None
    others = [rank for rank in range(world.world_size) if rank != world.rank]
    of = f"of {world.world_size}"
    try:
        if write is not None:
            for rank in others:
                key = f"{_roster(write)}failed/{rank}"
                if _store.check([key]):
                    return rank, f"process {rank} {of} failed ({_store.get(key).decode(errors='replace')})"
        joined = {}
        for rank in others:
            key = f"{_roster()}joined/{rank}"
            if _store.check([key]):
                host, _, pid = _store.get(key).decode().partition(" ")
                lost = write is not None and _store.check([f"{_roster(write)}lost/{rank}"])
                if host == temps.HOST and not lost:
                    joined[rank] = int(pid)
            elif write is None:
                return rank, f"process {rank} {of} did not join"
        deadline = time.monotonic() + EXITING
        while joined:  # a killed process closes its connections a moment before /proc shows it dead
            for rank, pid in joined.items():
                if _gone(pid):
                    return rank, (f"process {rank} {of} (pid {pid}) died without an error (killed: SIGKILL, "
                                  "the out-of-memory killer?)")
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
    except Exception:  # noqa: BLE001 - the store is gone with whoever served it
        if world.rank != 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
            return 0, f"process 0 {of} (which served the rendezvous store) is gone"
    return None


def _gone(pid: int) -> bool:
    """Return True when process `pid` of this host has exited (a zombie too: its parent has not reaped it yet)."""
    if not os.path.isdir("/proc/self"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        return False


EXITING = 1.0  # s a killed process of this host may take to show as dead after its connections closed
REAPED = 3.0  # s a survivor waits for rank 0's process to be reaped (torchrun polls every 0.1 s)


def _remove_lead_leftovers(target: Path | storage.RemotePath) -> bool:
    """Return whether what rank 0 (gone) left at `target` was removed: the stale-temp
    recovery every run does first (`remove_stale_temps`: the temporary output, or for S3 the
    marker key and the unfinished multipart uploads), once rank 0's process is reaped."""
    from ckpttool.outputs import remote

    try:
        host, _, pid = _store.get(f"{_roster()}joined/0").decode().partition(" ")
    except Exception:  # noqa: BLE001 - rank 0 served the store: it ran on this host only if MASTER_ADDR is local
        return False
    if host != temps.HOST:
        return False
    deadline = time.monotonic() + REAPED
    while time.monotonic() < deadline:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        return False
    with contextlib.suppress(Exception):
        if isinstance(target, storage.RemotePath):
            return bool(remote.remove_stale_temps(target))
        return bool(temps.remove_stale_temps(target))
    return False


# ---------------------------------------------------------------------------------------------
# The commit protocol


# the callbacks' fds: name -> fd, or for an object-storage target name -> MultipartSink (io.Output)
Prepare = Callable[[dict[str, io.Output]], None]  # rank 0, fresh outputs: sizes and heads
RunShare = Callable[[list[Operation], dict[str, io.Output]], None]  # every rank: its operations
Finish = Callable[[Path, dict[str, io.Output]], None]  # rank 0, all shares written: index, records, metadata


def write(operations: Sequence[Operation], target: Path, names: Sequence[str], *, directory: bool, force: bool,
          prepare: Prepare, run_share: RunShare, finish: Finish, streamed: bool = True,
          notify: Notify = ignore) -> tuple[ProcessStats, ...]:
    """Return what each process wrote, after all the processes of this torchrun job wrote
    `operations` together into files `names` and rank 0 renamed them into place at `target`.

    `directory`: `target` is a directory holding `names`; else `target` is the one file
    `names[0]`. `prepare(fds)` runs on rank 0 on the new, empty files; `run_share(ops, fds)`
    on every rank with its share; `finish(temp_path, fds)` on rank 0 once every share is
    written (fds reopened, so bytes other hosts wrote over NFS are seen). Raises on every
    rank when any rank failed; nothing is left at `target` then.

    An object-storage `target` (`s3://`) is written as multipart uploads every process sends
    parts of (`_write_remote`); that needs an output written in order (`streamed`: not a
    .pt file, no --verify).
    """
    remote = cast(storage.RemotePath, target) if storage.is_remote(target) else None  # checkpoint.as_path
    if remote is not None:
        if not streamed or not hasattr(remote.filesystem, "call_s3"):
            raise UsageError(f"{target}: under torchrun, object storage takes .safetensors, Hub folders and reshard "
                             "outputs on S3, without --verify; write a .pt or verified output to a shared path, or "
                             "from a single process")
    elif re.match(r"[A-Za-z][A-Za-z0-9+.-]*:/", str(target)):  # a URL (Path("s3://b/k") reads "s3:/b/k")
        raise UsageError(f"{target}: under torchrun the output must be a path every process can open (local disk, "
                         "NFS) or an s3:// URL")
    global _writes
    world = environment()
    assert world is not None, "distributed.write: not under torchrun (see `active`)"
    _writes += 1
    number = _writes  # names this write in the notes every process leaves (`_note`)
    try:
        init()
        shares = split(operations, world.world_size)
        if remote is not None:
            return _write_remote(world, shares, remote, names, directory, force, prepare, run_share, finish, notify)
        if world.rank == 0:
            return _lead(shares, target, names, directory, force, prepare, run_share, finish, notify)
        return _follow(world, shares[world.rank], target, run_share)
    except BaseException as error:
        raised: BaseException = error
        with contextlib.suppress(KeyboardInterrupt), signals.deferred():  # torchrun's SIGTERM must not cut it short
            raised = _note(world, number, error, remote or target)
        if raised is error:
            raise
        raise raised from error


def _follow(world: World, share: list[Operation], target: Path, run_share: RunShare) -> tuple[ProcessStats, ...]:
    """The commit protocol on a process other than rank 0 (`_lead`), for a local `target`."""
    testpoints.die(world.rank, "start")
    paths = broadcast(None)
    if isinstance(paths, str):
        raise OtherFailed(f"{target}: process 0 could not create the output ({paths}); nothing was written")
    paths = cast(dict[str, str], paths)  # rank 0 broadcasts an error or {name: path} (_lead)
    stats, failure = _run_share(world, share, paths, run_share, target)
    testpoints.die(world.rank, "commit")
    committed = all_ok(failure is None)  # the vote: rank 0 renames the output only if every process is still there
    if failure is not None:
        raise failure
    if not committed:
        raise OtherFailed(f"{target}: process 0 could not commit the output (see its error); nothing was left there")
    return stats


def _lead(shares: list[list[Operation]], target: Path, names: Sequence[str], directory: bool, force: bool,
          prepare: Prepare, run_share: RunShare, finish: Finish, notify: Notify) -> tuple[ProcessStats, ...]:
    """The commit protocol on rank 0, for a local `target`: the vote (an all-reduce every
    process joins once it has written its share, rank 0 once it has written what depends on
    the whole) comes before the rename, so a process that dies at any step before it leaves
    nothing at `target`."""
    world = environment()
    assert world is not None
    gathered = voted = False  # every rank reported; the vote was taken (or tried)
    root: Path | None = None
    try:
        with contextlib.ExitStack() as stack:
            try:
                root, paths = stack.enter_context(_temporary(target, names, directory, force, notify))
                with _opened(paths) as fds:
                    prepare(fds)
            except BaseException as error:
                broadcast(str(error) or type(error).__name__)  # the others stop too
                raise
            testpoints.die(0, "start")
            broadcast({name: str(path) for name, path in paths.items()})
            stats, failure = _run_share(world, shares[0], paths, run_share, target)
            gathered = True
            if failure is not None:
                raise failure
            with _opened(paths) as fds:
                finish(root, fds)
                io.sync_all(fds.values())  # what finish wrote; the shares' own bytes are on disk already
            testpoints.die(0, "commit")
            voted = True
            if not all_ok(True):  # the others vote their share's outcome, which the gather told: never False
                raise OtherFailed(f"{target}: a process failed after writing its share; nothing was committed")
        # renamed into place as the `with` ends
    except BaseException:
        if root is not None:  # atomic_* removed it, unless a second signal cut that short
            _remove(root)
        if gathered and not voted:
            with contextlib.suppress(WriteFailed):
                all_ok(False)
        raise
    return stats


def _write_remote(world: World, shares: list[list[Operation]], target: storage.RemotePath, names: Sequence[str],
                  directory: bool, force: bool, prepare: Prepare, run_share: RunShare, finish: Finish,
                  notify: Notify) -> tuple[ProcessStats, ...]:
    """The commit protocol for an S3 `target`: rank 0 begins one multipart upload per output
    file (heads written into its first parts) and broadcasts the upload ids; every process
    sends the parts its share fills whole, numbered by their place in the file; the parts at
    the edges of shares, filled by two processes, are summed onto rank 0 (each byte written by
    one process, zeros elsewhere) and sent by it; rank 0 collects every part's ETag and, after
    the vote (`_lead`), completes the uploads, else aborts them (`remote.remote_output`)."""
    if world.rank != 0:
        testpoints.die(world.rank, "start")
        begun = broadcast(None)
        if isinstance(begun, str):
            raise OtherFailed(f"{target}: process 0 could not begin the upload ({begun}); nothing was written")
        begun = cast(dict[str, tuple[str, str, int, int]], begun)  # rank 0 broadcasts an error or its uploads
        sinks = {name: MultipartSink(target.filesystem, key, f"{target}/{name}", upload_id, size, part_size)
                 for name, (key, upload_id, size, part_size) in begun.items()}
        stats, failure = _run_share(world, shares[world.rank], sinks, run_share, target)
        if failure is None:
            _merge_edges(world, sinks)
        testpoints.die(world.rank, "commit")
        committed = all_ok(failure is None)
        if failure is not None:
            raise failure
        if not committed:
            raise OtherFailed(f"{target}: process 0 could not commit the output (see its error); nothing was left there")
        return stats
    announced = gathered = voted = False
    try:
        with remote_output(target, force, directory, streamed=True, notify=notify) as output:
            sinks = {name: output.sink(name) for name in names} if directory else {names[0]: output}
            prepare(sinks)
            begun = {name: (sink.key, sink.begin(), sink.size, sink.part_size) for name, sink in sinks.items()}
            testpoints.die(0, "start")
            broadcast(begun)
            announced = True
            stats, failure = _run_share(world, shares[0], sinks, run_share, target)
            gathered = True
            if failure is not None:
                raise failure
            _merge_edges(world, sinks)
            finish(output.path if directory else Path(target.name), sinks)
            testpoints.die(0, "commit")
            voted = True
            if not all_ok(True):
                raise OtherFailed(f"{target}: a process failed after writing its share; nothing was committed")
        # the uploads are completed as the `with` ends
    except BaseException as error:
        with contextlib.suppress(WriteFailed):
            if not announced:
                broadcast(str(error) or type(error).__name__)  # the others stop too
            elif gathered and not voted:
                all_ok(False)
        raise
    return stats


def _merge_edges(world: World, sinks: dict) -> None:
    """Collective, every rank: sum onto rank 0 the parts several processes wrote pieces of
    (untouched bytes are zeros, so the sum is the part), rank 0 sends them; then rank 0
    records the ETags of the parts every other process sent."""
    import torch
    import torch.distributed as dist

    unsent = gather_stats({name: sorted(sink.unsent()) for name, sink in sinks.items()})
    edges = sorted({(name, index) for rows in unsent for name, indexes in rows.items() for index in indexes})
    failure: BaseException | None = None  # rank 0 raises it only after the last collective: no rank hangs
    for name, index in edges:
        buffer = sinks[name].take(index)
        try:
            dist.reduce(torch.frombuffer(buffer, dtype=torch.uint8), dst=0, op=dist.ReduceOp.SUM, group=_group)
        except RuntimeError as error:
            raise _lost(error) from None
        if world.rank == 0 and failure is None:
            try:
                sinks[name].send(index, buffer)
            except Exception as error:  # noqa: BLE001 - raised below
                failure = error
    sent = gather_stats({name: sink.sent for name, sink in sinks.items()})
    if failure is not None:
        raise failure
    if world.rank == 0:
        for rows in sent:
            for name, parts in rows.items():
                sinks[name].record(parts)


@contextlib.contextmanager
def _temporary(target: Path, names: Sequence[str], directory: bool,
               force: bool, notify: Notify) -> Iterator[tuple[Path, dict[str, Path]]]:
    """Yield (temporary path, name -> file path) of a named temporary output beside `target`
    that other processes can open; renamed to `target` when the block succeeds."""
    if directory:
        with atomic_directory(target, force=force, notify=notify) as output:
            yield output.path, {name: output.path / name for name in names}
    else:
        with atomic_output(target, force=force, unnamed=False, notify=notify) as handle:
            yield Path(handle.name), {names[0]: Path(handle.name)}


@contextlib.contextmanager
def _opened(paths: dict[str, Path] | dict[str, str]) -> Iterator[dict[str, int]]:
    """Yield name -> fd of `paths`, open for reading and writing, created if missing, never
    truncated (other processes write the same files); closed on exit."""
    fds: dict[str, int] = {}
    try:
        for name, path in paths.items():
            fds[name] = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        yield fds
    finally:
        for fd in fds.values():
            os.close(fd)


def _run_share(world: World, share: list[Operation], paths: dict, run_share: RunShare,
               target: Path | storage.RemotePath) -> tuple[tuple[ProcessStats, ...], BaseException | None]:
    """Write this rank's share, then gather every rank's outcome; return the stats and, when
    any rank failed, what to raise (this rank's own error, or one naming the rank that failed).
    `paths`: name -> file path, or name -> `MultipartSink` of a remote output."""
    started = time.perf_counter()
    failure: BaseException | None = None
    remote = any(not isinstance(path, (str, Path)) for path in paths.values())
    try:
        with (contextlib.nullcontext(paths) if remote else _opened(paths)) as fds:
            testpoints.run_share(world.rank, share, fds, run_share)
            io.sync_all(fds.values())
    except BaseException as error:  # noqa: BLE001 - reported to every rank, raised by the caller
        failure = error
    written = sum(op.output_length for op in share)
    reason = None if failure is None else (getattr(failure, "strerror", None) or str(failure) or type(failure).__name__)
    rows = gather_stats((world.rank, written, time.perf_counter() - started, reason))
    stats = tuple(ProcessStats(rank, written, round(seconds, 6)) for rank, written, seconds, _ in rows)
    failed = [(rank, why) for rank, _, _, why in rows if why is not None]
    if failure is None and failed:
        rank, why = failed[0]
        failure = OtherFailed(f"{target}: process {rank} of {world.world_size} failed ({why}); nothing was committed; "
                              f"{RERUN}")
    return stats, failure


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            for entry in path.iterdir():
                entry.unlink()
            path.rmdir()
        else:
            path.unlink()
