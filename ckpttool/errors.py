"""One hierarchy of errors; the CLI turns each into one line on stderr and an exit code.

Every message names the file (and tensor, where there is one) and says what to do next.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_INVALID = 1  # invalid/corrupt checkpoint, or an operation on one failed
EXIT_USAGE = 2  # click's own code for usage errors


class CheckpointError(Exception):
    """Base of every error about a checkpoint or an operation on one."""

    exit_code = EXIT_INVALID


class NotACheckpoint(CheckpointError):
    """The directory holds no DCP `.metadata` file."""


class UnsafeMetadata(CheckpointError):
    """A pickle asked for a class outside the allowlist; nothing from it was executed."""


class CorruptMetadata(CheckpointError):
    """`.metadata` could not be decoded (truncated, garbage, or not DCP metadata)."""


class MissingFile(CheckpointError):
    """A data file that the metadata references does not exist."""


class CorruptBlob(CheckpointError):
    """A blob's bytes do not decode, or disagree with the metadata (size, dtype, shape)."""


class UnsupportedFormat(CheckpointError):
    """A blob uses a transform or layout this build cannot read (e.g. zstd without `zstandard`)."""


class InvalidCheckpoint(CheckpointError):
    """`validate` found problems; the message lists them."""


class OutputExists(CheckpointError):
    """The destination exists and `--force` was not given."""

    exit_code = EXIT_USAGE


class KeyCollision(CheckpointError):
    """Renaming or normalising keys made two tensors share one name."""


class UsageError(CheckpointError):
    """Arguments that do not fit the checkpoint (unknown dtype name, bad size string, ...)."""

    exit_code = EXIT_USAGE


class WriteFailed(CheckpointError):
    """Writing an output failed (disk full, file size limit, I/O error); nothing was left
    at the destination."""


class VerificationFailed(CheckpointError):
    """`--verify` read back the output and found bytes that differ from the source."""
