"""Key groups: the unit of state partitioning and rescaling.

A key's group is a stable hash of its *serialized bytes* modulo the maximum parallelism,
so it is the same in every process and every Python version (``hash()`` is not). Subtask
``i`` of ``p`` owns the contiguous half-open range computed as Flink does, which is what
lets a checkpoint taken at parallelism ``p`` restore at any ``q <= max_parallelism``.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends import _heapstate

DEFAULT_MAX_PARALLELISM = 128


key_group_for = _heapstate.key_group_for
"""``key_group_for(key_bytes, max_parallelism) -> int``: the key group of a serialized key,
stable across processes and versions: zlib's crc32 of the bytes, through MurmurHash3's
32-bit finalizer (which spreads crc32's low-entropy bits over the whole word), modulo
``max_parallelism``. In C (:mod:`backends._heapstate`; ~300 ns a call in Python, once per
keyed record) with the Python twin as its fallback; both raise ValueError for a
``max_parallelism`` below 1."""


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
