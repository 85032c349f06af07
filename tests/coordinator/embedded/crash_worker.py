"""A job attempt that SIGKILLs itself between "files written" and "record committed".

``python -m tests.coordinator.embedded.crash_worker STORE CRASH_AT [fork]`` runs the demo
pipeline on ``STORE``; when checkpoint ``>= CRASH_AT`` has every file durable but no record
yet, it writes that checkpoint's id and files to ``STORE/crash.json`` (fsync'd) and kills
itself. With ``fork``, every heap materialization forks (:mod:`backends.forked`), however
small the state, so the kill may find snapshot children alive.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys

from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions
from coordinator.metadata import CompletedCheckpoint
from tools.demo_job import DemoConfig, pipeline

CONFIG = DemoConfig(events_per_source=6000, users=200, rate_per_source=4000.0)
# The attempt that crashes runs its sources slowly (12 s for the whole input), so checkpoint
# CRASH_AT comes long before the input ends however loaded the machine is; the rate only
# paces the sources (the records and the reference are the same), and the test's restart
# runs at CONFIG's.
CRASHING = dataclasses.replace(CONFIG, rate_per_source=500.0)


def options(store: str) -> RuntimeOptions:
    """The options of every attempt (the test's restart uses them too)."""
    return RuntimeOptions(
        store_url=store,
        checkpoint=CheckpointOptions(interval_s=0.05, retain=2),
        materialization_interval_s=0.2,
    )


def main(store: str, crash_at: int) -> None:
    def before_commit(cp: CompletedCheckpoint) -> None:
        if cp.checkpoint_id < crash_at:
            return
        fd = os.open(os.path.join(store, "crash.json"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, json.dumps({"id": cp.checkpoint_id, "files": cp.files()}).encode())
        os.fsync(fd)
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)

    runtime = EmbeddedRuntime(
        pipeline(CRASHING, os.path.join(store, "output")),
        options(store),
        before_commit=before_commit,
    )
    runtime.run()


if __name__ == "__main__":
    if sys.argv[3:] == ["fork"]:
        import backends.forked

        backends.forked.FORK_MIN_ENTRIES = 0
    main(sys.argv[1], int(sys.argv[2]))
