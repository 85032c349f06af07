"""Errors of the state backends, in the project's one tree (:mod:`dstl.errors`)::

    StateBackendError
    ├── KeyGroupOutOfRangeError    a key hashes outside the backend's key groups
    ├── LocalStoreError            the local store (RocksDB) failed or is closed
    ├── SnapshotProcessError       a forked snapshot's process failed or died
    └── ConfigError
        └── UnsupportedBatchError  the batch API does not support this state kind

Third-party (rocksdict) errors are translated at the store boundary with ``from exc``.
"""

from __future__ import annotations

from dstl.errors import ConfigError, StateBackendError


class KeyGroupOutOfRangeError(StateBackendError):
    """A key (or a batch of keys) belongs to key groups this backend does not own."""


class LocalStoreError(StateBackendError):
    """The local store (RocksDB through rocksdict) failed, or the backend is closed."""


class UnsupportedBatchError(ConfigError):
    """``apply_batch`` was called for a state kind it does not support."""


class SnapshotProcessError(StateBackendError):
    """The child process of a forked heap snapshot (:mod:`backends.forked`) failed, died
    or stopped answering: that materialization fails (the next one forks again)."""
