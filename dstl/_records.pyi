"""Type stub of the C extension ``dstl._records`` (source: ``dstl/_records.c``)."""

KIND_NONE: int
KIND_BYTES: int
KIND_INT64: int
KIND_FLOAT64: int
KIND_STR: int

def pack_int64(value: object, /) -> bytes: ...
def pack_float64(value: object, /) -> bytes: ...

_Column = tuple[int, bytes | None, bytes, bytes]

class RecordColumns:
    def __init__(
        self, capacity: int, max_bytes: int, user_key_kind: int, value_kind: int
    ) -> None: ...
    def append(
        self, op: int, key: bytes, key_group: int, user_key: bytes | None, value: bytes | None
    ) -> bool: ...
    def append_typed(
        self, op: int, key: bytes, key_group: int, user_key: object, value: object
    ) -> bool: ...
    def append_typed_list(
        self, op: int, key: bytes, key_group: int, user_key: object, values: list[object]
    ) -> bool: ...
    def take(
        self,
    ) -> tuple[int, bytes, bytes, bytes, bytes, _Column | None, _Column] | None: ...
    def __len__(self) -> int: ...
