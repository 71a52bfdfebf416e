"""Parent links and eviction tiers: which cached pages may be evicted now, and in which order.

Eviction takes cached leaves first (no cached or in-use page names them as parent), least recently released first
(ties: lowest page id), so the longest prefixes survive; only when no leaf is cached does it take pages whose only
children are in use; a cached page with a cached child is not queued at all (the child goes first). Eviction
never touches in-use pages, so every cached page counts as allocatable (check() verifies that evicting queued pages
reaches them all).

To tell the tiers apart in O(1), each parent hash counts the cached or in-use pages naming it as parent and how many
of those are cached. Whenever either count changes, the cached page holding that hash (if any) is requeued. The
order itself is kept by folio.cache.eviction.EvictionQueue; the pool pops from it.
"""

from __future__ import annotations

from folio.cache.eviction import EvictionQueue
from folio.cache.page import PageRecord, PageState


class Lineage:
    """Owns PageRecord.has_parent/parent (set and clear them only through link() and unlink()) and what the
    eviction queue holds. The pool reports each page entering CACHED (on_cached) or going back into use
    (on_revived), so that the queue holds exactly the cached pages with no cached child, at their tier."""

    def __init__(self, pages: list[PageRecord], ready: dict[bytes, int], queue: EvictionQueue) -> None:
        # The pool's page list and ready-hash index (hash -> page id), shared and only read here; the pool never
        # rebinds them.
        self._pages = pages
        self._ready = ready
        self._queue = queue
        # parent hash -> number of cached or in-use pages naming it as parent / how many of those are cached.
        # Read by check().
        self.num_children: dict[bytes, int] = {}
        self.num_cached_children: dict[bytes, int] = {}

    def link(self, page: PageRecord, parent_hash: bytes | None) -> None:
        """The page follows `parent_hash` (None = a sequence's first page). A no-op if it is linked already: the
        caller has checked that it is the same parent."""
        if page.has_parent:
            return
        page.has_parent = True
        page.parent = parent_hash
        if parent_hash is not None:
            self.num_children[parent_hash] = self.num_children.get(parent_hash, 0) + 1
            self._refresh(parent_hash)

    def unlink(self, page: PageRecord) -> None:
        """Drop the page's parent link, if any. A cached page also stops counting as a cached child, so unlink it
        before changing its state (eviction)."""
        if not page.has_parent:
            return
        parent_hash = page.parent
        page.has_parent = False
        page.parent = None
        if parent_hash is not None:
            _decrement(self.num_children, parent_hash)
            if page.state is PageState.CACHED:
                _decrement(self.num_cached_children, parent_hash)
            self._refresh(parent_hash)

    def on_cached(self, page: PageRecord) -> None:
        """The page has just become CACHED, its stamp set: count it as a cached child and queue it."""
        parent_hash = page.parent
        if parent_hash is not None:
            self.num_cached_children[parent_hash] = self.num_cached_children.get(parent_hash, 0) + 1
            self._refresh(parent_hash)
        # _requeue() without its checks: a page in use is never queued (check() verifies), so it is not queued yet.
        tier = self.tier(page)
        if tier is not None:
            self._queue.put(page.page_id, tier, page.stamp)

    def on_revived(self, page: PageRecord) -> None:
        """The page has just gone from CACHED back into use (not by eviction): unqueue it, uncount it."""
        self._queue.discard(page.page_id)
        parent_hash = page.parent
        if parent_hash is not None:
            _decrement(self.num_cached_children, parent_hash)
            self._refresh(parent_hash)

    def tier(self, page: PageRecord) -> int | None:
        """Of a cached page. 0: a leaf; 1: only in-use pages name it as parent; None: a cached page does (evict that
        one first)."""
        if not page.ready or self.num_children.get(page.hash, 0) == 0:
            return 0
        return 1 if self.num_cached_children.get(page.hash, 0) == 0 else None

    def depth_after(self, parent_hash: bytes | None) -> int:
        """Depth of a page following `parent_hash`: 0 for a first page, the parent's + 1 while the parent is ready
        (a sequence holds its earlier pages when it registers the next), -1 otherwise."""
        if parent_hash is None:
            return 0
        parent_id = self._ready.get(parent_hash)
        if parent_id is None:
            return -1
        parent_depth = self._pages[parent_id].depth
        return -1 if parent_depth < 0 else parent_depth + 1

    def clear(self) -> None:
        """Forget every link and empty the queue (all pages are being reset)."""
        self.num_children.clear()
        self.num_cached_children.clear()
        self._queue.clear()

    def _refresh(self, page_hash: bytes) -> None:
        """The children of `page_hash` changed: requeue the cached page holding it, if any."""
        page_id = self._ready.get(page_hash)
        if page_id is not None and self._pages[page_id].state is PageState.CACHED:
            self._requeue(self._pages[page_id])

    def _requeue(self, page: PageRecord) -> None:
        tier = self.tier(page)
        if tier is None:
            self._queue.discard(page.page_id)
        elif self._queue.tier_of(page.page_id) != tier:
            self._queue.put(page.page_id, tier, page.stamp)


def _decrement(counts: dict[bytes, int], key: bytes) -> None:
    remaining = counts[key] - 1
    if remaining:
        counts[key] = remaining
    else:
        del counts[key]
