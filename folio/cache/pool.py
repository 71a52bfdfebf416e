"""PagePool: which KV-cache pages hold what, who references them, and which to recycle next.

Torch-free host bookkeeping on the per-step path; every operation is O(1) or O(log num_pages) per page touched,
except find_partial (O(log(candidates) * page_size), at admission) and check() (O(num_pages), for tests).

A page is FREE (no content), IN_USE (refcount >= 1; refcounts count block tables, plus pins) or CACHED (refcount 0,
content kept, evictable). A page's content is described by
  - a hash (folio.hashing; it names the whole prefix up to the end of the page), either PENDING (claimed by the job
    filling the page right now, so others can wait instead of recomputing) or READY (its K/V are in the cache), and
  - its parent hash (the hash of the page before it; None for a sequence's first page) and the token ids whose K/V
    are written, used to reuse a partially matching page (folio.cache.partial_index).

Page ids are handed out deterministically: free pages lowest id first, then evicted pages in eviction order: cached
leaves first, least recently released first, so the longest prefixes survive (folio.cache.lineage tells the details).
Eviction never touches in-use pages, so every cached page counts as allocatable.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from folio.cache import invariants
from folio.cache.errors import InvariantViolation, OutOfPages, PageNotReady, PageStateError, RefcountUnderflow
from folio.cache.events import EventLog, PageEvent, PageEventKind
from folio.cache.eviction import EvictionQueue
from folio.cache.host_tier import HostTier
from folio.cache.lineage import Lineage
from folio.cache.page import PageRecord, PageState, check_hashes
from folio.cache.partial_index import MIN_PARTIAL_MATCH, PartialIndex, PartialMatch

__all__ = ["MIN_PARTIAL_MATCH", "PagePool", "PartialMatch", "PrefixLookup"]


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    """num_ready leading hashes are held by READY pages; the num_pending hashes after them are being filled."""

    num_ready: int
    num_pending: int


class PagePool:
    """Page bookkeeping for one KV cache. How a scheduler drives it, per job:

        found = pool.lookup(hashes)                 # prompt_page_hashes(); maybe wait while found.num_pending
        block_table = pool.acquire(hashes[:found.num_ready])
        block_table += pool.allocate(n)             # on demand; OutOfPages: wait or preempt someone
        pool.claim(page_id, hashes[i], parent)      # prompt pages about to be prefilled
        pool.set_ready(page_id, page_hash, parent, token_ids)  # each page whose K/V just became complete
        pool.record_tokens(page_id, parent, token_ids)        # the partial last page, before release
        pool.release(block_table)                   # finished, cancelled or preempted
    """

    def __init__(self, num_pages: int, page_size: int, *, record_events: bool = True,
                 num_host_pages: int = 0, host_write_through: bool = False) -> None:
        """record_events=False skips the event log, for engines whose caller never drains it. num_host_pages > 0:
        evicted ready pages move to a host tier of that many slots (folio.cache.host_tier), which with
        host_write_through copies every page a forward fills ahead of its eviction."""
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self._page_size = page_size
        self._pages = [PageRecord(page_id) for page_id in range(num_pages)]
        self._free: list[int] = list(range(num_pages))  # min-heap of free page ids (sorted = a valid heap)
        self._ready: dict[bytes, int] = {}  # ready hash -> page id (cached or in use)
        self._pending: dict[bytes, int] = {}  # pending hash -> page id (in use)
        self._eviction = EvictionQueue()  # allocate() pops it; self._lineage decides what it holds
        self._lineage = Lineage(self._pages, self._ready, self._eviction)  # parent links, eviction tiers
        self._partial_index = PartialIndex()  # recorded tokens, for find_partial()
        self._events = EventLog(record_events)
        self._host = (HostTier(num_host_pages, self._events, write_through=host_write_through)
                      if num_host_pages else None)
        self._clock = 0
        self._num_in_use = 0
        self._num_cached = 0

    # ---- counters and queries -------------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return len(self._pages)

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return self._num_cached

    @property
    def num_in_use(self) -> int:
        return self._num_in_use

    @property
    def num_allocatable(self) -> int:
        """Pages allocate() can hand out now: free plus cached (every cached page is evictable)."""
        return len(self._free) + self._num_cached

    @property
    def host(self) -> HostTier | None:
        return self._host

    def refcount(self, page_id: int) -> int:
        return self._page(page_id).refcount

    def page_state(self, page_id: int) -> PageState:
        return self._page(page_id).state

    def is_ready(self, page_id: int) -> bool:
        """Whether the page holds a ready hash (its content is fixed: others may share it)."""
        return self._page(page_id).ready

    def lookup(self, hashes: Sequence[bytes]) -> PrefixLookup:
        """How many leading `hashes` are READY, and how many right after those are PENDING. Changes nothing.

        A pending page becomes ready (set_ready) or disappears (its holder released it); callers wait and look
        up again.
        """
        num_ready = 0
        while num_ready < len(hashes) and hashes[num_ready] in self._ready:
            num_ready += 1
        end = num_ready
        while end < len(hashes) and hashes[end] in self._pending:
            end += 1
        return PrefixLookup(num_ready, end - num_ready)

    def cached_hashes(self) -> Iterator[bytes]:
        """Every READY hash (cached or in use), for the router's digest. A snapshot: safe to mutate the pool."""
        return iter(tuple(self._ready))

    def drain_events(self) -> list[PageEvent]:
        """Stored/evicted events since the last drain, oldest first; clears them."""
        return self._events.drain()

    # ---- taking pages ---------------------------------------------------------------------------------------

    def acquire(self, hashes: Sequence[bytes]) -> list[int]:
        """Take one reference on the READY page of each hash and return their page ids, in order.

        Cached pages are revived (prompt-cache hit); pages in use are shared (in-flight dedup). All or nothing:
        raises PageNotReady, changing nothing, if any hash is not ready (unknown, evicted or pending).
        """
        page_ids = []
        for idx, page_hash in enumerate(hashes):
            page_id = self._ready.get(page_hash)
            if page_id is None:
                state = "pending" if page_hash in self._pending else "not held by any page"
                raise PageNotReady(f"acquire: hash #{idx} ({bytes(page_hash).hex()}) is {state}")
            page_ids.append(page_id)
        self._clock += 1
        for page_id in page_ids:
            self._take_reference(self._pages[page_id])
        return page_ids

    def pin(self, page_id: int) -> None:
        """Take a reference on a cached or in-use page, e.g. the source of a partial-page copy, so that no
        allocation can evict it. Undo with unpin() (or release())."""
        page = self._page(page_id)
        if page.state is PageState.FREE:
            raise PageStateError(f"pin: {page.describe()} has no content")
        self._clock += 1
        self._take_reference(page)

    def unpin(self, page_id: int) -> None:
        """Drop a reference taken by pin(); exactly release([page_id])."""
        self.release([page_id])

    def allocate(self, num_pages: int) -> list[int]:
        """`num_pages` anonymous pages with refcount 1: free pages (lowest id first), then evicted cached pages
        (eviction order, see the module docstring and folio.cache.lineage). Evicting a ready page logs an
        "evicted" event.

        All or nothing: raises OutOfPages, changing nothing, if fewer than num_pages are allocatable.
        """
        if num_pages < 0:
            raise ValueError(f"allocate: num_pages must be >= 0, got {num_pages}")
        if num_pages > self.num_allocatable:
            raise OutOfPages(num_pages, self.num_allocatable)
        page_ids = []
        while len(page_ids) < num_pages and self._free:
            page = self._pages[heapq.heappop(self._free)]
            page.state = PageState.IN_USE
            page.refcount = 1
            self._num_in_use += 1
            page_ids.append(page.page_id)
        while len(page_ids) < num_pages:
            page_id = self._eviction.pop()
            if page_id is None:
                # num_allocatable promised more: some cached page cannot be reached through the queue.
                raise InvariantViolation(f"allocate: eviction queue is empty with {self._num_cached} pages cached")
            self._evict(self._pages[page_id])
            page_ids.append(page_id)
        return page_ids

    # ---- describing content ---------------------------------------------------------------------------------

    def claim(self, page_id: int, page_hash: bytes, parent_hash: bytes | None) -> bool:
        """Promise that in-use anonymous page `page_id` is being filled with the content named `page_hash`.

        The hash becomes PENDING: lookup() reports it so other jobs can wait for it. Returns False (nothing
        changed) if the hash is already pending or ready elsewhere. The claim ends with set_ready() or when the
        page is released (then the pending hash disappears).
        """
        page = self._in_use_page(page_id, "claim")
        if page.hash is not None:
            raise PageStateError(f"claim: {page.describe()} already has a hash")
        check_hashes(page_hash, parent_hash)
        page.check_parent(parent_hash, "claim")
        if page_hash in self._ready or page_hash in self._pending:
            return False
        self._lineage.link(page, parent_hash)
        page.hash = page_hash
        self._pending[page_hash] = page_id
        return True

    def set_ready(self, page_id: int, page_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int],
                  *, namespace: bytes = b"") -> bool:
        """Page `page_id` (in use) is full and holds the K/V of `token_ids` (page_size of them): register
        `page_hash` as READY (pending -> ready, or anonymous -> ready for a page filled during generation) and log
        a "stored" event. Returns True.

        If another page already holds `page_hash` ready, this page stays anonymous (its claim, recorded tokens
        and parent are dropped, so it is freed on release) and False is returned; the caller may swap it for the
        existing page (acquire([page_hash]) then release([page_id])). If another page merely has `page_hash`
        pending, that claim is dropped in favour of this ready page. `namespace` is the sequence's hash
        namespace (see find_partial).
        """
        page = self._in_use_page(page_id, "set_ready")
        if page.ready:
            raise PageStateError(f"set_ready: {page.describe()} is already hashed; a page is hashed once")
        check_hashes(page_hash, parent_hash)
        if len(token_ids) != self._page_size:
            raise ValueError(f"set_ready: page {page_id} needs {self._page_size} token ids, got {len(token_ids)}")
        if page.hash is not None and page.hash != page_hash:
            raise PageStateError(f"set_ready: {page.describe()} was claimed for another hash than "
                                 f"{page_hash.hex()}")
        page.check_parent(parent_hash, "set_ready")
        if page_hash in self._ready:
            self._drop_claim(page)
            self._partial_index.clear_tokens(page)
            self._lineage.unlink(page)
            return False
        rival_id = self._pending.get(page_hash)
        if rival_id is not None and rival_id != page_id:
            self._drop_claim(self._pages[rival_id])
        self._drop_claim(page)
        self._lineage.link(page, parent_hash)  # before recording tokens: the parent is part of their index key
        self._partial_index.set_tokens(page, token_ids, namespace)
        page.hash = page_hash
        page.ready = True
        page.depth = self._lineage.depth_after(parent_hash)
        self._ready[page_hash] = page_id
        self._events.log(PageEventKind.STORED, page_hash, page.depth)
        if self._host is not None:
            self._host.on_ready(page)
        return True

    def record_tokens(self, page_id: int, parent_hash: bytes | None, token_ids: Sequence[int],
                      *, namespace: bytes = b"") -> None:
        """In-use, not-ready page `page_id` holds the K/V of `token_ids` in its first len(token_ids) slots.

        Replaces any earlier record (call it again as the page fills, or after a rollback). On release the page
        then stays CACHED as a partial page that find_partial() can offer. Only tokens whose K/V are actually
        written may be recorded (not the last sampled token, which the next step feeds).
        """
        page = self._in_use_page(page_id, "record_tokens")
        if page.ready:
            raise PageStateError(f"record_tokens: {page.describe()} is hashed; its content is fixed")
        if not 1 <= len(token_ids) <= self._page_size:
            raise ValueError(f"record_tokens: page {page_id} takes 1..{self._page_size} token ids, "
                             f"got {len(token_ids)}")
        page.check_parent(parent_hash, "record_tokens")
        self._lineage.link(page, parent_hash)
        self._partial_index.set_tokens(page, token_ids, namespace)

    def find_partial(self, parent_hash: bytes | None, token_ids: Sequence[int],
                     *, namespace: bytes = b"") -> PartialMatch | None:
        """The cached or in-use page (full or partial) following `parent_hash` (None = a first page) in
        `namespace` whose recorded tokens share the longest common prefix with `token_ids` (ties: partial_index).
        None unless at least MIN_PARTIAL_MATCH tokens match. Changes nothing: pin() the page before any allocation
        that could evict it, copy its first num_matching slots, then unpin() it.

        The namespace matters for first pages only (parent None cannot tell namespaces apart; a parent hash
        already includes the namespace) but is part of the key everywhere, so pass the sequence's namespace.
        """
        return self._partial_index.best_match(parent_hash, token_ids, namespace)

    # ---- giving pages back ----------------------------------------------------------------------------------

    def release(self, page_ids: Sequence[int]) -> None:
        """Drop one reference per listed page id (a page listed twice loses two). At refcount 0 a page with a
        ready hash or recorded tokens becomes CACHED (recency = now); any other page (anonymous, or pending:
        the pending hash disappears, so waiters stop waiting) becomes FREE.

        All or nothing: raises RefcountUnderflow, changing nothing, if a page would drop below zero.
        """
        for page_id, count in Counter(page_ids).items():
            page = self._page(page_id)
            if page.refcount < count:
                what = "double free" if page.refcount == 0 else f"{count} releases"
                raise RefcountUnderflow(f"release: {what} of {page.describe()}")
        self._clock += 1
        # Last page first: children turn CACHED before their parents, so a parent never enters the eviction
        # queue only to leave it again.
        for page_id in reversed(page_ids):
            page = self._pages[page_id]
            page.refcount -= 1
            if page.refcount == 0:
                self._retire(page)

    def reset(self) -> None:
        """Forget every cached page, the host tier's too (all become FREE, ready hashes logged as "evicted").
        Raises PageStateError if any page is in use."""
        if self._num_in_use:
            raise PageStateError(f"reset: {self._num_in_use} pages are in use")
        for page in self._pages:
            if page.ready:
                self._events.log(PageEventKind.EVICTED, page.hash, page.depth)
        # In place: self._lineage shares the list.
        self._pages[:] = [PageRecord(page_id) for page_id in range(len(self._pages))]
        self._free = list(range(len(self._pages)))
        self._ready.clear()
        self._pending.clear()
        self._lineage.clear()
        self._partial_index.clear()
        self._num_cached = 0
        if self._host is not None:
            self._host.clear()

    def check(self) -> None:
        """Verify every invariant of the bookkeeping; raises InvariantViolation naming the first one broken.
        O(num_pages): cheap enough to call after every step in tests."""
        invariants.verify(self)

    # ---- internals ------------------------------------------------------------------------------------------

    def _page(self, page_id: int) -> PageRecord:
        if not 0 <= page_id < len(self._pages):
            raise ValueError(f"page id {page_id} is out of range [0, {len(self._pages)})")
        return self._pages[page_id]

    def _in_use_page(self, page_id: int, operation: str) -> PageRecord:
        page = self._page(page_id)
        if page.state is not PageState.IN_USE:
            raise PageStateError(f"{operation}: {page.describe()} is not in use")
        return page

    def _take_reference(self, page: PageRecord) -> None:
        if page.state is PageState.CACHED:
            page.state = PageState.IN_USE
            self._num_cached -= 1
            self._num_in_use += 1
            self._lineage.on_revived(page)
        page.refcount += 1
        page.stamp = self._clock

    def _retire(self, page: PageRecord) -> None:
        """Refcount just reached 0: keep the page's content cached, or free it."""
        self._drop_claim(page)
        self._num_in_use -= 1
        if page.ready or page.tokens is not None:
            page.state = PageState.CACHED
            page.stamp = self._clock
            self._num_cached += 1
            self._lineage.on_cached(page)
        else:
            self._lineage.unlink(page)
            page.state = PageState.FREE
            heapq.heappush(self._free, page.page_id)

    def _evict(self, page: PageRecord) -> None:
        """Cached page -> anonymous in-use page with refcount 1 (the caller hands it out)."""
        if page.ready:
            del self._ready[page.hash]
            if self._host is None or not self._host.offer(page):
                self._events.log(PageEventKind.EVICTED, page.hash, page.depth)
            page.hash = None
            page.ready = False
            page.depth = -1
        self._partial_index.clear_tokens(page)  # before unlinking: the parent is part of the index key
        self._lineage.unlink(page)  # while still CACHED, so the parent's cached-children count drops too
        page.state = PageState.IN_USE
        page.refcount = 1
        self._num_cached -= 1
        self._num_in_use += 1

    def _drop_claim(self, page: PageRecord) -> None:
        if page.is_pending:
            del self._pending[page.hash]
            page.hash = None
