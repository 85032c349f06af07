"""The end-to-end benchmark's headline: which cases each field is taken from."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from dstl.encoder import shared_encoder, warm_up_blocks
from tools.bench.end_to_end import (
    _cpu_facts,
    _headline,
    _helpers_cpu,
    _own_steps,
    _runq_s,
    _throughput,
)


def _case(store: str, pattern: str, amp: float | None, keys: int = 1_000_000, **kw: Any) -> dict:
    case = {
        "system": "ours",
        "store": store,
        "changelog": "on",
        "pattern": pattern,
        "keys": keys,
        "space_amp": amp,
        "records_per_s": 1000,
        "restore_s": 1.0,
        "replay_per_s": 2e6 if pattern == "long-log" else 1e5,
        "mat_max_s": 0.5,
        "mat_throughput_ratio": 0.95,
        "own_p99_ms": 10.0,
        "own_old_p99_ms": 8.0,
        "own_ms": [10.0],
        "own_steps": {},
        "mat_sync_p50_ms": 1.0,
        "mat_sync_max_ms": 2.0,
    }
    case.update(kw)
    return case


def test_space_amplification_headline_is_uniform_keys_with_hot_beside_it() -> None:
    cases = [
        _case("heap", "uniform", 1.32),
        _case("rocksdb", "uniform", 1.40),
        _case("heap", "hot", 1.55),
        _case("rocksdb", "hot", 1.22),
        _case("heap", "uniform", 1.45, keys=100_000),
        _case("rocksdb", "uniform", 1.23, keys=100_000),
        _case("heap", "long-log", 11.2),  # materialization off: no target
        _case("heap", "uniform", 0.8, changelog="off"),
        _case("heap", "uniform", 9.0, system="flink"),
    ]
    out = _headline(cases, None)
    assert out["space_amplification"] == 1.45  # the 100k heap case is the worst uniform one
    assert out["space_amplification_hot"] == 1.55
    assert out["replay_changes_per_s"] == 2e6


def test_space_amplification_without_hot_cases_is_none() -> None:  # a --quick run
    out = _headline([_case("heap", "uniform", 1.3), _case("rocksdb", "uniform", 1.2)], None)
    assert out["space_amplification"] == 1.3
    assert out["space_amplification_hot"] is None


def test_whole_run_materialization_ratio_is_over_the_log_only_case_of_the_same_store() -> None:
    cases = [
        _case("heap", "uniform", 1.3, records_per_s=300_000),
        _case("rocksdb", "uniform", 1.3, records_per_s=60_000),
        _case("heap", "uniform", 1.4, keys=100_000, records_per_s=350_000),
        _case("heap", "uniform", 0.8, changelog="off", records_per_s=390_000),
        _case("heap", "long-log", 11.0, records_per_s=400_000),
        _case("rocksdb", "long-log", 3.0, records_per_s=75_000),
    ]
    out = _headline(cases, None)
    assert out["materialization_whole_run_ratio_heap"] == 0.75
    assert out["materialization_whole_run_ratio_rocksdb"] == 0.8
    quick = _headline(cases[:2], None)  # no long-log case: no ratio
    assert quick["materialization_whole_run_ratio_heap"] is None


def test_whole_run_ratio_sums_the_repeated_pair_so_a_drift_cancels() -> None:
    cases = [
        _case("heap", "uniform", 1.3, records_per_s=500_000),
        _case("rocksdb", "uniform", 1.3, records_per_s=60_000),
        _case("heap", "long-log", 11.0, records_per_s=600_000),  # the machine got faster...
        _case("rocksdb", "long-log", 3.0, records_per_s=75_000),
    ]
    repeats = [  # ...and slower again by the end, where the pair runs the other way round
        _case("heap", "long-log", 11.0, records_per_s=450_000),
        _case("heap", "uniform", 1.3, records_per_s=550_000),
    ]
    out = _headline(cases, None, repeats)
    assert out["materialization_whole_run_ratio_heap"] == round(1_050_000 / 1_050_000, 3)
    assert out["materialization_whole_run_records_per_s_heap"] == {
        "with": [500_000, 550_000],
        "log_only": [600_000, 450_000],
    }
    assert out["materialization_whole_run_ratio_rocksdb"] == 0.8  # one pair: as before
    assert out["records_per_s_heap"] == 500_000  # the repeats feed the ratio only
    half = _headline(cases, None, repeats[:1])  # a pair missing its half: the first alone
    assert half["materialization_whole_run_ratio_heap"] == round(500_000 / 600_000, 3)


def test_cpu_facts_are_per_second_of_the_run_and_per_materialization() -> None:
    def sample(t: float, cpu: float, flt: int, kid: float, kid_flt: int) -> dict[str, Any]:
        return {"t": t, "cpu_s": cpu, "minflt": flt, "child_cpu_s": kid, "child_minflt": kid_flt}

    samples = [sample(10.0, 5.0, 1000, 1.0, 50), sample(12.0, 6.5, 3000, 2.2, 20050)]
    assert _cpu_facts(samples, 4) == {
        "worker_cores": 0.75,
        "minflt_per_s": 1000,
        "child_cpu_per_mat_s": 0.3,
        "child_minflt_per_mat": 5000,
    }
    assert _cpu_facts(samples, 0)["child_cpu_per_mat_s"] == 1.2  # no division by zero
    assert _cpu_facts([{"t": 1.0, "n": 0}, {"t": 2.0, "n": 5}], 3) == {}  # an older worker
    helpers = [  # the encoder helper started mid-window: the first sample lacks it
        {**samples[0], "snapshot_helper_cpu_s": 4.0},
        {**samples[1], "snapshot_helper_cpu_s": 5.5, "encoder_helper_cpu_s": 0.4},
    ]
    facts = _cpu_facts(helpers, 4)
    assert (facts["snapshot_helper_cores"], facts["encoder_helper_cores"]) == (0.75, 0.2)


def test_throughput_splits_any_counter_by_materialization_windows() -> None:
    """Records/s and the threads' runqueue wait a second, each during / outside the
    windows, an interval by its midpoint."""
    samples = [
        {"t": 0.0, "n": 0, "runq_s": 0.0},
        {"t": 1.0, "n": 100, "runq_s": 0.5},  # outside
        {"t": 2.0, "n": 160, "runq_s": 1.4},  # inside [1.2, 2.2]
        {"t": 3.0, "n": 260, "runq_s": 1.9},  # outside: midpoint 2.5
    ]
    windows = [(1.2, 2.2)]
    assert _throughput(samples, windows) == (60.0, 100.0)
    assert _throughput(samples, windows, "runq_s") == pytest.approx((0.9, 0.5))


def test_runq_s_counts_a_thread_kept_waiting_for_a_core() -> None:
    """A thread of ours and a child process, both busy on one core for 0.3 s: the thread
    waits while the child runs, and the process's runqueue seconds grow by about that."""
    core = min(os.sched_getaffinity(0))
    spun, done = threading.Event(), threading.Event()

    def spin(until: float) -> None:
        os.sched_setaffinity(0, {core})  # the calling thread (or child) only
        while time.monotonic() < until:
            pass

    def ours(until: float) -> None:
        spin(until)
        spun.set()
        done.wait()  # alive while it is counted: only live threads are

    before = _runq_s()
    until = time.monotonic() + 0.5  # CLOCK_MONOTONIC: the same in the child
    child = subprocess.Popen(
        [sys.executable, "-c", "import os, time\n"
         f"os.sched_setaffinity(0, {{{core}}})\n"
         f"while time.monotonic() < {until}: pass\n"]
    )  # fmt: skip
    thread = threading.Thread(target=ours, args=(until,))
    thread.start()
    assert child.wait(30) == 0
    assert spun.wait(10)
    waited = _runq_s() - before
    done.set()
    thread.join()
    assert waited > 0.05


def test_helpers_cpu_counts_the_live_encoder_helper_that_rusage_would_not() -> None:
    """A long-lived helper is never reaped while the worker runs: its CPU is read from
    /proc, the pid from the module that runs it. Here the process's real encoder helper."""

    def reaped() -> float:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return kids.ru_utime + kids.ru_stime

    encoder = shared_encoder()
    encoder.encode(warm_up_blocks())  # starts it if none runs
    reaped_before = reaped()
    before = _helpers_cpu()
    assert set(before) == {"snapshot_helper_cpu_s", "encoder_helper_cpu_s"}
    assert before["encoder_helper_cpu_s"] > 0  # its start alone imports pyarrow
    for _ in range(10_000):  # until a clock tick of the helper's work shows
        encoder.encode(warm_up_blocks())
        if _helpers_cpu()["encoder_helper_cpu_s"] > before["encoder_helper_cpu_s"]:
            break
    else:
        raise AssertionError("the helper's CPU never grew")
    assert reaped() - reaped_before < 0.01  # what RUSAGE_CHILDREN would have counted


def test_own_steps_report_the_blocks_a_barriers_upload_took_along() -> None:
    def checkpoint(i: int, blocks: int) -> dict[str, Any]:
        operator = {"async_ms": 10.0 + i, "encode_ms": 5.0, "upload_blocks": blocks}
        return {"id": i, "operator": operator, "commit_ms": 1.0}

    steps = _own_steps([checkpoint(i, b) for i, b in enumerate([1, 1, 1, 9])], [])
    assert steps["operator.upload_blocks"] == {"p50": 1, "max": 9}
    assert steps["operator.encode_ms"] == {"p50": 5.0, "p99": 5.0}
    assert steps["own_p99_ms"] == 14.0  # async 13 + commit 1


def test_own_steps_describe_the_slowest_checkpoints_step_by_step() -> None:
    def checkpoint(i: int, async_ms: float) -> dict[str, Any]:
        operator = {"async_ms": async_ms, "encode_ms": async_ms / 2, "encode_cpu_ms": 1.0}
        return {"id": i, "operator": operator, "commit_ms": 3.0}

    completed = [  # what the worker logs for checkpoint 7: its record's wall and CPU time
        {"event": "log", "msg": "checkpoint completed id=7 record_ms=2.500 record_cpu_ms=2.0"}
    ]
    cps = [checkpoint(i, ms) for i, ms in enumerate([5.0, 30.0, 6.0, 7.0, 20.0, 4.0, 1.0, 25.0])]
    slowest = _own_steps(cps, completed)["own_slowest"]
    assert [s["id"] for s in slowest] == [1, 7, 4]
    assert slowest[0]["own_ms"] == 33.0
    assert slowest[1]["encode_ms@operator"] == 12.5
    assert slowest[1]["encode_cpu_ms@operator"] == 1.0
    assert slowest[1]["record_ms@coordinator"] == 2.5
    assert slowest[1]["record_cpu_ms@coordinator"] == 2.0
    assert slowest[0]["record_cpu_ms@coordinator"] == 0.0  # not logged


def test_own_part_p99_is_over_every_checkpoint_of_the_uniform_changelog_on_cases() -> None:
    # 30 checkpoints a case: alone, a case's p99 is its maximum (the stalled 190 ms)
    stalled = [5.0 + i / 10 for i in range(29)] + [190.0]
    cases = [
        _case("heap", "uniform", 1.3, own_ms=stalled, own_p99_ms=190.0),
        _case("rocksdb", "uniform", 1.2, own_ms=[6.0] * 30, own_p99_ms=6.0),
        _case("heap", "uniform", 1.2, keys=100_000, own_ms=[7.0] * 29 + [18.0]),
        _case("rocksdb", "uniform", 1.2, keys=100_000, own_ms=[7.0] * 30),
        _case("heap", "hot", 1.3, own_ms=[500.0] * 30),  # labelled: not the headline
        _case("heap", "long-log", 9.0, own_ms=[500.0] * 30),  # no materialization
        _case("heap", "uniform", 0.8, changelog="off", own_ms=[500.0] * 30),
    ]
    repeats = [_case("heap", "uniform", 1.3, own_ms=[8.0] * 29 + [19.0])]
    out = _headline(cases, None, repeats)
    assert out["own_checkpoint_samples"] == 150
    assert out["own_checkpoint_max_ms"] == 190.0
    assert out["own_checkpoint_p99_ms"] == 19.0  # the second largest of 150
    assert out["own_checkpoint_slowest"] == []  # no case described its slowest
    # the first two alone (60 checkpoints): the p99 leaves the stalled one out
    assert _headline(cases[:2], None)["own_checkpoint_p99_ms"] == 7.8


def test_the_pooled_slowest_checkpoints_name_their_case_and_leave_labelled_cases_out() -> None:
    def slow(*ms: float) -> list[dict[str, Any]]:
        return [{"id": i, "own_ms": v} for i, v in enumerate(ms)]

    cases = [
        _case("heap", "uniform", 1.3, own_slowest=slow(30.0, 12.0, 11.0)),
        _case("rocksdb", "uniform", 1.2, keys=100_000, own_slowest=slow(25.0, 14.0, 9.0)),
        _case("heap", "hot", 1.3, own_slowest=slow(500.0)),  # labelled: not pooled
    ]
    out = _headline(cases, None, [_case("heap", "uniform", 1.3, own_slowest=slow(13.0))])
    assert out["own_checkpoint_slowest"] == [
        {"case": "heap 1000000", "id": 0, "own_ms": 30.0},
        {"case": "rocksdb 100000", "id": 0, "own_ms": 25.0},
        {"case": "rocksdb 100000", "id": 1, "own_ms": 14.0},
    ]
