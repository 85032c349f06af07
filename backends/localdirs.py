"""Local working directories (RocksDB stores, restore scratch) that a killed process cannot leak.

A RocksDB store works in a local directory; a SIGKILL leaves it behind (seen: 38 left in
the temp dir after 28 kills). Every such directory is made by :func:`owned_dir`, which
holds an exclusive ``flock`` on its ``.owner`` file for as long as the directory is in
use. The kernel drops the lock when the process dies, however it dies, so
:func:`reclaim` can tell a live directory (lock held, by this process or another) from a
dead one (lock free) and delete only the dead. ``flock`` locks belong to the open file,
not the process, so a check from the owning process itself also sees the lock held.

Directories of older code have no ``.owner`` file: they are reclaimed only when older
than ``min_age_s`` (a day by default), the orphan sweep's safety age.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

OWNER_FILE = ".owner"
PREFIXES = ("rocksdb-state-", "rocksdb-restore-")
"""Name prefixes of the directories this project makes in a shared temp directory."""
DEFAULT_MIN_AGE_S = 24 * 3600.0


@dataclass(slots=True)
class OwnedDir:
    """A local working directory and the lock that says its process is alive.

    Owned by the thread that made it; :meth:`release` deletes the directory (if
    ``delete``) and drops the lock. Idempotent.
    """

    path: str
    _fd: int
    delete: bool = True
    released: bool = field(default=False)

    def release(self) -> None:
        """Delete the directory (unless ``delete`` is False) and drop its lock."""
        if self.released:
            return
        self.released = True
        try:
            if self.delete:
                shutil.rmtree(self.path, ignore_errors=True)
        finally:
            os.close(self._fd)


def _lock(path: str) -> int:
    fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def owned_dir(prefix: str, parent: str | None = None, path: str | None = None) -> OwnedDir:
    """A fresh directory (``mkdtemp(prefix, parent)``, or ``path`` if given), locked.

    With ``path``, a directory that already exists is used but not deleted on release
    (it is the caller's), one that does not is created and deleted on release.
    """
    if path is None:
        made = tempfile.mkdtemp(prefix=prefix, dir=parent)
        return OwnedDir(made, _lock(made))
    existed = os.path.isdir(path)
    os.makedirs(path, exist_ok=True)
    return OwnedDir(path, _lock(path), delete=not existed)


def _is_dead(path: str, now: float, min_age_s: float) -> bool:
    owner = os.path.join(path, OWNER_FILE)
    try:
        fd = os.open(owner, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:  # older code, or a directory not made by owned_dir
        try:
            return now - os.stat(path).st_mtime >= min_age_s
        except OSError:
            return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its process is alive
    finally:
        os.close(fd)
    return True


def reclaim(
    parent: str | None = None,
    prefixes: tuple[str, ...] = PREFIXES,
    min_age_s: float = DEFAULT_MIN_AGE_S,
    now: float | None = None,
    recursive: bool = False,
) -> list[str]:
    """Delete the working directories under ``parent`` (default: the temp dir) whose
    process is gone; returns their paths.

    Looks at directories named with one of ``prefixes`` (all of them if ``recursive``:
    a runtime's own ``local_dir`` holds ``<job>/<backend>`` directories). Never deletes
    a directory whose lock is held.
    """
    parent = parent or tempfile.gettempdir()
    now = time.time() if now is None else now
    found: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return []
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        if recursive and not entry.name.startswith(prefixes):
            if os.path.exists(os.path.join(entry.path, OWNER_FILE)):
                candidates = [entry.path]
            else:
                candidates = [
                    e.path for e in os.scandir(entry.path) if e.is_dir(follow_symlinks=False)
                ]
        elif entry.name.startswith(prefixes):
            candidates = [entry.path]
        else:
            continue
        for path in candidates:
            if _is_dead(path, now, min_age_s):
                shutil.rmtree(path, ignore_errors=True)
                log.info("reclaimed local working directory path=%s", path)
                found.append(path)
        if candidates != [entry.path]:
            with contextlib.suppress(OSError):  # a job's directory, once nothing is left in it
                os.rmdir(entry.path)
    return found
