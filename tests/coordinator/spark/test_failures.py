"""Real failures of a Spark query with this backend: SIGKILLed drivers, failing tasks, rescales.

The driver is a subprocess (``python -m tools.spark.demo driver``, local[2] with up to 4
attempts per task), killed with SIGKILL at random moments after its first batch of each
run, four times in one job, and once right after a checkpoint was recorded (before its
output was committed); every other driver runs at another parallelism (2 and 3 key-group
ranges), so a batch planned at one parallelism is re-planned at the other after a kill;
tasks fail once after their ack and once in the middle of their input. After every restart
the committed output and the final state must equal a failure-free run. Each driver run
starts a JVM: the inputs are small so that a run gets killed after a batch or two.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.spark import demo as demo_spark


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_killed_driver_rescaled_and_failing_tasks(tmp_path: Path, backend: str) -> None:
    args = demo_spark.build_parser().parse_args(
        [
            "--data", str(tmp_path / "data"),
            "--events", "2400",
            "--per-batch", "400",
            "--state-backend", backend,
            "--parallelism", "2",
            "--rescale", "3",
            "--kills", "4",
            "--kill-min-s", "0",
            "--kill-max-s", "2.0",
            "--seed", "7" if backend == "heap" else "11",
            "--fault", "1:0:after",
            "--fault", "3:1:mid",
            "--crash-after-record", "5",
        ]
    )  # fmt: skip
    result = demo_spark.run(args)
    assert result.output_ok and result.state_ok, result
    assert result.killed >= 4  # random kills and the crash after a record
    assert result.replayed >= 1  # a completed batch was re-delivered, not re-processed
    assert result.restores >= 2  # the failed tasks' ranges (at least) were rebuilt
    assert result.parallelisms == (2, 3)  # batches were processed at both parallelisms
    assert result.ok
