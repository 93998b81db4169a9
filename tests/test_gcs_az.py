"""gs:// and az:// for real: every command against gcp-storage-emulator and Azurite on 127.0.0.1.

Both emulators run as child processes for this module (tests/storage_emulators.py; skipped with
the install line when absent, failed instead under CKPTTOOL_REQUIRE_EMULATORS=1). Outputs are
compared byte for byte with the same command run on local paths; every URL form users write
(gs://, gcs://, az://, abfs://, abfss://, abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/...)
is read and written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FIXTURES
from ports import closed_port
from storage_emulators import (AZURITE_ACCOUNT, OTHER_ACCOUNT, OTHER_KEY, azurite, connection_string,
                               gcs_emulator, missing)

from ckpttool.cli import main

CONTAINER = "ckpts"
SOURCE = FIXTURES / "fsdp2_world2"
TIMEOUT = 60
BOUNDED = 15  # seconds an unreachable endpoint may take to be reported (gcsfs alone retried for ~35 s, Azure's SDK 3 min)


class Stores:
    """Both emulators, with the fixture uploaded to `ckpts/src` of each (and of Azurite's second
    account at `ckpts/only-in-other`)."""

    def __init__(self, gcs_endpoint: str, azure_endpoint: str):
        import adlfs
        from gcsfs.core import GCSFileSystem  # not gcsfs's default class: it asks for bucket types over gRPC first

        self.gcs_endpoint, self.azure_endpoint = gcs_endpoint, azure_endpoint
        self.gcs_options = {"endpoint_url": gcs_endpoint, "token": "anon"}
        self.azure_connection = connection_string(azure_endpoint)
        self.other_connection = connection_string(azure_endpoint, OTHER_ACCOUNT, OTHER_KEY)
        self.gcs = GCSFileSystem(skip_instance_cache=True, **self.gcs_options)
        self.azure = adlfs.AzureBlobFileSystem(connection_string=self.azure_connection, skip_instance_cache=True)
        self.other = adlfs.AzureBlobFileSystem(connection_string=self.other_connection, skip_instance_cache=True)
        for fs, prefix in ((self.gcs, "src"), (self.azure, "src"), (self.other, "only-in-other")):
            fs.mkdir(CONTAINER)
            for path in sorted(SOURCE.iterdir()):
                fs.put_file(str(path), f"{CONTAINER}/{prefix}/{path.name}")

    def options(self, url: str) -> list[str]:
        """The CLI's storage options for `url` (Azure's credentials come from the environment)."""
        if url.startswith(("gs:", "gcs:")):
            return [arg for key, value in self.gcs_options.items() for arg in ("--storage-option", f"{key}={value}")]
        return []

    def library_options(self, url: str) -> dict:
        return dict(self.gcs_options) if url.startswith(("gs:", "gcs:")) else {}

    def files(self, url: str) -> dict[str, bytes]:
        """name -> bytes of what is at `url` ("" for one object)."""
        fs = self.gcs if url.startswith(("gs:", "gcs:")) else self.azure
        key = fs._strip_protocol(url)
        fs.invalidate_cache()
        if fs.isfile(key):
            return {"": fs.cat_file(key)}
        return {name[len(key) + 1:]: fs.cat_file(name) for name in sorted(fs.find(key))}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Both emulators on free ports, the environment pointing Azure at Azurite and Google's
    credential lookup away from the network (its metadata server probe goes to a closed local port)."""
    for package in ("gcsfs", "adlfs"):
        try:
            __import__(package)
        except ImportError:
            missing(package, "pip install -e '.[test]'")
    work = tmp_path_factory.mktemp("emulators")
    saved = dict(os.environ)
    closed = f"127.0.0.1:{closed_port()}"
    try:
        with gcs_emulator(work) as gcs_endpoint, azurite(work) as azure_endpoint:
            os.environ.update(AZURE_STORAGE_CONNECTION_STRING=connection_string(azure_endpoint),
                              GCE_METADATA_HOST=closed, GCE_METADATA_IP=closed, NO_GCE_CHECK="True")
            for name in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "AZURE_STORAGE_ACCOUNT_NAME",
                         "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN"):
                os.environ.pop(name, None)
            yield Stores(gcs_endpoint, azure_endpoint)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_cli(*args) -> tuple[int, str, str]:
    from click.testing import CliRunner

    args = [str(a) for a in args]
    if args[0] in ("consolidate", "reshard", "export"):
        args.append("--quiet")
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.stdout, result.stderr if hasattr(result, "stderr") else ""


def run_process(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """The installed command in its own process (what a user's shell runs)."""
    return subprocess.run([sys.executable, "-m", "ckpttool", *map(str, args)], capture_output=True, text=True,
                          timeout=TIMEOUT, env={**os.environ, **(env or {})})


def files_of(root: Path) -> dict[str, bytes]:
    if root.is_file():
        return {"": root.read_bytes()}
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """Each command's output from the local fixture, made once."""
    root = tmp_path_factory.mktemp("local")
    for args in (("consolidate", SOURCE, root / "model.safetensors"), ("reshard", SOURCE, root / "world3", "--world", "3"),
                 ("export", SOURCE, root / "export")):
        code, out, err = run_cli(*args)
        assert code == 0, out + err
    return root


GS, AZ = f"gs://{CONTAINER}/src", f"az://{CONTAINER}/src"
FORMS = {  # every way users write a location; each names the uploaded fixture
    "gs": f"gs://{CONTAINER}/src",
    "gcs": f"gcs://{CONTAINER}/src",
    "az": f"az://{CONTAINER}/src",
    "abfs": f"abfs://{CONTAINER}/src",
    "abfss": f"abfss://{CONTAINER}/src",
    "abfs-account": f"abfs://{CONTAINER}@{AZURITE_ACCOUNT}.dfs.core.windows.net/src",
}


# ---------------------------------------------------------------------------------------------
# Every URL form reads and writes


@pytest.mark.parametrize("form", FORMS)
def test_every_url_form_round_trips(stores, local, form):
    """inspect of the form matches the local run (the URL printed as written), and a reshard
    written through the form is byte-identical to the local one, read back through the form."""
    url = FORMS[form]
    code, remote, err = run_cli("inspect", url, "--json", *stores.options(url))
    assert code == 0, err
    _, expected, _ = run_cli("inspect", SOURCE, "--json")
    assert remote.replace(url, str(SOURCE)) == expected

    out = url.replace("/src", f"/round-trip-{form}")
    code, text, err = run_cli("reshard", url, out, "--world", "3", *stores.options(out))
    assert code == 0, text + err
    assert_same_checkpoint(stores, out, local / "world3")
    code, text, err = run_cli("validate", out, "--deep", "--json", *stores.options(out))
    assert code == 0 and json.loads(text)["valid"], text + err


def assert_same_checkpoint(stores, url: str, expected: Path) -> None:
    """The DCP checkpoint at `url` holds the local `expected` one's bytes: the same files, its
    data files identical, its .metadata too but for the checkpoint_id torch records in it (where
    it was written: `url`, not the local path; see assert_same_metadata)."""
    written, local_files = stores.files(url.replace(f"@{AZURITE_ACCOUNT}.dfs.core.windows.net", "")), files_of(expected)
    assert sorted(written) == sorted(local_files)
    assert_same_metadata(written.pop(".metadata"), local_files.pop(".metadata"), url)
    assert written == local_files
    _, remote_doc, _ = run_cli("inspect", url, "--json", *stores.options(url))
    _, local_doc, _ = run_cli("inspect", expected, "--json")
    assert remote_doc.replace(url, str(expected)) == local_doc


def assert_same_metadata(written: bytes, expected: bytes, url: str) -> None:
    """Every byte of the written `.metadata` up to the checkpoint_id (the last entry but three,
    in storage_meta) is the local one's; from there on each value is the local one's as torch
    reads them, but checkpoint_id, which is `url` (torch's FsspecWriter records the URL)."""
    import pickle

    start = expected.rindex(b"checkpoint_id")
    assert written[:start] == expected[:start], "the .metadata bytes differ before its checkpoint_id"
    ours, local = pickle.loads(written), pickle.loads(expected)  # torch's classes; both written by this test
    assert ours.storage_meta.checkpoint_id == url, ours.storage_meta
    ours.storage_meta.checkpoint_id = local.storage_meta.checkpoint_id
    assert ours == local


# ---------------------------------------------------------------------------------------------
# Every command, byte for byte with the local run


@pytest.mark.parametrize("url", [GS, AZ])
def test_validate_deep_of_a_remote_checkpoint_is_clean(stores, url):
    code, out, err = run_cli("validate", url, "--deep", "--json", *stores.options(url))
    assert code == 0, out + err
    assert json.loads(out)["valid"] is True and json.loads(out)["problems"] == []


@pytest.mark.parametrize("url", [GS, AZ])
def test_consolidate_from_a_store_is_byte_identical_to_the_local_run(stores, local, tmp_path, url):
    code, out, err = run_cli("consolidate", url, tmp_path / "model.safetensors", *stores.options(url))
    assert code == 0, out + err
    assert files_of(tmp_path / "model.safetensors") == files_of(local / "model.safetensors")


@pytest.mark.parametrize("store", ["gs", "az"])
def test_consolidate_to_a_store_is_byte_identical_to_the_local_run(stores, local, store):
    out = f"{store}://{CONTAINER}/to-{store}/model.safetensors"
    code, text, err = run_cli("consolidate", SOURCE, out, *stores.options(out))
    assert code == 0, text + err
    assert stores.files(out) == files_of(local / "model.safetensors")


@pytest.mark.parametrize("source, destination", [(GS, f"az://{CONTAINER}/from-gs"), (AZ, f"gs://{CONTAINER}/from-az")])
def test_consolidate_between_stores_is_byte_identical_to_the_local_run(stores, local, source, destination):
    out = f"{destination}/model.safetensors"
    code, text, err = run_cli("consolidate", source, out, *stores.options(GS))  # the options serve both URLs
    assert code == 0, text + err
    assert stores.files(out) == files_of(local / "model.safetensors")


@pytest.mark.parametrize("store", ["gs", "az"])
def test_export_to_a_store_is_byte_identical_to_the_local_run(stores, local, store):
    url, out = f"{store}://{CONTAINER}/src", f"{store}://{CONTAINER}/export-{store}"
    code, text, err = run_cli("export", url, out, *stores.options(url))
    assert code == 0, text + err
    written, expected = stores.files(out), files_of(local / "export")
    card = written.pop("README.md").decode()  # names its source: the URL, and `ckpttool export src OUTDIR`
    card = card.replace(url, str(SOURCE)).replace("export src OUTDIR", f"export {SOURCE.name} OUTDIR")
    assert card == expected.pop("README.md").decode()
    assert written == expected


def test_diff_names_remote_sources_with_their_urls_in_text_and_json(stores):
    """Regression: both sides were printed as `gs:/ckpts/src` (pathlib's spelling of a URL)."""
    options = stores.options(GS)
    code, out, err = run_cli("diff", GS, AZ, "--json", *options)
    assert code == 0, out + err
    document = json.loads(out)
    assert (document["a"], document["b"]) == (GS, AZ)
    code, out, err = run_cli("diff", GS, AZ, *options)
    assert code == 0, out + err
    assert f"{GS} and {AZ}" in out and ":/ckpts" not in out.replace("://ckpts", "")


@pytest.mark.parametrize("url", [GS, AZ])
def test_open_reads_the_same_tensors_as_from_the_local_checkpoint(stores, url):
    import ckpttool

    with ckpttool.open(SOURCE, framework="np") as expected, \
            ckpttool.open(url, framework="np", storage_options=stores.library_options(url)) as remote:
        assert sorted(remote.keys()) == sorted(expected.keys())
        for key in expected.keys():
            a, b = remote.get_tensor(key), expected.get_tensor(key)
            assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), key


def test_source_options_and_open_share_the_storage_options_name(stores):
    import ckpttool
    from ckpttool.options import SourceOptions

    report = ckpttool.inspect(GS, source=SourceOptions(storage_options=stores.gcs_options))
    assert str(report.path) == GS and report.summary == ckpttool.inspect(SOURCE).summary


def test_a_gs_command_leaves_stderr_empty(stores):
    """gcsfs's default filesystem asked each bucket's type over gRPC first and printed "Could not
    determine bucket type" three times per command (after 60 s against an emulator)."""
    result = run_process("validate", GS, "--deep", *stores.options(GS))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


# ---------------------------------------------------------------------------------------------
# The account an Azure URL names


def test_an_abfs_url_naming_its_account_reads_that_account(stores):
    """Regression: `abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/path` exited 1 "no checkpoint found"
    (listing keys drop `@ACCOUNT...`), and another account's URL was read with the default account."""
    url = f"abfs://{CONTAINER}@{OTHER_ACCOUNT}.dfs.core.windows.net/only-in-other"
    code, out, err = run_cli("inspect", url, "--json", "--storage-option", f"connection_string={stores.other_connection}")
    assert code == 0, out + err
    _, expected, _ = run_cli("inspect", SOURCE, "--json")
    assert out.replace(url, str(SOURCE)) == expected


def test_an_url_naming_another_account_than_the_configured_one_is_refused_in_one_line(stores):
    url = f"abfs://{CONTAINER}@{OTHER_ACCOUNT}.dfs.core.windows.net/src"  # devstoreaccount1 holds ckpts/src: not read
    result = run_process("inspect", url)
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert OTHER_ACCOUNT in result.stderr and AZURITE_ACCOUNT in result.stderr
    assert "AZURE_STORAGE_CONNECTION_STRING" in result.stderr


# ---------------------------------------------------------------------------------------------
# One-line errors


def test_az_without_credentials_is_one_line_naming_the_url_and_what_to_set(stores):
    """Regression: a 56-line traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AZURE_STORAGE_")}
    result = subprocess.run([sys.executable, "-m", "ckpttool", "inspect", AZ], capture_output=True, text=True,
                            timeout=TIMEOUT, env=env)
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert AZ in result.stderr and "AZURE_STORAGE_CONNECTION_STRING" in result.stderr


def test_gs_without_credentials_is_one_line_saying_what_to_set(stores):
    """gcsfs went on to gcloud's old token cache and the metadata server (14-50 s), then read anonymously."""
    started = time.monotonic()
    result = run_process("inspect", GS, "--storage-option", f"endpoint_url={stores.gcs_endpoint}")
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert GS in result.stderr and "GOOGLE_APPLICATION_CREDENTIALS" in result.stderr and "token=anon" in result.stderr
    assert time.monotonic() - started < BOUNDED


def test_gs_with_storage_emulator_host_and_no_token_reads_and_writes_anonymously(stores, local, tmp_path):
    """Issue 44 item 8: STORAGE_EMULATOR_HOST names an emulator, which checks no credentials;
    without a token gs:// goes there anonymously, as gcsfs and Google's client libraries do (it
    refused every command: "no Google Cloud credentials found")."""
    env = {"STORAGE_EMULATOR_HOST": stores.gcs_endpoint}
    result = run_process("consolidate", GS, tmp_path / "model.safetensors", "--quiet", env=env)
    assert result.returncode == 0, result.stderr
    assert files_of(tmp_path / "model.safetensors") == files_of(local / "model.safetensors")
    out = f"gs://{CONTAINER}/emulator-host/model.safetensors"
    result = run_process("consolidate", SOURCE, out, "--quiet", env=env)
    assert result.returncode == 0, result.stderr
    assert stores.files(out) == files_of(local / "model.safetensors")


@pytest.mark.parametrize("store", ["gs", "az"])
def test_an_unreachable_endpoint_is_one_line_within_seconds(stores, store):
    """No server at the endpoint: a few quick tries, then one line (gcsfs retried for ~35 s, the
    Azure SDK for 3 minutes)."""
    endpoint = f"http://127.0.0.1:{closed_port()}"
    url = f"{store}://{CONTAINER}/src"
    if store == "gs":
        args, env = ["--storage-option", f"endpoint_url={endpoint}", "--storage-option", "token=anon"], {}
    else:
        args, env = [], {"AZURE_STORAGE_CONNECTION_STRING": connection_string(endpoint)}
    started = time.monotonic()
    result = run_process("inspect", url, *args, env=env)
    elapsed = time.monotonic() - started
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "cannot reach the storage endpoint" in result.stderr and url in result.stderr
    assert elapsed < BOUNDED, f"took {elapsed:.1f} s"


@pytest.mark.parametrize("store", ["gs", "az"])
def test_a_missing_bucket_is_one_line_naming_it(stores, store):
    url = f"{store}://no-such-bucket/src"
    code, out, err = run_cli("inspect", url, *stores.options(url))
    assert code == 1, out
    kind = "bucket" if store == "gs" else "container"
    assert f"the {kind} {store}://no-such-bucket does not exist" in err and len(err.strip().splitlines()) == 1, err


def test_a_malformed_account_url_is_one_line(stores):
    code, out, err = run_cli("inspect", f"abfs://{CONTAINER}@Not_An_Account/src")
    assert code == 1 and "CONTAINER@ACCOUNT.dfs.core.windows.net" in err, out + err
