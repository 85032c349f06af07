"""The keyed function API, shared by both hosts (the embedded runtime and the Spark host).

A pipeline author writes a keyed function once; the embedded runtime
(:mod:`coordinator.embedded`) and the Spark host (``coordinator/spark/``) run it unchanged.
Its shape is Flink's ``KeyedProcessFunction`` and reads like PySpark's
``StatefulProcessor`` (``init`` with a handle, rows of a key, timers)::

    class Sessions:
        def open(self, state: StateAccess) -> None:             # after restore
            self.count = state.get_state(ValueStateDescriptor("count", INT64))

        def process(self, key: str, value: dict, ctx: Context) -> None:
            n = (self.count.value() or 0) + 1
            self.count.update(n)
            ctx.register_event_time_timer(ctx.timestamp + 30 * 60_000)
            ctx.emit((key, n))

        def on_timer(self, key: str, timestamp: int, ctx: Context) -> None:  # optional
            ctx.emit((key, "session closed", self.count.value()))
            self.count.clear()

Timers are keyed state (:mod:`backends.timers`): registering, deleting and firing are
logged changes, so timers are checkpointed, restored and rescaled with the rest of the
state, and each fires exactly once per committed run (the firing and its output belong to
the same checkpoint). Event-time timers fire when the watermark passes them,
processing-time timers when the host's clock does; timestamps are epoch milliseconds.

A two-input keyed function (:class:`KeyedCoFunction`, the embedded runtime's ``connect``)
has ``process1`` and ``process2`` instead of ``process``, one per input, and shares its
state and timers between them.

:class:`KeyedRunner` is the host side: it owns the function, its backend's two timer
services and the context, and is driven by the host's task thread (``process``,
``process_keyed``, ``advance_watermark``, ``advance_processing_time``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from backends.state import StateDescriptor
from backends.timers import TimeDomain, TimerService, timer_descriptor

MIN_WATERMARK = -(1 << 63)
"""The watermark before any source reported one: no event-time timer fires."""


class StateAccess(Protocol):
    """What a keyed function sees of its backend in :meth:`KeyedFunction.open`."""

    def get_state(self, descriptor: StateDescriptor) -> Any:
        """The state object for ``descriptor``."""
        ...


class Context(Protocol):
    """What a keyed function sees during ``process`` and ``on_timer`` (task thread only).

    ``key`` is the current key; ``timestamp`` the record's event time (``None`` when the
    source gives none) or, in ``on_timer``, the timer's time; ``time_domain`` is ``None``
    in ``process`` and the firing timer's domain in ``on_timer``.
    """

    key: Any
    timestamp: int | None
    time_domain: TimeDomain | None

    def emit(self, value: Any) -> None:
        """Send ``value`` downstream (into the current checkpoint's output)."""
        ...

    def register_event_time_timer(self, timestamp: int) -> None:
        """Fire ``on_timer`` for the current key once the watermark reaches ``timestamp``."""
        ...

    def delete_event_time_timer(self, timestamp: int) -> None:
        """Delete the current key's event-time timer at ``timestamp`` (if any)."""
        ...

    def register_processing_time_timer(self, timestamp: int) -> None:
        """Fire ``on_timer`` for the current key once the host's clock reaches ``timestamp``."""
        ...

    def delete_processing_time_timer(self, timestamp: int) -> None:
        """Delete the current key's processing-time timer at ``timestamp`` (if any)."""
        ...

    def current_watermark(self) -> int:
        """The operator's event-time watermark (:data:`MIN_WATERMARK` before any)."""
        ...

    def current_processing_time(self) -> int:
        """The host's clock, epoch milliseconds."""
        ...


class KeyedFunction(Protocol):
    """User logic of a keyed operator: ``open`` once, then ``process`` per record.

    ``on_timer(key, timestamp, ctx)`` is optional: a function that registers timers
    must define it. Called on its task thread only.
    """

    def open(self, state: StateAccess) -> None:
        """Declare states (called once, after restore)."""
        ...

    def process(self, key: Any, value: Any, ctx: Context) -> None:
        """Handle one record of ``key`` (the backend's current key is already ``key``)."""
        ...


class KeyedCoFunction(Protocol):
    """User logic of a two-input keyed operator: records of the first input go to
    ``process1``, of the second to ``process2``; ``on_timer`` as in :class:`KeyedFunction`.
    Called on its task thread only."""

    def open(self, state: StateAccess) -> None:
        """Declare states (called once, after restore)."""
        ...

    def process1(self, key: Any, value: Any, ctx: Context) -> None:
        """Handle one record of the first input."""
        ...

    def process2(self, key: Any, value: Any, ctx: Context) -> None:
        """Handle one record of the second input."""
        ...


KeyedRecord = tuple[Any, bytes, int, Any, "int | None"]
"""A record routed by key: ``(key, key_bytes, key_group, value, timestamp)``. The host
serialized and hashed the key once, to route it; the backend takes the bytes as they are."""


class _RunnerContext:
    """The :class:`Context` a :class:`KeyedRunner` hands its function. Task thread only."""

    __slots__ = ("_runner", "emit", "key", "time_domain", "timestamp")

    def __init__(self, runner: KeyedRunner) -> None:
        self._runner = runner
        self.key: Any = None
        self.timestamp: int | None = None
        self.time_domain: TimeDomain | None = None
        self.emit: Callable[[Any], None] = _no_output

    def register_event_time_timer(self, timestamp: int) -> None:
        self._runner.timers(TimeDomain.EVENT).register(int(timestamp))

    def delete_event_time_timer(self, timestamp: int) -> None:
        self._runner.timers(TimeDomain.EVENT).delete(int(timestamp))

    def register_processing_time_timer(self, timestamp: int) -> None:
        self._runner.timers(TimeDomain.PROCESSING).register(int(timestamp))

    def delete_processing_time_timer(self, timestamp: int) -> None:
        self._runner.timers(TimeDomain.PROCESSING).delete(int(timestamp))

    def current_watermark(self) -> int:
        return self._runner.watermark

    def current_processing_time(self) -> int:
        return self._runner.clock_ms()


def _no_output(value: Any) -> None:
    raise RuntimeError("emit outside process/on_timer")


class KeyedRunner:
    """Runs one keyed function on one backend: records, watermarks, timers, output.

    Owned by the host's task thread (every method). Create it after the backend is
    restored: the timer services rebuild their queues from the restored timer state.
    Invariants: the watermark never goes back; a timer fires at most once, after the
    watermark (event time) or clock (processing time) reached it, in timestamp order.
    """

    def __init__(self, function: Any, backend: Any, clock_ms: Callable[[], int]) -> None:
        self.function = function
        self.backend = backend
        self.clock_ms = clock_ms
        self.watermark = MIN_WATERMARK
        # A domain's timer state exists once a timer was registered (or restored): a
        # function that never uses timers gets no timer state in its checkpoints.
        self._timers: dict[TimeDomain, TimerService] = {
            d: TimerService(backend, d)
            for d in TimeDomain
            if timer_descriptor(d).name in backend.state_metas()
        }
        self.context = _RunnerContext(self)
        self._on_timer: Callable[[Any, int, Any], None] | None = getattr(function, "on_timer", None)

    def open(self) -> None:
        """Call the function's ``open`` (once)."""
        self.function.open(self.backend)

    def timers(self, domain: TimeDomain) -> TimerService:
        """The timer service of ``domain`` (made at the first use)."""
        service = self._timers.get(domain)
        if service is None:
            service = self._timers[domain] = TimerService(self.backend, domain)
        return service

    def process(
        self, key: Any, value: Any, timestamp: int | None, emit: Callable[[Any], None]
    ) -> None:
        """One record: make ``key`` current and call ``process``; output goes to ``emit``."""
        self.backend.set_current_key(key)
        ctx = self.context
        ctx.key, ctx.timestamp, ctx.time_domain, ctx.emit = key, timestamp, None, emit
        self.function.process(key, value, ctx)

    def process_keyed(
        self,
        records: Iterable[KeyedRecord],
        emit: Callable[[Any], None],
        handler: Callable[[Any, Any, Any], None] | None = None,
    ) -> None:
        """Records keyed upstream (:data:`KeyedRecord`), each to ``handler`` (default: the
        function's ``process``; ``process1``/``process2`` of a two-input function) with
        the key bytes and group as given: the key is not serialized or hashed again.
        The caller routed them here, so their groups are this backend's."""
        handle = self.function.process if handler is None else handler
        set_raw = self.backend.set_current_key_raw
        ctx = self.context
        ctx.time_domain, ctx.emit = None, emit
        for key, key_bytes, key_group, value, timestamp in records:
            set_raw(key, key_bytes, key_group)
            ctx.key = key
            ctx.timestamp = timestamp
            handle(key, value, ctx)

    def advance_watermark(self, watermark: int, emit: Callable[[Any], None]) -> int:
        """Move the watermark to ``watermark`` (if later) and fire the event-time timers
        it passed; returns how many fired."""
        if watermark <= self.watermark:
            return 0
        self.watermark = watermark
        return self._fire(TimeDomain.EVENT, watermark, emit)

    def advance_processing_time(self, now_ms: int, emit: Callable[[Any], None]) -> int:
        """Fire the processing-time timers due at ``now_ms``; returns how many fired."""
        return self._fire(TimeDomain.PROCESSING, now_ms, emit)

    def next_processing_timer(self) -> int | None:
        """When the earliest processing-time timer is due (for the host's wake-up)."""
        service = self._timers.get(TimeDomain.PROCESSING)
        return None if service is None else service.next_timestamp()

    def _fire(self, domain: TimeDomain, until: int, emit: Callable[[Any], None]) -> int:
        service = self._timers.get(domain)
        if service is None:
            return 0
        on_timer = self._on_timer
        ctx = self.context

        def fire(ts: int, key: Any) -> None:
            if on_timer is None:
                raise TypeError(
                    f"{type(self.function).__name__} registered a timer but has no on_timer"
                )
            ctx.key, ctx.timestamp, ctx.time_domain, ctx.emit = key, ts, domain, emit
            on_timer(key, ts, ctx)

        return service.fire_until(until, fire)
