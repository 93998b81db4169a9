"""One hierarchy of errors; the CLI turns each into one line on stderr and an exit code.

Every message names the file (and tensor, where there is one) and says what to do next.
"""

from __future__ import annotations

EXIT_INVALID = 1  # invalid/corrupt checkpoint, or an operation on one failed
EXIT_USAGE = 2  # click's own code for usage errors


class CheckpointError(Exception):
    """Base of every error about a checkpoint or an operation on one.

    `code` is the stable problem code (the same `validate` reports, see README); `exit_code`
    what the CLI exits with.
    """

    exit_code = EXIT_INVALID
    code = "failed"


class NotACheckpoint(CheckpointError):
    """The directory holds no DCP `.metadata` file."""

    code = "no-metadata"


class UnsafeMetadata(CheckpointError):
    """A pickle asked for a class outside the allowlist; nothing from it was executed."""

    code = "metadata-unsafe"


class CorruptMetadata(CheckpointError):
    """`.metadata` could not be decoded (truncated, garbage, or not DCP metadata)."""

    code = "metadata-unreadable"


class BadName(CorruptMetadata):
    """An entry name or data-file path holds a NUL byte or an unpaired surrogate: no file
    system, safetensors header or terminal can take it."""

    code = "bad-name"


class MissingFile(CheckpointError):
    """A data file that the metadata references does not exist."""

    code = "missing-file"


class CorruptBlob(CheckpointError):
    """A blob's bytes do not decode, or disagree with the metadata (size, dtype, shape)."""

    code = "corrupt-blob"


class UnsafeDataFile(CheckpointError):
    """A data file is not a regular file (FIFO, device, directory), or is a symlink that
    leaves the checkpoint directory (allowed only with --follow-symlinks)."""

    code = "unsafe-file"

    def __init__(self, message: str, code: str = "unsafe-file"):
        super().__init__(message)
        self.code = code


class UnsupportedFormat(CheckpointError):
    """A blob uses a transform or layout this build cannot read (e.g. zstd without `zstandard`)."""

    code = "unsupported"


class InvalidCheckpoint(CheckpointError):
    """The integrity gate found errors; `code` and the message are those of the first, and
    `problems` holds them all (what `ckpttool validate` would list)."""

    code = "invalid"

    def __init__(self, message: str, code: str = "invalid", problems: tuple = ()):
        super().__init__(message)
        self.code = code
        self.problems = problems


class VocabularyMismatch(InvalidCheckpoint):
    """A vocabulary larger than the padded rows an embedding or output layer holds
    (naming/engine.py VOCAB_ROWS): `target` (transformers' name) is made of `key`, of `rows` rows."""

    def __init__(self, message: str, target: str, key: str, rows: int, vocab: object):
        super().__init__(message, code="config-mismatch")
        self.target, self.key, self.rows, self.vocab = target, key, rows, vocab


class OutputExists(CheckpointError):
    """The destination exists and `--force` was not given."""

    code = "output-exists"
    exit_code = EXIT_USAGE


class KeyCollision(CheckpointError):
    """Renaming or normalising keys made two tensors share one name."""

    code = "key-collision"


class UsageError(CheckpointError):
    """Arguments that do not fit the checkpoint (unknown dtype name, bad size string, ...)."""

    code = "usage"
    exit_code = EXIT_USAGE


class WriteFailed(CheckpointError):
    """Writing an output failed (disk full, file size limit, I/O error); nothing was left
    at the destination."""

    code = "write-failed"


class VerificationFailed(CheckpointError):
    """`--verify` read back the output and found bytes that differ from the source."""

    code = "verify-failed"


class HubError(CheckpointError):
    """The Hugging Face Hub (the endpoint HF_ENDPOINT names) refused a push or could not be
    reached; `code` says which: `hub-auth` (401/403: no token, a wrong one, or no write
    access), `hub-not-found` (404: repository or revision), `hub-unreachable` (connection
    refused, timeout, offline mode), `hub-error` (any other answer)."""

    code = "hub-error"

    def __init__(self, message: str, code: str = "hub-error"):
        super().__init__(message)
        self.code = code


class StorageError(CheckpointError):
    """Object storage refused or failed a request (credentials, permissions, network), or its
    fsspec backend is not installed."""

    code = "storage"

    def __init__(self, message: str, code: str = "storage"):
        super().__init__(message)
        self.code = code


def clip(text: str, limit: int = 200) -> str:
    """Return `text` on one line, cut to `limit` characters (a message quoting file content)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


class AmbiguousSource(UsageError):
    """SRC holds several checkpoints or runs and nothing says which one is meant: naming one
    of them as SRC chooses."""

    code = "ambiguous-source"


class MissingEntry(UsageError, KeyError):
    """A key that names no entry of the checkpoint (`ckpttool.open(...).get_tensor`); a
    KeyError as well, as a missing key of a mapping is."""

    code = "no-such-entry"

    __str__ = Exception.__str__  # the message as written, not KeyError's repr of it
