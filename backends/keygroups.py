"""Key groups: the unit of state partitioning and rescaling.

A key's group is a stable hash of its *serialized bytes* modulo the maximum parallelism,
so it is the same in every process and every Python version (``hash()`` is not). Subtask
``i`` of ``p`` owns the contiguous half-open range computed as Flink does, which is what
lets a checkpoint taken at parallelism ``p`` restore at any ``q <= max_parallelism``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

DEFAULT_MAX_PARALLELISM = 128


def _fmix32(h: int) -> int:
    # MurmurHash3's finalizer spreads crc32's low-entropy bits over the whole word.
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h


def key_group_for(key_bytes: bytes, max_parallelism: int) -> int:
    """The key group of a serialized key: stable across processes and versions.

    ``_fmix32(crc32(key_bytes)) % max_parallelism``, inlined (this runs per record).
    """
    h = zlib.crc32(key_bytes)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h % max_parallelism


@dataclass(frozen=True, slots=True)
class KeyGroupRange:
    """The half-open range ``[start, end)`` of key groups a subtask owns."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"bad key group range [{self.start}, {self.end})")

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group < self.end

    def __len__(self) -> int:
        return self.end - self.start

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.start, self.end))

    def intersects(self, other: KeyGroupRange) -> bool:
        """Whether the two ranges share a key group."""
        return self.start < other.end and other.start < self.end

    @classmethod
    def for_subtask(cls, subtask: int, parallelism: int, max_parallelism: int) -> KeyGroupRange:
        """The range operator subtask ``subtask`` of ``parallelism`` owns."""
        if not 0 < parallelism <= max_parallelism:
            raise ValueError(f"parallelism {parallelism} must be in [1, {max_parallelism}]")
        if not 0 <= subtask < parallelism:
            raise ValueError(f"subtask {subtask} out of [0, {parallelism})")
        start = (subtask * max_parallelism + parallelism - 1) // parallelism
        end = ((subtask + 1) * max_parallelism + parallelism - 1) // parallelism
        return cls(start, end)


def subtask_for_key_group(key_group: int, parallelism: int, max_parallelism: int) -> int:
    """The subtask (of ``parallelism``) that owns ``key_group``; inverse of ``for_subtask``."""
    return key_group * parallelism // max_parallelism
