"""The changelog wrapper: every mutation of the inner backend is mirrored into the DSTL.

Each state call first changes the inner store, then appends one typed change record
(:class:`~backends.state.Op`) with the serialized key, user key and value. Registering a
state appends a self-describing ``META`` record. A checkpoint persists the log since the
last materialization and returns a :class:`~backends.handles.KeyedStateHandle`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import Any

from backends.handles import KeyedStateHandle, MaterializationHandle
from backends.heap import HeapKeyedStateBackend
from backends.keygroups import KeyGroupRange
from backends.serializers import Serializer, pack_list
from backends.snapshot import MaterializationSnapshot
from backends.state import (
    ListStateDescriptor,
    MapStateDescriptor,
    Op,
    StateDescriptor,
    ValueStateDescriptor,
)
from dstl.changelog import ChangelogWriter
from dstl.handles import ChangelogHandle


class _LoggedValueState:
    __slots__ = ("_backend", "_inner", "_name", "_ser", "_writer")

    def __init__(
        self, backend: ChangelogKeyedStateBackend, inner: Any, name: str, ser: Serializer
    ) -> None:
        self._backend = backend.inner
        self._inner = inner
        self._name = name
        self._ser = ser
        self._writer = backend.writer

    def value(self) -> Any:
        return self._inner.value()

    def update(self, value: Any) -> None:
        self._inner.update(value)
        b = self._backend
        self._writer.append(
            b.current_key_group,
            self._name,
            Op.VALUE_SET,
            b.current_key_bytes,
            None,
            self._ser.serialize(value),
        )

    def clear(self) -> None:
        self._inner.clear()
        b = self._backend
        self._writer.append(b.current_key_group, self._name, Op.CLEAR, b.current_key_bytes)


class _LoggedListState:
    __slots__ = ("_backend", "_inner", "_name", "_ser", "_writer")

    def __init__(
        self, backend: ChangelogKeyedStateBackend, inner: Any, name: str, ser: Serializer
    ) -> None:
        self._backend = backend.inner
        self._inner = inner
        self._name = name
        self._ser = ser
        self._writer = backend.writer

    def get(self) -> list[Any]:
        return self._inner.get()

    def add(self, value: Any) -> None:
        self._inner.add(value)
        b = self._backend
        self._writer.append(
            b.current_key_group,
            self._name,
            Op.LIST_ADD,
            b.current_key_bytes,
            None,
            self._ser.serialize(value),
        )

    def update(self, values: Iterable[Any]) -> None:
        items = list(values)
        self._inner.update(items)
        b = self._backend
        packed = pack_list([self._ser.serialize(v) for v in items])
        self._writer.append(
            b.current_key_group, self._name, Op.LIST_SET, b.current_key_bytes, None, packed
        )

    def clear(self) -> None:
        self._inner.clear()
        b = self._backend
        self._writer.append(b.current_key_group, self._name, Op.CLEAR, b.current_key_bytes)


class _LoggedMapState:
    __slots__ = ("_backend", "_inner", "_name", "_uk", "_v", "_writer")

    def __init__(
        self,
        backend: ChangelogKeyedStateBackend,
        inner: Any,
        name: str,
        uk: Serializer,
        v: Serializer,
    ) -> None:
        self._backend = backend.inner
        self._inner = inner
        self._name = name
        self._uk = uk
        self._v = v
        self._writer = backend.writer

    def get(self, user_key: Any) -> Any:
        return self._inner.get(user_key)

    def contains(self, user_key: Any) -> bool:
        return self._inner.contains(user_key)

    def items(self) -> Iterator[tuple[Any, Any]]:
        return self._inner.items()

    def put(self, user_key: Any, value: Any) -> None:
        self._inner.put(user_key, value)
        b = self._backend
        self._writer.append(
            b.current_key_group,
            self._name,
            Op.MAP_PUT,
            b.current_key_bytes,
            self._uk.serialize(user_key),
            self._v.serialize(value),
        )

    def remove(self, user_key: Any) -> None:
        self._inner.remove(user_key)
        b = self._backend
        self._writer.append(
            b.current_key_group,
            self._name,
            Op.MAP_REMOVE,
            b.current_key_bytes,
            self._uk.serialize(user_key),
        )

    def clear(self) -> None:
        self._inner.clear()
        b = self._backend
        self._writer.append(b.current_key_group, self._name, Op.CLEAR, b.current_key_bytes)


class ChangelogKeyedStateBackend:
    """Wraps a keyed backend so that every mutation is also written to a DSTL writer.

    Task thread only (the writer too). Invariants: the inner state equals the restored
    base plus the replay of every change appended since; :attr:`base` and
    :attr:`restored_log` are what a checkpoint references besides the new log, until a
    materialization of this backend replaces them.
    """

    def __init__(self, inner: HeapKeyedStateBackend, writer: ChangelogWriter) -> None:
        self.inner = inner
        self.writer = writer
        self.base: tuple[MaterializationHandle, ...] = ()
        self.restored_log: tuple[ChangelogHandle, ...] = ()
        self._log_from_sqn = writer.next_sqn()
        self._states: dict[str, Any] = {}
        self._logged_metas: set[str] = set()

    @property
    def backend_id(self) -> str:
        """The writer id: unique per backend instance and attempt."""
        return self.writer.writer_id

    @property
    def key_group_range(self) -> KeyGroupRange:
        """The key groups this backend owns."""
        return self.inner.key_group_range

    def set_current_key(self, key: Any) -> None:
        """Make ``key`` the key every state call acts on."""
        self.inner.set_current_key(key)

    def get_state(self, descriptor: StateDescriptor) -> Any:
        """The logged state object for ``descriptor`` (same object on every call)."""
        state = self._states.get(descriptor.name)
        inner = self.inner.get_state(descriptor)  # checks compatibility every time
        if state is not None:
            return state
        self._log_meta_once(descriptor.name)
        if isinstance(descriptor, ValueStateDescriptor):
            state = _LoggedValueState(self, inner, descriptor.name, descriptor.serializer)
        elif isinstance(descriptor, ListStateDescriptor):
            state = _LoggedListState(self, inner, descriptor.name, descriptor.serializer)
        elif isinstance(descriptor, MapStateDescriptor):
            state = _LoggedMapState(
                self,
                inner,
                descriptor.name,
                descriptor.user_key_serializer,
                descriptor.value_serializer,
            )
        self._states[descriptor.name] = state
        return state

    def _log_meta_once(self, name: str) -> None:
        if name not in self._logged_metas:
            self._logged_metas.add(name)
            self.writer.append_meta(name, Op.META, self.inner.state_metas()[name].to_json())

    # -- checkpoint and materialization -----------------------------------------------
    def checkpoint(self, checkpoint_id: int) -> Future[KeyedStateHandle]:
        """Persist the log since the last materialization; a future of the full handle.

        Called on the task thread at the barrier; the future completes on the upload thread.
        """
        for name in self.inner.state_metas():  # restored states must be self-describing too
            self._log_meta_once(name)
        persisted = self.writer.persist(self._log_from_sqn, checkpoint_id)
        base, restored = self.base, self.restored_log
        kgr = self.key_group_range
        key_ser, max_par = self.inner.key_serializer.name, self.inner.max_parallelism
        result: Future[KeyedStateHandle] = Future()

        def done(f: Future[tuple[ChangelogHandle, ...]]) -> None:
            try:
                handle = KeyedStateHandle(
                    self.backend_id,
                    kgr.start,
                    kgr.end,
                    key_ser,
                    max_par,
                    base,
                    restored + f.result(),
                )
            except BaseException as exc:
                result.set_exception(exc)
            else:
                result.set_result(handle)

        persisted.add_done_callback(done)
        return result

    def changed_since_materialization(self) -> bool:
        """Whether anything was logged since the current base (or since the start)."""
        last = self.writer.last_appended_sqn()
        return last is not None and last >= self._log_from_sqn

    def snapshot_for_materialization(self) -> MaterializationSnapshot:
        """Close the active change set and copy the state (the synchronous part)."""
        return self.inner.snapshot(sqn=self.writer.next_sqn())

    def materialization_done(self, handle: MaterializationHandle) -> None:
        """Later checkpoints reference ``handle`` instead of the log before ``handle.sqn``."""
        if handle.writer_id != self.backend_id:
            raise ValueError(f"materialization of {handle.writer_id} given to {self.backend_id}")
        if handle.sqn < self._log_from_sqn:
            return  # an older materialization finished late: keep the newer one
        self.base = (handle,)
        self.restored_log = ()
        self._log_from_sqn = handle.sqn
        self.writer.truncate(handle.sqn)
        # The META records before handle.sqn are gone from future checkpoints' logs, but
        # the materialized tables carry every state's metadata.
