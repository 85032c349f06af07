"""Real failures of a Spark query with this backend: SIGKILLed drivers, failing tasks.

The driver is a subprocess (``python -m tools.spark.demo driver``, local[2] with up to 4
attempts per task), killed with SIGKILL at random moments after its first batch of each
run, three times in one job, and once per state store right after a checkpoint was
recorded (before its output was committed); tasks fail once after their ack and once in
the middle of their input. After every restart the committed output and the final state
must equal a failure-free run. Each driver run starts a JVM, the slow part: one driver runs
the job twice, one query per state store (heap and RocksDB, on the same input), and the
inputs are small so that a run gets killed after a batch or two. Every other driver runs
at another parallelism (``--rescale 3``): restarts at 2 and 3 ranges alternate with the
kills and the materializations between them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.spark import demo as demo_spark


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(900)  # 3-4 min alone; much more when the machine is shared
def test_killed_driver_and_failing_tasks(tmp_path: Path) -> None:
    args = demo_spark.build_parser().parse_args(
        [
            "--data", str(tmp_path / "data"),
            "--events", "1600",
            "--per-batch", "400",
            "--state-backend", "heap",
            "--state-backend", "rocksdb",
            "--parallelism", "2",
            "--rescale", "3",
            "--kills", "3",
            "--kill-min-s", "0",
            "--kill-max-s", "2.0",
            "--seed", "7",
            "--fault", "1:0:after",
            "--fault", "3:1:mid",
            "--crash-after-record", "5",
        ]
    )  # fmt: skip
    result = demo_spark.run(args)
    assert result.output_ok and result.state_ok, result
    assert result.killed >= 3  # random kills and the crashes after a record (usually 5)
    # each store (the counts are the smallest of the two):
    assert result.replayed >= 1  # a completed batch was re-delivered, not re-processed
    assert result.restores >= 2  # the failed tasks' ranges (at least) were rebuilt
    assert result.ok
