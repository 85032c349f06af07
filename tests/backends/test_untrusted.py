"""Reading a store runs none of its code: tools never unpickle what a checkpoint holds.

A pickled value can call any function when it is unpickled. A store may come from
somebody else (a backup, a bucket shared across teams), so ``statectl`` and the Spark
jobs read pickled keys and values as their bytes; only a job's own restore, which reads
what it wrote itself, unpickles.
"""

from __future__ import annotations

import pathlib
import pickle
from typing import Any

import pytest

from backends import KeyGroupRange, ListStateDescriptor, ValueStateDescriptor, restore_into
from backends.serializers import PICKLE, STR, serializer_for, tuple_of
from materializer import Materializer
from tests.backends.conftest import MAX_PAR, STORES, Factory
from tools.restore import restore_operator


class Planted:
    """Unpickling this touches ``marker``: what a hostile store would run instead."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path(self.marker).touch, ())


def test_untrusted_serializers_keep_pickles_as_bytes() -> None:
    payload = pickle.dumps(Planted("/nonexistent/x"))
    assert serializer_for("pickle", trusted=False).deserialize(payload) == payload
    pair = serializer_for("tuple<str,pickle>", trusted=False)
    assert pair.deserialize(tuple_of(STR, PICKLE).serialize(("k", 1)))[1] == pickle.dumps(1, 5)
    assert serializer_for("pickle") is PICKLE  # trusted resolution is untouched


@pytest.mark.parametrize("kind", STORES)
def test_a_tool_restore_never_unpickles(
    factory: Factory, kind: str, tmp_path: pathlib.Path
) -> None:
    marker = tmp_path / "ran"
    blob = ValueStateDescriptor("blob", PICKLE)
    items = ListStateDescriptor("items", PICKLE)
    b = factory.logged(kind)
    b.set_current_key("a")
    b.get_state(blob).update(Planted(str(marker)))  # materialized below
    b.checkpoint(1).result()
    Materializer(b, factory.fileio, "job", "op", 0).materialize_now()
    b.set_current_key("b")
    b.get_state(items).add(Planted(str(marker)))  # only in the log
    b.set_current_key("c")
    b.get_state(blob).update(Planted(str(marker)))  # a value change in the log (folded)
    handle = b.checkpoint(2).result()
    assert handle.materialized and handle.changelog

    snapshot = restore_operator(factory.fileio, (handle,))
    assert not marker.exists()
    values = {
        (name, k): v
        for name, table in snapshot.tables.items()
        for m in table.values()
        for k, v in m.items()
    }
    assert values[("blob", "a")] == pickle.dumps(Planted(str(marker)), protocol=5)
    assert values[("items", "b")] == [pickle.dumps(Planted(str(marker)), protocol=5)]
    assert values[("blob", "c")] == pickle.dumps(Planted(str(marker)), protocol=5)

    # the job's own restore does unpickle: the check above could fail
    own = factory.store(kind, KeyGroupRange(0, MAX_PAR))
    restore_into(own, factory.fileio, [handle])
    assert marker.exists()
