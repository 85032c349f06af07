"""Route every row to the task that owns its key group, computed by Spark itself.

A key's group is ``fmix32(crc32(key bytes)) % max_parallelism``
(:func:`backends.keygroups.key_group_for`). For ``str`` keys (UTF-8) and ``int64`` keys
(8 bytes, little-endian) Spark computes it in SQL, with no Python call per row: ``crc32``
is a Spark function and MurmurHash3's finalizer is 32-bit arithmetic, done here in 64-bit
integers that never overflow (ANSI mode fails on overflow): a product ``h * c`` modulo
2^32 is ``h * c_lo + ((h * c_hi) mod 2^16) << 16`` with ``c = c_hi << 16 | c_lo``.

The owning task ``s`` of a key group follows from the parallelism; to make Spark's
``repartition(P, col)`` put task ``s``'s rows into partition ``s`` exactly, the column holds
an integer ``v_s`` with ``pmod(hash(v_s), P) == s`` (Spark's own hash, Murmur3 with seed 42,
computed in Python: :func:`spark_hash_int`). Every partition runs a task, with or without rows, so every
range acknowledges every batch. The state server checks each row's key group against its
range, so a wrong placement fails loudly instead of splitting state.

Every range must acknowledge every batch, also an empty one (its timers may be due), but
Spark optimizes a plan over an empty input away entirely. So each partition gets one
marker row (:data:`~coordinator.spark.config.MARKER` true, every other column null), which
the state server drops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from coordinator.spark.config import MARKER
from dstl.errors import ConfigError

_MASK32 = 0xFFFFFFFF


def _mul32(h: Column, c: int) -> Column:
    """``(h * c) mod 2^32`` for ``0 <= h < 2^32`` without a 64-bit overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    high = F.shiftleft((h * F.lit(hi)).bitwiseAND(F.lit(0xFFFF)), 16)
    return ((h * F.lit(lo)) + high).bitwiseAND(F.lit(_MASK32))


def key_bytes(key: Column, key_serializer: str) -> Column:
    """The serialized key as Spark binary (what the key serializer writes)."""
    if key_serializer == "str":
        return F.encode(key, "UTF-8")
    if key_serializer == "int64":
        big_endian = F.lpad(F.hex(key.cast("long")), 16, "0")
        return F.unhex(F.concat(*[F.substring(big_endian, 15 - 2 * i, 2) for i in range(8)]))
    raise ConfigError(f"no key-group expression for key serializer {key_serializer!r}")


_STEPS: list[Callable[[Column], Column]] = [
    lambda h: h.bitwiseXOR(F.shiftright(h, 16)),
    lambda h: _mul32(h, 0x85EBCA6B),
    lambda h: h.bitwiseXOR(F.shiftright(h, 13)),
    lambda h: _mul32(h, 0xC2B2AE35),
    lambda h: h.bitwiseXOR(F.shiftright(h, 16)),
]


def with_key_group(
    df: DataFrame, key: str, key_serializer: str, max_parallelism: int, column: str
) -> DataFrame:
    """``df`` with ``column`` holding the key group of ``key``
    (:func:`backends.keygroups.key_group_for`).

    One projection per step of the hash: each step reads the previous one two or three
    times, so a single expression would repeat ``crc32`` 32 times, and Spark's generated
    code for it overflows the stack of a streaming query's thread (seen: a
    ``StackOverflowError`` in the regex that strips generated-code comments). Spark does
    not merge projections that would repeat a non-trivial expression.
    """
    step = f"{column}__h"
    out = df.withColumn(step, F.crc32(key_bytes(F.col(key), key_serializer)))
    for fn in _STEPS:
        out = out.withColumn(step, fn(F.col(step)))
    return out.withColumn(column, F.pmod(F.col(step), F.lit(max_parallelism))).drop(step)


def _rotl32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _MASK32


def spark_hash_int(value: int, seed: int = 42) -> int:
    """Spark's ``hash(int)`` (``Murmur3_x86_32.hashInt``, signed): what ``repartition(P, c)``
    and ``F.hash`` compute for a 32-bit integer column."""
    k = (value & _MASK32) * 0xCC9E2D51 & _MASK32
    k = _rotl32(k, 15) * 0x1B873593 & _MASK32
    h = _rotl32(seed & _MASK32 ^ k, 13)
    h = (h * 5 + 0xE6546B64) & _MASK32
    h ^= 4
    h ^= h >> 16
    h = h * 0x85EBCA6B & _MASK32
    h ^= h >> 13
    h = h * 0xC2B2AE35 & _MASK32
    h ^= h >> 16
    return h - (1 << 32) if h & 0x80000000 else h


def partition_values(parallelism: int) -> list[int]:
    """``v_s`` for every task ``s``: ``pmod(hash(v_s), parallelism) == s`` in Spark.

    Computed here, not asked of Spark: a Spark job per query start cost 0.1-0.3 s of the
    first batch after every restart and rescale (measured on local[2]).
    """
    found: dict[int, int] = {}
    for v in range(64 * parallelism + 64):
        found.setdefault(spark_hash_int(v) % parallelism, v)  # Python's % is pmod
        if len(found) == parallelism:
            break
    if len(found) != parallelism:
        raise ConfigError(f"could not place {parallelism} partitions with Spark's hash")
    return [found[s] for s in range(parallelism)]


def route(
    df: DataFrame,
    key: str,
    key_serializer: str,
    parallelism: int,
    max_parallelism: int,
    values: list[int],
) -> DataFrame:
    """``df`` repartitioned so that partition ``s`` holds exactly task ``s``'s key groups."""
    column = "__changelog_state_partition"
    rows = with_key_group(df, key, key_serializer, max_parallelism, column)
    owner = F.floor(F.col(column) * F.lit(parallelism) / F.lit(max_parallelism)).cast("int")
    placed: Any = F.element_at(F.array(*[F.lit(v) for v in values]), owner + F.lit(1))
    rows = rows.withColumn(column, placed).withColumn(MARKER, F.lit(None).cast("boolean"))
    markers = df.sparkSession.range(
        0, parallelism, 1, 1
    ).select(  # built in the JVM: no Python rows
        F.element_at(F.array(*[F.lit(v) for v in values]), F.col("id").cast("int") + 1).alias(
            column
        ),
        F.lit(True).alias(MARKER),
    )
    rows = rows.unionByName(markers, allowMissingColumns=True)
    return rows.repartition(parallelism, column).drop(column)
