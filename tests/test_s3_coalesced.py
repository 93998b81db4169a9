"""Reads from object storage are coalesced: consolidate and reshard of an `s3://` checkpoint
fetch each file's needed bytes (record headers and data together) in a few large ranged GETs,
counted here by a proxy in front of a real moto server on 127.0.0.1, and write the same bytes
as the same command on the local copy. `spans` (merging ranges, the store) is tested alone too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("moto.server")

from ckpttool.store import spans  # noqa: E402
from ckpttool.cli import main  # noqa: E402
from dcp_world import write_forked as write_world  # noqa: E402
from s3_proxy import LatencyProxy  # noqa: E402
from storage_emulators import aws_environment, moto_s3  # noqa: E402

BUCKET = "coalesced"
MiB = 1 << 20


@pytest.fixture(scope="module")
def world8(tmp_path_factory) -> Path:
    """A world-8 checkpoint saved by 8 gloo processes with torch's dcp.save (12 tensors, 3 MB)."""
    return write_world(tmp_path_factory.mktemp("world8") / "ckpt", world=8)


@pytest.fixture(scope="module")
def proxy(world8):
    """A moto server holding `world8` at s3://coalesced/w8, and a counting proxy in front of it;
    the AWS_* environment points at the proxy."""
    import boto3

    with moto_s3() as endpoint, LatencyProxy(endpoint) as forward, aws_environment(forward.endpoint):
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=BUCKET)
        for path in sorted(world8.iterdir()):
            client.upload_file(str(path), BUCKET, f"w8/{path.name}")
        yield forward


@pytest.fixture(scope="module")
def world8_48mb(tmp_path_factory) -> Path:
    """A world-8 checkpoint of 12 tensors of 1024 x 1024 fp32 saved with torch's dcp.save: 48 MiB
    in 6 MiB files, more than the 32 MB that --max-memory 64MB gives coalesced reads (the
    smallest that showed 39 GETs against a bound of 22: records located before the copies)."""
    return write_world(tmp_path_factory.mktemp("world8_48mb") / "ckpt", world=8, tensors=12, rows=1024, columns=1024)


@pytest.fixture(scope="module")
def large(proxy, world8_48mb) -> str:
    """`world8_48mb` at s3://coalesced/w8-48mb (on `proxy`'s moto server); its URL."""
    import boto3

    client = boto3.client("s3", endpoint_url=proxy.endpoint)
    for path in sorted(world8_48mb.iterdir()):
        client.upload_file(str(path), BUCKET, f"w8-48mb/{path.name}")
    return f"s3://{BUCKET}/w8-48mb"


def run_cli(*args):
    from click.testing import CliRunner

    result = CliRunner().invoke(main, [*map(str, args), "--quiet", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def files_of(root: Path) -> dict[str, bytes]:
    if root.is_file():
        return {"": root.read_bytes()}
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def data_files(checkpoint: Path) -> list[Path]:
    return sorted(checkpoint.glob("*.distcp"))


def bound(checkpoint: Path) -> int:
    """The most GETs a command may send for `checkpoint`: files + bytes / 8 MiB + 8."""
    files = data_files(checkpoint)
    return len(files) + sum(p.stat().st_size for p in files) // (8 * MiB) + 8


# ---------------------------------------------------------------------------------------------
# Through the proxy: requests counted, bytes compared


def test_s3_consolidate_of_world_8_is_a_few_gets_and_the_local_bytes(proxy, world8, tmp_path):
    local = run_cli("consolidate", world8, tmp_path / "local.safetensors")
    proxy.reset()
    remote = run_cli("consolidate", f"s3://{BUCKET}/w8", tmp_path / "remote.safetensors")
    gets = proxy.gets
    assert (tmp_path / "remote.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    assert gets <= bound(world8), f"{gets} GETs (bound {bound(world8)}), {remote['requests']} for data files"
    assert local["requests"] == 0
    assert len(data_files(world8)) <= remote["requests"] <= gets  # one span per file at least; listing and .metadata besides


def test_s3_reshard_of_world_8_is_a_few_gets_and_the_local_bytes(proxy, world8, tmp_path):
    local = run_cli("reshard", world8, tmp_path / "out", "--world", "3")
    expected = files_of(tmp_path / "out")
    os.rename(tmp_path / "out", tmp_path / "local")  # .metadata names the directory written
    proxy.reset()
    remote = run_cli("reshard", f"s3://{BUCKET}/w8", tmp_path / "out", "--world", "3")
    gets = proxy.gets
    assert files_of(tmp_path / "out") == expected
    assert gets <= bound(world8), f"{gets} GETs (bound {bound(world8)}), {remote['requests']} for data files"
    assert local["requests"] == 0 and 0 < remote["requests"] <= gets


@pytest.mark.parametrize("command", ["consolidate", "reshard"])
def test_a_budget_smaller_than_the_data_still_writes_the_local_bytes(proxy, world8, tmp_path, monkeypatch, command):
    """64 KiB of --max-memory and 40 KiB spans: locating fetches only record heads and ends,
    kept spans are dropped and fetched again, readers start spans beyond the budget."""
    monkeypatch.setattr(spans, "SPAN", 40 << 10)
    monkeypatch.setattr(spans, "GAP", 1 << 10)
    out, extra = (tmp_path / "m.safetensors", []) if command == "consolidate" else (tmp_path / "out", ["--world", "3"])
    run_cli(command, world8, out, *extra)
    expected = files_of(out)
    os.rename(out, tmp_path / "local")
    remote = run_cli(command, f"s3://{BUCKET}/w8", out, *extra, "--max-memory", "64KiB", "--verify")
    assert files_of(out) == expected
    assert remote["requests"] > len(data_files(world8))


OUTPUTS = {"safetensors": ("m.safetensors", []), "hub shards": ("hub", ["--max-shard-size", "20MB"]),
           "pt": ("m.pt", []), "reshard": ("out", ["--world", "3"])}


# 64MB: the smallest --max-memory the bound holds at; 512MB: the default, for one consolidate output and reshard
@pytest.mark.parametrize("output, max_memory", [("safetensors", "64MB"), ("safetensors", "512MB"), ("hub shards", "64MB"),
                                                ("pt", "64MB"), ("reshard", "64MB"), ("reshard", "512MB")])
def test_s3_gets_stay_within_the_bound_when_the_data_is_more_than_half_of_max_memory(
        proxy, world8_48mb, large, tmp_path, output, max_memory):
    """Each byte of a data file is fetched about once, record headers with their data: at 64MB
    the spans cannot all be held, yet none is fetched twice and no header costs a GET of its own."""
    command = "reshard" if output == "reshard" else "consolidate"
    name, extra = OUTPUTS[output]
    run_cli(command, world8_48mb, tmp_path / name, *extra)
    expected = files_of(tmp_path / name)
    os.rename(tmp_path / name, tmp_path / "local")  # reshard's .metadata names the directory written
    proxy.reset()
    remote = run_cli(command, large, tmp_path / name, *extra, "--max-memory", max_memory)
    gets = [(path.rsplit("/", 1)[-1], ranges) for method, path, ranges in proxy.log if method == "GET"]
    assert files_of(tmp_path / name) == expected
    assert len(gets) <= bound(world8_48mb), f"{len(gets)} GETs (bound {bound(world8_48mb)}): {gets}"
    assert remote["requests"] <= len(gets)


def test_a_record_read_with_its_data_that_disagrees_with_the_metadata_fails_as_the_local_run(proxy, world8, tmp_path):
    """Records after the first of their shape are located when the copies reach them: one whose
    data.pkl says 16 rows where the metadata says 32 fails the command with the local run's
    one-line error (naming the file and the tensor), exit 1 and no output."""
    import shutil

    import boto3

    from ckpttool import readers

    bad = tmp_path / "bad"
    shutil.copytree(world8, bad)
    tensor = readers.read(bad, False)[1].tensors["model.layers.5.weight"]
    blob = next(chunk.blob for chunk in tensor.chunks if chunk.blob.file == "__3_0.distcp")
    data = bytearray((bad / blob.file).read_bytes())
    at = data.index(b"K M\x00\x01\x86", blob.offset, blob.offset + 4096)  # the size (32, 256) in data.pkl
    data[at + 1] = 16
    (bad / blob.file).write_bytes(bytes(data))
    client = boto3.client("s3", endpoint_url=proxy.endpoint)
    for path in sorted(bad.iterdir()):
        client.upload_file(str(path), BUCKET, f"w8-bad/{path.name}")
    from click.testing import CliRunner

    local = CliRunner().invoke(main, ["consolidate", str(bad), str(tmp_path / "local.safetensors"), "--quiet"])
    remote = CliRunner().invoke(main, ["consolidate", f"s3://{BUCKET}/w8-bad", str(tmp_path / "remote.safetensors"),
                                       "--quiet", "--max-memory", "64MB"])
    assert (local.exit_code, remote.exit_code) == (1, 1)
    assert "model.layers.5.weight" in local.output and "shape [16, 256]" in local.output
    assert remote.output.replace(f"s3://{BUCKET}/w8-bad", str(bad)) == local.output
    assert not (tmp_path / "remote.safetensors").exists()


def test_consolidate_from_s3_at_20_ms_per_request_is_not_request_bound(proxy, world8, tmp_path, monkeypatch):
    """Each GET waits 20 ms at the proxy: a request per record would take seconds."""
    monkeypatch.setattr(proxy, "latency", 0.02)
    remote = run_cli("consolidate", f"s3://{BUCKET}/w8", tmp_path / "remote.safetensors")
    assert remote["requests"] <= bound(world8)


# ---------------------------------------------------------------------------------------------
# spans alone


def test_coalesce_merges_neighbours_and_small_gaps_per_file_and_cuts_long_runs():
    ranges = [("b", 0, 10), ("a", 200, 300), ("a", 0, 100), ("a", 150, 160), ("a", 5000, 5001)]
    assert spans.coalesce(ranges, gap=64, limit=1 << 20) == [
        spans.Span("a", 0, 300), spans.Span("a", 5000, 5001), spans.Span("b", 0, 10)]
    cut = spans.coalesce([("f", 0, 25)], gap=0, limit=10)
    assert [(s.start, s.end) for s in cut] == [(0, 9), (9, 18), (18, 25)]


def test_subtract_leaves_what_no_span_covers():
    assert spans.subtract([("f", 0, 100), ("g", 0, 5)], [spans.Span("f", 10, 20), spans.Span("f", 50, 200)]) == [
        ("f", 0, 10), ("f", 20, 50), ("g", 0, 5)]


def fake_files(sizes: dict[str, int]):
    data = {name: bytes((i * 7 + len(name)) % 251 for i in range(size)) for name, size in sizes.items()}
    calls = []

    def fetch(file, start, end):
        calls.append((file, start, end))
        return data[file][start:end]

    return data, calls, fetch


def test_the_store_fetches_spans_in_order_of_use_and_frees_each_once_read():
    data, calls, fetch = fake_files({"a": 300_000, "b": 50_000})
    store = spans.SpanStore(fetch, budget=1 << 20)
    try:
        ranges = [("b", 0, 1000)] + [("a", i * 1000, i * 1000 + 900) for i in range(300)] + [("b", 40_000, 41_000)]
        store.expect(ranges)
        for file, start, end in ranges:
            assert bytes(store.read(file, start, end - start)) == data[file][start:end]
        assert calls == [("b", 0, 41_000), ("a", 0, 299_900)]
        assert store.requests == 2 and store._used == 0 and not any(store._entries.values())
        assert store.read("a", 0, 10) is None  # freed: the caller reads it itself
    finally:
        store.close()


def test_a_walker_keeps_the_spans_it_passed_within_the_budget_for_the_copies(monkeypatch):
    monkeypatch.setattr(spans, "SPAN", 100_000)
    data, calls, fetch = fake_files({"a": 1_000_000})
    store = spans.SpanStore(fetch, budget=350_000)
    try:
        records = [("a", i * 100_000, (i + 1) * 100_000) for i in range(10)]
        store.walk([spans.Span(*record) for record in records])
        for file, start, end in records:
            store.passed(file, start)
            assert bytes(store.read(file, end - 10, 10)) == data[file][end - 10:end]
        assert len(calls) == 10  # each walked span fetched once (two at a time ahead of the walker)
        store.expect(records)
        for file, start, end in records:
            assert bytes(store.read(file, start, end - start)) == data[file][start:end]
        assert len(calls) == 10 + 10 - 4, "the three spans kept and the one still walked are not fetched again"
        assert store._used == 0 and not any(store._entries.values())
    finally:
        store.close()


def test_a_failed_get_is_raised_to_every_read_of_its_span():
    def fetch(file, start, end):
        raise OSError(f"{file}: boom")

    store = spans.SpanStore(fetch, budget=1 << 20)
    try:
        store.expect([("a", 0, 10), ("a", 10, 20)])
        for start in (0, 10):
            with pytest.raises(OSError, match="a: boom"):
                store.read("a", start, 10)
    finally:
        store.close()


def test_files_read_one_after_another_get_spans_of_half_the_budget_and_side_by_side_smaller():
    """4 MiB of budget: copies in file order read 2 MiB spans (one read, one fetched ahead);
    copies visiting two files side by side read 1 MiB spans (two per file fit)."""
    size = 3 << 20
    for order, expected in (("file", 4), ("side by side", 6)):
        data, calls, fetch = fake_files({"a": size, "b": size})
        store = spans.SpanStore(fetch, budget=4 << 20)
        try:
            pieces = [(file, at, at + (256 << 10)) for file in "ab" for at in range(0, size, 256 << 10)]
            ranges = pieces if order == "file" else sorted(pieces, key=lambda r: (r[1], r[0]))
            store.expect(ranges)
            for file, start, end in ranges:
                assert bytes(store.read(file, start, end - start)) == data[file][start:end]
            assert len(calls) == expected, (order, calls)
        finally:
            store.close()
