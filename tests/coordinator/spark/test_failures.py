"""Real failures of a Spark query with this backend: SIGKILLed drivers, failing tasks.

The driver is a subprocess (``python -m tools.spark.demo driver``, local[2] with up to 4
attempts per task), killed with SIGKILL at random moments after its first batch of each
run and once right after a checkpoint was recorded (before its output was committed);
tasks fail once after their ack and once in the middle of their input. After every
restart the committed output and the final state must equal a failure-free run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.spark import demo as demo_spark


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_killed_driver_and_failing_tasks(tmp_path: Path, backend: str) -> None:
    args = demo_spark.build_parser().parse_args(
        [
            "--data", str(tmp_path / "data"),
            "--events", "2400",
            "--per-batch", "800",
            "--state-backend", backend,
            "--kills", "2",
            "--kill-min-s", "0",
            "--kill-max-s", "2.5",
            "--seed", "7" if backend == "heap" else "11",
            "--fault", "1:0:after",
            "--fault", "3:1:mid",
            "--crash-after-record", "4",
        ]
    )  # fmt: skip
    result = demo_spark.run(args)
    assert result.output_ok and result.state_ok, result
    assert result.killed >= 2  # at least one random kill and the crash after a record
    assert result.replayed >= 1  # a completed batch was re-delivered, not re-processed
    assert result.restores >= 2  # the failed tasks' ranges (at least) were rebuilt
    assert result.ok
