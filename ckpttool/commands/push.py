"""`push`: a checkpoint, or a folder ready for the Hub, to a Hugging Face Hub model repository.

A Hub folder (`model.safetensors`, or shards and `model.safetensors.index.json`, with whatever
config, tokenizer and card files sit beside them) goes up as it is, after the integrity gate
has read its headers. Anything else ckpttool reads (DCP, torchtitan, accelerate, ...) is
exported first, into a temporary folder under TMPDIR that is removed afterwards whatever
happens: a failed upload, Ctrl-C, SIGTERM. The repository is created (or found) before the
export, so a missing token fails in a second, not after minutes of exporting.

Token and endpoint come from huggingface_hub's own sources: `HF_TOKEN`, then the token of
`hf auth login`; `HF_ENDPOINT` (default https://huggingface.co). A `--revision` that names no
branch yet is created from `main`, as `hf upload` does.

Example:
    >>> push("runs/llama/step-00000200", "me/llama-tiny", dry_run=True).total_bytes
    1048576
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, TypedDict

from ckpttool import readers
from ckpttool.check import integrity
from ckpttool.core.errors import HubError, UsageError
from ckpttool.store.io import ProgressFactory, no_progress
from ckpttool.options import SourceOptions, WriteOptions
from ckpttool.outputs.temps import TEMP_PREFIX
from ckpttool.readers.detect import HUB_FOLDER, detect

# Above this many bytes, huggingface_hub versions that have `upload_large_folder` (their
# `upload_folder` makes one commit) use it instead: resumable, many commits. Newer ones (2.4
# here) have none: their `upload_folder` is itself resumable and commits in batches (with hf_xet).
LARGE_FOLDER_BYTES = 50 * 10**9
DEFAULT_REVISION = "main"  # huggingface_hub.constants.DEFAULT_REVISION
IGNORED = (TEMP_PREFIX + "*", "*/" + TEMP_PREFIX + "*")  # what a killed ckpttool run left, never uploaded


@dataclass(frozen=True)
class PushFile:
    """One file of the pushed folder: its path in the repository and its size."""

    path: str
    size: int


@dataclass(frozen=True)
class PushReport:
    """What push uploaded (or, with dry_run, would upload) and where."""

    source: Path
    repo_id: str
    revision: str
    endpoint: str
    files: tuple[PushFile, ...]
    layout: str  # what readers.detect found at source
    exported: bool  # the source was exported to a temporary folder first
    method: str  # "upload_folder" or "upload_large_folder"
    seconds: float
    dry_run: bool = False
    commit_url: str | None = None
    commit_oid: str | None = None
    repo_url: str | None = None
    notes: tuple[str, ...] = ()  # what the export said (e.g. no config.json), for stderr

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def push(
    src: str | os.PathLike,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool = False,
    commit_message: str | None = None,
    dry_run: bool = False,
    endpoint: str | None = None,
    token: str | None = None,
    progress: ProgressFactory | None = None,
    source: SourceOptions = SourceOptions(),
) -> PushReport:
    """Return a report after uploading `src` to the Hub model repository `repo_id`.

    `endpoint` and `token` default to huggingface_hub's own (HF_ENDPOINT, HF_TOKEN, the stored
    login). `private` applies only when the repository is created. With `dry_run`, nothing is
    exported, created or uploaded, and the Hub is not contacted: the report lists the files.

    Example:
        >>> report = push("model-hub/", "me/model", commit_message="step 200")
        >>> report.commit_url
        'https://huggingface.co/me/model/commit/3f1c...'
    """
    from huggingface_hub import HfApi
    from huggingface_hub.utils import validate_repo_id

    started = time.perf_counter()
    origin = Path(src)
    try:
        validate_repo_id(repo_id)
    except ValueError:  # HFValidationError
        raise UsageError(f"REPO_ID {repo_id!r}: give NAME or NAMESPACE/NAME (letters, digits, '-', '_', '.'; "
                         "at most 96 characters)") from None
    detection = detect(origin)
    ready = detection.layout == HUB_FOLDER and origin.is_dir() and not detection.run_directory
    api = HfApi(endpoint=endpoint, token=token)
    branch = revision or DEFAULT_REVISION
    notes: tuple[str, ...] = ()
    if ready:
        integrity.gate(readers.read(origin, source.follow_symlinks)[1], source.follow_symlinks)
        files = folder_files(origin)
    else:  # planned before the repository is created: a checkpoint export refuses creates nothing
        files, notes = _export_preview(origin, source)
    summary = _Summary(source=origin, revision=branch, endpoint=api.endpoint, layout=detection.describe(),
                       exported=not ready, notes=notes)
    if dry_run:
        return PushReport(repo_id=repo_id, files=files, method=upload_method(api, files), dry_run=True,
                          seconds=time.perf_counter() - started, **summary)
    with _hub_errors(api.endpoint, repo_id, branch):
        repo_url = api.create_repo(repo_id, private=True if private else None, exist_ok=True)
        repo_id = repo_url.repo_id or repo_id  # a bare NAME is created under the token's user
        if revision is not None:
            _ensure_branch(api, repo_id, revision)
    with _staged(origin, ready, source, progress) as folder:
        files = folder_files(folder)
        _refuse_oversized(files, origin)
        method = upload_method(api, files)
        message = commit_message or f"Upload {origin.name or origin} with ckpttool"
        with _hub_errors(api.endpoint, repo_id, branch):
            commit_url, commit_oid = _upload(api, method, folder, repo_id, revision, message)
    return PushReport(repo_id=repo_id, files=files, method=method, commit_url=commit_url, commit_oid=commit_oid,
                      repo_url=str(repo_url), seconds=time.perf_counter() - started, **summary)


class _Summary(TypedDict):
    """The PushReport fields known before the upload."""

    source: Path
    revision: str
    endpoint: str
    layout: str
    exported: bool
    notes: tuple[str, ...]


def folder_files(folder: Path) -> tuple[PushFile, ...]:
    """Return the files `upload_folder` sends from `folder`, sorted: every file below it but
    huggingface_hub's DEFAULT_IGNORE_PATTERNS (.git, .cache/huggingface) and our temporaries."""
    from huggingface_hub.utils import filter_repo_objects
    from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

    relative = {p.relative_to(folder).as_posix(): p for p in sorted(folder.glob("**/*")) if p.is_file()}
    kept = filter_repo_objects(relative, ignore_patterns=[*IGNORED, *DEFAULT_IGNORE_PATTERNS])
    return tuple(PushFile(name, relative[name].stat().st_size) for name in kept)


def upload_method(api: Any, files: tuple[PushFile, ...]) -> str:
    """Return `upload_large_folder` for a folder over LARGE_FOLDER_BYTES when this
    huggingface_hub has it, else `upload_folder`."""
    large = sum(f.size for f in files) > LARGE_FOLDER_BYTES
    return "upload_large_folder" if large and hasattr(api, "upload_large_folder") else "upload_folder"


def _upload(api: Any, method: str, folder: Path, repo_id: str, revision: str | None,
            message: str) -> tuple[str | None, str | None]:
    """Upload `folder`; return the commit URL and oid (of the branch head for
    upload_large_folder, which returns nothing and names its own commits)."""
    if method == "upload_large_folder":
        api.upload_large_folder(repo_id=repo_id, folder_path=folder, repo_type="model", revision=revision,
                                ignore_patterns=list(IGNORED))
        oid = api.repo_info(repo_id, revision=revision).sha
        return f"{api.endpoint}/{repo_id}/commit/{oid}", oid
    commit = api.upload_folder(repo_id=repo_id, folder_path=folder, revision=revision, commit_message=message,
                               ignore_patterns=list(IGNORED))
    return commit.commit_url, commit.oid


def _ensure_branch(api: Any, repo_id: str, revision: str) -> None:
    """Create branch `revision` from main when the repository has no such revision yet."""
    from huggingface_hub.errors import RevisionNotFoundError

    try:
        api.repo_info(repo_id, revision=revision)
    except RevisionNotFoundError:
        api.create_branch(repo_id, branch=revision, exist_ok=True)


def _refuse_oversized(files: tuple[PushFile, ...], source: Path) -> None:
    from ckpttool.commands.export import HUB_MAX_FILE_SIZE

    for item in files:
        if item.size > HUB_MAX_FILE_SIZE:
            raise UsageError(f"{source}: {item.path} is {item.size} bytes, over the Hub's per-file limit of "
                             f"{HUB_MAX_FILE_SIZE} bytes; export it with a smaller --max-shard-size")


@contextlib.contextmanager
def _staged(source: Path, ready: bool, options: SourceOptions, progress: ProgressFactory | None) -> Iterator[Path]:
    """Yield the folder to upload: `source` itself when it is ready for the Hub, else a
    temporary export of it, removed when the block ends however it ends (an Interrupted
    from the CLI's signal handling is a KeyboardInterrupt, which unwinds through here)."""
    if ready:
        yield source
        return
    from ckpttool.commands.export import export

    with tempfile.TemporaryDirectory(prefix=TEMP_PREFIX + "push-") as staging:
        folder = Path(staging) / "model"
        export(source, folder, write=WriteOptions(progress=progress or no_progress), source=options)
        yield folder


def _export_preview(source: Path, options: SourceOptions) -> tuple[tuple[PushFile, ...], tuple[str, ...]]:
    """Return the files `export` would write for `source`, planned without writing, and its notes."""
    from ckpttool.commands.export import export

    report = export(source, Path(tempfile.gettempdir()) / "ckpttool-push-preview", write=WriteOptions(dry_run=True),
                    source=options)
    return tuple(sorted((PushFile(name, size) for name, size in report.files), key=lambda f: f.path)), report.notes


# ---------------------------------------------------------------------------------------------
# huggingface_hub's exceptions -> one line saying what to do


@contextlib.contextmanager
def _hub_errors(endpoint: str, repo_id: str, revision: str) -> Iterator[None]:
    """Turn huggingface_hub's HTTP and network errors into HubError (other errors pass)."""
    try:
        yield
    except Exception as error:
        mapped = hub_error(error, endpoint, repo_id, revision)
        if mapped is None:
            raise
        raise mapped from None


def hub_error(error: Exception, endpoint: str, repo_id: str, revision: str) -> HubError | None:
    """Return the HubError for an exception huggingface_hub raised, or None when it is not
    one of its HTTP or network errors (huggingface_hub/errors.py, utils/_http.py
    `hf_raise_for_status`)."""
    from huggingface_hub import errors

    login = "set HF_TOKEN to a token with write access or run `hf auth login`"
    if isinstance(error, errors.OfflineModeIsEnabled):
        return HubError(f"{endpoint}: HF_HUB_OFFLINE is set, so nothing can be pushed; unset it", "hub-unreachable")
    if isinstance(error, errors.RevisionNotFoundError):
        return HubError(f"{repo_id}: no revision {revision!r} on {endpoint}; give a branch name with --revision "
                        "(a missing branch is created from main)", "hub-not-found")
    if isinstance(error, errors.RepositoryNotFoundError):
        return HubError(f"{repo_id}: repository not found on {endpoint}, or the token cannot see it; check "
                        f"REPO_ID (namespace/name) and {login}", "hub-not-found")
    if isinstance(error, errors.HfHubHTTPError):
        status = error.response.status_code
        said = _server_said(error)
        if status == 401:
            return HubError(f"{endpoint}: authentication failed (401{said}); {login}", "hub-auth")
        if status == 403:
            return HubError(f"{repo_id}: not allowed (403{said}); {login}, with rights to the namespace "
                            f"{repo_id.split('/')[0]!r}", "hub-auth")
        if status == 404:
            return HubError(f"{repo_id}: not found on {endpoint} (404{said}); check REPO_ID and --revision",
                            "hub-not-found")
        return HubError(f"{repo_id}: the Hub at {endpoint} answered {status}{said}; try again later",
                        "hub-error")
    if isinstance(error, ValueError) and str(error).startswith("Invalid metadata in README.md"):
        return HubError(f"{repo_id}: the Hub refused README.md's metadata ({_first_line(str(error).split(chr(10), 1)[-1])});"
                        " fix the YAML block at its top", "hub-error")
    if isinstance(error, _network_errors()):
        return HubError(f"{endpoint}: cannot reach the Hub ({type(error).__name__}: {_first_line(error)}); check "
                        "the network, a proxy, or HF_ENDPOINT", "hub-unreachable")
    return None


def _network_errors() -> tuple[type[BaseException], ...]:
    """The transport errors of the HTTP client huggingface_hub uses: httpx2 (2.x), httpx
    (1.x) or requests (0.x), whichever is loaded; and the OS's own."""
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"),
                         ("requests", "ConnectionError"), ("requests", "Timeout")):
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(getattr(loaded, name, None), type):
            found.append(getattr(loaded, name))
    return tuple(found)


def _server_said(error: Any) -> str:
    message = getattr(error, "server_message", None)
    return f": {_first_line(message)}" if message else ""


def _first_line(text: Any) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    line = lines[0] if lines else type(text).__name__
    return line if len(line) <= 200 else line[:197] + "..."
