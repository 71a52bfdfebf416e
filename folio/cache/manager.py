"""KVCacheManager: a sequence's pages, in front of the page pool (its only user). Torch-free.

What the scheduler asks of the cache, per sequence: how much of a prompt is already held (admission), take the
cached prefix (whole pages, or the leading slots of a similar page, copied), pages up to a position (or "no": the
scheduler then picks whom to preempt), commit tokens whose K/V the forward wrote, free everything, and roll back
the last n tokens (speculative decoding, banned strings). The router's digest reads a snapshot. Slot copies the
device must run before the next forward (partial reuse, copy-on-write after a rollback) are handed out as
`PageCopy` records; the manager never touches tensors.

Sliding windows (`window`): `commit` releases the pages before a running sequence's window (folio.cache.
window_release); a rollback that reaches back before it takes them back by hash, or computes the sequence again.
"""

from __future__ import annotations

from dataclasses import dataclass

from folio.cache.errors import OutOfPages
from folio.cache.events import PageEvent, PageEventKind
from folio.cache.host_tier import HostTransfers, promote, take_transfers
from folio.cache.pool import PagePool
from folio.cache.reports import CacheSnapshot, PrefixCacheStats
from folio.cache.window_release import held_pages, release_before_window, restore_window
from folio.hashing import hash_page, prompt_page_hashes
from folio.sequence import Sequence


@dataclass(frozen=True)
class PageCopy:
    """Copy slots [0, num_slots) of src_page into dst_page, in every layer, before the next forward."""

    src_page: int
    dst_page: int
    num_slots: int


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool = True, pool: PagePool | None = None,
                 window: int = 0, num_host_pages: int = 0, host_write_through: bool = False):
        """prefix_cache False: no page is ever shared or kept after its sequence (to measure what it is worth).
        pool: a new pool of num_pages pages of page_size by default; tests pass their own to inspect it.
        window: > 0 where every layer of every model reading these pages attends to at most this many tokens
        (folio.model.windows.released_window): pages before a running sequence's window are released.
        num_host_pages: slots of the host tier that keeps evicted pages (folio.cache.host_tier; 0: none);
        host_write_through: copy each page to the host tier once computed, so that evicting it costs no copy."""
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"window must be an int >= 0 (0: no page is released early), got {window!r}")
        self.window = window
        self._pool = pool if pool is not None else PagePool(
            num_pages, page_size, num_host_pages=num_host_pages if prefix_cache else 0,
            host_write_through=host_write_through)
        if (self._pool.num_pages, self._pool.page_size) != (num_pages, page_size):
            raise ValueError(f"pool of {self._pool.num_pages} pages of {self._pool.page_size} given for "
                             f"{num_pages} pages of {page_size}")
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self._copies: list[PageCopy] = []  # copy-on-write after rollbacks, for the next step
        self._num_queried = self._num_hit_tokens = self._num_hit_pages = self._num_partial = 0
        self._num_evicted = self._num_host_hit_pages = 0
        self._events: list[PageEvent] = []

    # --- counts ---

    def num_cached_prefix_tokens(self, page_hashes: list[bytes], num_tokens: int,
                                 queued_ahead: set[bytes] | None = None) -> int:
        """Tokens of a prompt of num_tokens whose leading full pages (`page_hashes`) the pool holds or is filling
        now: what its admission would reuse if it came now (the last token is always computed).

        queued_ahead: for a queue walked in order, the pages that prompts queued ahead of this one will compute;
        leading pages among them count as reused too (an admission takes pages in flight instead of computing them
        again), and this prompt's own pages beyond those it reuses are added to the set."""
        if not self.prefix_cache:
            return 0
        reusable = page_hashes[:max(num_tokens - 1, 0) // self.page_size]
        found = self._pool.lookup(reusable)
        num_reused = found.num_ready + found.num_pending
        if queued_ahead is not None:
            while num_reused < len(reusable) and reusable[num_reused] in queued_ahead:
                num_reused += 1
            queued_ahead.update(page_hashes[num_reused:])
        return num_reused * self.page_size

    @property
    def num_pages(self) -> int:
        return self._pool.num_pages

    @property
    def num_free(self) -> int:
        return self._pool.num_free

    @property
    def num_cached(self) -> int:
        return self._pool.num_cached

    @property
    def num_in_use(self) -> int:
        return self._pool.num_in_use

    @property
    def num_allocatable(self) -> int:
        return self._pool.num_allocatable

    # --- admission ---

    def start(self, seq: Sequence) -> None:
        """Hash the sequence's full pages (a new job, or one preempted: its generated tokens are prompt now)."""
        seq.page_hashes = prompt_page_hashes(seq.token_ids, self.page_size, seq.namespace)

    def num_held_prompt_pages(self, seq: Sequence) -> int:
        """Leading full pages of the sequence that the pool holds or is filling now (never computed again)."""
        if not self.prefix_cache:
            return 0
        found = self._pool.lookup(seq.page_hashes)
        return found.num_ready + found.num_pending

    def count_admission(self, seq: Sequence) -> None:
        if seq.num_sampled == 0:
            self._num_queried += len(seq.token_ids)

    # --- prefix reuse ---

    def reuse_prefix(self, seq: Sequence) -> tuple[bool, list[PageCopy]]:
        """At a page boundary, take the following cached pages, then copy the leading slots of a page similar to
        the next one. Returns (whether the sequence advanced, the slot copies to run)."""
        if not self.prefix_cache:
            return False, []
        size = self.page_size
        advanced = False
        while seq.num_cached_tokens % size == 0:
            page_idx = seq.num_cached_tokens // size
            if page_idx >= len(seq.page_hashes) or len(seq.block_table) > page_idx:
                break
            num_ready = self._pool.lookup(seq.page_hashes[page_idx:]).num_ready
            if num_ready:
                seq.block_table.extend(self._pool.acquire(seq.page_hashes[page_idx:page_idx + num_ready]))
            else:  # past the GPU's pages: the host tier's, copied back (the copies run before the next forward)
                promoted = promote(self._pool, seq.page_hashes[page_idx:])
                if not promoted:
                    break
                seq.block_table.extend(promoted)
                num_ready = len(promoted)
                self._num_host_hit_pages += num_ready if seq.num_sampled == 0 else 0
            seq.num_cached_tokens += num_ready * size
            self._count_hit(seq, pages=num_ready, tokens=num_ready * size)
            advanced = True
        copy = self._reuse_partial_page(seq)
        return advanced or copy is not None, [] if copy is None else [copy]

    def reads_arriving_page(self, seq: Sequence) -> bool:
        """Whether the sequence holds a page that the plan being made fills from the host tier: its forward runs
        beside that copy, so the sequence computes from the next step on."""
        host = self._pool.host
        return host is not None and host.num_arriving > 0 and any(host.is_arriving(p) for p in seq.block_table)

    def waits_for_pending_page(self, seq: Sequence) -> bool:
        """Another sequence is computing the page this one would compute next: wait a step instead."""
        page_idx = self._next_unheld_prompt_page(seq)
        return page_idx is not None and self._pool.lookup(seq.page_hashes[page_idx:page_idx + 1]).num_pending > 0

    def _next_unheld_prompt_page(self, seq: Sequence) -> int | None:
        start = seq.num_cached_tokens
        if not self.prefix_cache or start % self.page_size:
            return None
        page_idx = start // self.page_size
        if page_idx >= len(seq.page_hashes) or len(seq.block_table) > page_idx:
            return None
        return page_idx

    def _reuse_partial_page(self, seq: Sequence) -> PageCopy | None:
        size = self.page_size
        start = seq.num_cached_tokens
        if start % size or len(seq.block_table) > start // size:
            return None
        page_idx = start // size
        if page_idx < len(seq.page_hashes) and self._pool.lookup(seq.page_hashes[page_idx:page_idx + 1]).num_pending:
            return None  # someone is computing exactly this page: wait for it instead
        # The last token is always computed (its logits are needed), so at most len-1 tokens can be reused.
        end = min(start + size, len(seq.token_ids) - 1)
        if end - start < 2:
            return None
        found = self._pool.find_partial(self._parent(seq, page_idx), seq.token_ids[start:end],
                                        namespace=seq.namespace)
        host = self._pool.host
        if found is None or (host is not None and host.is_arriving(found.page_id)):
            return None  # (a page filled from the host in this plan has no slots to copy before the forward)
        src_page, num_slots = found.page_id, min(found.num_matching, end - start)
        # Allocating the destination must not evict the source. Unpinning right after is safe: copies run before
        # the step's forward, in plan order, and nothing writes a page before the forward, so even if a later
        # allocation of this step recycles the source page, the copy has read it by then.
        self._pool.pin(src_page)
        try:
            (dst_page,) = self._pool.allocate(1)
        except OutOfPages:
            return None
        finally:
            self._pool.unpin(src_page)
        seq.block_table.append(dst_page)
        self._claim_if_prompt_page(seq, page_idx, dst_page)
        seq.num_cached_tokens += num_slots
        self._count_hit(seq, pages=0, tokens=num_slots)
        self._num_partial += seq.num_sampled == 0
        return PageCopy(src_page, dst_page, num_slots)

    def _count_hit(self, seq: Sequence, pages: int, tokens: int) -> None:
        # Only the first prefill counts as a cache hit; re-prefill after preemption is our own doing.
        if seq.num_sampled == 0:
            seq.num_prefix_hit_pages += pages
            seq.num_prefix_hit_tokens += tokens
            self._num_hit_pages += pages
            self._num_hit_tokens += tokens

    # --- pages for new tokens ---

    def allocate(self, seq: Sequence, end: int) -> bool:
        """Pages so that positions < end have slots. False, changing nothing, when the pool has too few."""
        num_needed = -(-end // self.page_size) - len(seq.block_table)
        if num_needed <= 0:
            return True
        try:
            new_pages = self._pool.allocate(num_needed)
        except OutOfPages:
            return False
        first_idx = len(seq.block_table)
        seq.block_table.extend(new_pages)
        for offset, page in enumerate(new_pages):
            self._claim_if_prompt_page(seq, first_idx + offset, page)
        return True

    def num_pages_to_reach(self, seq: Sequence, end: int) -> int:
        return max(0, -(-end // self.page_size) - len(seq.block_table))

    def _claim_if_prompt_page(self, seq: Sequence, page_idx: int, page: int) -> None:
        if self.prefix_cache and page_idx < len(seq.page_hashes):
            if self._pool.claim(page, seq.page_hashes[page_idx], self._parent(seq, page_idx)):
                seq.claimed_page_idx.add(page_idx)

    @property
    def pending_copies(self) -> tuple[PageCopy, ...]:
        """Copies left by rollbacks that the next plan will run (take_copies); until then their slots are counted
        as cached but not yet written."""
        return tuple(self._copies)

    def take_transfers(self) -> HostTransfers:
        """Host-tier copies listed since the last call (pages evicted to the host, pages brought back), for the
        plan being finished: the device runs them with its slot copies (folio.host_pages)."""
        return take_transfers(self._pool)

    def take_copies(self) -> list[PageCopy]:
        """Slot copies left by rollbacks, to run before the next forward."""
        copies, self._copies = self._copies, []
        return copies

    # --- after the forward ---

    def commit(self, seq: Sequence, end: int) -> None:
        """The K/V of tokens [num_cached_tokens, end) are written: advance and register the pages they filled."""
        start, seq.num_cached_tokens = seq.num_cached_tokens, end
        size = self.page_size
        for page_idx in range(start // size, end // size) if self.prefix_cache else ():
            tokens = seq.token_ids[page_idx * size:(page_idx + 1) * size]
            parent = self._parent(seq, page_idx)
            if page_idx == len(seq.page_hashes):
                seq.page_hashes.append(hash_page(parent, tokens, seq.namespace))
            self._pool.set_ready(seq.block_table[page_idx], seq.page_hashes[page_idx], parent, tokens,
                                 namespace=seq.namespace)
            seq.claimed_page_idx.discard(page_idx)
        if self.window:  # (called per row and step: most models have no window)
            release_before_window(self._pool, seq, self.window, self.page_size)

    # --- giving pages back ---

    def trim(self, seq: Sequence) -> None:
        """Release the pages past the sequence's tokens (taken for drafted tokens that were rejected). They were
        never committed, so nothing of them is registered or shared."""
        keep = -(-len(seq.token_ids) // self.page_size)
        if len(seq.block_table) > keep:
            if seq.num_cached_tokens > keep * self.page_size:
                raise AssertionError(f"trim below the cached length of {seq!r}")
            self._pool.release(seq.block_table[keep:])
            del seq.block_table[keep:]
            seq.claimed_page_idx = {i for i in seq.claimed_page_idx if i < keep}

    def free(self, seq: Sequence) -> None:
        """Release every page of the sequence; a partly filled last page stays findable for partial reuse (the
        next chat turn, say)."""
        size, cached = self.page_size, seq.num_cached_tokens
        if self.prefix_cache and cached % size and len(seq.block_table) > cached // size:
            page_idx = cached // size
            self._pool.record_tokens(seq.block_table[page_idx], self._parent(seq, page_idx),
                                     seq.token_ids[page_idx * size:cached], namespace=seq.namespace)
        self._pool.release(held_pages(seq))
        seq.block_table = []
        seq.num_released_pages = 0
        seq.claimed_page_idx.clear()
        seq.num_cached_tokens = 0

    def preempt(self, seq: Sequence, planned_copies: list[PageCopy]) -> list[PageCopy]:
        """Free a sequence preempted while a step is being planned; its tokens all become prompt. Copies planned
        into its pages will not run: their slots must not count as cached, or the release would record the page
        as holding tokens it never received. Returns the planned copies that still run."""
        own = set(seq.block_table)
        seq.num_cached_tokens -= sum(c.num_slots for c in planned_copies if c.dst_page in own)
        self.free(seq)
        self.start(seq)
        return [c for c in planned_copies if c.dst_page not in own]

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Forget the last num_tokens of a running sequence's generated tokens, as if they had never been sampled:
        the token list shrinks, and the new last token is fed again by the next step (its logits are needed).
        Pages past the new end are released (full ones stay cached for their hash); a page the next step writes
        into that is registered (others may share it) is swapped for a private copy of its leading slots. Call
        between steps, with no step launched ahead holding the sequence."""
        num_generated = len(seq.token_ids) - seq.prompt_len
        if not 0 <= num_tokens <= num_generated:
            raise ValueError(f"rollback of {num_tokens} tokens: the sequence has {num_generated} generated tokens")
        if num_tokens == 0:
            return
        size = self.page_size
        del seq.token_ids[len(seq.token_ids) - num_tokens:]
        new_len = len(seq.token_ids)
        seq.num_cached_tokens = min(seq.num_cached_tokens, new_len - 1)
        del seq.page_hashes[(new_len - 1) // size:]  # as prompt_page_hashes: pages before the fed token
        keep = -(-new_len // size)
        if len(seq.block_table) > keep:
            self._pool.release(held_pages(seq, keep))
            del seq.block_table[keep:]
            seq.num_released_pages = min(seq.num_released_pages, keep)
        seq.claimed_page_idx = {i for i in seq.claimed_page_idx if i < keep}
        write_idx = seq.num_cached_tokens // size
        if seq.num_released_pages <= write_idx < len(seq.block_table) and self._pool.is_ready(
                seq.block_table[write_idx]):
            self._copy_on_write(seq, write_idx)
        if not restore_window(self._pool, seq, self.window, self.page_size, self.prefix_cache):
            self.free(seq)  # a page the window needs again is gone: compute the sequence again
            self.start(seq)

    def _copy_on_write(self, seq: Sequence, page_idx: int) -> None:
        """Swap registered page page_idx of `seq`, which the next step writes into, for a private page holding
        a copy of its leading slots. Released first, the old page is allocatable again, so the swap cannot run
        out of pages unless another sequence holds it; then the slots are recomputed instead."""
        old, num_slots = seq.block_table[page_idx], seq.num_cached_tokens % self.page_size
        self._pool.release([old])
        try:
            # (may hand back `old` itself, evicted: its slots are still there, and nothing needs copying)
            (fresh,) = self._pool.allocate(1)
        except OutOfPages:
            del seq.block_table[page_idx:]
            seq.num_cached_tokens = page_idx * self.page_size
            return
        seq.block_table[page_idx] = fresh
        if num_slots and fresh != old:
            self._copies.append(PageCopy(old, fresh, num_slots))

    # --- reading the state ---

    def snapshot(self) -> CacheSnapshot:
        pool = self._pool
        return CacheSnapshot(page_size=self.page_size, num_pages=pool.num_pages, num_free=pool.num_free,
                             num_cached=pool.num_cached, num_in_use=pool.num_in_use,
                             num_allocatable=pool.num_allocatable, ready_hashes=tuple(pool.cached_hashes()))

    def stats(self) -> PrefixCacheStats:
        host = self._pool.host
        return PrefixCacheStats(num_queried_tokens=self._num_queried, num_hit_tokens=self._num_hit_tokens,
                                num_hit_pages=self._num_hit_pages, num_partial_copies=self._num_partial,
                                num_evicted_pages=self._num_evicted, num_host_hit_pages=self._num_host_hit_pages,
                                num_pages_to_host=host.num_moved_to_host if host else 0,
                                num_pages_from_host=host.num_moved_from_host if host else 0,
                                num_copies_to_host=host.num_copied_to_host if host else 0)

    def drain_events(self) -> list[PageEvent]:
        """Page stored/evicted events since the last call, oldest first."""
        events = self._pool.drain_events()
        self._num_evicted += sum(1 for e in events if e.kind is PageEventKind.EVICTED)
        return events

    def check(self) -> None:
        """Verify the pool's invariants (raises folio.cache.InvariantViolation): tests call it after every step."""
        self._pool.check()

    def reset(self) -> None:
        """Forget every cached page (no page may be in use)."""
        self._pool.reset()
        self._copies.clear()

    @staticmethod
    def _parent(seq: Sequence, page_idx: int) -> bytes | None:
        return seq.page_hashes[page_idx - 1] if page_idx > 0 else None
