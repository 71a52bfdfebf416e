"""The host tier: host-memory slots holding ready pages' K/V under their hash, so that a prompt whose prefix the GPU
pool evicted copies it back instead of computing it again. Torch-free bookkeeping; the copies are folio.host_pages'
business (the device side), which runs the transfers listed here.

Rules:
- A host entry is either host-only (its page was evicted from the GPU) or a mirror: the same hash is READY on a GPU
  page too, and the slot holds (or is being given) the same K/V. Evicting a mirrored page costs no copy: its entry
  becomes host-only. Entries become mirrors three ways: write-through (`write_through=True`: every page that a
  forward fills is copied to a slot once that forward is done, while later steps run, so that evictions never
  wait for a copy), promotion (a prefix lookup brings a host-only entry back: the slot keeps its copy), and a
  prompt computing a host-only hash again (the slot's copy is as good as the new one).
- Only ready pages are stored (full pages under a hash, with their parent link and tokens); partial pages are not.
- Slots are recycled least recently stored first: a host-only entry's hash is then lost (logged "evicted"), a
  mirror's only loses its copy (its page is still on the GPU). The GPU evicts leaves first, so a sequence's deeper
  pages reach the host first and leave it first.

Device order. The device runs one plan's transfers as: the mirror copies (GPU -> host, of pages filled by earlier
forwards), the write-backs (GPU -> host, pages evicted without a mirror), the plan's slot copies
(folio.cache.manager.PageCopy), then the fetches (host -> GPU) beside the plan's forward, which reads none of the
pages they fill (the scheduler holds a sequence holding an arriving page back a step: manager.reads_arriving_page);
the next plan's forward waits for them. Rules that keep this grouping equal to the bookkeeping's order:
  - a slot that a fetch of the plan reads is not recycled until the plan's transfers are taken (no copy of the same
    plan overwrites it first);
  - a page being filled from the host is pinned until then (no GPU -> host copy of the same plan reads it before it
    is filled) and no slot copy of the same plan reads it (the manager asks `is_arriving`);
  - mirror copies are listed after the forward that fills their pages was launched (manager.commit), so they run
    with the next plan, once that forward is done. A plan that evicts a mirrored page whose copy may still be
    running names that copy's plan (`HostTransfers.wait_ticket`): the device makes its forward wait for it.
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
    """A page's content kept in host slot `slot`: what set_ready needs to register it again, and `ticket`, the plan
    whose transfers copy it there."""

    slot: int
    parent: bytes | None
    tokens: tuple[int, ...]
    namespace: bytes
    depth: int
    ticket: int


@dataclass(frozen=True, slots=True)
class HostTransfers:
    """One plan's copies, each list in bookkeeping order. mirror: (GPU page id, host slot) of pages filled by
    earlier forwards (write-through); to_host: (GPU page id, host slot) of pages evicted without a mirror, run before
    anything writes those pages; from_host: (host slot, GPU page id), run after the plan's slot copies. ticket: this
    plan's number (its copies are done when the device's mark for it is); wait_ticket: the latest plan whose mirror
    copy of a page this plan evicts (and so may overwrite) the forward must wait for, -1 for none."""

    to_host: tuple[tuple[int, int], ...] = ()
    from_host: tuple[tuple[int, int], ...] = ()
    mirror: tuple[tuple[int, int], ...] = ()
    ticket: int = -1
    wait_ticket: int = -1

    def __bool__(self) -> bool:
        return bool(self.to_host or self.from_host or self.mirror or self.wait_ticket >= 0)


NO_TRANSFERS = HostTransfers()


class HostTier:
    """Owned by a PagePool (it shares the pool's event log, so events stay in order)."""

    def __init__(self, num_host_pages: int, events: EventLog, *, write_through: bool = False) -> None:
        if isinstance(num_host_pages, bool) or not isinstance(num_host_pages, int) or num_host_pages < 1:
            raise ValueError(f"num_host_pages must be an int >= 1, got {num_host_pages!r}")
        self.num_host_pages = num_host_pages
        self.write_through = write_through
        self._events = events
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # oldest stored first
        self._mirrored: dict[bytes, int] = {}  # hash -> GPU page holding it READY too
        self._free: list[int] = list(range(num_host_pages))  # min-heap of free slots
        self._reading: set[int] = set()  # slots read by this plan's host->GPU copies: not recycled until taken
        self._to_host: list[tuple[int, int]] = []
        self._from_host: list[tuple[int, int]] = []
        self._mirror: list[tuple[int, int]] = []
        self._arriving: dict[int, None] = {}  # GPU pages pinned until the plan's transfers are taken
        self._ticket = 0  # the number of the plan whose transfers are being listed
        self._wait_ticket = -1
        self.num_moved_to_host = 0  # pages evicted from the GPU into the host tier since the start
        self.num_moved_from_host = 0  # pages copied host -> GPU since the start
        self.num_copied_to_host = 0  # GPU -> host copies since the start (write-backs and mirror copies)

    @property
    def num_used(self) -> int:
        return len(self._entries)

    def __contains__(self, page_hash: bytes) -> bool:
        return page_hash in self._entries

    def hashes(self) -> tuple[bytes, ...]:
        """Every hash held here (mirrors too), oldest stored first (a snapshot)."""
        return tuple(self._entries)

    def mirrors(self) -> dict[bytes, int]:
        """Hash -> GPU page of the entries whose page is also on the GPU (a snapshot)."""
        return dict(self._mirrored)

    def num_leading(self, hashes: Sequence[bytes]) -> int:
        """How many leading `hashes` are held here only (not on the GPU)."""
        num = 0
        while num < len(hashes) and hashes[num] in self._entries and hashes[num] not in self._mirrored:
            num += 1
        return num

    @property
    def num_arriving(self) -> int:
        return len(self._arriving)

    def is_arriving(self, page_id: int) -> bool:
        """Whether GPU page `page_id` is filled from the host by the plan being made (its slots are not there yet
        for a slot copy)."""
        return page_id in self._arriving

    # ---- the pool's hooks -----------------------------------------------------------------------------------

    def on_ready(self, page: PageRecord) -> None:
        """Ready page `page` was just registered under its hash: a host-only entry of that hash becomes its mirror;
        otherwise, with write-through, it gets a slot and a mirror copy (run with the next plan)."""
        page_hash = page.hash
        if page_hash in self._entries:
            self._mirrored[page_hash] = page.page_id
            return
        if not self.write_through:
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._entries[page_hash] = HostEntry(slot, page.parent, page.tokens, page.namespace, page.depth,
                                             self._ticket)
        self._mirrored[page_hash] = page.page_id
        self._mirror.append((page.page_id, slot))
        self.num_copied_to_host += 1

    def offer(self, page: PageRecord) -> bool:
        """The GPU pool is evicting ready page `page` (still describing its content): keep it (a mirror already
        has its copy; otherwise a slot and a write-back) and log "moved_to_host". False when no slot can be had
        (every one is read by this plan): the page is lost."""
        entry = self._entries.get(page.hash)
        if entry is not None:  # (a mirror: a hash is ready on one GPU page at most)
            del self._mirrored[page.hash]
            self._entries.move_to_end(page.hash)
            self._wait_ticket = max(self._wait_ticket, entry.ticket)
        else:
            slot = self._take_slot()
            if slot is None:
                return False
            self._entries[page.hash] = HostEntry(slot, page.parent, page.tokens, page.namespace, page.depth,
                                                 self._ticket)
            self._to_host.append((page.page_id, slot))
            self.num_copied_to_host += 1
        self.num_moved_to_host += 1
        self._events.log(PageEventKind.MOVED_TO_HOST, page.hash, page.depth)
        return True

    def clear(self) -> None:
        """Forget everything (the pool is being reset), logging "evicted" for each host-only hash (the pool logs
        its own ready hashes)."""
        for page_hash, entry in self._entries.items():
            if page_hash not in self._mirrored:
                self._events.log(PageEventKind.EVICTED, page_hash, entry.depth)
        self._entries.clear()
        self._mirrored.clear()
        self._free = list(range(self.num_host_pages))
        self._reading.clear()
        self._to_host.clear()
        self._from_host.clear()
        self._mirror.clear()
        self._arriving.clear()
        self._wait_ticket = -1

    # ---- promotion ------------------------------------------------------------------------------------------

    def take(self, hashes: Sequence[bytes]) -> list[HostEntry]:
        """The entries of `hashes` (all held here only), for promotion; their slots are not recycled until the
        plan's transfers are taken."""
        entries = [self._entries[page_hash] for page_hash in hashes]
        self._reading.update(entry.slot for entry in entries)
        return entries

    def schedule_fetch(self, slot: int, page_id: int) -> None:
        self._from_host.append((slot, page_id))
        self._arriving[page_id] = None
        self.num_moved_from_host += 1

    def take_transfers(self) -> tuple[HostTransfers, list[int]]:
        """The copies listed since the last call, and the GPU pages to unpin now that they are part of a plan."""
        transfers = HostTransfers(tuple(self._to_host), tuple(self._from_host), tuple(self._mirror),
                                  self._ticket, self._wait_ticket)
        arriving = list(self._arriving)
        self._to_host.clear()
        self._from_host.clear()
        self._mirror.clear()
        self._arriving.clear()
        self._reading.clear()
        self._wait_ticket = -1
        self._ticket += 1
        return (transfers if transfers else NO_TRANSFERS), arriving

    def _take_slot(self) -> int | None:
        if self._free:
            return heapq.heappop(self._free)
        victim = next((h for h, e in self._entries.items() if e.slot not in self._reading), None)
        if victim is None:
            return None
        entry = self._entries.pop(victim)
        if self._mirrored.pop(victim, None) is None:
            self._events.log(PageEventKind.EVICTED, victim, entry.depth)
        elif entry.ticket == self._ticket:  # (its mirror copy, not yet made, would only be overwritten)
            self._mirror = [(page, slot) for page, slot in self._mirror if slot != entry.slot]
        return entry.slot


def promote(pool: PagePool, hashes: Sequence[bytes]) -> list[int]:
    """Bring the leading `hashes` that the pool's host tier holds (and the GPU does not) back into GPU pages:
    allocate them (as many as can be had without preempting anyone), register each under its hash (READY, so
    others may share it at once: every forward that reads it runs after the copy; its host entry becomes its
    mirror) and schedule its host->GPU copy. Returns the page ids, each with one reference for the caller (and a
    pin, dropped by take_transfers)."""
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
            raise AssertionError(f"promote: hash {page_hash.hex()} was ready on the GPU and held host-only")
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
