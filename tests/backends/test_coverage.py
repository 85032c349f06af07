"""Coverage of several writers, the replacement rule, and restoring part of a state.

- A materialization may cover several writers (an offline compaction of a restored or
  rescaled state); old records without ``covers`` read as before.
- ``replacement_problem`` refuses a materialization with other key groups, one older than
  the base, and one holding changes the state's history lacks.
- Restoring part of a materialization's key groups reads only the pieces that hold them
  (plus a declaration per state), and ``states=`` restores only those states.
"""

from __future__ import annotations

import pytest

from backends import KeyedStateHandle, KeyGroupRange, MaterializationHandle, restore_into
from backends.handles import extent, replacement_problem
from backends.restore import pieces_to_read
from dstl import FileIO
from dstl.errors import CorruptionError
from dstl.handles import ChangelogHandle, handle_from_json, handle_to_json
from materializer import Materializer
from materializer.materializer import MaterializerOptions
from tests.backends.conftest import MAX_PAR, Factory
from tests.backends.helpers import COUNT, ITEMS, PRICES, dump, workload


def _mat(writer: str, sqn: int, covers: tuple[tuple[str, int], ...] = (), kg=(0, 64)):  # type: ignore[no-untyped-def]
    return MaterializationHandle(writer, sqn, kg[0], kg[1], "heap-parquet", (), 0, covers)


def _log(writer: str, start: int, end: int) -> ChangelogHandle:
    return ChangelogHandle(
        "jobs/j/changelog/w0/0000000000000001-a.parquet", 0, writer, start, end, 1, 10
    )


def test_covers_round_trip_and_old_records() -> None:
    m = _mat("w2", 7, (("w0", 3), ("w1", 9)))
    again = handle_from_json(handle_to_json(m))
    assert again == m
    assert again.covered_sqn("w0") == 3 and again.covered_sqn("w2") == 7
    assert again.covered_sqn("other") == 0
    assert again.coverage() == {"w0": 3, "w1": 9, "w2": 7}
    old = handle_to_json(_mat("w0", 5))
    del old["covers"]  # what records written before covers existed hold
    assert handle_from_json(old).covers == ()


@pytest.mark.parametrize(
    "covers",
    [[["w1"]], [["w1", -1]], [["w1", 2], ["w0", 1]], [["w1", 2], ["w1", 3]], [["w0", 1]]],
    ids=["short", "negative", "unsorted", "duplicate", "itself"],
)
def test_bad_covers_are_corrupt(covers: list[list[object]]) -> None:
    raw = handle_to_json(_mat("w0", 5))
    raw["covers"] = covers
    with pytest.raises(CorruptionError):
        handle_from_json(raw)


def test_replay_starts_where_any_materialization_covers() -> None:
    h = KeyedStateHandle("w2", 0, 64, "str", MAX_PAR, (_mat("w2", 4, (("w0", 12),)),), ())
    assert h.replay_from("w0") == 12 and h.replay_from("w2") == 4 and h.replay_from("w1") == 0
    assert extent(h.materialized, (_log("w2", 4, 9), _log("w1", 0, 3))) == {
        "w0": 12,
        "w1": 3,
        "w2": 9,
    }


def test_replacement_rule() -> None:
    rng = KeyGroupRange(0, 64)
    base = (_mat("w0", 10),)
    log = (_log("w0", 10, 20), _log("w1", 0, 5))
    ok = _mat("w1", 5, (("w0", 20),))
    assert replacement_problem(ok, rng, base, log) is None
    assert "key groups" in str(
        replacement_problem(_mat("w1", 5, (("w0", 20),), (0, 32)), rng, base, log)
    )
    assert "older" in str(replacement_problem(_mat("w1", 5, (("w0", 8),)), rng, base, log))
    # w0 only reached 20 in this history: a compaction up to 25 came from another branch
    assert "lacks" in str(replacement_problem(_mat("w1", 5, (("w0", 25),)), rng, base, log))
    # ...unless w0 is the live writer, whose log goes on
    assert replacement_problem(_mat("w1", 5, (("w0", 25),)), rng, base, log, "w0") is None


class CountingReads(FileIO):
    def __init__(self, fileio: FileIO) -> None:
        super().__init__(fileio.root_url)
        self.paths: list[str] = []

    def read(self, path: str) -> bytes:
        self.paths.append(path)
        return super().read(path)


def test_partial_restore_reads_only_its_pieces(factory: Factory) -> None:
    b = factory.logged("heap")
    for i in range(4000):
        b.set_current_key(f"k{i}")
        b.get_state(COUNT).update(i)
    workload(b, 3, 500, factory.clock)
    opts = MaterializerOptions(heap_piece_rows=64)  # many small pieces
    mat = Materializer(b, factory.fileio, "job", "op", 0, options=opts).materialize_now()
    workload(b, 4, 300, factory.clock)
    handle = b.checkpoint(1).result()
    part = KeyGroupRange(16, 40)
    counting = CountingReads(factory.fileio)
    nb = factory.store("heap", part)
    restore_into(nb, counting, [handle])
    expected = factory.store("heap", part)
    restore_into(expected, factory.fileio, [handle])
    whole = factory.store("heap", KeyGroupRange(0, MAX_PAR))
    restore_into(whole, factory.fileio, [handle])
    assert dump(nb) == dump(expected)
    read = {p for p in counting.paths if "/materialized/" in p}
    assert 0 < len(read) < len(mat.state_files) // 2
    assert set(nb.state_metas()) == set(whole.state_metas())  # every state still declared


def test_a_state_whose_pieces_are_all_elsewhere_is_still_declared(factory: Factory) -> None:
    # Regression guard for the piece selection: the only piece of "items" lies outside
    # the restored range, and a later change of it inside the range must still replay.
    b = factory.logged("heap")
    inside = next(f"k{i}" for i in range(1000) if _kg(f"k{i}") in range(64, 128))
    outside = next(f"k{i}" for i in range(1000) if _kg(f"k{i}") in range(0, 64))
    b.set_current_key(outside)
    b.get_state(ITEMS).add("x")
    b.get_state(COUNT).update(1)
    opts = MaterializerOptions(heap_piece_rows=1)
    Materializer(b, factory.fileio, "job", "op", 0, options=opts).materialize_now()
    b.set_current_key(inside)
    b.get_state(ITEMS).add("y")
    handle = b.checkpoint(1).result()
    files = handle.materialized[0].state_files
    chosen = pieces_to_read(files, KeyGroupRange(64, 128))
    assert {f.state for f in chosen} == {"count", "items"}
    nb = factory.store("heap", KeyGroupRange(64, 128))
    restore_into(nb, factory.fileio, [handle])
    assert dump(nb) == {"items": {inside: ["y"]}}


def test_restore_only_some_states(factory: Factory) -> None:
    b = factory.logged("rocksdb")
    workload(b, 5, 800, factory.clock)
    Materializer(b, factory.fileio, "job", "op", 0).materialize_now()
    workload(b, 6, 300, factory.clock)
    handle = b.checkpoint(1).result()
    for kind in ("heap", "rocksdb"):
        nb = factory.store(kind)
        restore_into(nb, factory.fileio, [handle], states={"count", "prices"})
        assert set(nb.state_metas()) == {"count", "prices"}
        full = dump(b.inner)
        assert dump(nb) == {k: v for k, v in full.items() if k in {COUNT.name, PRICES.name}}


def _kg(key: str) -> int:
    from backends import key_group_for
    from backends.serializers import STR

    return key_group_for(STR.serialize(key), MAX_PAR)


def test_replay_segments_follow_each_materializations_own_key_groups() -> None:
    # A state merged from two old ranges: [0, 16) rests on a materialization that holds
    # w0's log up to 30, [16, 40) on none, [40, 64) on one that holds w0's log up to 10.
    merged = KeyedStateHandle(
        "w9",
        0,
        64,
        "str",
        MAX_PAR,
        (_mat("w1", 5, (("w0", 30),), kg=(0, 16)), _mat("w2", 8, (("w0", 10),), kg=(40, 64))),
    )
    assert merged.replay_segments("w0") == [(0, 16, 30), (16, 40, 0), (40, 64, 10)]
    assert merged.replay_segments("w1") == [(0, 16, 5), (16, 64, 0)]
    assert merged.replay_segments("w0", KeyGroupRange(8, 20)) == [(8, 16, 30), (16, 20, 0)]
    assert merged.replay_from("w0") == 0  # some key group needs all of w0's log
    whole = KeyedStateHandle("w9", 0, 64, "str", MAX_PAR, (_mat("w1", 5, (("w0", 30),)),))
    assert whole.replay_segments("w0") == [(0, 64, 30)]
    assert whole.replay_from("w0") == 30
