"""Type stub of the C extension ``dstl._durable`` (source: ``dstl/_durable.c``)."""

from typing_extensions import Buffer

def write_new(directory: str, tmp_name: str, name: str, data: Buffer, /) -> None: ...
