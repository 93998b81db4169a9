"""`ckpttool push SRC REPO_ID`: to a Hub stand-in on 127.0.0.1 (tests/hub_server.py), then
back with huggingface_hub's own `hf_hub_download`; no test touches the internet.

A Hub folder goes up as it is; a DCP checkpoint is exported to a temporary folder first, gone
afterwards however the push ends; `--dry-run` contacts no Hub; a wrong token and a Hub that is
down each exit 1 with one line saying what to do."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import FIXTURES
from hub_server import HubServer
from ports import closed_port
from ckpttool.options import ConvertOptions, WriteOptions
from ckpttool.commands.consolidate import consolidate
from ckpttool.commands.export import export
from ckpttool.commands.push import push
from ckpttool.core.errors import HubError

TOKEN = "hf_stand_in_valid_token"
SOURCE = FIXTURES / "fsdp2_world2"
CKPTTOOL = Path(sys.executable).with_name("ckpttool")
LOOPBACK = "http://127.0.0.1:"


@pytest.fixture(scope="session")
def hub_server():
    with HubServer(token=TOKEN) as server:
        assert server.url.startswith(LOOPBACK)
        yield server


@pytest.fixture
def hub(hub_server, tmp_path, monkeypatch) -> HubServer:
    """huggingface_hub pointed at the stand-in, as HF_ENDPOINT and HF_TOKEN would point it
    (set in the environment for subprocesses, and in its already-imported constants for this
    process); no stored login; exports staged in a directory of this test."""
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setattr(constants, "ENDPOINT", hub_server.url)  # and what huggingface_hub derives from it
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub_server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(socket, "getaddrinfo", loopback_only(socket.getaddrinfo))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    staging = tmp_path / "staging"
    staging.mkdir()
    monkeypatch.setenv("TMPDIR", str(staging))
    monkeypatch.setattr(tempfile, "tempdir", str(staging))
    hub_server.refuse_commits, hub_server.hold_commits = None, 0.0
    assert constants.ENDPOINT.startswith(LOOPBACK)  # never the internet
    return hub_server


@pytest.fixture(scope="session")
def hub_folder(tmp_path_factory) -> Path:
    """SOURCE as Hub shards of at most 2 kB plus the index, with a config and a model card."""
    folder = tmp_path_factory.mktemp("push") / "hub"
    consolidate(SOURCE, folder, convert=ConvertOptions(max_shard_size="2kB"))
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt", "vocab_size": 64}))
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    return folder


def downloaded(hub: HubServer, repo_id: str, revision: str, path: str, cache: Path) -> bytes:
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo_id, path, revision=revision, endpoint=hub.url, token=TOKEN,
                                cache_dir=cache)).read_bytes()


def staged(hub_fixture_tmp: Path) -> list[str]:
    return sorted(os.listdir(hub_fixture_tmp / "staging"))


def loopback_only(getaddrinfo):
    """socket.getaddrinfo that refuses every host but 127.0.0.1 at once: no test reaches,
    or waits for, the internet."""

    def resolve(host, *args, **kwargs):
        if host not in ("127.0.0.1", b"127.0.0.1"):
            raise socket.gaierror(socket.EAI_NONAME, f"{host}: tests/test_push.py allows 127.0.0.1 only")
        return getaddrinfo(host, *args, **kwargs)

    return resolve


def test_push_of_a_hub_folder_downloads_back_byte_identical(hub, hub_folder, tmp_path):
    report = push(hub_folder, "tester/tiny-hub", commit_message="step 2")

    names = sorted(p.name for p in hub_folder.iterdir())
    assert len([n for n in names if n.endswith(".safetensors")]) > 1 and "model.safetensors.index.json" in names
    assert [f.path for f in report.files] == names and not report.exported
    assert report.endpoint.startswith(LOOPBACK) and report.repo_id == "tester/tiny-hub"
    assert report.total_bytes == sum((hub_folder / n).stat().st_size for n in names)
    commit = hub.commits[-1]
    assert (commit.repo_id, commit.revision, commit.summary) == ("tester/tiny-hub", "main", "step 2")
    assert report.commit_oid == commit.oid and report.commit_url.endswith(f"/tester/tiny-hub/commit/{commit.oid}")
    for name in names:
        assert downloaded(hub, "tester/tiny-hub", commit.oid, name, tmp_path / "cache") == (hub_folder / name).read_bytes()


def test_push_of_a_dcp_checkpoint_exports_to_a_temporary_folder_removed_afterwards(hub, tmp_path):
    report = push(SOURCE, "tiny-dcp")  # a bare name goes under the token's user

    assert report.exported and report.repo_id == "tester/tiny-dcp" and report.layout == "dcp"
    reference = export(SOURCE, tmp_path / "reference")
    assert [(f.path, f.size) for f in report.files] == sorted(reference.files)
    assert "model.safetensors" in {f.path for f in report.files}
    for name, _ in reference.files:
        content = downloaded(hub, "tester/tiny-dcp", report.commit_oid, name, tmp_path / "cache")
        assert content == (tmp_path / "reference" / name).read_bytes(), name
    assert staged(tmp_path) == []


def test_temporary_export_is_removed_when_the_upload_fails(hub, tmp_path):
    hub.refuse_commits = 403
    commits = len(hub.commits)

    with pytest.raises(HubError) as failure:
        push(SOURCE, "tester/refused")

    assert failure.value.code == "hub-auth" and "\n" not in str(failure.value)
    assert staged(tmp_path) == [] and len(hub.commits) == commits


def test_revision_names_a_branch_created_from_main(hub, cli, hub_folder):
    result = cli("push", hub_folder, "tester/branched", "--revision", "dev", "--json")

    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)
    repo = hub.repos["tester/branched"]
    assert document["revision"] == "dev" and repo.branches["dev"] == document["commit_oid"]
    assert repo.trees[repo.branches["main"]] == {}  # main untouched


@pytest.mark.parametrize("source", ["hub-folder", "dcp"])
def test_dry_run_lists_files_and_contacts_no_hub(hub, cli, hub_folder, tmp_path, source):
    requests = len(hub.requests)
    src = hub_folder if source == "hub-folder" else SOURCE

    result = cli("push", src, "tester/never", "--dry-run", "--json")

    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["dry_run"] and document["commit_oid"] is None
    if source == "hub-folder":
        expected = sorted((p.name, p.stat().st_size) for p in hub_folder.iterdir())
    else:
        expected = sorted(export(SOURCE, tmp_path / "planned", write=WriteOptions(dry_run=True)).files)
    assert [(f["path"], f["bytes"]) for f in document["files"]] == expected
    assert len(hub.requests) == requests and "tester/never" not in hub.repos and staged(tmp_path) == []
    text = cli("push", src, "tester/never", "--dry-run")
    assert text.exit_code == 0 and "dry run: nothing was exported, created or uploaded" in text.stdout
    assert len(hub.requests) == requests


def test_wrong_token_exits_1_with_one_line(hub, cli, hub_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_not_the_right_one")

    result = cli("push", SOURCE, "tester/wrong-token")

    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.startswith("error: [hub-auth] ") and result.stderr.count("\n") == 1
    assert "HF_TOKEN" in result.stderr and "hf auth login" in result.stderr
    assert "tester/wrong-token" not in hub.repos and staged(tmp_path) == []  # failed before exporting


def test_hub_that_is_down_exits_1_with_one_line(hub, cli, hub_folder, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")

    result = cli("push", hub_folder, "tester/down")

    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.startswith("error: [hub-unreachable] http://127.0.0.1:") and result.stderr.count("\n") == 1
    assert "HF_ENDPOINT" in result.stderr


def test_json_document_of_a_push(hub, cli, hub_folder):
    result = cli("push", hub_folder, "tester/tiny-json", "--json", "--commit-message", "from ckpttool", "--private")

    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["schema"] == "ckpttool.push/1"
    assert document["endpoint"].startswith(LOOPBACK) and document["repo_id"] == "tester/tiny-json"
    assert (document["revision"], document["method"], document["exported"], document["dry_run"]) == \
        ("main", "upload_folder", False, False)
    assert document["commit_oid"] == hub.commits[-1].oid and hub.commits[-1].summary == "from ckpttool"
    assert hub.repos["tester/tiny-json"].private
    assert document["total_bytes"] == sum(f["bytes"] for f in document["files"])
    assert {f["path"]: f["bytes"] for f in document["files"]} == \
        {name: len(content) for name, content in hub.commits[-1].files.items()}


def test_installed_ckpttool_reads_hf_endpoint_and_hf_token_from_the_environment(hub, hub_folder, tmp_path):
    result = subprocess.run([CKPTTOOL, "push", hub_folder, "tester/tiny-env", "--quiet"],
                            capture_output=True, text=True, timeout=120)

    assert result.returncode == 0, result.stderr
    assert f"to tester/tiny-env@main on {hub.url}" in result.stdout
    assert hub.commits[-1].repo_id == "tester/tiny-env"


def default_sigint() -> None:
    """SIGINT's default action in the child, even when the suite inherited it ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interrupted_push_removes_its_temporary_export(hub, tmp_path):
    """SIGINT while the commit is in flight: exit 130, nothing left in TMPDIR."""
    hub.hold_commits = 3.0  # seconds the stand-in waits before answering a commit
    process = subprocess.Popen([CKPTTOOL, "push", SOURCE, "tester/interrupted", "--quiet"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 60
        while not any(path.endswith("/interrupted/commit/main") for _, path in hub.requests):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
        assert os.listdir(tmp_path / "staging")  # the export is there while the upload runs
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        hub.hold_commits = 0.0
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr
    assert "interrupted by SIGINT" in stderr and staged(tmp_path) == []


def test_a_broken_folder_is_refused_before_the_hub_is_contacted(hub, cli, hub_folder, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(hub_folder, broken)
    (broken / "model-00002-of-00002.safetensors").unlink()
    requests = len(hub.requests)

    result = cli("push", broken, "tester/broken")

    assert result.exit_code == 1 and result.stderr.startswith("error: [") and result.stderr.count("\n") == 1
    assert "model-00002-of-00002.safetensors" in result.stderr
    assert len(hub.requests) == requests and "tester/broken" not in hub.repos


def test_a_repository_the_hub_does_not_know_exits_1_with_one_line(hub, cli, hub_folder):
    hub.refuse_commits = 404  # the Hub answers "Repository not found", as for a repo deleted meanwhile

    result = cli("push", hub_folder, "tester/vanished")

    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.startswith("error: [hub-not-found] ") and result.stderr.count("\n") == 1


def test_push_of_an_exported_lora_adapter_loads_in_peft_from_the_hub(hub, tmp_path):
    """`export --adapter` then `push`: the adapter folder goes up like any folder, and PEFT
    loads the downloaded snapshot onto the base, giving the trained model's logits exactly."""
    peft = pytest.importorskip("peft")
    import torch
    import transformers
    from safetensors.torch import load_file

    from ckpttool.commands.export_adapter import export_adapter

    fixture = FIXTURES / "peft" / "attention"
    export_adapter(fixture / "checkpoint", tmp_path / "adapter", assets=fixture / "adapter")
    report = push(tmp_path / "adapter", "tester/tiny-lora", commit_message="adapter")
    names = sorted(path.name for path in (tmp_path / "adapter").iterdir())
    assert [f.path for f in report.files] == names and {"adapter_config.json", "adapter_model.safetensors"} <= set(names)
    snapshot = tmp_path / "snapshot"  # the files as huggingface_hub downloads them
    snapshot.mkdir()
    for name in names:
        data = downloaded(hub, "tester/tiny-lora", report.commit_oid, name, tmp_path / "cache")
        assert data == (tmp_path / "adapter" / name).read_bytes()
        (snapshot / name).write_bytes(data)
    input_ids = torch.tensor([[1, 5, 9, 2, 33, 127, 0, 17], [40, 3, 3, 8, 21, 100, 11, 4]])

    def logits(adapter):
        base = transformers.AutoModelForCausalLM.from_pretrained(fixture / "base")
        with torch.no_grad():
            return peft.PeftModel.from_pretrained(base, adapter).eval()(input_ids=input_ids).logits

    got = logits(snapshot)
    # the oracle is PEFT's own saved adapter run here: the stored logits.safetensors were computed
    # on another CPU, whose kernels may round the last bit otherwise (1e-7 seen between hosts)
    expected = logits(fixture / "adapter")
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert got.contiguous().view(torch.uint8).numpy().tobytes() == expected.contiguous().view(torch.uint8).numpy().tobytes()
    stored = load_file(str(fixture / "logits.safetensors"))["logits"]
    assert float((got - stored).abs().max()) < 1e-5  # and what the training run itself gave, to float32 rounding
