"""The end-to-end workload, shared by our runtime and the Flink peer (standard library only).

Record ``i`` of the one source is ``(key, value)``: the first ``keys`` records load every
key once, in order (so the state has its full size early and both systems measure the
same state), then keys are uniform over ``[0, keys)`` (or over ``[0, hot)`` in the
hot-key variant). Keys and values are int64. The stream is a pure function of the
record index, so a source restarts at any offset (ours) or split position (Flink's
``NumberSequenceSource``) and both systems see the same records.

This module is imported by the Flink job inside Flink's own virtualenv: it must not
import anything of this project.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

BLOCK = 1 << 16
"""Records per random block: record ``i`` after the load is draw ``i % BLOCK`` of
``random.Random(i // BLOCK)``, so any offset is reached by generating one block."""


class KeyGen:
    """``key(i)`` of the workload with a one-block cache. Not thread-safe."""

    def __init__(self, keys: int, hot: int = 0) -> None:
        if keys < 1 or hot < 0:
            raise ValueError("keys must be >= 1 and hot >= 0")
        self.keys = keys
        self.span = hot or keys
        self._block = -1
        self._draws: list[int] = []

    def block(self, index: int) -> list[int]:
        """The keys of random block ``index`` (records ``keys + index * BLOCK`` on)."""
        if index != self._block:
            rnd = random.Random(index).random
            span = self.span
            self._draws = [int(rnd() * span) for _ in range(BLOCK)]
            self._block = index
        return self._draws

    def key(self, i: int) -> int:
        """The key of record ``i``."""
        if i < self.keys:
            return i
        j = i - self.keys
        return self.block(j // BLOCK)[j % BLOCK]


def value_of(i: int) -> int:
    """The value of record ``i`` (summed per key)."""
    return i % 1000


def records(keys: int, hot: int, offset: int) -> Iterator[tuple[int, int]]:
    """The records from ``offset`` on, without end."""
    gen = KeyGen(keys, hot)
    i = offset
    while i < keys:
        yield i, i % 1000
        i += 1
    while True:
        j = i - keys
        draws = gen.block(j // BLOCK)
        start = j % BLOCK
        for n, key in enumerate(draws[start:], i):
            yield key, n % 1000
        i += BLOCK - start
