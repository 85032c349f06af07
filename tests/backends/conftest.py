"""Fixtures: every store (heap, RocksDB), with and without the changelog wrapper.

``make_backend(kgr)`` builds a fresh backend of the parametrized flavour; everything it
built is closed at teardown. Time is a :class:`FakeClock` (milliseconds), never sleeps.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from backends import (
    ChangelogKeyedStateBackend,
    HeapKeyedStateBackend,
    KeyGroupRange,
    RocksDBKeyedStateBackend,
    restore_into,
)
from backends.serializers import STR, Serializer
from dstl import ChangelogStorage, FileIO

MAX_PAR = 128
STORES = ("heap", "rocksdb")


class FakeClock:
    """A settable millisecond clock."""

    def __init__(self, now: int = 1_000_000) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> None:
        self.now += ms


class Factory:
    """Builds stores and changelog backends in one tmp dir; closes them all at the end."""

    def __init__(self, tmp_path: Any, storage: ChangelogStorage, fileio: FileIO) -> None:
        self.tmp_path = tmp_path
        self.storage = storage
        self.fileio = fileio
        self.clock = FakeClock()
        self._counter = itertools.count()
        self._made: list[Any] = []

    def store(
        self,
        kind: str,
        kgr: KeyGroupRange | None = None,
        key_serializer: Serializer = STR,
        max_par: int = MAX_PAR,
    ) -> Any:
        kgr = kgr or KeyGroupRange(0, max_par)
        if kind == "heap":
            b: Any = HeapKeyedStateBackend(key_serializer, kgr, max_par, clock=self.clock)
        else:
            path = str(self.tmp_path / f"rocks-{next(self._counter)}")
            b = RocksDBKeyedStateBackend(key_serializer, kgr, max_par, path=path, clock=self.clock)
        self._made.append(b)
        return b

    def logged(self, kind: str, kgr: KeyGroupRange | None = None, writer: str | None = None) -> Any:
        name = writer or f"op-{next(self._counter)}"
        return ChangelogKeyedStateBackend(self.store(kind, kgr), self.storage.create_writer(name))

    def restored(self, kind: str, handles: list[Any], q: int = 1) -> dict[str, Any]:
        """The merged dump of ``handles`` restored into ``q`` fresh ``kind`` stores."""
        from tests.backends.helpers import dump, merge_dumps

        dumps = []
        for s in range(q):
            nb = self.store(kind, KeyGroupRange.for_subtask(s, q, MAX_PAR))
            restore_into(nb, self.fileio, handles)
            dumps.append(dump(nb))
        return merge_dumps(dumps)

    def close(self) -> None:
        for b in self._made:
            b.close()


@pytest.fixture
def factory(tmp_path: Any) -> Iterator[Factory]:
    fileio = FileIO(str(tmp_path / "store"))
    with ChangelogStorage(fileio, "job", "w0") as storage:
        f = Factory(tmp_path, storage, fileio)
        try:
            yield f
        finally:
            f.close()


@pytest.fixture(params=STORES)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=[False, True], ids=["plain", "changelog"])
def make_backend(
    request: pytest.FixtureRequest, factory: Factory, store_kind: str
) -> Callable[..., Any]:
    """A function ``(kgr=None) -> backend`` of the parametrized store, maybe logged."""

    def make(kgr: KeyGroupRange | None = None) -> Any:
        if request.param:
            return factory.logged(store_kind, kgr)
        return factory.store(store_kind, kgr)

    return make


@pytest.fixture
def backend(make_backend: Callable[..., Any]) -> Any:
    return make_backend()


@pytest.fixture
def clock(factory: Factory) -> FakeClock:
    return factory.clock
