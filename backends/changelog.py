"""The changelog wrapper: every mutation of the inner backend is mirrored into the DSTL.

Each state call changes the inner store and appends one typed change record
(:class:`~backends.state.Op`) with the serialized key, user key and *raw* value (with TTL,
``(ts, value)``; reducing/aggregating state: the new accumulator as ``ACC_SET``; timers:
``TIMER_REGISTER``/``TIMER_DELETE``). Registering a state appends a self-describing
``META`` record. The wrapper sits between the store's raw states and the store-independent
behaviour of :mod:`backends.wrappers`, so TTL cleanups and accumulator updates are logged
as the raw changes they are. A checkpoint persists the log since the last materialization
and returns a :class:`~backends.handles.KeyedStateHandle`.

Records go to a per-state C buffer (:class:`dstl._records.RecordColumns`), one call per
record. Over the heap store, for int64, float64 and str parts, the buffer serializes them
itself and the append happens inside the heap store's own C write
(:mod:`backends._heapstate`): the log then adds one C append per record and no Python
call, which is what keeps its per-record cost small (``python -m tools.bench run
state-ops``). Other states serialize in Python, once (RocksDB stores those bytes). A
value the state's serializer or the buffer refuses raises before anything changes.

Hot paths load callables kept on ``self`` (bound C methods, serializer functions) into
locals before calling them: CPython 3.11 cannot specialize ``self._slot(...)`` for a
callable stored on the instance (it stays a generic method lookup, ~20 ns in this loop),
while ``f = self._slot; f(...)`` is a specialized attribute load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from backends._heapstate import ColumnWriter, HeapList, HeapMap, HeapValue
from backends.backend import KeyedStateBackend
from backends.batch import prepare_batch
from backends.forked import materialization_snapshot
from backends.handles import KeyedStateHandle, MaterializationHandle, replacement_problem
from backends.heap import HeapKeyedStateBackend
from backends.keygroups import KeyGroupRange
from backends.serializers import Serializer, pack_list
from backends.snapshot import MaterializationSnapshot
from backends.state import MAP_LIKE, Op, StateDescriptor, StateKind, StateMeta
from backends.wrappers import wrap
from dstl._records import KIND_BYTES, KIND_FLOAT64, KIND_INT64, KIND_NONE, KIND_STR, RecordColumns
from dstl.changelog import ChangelogWriter
from dstl.handles import ChangelogHandle

FLUSH_RECORDS = 4096  # a logged state hands its records to the writer every this many
FLUSH_BYTES = 1 << 20  # ...or once they hold this many bytes

W = TypeVar("W", HeapValue, HeapList, HeapMap)

_CLEAR = int(Op.CLEAR)
_LIST_ADD = int(Op.LIST_ADD)
_LIST_SET = int(Op.LIST_SET)
# Serializers whose bytes the C record buffer produces itself (the same bytes: INT64 and
# FLOAT64 are little-endian struct "<q"/"<d", STR is UTF-8).
_NATIVE_KINDS = {"int64": KIND_INT64, "float64": KIND_FLOAT64, "str": KIND_STR}


def _kind(serializer: Serializer) -> int:
    """The record buffer's kind for values of ``serializer`` (KIND_BYTES: we serialize)."""
    return _NATIVE_KINDS.get(serializer.name, KIND_BYTES)


def _heap_write(
    cls: type[W], backend: ChangelogKeyedStateBackend, meta: StateMeta, logged: _Logged, op: int
) -> W:
    """The heap store's C write for state ``meta`` that also appends ``op`` records to
    ``logged``'s buffer (and flushes it when full): one C call per update, and the same
    write the heap store makes without the log (tests/backends/test_changelog_fastpath.py
    checks both leave identical state)."""
    inner = backend.inner
    table = inner.raw_table(meta.name)
    return cls(inner, table, logged._records, op, logged.flush)


class _Logged:
    """Base of logged raw states: a per-state columnar buffer of change records.

    Each mutation appends one record (op, key, key group, user key, value) to a
    :class:`~dstl._records.RecordColumns` in one C call, which checks the parts first (a
    refused value changes nothing) and says when the buffer is full; the buffer goes to
    the writer (:meth:`flush`) then and before anything that closes a change set
    (checkpoint, materialization). The buffer's kinds follow the state's serializers
    (:func:`_kind`); they matter only to the heap's C writes, which append typed parts
    (the other states append bytes they serialized). Records of
    *different* states may reach the writer in another order than they happened; records
    of one state never do, and replay is per state, so the restored state is the same.
    Task thread only.
    """

    __slots__ = ("_append", "_backend", "_inner", "_name", "_records", "_writer")

    def __init__(self, backend: ChangelogKeyedStateBackend, inner: Any, meta: StateMeta) -> None:
        user_key_kind = _kind(meta.user_key_ser()) if meta.kind in MAP_LIKE else KIND_NONE
        value_kind = _kind(meta.raw_value_ser())
        self._backend = backend.inner
        self._inner = inner
        self._name = meta.name
        self._writer = backend.writer
        self._records = RecordColumns(FLUSH_RECORDS, FLUSH_BYTES, user_key_kind, value_kind)
        # a bound C method: (op, key bytes, key group, user key, value bytes) -> full?
        self._append = self._records.append
        backend._logged.append(self)

    def flush(self) -> None:
        """Hand the buffered records to the writer, in order."""
        self._writer.append_records(self._name, self._records)

    def clear(self) -> None:
        self._inner.clear()
        b, append = self._backend, self._append
        if append(_CLEAR, b.current_key_bytes, b.current_key_group, None, None):
            self.flush()


class _LoggedValueState(_Logged):
    """Raw value-like state that logs ``op`` (VALUE_SET or ACC_SET). Task thread only."""

    __slots__ = ("_put_bytes", "_ser", "_vop", "value")

    def __init__(
        self, backend: ChangelogKeyedStateBackend, inner: Any, meta: StateMeta, op: Op
    ) -> None:
        super().__init__(backend, inner, meta)
        self._ser = meta.raw_value_ser().serialize
        self._vop = int(op)
        self.value: Callable[[], Any] = inner.value  # reads: no extra call layer
        # Stores that keep bytes (RocksDB) take the bytes we serialize for the log.
        self._put_bytes: Callable[[bytes], None] | None = getattr(inner, "update_serialized", None)

    def update(self, value: Any) -> None:
        ser, put, append = self._ser, self._put_bytes, self._append
        data = ser(value)  # first: a value it refuses changes nothing
        if put is None:
            self._inner.update(value)
        else:
            put(data)
        b = self._backend
        if append(self._vop, b.current_key_bytes, b.current_key_group, None, data):
            self.flush()

    def with_default(self, default: Any) -> Any:
        """This state read with ``default`` for an absent (or None) value: the inner
        store's own defaulted read and this state's logged writes (same buffer, same
        order); None if the inner store has no defaulted read."""
        inner_with = getattr(self._inner, "with_default", None)
        if inner_with is None:
            return None
        return _DefaultedView(inner_with(default).value, self.update, self.clear)


class _DefaultedView:
    """A logged value state with a default: each method is a bound method of the store
    or the logged state (reads default in the store, writes log), so no call layer of
    its own. Task thread only."""

    __slots__ = ("clear", "update", "value")

    def __init__(
        self,
        value: Callable[[], Any],
        update: Callable[[Any], None],
        clear: Callable[[], None],
    ) -> None:
        self.value = value
        self.update = update
        self.clear = clear


class _LoggedHeapValueState(_LoggedValueState):
    """:class:`_LoggedValueState` over the heap store, for values the record buffer
    serializes itself (:data:`_NATIVE_KINDS`): ``update`` is the heap store's own C write
    with the record append in the same call (:class:`backends._heapstate.HeapValue`).

    Task thread only.
    """

    __slots__ = ("update",)

    def __init__(
        self, backend: ChangelogKeyedStateBackend, inner: Any, meta: StateMeta, op: Op
    ) -> None:
        super().__init__(backend, inner, meta, op)
        store = backend.inner.column_store(meta.name)
        if store is not None:  # a columnar state: its C write appends the record too
            self.update = ColumnWriter(store, self._records, self._vop, self.flush).update  # type: ignore[method-assign]
            return
        write = _heap_write(HeapValue, backend, meta, self, self._vop)
        self.update = write.update  # type: ignore[method-assign]


class _LoggedListState(_Logged):
    """Raw list state that logs LIST_ADD / LIST_SET / CLEAR. Task thread only."""

    __slots__ = ("_add_bytes", "_ser", "_set_bytes", "get")

    def __init__(self, backend: ChangelogKeyedStateBackend, inner: Any, meta: StateMeta) -> None:
        super().__init__(backend, inner, meta)
        self._ser = meta.raw_value_ser().serialize
        # Stores that keep bytes (RocksDB) take the bytes we serialize for the log.
        self._add_bytes: Callable[[bytes], None] | None = getattr(inner, "add_serialized", None)
        self._set_bytes: Callable[[bytes], None] | None = getattr(inner, "update_serialized", None)
        self.get: Callable[[], list[Any]] = inner.get  # reads: no extra call layer

    def add(self, value: Any) -> None:
        ser, add, append = self._ser, self._add_bytes, self._append
        data = ser(value)  # first: a value it refuses changes nothing
        if add is None:
            self._inner.add(value)
        else:
            add(data)
        b = self._backend
        if append(_LIST_ADD, b.current_key_bytes, b.current_key_group, None, data):
            self.flush()

    def update(self, values: Iterable[Any]) -> None:
        items = list(values)
        if not items:
            self.clear()
            return
        ser, set_bytes = self._ser, self._set_bytes
        data = pack_list([ser(v) for v in items])  # first: nothing changes if one is refused
        if set_bytes is None:
            self._inner.update(items)
        else:
            set_bytes(data)
        b, append = self._backend, self._append
        if append(_LIST_SET, b.current_key_bytes, b.current_key_group, None, data):
            self.flush()


class _LoggedHeapListState(_LoggedListState):
    """:class:`_LoggedListState` over the heap store, for elements the record buffer
    serializes itself: ``add`` is the heap store's C add with the record append, and
    ``update`` its C replace with a LIST_SET record that frames the elements in the same
    call (:class:`backends._heapstate.HeapList`). Task thread only.
    """

    __slots__ = ("_replace", "add")

    def __init__(self, backend: ChangelogKeyedStateBackend, inner: Any, meta: StateMeta) -> None:
        super().__init__(backend, inner, meta)
        self.add = _heap_write(HeapList, backend, meta, self, _LIST_ADD).add  # type: ignore[method-assign]
        self._replace = _heap_write(HeapList, backend, meta, self, _LIST_SET).replace

    def update(self, values: Iterable[Any]) -> None:
        items = list(values)
        if not items:
            self.clear()
            return
        replace = self._replace
        replace(items)


class _LoggedMapState(_Logged):
    """Raw map state that logs ``put_op``/``remove_op`` (MAP_* or TIMER_*), with user keys
    and values serialized here, once: a store that keeps bytes (RocksDB) takes them.

    Task thread only.
    """

    __slots__ = (
        "_put_bytes",
        "_put_op",
        "_remove_op",
        "_uk_bytes",
        "_v_bytes",
        "contains",
        "get",
        "items",
    )

    def __init__(
        self,
        backend: ChangelogKeyedStateBackend,
        inner: Any,
        meta: StateMeta,
        put_op: Op,
        remove_op: Op,
    ) -> None:
        super().__init__(backend, inner, meta)
        self._uk_bytes: Callable[[Any], bytes] = meta.user_key_ser().serialize
        self._v_bytes: Callable[[Any], bytes] = meta.raw_value_ser().serialize
        self._put_bytes: Callable[[bytes, bytes], None] | None = getattr(
            inner, "put_serialized", None
        )
        self._put_op = int(put_op)
        self._remove_op = int(remove_op)
        # reads: no extra call layer
        self.get: Callable[[Any], Any] = inner.get
        self.contains: Callable[[Any], bool] = inner.contains
        self.items: Callable[[], Iterator[tuple[Any, Any]]] = inner.items

    def put(self, user_key: Any, value: Any) -> None:
        uk_bytes, v_bytes, put, append = (
            self._uk_bytes,
            self._v_bytes,
            self._put_bytes,
            self._append,
        )
        uk, v = uk_bytes(user_key), v_bytes(value)  # first: a part refused changes nothing
        if put is None:
            self._inner.put(user_key, value)
        else:
            put(uk, v)
        b = self._backend
        if append(self._put_op, b.current_key_bytes, b.current_key_group, uk, v):
            self.flush()

    def remove(self, user_key: Any) -> None:
        uk_bytes, append = self._uk_bytes, self._append
        uk = uk_bytes(user_key)
        self._inner.remove(user_key)
        b = self._backend
        if append(self._remove_op, b.current_key_bytes, b.current_key_group, uk, None):
            self.flush()


class _LoggedHeapMapState(_LoggedMapState):
    """:class:`_LoggedMapState` over the heap store, for user keys and values the record
    buffer serializes itself: ``put`` is the heap store's C put with the record append
    (:class:`backends._heapstate.HeapMap`). Task thread only.
    """

    __slots__ = ("put",)

    def __init__(
        self,
        backend: ChangelogKeyedStateBackend,
        inner: Any,
        meta: StateMeta,
        put_op: Op,
        remove_op: Op,
    ) -> None:
        super().__init__(backend, inner, meta, put_op, remove_op)
        self.put = _heap_write(HeapMap, backend, meta, self, self._put_op).put  # type: ignore[method-assign]


B = TypeVar("B", bound=KeyedStateBackend)


class ChangelogKeyedStateBackend(Generic[B]):
    """Wraps a keyed backend (heap or RocksDB) so every mutation is also written to a DSTL
    writer.

    Task thread only (the writer too). Invariants: the inner state equals the restored
    base plus the replay of every change appended since; :attr:`base` and
    :attr:`restored_log` are what a checkpoint references besides the new log, until a
    materialization of this backend replaces them.
    """

    def __init__(self, inner: B, writer: ChangelogWriter) -> None:
        self.inner = inner
        self.writer = writer
        # The hot path: no extra call layer for key switches.
        self.set_current_key = inner.set_current_key  # type: ignore[method-assign]
        self.set_current_key_raw = inner.set_current_key_raw  # type: ignore[method-assign]
        self.base: tuple[MaterializationHandle, ...] = ()
        self.restored_log: tuple[ChangelogHandle, ...] = ()
        self._log_from_sqn = writer.next_sqn()
        self._states: dict[str, Any] = {}
        self._raw: dict[str, Any] = {}
        self._logged: list[_Logged] = []
        self._logged_metas: set[str] = set()

    @property
    def backend_id(self) -> str:
        """The writer id: unique per backend instance and attempt."""
        return self.writer.writer_id

    @property
    def key_group_range(self) -> KeyGroupRange:
        """The key groups this backend owns."""
        return self.inner.key_group_range

    @property
    def key_serializer(self) -> Serializer:
        """The inner backend's key serializer."""
        return self.inner.key_serializer

    @property
    def max_parallelism(self) -> int:
        """The inner backend's max parallelism."""
        return self.inner.max_parallelism

    @property
    def clock(self) -> Callable[[], int]:
        """The inner backend's TTL clock (milliseconds)."""
        return self.inner.clock

    @property
    def current_key(self) -> Any:
        """The current key."""
        return self.inner.current_key

    @property
    def current_key_bytes(self) -> bytes:
        """The current key's bytes."""
        return self.inner.current_key_bytes

    @property
    def current_key_group(self) -> int:
        """The current key's group."""
        return self.inner.current_key_group

    def set_current_key(self, key: Any) -> None:
        """Make ``key`` the key every state call acts on."""
        self.inner.set_current_key(key)

    def set_current_key_raw(self, key: Any, key_bytes: bytes, key_group: int) -> None:
        """Set the current key when its bytes and group are already known."""
        self.inner.set_current_key_raw(key, key_bytes, key_group)

    def get_state(self, descriptor: StateDescriptor) -> Any:
        """The logged state object for ``descriptor`` (same object on every call).

        Checks compatibility with an existing declaration on every call.
        """
        meta = descriptor.meta
        state = self._states.get(meta.name)
        if state is not None:
            self.inner.state_metas()[meta.name].check_compatible(meta)
            return state
        state = wrap(descriptor, self.internal_state(meta), self.inner.clock)
        self._states[meta.name] = state
        return state

    def internal_state(self, meta: StateMeta) -> Any:
        """The logged raw state of ``meta`` (registers it and logs its META once)."""
        logged = self._raw.get(meta.name)
        raw = self.inner.internal_state(meta)  # registers, checks compatibility
        if logged is not None:
            return logged
        self._log_meta_once(meta.name)
        # the heap's C writes only for parts the record buffer serializes itself
        heap = isinstance(self.inner, HeapKeyedStateBackend) and meta.raw_value_ser().name in (
            _NATIVE_KINDS
        )
        if meta.kind is StateKind.LIST:
            list_cls = _LoggedHeapListState if heap else _LoggedListState
            logged = list_cls(self, raw, meta)
        elif meta.kind in MAP_LIKE:
            timer = meta.kind is StateKind.TIMER
            map_cls = (
                _LoggedHeapMapState
                if heap and meta.user_key_ser().name in _NATIVE_KINDS
                else _LoggedMapState
            )
            logged = map_cls(
                self,
                raw,
                meta,
                Op.TIMER_REGISTER if timer else Op.MAP_PUT,
                Op.TIMER_DELETE if timer else Op.MAP_REMOVE,
            )
        else:
            value_cls = _LoggedHeapValueState if heap else _LoggedValueState
            op = Op.VALUE_SET if meta.kind is StateKind.VALUE else Op.ACC_SET
            logged = value_cls(self, raw, meta, op)
        self._raw[meta.name] = logged
        return logged

    def state_metas(self) -> dict[str, StateMeta]:
        """Every state declared or restored, by name."""
        return self.inner.state_metas()

    def flush_log(self) -> None:
        """Hand every buffered change record to the writer.

        Called before every change-set boundary (checkpoint, materialization); call it
        yourself before using :attr:`writer` directly.
        """
        for state in self._logged:
            state.flush()

    def entries(self, name: str) -> Iterator[tuple[int, Any, Any]]:
        """The inner store's raw entries of state ``name``."""
        return self.inner.entries(name)

    def apply_batch(
        self, descriptor: StateDescriptor, keys: Any, values: Any, user_keys: Any = None
    ) -> None:
        """Columnar update of many keys: one store batch plus one ``append_columns``."""
        self.get_state(descriptor)
        self._raw[descriptor.name].flush()  # keep this state's records in order
        inner = self.inner
        meta, batch = prepare_batch(
            descriptor,
            inner.key_serializer,
            inner.key_group_range,
            inner.max_parallelism,
            inner.clock(),
            keys,
            values,
            user_keys,
        )
        inner.apply_prepared(meta, batch)
        if not batch.keys:
            return
        uks = batch.user_key_bytes_with(meta.user_key_ser()) if batch.user_keys else None
        self.writer.append_columns(
            batch.key_group_array,
            meta.name,
            batch.op,
            batch.key_bytes,
            batch.value_column_with(meta.raw_value_ser()),
            uks,
        )

    def close(self) -> None:
        """Close the inner store (the writer belongs to its storage)."""
        self.inner.close()

    def _log_meta_once(self, name: str) -> None:
        if name not in self._logged_metas:
            self._logged_metas.add(name)
            self.writer.append_meta(name, Op.META, self.inner.state_metas()[name].to_json())

    # -- checkpoint and materialization -----------------------------------------------
    def checkpoint(self, checkpoint_id: int) -> Future[KeyedStateHandle]:
        """Persist the log since the last materialization; a future of the full handle.

        Called on the task thread at the barrier; the future completes on the upload thread.
        """
        self.flush_log()
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
        self.flush_log()
        last = self.writer.last_appended_sqn()
        return last is not None and last >= self._log_from_sqn

    def log_bytes(self) -> int:
        """About how many bytes of log a checkpoint taken now would reference beside its
        base (:meth:`ChangelogWriter.log_size`); what periodic materialization bounds."""
        self.flush_log()
        return self.writer.log_size()[0]

    @property
    def max_log_ratio(self) -> float | None:
        """The inner store's own default for the materialization size bound
        (``MAX_LOG_RATIO``, see :mod:`materializer.scheduler`); None: the scheduler's."""
        ratio: float | None = getattr(self.inner, "MAX_LOG_RATIO", None)
        return ratio

    def prepare_materialization(self) -> bool:
        """Whether :meth:`snapshot_for_materialization` would be short now; if not, the
        inner store starts what makes it short (RocksDB: a background memtable flush,
        :meth:`~backends.rocksdb.RocksDBKeyedStateBackend.prepare_snapshot`). Stores
        without such a step are always ready. Changes no state."""
        prepare: Callable[[], bool] | None = getattr(self.inner, "prepare_snapshot", None)
        return True if prepare is None else prepare()

    def snapshot_for_materialization(self) -> MaterializationSnapshot:
        """Close the active change set, starting a new log segment
        (:meth:`~dstl.changelog.ChangelogWriter.cut`), and snapshot the state (the
        synchronous part; see :func:`backends.forked.materialization_snapshot`)."""
        self.flush_log()
        return materialization_snapshot(self.inner, self.writer.cut())

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

    def adoption_problem(self, handle: MaterializationHandle) -> str | None:
        """Why :meth:`adopt` would refuse ``handle`` (None: it would adopt it)."""
        return replacement_problem(
            handle, self.key_group_range, self.base, self.restored_log, self.backend_id
        )

    def adopt(self, handle: MaterializationHandle) -> bool:
        """Rest later checkpoints on ``handle``, a materialization made elsewhere (an
        offline compaction of this state); False, and nothing changes, if it may not
        replace the current base (:func:`~backends.handles.replacement_problem`).

        The local store is untouched: it already holds this state. Later checkpoints
        reference ``handle`` and, of each writer's log, only what it does not cover; the
        writer truncates its own log below its coverage. Task thread only.
        """
        if self.adoption_problem(handle) is not None:
            return False
        own = handle.covered_sqn(self.backend_id)
        self.base = (handle,)
        self.restored_log = tuple(
            c for c in self.restored_log if c.sqn_end > handle.covered_sqn(c.writer_id)
        )
        if own > self._log_from_sqn:
            self._log_from_sqn = own
            self.writer.truncate(own)
        return True
