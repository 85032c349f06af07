"""The output side of a task: chained stateless steps, routing, batching, events.

A task emits ``(value, timestamp)`` pairs. For each output edge the :class:`RecordWriter`
applies the edge's chained ``map``/``filter``/``flat_map`` steps, then routes:

- by key: the key is selected, serialized and hashed to its key group *once*, here; the
  record travels as ``(key, key_bytes, key_group, value, timestamp)`` and the keyed
  operator sets it as its current key without serializing again;
- one to one (equal parallelism) or round robin: as ``(value, timestamp)``.

Batches are cut at the receiving inbox's batch hint (a quarter of its debloated
capacity). :meth:`RecordWriter.flush` reserves the sequence numbers of every pending
batch in every inbox before it blocks on any, so a barrier sent while it is blocked (from
the wait hook, see :mod:`coordinator.embedded.channels`) counts all of them as before it.
Task thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from backends.keygroups import key_group_for
from coordinator.embedded.channels import Barrier, Inbox
from coordinator.embedded.pipeline import FILTER, MAP, Edge, KeySpec, Transform

Pair = tuple[Any, "int | None"]


def apply_transforms(transforms: tuple[Transform, ...], batch: list[Pair]) -> list[Pair]:
    """``batch`` through the chained steps, in order."""
    for t in transforms:
        fn = t.fn
        if t.kind == MAP:
            batch = [(fn(v), ts) for v, ts in batch]
        elif t.kind == FILTER:
            batch = [p for p in batch if fn(p[0])]
        else:
            batch = [(out, ts) for v, ts in batch for out in fn(v)]
    return batch


class Output:
    """One output edge of one subtask: the inboxes it sends to and its channel there."""

    def __init__(
        self,
        edge: Edge,
        targets: list[Inbox],
        channel: int,
        max_parallelism: int,
    ) -> None:
        self.edge = edge
        self.targets = targets
        self.channel = channel
        self.max_parallelism = max_parallelism
        self.buffers: list[list[Any]] = [[] for _ in targets]
        self._next = channel % len(targets)

    def route(self, batch: Sequence[Pair]) -> None:
        """Append ``batch`` (after the edge's steps) to the buffers of its targets."""
        batch = list(batch) if not isinstance(batch, list) else batch
        if self.edge.transforms:
            batch = apply_transforms(self.edge.transforms, batch)
        if not batch:
            return
        key = self.edge.key
        if key is not None:
            self._route_keyed(key, batch)
        elif len(self.targets) == 1:
            self.buffers[0].extend(batch)
        else:  # round robin, a batch at a time
            self.buffers[self._next].extend(batch)
            self._next = (self._next + 1) % len(self.targets)

    def _route_keyed(self, spec: KeySpec, batch: list[Pair]) -> None:
        select, serialize, project = spec.selector, spec.serializer.serialize, spec.value
        max_par = self.max_parallelism
        n = len(self.targets)
        buffers = self.buffers
        for value, ts in batch:
            key = select(value)
            key_bytes = serialize(key)
            group = key_group_for(key_bytes, max_par)
            buffers[group * n // max_par].append(
                (key, key_bytes, group, value if project is None else project(value), ts)
            )


class RecordWriter:
    """Every output edge of one subtask. Task thread only.

    ``on_wait`` runs while a send is blocked on a full inbox (every ``poll_s``): the task
    snapshots there for an unaligned barrier or a timed-out alignment.
    """

    def __init__(
        self,
        outputs: list[Output],
        on_wait: Callable[[], None] | None = None,
        poll_s: float = 0.05,
    ) -> None:
        self.outputs = outputs
        self.on_wait = on_wait
        self.poll_s = poll_s

    def write(self, batch: Sequence[Pair]) -> None:
        """Route ``batch`` into the buffers (sent by :meth:`flush`)."""
        for out in self.outputs:
            out.route(batch)

    def batch_hint(self) -> int:
        """The smallest batch hint of any receiving inbox (a source reads this many)."""
        return min((t.batch_hint() for o in self.outputs for t in o.targets), default=1 << 30)

    def flush(self) -> None:
        """Send every buffered record (blocks while a receiver is full)."""
        pending: list[tuple[Inbox, int, list[Any]]] = []
        for out in self.outputs:
            for i, buffer in enumerate(out.buffers):
                if not buffer:
                    continue
                inbox = out.targets[i]
                out.buffers[i] = []
                step = inbox.batch_hint()
                for start in range(0, len(buffer), step):
                    inbox.reserve(out.channel)
                    pending.append((inbox, out.channel, buffer[start : start + step]))
        for inbox, channel, chunk in pending:
            inbox.put(channel, chunk, self.on_wait, self.poll_s)

    def broadcast(self, element: Any) -> None:
        """Flush, then send ``element`` (a watermark, an aligned barrier) on every channel."""
        self.flush()
        for out in self.outputs:
            for inbox in out.targets:
                inbox.send(out.channel, element)

    def broadcast_priority(self, barrier: Barrier) -> None:
        """Send an unaligned barrier ahead of everything queued, on every channel; every
        record emitted so far counts as before it. Buffers are empty when this runs from
        the wait hook (the blocked flush took them), so the flush here never nests a wait."""
        self.flush()
        for out in self.outputs:
            for inbox in out.targets:
                inbox.put_priority(out.channel, barrier)
