"""The queue of cached pages that may be evicted right now, in eviction order.

Entries are ordered by (tier, stamp, page_id): tier 0 are true leaves (no page names them as parent), tier 1 are
cached pages whose only children are pages in use; a cached page with a cached child is not queued at all (its child
goes first). Lower stamp = released longer ago. folio.cache.lineage decides tiers; this module only keeps the order.

A binary heap with lazy deletion: moving or removing a page leaves its old entry in the heap, recognised as stale
because it is no longer the page's live entry. That keeps put/discard O(1) and pop O(log n) amortised; the heap is
rebuilt when stale entries outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from folio.cache.errors import InvariantViolation

# (tier, stamp, page_id, seq): seq is unique per entry so that an entry is recognised by equality alone.
Entry = tuple[int, int, int, int]

_MIN_HEAP_SIZE_TO_COMPACT = 64


class EvictionQueue:
    def __init__(self) -> None:
        self._heap: list[Entry] = []
        self._live: dict[int, Entry] = {}  # page_id -> its entry in _heap
        self._next_seq = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, page_id: int) -> bool:
        return page_id in self._live

    def tier_of(self, page_id: int) -> int | None:
        entry = self._live.get(page_id)
        return None if entry is None else entry[0]

    def put(self, page_id: int, tier: int, stamp: int) -> None:
        """Queue page_id (or move it, if queued already) at (tier, stamp)."""
        entry = (tier, stamp, page_id, self._next_seq)
        self._next_seq += 1
        self._live[page_id] = entry
        heapq.heappush(self._heap, entry)
        self._maybe_compact()

    def discard(self, page_id: int) -> None:
        """Unqueue page_id if it is queued."""
        if self._live.pop(page_id, None) is not None:
            self._maybe_compact()

    def pop(self) -> int | None:
        """Remove and return the first queued page, or None if the queue is empty."""
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._live.get(entry[2]) == entry:
                del self._live[entry[2]]
                return entry[2]
        return None

    def clear(self) -> None:
        self._heap.clear()
        self._live.clear()

    def items(self) -> Iterator[tuple[int, int, int]]:
        """(page_id, tier, stamp) of every queued page, in no particular order."""
        for page_id, (tier, stamp, _, _) in self._live.items():
            yield page_id, tier, stamp

    def verify(self) -> None:
        """Raise InvariantViolation if a live entry is missing from the heap or the heap order is broken."""
        in_heap = {entry for entry in self._heap}
        for page_id, entry in self._live.items():
            if entry[2] != page_id:
                raise InvariantViolation(f"eviction queue: entry {entry} filed under page {page_id}")
            if entry not in in_heap:
                raise InvariantViolation(f"eviction queue: live entry of page {page_id} is not in the heap")
        for idx in range(1, len(self._heap)):
            if self._heap[idx] < self._heap[(idx - 1) // 2]:
                raise InvariantViolation(f"eviction queue: heap order broken at index {idx}")

    def _maybe_compact(self) -> None:
        if len(self._heap) > _MIN_HEAP_SIZE_TO_COMPACT and len(self._heap) > 2 * len(self._live):
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)
