"""Working directories of a killed process are reclaimed; a live one's never are."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from backends import localdirs

REPO = Path(__file__).resolve().parents[2]

_HOLDER = """
import sys, time
from backends import KeyGroupRange, RocksDBKeyedStateBackend
from backends.serializers import STR
b = RocksDBKeyedStateBackend(STR, KeyGroupRange(0, 128), 128, path=sys.argv[1])
b.set_current_key("k")
print(b.path, flush=True)
time.sleep(600)
"""


def _hold(path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == str(path)  # the store is open
    return proc


def test_a_killed_stores_directory_is_reclaimed_a_live_one_is_not(tmp_path: Path) -> None:
    local = tmp_path / "local"
    dead, live = local / "job" / "op-0-a0000", local / "job" / "op-1-a0000"
    victim, survivor = _hold(dead), _hold(live)
    try:
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        assert (dead / "db").is_dir()  # what a SIGKILL leaves behind
        assert localdirs.reclaim(str(local), recursive=True) == [str(dead)]
        assert not dead.exists()
        assert (live / "db").is_dir()  # its process still holds the lock
    finally:
        survivor.kill()
        survivor.wait(timeout=30)
    assert localdirs.reclaim(str(local), recursive=True) == [str(live)]


def test_this_processes_own_directories_are_live(tmp_path: Path) -> None:
    owned = localdirs.owned_dir("rocksdb-state-", parent=str(tmp_path))
    assert localdirs.reclaim(str(tmp_path)) == []  # flock is per open file: held for us too
    owned.release()
    assert not os.path.exists(owned.path)


def test_directories_without_an_owner_file_wait_for_the_safety_age(tmp_path: Path) -> None:
    old = tmp_path / "rocksdb-state-old"
    old.mkdir()
    assert localdirs.reclaim(str(tmp_path), now=time.time()) == []
    assert localdirs.reclaim(str(tmp_path), now=time.time() + 2 * 86400) == [str(old)]
    (tmp_path / "unrelated").mkdir()
    assert localdirs.reclaim(str(tmp_path), now=time.time() + 2 * 86400) == []
