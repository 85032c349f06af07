"""One attempt of the shapes job (:mod:`tests.coordinator.embedded.jobs`), to be killed.

``python -m tests.coordinator.embedded.pipeline_worker STORE MODE SQL_URL [METADATA_URL]``
runs the job into the SQL table ``out`` at ``SQL_URL``, restoring from the job's latest
checkpoint, in barrier mode ``MODE`` (``aligned``, ``unaligned``, ``timeout``: aligned
with a 20 ms alignment timeout, which most alignments here exceed, ``at-least-once``).
It prints one JSON line per completed checkpoint, and exits 0 once the input ended and
the final checkpoint committed.
"""

from __future__ import annotations

import json
import sys
import time

from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions, SqlSink
from coordinator.handles import ChannelStateHandle
from coordinator.metadata import CompletedCheckpoint
from tests.coordinator.embedded.jobs import SQL_COLUMNS, JobConfig, build

# Unpaced sources and a slow first operator: inboxes stay full, so unaligned barriers
# overtake records and most checkpoints carry channel state.
CONFIG = JobConfig(events_per_subtask=10_000, clicks=10_000, rate_per_s=None, slow_ms=0.5)


def options(store: str, mode: str, metadata: str | None) -> RuntimeOptions:
    """The options of every attempt."""
    return RuntimeOptions(
        store_url=store,
        metadata_url=metadata,
        checkpoint=CheckpointOptions(interval_s=0.1, retain=2),
        materialization_interval_s=0.3,
        barrier_mode="aligned" if mode == "timeout" else mode,  # type: ignore[arg-type]
        aligned_timeout_s=0.02 if mode == "timeout" else None,
        debloat_target_s=0.2,
    )


def main(store: str, mode: str, sql_url: str, metadata: str | None) -> None:
    def on_checkpoint(cp: CompletedCheckpoint) -> None:
        in_flight = sum(
            h.records for s in cp.subtasks for h in s.handles if isinstance(h, ChannelStateHandle)
        )
        event = {"id": cp.checkpoint_id, "t": time.time(), "in_flight": in_flight}
        print(json.dumps(event), flush=True)

    job = build(CONFIG, SqlSink(sql_url, "out", SQL_COLUMNS))
    EmbeddedRuntime(job, options(store, mode, metadata), on_checkpoint=on_checkpoint).run()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
