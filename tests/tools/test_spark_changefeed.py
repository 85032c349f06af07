"""The change feed of the Spark data source equals the mutations made between checkpoints.

Mutations are made through the real state API of real backends and recorded as they are
made; the feed between checkpoints A and B must hold exactly those made after A and up
to B, per key in the order they were made, each attributed to the first checkpoint that
holds it. Also across a rescaled restore (new writers after old ones), from a running
pipeline in offline mode, and the error when a materialization folded changes away.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.restore import restore_changelog_backend
from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions
from coordinator.metadata import MetadataStore
from tests.backends.helpers import COUNT, ITEMS, PRICES, TTL_VALUE, owns, workload
from tests.tools.spark_store import Recorder
from tools.demo_job import DemoConfig, offsets_of, pipeline, reference
from tools.spark import register

Change = tuple[Any, ...]  # (operation, user_key, value, ttl_timestamp, checkpoint_id)


class Mutations:
    """Makes random mutations on a recorder's backends and records what each one logs."""

    def __init__(self, rec: Recorder, seed: int) -> None:
        self.rec = rec
        self.rnd = random.Random(seed)
        self.made: dict[str, dict[Any, list[Change]]] = {}

    def run(self, n: int, checkpoint: int) -> None:
        """``n`` mutations on random keys; they belong to checkpoint ``checkpoint``."""
        clock = self.rec.factory.clock
        for i in range(n):
            key = f"k{self.rnd.randrange(30)}"
            b = next(b for b in self.rec.backends if owns(b, key))
            b.set_current_key(key)
            op = self.rnd.randrange(9)
            if op == 0:
                b.get_state(COUNT).update(i)
                self._made("count", key, ("value_set", None, i, None, checkpoint))
            elif op == 1:
                b.get_state(COUNT).clear()
                self._made("count", key, ("clear", None, None, None, checkpoint))
            elif op == 2:
                b.get_state(ITEMS).add(f"i{i}")
                self._made("items", key, ("list_add", None, [f"i{i}"], None, checkpoint))
            elif op == 3:
                b.get_state(ITEMS).update([f"a{i}", f"b{i}"])
                self._made("items", key, ("list_set", None, [f"a{i}", f"b{i}"], None, checkpoint))
            elif op == 4:
                b.get_state(ITEMS).clear()
                self._made("items", key, ("clear", None, None, None, checkpoint))
            elif op in (5, 6):
                b.get_state(PRICES).put(f"p{i % 3}", i / 4)
                self._made("prices", key, ("map_put", f"p{i % 3}", i / 4, None, checkpoint))
            elif op == 7:
                b.get_state(PRICES).remove(f"p{i % 3}")
                self._made("prices", key, ("map_remove", f"p{i % 3}", None, None, checkpoint))
            else:
                clock.advance(7)
                b.get_state(TTL_VALUE).update(i)
                self._made("ttl_value", key, ("value_set", None, i, clock(), checkpoint))

    def _made(self, state: str, key: str, change: Change) -> None:
        self.made.setdefault(state, {}).setdefault(key, []).append(change)


def _feed(spark: Any, rec: Recorder, state: str, start: int, end: int | str) -> Any:
    register(spark)
    return (
        spark.read.format("changelog-state")
        .option("store", str(rec.root))
        .option("job", rec.job)
        .option("readChangeFeed", "true")
        .option("changeStartCheckpoint", str(start))
        .option("changeEndCheckpoint", str(end))
        .option("state", state)
        .load()
    )


def _per_key(rows: list[Any]) -> dict[Any, list[Change]]:
    out: dict[Any, list[Change]] = {}
    for r in sorted(rows, key=lambda r: r.sequence):
        d = r.asDict()
        value = list(d["value"]) if isinstance(d["value"], list) else d["value"]
        change = (
            d["operation"],
            d.get("user_key"),
            value,
            d.get("ttl_timestamp"),
            d["checkpoint_id"],
        )
        out.setdefault(d["key"], []).append(change)
    return out


@pytest.fixture
def rec(tmp_path: Path) -> Iterator[Recorder]:
    r = Recorder(tmp_path / "store", "feed", "heap", True)
    yield r
    r.close()


def test_the_feed_is_the_mutations_between_two_checkpoints(spark: Any, rec: Recorder) -> None:
    for i in range(2):
        workload(rec.backends[i], 10 + i, 400, rec.factory.clock)
    a = rec.checkpoint().checkpoint_id
    m = Mutations(rec, 1)
    m.run(300, a + 1)
    c1 = rec.checkpoint().checkpoint_id
    assert c1 == a + 1
    m.run(300, c1 + 1)
    b = rec.checkpoint().checkpoint_id
    for state in ("count", "items", "prices", "ttl_value"):
        df = _feed(spark, rec, state, a, b)
        assert _per_key(df.collect()) == m.made[state], state
    assert _feed(spark, rec, "count", a, b).schema.simpleString() == (
        "struct<sequence:bigint,checkpoint_id:bigint,writer:string,sqn:bigint,key_group:int,"
        "operation:string,key:string,value:bigint>"
    )
    # from the job's start: the workload's changes too, ending with the same ones
    everything = _per_key(_feed(spark, rec, "prices", 0, "latest").collect())
    for key, changes in m.made["prices"].items():
        assert everything[key][-len(changes) :] == changes


def test_across_a_rescaled_restore_new_writers_follow_old_ones(spark: Any, rec: Recorder) -> None:
    a = rec.checkpoint().checkpoint_id
    m = Mutations(rec, 2)
    m.run(250, a + 1)
    restored = rec.checkpoint()
    old = [s.handles[0] for s in restored.subtasks]
    rec.backends = [rec.new_backend(s, 3, "a1") for s in range(3)]
    for b in rec.backends:
        restore_changelog_backend(b, rec.fileio, old)
    m.run(250, restored.checkpoint_id + 1)
    b_id = rec.checkpoint().checkpoint_id
    for state in ("count", "prices"):
        rows = _feed(spark, rec, state, a, b_id).collect()
        assert _per_key(rows) == m.made[state], state
        assert {r.writer for r in rows} >= {"op-0-a0", "op-0-a1", "op-2-a1"}


def test_no_change_is_an_empty_feed(spark: Any, rec: Recorder) -> None:
    workload(rec.backends[0], 5, 200, rec.factory.clock)
    a = rec.checkpoint().checkpoint_id
    b = rec.checkpoint().checkpoint_id
    assert _feed(spark, rec, "count", a, b).count() == 0  # Spark reads one empty stand-in


def test_a_materialization_in_between_is_an_error_not_a_short_feed(
    spark: Any, rec: Recorder
) -> None:
    a = rec.checkpoint().checkpoint_id
    Mutations(rec, 3).run(200, 0)
    rec.materialize(0)
    Mutations(rec, 4).run(50, 0)
    b = rec.checkpoint().checkpoint_id
    with pytest.raises(Exception, match=r"writer op-0-a0 from sqn \d+ on .* in no retained"):
        _feed(spark, rec, "count", a, b).collect()


def test_a_running_offline_pipeline(spark: Any, tmp_path: Path) -> None:
    root = tmp_path / "store"
    config = DemoConfig(events_per_source=3000, users=80, rate_per_source=6000.0)
    options = RuntimeOptions(
        store_url=str(root),
        checkpoint=CheckpointOptions(interval_s=0.05, retain=3),
        materialization="offline",
        source_batch=64,
    )
    EmbeddedRuntime(pipeline(config, str(tmp_path / "out")), options).run()
    with MetadataStore.for_local_store(str(root), create=False) as store:
        first, *_, last = [store.get("demo", c.checkpoint_id) for c in store.list("demo")]
    _, at_first = reference(config, offsets_of(first.source_offsets, config))
    _, at_last = reference(config, offsets_of(last.source_offsets, config))
    register(spark)
    rows = (
        spark.read.format("changelog-state")
        .option("store", str(root))
        .option("readChangeFeed", "true")
        .option("changeStartCheckpoint", first.checkpoint_id)
        .option("state", "count")
        .load()
        .collect()
    )
    got = {k: [c[2] for c in v] for k, v in _per_key(rows).items()}
    # every event a user had between the two checkpoints set its count one higher
    expected = {
        user: list(range(at_first["count"].get(user, 0) + 1, n + 1))
        for user, n in at_last["count"].items()
        if n > at_first["count"].get(user, 0)
    }
    assert got == expected
    assert all(first.checkpoint_id < r.checkpoint_id <= last.checkpoint_id for r in rows)
