"""Type stub of the C extension ``dstl._durable`` (source: ``dstl/_durable.c``)."""

from collections.abc import Sequence

from typing_extensions import Buffer

def write_new(directory: str, tmp_name: str, name: str, data: Buffer, /) -> None: ...
def exchange(
    wfd: int, rfd: int, parts: Sequence[Buffer], capacity: int, timeout: float, /
) -> tuple[int, bytes]: ...
