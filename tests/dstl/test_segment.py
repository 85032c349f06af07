"""The segment format: self-describing, compressed, checksummed per block, Spark-readable."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dstl.errors import CorruptionError
from dstl.segment import (
    BLOCK_SCHEMA,
    FORMAT_NAME,
    METADATA_KEY,
    SEGMENT_VERSION,
    Block,
    SegmentReader,
    by_key_group,
    encode_segment,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

LOCATION = "file:///store/jobs/j/changelog/w/00000000000000a1-abc.parquet"


def _block(writer: str, sqn: int, n: int) -> Block:
    table = pa.Table.from_pydict(
        {
            "key_group": [i % 7 for i in range(n)],
            "sqn": [sqn] * n,
            "state": ["counts"] * n,
            "op": [1] * n,
            "key": [f"key-{writer}-{i}".encode() for i in range(n)],
            "user_key": [None if i % 3 else b"uk" for i in range(n)],
            "value": [f"value-{i}".encode() * 3 for i in range(n)],
        },
        schema=BLOCK_SCHEMA,
    )
    return Block(writer, sqn, sqn + 1, table)


BLOCKS = [_block("a", 0, 40), _block("b", 3, 25)]


def _read_all(data: bytes) -> list[pa.Table]:
    reader = SegmentReader(data, LOCATION)
    return [reader.read_block(i, b["writer"]) for i, b in enumerate(reader.blocks)]


def test_footer_describes_the_segment() -> None:
    data = encode_segment(BLOCKS)
    pf = pq.ParquetFile(io.BytesIO(data))
    meta = json.loads(pf.metadata.metadata[METADATA_KEY])
    assert meta["format"] == FORMAT_NAME and meta["version"] == SEGMENT_VERSION
    assert meta["checksum"] == "crc32"
    assert [(b["writer"], b["sqn_start"], b["sqn_end"], b["rows"]) for b in meta["blocks"]] == [
        ("a", 0, 1, 40),
        ("b", 3, 4, 25),
    ]
    assert pf.metadata.num_row_groups == 2
    assert pf.metadata.row_group(0).column(0).compression == "ZSTD"
    tables = _read_all(data)
    assert tables[1]["key"].to_pylist() == by_key_group(BLOCKS[1].table)["key"].to_pylist()
    assert tables[0].equals(by_key_group(BLOCKS[0].table))


def test_an_ungrouped_segment_holds_its_rows_as_appended() -> None:
    """What a barrier's segment holds (``grouped=False``): the same rows, footer and
    checksums, in the order they were appended."""
    data = encode_segment(BLOCKS, grouped=False)
    tables = _read_all(data)
    assert [t.equals(b.table) for t, b in zip(tables, BLOCKS, strict=True)] == [True, True]
    assert BLOCKS[0].table["key_group"].to_pylist() != sorted(
        BLOCKS[0].table["key_group"].to_pylist()
    )  # else this would not tell the two apart
    reader = SegmentReader(data, LOCATION)
    for i in range(len(BLOCKS)):
        reader.verify_block(i)


def test_a_block_holds_its_rows_by_key_group_each_key_in_order() -> None:
    """Grouped by key group (the column then takes a few bytes a block); within a group
    the rows keep the order they were appended in, so each key's changes do."""
    rnd = random.Random(3)
    n = 5_000
    keys = [rnd.randrange(300) for _ in range(n)]
    table = pa.Table.from_pydict(
        {
            "key_group": [k % 128 - (k == 7) * (k % 128 + 1) for k in keys],  # 7: META, -1
            "sqn": [i // 1000 for i in range(n)],
            "state": ["s" if i % 2 else "t" for i in range(n)],
            "op": [1] * n,
            "key": [b"%d" % k for k in keys],
            "user_key": [None] * n,
            "value": [b"%d" % i for i in range(n)],
        },
        schema=BLOCK_SCHEMA,
    )
    (got,) = _read_all(encode_segment([Block("w", 0, 5, table)]))
    groups = got["key_group"].to_pylist()
    assert groups == sorted(groups) and groups[0] == -1
    per_key: dict[bytes, list[int]] = {}
    for k, v in zip(got["key"].to_pylist(), got["value"].to_pylist(), strict=True):
        per_key.setdefault(k, []).append(int(v))
    assert all(vs == sorted(vs) for vs in per_key.values())  # appended in value order
    assert sorted(got.to_pylist(), key=lambda r: int(r["value"])) == table.to_pylist()
    pf = pq.ParquetFile(io.BytesIO(encode_segment([Block("w", 0, 5, table)])))
    assert pf.metadata.row_group(0).column(1).total_compressed_size < 1_000  # 4.7k as appended


def test_only_columns_of_few_values_are_dictionary_encoded() -> None:
    """Keys, user keys and values are written plain (zstd finds what repeats); the
    columns of a few distinct values (writer, key group, sqn, state, op) use a dictionary."""
    n = 100_000
    rnd = random.Random(7)
    rows = [rnd.randbytes(16) for _ in range(n)]  # incompressible, all distinct
    table = pa.Table.from_pydict(
        {
            "key_group": [i % 128 for i in range(n)],
            "sqn": [1] * n,
            "state": ["m"] * n,
            "op": [1] * n,
            "key": [f"key-{i % 5000}".encode() for i in range(n)],
            "user_key": [None] * n,
            "value": rows,
        },
        schema=BLOCK_SCHEMA,
    )
    pf = pq.ParquetFile(io.BytesIO(encode_segment([Block("w", 1, 2, table)])))
    columns = {c.path_in_schema: c for c in map(pf.metadata.row_group(0).column, range(8))}
    assert {name for name, c in columns.items() if c.has_dictionary_page} == {
        "writer", "key_group", "sqn", "state", "op"
    }  # fmt: skip
    assert "PLAIN" in columns["value"].encodings
    assert columns["key"].total_compressed_size < columns["value"].total_compressed_size / 4
    assert sorted(pf.read()["value"].to_pylist()) == sorted(rows)


def test_bit_flips_are_detected_or_harmless() -> None:
    """A flipped bit anywhere in a block raises; elsewhere it never changes what is read."""
    data = encode_segment(BLOCKS)
    expected = [t.to_pylist() for t in _read_all(data)]
    meta = json.loads(pq.ParquetFile(io.BytesIO(data)).metadata.metadata[METADATA_KEY])
    in_blocks = {
        pos for b in meta["blocks"] for pos in range(b["offset"], b["offset"] + b["length"])
    }
    detected = 0
    for pos in range(len(data)):  # every byte, one bit each (varying which bit)
        corrupt = bytearray(data)
        corrupt[pos] ^= 1 << (pos % 8)
        try:
            got = [t.to_pylist() for t in _read_all(bytes(corrupt))]
        except CorruptionError as exc:
            assert "00000000000000a1-abc.parquet" in str(exc)
            detected += 1
            continue
        assert pos not in in_blocks, f"flip at {pos} (in a block) went unnoticed"
        assert got == expected, f"flip at {pos} changed the data silently"
    assert detected >= len(in_blocks)


def test_flip_in_the_middle_of_the_data_names_the_block_and_file() -> None:
    data = bytearray(encode_segment(BLOCKS))
    meta = json.loads(pq.ParquetFile(io.BytesIO(bytes(data))).metadata.metadata[METADATA_KEY])
    second = meta["blocks"][1]
    data[second["offset"] + second["length"] // 2] ^= 0x10
    reader = SegmentReader(bytes(data), LOCATION)
    reader.read_block(0, "a")  # the other block is intact and still readable
    with pytest.raises(CorruptionError, match=r"block 1 .*00000000000000a1-abc\.parquet"):
        reader.read_block(1, "b")


@pytest.mark.parametrize("keep", [0, 4, 100, -8, -1])
def test_truncated_segment_is_detected(keep: int) -> None:
    data = encode_segment(BLOCKS)
    with pytest.raises(CorruptionError, match=r"00000000000000a1-abc\.parquet"):
        _read_all(data[:keep])


def test_wrong_writer_or_block_is_corruption() -> None:
    reader = SegmentReader(encode_segment(BLOCKS), LOCATION)
    with pytest.raises(CorruptionError, match="belongs to writer 'a'"):
        reader.read_block(0, "b")
    with pytest.raises(CorruptionError, match="no block 2"):
        reader.read_block(2, "a")


def test_a_parquet_file_that_is_not_a_segment_is_rejected() -> None:
    sink = io.BytesIO()
    pq.write_table(pa.table({"x": [1]}), sink)
    with pytest.raises(CorruptionError, match="not a changelog segment"):
        SegmentReader(sink.getvalue(), LOCATION)


def test_plain_spark_reads_a_segment_directory(spark: SparkSession, tmp_path: Path) -> None:
    directory = tmp_path / "changelog"
    directory.mkdir()
    (directory / "0000000000000001-a.parquet").write_bytes(encode_segment(BLOCKS))
    (directory / "0000000000000002-b.parquet").write_bytes(encode_segment([_block("c", 9, 5)]))
    df = spark.read.parquet(str(directory))
    assert df.columns == [
        "writer",
        "key_group",
        "sqn",
        "state",
        "op",
        "key",
        "user_key",
        "value",
    ]
    rows = {
        (r["writer"], r["sqn"]): r["n"]
        for r in df.groupBy("writer", "sqn").count().withColumnRenamed("count", "n").collect()
    }
    assert rows == {("a", 0): 40, ("b", 3): 25, ("c", 9): 5}
    first = df.where("writer = 'b'").orderBy("key").first()
    assert first is not None and bytes(first["key"]) == b"key-b-0"
