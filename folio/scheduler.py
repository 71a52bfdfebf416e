"""The scheduler: which sequences run, which tokens each feeds this step, and whom to preempt.

Torch-free; it asks the KV cache manager for pages and never sees the page pool. Each step:

1. admission: FIFO; a job that does not fit may be overtaken by later ones at most `max_skips` times;
2. prefix reuse: a sequence at a page boundary takes the cached pages that follow (the manager's business);
   if another sequence is computing that page right now, it waits a step rather than computing it twice;
3. chunk planning: every prefilling sequence gets a chunk within the step's token budget (`max_chunk_size`),
   ending on a page boundary where possible; every decoding sequence feeds its one unprocessed token;
4. pages on demand: pages are allocated as chunks reach them, never reserved for a job's worst case; when the
   pool is exhausted the most recently admitted sequence is preempted: its pages are released (they stay cached,
   so resuming is mostly a prefix hit) and it goes back to the front of the queue with its tokens kept.

After the forward pass, `commit()` advances each sequence's cached length through the manager.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from folio import cfg
from folio.cache.host_tier import NO_TRANSFERS, HostTransfers
from folio.cache.manager import KVCacheManager, PageCopy
from folio.sequence import SeqStatus, Sequence


class CacheTooSmall(RuntimeError):
    """Even alone, a sequence cannot get the pages it needs (enqueue-time validation should prevent this)."""


@dataclass
class Chunk:
    """Tokens `token_ids[start:end]` of `seq` are fed this step, followed by `drafts` (speculative tokens, not in
    the sequence: positions end .. stop - 1). Logits are wanted for the last one when `end` reaches the end of the
    sequence (a token is then sampled), or for every one of a verify row."""

    seq: Sequence
    start: int
    end: int
    verify: bool = False  # a row of drafted tokens: logits for each of its tokens
    drafts: tuple[int, ...] = ()  # (a verify row's; accepted ones join the sequence after sampling)
    # the drafter's distributions at the drafted positions (a [k, V] device tensor, opaque here); None: point masses
    draft_probs: object = None

    @property
    def stop(self) -> int:
        """One past the last position fed (drafts included)."""
        return self.end + len(self.drafts)

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start

    @property
    def token_ids(self) -> list[int]:
        """The ids fed, drafts included."""
        ids = self.seq.token_ids[self.start:self.end]
        return ids + list(self.drafts) if self.drafts else ids

    @property
    def wants_logits(self) -> bool:
        return self.verify or self.end == len(self.seq.token_ids)

    @property
    def num_logits(self) -> int:
        return self.num_tokens if self.verify else int(self.wants_logits)

    @property
    def is_prompt(self) -> bool:
        """Prompt tokens (several, or one whose logits nobody wants), as opposed to a decode or verify row."""
        # (asked of every row a few times a step: spelled out; a row that is not a verify row has no drafts)
        return not self.verify and (self.end - self.start > 1 or self.end != len(self.seq.token_ids))


@dataclass
class StepPlan:
    started: list[Sequence] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    copies: list[PageCopy] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences that made prompt progress without computing (whole pages reused, slots copied) this step.
    progressed: set[Sequence] = field(default_factory=set)
    # Host-tier copies (folio.cache.host_tier.HostTransfers): pages evicted to the host, pages brought back
    transfers: HostTransfers = NO_TRANSFERS

    @property
    def empty(self) -> bool:
        return not self.chunks and not self.copies and not self.transfers

    def take_transfers(self, cache: KVCacheManager) -> StepPlan:
        """Attach the host copies listed while planning, unless nothing of this plan will run (a plan made ahead
        that is dropped then: they wait for the next plan). Returns self."""
        if self.chunks or self.copies or self.started or self.progressed:
            self.transfers = cache.take_transfers()
        return self


class Scheduler:
    """gather_rows, gather_steps: while at least gather_rows sequences decode, prompt tokens wait (at most
    gather_steps steps in a row) until a whole max_chunk_size of them is ready, so that fewer steps carry prompt
    chunks: those cannot replay a decode graph, and the eager forward's host cost, paid once per such step, is
    what bounds a large batch once the decode rows run from graphs. 0: prompt chunks every step."""

    def __init__(self, cache: KVCacheManager, max_batch_size: int, max_chunk_size: int, gather_rows: int = 0,
                 gather_steps: int = 0):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_chunk_size < 1:
            raise ValueError(f"max_chunk_size must be >= 1, got {max_chunk_size}")
        self.cache = cache
        self.page_size = cache.page_size
        self.max_batch_size = max_batch_size
        self.max_chunk_size = max_chunk_size
        if gather_rows < 0 or gather_steps < 0:
            raise ValueError(f"gather_rows and gather_steps must be >= 0, got {gather_rows}, {gather_steps}")
        self.gather_rows, self.gather_steps = gather_rows, gather_steps
        self.num_gathering_steps = 0  # steps in a row whose prompt tokens waited
        self.num_preemptions = 0
        self.pending: deque[Sequence] = deque()
        self.active: list[Sequence] = []  # in admission order
        self._admit_counter = 0
        self._cfg: set[Sequence] = set()  # CFG jobs' positive sequences, queued or running (folio.cfg)
        # Keep a few pages free at admission so running sequences can grow without immediate preemption.
        self._admission_reserve_pages = max(1, cache.num_pages // 64)

    # --- queue ---

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (with a CFG job's negative sequence right behind it)."""
        for s in cfg.group(seq):
            self.cache.start(s)
            self.pending.append(s)
        if seq.cfg_partner is not None:
            self._cfg.add(cfg.positive(seq))

    def remove(self, seq: Sequence) -> None:
        """Cancel or finish: drop the sequence wherever it is and release its pages. A CFG job's two sequences
        leave together; the one not passed is marked FINISHED (what the job's end was, the caller's says)."""
        for s in cfg.group(seq):
            if s in self.active:
                self.active.remove(s)
                self.cache.free(s)
            elif s in self.pending:
                self.pending.remove(s)
            if s is not seq and s.is_live:
                s.status = SeqStatus.FINISHED
        if seq.cfg_partner is not None:
            self._cfg.discard(cfg.positive(seq))

    @property
    def num_cfg_jobs(self) -> int:
        """CFG jobs queued or running (folio.cfg)."""
        return len(self._cfg)

    @property
    def num_sequences(self) -> int:
        return len(self.pending) + len(self.active)

    def num_prefill_tokens(self) -> int:
        """Tokens still to prefill over running and queued sequences (a decoding sequence's one unfed token does
        not count). A queued one counts less the leading pages its admission would reuse if they are still there:
        those the pool holds now, and those a sequence queued ahead of it will compute (a burst of prompts sharing
        a new prefix is one prefix of work, not one per prompt)."""
        running = sum(n for n in (seq.num_uncached_tokens for seq in self.active) if n > 1)
        cached = self.cache.num_cached_prefix_tokens
        queued_ahead: set[bytes] = set()
        return running + sum(max(seq.num_uncached_tokens - cached(seq.page_hashes, len(seq.token_ids), queued_ahead),
                                 0) for seq in self.pending)

    # --- the step ---

    def plan(self, drafts: dict[Sequence, tuple[int, ...]] | None = None) -> StepPlan:
        """drafts: speculative tokens of decoding sequences; each such sequence feeds a verify row of its unfed
        token and its drafts, or a plain decode row when the pool has no pages for the drafts."""
        return self._plan(set(), drafts or {})

    def _plan(self, sampling: set[Sequence], drafts: dict[Sequence, tuple[int, ...]]) -> StepPlan:
        """`sampling`: sequences whose next token is being sampled now (plan_ahead): each feeds it, at position
        len(token_ids)."""
        plan = StepPlan(copies=self.cache.take_copies())
        self._admit(plan)
        budget = self._prompt_budget(sampling)
        now = time.monotonic()
        for seq in list(self.active):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted while planning an earlier sequence
            if seq in sampling:
                position = len(seq.token_ids)
                chunk = Chunk(seq, position, position + 1)
            elif seq.num_uncached_tokens == 0:
                continue  # sampling now but not planned ahead (this token ends it)
            else:
                if not seq.is_decoding:
                    advanced, copies = self.cache.reuse_prefix(seq)
                    plan.copies.extend(copies)
                    if advanced:
                        plan.progressed.add(seq)
                    if self.cache.waits_for_pending_page(seq) or self.cache.reads_arriving_page(seq):
                        continue
                chunk = self._next_chunk(seq, budget)
                if chunk is None:
                    continue
                if seq in drafts and chunk.end == len(seq.token_ids) and chunk.num_tokens == 1:
                    # drafts never preempt anyone: without pages for them the row just decodes
                    verify = Chunk(seq, chunk.start, chunk.end, verify=True, drafts=drafts[seq])
                    if self.cache.allocate(seq, verify.stop):
                        chunk = verify
            if not self._ensure_pages(seq, chunk.end, plan):
                continue
            if chunk.is_prompt and seq not in sampling:
                budget -= chunk.num_tokens  # prompt tokens; a decode row costs no budget
            plan.chunks.append(chunk)
        if self._cfg:
            plan.chunks = cfg.sync_pair_chunks(plan.chunks)  # a CFG pair samples in one step or not at all
        for chunk in plan.chunks:  # (a plan made ahead is launched at once: its chunks start now too)
            if chunk.seq.time_first_chunk is None:
                chunk.seq.time_first_chunk = now
        return plan.take_transfers(self.cache)

    def _prompt_budget(self, sampling: set[Sequence]) -> int:
        """This step's prompt tokens: max_chunk_size, or 0 while they are gathered (see the class)."""
        if not self.gather_rows or not self.gather_steps:
            return self.max_chunk_size
        num_decoding, num_prompt = len(sampling), 0
        for seq in self.active:
            uncached = seq.num_uncached_tokens if seq not in sampling else 0
            num_decoding += uncached == 1
            num_prompt += uncached if uncached > 1 else 0
        if (num_prompt and num_decoding >= self.gather_rows and num_prompt < self.max_chunk_size
                and self.num_gathering_steps < self.gather_steps):
            self.num_gathering_steps += 1
            return 0
        self.num_gathering_steps = 0
        return self.max_chunk_size

    def commit(self, plan: StepPlan) -> None:
        """The forward pass of `plan` ran: its tokens' K/V are in the cache."""
        for chunk in plan.chunks:
            if chunk.seq.status is SeqStatus.RUNNING:
                self.cache.commit(chunk.seq, chunk.end)

    def commit_drafts(self, seq: Sequence, end: int) -> None:
        """A verify row's accepted drafts joined the sequence: their K/V, written by its forward, are cached up
        to `end`; pages taken for rejected drafts go back."""
        self.cache.commit(seq, end)
        self.cache.trim(seq)

    def plan_ahead(self, seqs: list[Sequence]) -> StepPlan | None:
        """The step after the current one, planned before the tokens now being sampled are known. Each of `seqs`
        (active, all of their tokens cached) feeds the token it is about to sample, at position len(token_ids);
        their chunks [len, len + 1) come first, in the order of `seqs`, and become whole once that token is
        appended. The rest of the step is what plan() would make of it then: admission, prefix reuse, prompt
        chunks. None, with nothing changed, when the pool might run short of pages for the step, since planning
        ahead must never preempt, or while a CFG job is queued or running (its two rows are planned after its
        token is known: the simple way to keep the pair in step)."""
        if self._cfg:
            return None
        size = self.page_size
        crossing = sum(1 for seq in seqs if len(seq.token_ids) // size + 1 > len(seq.block_table))
        admissible = min(len(self.pending), max(0, self.max_batch_size - len(self.active)))
        others: list[Sequence] = []
        if len(seqs) != len(self.active):
            feeding = set(seqs)
            others = [seq for seq in self.active if seq not in feeding and seq.num_uncached_tokens > 0]
        if not others and not admissible:
            # Only decode rows (the steady state, planned every step: kept to one loop over `seqs`).
            if crossing > self.cache.num_allocatable:
                return None
            plan = StepPlan(copies=self.cache.take_copies())
            for seq in seqs:
                position = len(seq.token_ids)
                if not self._ensure_pages(seq, position + 1, plan):
                    raise AssertionError("plan_ahead preempted a sequence although enough pages were free")
                plan.chunks.append(Chunk(seq, position, position + 1))
            return plan.take_transfers(self.cache)
        if crossing + self._prompt_pages_bound(others, admissible) > self.cache.num_allocatable:
            return None
        sampling = set(seqs)
        plan = self._plan(sampling, {})
        if plan.preempted:
            raise AssertionError("plan_ahead preempted a sequence although enough pages were free")
        by_seq = {c.seq: c for c in plan.chunks if c.seq in sampling}
        plan.chunks = [by_seq[seq] for seq in seqs] + [c for c in plan.chunks if c.seq not in sampling]
        return plan

    def _prompt_pages_bound(self, others: list[Sequence], admissible: int) -> int:
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
        if self.cache.prefix_cache:
            revived = sum(max(0, len(seq.page_hashes) - len(seq.block_table)) for seq in others)
            revived += admissible * max((len(seq.page_hashes) for seq in self.pending), default=0)
        return chunk_pages + revived

    # --- admission ---

    def _admit(self, plan: StepPlan) -> None:
        if not self.pending or len(self.active) >= self.max_batch_size:
            return
        if self.active and self._admission_reserve_pages > self.cache.num_allocatable:
            # No queued job fits (each needs the reserve and >= 0 pages more; _fits): skipping them all changes
            # nothing (skips count only when a later job is admitted), so the queue, thousands of jobs under a
            # burst against a full cache, is not walked at every plan.
            return
        skipped: list[Sequence] = []
        for seq in list(self.pending):
            if seq.cfg_negative:
                continue  # admitted with its positive
            group = cfg.group(seq)  # a CFG job: both sequences, two batch rows
            if len(self.active) + len(group) > self.max_batch_size:
                break
            if not self._fits(group):
                skipped.append(seq)
                continue
            # Never overtake a job that has been skipped as often as it allows.
            if any(s.job.max_skips is not None and s.num_skips >= s.job.max_skips for s in skipped):
                break
            for s in skipped:
                s.num_skips += 1
            for s in group:
                self.pending.remove(s)
                s.admit_order = self._admit_counter
                self._admit_counter += 1
                s.status = SeqStatus.RUNNING
                self.active.append(s)
                if not s.started:
                    s.started = True
                    s.num_prefill_target = len(s.token_ids)
                    self.cache.count_admission(s)
                    if not s.cfg_negative:
                        plan.started.append(s)

    def _fits(self, group: tuple[Sequence, ...]) -> bool:
        """Room for the part of each prompt not already in the pool, plus one page to grow into (unless the
        prompt's pages are all the job will ever need: a job that fills the whole cache exactly must still fit an
        empty one)."""
        size = self.page_size
        pages_needed = 0
        for seq in group:
            final_len = seq.prompt_len + seq.job.max_new_tokens
            pages = min(-(-len(seq.token_ids) // size) + 1,
                        max(-(-final_len // size), -(-len(seq.token_ids) // size)))
            pages_needed += pages - self.cache.num_held_prompt_pages(seq)
        reserve = self._admission_reserve_pages if self.active else 0
        return pages_needed + reserve <= self.cache.num_allocatable

    # --- chunks and pages ---

    def _next_chunk(self, seq: Sequence, budget: int) -> Chunk | None:
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

    def _ensure_pages(self, seq: Sequence, end: int, plan: StepPlan) -> bool:
        """Pages so positions < end have slots, preempting newer sequences if needed. Returns False if `seq`
        itself had to be preempted."""
        while not self.cache.allocate(seq, end):
            victim = max(self.active, key=lambda s: s.admit_order)
            self._preempt(victim, plan)
            if seq.status is not SeqStatus.RUNNING:  # seq itself, or its CFG partner with it
                return False
        return True

    def _preempt(self, victim: Sequence, plan: StepPlan) -> None:
        """Back to the front of the queue: the sequence, or both of a CFG job's (positive first)."""
        group = cfg.group(victim)
        if len(self.active) <= len(group):
            raise CacheTooSmall(
                f"a single job of {' + '.join(str(len(s.token_ids)) for s in group)} tokens does not fit the cache "
                f"({self.cache.num_pages} pages of {self.page_size})")
        for seq in reversed(group):
            self.num_preemptions += 1
            self.active.remove(seq)
            seq.status = SeqStatus.WAITING
            plan.chunks = [c for c in plan.chunks if c.seq is not seq]
            plan.copies = self.cache.preempt(seq, plan.copies)
            self.pending.appendleft(seq)
            plan.preempted.append(seq)
