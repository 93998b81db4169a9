"""Object storage that fails now and then (issue 32): every S3 request type retried, and a
seeded subset of the reliability soak (`benchmarks/soak.py`) run on every test run.

The regression tests put `fault_proxy.FaultProxy` between the commands and a moto server and
script its faults: the first LIST page cut short (it was read as "malformed XML" and failed the
command), every LIST cut short (one line naming the URL after a bounded number of tries), a
CreateMultipartUpload whose answer is lost (botocore sends it again; the first upload was left
unfinished). A run SIGKILLed between the first and the last key of a multi-file S3 commit (and
after the last, before its commit record is removed) is killed at a `testpoints.pause`. The
soak subset, sharing one soak (sources, servers, fault-free references) with those, runs ~36
seeded points chosen so that every command meets every fault (SIGKILL, SIGTERM, S3 faults)
and runs on every store, and 12 disk-full points as root with `mount`; none may be dirty.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import FIXTURES

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

import soak_harness  # noqa: E402
from fault_proxy import FaultProxy  # noqa: E402
from storage_emulators import aws_environment, moto_s3  # noqa: E402

from ckpttool.store import s3  # noqa: E402
from ckpttool.cli import main  # noqa: E402

BUCKET = "faults"
SOURCE = FIXTURES / "fsdp2_world2"


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    """A moto server with SOURCE uploaded under s3://faults/src; yields (endpoint, s3fs on it)."""
    import s3fs

    with moto_s3() as endpoint, aws_environment(None):
        fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
        fs.call_s3("create_bucket", Bucket=BUCKET)
        for path in sorted(SOURCE.iterdir()):
            fs.put_file(str(path), f"{BUCKET}/src/{path.name}")
        yield endpoint, fs


def run_cli(proxy: FaultProxy, *args: str):
    """The CLI in this process, its S3 requests through `proxy` (a short read timeout: stalls end fast)."""
    from click.testing import CliRunner

    options = ["--storage-option", f"endpoint_url={proxy.endpoint}",
               "--storage-option", 'config_kwargs={"read_timeout": 2, "connect_timeout": 2}']
    return CliRunner().invoke(main, [*map(str, args), *options, "-q"])


def local_bytes(tmp_path: Path, *args: str) -> bytes:
    out = tmp_path / "local.safetensors"
    from click.testing import CliRunner

    assert CliRunner().invoke(main, ["consolidate", str(SOURCE), str(out), *args, "-q"]).exit_code == 0
    return out.read_bytes()


def test_a_list_page_cut_short_is_asked_again_and_the_output_is_byte_identical(moto, tmp_path):
    """Issue 32: the proxy sends the first LIST's headers (Content-Length promised) and part of
    its XML, then closes; the reader notices the body is short, as it does for a GET, and asks again."""
    endpoint, _ = moto
    out = tmp_path / "model.safetensors"
    with FaultProxy(endpoint, script={"LIST": ["short"]}) as proxy:
        result = run_cli(proxy, "consolidate", f"s3://{BUCKET}/src", out)
    assert result.exit_code == 0, result.output
    assert ("LIST", "short") in [(kind, fault) for kind, fault, _ in proxy.injected]
    assert proxy.counts["LIST"] >= 2
    assert out.read_bytes() == local_bytes(tmp_path)


@pytest.mark.parametrize("fault", ["short", "reset-mid", "stall"])
def test_a_list_that_always_fails_gives_one_line_naming_the_url_after_bounded_tries(moto, tmp_path, fault):
    """Every LIST cut short (or dropped mid-body, or stalled past the read timeout): exit 1 and one
    line naming the s3:// URL and what to do, after at most ATTEMPTS tries of ATTEMPTS requests."""
    endpoint, _ = moto
    with FaultProxy(endpoint, always={"LIST": fault}, stall=3.0) as proxy:
        result = run_cli(proxy, "consolidate", f"s3://{BUCKET}/src", tmp_path / "model.safetensors")
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"s3://{BUCKET}/src" in lines[0], result.output
    assert "run the command again" in lines[0]
    assert 2 <= proxy.counts["LIST"] <= s3.ATTEMPTS * s3.ATTEMPTS
    assert not (tmp_path / "model.safetensors").exists()


def test_a_multipart_upload_begun_twice_leaves_no_unfinished_upload(moto, tmp_path):
    """The proxy lets moto begin the first upload but cuts its answer: botocore begins another
    one, which the run completes; the first, whose id the run never saw, is aborted at the end
    (it would stay invisible and billed until a lifecycle rule removed it)."""
    endpoint, fs = moto
    key = f"{BUCKET}/orphan/model.safetensors"
    with FaultProxy(endpoint, script={"CREATE": ["reset-mid"]}) as proxy:
        result = run_cli(proxy, "consolidate", SOURCE, f"s3://{key}")
    assert result.exit_code == 0, result.output
    assert proxy.counts["CREATE"] == 2  # the fault happened: two uploads were begun
    fs.invalidate_cache()
    assert fs.cat_file(key) == local_bytes(tmp_path)
    assert fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix="orphan/").get("Uploads", []) == []
    assert [k for k in fs.find(f"{BUCKET}/orphan") if ".ckpttool-" in k] == []


def test_a_write_whose_requests_fail_now_and_then_uploads_the_local_bytes(moto, tmp_path):
    """A fault on 30% of the requests of a streamed Hub-folder upload (every kind of fault, every
    request type, seeded): retried within botocore's and s3fs's bounds, the same bytes as locally."""
    endpoint, fs = moto
    key = f"{BUCKET}/flaky/hub"
    with FaultProxy(endpoint, seed=3, rate=0.3, faults=("slowdown", "internal", "reset", "reset-mid", "short"),
                    ) as proxy:
        result = run_cli(proxy, "consolidate", f"s3://{BUCKET}/src", f"s3://{key}", "--max-shard-size", "2KB")
    assert result.exit_code == 0, result.output
    assert proxy.injected  # faults were injected
    local = tmp_path / "hub"
    from click.testing import CliRunner

    assert CliRunner().invoke(main, ["consolidate", str(SOURCE), str(local), "--max-shard-size", "2KB", "-q"]).exit_code == 0
    fs.invalidate_cache()
    assert {p.name: p.read_bytes() for p in local.iterdir()} == \
        {name.rsplit("/", 1)[1]: fs.cat_file(name) for name in fs.find(key)}
    assert fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix="flaky/").get("Uploads", []) == []


def test_sigterm_while_a_staged_upload_is_in_flight_leaves_no_temporary_key(moto):
    """The .pt output is staged: uploaded to a temporary key, then copied into place. SIGTERM
    arrives while that upload's PUT is held by the proxy: the run waits for it to end before
    cleaning up (it used to look first, find nothing, and exit while the PUT still went on
    to create the temporary key)."""
    import signal
    import subprocess
    import sys
    import time

    endpoint, fs = moto
    key = f"{BUCKET}/signal/model.pt"
    with FaultProxy(endpoint, script={"PUT": ["slow"]}, slow=3.0) as proxy:
        process = subprocess.Popen(
            [sys.executable, "-m", "ckpttool", "consolidate", str(SOURCE), f"s3://{key}", "-q",
             "--storage-option", f"endpoint_url={proxy.endpoint}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
        deadline = time.monotonic() + 60
        while not proxy.injected and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proxy.injected == [("PUT", "slow", proxy.injected[0][2])], process.communicate()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        while proxy.active and time.monotonic() < deadline:  # the held PUT reaches moto whatever the client does
            time.sleep(0.05)
    assert process.returncode == 143, stderr
    assert stderr.strip().splitlines() == ["interrupted by SIGTERM; nothing was left half-written"]
    fs.invalidate_cache()
    assert fs.find(f"{BUCKET}/signal") == []


# ---------------------------------------------------------------------------------------------
# The soak, a seeded subset


SEED = 32  # the number: any seed works
KINDS = ("sigkill", "sigterm", "s3")
STAGED_SHARDS = soak_harness.Command("shards-staged", "dcp", "hub", ("--max-shard-size", "64KB", "--verify"))


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    """One soak for the module: its sources, moto server, proxies, zygote and fault-free
    reference outputs are made once and shared by every test below."""
    with soak_harness.Soak(tmp_path_factory.mktemp("soak"), SEED, torchrun_share=0.0, jobs=2) as soak:
        yield soak


def spread(kinds: tuple[str, ...], mount_ok: bool) -> list[int]:
    """The first points of the seed that each bring a (fault, command) or a (command, store) not
    drawn before, until every one is: every command under every fault and on every store, in
    about 30 points (50 drawn at random left some out and repeated others)."""
    chosen, pairs = [], set()
    for index in range(2000):
        point = soak_harness.draw(SEED, index, mount_ok, 0.0, kinds)
        new = {(point.fault, point.command), (point.command, point.store)} - pairs
        if new:
            chosen.append(index)
            pairs |= new
    return chosen


def run_soak(soak, kinds: tuple[str, ...], points: list[int]) -> list:
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda index: soak.run_point(index, index % 2, kinds), points))


def dirty(outcomes: list, kinds: tuple[str, ...]) -> list[str]:
    replay = f"python benchmarks/soak.py --seed {SEED} --kinds {','.join(kinds)} --torchrun-share 0 --only"
    return [f"{o.point.describe()}: {'; '.join(o.reasons)} (replay: {replay} {o.point.index})"
            for o in outcomes if o.verdict == "dirty"]


@pytest.mark.parametrize("command", [soak_harness.BY_NAME["shards"], STAGED_SHARDS, soak_harness.BY_NAME["reshard"]],
                         ids=["shards-streamed", "shards-staged", "reshard-streamed"])
def test_sigkill_between_the_first_and_last_committed_key_is_undone_by_the_next_run(soak, command):
    """A directory's commit on S3 makes its keys visible one by one (S3 has no atomic commit of
    several): SIGKILL after the first one, before the index or .metadata. The keys left are each
    listed in the run's commit record, and the next run, without --force, removes them first
    (it used to fail: "already exists"), then writes the output byte-identical, nothing beside it."""
    outcome, left = soak.killed_at(command, "s3-dst", "commit-key")
    assert outcome.code == -9 and outcome.undone >= 1, left  # killed with keys visible: a partial output
    assert not any(name.endswith((".index.json", ".metadata")) for name in left["output"])
    assert set(left["output"]) <= left["listed"]
    assert outcome.reasons == [] and outcome.verdict == "clean failure", outcome.reasons


def test_a_complete_commit_whose_record_was_left_is_kept_by_the_next_run(soak):
    """SIGKILL after the last key was put, before the commit record was removed: the record's
    last key holds the recorded bytes, so the next run keeps the output (it needs --force to
    replace it, as for any output) and removes only the record."""
    command = soak_harness.BY_NAME["reshard"]
    outcome, left = soak.killed_at(command, "s3", "committed", recover=False)
    reference = soak.references[(command.name, "s3")]
    assert left["output"] == reference.hashes and [k for k in left["temps"] if soak_harness.RECORD_MARK in k]
    run = soak.run(command, "s3")
    assert run.code == 2 and "already exists; pass --force" in run.stderr, run.stderr
    after = soak.state(command, "s3")
    assert after["output"] == reference.hashes and after["temps"] == [] and after["uploads"] == []
    soak.clear(command, "s3")


def test_seeded_fault_points_over_every_command_and_store_are_identical_or_clean_failures(soak):
    """SIGKILL or SIGTERM at a random time, or S3 faults at a random rate and mix, over every
    command under every fault and on every store: each run is byte-identical to the fault-free
    one or a clean failure (one line, nothing at the destination, the source untouched), and
    the next run succeeds; an S3 point within the retry budget is byte-identical, never a failure."""
    points = spread(KINDS, soak.mount_ok)
    outcomes = run_soak(soak, KINDS, points)
    drawn = {(o.point.fault, o.point.command) for o in outcomes} | {(o.point.command, o.point.store) for o in outcomes}
    commands = soak_harness.COMMANDS
    assert drawn == {(fault, c.name) for fault in KINDS for c in commands if fault != "s3" or c.stores != ("local",)} \
        | {(c.name, store) for c in commands for store in c.stores}
    assert dirty(outcomes, KINDS) == [], "\n".join(dirty(outcomes, KINDS))
    verdicts = {o.verdict for o in outcomes}
    assert {"identical", "clean failure"} <= verdicts, soak_harness.table(outcomes)  # both kinds were reached
    # S3 faults no request met RETRY_BUDGET times are retried away: those runs succeed, byte-identical
    within = [o for o in outcomes if o.point.fault == "s3" and o.most_faults_on_one_request < soak_harness.RETRY_BUDGET]
    assert any(o.injected for o in within), soak_harness.table(outcomes)
    assert [o.point.describe() for o in within if o.verdict != "identical"] == []


@pytest.mark.skipif(not soak_harness.mount_available(), reason="the disk-full points mount a tmpfs: root and `mount` needed")
def test_a_disk_full_at_random_offsets_fails_cleanly(soak):
    """A tmpfs sized to fill at a random byte of the output (or of what is staged in TMPDIR)."""
    outcomes = run_soak(soak, ("disk-full",), list(range(1000, 1012)))
    assert dirty(outcomes, ("disk-full",)) == [], "\n".join(dirty(outcomes, ("disk-full",)))
    assert any(o.verdict == "clean failure" for o in outcomes), soak_harness.table(outcomes)
