"""The host tier: ready pages that the GPU pool evicts, kept in host-memory slots under their hash, so that a later
prompt with that prefix copies them back instead of computing them again. Torch-free bookkeeping; the copies are
folio.host_pages' business (the device side), which runs the transfers listed here.

Rules:
- A hash is READY in one tier at a time: a page moves to the host when the GPU pool evicts it (instead of being
  lost), and back when a prefix lookup reaches it (promote(): the host entry goes, a GPU page takes the hash). If
  the hash becomes ready on the GPU another way (a prompt computed it again), the host entry is dropped.
- Only ready pages move (full pages under a hash, with their parent link and tokens); partial pages are dropped.
- Host slots are recycled least recently stored first (logged "evicted"). The GPU evicts leaves first, so a
  sequence's deeper pages reach the host first and leave it first.

Device order. The device runs one plan's transfers as: every GPU->host copy (reads of the pages evicted), then the
plan's slot copies (folio.cache.manager.PageCopy), then every host->GPU copy, then the forward. Three rules keep
that grouping equal to the order in which the bookkeeping happened:
  - a slot read by a host->GPU copy is handed out again only after the plan's transfers are taken (so no GPU->host
    copy of the same plan overwrites it first);
  - a page being filled from the host is pinned until then (so no GPU->host copy of the same plan reads it before
    it is filled);
  - no slot copy of the same plan reads such a page (the manager asks `is_arriving`).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from folio.cache.events import EventLog, PageEventKind
from folio.cache.page import PageRecord

if TYPE_CHECKING:
    from folio.cache.pool import PagePool


@dataclass(frozen=True, slots=True)
class HostEntry:
    """A page's content kept in host slot `slot`: what set_ready needs to register it again."""

    slot: int
    parent: bytes | None
    tokens: tuple[int, ...]
    namespace: bytes
    depth: int


@dataclass(frozen=True, slots=True)
class HostTransfers:
    """One plan's copies, each list in bookkeeping order. to_host: (GPU page id, host slot) of evicted pages, run
    before anything writes those pages; from_host: (host slot, GPU page id), run after the plan's slot copies."""

    to_host: tuple[tuple[int, int], ...] = ()
    from_host: tuple[tuple[int, int], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.to_host or self.from_host)


NO_TRANSFERS = HostTransfers()


class HostTier:
    """Owned by a PagePool (it shares the pool's event log, so events stay in order)."""

    def __init__(self, num_host_pages: int, events: EventLog) -> None:
        if isinstance(num_host_pages, bool) or not isinstance(num_host_pages, int) or num_host_pages < 1:
            raise ValueError(f"num_host_pages must be an int >= 1, got {num_host_pages!r}")
        self.num_host_pages = num_host_pages
        self._events = events
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # oldest stored first
        self._free: list[int] = list(range(num_host_pages))  # min-heap of free slots
        self._deferred: list[int] = []  # slots read by this plan's host->GPU copies: free once taken
        self._to_host: list[tuple[int, int]] = []
        self._from_host: list[tuple[int, int]] = []
        self._arriving: dict[int, None] = {}  # GPU pages pinned until the plan's transfers are taken
        self.num_moved_to_host = 0  # pages copied GPU -> host since the start
        self.num_moved_from_host = 0  # pages copied host -> GPU since the start

    @property
    def num_used(self) -> int:
        return len(self._entries)

    def __contains__(self, page_hash: bytes) -> bool:
        return page_hash in self._entries

    def hashes(self) -> tuple[bytes, ...]:
        """Every hash held here, oldest stored first (a snapshot)."""
        return tuple(self._entries)

    def num_leading(self, hashes: Sequence[bytes]) -> int:
        """How many leading `hashes` are held here."""
        num = 0
        while num < len(hashes) and hashes[num] in self._entries:
            num += 1
        return num

    def is_arriving(self, page_id: int) -> bool:
        """Whether GPU page `page_id` is filled from the host by the plan being made (its slots are not there yet
        for a slot copy)."""
        return page_id in self._arriving

    # ---- the pool's hooks -----------------------------------------------------------------------------------

    def offer(self, page: PageRecord) -> bool:
        """The GPU pool is evicting ready page `page` (still describing its content): keep it in a slot and log
        "moved_to_host". False when no slot can be had (every one is read by this plan): the page is lost."""
        slot = self._take_slot()
        if slot is None:
            return False
        self._entries[page.hash] = HostEntry(slot, page.parent, page.tokens, page.namespace, page.depth)
        self._to_host.append((page.page_id, slot))
        self.num_moved_to_host += 1
        self._events.log(PageEventKind.MOVED_TO_HOST, page.hash, page.depth)
        return True

    def discard(self, page_hash: bytes) -> None:
        """The hash became ready on the GPU without the host's copy: forget it here (no event: the pool logs
        "stored", which tells a router the page is on the GPU again)."""
        entry = self._entries.pop(page_hash, None)
        if entry is not None:
            # (safe to reuse at once: no host->GPU copy reads it; a GPU->host copy of this plan that wrote it runs
            # before any later one, in order)
            heapq.heappush(self._free, entry.slot)

    def clear(self) -> None:
        """Forget everything (the pool is being reset), logging "evicted" for each hash held."""
        for page_hash, entry in self._entries.items():
            self._events.log(PageEventKind.EVICTED, page_hash, entry.depth)
        self._entries.clear()
        self._free = list(range(self.num_host_pages))
        self._deferred.clear()
        self._to_host.clear()
        self._from_host.clear()
        self._arriving.clear()

    # ---- promotion ------------------------------------------------------------------------------------------

    def take(self, hashes: Sequence[bytes]) -> list[HostEntry]:
        """Remove the entries of `hashes` (all held here) for promotion; their slots stay reserved until the
        plan's transfers are taken."""
        entries = [self._entries.pop(page_hash) for page_hash in hashes]
        self._deferred.extend(entry.slot for entry in entries)
        return entries

    def schedule_fetch(self, slot: int, page_id: int) -> None:
        self._from_host.append((slot, page_id))
        self._arriving[page_id] = None
        self.num_moved_from_host += 1

    def take_transfers(self) -> tuple[HostTransfers, list[int]]:
        """The copies listed since the last call, and the GPU pages to unpin now that they are part of a plan."""
        transfers = HostTransfers(tuple(self._to_host), tuple(self._from_host))
        arriving = list(self._arriving)
        self._to_host.clear()
        self._from_host.clear()
        self._arriving.clear()
        for slot in self._deferred:
            heapq.heappush(self._free, slot)
        self._deferred.clear()
        return (transfers if transfers else NO_TRANSFERS), arriving

    def _take_slot(self) -> int | None:
        if self._free:
            return heapq.heappop(self._free)
        if not self._entries:
            return None
        page_hash, entry = self._entries.popitem(last=False)
        self._events.log(PageEventKind.EVICTED, page_hash, entry.depth)
        return entry.slot


def promote(pool: PagePool, hashes: Sequence[bytes]) -> list[int]:
    """Bring the leading `hashes` that the pool's host tier holds back into GPU pages: allocate them (as many as
    can be had without preempting anyone), register each under its hash (READY, so others may share it at once:
    every forward that reads it runs after the copy) and schedule its host->GPU copy. Returns the page ids, each
    with one reference for the caller (and a pin, dropped by take_transfers)."""
    host = pool.host
    if host is None:
        return []
    num = min(host.num_leading(hashes), pool.num_allocatable)
    if num == 0:
        return []
    entries = host.take(hashes[:num])  # before allocating: evictions it causes must not recycle these slots
    page_ids = pool.allocate(num)
    for page_hash, entry, page_id in zip(hashes, entries, page_ids):
        if not pool.set_ready(page_id, page_hash, entry.parent, entry.tokens, namespace=entry.namespace):
            raise AssertionError(f"promote: hash {page_hash.hex()} was ready on the GPU and the host at once")
        pool.pin(page_id)
        host.schedule_fetch(entry.slot, page_id)
    return page_ids


def take_transfers(pool: PagePool) -> HostTransfers:
    """The host copies listed since the last call, for the plan being finished; unpins the pages they fill."""
    host = pool.host
    if host is None:
        return NO_TRANSFERS
    transfers, arriving = host.take_transfers()
    if arriving:
        pool.release(arriving)
    return transfers
