"""One attempt of the soak job: prints a JSON line per completed checkpoint.

``python -m tests.coordinator.embedded.soak_worker STORE LOCAL_DIR BACKEND`` runs the demo pipeline
(resuming from the latest checkpoint) with checkpoints every 10 ms, retention 3 and
RocksDB (or heap) working directories under ``LOCAL_DIR``, until the parent kills it or
the input ends.
"""

from __future__ import annotations

import json
import sys

from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions
from coordinator.metadata import CompletedCheckpoint
from tools.demo_job import DemoConfig, pipeline

CONFIG = DemoConfig(events_per_source=40_000, users=300, rate_per_source=300.0)


def options(store: str, local_dir: str, backend: str) -> RuntimeOptions:
    """The options of every attempt."""
    return RuntimeOptions(
        store_url=store,
        checkpoint=CheckpointOptions(interval_s=0.01, retain=3),
        materialization_interval_s=0.15,
        state_backend=backend,
        local_dir=local_dir,
    )


def main(store: str, local_dir: str, backend: str) -> None:
    def emit(cp: CompletedCheckpoint) -> None:
        print(json.dumps({"id": cp.checkpoint_id}), flush=True)

    runtime = EmbeddedRuntime(
        pipeline(CONFIG, f"{store}/output"), options(store, local_dir, backend), on_checkpoint=emit
    )
    runtime.run()
    print(json.dumps({"finished": True}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
