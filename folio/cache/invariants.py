"""PagePool.check(): recompute every index of the pool from its page records and compare.

Lives apart from pool.py so the per-step code stays short; it reads the private fields of the pool and of its parts
(lineage.Lineage, partial_index.PartialIndex, eviction.EvictionQueue) on purpose: it is their auditor, not a client.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from folio.cache.errors import InvariantViolation
from folio.cache.page import PageRecord, PageState
from folio.cache.partial_index import partial_key

if TYPE_CHECKING:
    from folio.cache.pool import PagePool


def verify(pool: PagePool) -> None:
    """Raise InvariantViolation naming the first broken invariant."""
    _verify_shared_state(pool)
    for page in pool._pages:
        _verify_page(pool, page)
    _verify_counters(pool)
    _verify_hash_indexes(pool)
    _verify_free_heap(pool)
    _verify_children(pool)
    _verify_eviction_queue(pool)
    _verify_partial_index(pool)
    _verify_all_cached_evictable(pool)
    if pool._host is not None:
        _verify_host_tier(pool)


def _fail(message: str) -> None:
    raise InvariantViolation(message)


def _verify_shared_state(pool: PagePool) -> None:
    """The pool's parts work on the pool's own page list, ready-hash index and eviction queue, not on copies."""
    if pool._lineage._pages is not pool._pages:
        _fail("the lineage reads another page list than the pool's")
    if pool._lineage._ready is not pool._ready:
        _fail("the lineage reads another ready-hash index than the pool's")
    if pool._lineage._queue is not pool._eviction:
        _fail("the lineage fills another eviction queue than the one allocate() pops")


def _verify_page(pool: PagePool, page: PageRecord) -> None:
    where = page.describe()
    if page.refcount < 0:
        _fail(f"{where}: negative refcount")
    if (page.refcount > 0) != (page.state is PageState.IN_USE):
        _fail(f"{where}: refcount does not match the state")
    if page.state is PageState.FREE:
        if page.hash is not None or page.ready or page.has_parent or page.tokens is not None:
            _fail(f"{where}: a free page keeps content")
    if page.state is PageState.CACHED and not (page.ready or (page.hash is None and page.tokens is not None)):
        _fail(f"{where}: a cached page needs a ready hash or recorded tokens, and no pending claim")
    if page.ready and page.hash is None:
        _fail(f"{where}: ready without a hash")
    if (page.hash is not None or page.tokens is not None) and not page.has_parent:
        _fail(f"{where}: has content but no parent link")
    if not page.has_parent and page.parent is not None:
        _fail(f"{where}: parent hash without a parent link")
    if page.ready and len(page.tokens or ()) != pool.page_size:
        _fail(f"{where}: a ready page must record exactly page_size tokens")
    if page.tokens is not None and not 1 <= len(page.tokens) <= pool.page_size:
        _fail(f"{where}: recorded token count out of range")
    if page.tokens is None and page.namespace:
        _fail(f"{where}: namespace without recorded tokens")
    if page.hash is not None and page.hash == page.parent:
        _fail(f"{where}: names its own hash as parent")


def _verify_counters(pool: PagePool) -> None:
    by_state = Counter(page.state for page in pool._pages)
    if by_state[PageState.IN_USE] != pool.num_in_use:
        _fail(f"num_in_use is {pool.num_in_use}, but {by_state[PageState.IN_USE]} pages are in use")
    if by_state[PageState.CACHED] != pool.num_cached:
        _fail(f"num_cached is {pool.num_cached}, but {by_state[PageState.CACHED]} pages are cached")
    if by_state[PageState.FREE] != pool.num_free:
        _fail(f"num_free is {pool.num_free}, but {by_state[PageState.FREE]} pages are free")


def _verify_hash_indexes(pool: PagePool) -> None:
    ready = {page.hash: page.page_id for page in pool._pages if page.ready}
    pending = {page.hash: page.page_id for page in pool._pages if page.is_pending}
    if sum(page.ready for page in pool._pages) != len(ready):
        _fail("two pages hold the same ready hash")
    if sum(page.is_pending for page in pool._pages) != len(pending):
        _fail("two pages hold the same pending hash")
    if ready.keys() & pending.keys():
        _fail("a hash is both ready and pending")
    if ready != pool._ready:
        _fail("the ready-hash index does not match the page records")
    if pending != pool._pending:
        _fail("the pending-hash index does not match the page records")
    for page_id in pending.values():
        if pool._pages[page_id].state is not PageState.IN_USE:
            _fail(f"{pool._pages[page_id].describe()}: pending but not in use")


def _verify_free_heap(pool: PagePool) -> None:
    heap = pool._free
    free_ids = sorted(page.page_id for page in pool._pages if page.state is PageState.FREE)
    if sorted(heap) != free_ids:
        _fail("the free list does not hold exactly the free pages")
    for idx in range(1, len(heap)):
        if heap[idx] < heap[(idx - 1) // 2]:
            _fail(f"the free list's heap order is broken at index {idx}")


def _verify_children(pool: PagePool) -> None:
    num_children: Counter[bytes] = Counter()
    num_cached_children: Counter[bytes] = Counter()
    for page in pool._pages:
        if page.has_parent and page.parent is not None:
            num_children[page.parent] += 1
            if page.state is PageState.CACHED:
                num_cached_children[page.parent] += 1
    if dict(num_children) != pool._lineage.num_children:
        _fail("child counts do not match the pages' parent links")
    if dict(num_cached_children) != pool._lineage.num_cached_children:
        _fail("cached-child counts do not match the pages' parent links")


def _verify_eviction_queue(pool: PagePool) -> None:
    pool._eviction.verify()
    expected = {}
    for page in pool._pages:
        if page.state is PageState.CACHED:
            tier = pool._lineage.tier(page)
            if tier is not None:
                expected[page.page_id] = (tier, page.stamp)
    queued = {page_id: (tier, stamp) for page_id, tier, stamp in pool._eviction.items()}
    if queued != expected:
        wrong = sorted(set(queued.items()) ^ set(expected.items()))[:4]
        _fail(f"eviction queue differs from the cached leaves (page, (tier, stamp)) e.g. {wrong}")


def _verify_partial_index(pool: PagePool) -> None:
    expected: dict = {}
    for page in pool._pages:
        if page.tokens is not None and len(page.tokens) >= 2:
            expected.setdefault(partial_key(page), []).append((page.tokens, page.page_id))
    if {key: sorted(entries) for key, entries in expected.items()} != pool._partial_index.buckets:
        _fail("the partial-page index does not match the recorded tokens")


def _verify_all_cached_evictable(pool: PagePool) -> None:
    """num_allocatable counts every cached page, so repeatedly evicting queued pages must reach all of them
    (it would not if parent links formed a cycle)."""
    remaining = dict(pool._lineage.num_cached_children)
    ready_cached = {page.hash: page for page in pool._pages if page.ready and page.state is PageState.CACHED}
    frontier = [page for page in pool._pages
                if page.state is PageState.CACHED and not (page.ready and remaining.get(page.hash, 0))]
    num_reached = 0
    while frontier:
        page = frontier.pop()
        num_reached += 1
        parent = ready_cached.get(page.parent) if page.parent is not None else None
        if parent is not None:
            remaining[parent.hash] -= 1
            if remaining[parent.hash] == 0:
                frontier.append(parent)
    if num_reached != pool.num_cached:
        _fail(f"only {num_reached} of {pool.num_cached} cached pages can ever be evicted")


def _verify_host_tier(pool: PagePool) -> None:
    """Every host slot is free or holds exactly one entry; a hash held in both tiers is a mirror of the GPU page
    holding it ready, and every other entry's hash is not ready on the GPU; host entries describe full pages; slots
    read by this plan's fetches are held; pages being filled from the host are pinned, ready GPU pages; listed
    copies name held slots."""
    host = pool._host
    held = [entry.slot for entry in host._entries.values()]
    slots = sorted(held + host._free)
    if slots != list(range(host.num_host_pages)):
        _fail(f"host slots are lost or shared: {len(held)} held, {len(host._free)} free of {host.num_host_pages}")
    for idx in range(1, len(host._free)):
        if host._free[idx] < host._free[(idx - 1) // 2]:
            _fail(f"the host tier's free-slot heap order is broken at index {idx}")
    for page_hash, page_id in host._mirrored.items():
        if page_hash not in host._entries or pool._ready.get(page_hash) != page_id:
            _fail(f"host mirror {page_hash.hex()} of page {page_id}: not an entry, or not that page's ready hash")
    both = (pool._ready.keys() & host._entries.keys()) - host._mirrored.keys()
    if both:
        _fail(f"hash {next(iter(both)).hex()} is ready on the GPU and held host-only")
    for page_hash, entry in host._entries.items():
        if len(entry.tokens) != pool.page_size or page_hash == entry.parent:
            _fail(f"host entry {page_hash.hex()} (slot {entry.slot}) does not describe a full page")
    if not host._reading <= set(held):
        _fail("a slot read by this plan's fetches is not held")
    for page_id in host._arriving:
        page = pool._pages[page_id]
        if not page.ready or page.state is not PageState.IN_USE:
            _fail(f"{page.describe()}: filled from the host but not a ready page in use")
    if len({slot for slot, _ in host._from_host}) != len(host._from_host):
        _fail("two host->GPU copies of one plan read the same slot")
    listed_now = {entry.slot for entry in host._entries.values() if entry.ticket == host._ticket}
    for page_id, slot in host._mirror + host._to_host:
        if slot not in listed_now:
            _fail(f"a copy of page {page_id} into slot {slot}, which no entry stored by this plan holds")
