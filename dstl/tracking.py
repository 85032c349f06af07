"""Which uploaded segments a worker may delete, and when.

A segment holds blocks of many writers. The storage tracks every segment it uploaded until
its fate is known. The rule (Flink's ``TaskChangelogRegistry``, made explicit):

1. A block is *claimed* by checkpoint ``C`` when a writer's ``persist(from, C)`` includes
   it (at call time, even while the upload is still in flight).
2. ``confirm(C)`` hands every segment holding a block claimed by ``C`` over to the
   coordinator: its metadata store counts references from then on; the DSTL **never**
   deletes a handed-over segment.
3. ``reset(C)`` (checkpoint aborted) drops ``C``'s claims. A failed upload drops the claims
   on its blocks too: every persist that claimed them failed with it.
4. A segment is **deleted** once it is not handed over, none of its blocks is claimed, no
   block is still in flight, and every writer with a block in it has truncated past that
   block (``truncate(to)`` with ``to >= block end``). Such bytes are needed by nobody: no
   confirmed checkpoint, no pending one, and no future one (the writers dropped them).
5. Nothing else deletes: a claim that is never confirmed nor reset keeps the segment; a
   closed writer or storage deletes nothing (unknown outcome: left for the orphan sweep).

Changes of an aborted checkpoint stay in the writer's log and are referenced by the next
persist; uploads are never re-done once they succeeded, so "re-uploaded elsewhere" only
happens for failed or losing attempts, whose files the uploader deletes itself.

Thread-safe: guarded by ``self._lock``; methods return the segments to delete, and the
caller deletes them outside the lock (no I/O here).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

BlockKey = tuple[str, int]  # (writer id, sqn_start)


@dataclass(slots=True)
class _Block:
    sqn_end: int
    in_flight: bool = True
    segment: str | None = None
    claims: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Segment:
    blocks: list[BlockKey]
    handed_over: bool = False


class SegmentTracker:
    """Tracks blocks, claims and truncation points; decides deletions (see module doc).

    Thread-safe: every method takes ``self._lock``; none does I/O.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[BlockKey, _Block] = {}
        self._segments: dict[str, _Segment] = {}
        self._truncated: dict[str, int] = {}

    # -- events ------------------------------------------------------------------------
    def submitted(self, writer: str, sqn_start: int, sqn_end: int) -> None:
        """An upload of ``[sqn_start, sqn_end)`` of ``writer`` was (re)submitted."""
        with self._lock:
            block = self._blocks.get((writer, sqn_start))
            if block is None:
                self._blocks[(writer, sqn_start)] = _Block(sqn_end)
            else:
                block.in_flight = True

    def claim(self, writer: str, checkpoint_id: int, sqn_starts: list[int]) -> None:
        """Checkpoint ``checkpoint_id`` will reference these blocks of ``writer``."""
        with self._lock:
            for start in sqn_starts:
                block = self._blocks.get((writer, start))
                if block is not None:
                    block.claims.add(checkpoint_id)

    def uploaded(self, segment: str, blocks: list[tuple[str, int, int]]) -> list[str]:
        """``blocks`` (writer, start, end) are durable in ``segment``; returns deletions."""
        with self._lock:
            keys: list[BlockKey] = []
            for writer, start, end in blocks:
                block = self._blocks.setdefault((writer, start), _Block(end))
                block.in_flight = False
                block.segment = segment
                keys.append((writer, start))
            self._segments[segment] = _Segment(keys)
            return self._collect([segment])

    def upload_failed(self, blocks: list[tuple[str, int, int]]) -> None:
        """The upload of ``blocks`` failed: every persist that claimed them failed too."""
        with self._lock:
            for writer, start, _end in blocks:
                block = self._blocks.get((writer, start))
                if block is not None:
                    block.in_flight = False
                    block.claims.clear()

    def confirm(self, writer: str, checkpoint_id: int) -> None:
        """Checkpoint completed: segments it claimed are handed over (never deleted here)."""
        with self._lock:
            for (w, _start), block in list(self._blocks.items()):
                if w != writer or checkpoint_id not in block.claims:
                    continue
                block.claims.discard(checkpoint_id)
                seg = self._segments.get(block.segment) if block.segment else None
                if seg is not None:
                    seg.handed_over = True

    def reset(self, writer: str, checkpoint_id: int) -> list[str]:
        """Checkpoint aborted: drop its claims; returns segments that became deletable."""
        with self._lock:
            touched: list[str] = []
            for (w, _start), block in self._blocks.items():
                if w == writer and checkpoint_id in block.claims:
                    block.claims.discard(checkpoint_id)
                    if block.segment is not None:
                        touched.append(block.segment)
            return self._collect(touched)

    def truncate(self, writer: str, to_sqn: int) -> list[str]:
        """``writer`` no longer needs changes below ``to_sqn``; returns deletions."""
        with self._lock:
            self._truncated[writer] = max(self._truncated.get(writer, to_sqn), to_sqn)
            touched: list[str] = []
            for key, block in list(self._blocks.items()):
                if key[0] != writer or block.sqn_end > to_sqn:
                    continue
                if block.segment is not None:
                    touched.append(block.segment)
                elif not block.in_flight:
                    del self._blocks[key]  # a failed upload the writer dropped
            return self._collect(touched)

    # -- queries -----------------------------------------------------------------------
    def tracked(self) -> dict[str, bool]:
        """Every tracked segment and whether it was handed over to the coordinator."""
        with self._lock:
            return {path: seg.handed_over for path, seg in self._segments.items()}

    # -- internals (lock held) -----------------------------------------------------------
    def _dead(self, key: BlockKey) -> bool:
        block = self._blocks[key]
        truncated = self._truncated.get(key[0])
        return (
            not block.in_flight
            and not block.claims
            and truncated is not None
            and truncated >= block.sqn_end
        )

    def _collect(self, candidates: list[str]) -> list[str]:
        deletable: list[str] = []
        for path in dict.fromkeys(candidates):
            seg = self._segments.get(path)
            if seg is None:
                continue
            if all(self._dead(k) for k in seg.blocks):
                if not seg.handed_over:
                    deletable.append(path)
                del self._segments[path]
                for k in seg.blocks:
                    if self._blocks.get(k) is not None and self._blocks[k].segment == path:
                        del self._blocks[k]
        return deletable
