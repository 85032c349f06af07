"""One attempt of the soak job: prints a JSON line per completed checkpoint.

``python -m tests.coordinator.embedded.soak_worker STORE LOCAL_DIR BACKEND [unpaced]`` runs the
demo pipeline (resuming from the latest checkpoint) with checkpoints every 10 ms, retention 3
and RocksDB (or heap) working directories under ``LOCAL_DIR``, until the parent kills it or
the input ends. ``unpaced`` drops the source's rate and checkpoints every 250 ms: the last
attempt, which the parent lets finish, drains the rest of the input at full speed instead of
waiting for it. With checkpoints every 10 ms it took 99 s of the soak's 167 (2,628
checkpoints beyond the 1,000 the killed attempts made): the job's records/s is bound by its
checkpoints there, and the soak's checkpoints are the killed attempts'.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions
from coordinator.metadata import CompletedCheckpoint
from tools.demo_job import DemoConfig, pipeline

# Paced so that a checkpoint holds a few records of each source. The input lasts 333 s of
# running at that pace, so the attempts that get killed never reach its end before the
# parent saw its 1,000 checkpoints, down to 3 checkpoints per second (a loaded machine with
# the rest of the suite beside it ran at 4.4/s and used up the 133 s that 40,000 events
# lasted, at checkpoint 534).
CONFIG = DemoConfig(events_per_source=100_000, users=300, rate_per_source=300.0)


def options(store: str, local_dir: str, backend: str, paced: bool) -> RuntimeOptions:
    """The options of every attempt (the last, unpaced one checkpoints less often)."""
    return RuntimeOptions(
        store_url=store,
        checkpoint=CheckpointOptions(interval_s=0.01 if paced else 0.25, retain=3),
        materialization_interval_s=0.15,
        state_backend=backend,
        local_dir=local_dir,
    )


def main(store: str, local_dir: str, backend: str, paced: bool = True) -> None:
    def emit(cp: CompletedCheckpoint) -> None:
        print(json.dumps({"id": cp.checkpoint_id}), flush=True)

    config = CONFIG if paced else dataclasses.replace(CONFIG, rate_per_source=None)
    opts = options(store, local_dir, backend, paced)
    runtime = EmbeddedRuntime(pipeline(config, f"{store}/output"), opts, on_checkpoint=emit)
    runtime.run()
    print(json.dumps({"finished": True}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4], paced=sys.argv[4:] != ["unpaced"])
