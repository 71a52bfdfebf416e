"""The scheduler: which jobs run, which tokens each feeds this step, and which pages hold them.

Torch-free. It talks to the page pool only through `PagePool`'s public API and to jobs only through the few
attributes admission needs (`max_skips`, `skips`, `serial`). Each step:

1. admission — FIFO; a job that does not fit may be overtaken by later ones at most `max_skips` times;
2. prefix reuse — a sequence whose next page is already in the pool (cached, or computed by a running job) takes
   it instead of computing it; if another job is computing that page right now, it waits a step rather than
   computing it twice; a page sharing only leading tokens with a cached page gets those K/V slots copied;
3. chunk planning — every prefilling sequence gets a chunk within the step's token budget (`max_chunk_size`),
   ending on a page boundary where possible; every decoding sequence feeds its one unprocessed token;
4. pages on demand — pages are allocated as chunks reach them, never reserved for a job's worst case; when the
   pool is exhausted the most recently admitted sequence is preempted: its pages are released (they stay cached,
   so resuming is mostly a prefix hit) and it goes back to the front of the queue with its tokens kept.

After the forward pass, `commit()` advances each sequence's cached length and registers the pages it completed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Any

from folio.cache import OutOfPages, PagePool
from folio.hashing import hash_page, prompt_page_hashes


class CacheTooSmall(RuntimeError):
    """Even alone, a sequence cannot get the pages it needs (enqueue-time validation should prevent this)."""


@dataclass(eq=False)
class SeqState:
    """Page-side state of one job's sequence. `token_ids` = prompt + sampled tokens; the K/V of the first
    `num_cached_tokens` are in the cache. Between steps at most one token (the last sampled) is not cached, except
    while the prompt is still being prefilled."""

    job: Any
    token_ids: list[int]
    namespace: bytes = b""
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # page_hashes[k] is the hash of full page k; prompt pages are known up front, later ones as they fill.
    page_hashes: list[bytes] = field(default_factory=list)
    # Pages this sequence allocated and promised to fill (claimed in the pool), by page index.
    claimed: set[int] = field(default_factory=set)
    admit_order: int = -1
    started: bool = False
    num_prefill_target: int = 0  # prompt length when admitted: the part reported as prefill progress

    @property
    def num_uncached_tokens(self) -> int:
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_uncached_tokens == 1


@dataclass
class Chunk:
    """Tokens `token_ids[start:end]` of `seq` are fed this step; logits are wanted for the last one when `end`
    reaches the end of the sequence (then a token is sampled)."""

    seq: SeqState
    start: int
    end: int

    @property
    def wants_logits(self) -> bool:
        return self.end == len(self.seq.token_ids)


@dataclass
class PageCopy:
    src_page: int
    dst_page: int
    num_slots: int


@dataclass
class StepPlan:
    started: list[SeqState] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    copies: list[PageCopy] = field(default_factory=list)
    preempted: list[SeqState] = field(default_factory=list)
    # Sequences that made prompt progress without computing (whole pages reused, slots copied) this step.
    progressed: set[int] = field(default_factory=set)

    @property
    def empty(self) -> bool:
        return not self.chunks and not self.copies


class Scheduler:
    def __init__(self, pool: PagePool, max_batch_size: int, max_chunk_size: int, prefix_cache: bool = True):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_chunk_size < 1:
            raise ValueError(f"max_chunk_size must be >= 1, got {max_chunk_size}")
        self.pool = pool
        self.page_size = pool.page_size
        self.max_batch_size = max_batch_size
        self.max_chunk_size = max_chunk_size
        # Off: no page is ever shared or kept after its job (for measuring what the prefix cache is worth).
        self.prefix_cache = prefix_cache
        self.num_preemptions = 0
        self.pending: deque[SeqState] = deque()
        self.active: list[SeqState] = []  # in admission order
        self._admit_counter = 0
        # Keep a few pages free at admission so running sequences can grow without immediate preemption.
        self._admission_reserve_pages = max(1, pool.num_pages // 64)

    # --- queue ---

    def add(self, seq: SeqState) -> None:
        seq.page_hashes = prompt_page_hashes(seq.token_ids, self.page_size, seq.namespace)
        self.pending.append(seq)

    def remove(self, seq: SeqState) -> None:
        """Cancel or finish: drop the sequence wherever it is and release its pages."""
        if seq in self.active:
            self.active.remove(seq)
            self._release_pages(seq)
        elif seq in self.pending:
            self.pending.remove(seq)

    @property
    def num_sequences(self) -> int:
        return len(self.pending) + len(self.active)

    def num_prefill_tokens(self) -> int:
        """Tokens still to prefill over running and queued sequences (a decoding sequence's one unfed token does
        not count; queued ones count whole, since their cache hits are known only at admission)."""
        running = sum(n for n in (seq.num_uncached_tokens for seq in self.active) if n > 1)
        return running + sum(seq.num_uncached_tokens for seq in self.pending)

    # --- the step ---

    def plan(self) -> StepPlan:
        return self._plan({})

    def _plan(self, sampling: dict[int, SeqState]) -> StepPlan:
        """`sampling`: id -> sequence of those whose next token is being sampled now (plan_ahead): each feeds it,
        at position len(token_ids)."""
        plan = StepPlan()
        self._admit(plan)
        budget = self.max_chunk_size
        for seq in list(self.active):
            if plan.preempted and any(seq is gone for gone in plan.preempted):
                continue  # preempted while planning an earlier sequence (a list scan per sequence cost ~1 ms at 256)
            if id(seq) in sampling:
                position = len(seq.token_ids)
                chunk = Chunk(seq, position, position + 1)
            elif seq.num_uncached_tokens == 0:
                continue  # sampling now but not planned ahead (this token ends it)
            else:
                if not seq.is_decoding:
                    self._reuse_prefix(seq, plan)
                    if self._waits_for_pending_page(seq):
                        continue
                chunk = self._next_chunk(seq, budget)
                if chunk is None:
                    continue
            if not self._ensure_pages(seq, chunk.end, plan):
                continue
            if chunk.end - chunk.start > 1 or not (chunk.wants_logits or id(seq) in sampling):
                budget -= chunk.end - chunk.start  # prompt tokens; a decode row costs no budget
            plan.chunks.append(chunk)
        return plan

    def commit(self, plan: StepPlan) -> None:
        """The forward pass of `plan` ran: its tokens' K/V are in the cache."""
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq not in self.active:
                continue
            seq.num_cached_tokens = chunk.end
            self._register_full_pages(seq, chunk.start, chunk.end)

    def append_token(self, seq: SeqState, token_id: int) -> None:
        seq.token_ids.append(token_id)

    def plan_ahead(self, seqs: list[SeqState]) -> StepPlan | None:
        """The step after the current one, planned before the tokens now being sampled are known. Each of `seqs`
        (active, all of their tokens cached) feeds the token it is about to sample, at position len(token_ids);
        their chunks [len, len + 1) come first, in the order of `seqs`, and become whole once `append_token` adds
        that token. The rest of the step is what plan() would make of it then: admission, prefix reuse, prompt
        chunks. None, with nothing changed, when the pool might run short of pages for the step, since planning
        ahead must never preempt."""
        size = self.page_size
        crossing = sum(1 for seq in seqs if len(seq.token_ids) // size + 1 > len(seq.block_table))
        admissible = min(len(self.pending), max(0, self.max_batch_size - len(self.active)))
        others: list[SeqState] = []
        if len(seqs) != len(self.active):
            feeding = {id(seq) for seq in seqs}
            others = [seq for seq in self.active if id(seq) not in feeding and seq.num_uncached_tokens > 0]
        if not others and not admissible:
            # Only decode rows (the steady state, planned every step: kept to one loop over `seqs`).
            if crossing > self.pool.num_allocatable:
                return None
            plan = StepPlan()
            for seq in seqs:
                position = len(seq.token_ids)
                if not self._ensure_pages(seq, position + 1, plan):
                    raise AssertionError("plan_ahead preempted a sequence although enough pages were free")
                plan.chunks.append(Chunk(seq, position, position + 1))
            return plan
        if crossing + self._prompt_pages_bound(others, admissible) > self.pool.num_allocatable:
            return None
        sampling = {id(seq): seq for seq in seqs}
        plan = self._plan(sampling)
        if plan.preempted:
            raise AssertionError("plan_ahead preempted a sequence although enough pages were free")
        by_seq = {id(c.seq): c for c in plan.chunks if id(c.seq) in sampling}
        plan.chunks = [by_seq[id(seq)] for seq in seqs] + [c for c in plan.chunks if id(c.seq) not in sampling]
        return plan

    def _prompt_pages_bound(self, others: list[SeqState], admissible: int) -> int:
        """Most pages that the prompt side of a step planned ahead can take from the allocatable ones, where
        `others` are the active sequences with tokens to feed besides the fed rows and `admissible` the queued
        ones that may be admitted: their chunks' pages (at most max_chunk_size tokens in all) plus two per
        sequence (a chunk may start partway into a copied page and end partway into another), and the cached
        prompt pages that prefix reuse may revive."""
        size = self.page_size
        longest_pending = max((len(seq.token_ids) for seq in self.pending), default=0)
        prompt_tokens = sum(seq.num_uncached_tokens for seq in others) + admissible * longest_pending
        chunk_pages = -(-min(self.max_chunk_size, prompt_tokens) // size) + 2 * (len(others) + admissible)
        revived = 0
        if self.prefix_cache:
            revived = sum(max(0, len(seq.page_hashes) - len(seq.block_table)) for seq in others)
            revived += admissible * max((len(seq.page_hashes) for seq in self.pending), default=0)
        return chunk_pages + revived

    # --- admission ---

    def _admit(self, plan: StepPlan) -> None:
        skipped: list[SeqState] = []
        for seq in list(self.pending):
            if len(self.active) >= self.max_batch_size:
                break
            if not self._fits(seq):
                skipped.append(seq)
                continue
            # Never overtake a job that has been skipped as often as it allows.
            if any(s.job.max_skips is not None and s.job.skips >= s.job.max_skips for s in skipped):
                break
            for s in skipped:
                s.job.skips += 1
            self.pending.remove(seq)
            seq.admit_order = self._admit_counter
            self._admit_counter += 1
            self.active.append(seq)
            if not seq.started:
                seq.started = True
                seq.num_prefill_target = len(seq.token_ids)
                plan.started.append(seq)

    def _fits(self, seq: SeqState) -> bool:
        """Room for the part of the prompt not already in the pool, plus one page to grow into."""
        shared = 0
        if self.prefix_cache:
            lookup = self.pool.lookup(seq.page_hashes)
            shared = lookup.num_ready + lookup.num_pending
        pages_needed = math.ceil(len(seq.token_ids) / self.page_size) - shared + 1
        reserve = self._admission_reserve_pages if self.active else 0
        return pages_needed + reserve <= self.pool.num_allocatable

    # --- prefix reuse ---

    def _reuse_prefix(self, seq: SeqState, plan: StepPlan) -> None:
        """At a page boundary, take whole pages from the pool, else copy the leading slots of a similar page."""
        if not self.prefix_cache:
            return
        size = self.page_size
        while seq.num_cached_tokens % size == 0:
            page_idx = seq.num_cached_tokens // size
            if page_idx >= len(seq.page_hashes) or len(seq.block_table) > page_idx:
                break
            lookup = self.pool.lookup(seq.page_hashes[page_idx:])
            if lookup.num_ready == 0:
                break
            hashes = seq.page_hashes[page_idx:page_idx + lookup.num_ready]
            seq.block_table.extend(self.pool.acquire(hashes))
            seq.num_cached_tokens += lookup.num_ready * size
            self._count_cached(seq, pages=lookup.num_ready, tokens=lookup.num_ready * size)
            plan.progressed.add(id(seq))
        self._reuse_partial_page(seq, plan)

    def _reuse_partial_page(self, seq: SeqState, plan: StepPlan) -> None:
        size = self.page_size
        start = seq.num_cached_tokens
        if start % size or len(seq.block_table) > start // size:
            return
        page_idx = start // size
        if page_idx < len(seq.page_hashes) and self.pool.lookup(seq.page_hashes[page_idx:page_idx + 1]).num_pending:
            return  # someone is computing exactly this page: wait for it instead
        # The last token is always computed (its logits are needed), so at most len-1 tokens can be reused.
        end = min(start + size, len(seq.token_ids) - 1)
        if end - start < 2:
            return
        parent = seq.page_hashes[page_idx - 1] if page_idx > 0 else None
        found = self.pool.find_partial(parent, seq.token_ids[start:end], namespace=seq.namespace)
        if found is None:
            return
        src_page, num_slots = found
        num_slots = min(num_slots, end - start)
        # Allocating the destination must not evict the source. Unpinning right after is safe: copies run before
        # the step's forward pass, in plan order, and nothing writes a page before the forward pass — so even if a
        # later allocation of this step recycles the source page, the copy has read it by then.
        self.pool.pin(src_page)
        try:
            (dst_page,) = self.pool.allocate(1)
        except OutOfPages:
            return
        finally:
            self.pool.unpin(src_page)
        seq.block_table.append(dst_page)
        self._claim_if_prompt_page(seq, page_idx, dst_page)
        plan.copies.append(PageCopy(src_page, dst_page, num_slots))
        seq.num_cached_tokens += num_slots
        self._count_cached(seq, pages=0, tokens=num_slots)
        plan.progressed.add(id(seq))

    def _waits_for_pending_page(self, seq: SeqState) -> bool:
        if not self.prefix_cache:
            return False
        start = seq.num_cached_tokens
        if start % self.page_size:
            return False
        page_idx = start // self.page_size
        if page_idx >= len(seq.page_hashes) or len(seq.block_table) > page_idx:
            return False
        return self.pool.lookup(seq.page_hashes[page_idx:page_idx + 1]).num_pending > 0

    @staticmethod
    def _count_cached(seq: SeqState, pages: int, tokens: int) -> None:
        # Only the first prefill counts as a cache hit; re-prefill after preemption is our own doing.
        if seq.job.new_tokens == 0:
            seq.job.cached_pages += pages
            seq.job.cached_tokens += tokens

    # --- chunks and pages ---

    def _next_chunk(self, seq: SeqState, budget: int) -> Chunk | None:
        start = seq.num_cached_tokens
        total = len(seq.token_ids)
        if total - start == 1:
            return Chunk(seq, start, total)
        if budget <= 0:
            return None
        end = min(total, start + budget)
        if end < total:
            aligned = end - end % self.page_size
            if aligned > start:
                end = aligned
        return Chunk(seq, start, end)

    def _ensure_pages(self, seq: SeqState, end: int, plan: StepPlan) -> bool:
        """Allocate pages so positions < end have slots, preempting newer sequences if needed. Returns False if
        `seq` itself had to be preempted."""
        pages_needed = math.ceil(end / self.page_size) - len(seq.block_table)
        while pages_needed > 0:
            try:
                new_pages = self.pool.allocate(pages_needed)
                break
            except OutOfPages:
                victim = max(self.active, key=lambda s: s.admit_order)
                self._preempt(victim, plan)
                if victim is seq:
                    return False
        else:
            return True
        first_idx = len(seq.block_table)
        seq.block_table.extend(new_pages)
        for offset, page in enumerate(new_pages):
            self._claim_if_prompt_page(seq, first_idx + offset, page)
        return True

    def _claim_if_prompt_page(self, seq: SeqState, page_idx: int, page: int) -> None:
        if self.prefix_cache and page_idx < len(seq.page_hashes):
            parent = seq.page_hashes[page_idx - 1] if page_idx > 0 else None
            if self.pool.claim(page, seq.page_hashes[page_idx], parent):
                seq.claimed.add(page_idx)

    def _preempt(self, seq: SeqState, plan: StepPlan) -> None:
        if len(self.active) == 1:
            raise CacheTooSmall(
                f"a single sequence of {len(seq.token_ids)} tokens does not fit the cache "
                f"({self.pool.num_pages} pages of {self.page_size})")
        self.num_preemptions += 1
        self.active.remove(seq)
        plan.chunks = [c for c in plan.chunks if c.seq is not seq]
        own = set(seq.block_table)
        for copy in plan.copies:
            if copy.dst_page in own:
                # The copy will not run: its slots must not be counted, or releasing would record the page as
                # holding tokens it never received, for later partial reuse to copy from.
                seq.num_cached_tokens -= copy.num_slots
        plan.copies = [c for c in plan.copies if c.dst_page not in own]
        self._release_pages(seq)
        seq.page_hashes = prompt_page_hashes(seq.token_ids, self.page_size, seq.namespace)
        self.pending.appendleft(seq)
        plan.preempted.append(seq)

    def _register_full_pages(self, seq: SeqState, start: int, end: int) -> None:
        if not self.prefix_cache:
            return
        size = self.page_size
        for page_idx in range(start // size, end // size):
            if page_idx < len(seq.page_hashes):
                page_hash = seq.page_hashes[page_idx]
            else:
                parent = seq.page_hashes[page_idx - 1] if page_idx > 0 else None
                page_hash = hash_page(parent, seq.token_ids[page_idx * size:(page_idx + 1) * size], seq.namespace)
                seq.page_hashes.append(page_hash)
            parent = seq.page_hashes[page_idx - 1] if page_idx > 0 else None
            tokens = seq.token_ids[page_idx * size:(page_idx + 1) * size]
            self.pool.set_ready(seq.block_table[page_idx], page_hash, parent, tokens, namespace=seq.namespace)
            seq.claimed.discard(page_idx)

    def _release_pages(self, seq: SeqState) -> None:
        size = self.page_size
        cached = seq.num_cached_tokens
        if self.prefix_cache and cached % size and len(seq.block_table) > cached // size:
            # Keep the partly filled last page findable for partial reuse (e.g. the next chat turn).
            page_idx = cached // size
            parent = seq.page_hashes[page_idx - 1] if page_idx > 0 else None
            self.pool.record_tokens(seq.block_table[page_idx], parent, seq.token_ids[page_idx * size:cached],
                                   namespace=seq.namespace)
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.claimed.clear()
        seq.num_cached_tokens = 0


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    return math.ceil(num_tokens / page_size)


def validate_fits(token_ids: SequenceABC[int], max_new_tokens: int, num_pages: int, page_size: int) -> None:
    pages = pages_for_tokens(len(token_ids) + max_new_tokens, page_size)
    if pages > num_pages:
        raise ValueError(
            f"the job needs {pages} pages ({len(token_ids)} prompt + {max_new_tokens} new tokens, page size "
            f"{page_size}) but the whole cache has {num_pages}")
