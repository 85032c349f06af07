"""DSTL: the durable short-term log and the one door to durable storage.

Knows nothing of state types, RocksDB or checkpoints.
"""

from dstl.changelog import ChangelogOptions, ChangelogStorage, ChangelogWriter
from dstl.fileio import FileInfo, FileIO
from dstl.handles import ChangelogHandle, handle_from_json, handle_to_json, register_handle
from dstl.read import read_changes
from dstl.retry import InFlightBudget, ManualClock, RetryPolicy, SystemClock

__all__ = [
    "ChangelogHandle",
    "ChangelogOptions",
    "ChangelogStorage",
    "ChangelogWriter",
    "FileIO",
    "FileInfo",
    "InFlightBudget",
    "ManualClock",
    "RetryPolicy",
    "SystemClock",
    "handle_from_json",
    "handle_to_json",
    "read_changes",
    "register_handle",
]
