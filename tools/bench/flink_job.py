"""The end-to-end workload on Apache Flink (PyFlink, local mini cluster): the peer.

Run by :mod:`tools.bench.peers` with the Python of Flink's own virtualenv, never with
ours (this project's packages are not importable there; only :mod:`workload` is, from
this directory)::

    python tools/bench/flink_job.py --dir DIR --keys N [--hot H] [--restore-from CHK]

One Java source (``NumberSequenceSource``), a Python map to the workload's ``(key,
value)`` records, ``key_by`` key, and a Python ``KeyedProcessFunction`` keeping a count
and a sum per key in two ``ValueState``s: the same job as ours. State backend: RocksDB,
incremental checkpoints, the changelog state backend on (DSTL on the local file system),
checkpoints every second, retained on cancellation; everything else at Flink's defaults
(periodic materialization every 10 minutes). The job runs until the harness kills it;
the keyed function appends ``time processed`` lines to ``DIR/progress-<pid>`` about
five times a second, and ``open <time>`` when it opens. Flink's own log goes to
``DIR/log`` (the harness reads task state switches and completed checkpoints from it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

# Run as a script in Flink's virtualenv: the project root is not on its path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.bench import workload
from tools.bench.workload import KeyGen, value_of

CHECKPOINT_INTERVAL = "1 s"


def configuration(args: argparse.Namespace) -> dict[str, str]:
    """Flink options of the peer: RocksDB, incremental, changelog on, defaults otherwise."""
    root = os.path.abspath(args.dir)
    conf = {
        "parallelism.default": "1",
        "state.backend.type": "rocksdb",
        "execution.checkpointing.incremental": "true",
        "execution.checkpointing.interval": CHECKPOINT_INTERVAL,
        "execution.checkpointing.dir": f"file://{root}/checkpoints",
        "execution.checkpointing.externalized-checkpoint-retention": "RETAIN_ON_CANCELLATION",
        "state.changelog.enabled": "true" if args.changelog == "on" else "false",
        "state.changelog.storage": "filesystem",
        "state.changelog.dstl.dfs.base-path": f"file://{root}/changelog",
        "restart-strategy.type": "none",
        "python.executable": sys.executable,
        "python.client.executable": sys.executable,
        "python.execution-mode": os.environ.get("PEER_PYTHON_MODE", "process"),
    }
    if args.restore_from:
        conf["execution.state-recovery.path"] = args.restore_from
        # NO_CLAIM cannot restore a changelog checkpoint (no forced full snapshot).
        conf["execution.state-recovery.claim-mode"] = "CLAIM"
    return conf


def main() -> None:
    """Build and run the job; returns only if the job ends (it does not by itself)."""
    from pyflink.common import Configuration, Types, WatermarkStrategy
    from pyflink.datastream import KeyedProcessFunction, StreamExecutionEnvironment
    from pyflink.datastream.connectors.number_seq import NumberSequenceSource
    from pyflink.datastream.state import ValueStateDescriptor

    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--keys", type=int, required=True)
    parser.add_argument("--hot", type=int, default=0)
    parser.add_argument("--changelog", choices=["on", "off"], default="on")
    parser.add_argument("--restore-from", default="")
    parser.add_argument("--api", choices=["sql", "datastream"], default="sql")
    args = parser.parse_args()
    progress = os.path.join(os.path.abspath(args.dir), f"progress-{os.getpid()}")

    class CountSum(KeyedProcessFunction):
        def open(self, runtime_context: object) -> None:
            ctx = runtime_context
            self.count = ctx.get_state(ValueStateDescriptor("count", Types.LONG()))  # type: ignore[attr-defined]
            self.sum = ctx.get_state(ValueStateDescriptor("sum", Types.LONG()))  # type: ignore[attr-defined]
            self.n = 0
            self.last = time.time()
            self.out = open(progress, "a", buffering=1)  # noqa: SIM115  (closed by close())
            self.out.write(f"open {self.last:.3f}\n")

        def process_element(self, value: tuple[int, int], ctx: object) -> None:
            self.count.update((self.count.value() or 0) + 1)
            self.sum.update((self.sum.value() or 0) + value[1])
            self.n += 1
            if not self.n & 1023:
                now = time.time()
                if now - self.last >= 0.2:
                    self.last = now
                    self.out.write(f"{now:.3f} {self.n}\n")

        def close(self) -> None:
            self.out.close()

    config = Configuration()
    for key, value in configuration(args).items():
        config.set_string(key, value)
    env = StreamExecutionEnvironment.get_execution_environment(config)
    sequence = env.from_source(
        NumberSequenceSource(0, 1 << 62), WatermarkStrategy.no_watermarks(), "sequence"
    ).uid("sequence")
    if args.api == "sql":
        sql_job(env, sequence, args.keys, args.hot)
        return
    import cloudpickle

    cloudpickle.register_pickle_by_value(workload)  # Flink's Python workers cannot import it
    gen = KeyGen(args.keys, args.hot)
    (
        sequence.map(
            lambda i: (gen.key(i), value_of(i)),
            output_type=Types.TUPLE([Types.LONG(), Types.LONG()]),
        )
        .uid("records")
        .key_by(lambda r: r[0], key_type=Types.LONG())
        .process(CountSum())
        .uid("count-sum")
        .print()
    )
    env.execute("end-to-end peer")


def sql_job(env: Any, sequence: Any, keys: int, hot: int) -> None:
    """The same aggregation in Flink SQL: Java operators only, no Python per record.

    Keys: record ``i < keys`` has key ``i``, later ones a multiplicative hash of ``i``
    modulo ``hot or keys`` (uniform, though not the same draws as :mod:`workload`).
    """
    from pyflink.table import StreamTableEnvironment

    t_env = StreamTableEnvironment.create(env)
    t_env.create_temporary_view("seq", t_env.from_data_stream(sequence))
    span = hot or keys
    t_env.execute_sql(
        "CREATE TABLE out_table (k BIGINT, c BIGINT, s BIGINT) WITH ('connector' = 'blackhole')"
    )
    t_env.execute_sql(
        f"""
        INSERT INTO out_table
        SELECT k, COUNT(*), SUM(v) FROM (
            SELECT CASE WHEN f0 < {keys} THEN f0
                   ELSE MOD(MOD(f0 * 2862933555777941757 + 3037000493, {span}) + {span}, {span})
                   END AS k,
                   MOD(f0, 1000) AS v
            FROM seq)
        GROUP BY k
        """
    ).wait()


if __name__ == "__main__":
    main()
