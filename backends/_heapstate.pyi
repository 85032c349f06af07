"""Type stub of the C extension ``backends._heapstate`` (source: ``backends/_heapstate.c``)."""

from collections.abc import Callable
from typing import Any

from dstl._records import RecordColumns

class KeyContext:
    current_key: Any
    current_key_bytes: Any
    current_key_group: Any

class _HeapState:
    _backend: Any
    _table: dict[Any, Any]
    def __init__(
        self,
        backend: KeyContext,
        table: dict[Any, Any],
        records: RecordColumns | None = None,
        op: int | None = None,
        flush: Callable[[], object] | None = None,
    ) -> None: ...

class HeapValue(_HeapState):
    def update(self, value: Any) -> None: ...

class HeapList(_HeapState):
    def add(self, value: Any) -> None: ...
    def replace(self, items: list[Any], /) -> None: ...

class HeapMap(_HeapState):
    def put(self, user_key: Any, value: Any) -> None: ...
