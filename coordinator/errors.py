"""Errors of the coordinator package, subclasses of the one tree in :mod:`dstl.errors`.

::

    CheckpointError
    ├── CheckpointTriggerRejectedError   a manual trigger was refused (too many pending)
    ├── SavepointError                   a savepoint could not be made self-contained
    └── CompactionSupersededError        an offline compaction lost to newer state
    MetadataStoreError
    ├── SchemaVersionError               the database schema is newer than this code
    └── RecordSupersededError            a newer record of the job landed first
    SinkError                            a sink could not publish a committed transaction
"""

from __future__ import annotations

from dstl.errors import CheckpointError, MetadataStoreError, StateBackendError


class CheckpointTriggerRejectedError(CheckpointError):
    """A manual checkpoint trigger was refused; nothing was started."""


class SavepointError(CheckpointError):
    """Copying a savepoint's files failed; the savepoint was aborted, nothing recorded."""


class CompactionSupersededError(CheckpointError):
    """An offline compaction lost the race with newer state of its job (a newer
    materialization or compaction, a rescale, a restore of an older checkpoint);
    nothing was registered."""


class SchemaVersionError(MetadataStoreError):
    """The metadata schema is newer than this code knows; it is never downgraded."""


class RecordSupersededError(MetadataStoreError):
    """A checkpoint was not recorded: the job already has a record with a higher id (a
    savepoint ``statectl`` took meanwhile). Nothing was written; the checkpoint is
    aborted, and its state is in the next one."""


class SinkError(StateBackendError):
    """A sink's target refused or failed a publish (the transaction stays staged)."""
