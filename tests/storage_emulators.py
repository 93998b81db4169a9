"""Object storage on 127.0.0.1 for the s3://, gs:// and az:// tests: moto's S3 server, and the Google
Cloud Storage and Azure Blob Storage emulators.

`moto_s3()` runs moto's S3 server mode in this process (a thread) on a free port, its buckets
emptied first; `aws_environment(endpoint)` points botocore's AWS_* variables at a test server
(moto's fixed test credentials) and puts the environment back afterwards.

`gcs_emulator()` runs gcp-storage-emulator (PyPI: `pip install gcp-storage-emulator`) and
`azurite()` runs Azurite's blob service (npm: `npm install -g azurite`, or a local install whose
`node_modules/.bin` is on PATH or named by `AZURITE`), each as a child process on a free port
with in-memory storage, stopped when the context exits.

When an emulator is not installed the tests that need it are skipped with the install line, unless
`CKPTTOOL_REQUIRE_EMULATORS=1` (CI sets it): then they fail, so a CI that lost an emulator says so.

Example:
    >>> with moto_s3() as endpoint, aws_environment(endpoint):
    ...     fs = s3fs.S3FileSystem(skip_instance_cache=True)
    >>> with gcs_emulator() as endpoint:
    ...     fs = gcsfs.GCSFileSystem(endpoint_url=endpoint, token="anon")
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from ports import free_port

REQUIRE = "CKPTTOOL_REQUIRE_EMULATORS"
START_TIMEOUT = 60  # seconds for an emulator to listen (Azurite's node start takes ~5 s on 2 busy cores)

# Azurite's well-known development account (documented by Microsoft; not a secret), and a second
# account the multi-account tests name in URLs
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
OTHER_ACCOUNT = "otheraccount"
OTHER_KEY = "b3RoZXJhY2NvdW50a2V5MQ=="


def missing(what: str, install: str) -> None:
    """Skip (or, with CKPTTOOL_REQUIRE_EMULATORS set, fail) because `what` is not installed."""
    message = f"{what} is not installed ({install})"
    if os.environ.get(REQUIRE, "").lower() not in ("", "0", "false"):
        pytest.fail(f"{message}; {REQUIRE} is set, so the gs:// and az:// tests must run", pytrace=False)
    pytest.skip(f"{message}; set {REQUIRE}=1 to make this a failure")


def _die_with_parent() -> None:
    """In the child: be sent SIGTERM when the test process dies (killed by a timeout, its
    teardown never runs), so no emulator outlives its run. Linux's prctl(PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


@contextlib.contextmanager
def _running(command: list[str], port: int, name: str, log: Path, env: dict[str, str] | None = None) -> Iterator[None]:
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                   cwd=log.parent, start_new_session=True,  # anything it writes lands beside its log
                                   preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{name} did not start on 127.0.0.1:{port} (exit {process.poll()}):\n"
                            f"{log.read_text(errors='replace')[-2000:]}", pytrace=False)
            time.sleep(0.1)
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """Yield the endpoint URL of moto's S3 server (server mode, a thread of this process) on a
    free port of 127.0.0.1, with no bucket: moto keeps its buckets per process, not per server,
    so another module's server may have left some; they are reset first."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).close()
        yield endpoint
    finally:
        server.stop()


@contextlib.contextmanager
def aws_environment(endpoint: str | None = None) -> Iterator[None]:
    """Set moto's test credentials and region in the AWS_* variables botocore reads, and
    AWS_ENDPOINT_URL to `endpoint` (unset when None); restore the whole environment on exit."""
    saved = dict(os.environ)
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    if endpoint is None:
        os.environ.pop("AWS_ENDPOINT_URL", None)
    else:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def gcs_emulator(workdir: Path) -> Iterator[str]:
    """Yield the endpoint URL of a gcp-storage-emulator child process (in-memory)."""
    if importlib.util.find_spec("gcp_storage_emulator") is None:
        missing("gcp-storage-emulator", "pip install gcp-storage-emulator")
    port = free_port()
    command = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port),
               "--in-memory", "--quiet"]
    with _running(command, port, "gcp-storage-emulator", workdir / "gcs-emulator.log"):
        yield f"http://127.0.0.1:{port}"


def azurite_command() -> str | None:
    """The `azurite-blob` executable: $AZURITE, else on PATH."""
    named = os.environ.get("AZURITE")
    if named:
        return named
    return shutil.which("azurite-blob")


@contextlib.contextmanager
def azurite(workdir: Path) -> Iterator[str]:
    """Yield the blob endpoint of an Azurite child process holding two accounts (in-memory);
    account URLs are `{endpoint}/{account}`."""
    executable = azurite_command()
    if executable is None:
        missing("Azurite (azurite-blob)", "npm install -g azurite")
    port = free_port()
    command = [executable, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence", "--silent",
               "--skipApiVersionCheck", "--disableTelemetry"]
    accounts = f"{AZURITE_ACCOUNT}:{AZURITE_KEY};{OTHER_ACCOUNT}:{OTHER_KEY}"
    with _running(command, port, "Azurite", workdir / "azurite.log", env={"AZURITE_ACCOUNTS": accounts}):
        yield f"http://127.0.0.1:{port}"


def connection_string(endpoint: str, account: str = AZURITE_ACCOUNT, key: str = AZURITE_KEY) -> str:
    """The connection string of `account` on an Azurite at `endpoint`."""
    return (f"DefaultEndpointsProtocol=http;AccountName={account};AccountKey={key};"
            f"BlobEndpoint={endpoint}/{account};")
