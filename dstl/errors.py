"""The one exception tree of the project.

Every package raises from this tree; third-party errors (OS, fsspec/botocore, pyarrow,
rocksdict, SQLAlchemy) are translated at the boundary, once, with ``raise ... from exc``.
It lives in ``dstl`` because ``dstl`` is the bottom of the import graph.

::

    StateBackendError
    ├── ConfigError                    a wrong option, key or value
    ├── StorageError                   durable storage failed
    │   ├── TransientStorageError      worth retrying (timeouts, throttling, 5xx)
    │   ├── StorageNotFoundError       a file or store that should exist does not
    │   ├── StorageConflictError       a write-once object already exists
    │   ├── UnknownOutcomeError        we cannot tell whether a write landed
    │   └── UploadFailedError          a segment upload gave up after its retries
    ├── CorruptionError                bytes are there but wrong (checksum, truncation, format)
    ├── SchemaMismatchError            restored state does not match the declared serializers
    ├── CheckpointError                checkpointing failed
    │   ├── CheckpointNotFoundError    no such checkpoint in the metadata store
    │   ├── CheckpointDeclinedError    a task declined; the checkpoint was aborted
    │   └── CheckpointTimeoutError     a checkpoint expired before all acks arrived
    ├── MetadataStoreError             the SQL metadata store failed or is unreachable
    │   ├── MetadataNotFoundError      there is no metadata store at that place
    │   └── MetadataCorruptError       its database or a record in it is damaged
    │                                  (also a CorruptionError)
    └── JobFailedError                 the pipeline failed (tolerable failures exceeded, task error)
"""

from __future__ import annotations


class StateBackendError(Exception):
    """Root of every error this project raises on purpose."""


class ConfigError(StateBackendError, ValueError):
    """A configuration key, option or value is wrong. Nothing was changed."""


class StorageError(StateBackendError):
    """Durable storage could not complete an operation.

    ``location`` names the file or prefix involved when known.
    """

    def __init__(self, message: str, location: str | None = None) -> None:
        super().__init__(message if location is None else f"{message}: {location}")
        self.location = location


class TransientStorageError(StorageError):
    """A failure that may succeed when retried (timeout, throttling, connection reset)."""


class StorageNotFoundError(StorageError):
    """A file or store that was expected to exist does not."""


class StorageConflictError(StorageError):
    """A write-once object already exists; nothing was overwritten."""


class UnknownOutcomeError(StorageError):
    """A write may or may not have landed; its file must not be deleted eagerly."""


class UploadFailedError(StorageError):
    """A changelog segment could not be written after every allowed attempt.

    ``attempts`` counts them; ``__cause__`` is the last attempt's error. The changes stay
    in their writers, and the next persist uploads them again. No handle references any
    file of the failed upload.
    """

    def __init__(self, message: str, location: str | None = None, attempts: int = 0) -> None:
        super().__init__(message, location)
        self.attempts = attempts


class CorruptionError(StateBackendError):
    """Durable bytes exist but are corrupt, truncated or of an unknown format."""

    def __init__(self, message: str, location: str | None = None) -> None:
        super().__init__(message if location is None else f"{message}: {location}")
        self.location = location


class SchemaMismatchError(StateBackendError):
    """Restored state was written with serializers other than the declared ones."""


class CheckpointError(StateBackendError):
    """A checkpoint could not be taken, completed or restored."""


class CheckpointNotFoundError(CheckpointError):
    """The requested checkpoint does not exist in the metadata store."""


class CheckpointDeclinedError(CheckpointError):
    """A task declined the checkpoint; it was aborted."""


class CheckpointTimeoutError(CheckpointError):
    """A checkpoint expired before every expected acknowledgement arrived."""


class MetadataStoreError(StateBackendError):
    """The SQL metadata store failed, is unreachable or has an unknown schema."""


class MetadataNotFoundError(MetadataStoreError):
    """There is no metadata store at the given URL or path."""


class MetadataCorruptError(MetadataStoreError, CorruptionError):
    """The metadata store's database, or a record in it, is damaged or not ours.

    Also a :class:`CorruptionError`, so every reader treats it as damaged data.
    """


class JobFailedError(StateBackendError):
    """The pipeline failed; ``reason`` says why."""
