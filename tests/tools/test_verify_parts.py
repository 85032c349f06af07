"""verify checks a staged sink part in its own format: JSON lines, or the Spark host's Parquet.

(Regression: verify read every part as JSON lines, so each checkpoint of a Spark-host store
failed with "corrupt" on its Parquet output parts.)
"""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from coordinator.handles import SinkTransactionHandle
from dstl.errors import CorruptionError
from tools.verify import _check_format

URL = "file:///store/part"


def _handle(suffix: str, records: int) -> SinkTransactionHandle:
    return SinkTransactionHandle(
        location="jobs/j/sink/op/0000/0000000000000001-abc." + suffix,
        checkpoint_id=1,
        subtask=0,
        records=records,
        size_bytes=1,
        suffix=suffix,
    )


def _parquet(rows: int) -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.table({"user": [f"u{i}" for i in range(rows)], "n": list(range(rows))}), out)
    return out.getvalue()


def test_a_parquet_part_is_checked_as_parquet() -> None:
    _check_format(_parquet(3), URL, _handle("parquet", 3))
    with pytest.raises(CorruptionError, match="2 records, handle says 3"):
        _check_format(_parquet(2), URL, _handle("parquet", 3))
    with pytest.raises(CorruptionError, match="unreadable"):
        _check_format(b"PAR1 not parquet", URL, _handle("parquet", 3))


def test_a_json_lines_part_is_checked_as_json_lines() -> None:
    data = "".join(json.dumps({"n": i}) + "\n" for i in range(3)).encode()
    _check_format(data, URL, _handle("jsonl", 3))
    with pytest.raises(CorruptionError, match="2 records, handle says 3"):
        _check_format(data[: data.rindex(b"{")], URL, _handle("jsonl", 3))
