"""Checkpoints on object storage: every command reads `s3://` sources by ranged GETs, and
consolidate/reshard write `s3://` destinations that appear only when complete.

Against a real S3-protocol server on 127.0.0.1 (moto's server mode, started once per
module); outputs are compared byte for byte with the same command run on local paths.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import FIXTURES

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from ckpttool.store import storage  # noqa: E402
from ckpttool.cli import main  # noqa: E402
from ckpttool.outputs import multipart  # noqa: E402
from storage_emulators import aws_environment, moto_s3  # noqa: E402

BUCKET = "ckpts"
SOURCE = FIXTURES / "fsdp2_world2"
TIMEOUT = 30
MARKER = "ckpttool-test: paused at "


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on a free port, the environment pointing at it, the fixture uploaded;
    yields an s3fs filesystem for looking at what the commands left."""
    import s3fs

    with moto_s3() as endpoint, aws_environment(endpoint):
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir(BUCKET)
        for folder, prefix in ((SOURCE, "src"), (FIXTURES / "dcp_hf_world2_consolidated", "hub")):
            for path in sorted(folder.iterdir()):
                fs.put_file(str(path), f"{BUCKET}/{prefix}/{path.name}")
        yield fs


def run_cli(*args) -> tuple[int, str, str]:
    from click.testing import CliRunner

    result = CliRunner().invoke(main, [*map(str, args), "--quiet"] if args[0] in ("consolidate", "reshard") else list(map(str, args)))
    stderr = result.stderr if hasattr(result, "stderr") else ""
    return result.exit_code, result.stdout, stderr


def files_of(root: Path) -> dict[str, bytes]:
    if root.is_file():
        return {"": root.read_bytes()}
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def remote_files(fs, key: str) -> dict[str, bytes]:
    fs.invalidate_cache()
    if fs.isfile(key):
        return {"": fs.cat_file(key)}
    return {name[len(key) + 1:]: fs.cat_file(name) for name in sorted(fs.find(key))}


class GetLog:
    """Every GetObject request the process's S3 reader sends, with its Range header."""

    def __init__(self):
        self.requests: list[tuple[str, str | None]] = []


@pytest.fixture
def get_log(s3, monkeypatch):
    from ckpttool.store import s3 as native

    log = GetLog()
    real_open = native.S3Client._open

    def logged(self, method, bucket, key, query=None, headers=None):
        if method == "GET" and key:
            log.requests.append((self.url(bucket, key), (headers or {}).get("range")))
        return real_open(self, method, bucket, key, query, headers)

    monkeypatch.setattr(native.S3Client, "_open", logged)
    return log


# ---------------------------------------------------------------------------------------------
# Reading from S3


def test_inspect_of_an_s3_checkpoint_matches_the_local_one(s3):
    local_code, local, _ = run_cli("inspect", SOURCE, "--json")
    code, remote, err = run_cli("inspect", f"s3://{BUCKET}/src", "--json")
    assert (code, local_code) == (0, 0), err
    local_doc, remote_doc = json.loads(local), json.loads(remote)
    assert json.dumps(remote_doc).replace(f"s3://{BUCKET}/src", str(SOURCE)) == json.dumps(local_doc)


def test_validate_deep_reads_an_s3_checkpoint_with_the_endpoint_as_a_storage_option(s3, monkeypatch):
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    code, out, _ = run_cli("validate", f"s3://{BUCKET}/src", "--deep", "--json", "--storage-option", f"endpoint_url={endpoint}")
    assert code == 0, out
    assert json.loads(out)["valid"] is True
    assert json.loads(out)["problems"] == []  # each file is the one the metadata names (no "unreferenced-file")


@pytest.mark.parametrize("name", ["model.safetensors", "hub"])
def test_consolidate_from_s3_is_byte_identical_to_the_local_run(s3, tmp_path, get_log, name):
    extra = ["--max-shard-size", "20KB"] if name == "hub" else []
    assert run_cli("consolidate", SOURCE, tmp_path / "local" / name, *extra)[0] == 0
    code, out, err = run_cli("consolidate", f"s3://{BUCKET}/src", tmp_path / "remote" / name, *extra)
    assert code == 0, out + err
    assert files_of(tmp_path / "remote" / name) == files_of(tmp_path / "local" / name)
    data_reads = [(url, r) for url, r in get_log.requests if url.endswith(".distcp")]
    assert data_reads and all(r is not None and r.startswith("bytes=") for _, r in data_reads), get_log.requests
    assert all(r is not None for _, r in get_log.requests), "an object was downloaded whole"


def test_an_uncoalesced_read_from_s3_is_one_get_streamed_through_a_small_buffer(s3, get_log, monkeypatch):
    """Without a budget for coalesced spans (`DataFiles` as validate and export open it), a
    range is one GET whose body is read into the piece buffer as it arrives (here 64 bytes)."""
    from ckpttool.store import s3 as native
    from ckpttool.dcp.blobs import DataFiles

    fills = []
    real_pieces = native.S3Client.pieces

    def pieces(self, bucket_key, offset, length, buffer):
        for view in real_pieces(self, bucket_key, offset, length, buffer):
            fills.append(len(view))
            yield view

    monkeypatch.setattr(native.S3Client, "pieces", pieces)
    name = sorted(p.name for p in SOURCE.glob("*.distcp"))[0]
    expected = (SOURCE / name).read_bytes()[100:1100]
    with DataFiles(storage.location(f"s3://{BUCKET}/src")) as files:
        assert not files.coalesced
        got = b"".join(bytes(view) for view in files.pieces(name, 100, 1000, memoryview(bytearray(64))))
        assert files.requests == 1
    assert got == expected
    assert max(fills) == 64 and len(fills) == 16, "read into the piece buffer, never the whole range at once"
    assert [r for _, r in get_log.requests] == ["bytes=100-1099"]


def test_a_copy_from_coalesced_spans_is_written_in_pieces(s3, tmp_path, get_log, monkeypatch):
    """consolidate from S3 fetches whole spans and writes each copy from them in views of at
    most `storage.PIECE` bytes (here 64)."""
    monkeypatch.setattr(storage, "PIECE", 64)
    from ckpttool.store import io as moving

    writes = []
    real_write_at = moving.write_at

    def write_at(fd, data, offset):
        writes.append(len(data))
        real_write_at(fd, data, offset)

    monkeypatch.setattr("ckpttool.run.execute.write_at", write_at)
    assert run_cli("consolidate", SOURCE, tmp_path / "local.safetensors", "--threads", "1")[0] == 0
    writes.clear()
    code, out, err = run_cli("consolidate", f"s3://{BUCKET}/src", tmp_path / "remote.safetensors", "--threads", "1")
    assert code == 0, out + err
    assert (tmp_path / "remote.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    assert writes and max(writes) == 64
    data_gets = [r for url, r in get_log.requests if url.endswith(".distcp")]
    assert len(data_gets) == len(list(SOURCE.glob("*.distcp"))), "one span per data file"


def test_consolidate_of_an_s3_hub_folder_reads_safetensors_headers_by_range(s3, tmp_path, get_log):
    source = FIXTURES / "dcp_hf_world2_consolidated"
    assert run_cli("consolidate", source, tmp_path / "local.safetensors")[0] == 0
    code, out, _ = run_cli("consolidate", f"s3://{BUCKET}/hub", tmp_path / "remote.safetensors")
    assert code == 0, out
    assert (tmp_path / "remote.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    assert get_log.requests and all(r is not None for _, r in get_log.requests)


def test_reshard_from_s3_is_byte_identical_to_the_local_run(s3, tmp_path):
    assert run_cli("reshard", SOURCE, tmp_path / "out", "--world", "3")[0] == 0
    local = files_of(tmp_path / "out")
    os.rename(tmp_path / "out", tmp_path / "local")
    code, out, _ = run_cli("reshard", f"s3://{BUCKET}/src", tmp_path / "out", "--world", "3")
    assert code == 0, out
    assert files_of(tmp_path / "out") == local


# ---------------------------------------------------------------------------------------------
# Writing to S3


@pytest.mark.parametrize("source", ["local", "s3"])
def test_consolidate_to_s3_uploads_the_same_bytes(s3, tmp_path, source):
    src = SOURCE if source == "local" else f"s3://{BUCKET}/src"
    assert run_cli("consolidate", SOURCE, tmp_path / "model.safetensors")[0] == 0
    assert run_cli("consolidate", SOURCE, tmp_path / "hub", "--max-shard-size", "20KB")[0] == 0
    key = f"{BUCKET}/out-{source}"
    assert run_cli("consolidate", src, f"s3://{key}/model.safetensors")[0] == 0
    assert run_cli("consolidate", src, f"s3://{key}/hub", "--max-shard-size", "20KB")[0] == 0
    assert remote_files(s3, f"{key}/model.safetensors") == files_of(tmp_path / "model.safetensors")
    assert remote_files(s3, f"{key}/hub") == files_of(tmp_path / "hub")
    assert not [k for k in s3.find(BUCKET) if ".ckpttool-" in k]
    code, _, err = run_cli("consolidate", src, f"s3://{key}/model.safetensors")
    assert code == 2 and "already exists" in err


class PartLog:
    """(key, part number, bytes) of every UploadPart the process's s3 client sends."""

    def __init__(self):
        self.parts: list[tuple[str, int, int]] = []

    def __call__(self, params, **kwargs):
        self.parts.append((params["Key"], params["PartNumber"], len(params["Body"])))


@pytest.mark.parametrize("command", ["safetensors", "hub", "reshard"])
def test_streamed_outputs_are_sent_in_parts_as_they_fill_and_equal_the_local_bytes(s3, tmp_path, monkeypatch, command):
    """With 256-byte parts (S3 allows 5 MiB; the server is told 256), every output file is many
    parts, cut anywhere in a tensor, filled by 4 threads at once; the object is the local bytes."""
    import moto.s3.models

    monkeypatch.setattr(multipart, "PART", 256)
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 256)
    args = {"safetensors": ["consolidate", SOURCE, "{out}/model.safetensors"],
            "hub": ["consolidate", SOURCE, "{out}/hub", "--max-shard-size", "20KB"],
            "reshard": ["reshard", SOURCE, "{out}/world3", "--world", "3"]}[command]
    local, key = tmp_path, f"{BUCKET}/parts-{command}"
    assert run_cli(*[str(a).format(out=local) for a in args])[0] == 0
    fs = storage.open_filesystem("s3")
    fs.connect()
    log = PartLog()
    fs.s3.meta.events.register("provide-client-params.s3.UploadPart", log)
    try:
        code, out, err = run_cli(*[str(a).format(out=f"s3://{key}") for a in args], "--threads", "4")
    finally:
        fs.s3.meta.events.unregister("provide-client-params.s3.UploadPart", log)
    assert code == 0, out + err
    name = Path(args[2]).name
    written, uploaded = files_of(local / name), remote_files(s3, f"{key}/{name}")
    if command == "reshard":  # .metadata names where it was written
        assert uploaded.pop(".metadata")[:2] == written.pop(".metadata")[:2]
        assert run_cli("validate", f"s3://{key}/{name}", "--deep")[0] == 0
    assert uploaded == written
    by_key: dict[str, dict[int, int]] = {}
    for part_key, number, size in log.parts:
        by_key.setdefault(part_key, {})[number] = size
    assert len(log.parts) > 10
    for sizes in by_key.values():  # every part but the last is whole
        assert sorted(sizes) == list(range(1, len(sizes) + 1))
        assert all(size == 256 for number, size in sizes.items() if number < len(sizes))
    assert unfinished_uploads(s3, key) == []


def test_force_replaces_a_remote_checkpoint_leaving_none_of_the_old_keys(s3, tmp_path):
    key = f"{BUCKET}/replaced"
    assert run_cli("reshard", SOURCE, f"s3://{key}", "--world", "3")[0] == 0
    assert run_cli("reshard", SOURCE, tmp_path / "world2", "--world", "2")[0] == 0
    code, out, err = run_cli("reshard", SOURCE, f"s3://{key}", "--world", "2", "--force")
    assert code == 0, out + err
    uploaded = remote_files(s3, key)
    assert sorted(uploaded) == sorted(files_of(tmp_path / "world2"))  # __2_0.distcp of world 3 is gone
    assert run_cli("validate", f"s3://{key}", "--deep")[0] == 0


def test_reshard_s3_to_s3_writes_the_local_bytes_and_reads_back(s3, tmp_path):
    assert run_cli("reshard", SOURCE, tmp_path / "out", "--world", "3")[0] == 0
    code, out, _ = run_cli("reshard", f"s3://{BUCKET}/src", f"s3://{BUCKET}/resharded", "--world", "3")
    assert code == 0, out
    uploaded = remote_files(s3, f"{BUCKET}/resharded")
    assert uploaded.keys() == files_of(tmp_path / "out").keys()
    assert {k: v for k, v in uploaded.items() if k != ".metadata"} == \
        {k: v for k, v in files_of(tmp_path / "out").items() if k != ".metadata"}
    assert run_cli("validate", f"s3://{BUCKET}/resharded", "--deep")[0] == 0


# ---------------------------------------------------------------------------------------------
# Interrupted uploads


def run_until_upload(destination: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "CKPTTOOL_TEST_PAUSE": f"upload:{TIMEOUT}"}
    process = subprocess.Popen(
        [sys.executable, "-m", "ckpttool", "consolidate", str(SOURCE), destination, "--max-shard-size", "20KB",
         "--quiet", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL),
    )
    watchdog = threading.Timer(TIMEOUT, process.kill)
    watchdog.start()
    early = []
    while (line := process.stderr.readline()) and line.strip() != MARKER + "upload":
        early.append(line)
    watchdog.cancel()
    assert line, f"exited {process.wait()} before pausing: {''.join(early)}"
    return process


def unfinished_uploads(fs, prefix: str) -> list[str]:
    """Keys of multipart uploads begun under `prefix` and neither completed nor aborted."""
    listing = fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix=prefix[len(BUCKET) + 1:])
    return [upload["Key"] for upload in listing.get("Uploads", [])]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_an_interrupted_streamed_upload_leaves_nothing_at_the_destination(s3, signum):
    """A Hub folder streams: each shard is a multipart upload to its final key, invisible
    until the commit completes it; SIGTERM aborts them, SIGKILL leaves them unfinished
    (invisible) beside an empty key naming the run, and the next run aborts them."""
    key = f"{BUCKET}/streamed-{signum}/hub"
    process = run_until_upload(f"s3://{key}")
    assert unfinished_uploads(s3, key)  # the first part of the first shard is sent
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=TIMEOUT)
    s3.invalidate_cache()
    assert not s3.exists(key)
    marker = [k for k in s3.find(f"{BUCKET}/streamed-{signum}") if ".ckpttool-tmp-" in k]
    if signum == signal.SIGTERM:
        assert process.returncode == 128 + signum, stderr
        assert unfinished_uploads(s3, key) == [] and marker == []
    else:  # the next run to write there aborts the uploads and removes the marker the killed run left
        assert unfinished_uploads(s3, key) and len(marker) == 1
        code, _, err = run_cli("consolidate", SOURCE, f"s3://{key}", "--max-shard-size", "20KB")
        assert code == 0 and "removed stale temp s3://" in err, err
        s3.invalidate_cache()
        assert unfinished_uploads(s3, key) == []
        assert not [k for k in s3.find(f"{BUCKET}/streamed-{signum}") if ".ckpttool-tmp-" in k]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_an_interrupted_staged_upload_leaves_nothing_at_the_destination(s3, signum):
    """With --verify the output is built and checked locally, then uploaded to a temporary
    key: SIGTERM deletes it, SIGKILL leaves it (never an object at the destination)."""
    key = f"{BUCKET}/killed-{signum}/hub"
    process = run_until_upload(f"s3://{key}", "--verify")
    s3.invalidate_cache()
    assert [k for k in s3.find(BUCKET) if ".ckpttool-tmp-hub" in k]  # the first file is uploaded to its temp key
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=TIMEOUT)
    s3.invalidate_cache()
    assert not s3.exists(key)
    temps = [k for k in s3.find(f"{BUCKET}/killed-{signum}") if ".ckpttool-tmp-" in k]
    if signum == signal.SIGTERM:
        assert process.returncode == 128 + signum, stderr
        assert temps == []
    else:
        assert temps  # SIGKILL: nothing can clean up; the temporary keys remain (never the destination)
        code, _, err = run_cli("consolidate", SOURCE, f"s3://{key}", "--max-shard-size", "20KB")
        assert code == 0 and "removed stale temp s3://" in err and f"pid {process.pid}" in err, err
        s3.invalidate_cache()
        assert not [k for k in s3.find(f"{BUCKET}/killed-{signum}") if ".ckpttool-tmp-" in k]


# ---------------------------------------------------------------------------------------------
# Failures: one line, exit 1


def test_a_missing_bucket_exits_1_with_one_line(s3, tmp_path):
    code, _, err = run_cli("consolidate", "s3://no-such-bucket/src", tmp_path / "m.safetensors")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "no-such-bucket" in err, err


@pytest.mark.parametrize("source", ["local", "s3"])
def test_a_missing_destination_bucket_fails_before_any_work(s3, get_log, monkeypatch, source):
    """No data file of the source is opened (a local fd, or a remote reader) and none is
    requested (a GET of a .distcp); the same command into a bucket that exists does both."""
    from ckpttool.dcp.blobs import DataFiles

    opened = []
    real_fd, real_reader = DataFiles.fd, DataFiles._reader

    def fd(files, relative):
        opened.append(relative)
        return real_fd(files, relative)

    def remote_reader(files, relative):
        opened.append(relative)
        return real_reader(files, relative)

    monkeypatch.setattr(DataFiles, "fd", fd)
    monkeypatch.setattr(DataFiles, "_reader", remote_reader)
    src = SOURCE if source == "local" else f"s3://{BUCKET}/src"
    code, _, err = run_cli("consolidate", src, "s3://no-such-bucket/model.safetensors")
    assert code == 1 and "[no-bucket]" in err and len(err.strip().splitlines()) == 1, err
    assert opened == []
    assert [url for url, _ in get_log.requests if url.endswith(".distcp")] == []
    code, _, err = run_cli("consolidate", src, f"s3://{BUCKET}/before-any-work-{source}/model.safetensors")
    assert code == 0, err
    assert sorted(set(opened)) == sorted(p.name for p in SOURCE.glob("*.distcp"))
    assert bool([url for url, _ in get_log.requests if url.endswith(".distcp")]) == (source == "s3")


def test_a_missing_key_exits_1_with_one_line(s3, tmp_path):
    code, _, err = run_cli("inspect", f"s3://{BUCKET}/no-such-checkpoint")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "no-such-checkpoint" in err, err


def test_wrong_credentials_exit_1_with_one_line(s3, tmp_path, monkeypatch):
    from moto import settings

    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server now checks access keys
    result = subprocess.run([sys.executable, "-m", "ckpttool", "inspect", f"s3://{BUCKET}/src"],
                            capture_output=True, text=True, timeout=TIMEOUT,
                            env={**os.environ, "AWS_ACCESS_KEY_ID": "wrong", "AWS_SECRET_ACCESS_KEY": "wrong"})
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "access denied" in result.stderr


def test_a_missing_backend_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    with pytest.raises(storage.StorageError, match=r"pip install 'ckpttool\[gcs\]'"):
        storage.location("gs://bucket/ckpt")


# ---------------------------------------------------------------------------------------------
# torchrun: every process sends parts of the same uploads


def test_torchrun_processes_upload_parts_of_one_output_and_commit_only_together(s3, tmp_path, monkeypatch):
    """3 real torchrun processes (gloo) write S3 outputs: each sends the 1000-byte parts its
    share fills, the parts at the edges of shares are summed onto rank 0, rank 0 completes the
    uploads. The objects equal a single local process's bytes; then a rank killed mid-copy
    leaves no object, no marker and no unfinished upload. One job runs the three cases in
    turn (tests/torchrun_cases.py): torch starts once per process."""
    import moto.s3.models

    from torchrun_cases import MARK

    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 1000)
    source = FIXTURES / "fsdp2_world2_adamw"
    cases = {  # name: (ckpttool args with {out}, env per rank)
        "safetensors": (["consolidate", source, "{out}/model.safetensors", "--json", "--quiet"], {}),
        "reshard": (["reshard", source, "{out}/world3", "--world", "3", "--json", "--quiet"], {}),
        "killed": (["reshard", source, "{out}/world3", "--world", "3", "--quiet"],
                   {"1": {"CKPTTOOL_TEST_FAIL": "1:kill"}}),
    }
    spec = {"results": str(tmp_path), "cases": [
        {"name": name, "args": [str(a).format(out=f"s3://{BUCKET}/torchrun-{name}") for a in args], "env": env}
        for name, (args, env) in cases.items()]}
    (tmp_path / "cases.json").write_text(json.dumps(spec))
    job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                          str(Path(__file__).with_name("torchrun_cases.py")), str(tmp_path / "cases.json")],
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "CKPTTOOL_PART_SIZE": "1000", "OMP_NUM_THREADS": "1"})
    assert job.returncode != 0, "rank 1 was killed in the last case"
    outputs = dict(part.split("\n", 1) for part in job.stdout.split(MARK)[1:])
    codes = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    for name in ("safetensors", "reshard"):
        assert [c[name] for c in codes] == [0, 0, 0], job.stderr[-3000:]
        assert [p["rank"] for p in json.loads(outputs[name])["processes"]] == [0, 1, 2]
        args = cases[name][0]
        local = tmp_path / name
        assert run_cli(*[str(a).format(out=local) for a in args[:-2]])[0] == 0
        output = Path(args[2]).name
        written, uploaded = files_of(local / output), remote_files(s3, f"{BUCKET}/torchrun-{name}/{output}")
        if name == "reshard":  # .metadata names where it was written
            uploaded.pop(".metadata"), written.pop(".metadata")
            assert run_cli("validate", f"s3://{BUCKET}/torchrun-{name}/{output}", "--deep")[0] == 0
        assert uploaded == written
    assert "ckpttool-test: rank 1 fails" in job.stderr
    s3.invalidate_cache()
    assert not s3.exists(f"{BUCKET}/torchrun-killed")
    assert unfinished_uploads(s3, f"{BUCKET}/torchrun-killed") == []


def test_a_multipart_sink_sends_each_part_once_and_refuses_bytes_for_a_sent_part(monkeypatch):
    """No server needed: a stand-in filesystem records the requests a MultipartSink makes."""

    class Recorder:
        def __init__(self):
            self.calls = []

        def split_path(self, key):
            bucket, _, path = key.partition("/")
            return bucket, path, None

        def call_s3(self, method, **params):
            self.calls.append((method, params.get("PartNumber"), bytes(params.get("Body") or b"")))
            return {"UploadId": "u1", "ETag": f"e{params.get('PartNumber')}"}

    monkeypatch.setattr(multipart, "PART", 8)
    fs = Recorder()
    sink = multipart.MultipartSink(fs, "bucket/model.safetensors", "s3://bucket/model.safetensors")
    sink.reserve(20)
    sink.write_at(b"abcdefgh", 0)  # part 1 full: sent at once
    sink.write_at(b"ijkl", 8)  # part 2 half full: kept
    with pytest.raises(OSError, match="written after their part was sent"):
        sink.write_at(b"x", 3)
    sink.finish()  # part 2 (bytes 12..16 never written: zeros) and part 3
    sink.complete()
    assert [c[:2] for c in fs.calls] == [("create_multipart_upload", None), ("upload_part", 1), ("upload_part", 2),
                                         ("upload_part", 3), ("complete_multipart_upload", None)]
    assert [c[2] for c in fs.calls[1:4]] == [b"abcdefgh", b"ijkl\0\0\0\0", b"\0\0\0\0"]


def test_reading_s3_imports_neither_s3fs_nor_botocore_nor_torch(s3, tmp_path):
    """What keeps a consolidate from S3 near the memory of a local one (s3fs and aiobotocore
    alone cost 64 MB): the S3 reader is the standard library's."""
    script = ("import sys\n"
              "from ckpttool.cli import main\n"
              "try:\n"
              "    main(sys.argv[1:])\n"
              "except SystemExit as exit:\n"
              "    assert not exit.code, exit.code\n"
              "print(sorted(m for m in ('s3fs', 'botocore', 'aiobotocore', 'fsspec', 'torch') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", script, "consolidate", f"s3://{BUCKET}/src",
                             str(tmp_path / "m.safetensors"), "--quiet"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "m.safetensors").stat().st_size > 0


def test_a_commit_failing_half_way_deletes_what_it_had_made_visible(s3, monkeypatch):
    """The second of a Hub folder's shards fails to complete: the first, already visible, is
    deleted again, the rest aborted; the destination stays empty."""
    completed = []
    real_complete = multipart.MultipartSink.complete

    def complete(sink):
        if completed:
            raise OSError("injected: CompleteMultipartUpload failed")
        completed.append(sink.key)
        real_complete(sink)

    monkeypatch.setattr(multipart.MultipartSink, "complete", complete)
    key = f"{BUCKET}/half-committed/hub"
    code, _, err = run_cli("consolidate", SOURCE, f"s3://{key}", "--max-shard-size", "1KB")
    assert code == 1 and "injected" in err, err
    assert completed, "one shard was completed before the failure"
    s3.invalidate_cache()
    assert not s3.exists(key) and unfinished_uploads(s3, key) == []
    assert not [k for k in s3.find(f"{BUCKET}/half-committed") if ".ckpttool-" in k]


def test_a_staged_commit_failing_half_way_deletes_what_it_had_made_visible(s3, monkeypatch):
    """The same with --verify (built locally, then copied from temporary keys): the second
    copy fails, the first is deleted again, the temporary keys too."""
    import s3fs

    copied = []
    real_copy = s3fs.S3FileSystem._cp_file  # what fs.copy runs (its sync wrapper may be bound per instance)

    async def copy(fs, path1, path2, **kwargs):
        if copied:
            raise OSError("injected: CopyObject failed")
        copied.append(path2)
        return await real_copy(fs, path1, path2, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_cp_file", copy)
    key = f"{BUCKET}/half-copied/hub"
    code, _, err = run_cli("consolidate", SOURCE, f"s3://{key}", "--max-shard-size", "1KB", "--verify")
    assert code == 1 and "injected" in err, err
    assert copied, "one file was copied into place before the failure"
    s3.invalidate_cache()
    assert not s3.exists(key)
    assert not [k for k in s3.find(f"{BUCKET}/half-copied") if ".ckpttool-" in k]
