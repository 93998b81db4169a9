"""Starting the disk on outputs as they are written (`io.Writeback`, `execute.run`'s
`on_written`): every byte an operation writes is reported, every reported span lies in its
output, the flush requests change no byte, and a streamed output is left alone."""

from __future__ import annotations

import os

from conftest import FIXTURES

from ckpttool.run import execute
from ckpttool.store import io
from ckpttool.commands.consolidate import consolidate
from ckpttool.commands.reshard import reshard

SOURCE = FIXTURES / "fsdp2_world3_uneven"


def files_of(directory) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def recording(monkeypatch) -> tuple[list, list]:
    """Record each `on_written` span and each flush request (still made) of the runs that follow."""
    spans: list[tuple[str, int, int]] = []
    flushed: list[tuple[int, int, int]] = []
    run, start_writeback = execute.run, io.start_writeback

    def recorded_run(operations, files, outputs, **options):
        operations = list(operations)
        on_written = options.get("on_written")
        assert on_written is not None, "reshard and consolidate report what they write"

        def record(name: str, start: int, end: int) -> None:
            spans.append((name, start, end))
            on_written(name, start, end)

        run(operations, files, outputs, **dict(options, on_written=record))
        for op in operations:  # every operation's bytes lie in a reported span of its output
            start = execute.first_offset(op)
            assert any(name == op.dst and low <= start and start + op.output_length <= high
                       for name, low, high in spans), op

    def recorded_writeback(output, start: int, end: int) -> None:
        flushed.append((output, start, end))
        start_writeback(output, start, end)

    monkeypatch.setattr(execute, "run", recorded_run)
    monkeypatch.setattr(io, "start_writeback", recorded_writeback)
    return spans, flushed


def test_reshard_flushes_every_written_span_and_writes_the_same_bytes(tmp_path, monkeypatch):
    reshard(SOURCE, tmp_path / "plain", world_size=5)
    monkeypatch.setattr(io, "WRITEBACK_STEP", 1)  # a flush request after every task
    spans, flushed = recording(monkeypatch)
    reshard(SOURCE, tmp_path / "flushed", world_size=5)
    plain, written = files_of(tmp_path / "plain"), files_of(tmp_path / "flushed")
    assert written.keys() == plain.keys()
    for name in plain:  # `.metadata` names its own path: the rank files must match byte for byte
        if name != ".metadata":
            assert written[name] == plain[name], name
    sizes = {name: len(data) for name, data in written.items()}
    assert spans and len(flushed) == len(spans)
    assert all(0 <= start < end <= sizes[name] for name, start, end in spans)
    assert {name for name, _, _ in spans} == {name for name in sizes if name.endswith(".distcp")}


def test_consolidate_flushes_its_output_and_writes_the_same_bytes(tmp_path, monkeypatch):
    consolidate(SOURCE, tmp_path / "plain.safetensors")
    monkeypatch.setattr(io, "WRITEBACK_STEP", 1)
    spans, flushed = recording(monkeypatch)
    consolidate(SOURCE, tmp_path / "flushed.safetensors")
    data = (tmp_path / "flushed.safetensors").read_bytes()
    assert data == (tmp_path / "plain.safetensors").read_bytes()
    assert spans and len(flushed) == len(spans)
    assert all(isinstance(fd, int) and 0 <= start < end <= len(data) for fd, start, end in flushed)


def test_writeback_hands_the_kernel_a_step_at_a_time_and_not_the_rest(tmp_path, monkeypatch):
    flushed: list[tuple[object, int, int]] = []
    monkeypatch.setattr(io, "start_writeback", lambda output, start, end: flushed.append((output, start, end)))
    with io.Writeback({"a": 7, "b": 8}, step=100) as writeback:
        writeback.written("a", 0, 60)
        writeback.written("b", 0, 99)  # under a step: left to the final fsync
        writeback.written("a", 60, 130)
        writeback.written("a", 130, 150)
        writeback.written("a", 150, 250)
    assert flushed == [(7, 0, 130), (7, 130, 250)]


def test_a_flush_request_changes_no_byte_and_skips_a_streamed_output(tmp_path):
    path = tmp_path / "data"
    data = os.urandom(3 << 20)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        io.write_at(fd, data, 0)
        io.start_writeback(fd, 0, len(data))
        io.start_writeback(fd, 5, 5)  # an empty span asks nothing
        assert os.pread(fd, len(data), 0) == data
    finally:
        os.close(fd)
    assert path.read_bytes() == data

    class Sink:  # a streamed output (multipart upload): nothing to flush
        def write_at(self, data, offset):
            raise AssertionError("a flush request must not write")

    io.start_writeback(Sink(), 0, 10)


def test_rank_files_are_fsynced_several_at_once_and_all_before_wait_returns(tmp_path, monkeypatch):
    """`_Syncs` fsyncs up to `io.SYNC_THREADS` rank files at once (fsyncs issued together share
    ext4's journal commit), and `wait` returns only once every file, started or not, is synced."""
    import threading
    import time

    from ckpttool.commands import reshard as reshard_module

    fds = {f"__{rank}_0.distcp": os.open(tmp_path / f"__{rank}_0.distcp", os.O_CREAT | os.O_WRONLY, 0o644)
           for rank in range(12)}
    synced, running, most = [], [0], [0]
    lock = threading.Lock()

    def slow_sync(fd) -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
            synced.append(fd)

    monkeypatch.setattr(reshard_module.io, "sync", slow_sync)
    try:
        with reshard_module._Syncs(fds) as syncs:
            for name in list(fds)[:8]:  # the rest were never started: wait syncs them itself
                syncs.start(name)
            syncs.wait(fds)
            assert sorted(synced) == sorted(fds.values())
        assert most[0] > 1, "the fsyncs ran one at a time"
        synced.clear()
        reshard_module._Syncs.all(fds)  # the path without a running pool (torchrun's shares)
        assert sorted(synced) == sorted(fds.values())
    finally:
        for fd in fds.values():
            os.close(fd)
