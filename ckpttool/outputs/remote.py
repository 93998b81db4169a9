"""Outputs on object storage: a file or a directory that becomes visible only when complete.

Two ways (`remote_output`):

- streamed (S3 through s3fs, for outputs written in order: `.safetensors`, Hub folders,
  DCP): each data file is a multipart upload to its final key, parts sent as soon as they
  are filled (`multipart.MultipartSink`), so no local copy of the output is needed and at
  most a few parts are in memory. Nothing is visible until the commit completes the uploads
  (small files such as `.metadata` and indexes are put last); any failure or SIGTERM aborts
  them.
- staged (torch.save `.pt` outputs, whose zip headers are written after the data; `--verify`,
  which reads the output back; backends other than s3fs): built in a local temporary
  directory, uploaded to a temporary key `.ckpttool-tmp-NAME.HOST.PID.TOKEN` beside the
  destination, then copied to the final keys (data files first, `.metadata` and indexes last)
  and the temporary keys deleted; any failure or SIGTERM deletes them instead.

S3 cannot make several keys visible at once, so a directory's commit makes them visible one
by one, data files first and `.metadata` and indexes last. Before the first one, the run puts
a *commit record* beside the destination, `.ckpttool-commit-NAME.HOST.PID.TOKEN`: the keys it
is about to make (ckpttool's own: never a user's file it writes over) and the size and
SHA-256 of the last one. It is removed once the commit is complete. A run that stops
mid-commit (SIGKILL, a request failing for good) thus leaves a record naming every key it
made visible; whoever finds the record of a dead run (`undo_commit`) removes those keys,
unless the last key is there with the recorded bytes (the commit completed and only the
record's removal was lost): then it keeps the output and removes the record.

A killed run's leftovers (temporary keys, a streamed run's marker key and unfinished uploads,
a commit record and the keys it lists) are removed by the next run that writes the same
destination (`remove_stale_temps`), before it looks whether the destination exists: it needs
no `--force` and no clean-up by hand.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from ckpttool.core import testpoints
from ckpttool.core.errors import OutputExists, StorageError
from ckpttool.outputs.notices import Notify, Replaced, ignore
from ckpttool.outputs.replacing import is_ours, replacement
from ckpttool.outputs.local import OutputDirectory
from ckpttool.outputs.multipart import MultipartSink, put
from ckpttool.outputs.signals import deferred
from ckpttool.outputs.temps import WRITING_PREFIX, StaleTemp, dead_entries, new_token, temp_name
from ckpttool.store.storage import RemotePath, request_errors

SETTLE_SECONDS = 10  # a request still running when a run fails is waited for this long, then cancelled
LAST_KEYS = (".metadata", ".index.json")  # copied last: a reader sees the checkpoint only when all else is there
RECORD_FORMAT = "ckpttool-commit/1"  # a commit record's "format"


def check(path: RemotePath, force: bool, notify: Notify = ignore) -> None:
    """Raise OutputExists when something is at `path` (an object or a prefix) and `force` is
    off, and StorageError when its bucket does not exist: before any work is done. First
    removes the temporary keys that killed runs on this host left beside `path`
    (`remove_stale_temps`, each told to `notify`)."""
    fs, bucket = path.filesystem, path.key.split("/", 1)[0]
    with request_errors(str(path)):
        fs.invalidate_cache(path.key)  # an earlier run in this process may have written it
        for stale in remove_stale_temps(path):
            notify(stale)
        exists = fs.exists(path.key)
        with contextlib.suppress(PermissionError):  # a role that may write but not list buckets: the upload will tell
            if not exists and not fs.exists(bucket):
                raise StorageError(f"{path}: the bucket {path._protocol}://{bucket} does not exist (create it "
                                   "first, or check the endpoint)", "no-bucket")
    if exists and not force:
        raise OutputExists(f"{path}: already exists; pass --force to replace it")


def remove_stale_temps(target: RemotePath) -> list[StaleTemp]:
    """Remove and return the `.ckpttool-tmp-NAME.HOST.PID.TOKEN` keys beside `target` whose
    run, on this host, is gone: what a SIGKILL leaves (a staged run's temporary upload, or a
    streamed run's empty marker key, whose unfinished multipart uploads to `target` are
    aborted too when no live run writes there). Keys of live runs and of other hosts are left
    alone."""
    fs, parent = target.filesystem, target.parent.key
    try:
        _abort_temp_uploads(target)
        names = [name.rstrip("/").rsplit("/", 1)[-1] for name in fs.ls(parent, detail=False, refresh=True)]
    except FileNotFoundError:  # no bucket: `check` says so
        return []
    dead, found = dead_entries(names, target.name, kinds=("tmp",))
    removed = []
    if len(dead) == found:  # no live run writes `target`: the keys a dead run's record lists are its own
        for entry in dead_entries(names, target.name, kinds=("commit",))[0]:
            undone = undo_commit(target, f"{parent}/{entry.name}")
            removed.append(StaleTemp(target.parent / entry.name, target, entry.pid, keys=undone))
    for entry in dead:
        marker = f"{parent}/{entry.name}"
        if len(dead) == found and fs.isfile(marker) and not fs.size(marker):
            # no live run writes `target`, and this is a streamed run's marker: unfinished uploads there are the dead runs'
            _abort_uploads(target, target.key)
        fs.rm(marker, recursive=True)
        removed.append(StaleTemp(target.parent / entry.name, target, entry.pid))
    return removed


def _abort_temp_uploads(target: RemotePath) -> None:
    """Abort the unfinished multipart uploads to temporary keys of dead runs beside `target`
    (a staged run SIGKILLed while it uploaded): before the keys are listed, so that a
    CompleteMultipartUpload the run had sent just before it died cannot make its temporary key
    appear after the listing (it fails, or it has landed and the listing sees the key)."""
    fs = target.filesystem
    if not hasattr(fs, "call_s3"):
        return
    bucket, prefix, _ = fs.split_path(f"{target.parent.key}/{WRITING_PREFIX}{target.name}.")
    parent = prefix.rsplit("/", 1)[0] + "/" if "/" in prefix else ""
    uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
    entries = {upload["Key"][len(parent):].split("/", 1)[0] for upload in uploads}
    dead = {entry.name for entry in dead_entries(entries, target.name, kinds=("tmp",))[0]}
    for upload in uploads:
        if upload["Key"][len(parent):].split("/", 1)[0] in dead:
            with contextlib.suppress(FileNotFoundError):  # NoSuchUpload: completed or aborted meanwhile
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])


def undo_commit(target: RemotePath, record: str) -> int:
    """Return how many keys of `target` were removed after reading the commit record at
    `record` (see the module docstring): the keys it lists that exist, unless its last key
    holds the recorded bytes (the commit completed); then the record itself. A record that is
    not one (unreadable) only is removed, and a listed key outside `target` never."""
    fs = target.filesystem
    try:
        document = json.loads(fs.cat_file(record))
        keys, last = list(document["keys"]), document["last"]
        if document["format"] != RECORD_FORMAT:
            raise ValueError(document["format"])
    except FileNotFoundError:
        return 0
    except (ValueError, KeyError, TypeError):
        keys, last = [], None
    removed = 0
    if last is not None and not _holds(fs, last):
        fs.invalidate_cache(target.key)
        present = set(fs.find(target.key)) | ({target.key} if fs.isfile(target.key) else set())
        for key in keys:
            if key in present and (key == target.key or key.startswith(target.key + "/")):
                fs.rm_file(key)
                removed += 1
        fs.invalidate_cache(target.key)
    fs.rm_file(record)
    return removed


def _holds(fs: Any, last: dict) -> bool:
    """True when the key `last["key"]` exists with `last["size"]` bytes whose SHA-256 is
    `last["sha256"]` (the size alone when that is None)."""
    fs.invalidate_cache(last["key"])
    try:
        size = fs.size(last["key"])
    except FileNotFoundError:
        return False
    if size != last["size"]:
        return False
    if last["sha256"] is None:
        return True
    with fs.open(last["key"], "rb") as handle:
        return _sha256(handle) == last["sha256"]


def _sha256(handle: Any) -> str:
    """The SHA-256 (hex) of what `handle` reads, in 8 MiB blocks (a `.metadata` may be large)."""
    digest = hashlib.sha256()
    while block := handle.read(8 << 20):
        digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Commit:
    """The keys a directory's commit makes visible, in order, what the last one is made from
    (a local file, or the size of a multipart upload's object), and where its commit record
    goes."""

    keys: Sequence[str]
    last: Path | int
    record: str

    def document(self, listed: Sequence[str]) -> bytes:
        """The commit record listing `listed` (the keys it may remove)."""
        if isinstance(self.last, Path):
            with open(self.last, "rb") as handle:
                size, digest = self.last.stat().st_size, _sha256(handle)
        else:
            size, digest = self.last, None
        last = {"key": self.keys[-1], "size": size, "sha256": digest}
        return json.dumps({"format": RECORD_FORMAT, "keys": list(listed), "last": last}, indent=1).encode()


def _abort_uploads(target: RemotePath, key: str) -> None:
    """Abort the unfinished multipart uploads to `key` (or keys under it) on `target`'s bucket."""
    fs = target.filesystem
    if not hasattr(fs, "call_s3"):
        return
    bucket, prefix, _ = fs.split_path(key)
    listing = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    for upload in listing.get("Uploads", []):
        if upload["Key"] == prefix or upload["Key"].startswith(prefix + "/"):
            with contextlib.suppress(FileNotFoundError):  # NoSuchUpload: gone already (an abort retried after its answer was lost)
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])


def _abort_orphans(target: RemotePath, temp: str) -> None:
    """Abort the unfinished multipart uploads left to `target` and `temp` once this run's own are
    completed or aborted: a CreateMultipartUpload whose answer was lost and which botocore sent
    again began an upload nobody knows the id of (invisible, but kept and billed until aborted).
    Only when no other live run writes `target` (no marker beside it but this run's `temp`).
    Raises what the requests raise: the caller then keeps its marker, so the
    next run to write `target` aborts them (`remove_stale_temps`)."""
    fs, parent = target.filesystem, target.parent.key
    names = [name.rstrip("/").rsplit("/", 1)[-1] for name in fs.ls(parent, detail=False, refresh=True)]
    dead, found = dead_entries(names, target.name, kinds=("tmp",))
    if found - len(dead) > (1 if temp.rsplit("/", 1)[-1] in names else 0):
        return
    _abort_uploads(target, target.key)
    _abort_uploads(target, temp)


class Streams:
    """The multipart uploads of one streamed output, by file name (`sink` opens one)."""

    def __init__(self, target: RemotePath, directory: bool, record: str, notify: Notify = ignore):
        self.target, self.directory, self.record, self.notify = target, directory, record, notify
        self.sinks: dict[str, MultipartSink] = {}

    def key(self, name: str) -> str:
        return f"{self.target.key}/{name}" if self.directory else self.target.key

    def sink(self, name: str) -> MultipartSink:
        sink = self.sinks[name] = MultipartSink(self.target.filesystem, self.key(name), f"{self.target}/{name}")
        return sink

    def commit(self, local: Path, force: bool) -> None:
        """Send what is left, then, with signals deferred and the old output replaced as
        `_replacing` says: complete every upload, then put the small local files (`.metadata`
        and indexes last)."""
        for sink in self.sinks.values():
            sink.finish()
            testpoints.pause("upload")  # on the main thread, where signals arrive
        small = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()) if self.directory else []
        small.sort(key=lambda name: name.endswith(LAST_KEYS))
        fs, target = self.target.filesystem, self.target
        keys = [self.key(name) for name in [*self.sinks, *small]]
        last = local / small[-1] if small else self.sinks[next(reversed(self.sinks))].size if self.sinks else 0
        commit = Commit(keys, last, self.record) if self.directory else None
        with request_errors(str(target)), deferred(), _replacing(target, force, self.directory, self.notify,
                                                                 commit) as made:
            for name, sink in self.sinks.items():
                sink.complete()
                made.append(self.key(name))
                testpoints.pause("commit-key")
            for name in small:
                put(fs, local / name, self.key(name))
                made.append(self.key(name))
                testpoints.pause("commit-key")

    def abort(self) -> None:
        for sink in self.sinks.values():
            sink.abort()


@contextlib.contextmanager
def remote_output(target: RemotePath, force: bool, directory: bool, streamed: bool = False,
                  notify: Notify = ignore) -> Iterator[Any]:
    """Yield where to write `target`; when the block succeeds, make it visible at `target` as
    the module docstring describes.

    A directory: an `OutputDirectory` whose path is a local directory under $TMPDIR (staged:
    the whole output; streamed, when `streamed` and the backend is s3fs: the small files, its
    data files opened as uploads by `OutputDirectory.opened`). One file: a local file open for
    writing (staged), or a `MultipartSink` (streamed). On any exception (SIGTERM and Ctrl-C
    included) the uploads are aborted, local files and temporary keys removed, and `target`
    is left as it was. After SIGKILL, unfinished multipart uploads (invisible; an S3 lifecycle
    rule `AbortIncompleteMultipartUpload` removes them) or temporary keys may remain, never an
    object at the destination key.
    """
    check(target, force, notify)
    fs, token = target.filesystem, new_token()
    temp, record = (f"{target.parent.key}/{temp_name(target.name, kind, token)}" for kind in ("tmp", "commit"))
    streams = Streams(target, directory, record, notify) if streamed and hasattr(fs, "call_s3") else None
    local: Path | None = None
    try:
        with deferred():  # a signal inside mkdtemp, after its mkdir, would leave a directory nobody noted
            local = Path(tempfile.mkdtemp(prefix=WRITING_PREFIX))
        output = local / target.name
        if streams is not None:  # an empty key naming this run: a later run aborts our uploads if we are killed
            with request_errors(str(target)):
                fs.pipe_file(temp, b"")
        if directory:
            output.mkdir()
        testpoints.pause("start")
        with _written(output, directory, streams) as written:
            yield written
        testpoints.pause("commit")
        if streams is not None:
            streams.commit(output, force)
            with deferred(), contextlib.suppress(Exception):  # the output is complete: a failure here is the next run's
                _remove_late_temps(target, notify)
                _abort_orphans(target, temp)
                fs.rm_file(temp)  # only when the orphans are gone: else the next run aborts them
        else:
            _upload(output, target, temp, record, force, directory, notify)
            with deferred(), contextlib.suppress(Exception):
                _remove_late_temps(target, notify)
                _abort_orphans(target, temp)
    except BaseException:
        with deferred():  # network calls: a signal now (torchrun stopping us) must not cut them short
            _settle(fs)
            if streams is not None:
                streams.abort()
            with contextlib.suppress(Exception), request_errors(str(target)):
                _abort_orphans(target, temp)
                fs.invalidate_cache(target.parent.key)
                if fs.exists(temp):
                    fs.rm(temp, recursive=True)
        raise
    finally:
        with deferred():  # a signal during the removal would leave the rest of it in $TMPDIR
            if local is not None:
                shutil.rmtree(local, ignore_errors=True)


def _remove_late_temps(target: RemotePath, notify: Notify) -> None:
    """`remove_stale_temps` once more, as the run ends: a request a killed run had sent just
    before it died (its temporary key's PUT) may have landed after this run's first look."""
    for stale in remove_stale_temps(target):
        notify(stale)


def _settle(fs: Any) -> None:
    """Let the requests still running in fsspec's event-loop thread end (those past
    SETTLE_SECONDS are cancelled): a signal raised in the main thread while it waited for one
    (a temporary key's upload, a multipart upload being begun) leaves it running, and what it
    made after the clean-up looked would be left behind."""
    import asyncio

    loop = getattr(fs, "loop", None)
    if loop is None or not loop.is_running():
        return

    async def running() -> None:
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=SETTLE_SECONDS)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=SETTLE_SECONDS)

    with contextlib.suppress(Exception):
        asyncio.run_coroutine_threadsafe(running(), loop).result(3 * SETTLE_SECONDS)


@contextlib.contextmanager
def _written(output: Path, directory: bool, streams: Streams | None) -> Iterator[Any]:
    """Yield what the writer of `remote_output` is given for the local stand-in `output`."""
    if directory:
        yield OutputDirectory(output, streams.sink if streams is not None else None)
    elif streams is not None:
        yield streams.sink(streams.target.name)
    else:
        with open(output, "x+b") as handle:
            yield handle
            handle.flush()


@contextlib.contextmanager
def _replacing(target: RemotePath, force: bool, directory: bool, notify: Notify,
               commit: Commit | None = None) -> Iterator[list[str]]:
    """Yield the list the block appends each key it makes visible at `target` to (both commit
    paths). Before: with `force`, the old output's index and `.metadata` keys are removed (so
    no reader pairs them with new data; the old checkpoint is unreadable, never mixed), an old
    directory where one file goes removed; then, for a `commit` of several keys, its record
    is put (listing the keys that are not a user's file written over). After: what is left of
    ckpttool's own files of the old output is removed, and everything else kept
    (`replacing.replacement`); the keys replaced that were not ckpttool's are told to `notify`
    (`notices.Replaced`); then the record is removed. Should the block fail, the keys it made
    are deleted again, so a new destination stays empty (and the record removed once they
    are: else the next run finishes the job, `undo_commit`)."""
    fs, prefix = target.filesystem, target.key + "/"
    found = set(fs.find(target.key)) if force and directory else set()  # the prefix's keys; or one object at it
    old = {key[len(prefix):] for key in found if key.startswith(prefix)}
    first = {name for name in old if is_ours(name) and name.endswith(LAST_KEYS)}
    made: list[str] = []
    recorded = False
    try:
        for name in sorted(first):
            fs.rm_file(prefix + name)
        if force and not directory and fs.isdir(target.key):
            fs.rm(target.key, recursive=True)
        if commit is not None and len(commit.keys) > 1:
            listed = [key for key in commit.keys if key[len(prefix):] not in old or is_ours(key[len(prefix):])]
            fs.pipe_file(commit.record, commit.document(listed))
            recorded = True
        yield made
    except BaseException:
        for key in made:
            if key[len(prefix):] not in old or is_ours(key[len(prefix):]):  # a user's file now holds the new one: keep it
                with contextlib.suppress(Exception):
                    fs.rm_file(key)
        if recorded and commit is not None:
            with contextlib.suppress(Exception):
                undo_commit(target, commit.record)
        raise
    try:
        written = {key[len(prefix):] for key in made}
        plan = replacement(old, written)
        for name in sorted(old - set(plan.keep) - written - first):
            fs.rm_file(prefix + name)
        for key in found - {prefix + name for name in old}:  # an object where a directory now goes
            fs.rm_file(key)
        fs.invalidate_cache()
        if plan.replaced:
            notify(Replaced(str(target), plan.replaced))
    finally:
        testpoints.pause("committed")
        if recorded and commit is not None:  # the commit is complete: a record left is kept by `undo_commit`
            with contextlib.suppress(Exception):
                fs.rm_file(commit.record)


def _upload(local: Path, target: RemotePath, temp: str, record: str, force: bool, directory: bool,
            notify: Notify) -> None:
    fs = target.filesystem
    if directory:
        names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
        names.sort(key=lambda name: name.endswith(LAST_KEYS))  # stable: data files first
    else:
        names = [""]
    with request_errors(str(target)):
        for position, name in enumerate(names):
            put(fs, local / name if name else local, f"{temp}/{name}" if name else temp)
            if position == 0:
                testpoints.pause("upload")
        finals = [f"{target.key}/{name}" if name else target.key for name in names]
        commit = Commit(finals, local / names[-1], record) if directory and names else None
        with deferred():  # from here the destination changes: finish before any signal is handled
            with _replacing(target, force, directory, notify, commit) as made:
                for name, final in zip(names, finals):
                    fs.copy(f"{temp}/{name}" if name else temp, final)
                    made.append(final)
                    testpoints.pause("commit-key")
            fs.rm(temp, recursive=True)
