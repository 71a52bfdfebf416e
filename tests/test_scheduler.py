"""The scheduler and page pool together, without a model (torch-free).

A fake KV store records which token each cache slot holds: writing a chunk fills its slots, a partial-page copy
copies slots. After every step, every cached position of every running sequence must hold that sequence's token —
whatever pages were shared, revived, copied, evicted or preempted on the way. That is the oracle for prefix reuse.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from folio.cache import PagePool
from folio.scheduler import Scheduler, SeqState


@dataclass(eq=False)
class FakeJob:
    max_new_tokens: int
    max_skips: int | None = 4
    skips: int = 0
    new_tokens: int = 0
    cached_pages: int = 0
    cached_tokens: int = 0


class Harness:
    def __init__(self, num_pages: int, page_size: int, max_batch_size: int = 8, max_chunk_size: int = 32,
                 prefix_cache: bool = True):
        self.pool = PagePool(num_pages, page_size)
        self.sched = Scheduler(self.pool, max_batch_size, max_chunk_size, prefix_cache)
        self.slots: dict[tuple[int, int], int] = {}  # (page, slot) -> token written there
        self.finished = 0

    def enqueue(self, prompt: list[int], max_new_tokens: int) -> SeqState:
        seq = SeqState(job=FakeJob(max_new_tokens), token_ids=list(prompt))
        self.sched.add(seq)
        return seq

    def step(self) -> None:
        size = self.pool.page_size
        plan = self.sched.plan()
        for copy in plan.copies:
            for slot in range(copy.num_slots):
                self.slots[(copy.dst_page, slot)] = self.slots[(copy.src_page, slot)]
        for chunk in plan.chunks:
            seq = chunk.seq
            for pos in range(chunk.start, chunk.end):
                self.slots[(seq.block_table[pos // size], pos % size)] = seq.token_ids[pos]
        self.sched.commit(plan)
        for chunk in plan.chunks:
            if not chunk.wants_logits or chunk.seq not in self.sched.active:
                continue
            seq = chunk.seq
            # A deterministic "model": sequences with equal histories continue equally, so generated pages
            # collide too and exercise dedup of generated content.
            self.sched.append_token(seq, (sum(seq.token_ids[-3:]) * 7 + len(seq.token_ids)) % 5)
            seq.job.new_tokens += 1
            if seq.job.new_tokens >= seq.job.max_new_tokens:
                self.sched.remove(seq)
                self.finished += 1

    def check(self) -> None:
        self.pool.check()
        size = self.pool.page_size
        refs: dict[int, int] = {}
        for seq in self.sched.active:
            assert len(seq.block_table) * size >= seq.num_cached_tokens
            for page in seq.block_table:
                refs[page] = refs.get(page, 0) + 1
            for pos in range(seq.num_cached_tokens):
                page = seq.block_table[pos // size]
                assert self.slots.get((page, pos % size)) == seq.token_ids[pos], (
                    f"position {pos} of a sequence reads a slot holding another token")
        for seq in self.sched.pending:
            assert seq.block_table == [] and seq.num_cached_tokens == 0
        for page, count in refs.items():
            assert self.pool.refcount(page) == count
        assert self.pool.num_in_use == len(refs)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.h = Harness(num_pages=24, page_size=4, max_batch_size=6, max_chunk_size=8)
        self.seqs: list[SeqState] = []

    @rule(prefix=st.integers(0, 3), length=st.integers(1, 30), tail=st.integers(0, 4), new=st.integers(1, 12))
    def enqueue(self, prefix, length, tail, new):
        # Few distinct prefixes: prompts collide often, partially and wholly.
        prompt = [(prefix * 3 + i) % 5 for i in range(length)] + [tail] * (tail % 3)
        if len(prompt) + new <= 24 * 4:
            self.seqs.append(self.h.enqueue(prompt, new))

    @rule()
    def step(self):
        self.h.step()

    @precondition(lambda self: self.seqs)
    @rule(pick=st.integers(0, 1000))
    def cancel(self, pick):
        seq = self.seqs.pop(pick % len(self.seqs))
        self.h.sched.remove(seq)

    @invariant()
    def consistent(self):
        self.h.check()

    def teardown(self):
        for seq in list(self.h.sched.active) + list(self.h.sched.pending):
            self.h.sched.remove(seq)
        self.h.pool.check()
        assert self.h.pool.num_in_use == 0
        assert self.h.pool.num_free + self.h.pool.num_cached == self.h.pool.num_pages


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)


def test_ten_thousand_jobs_leak_no_page():
    rng = random.Random(7)
    h = Harness(num_pages=64, page_size=8, max_batch_size=32, max_chunk_size=64)
    submitted = cancelled = 0
    live: list[SeqState] = []
    while submitted < 10_000 or h.sched.num_sequences:
        while submitted < 10_000 and len(h.sched.pending) < 16:
            base = rng.randrange(8)
            prompt = [base] * rng.randrange(1, 12) + [rng.randrange(5) for _ in range(rng.randrange(0, 20))]
            live.append(h.enqueue(prompt, rng.randrange(1, 6)))
            submitted += 1
        h.step()
        if live and rng.random() < 0.05:
            h.sched.remove(live.pop(rng.randrange(len(live))))
            cancelled += 1
        if len(live) > 256:
            live = [s for s in live if s in h.sched.active or s in h.sched.pending]
    h.check()
    assert h.finished + cancelled >= 10_000
    assert h.pool.num_in_use == 0
    assert h.pool.num_free + h.pool.num_cached == h.pool.num_pages
    assert h.sched.num_preemptions > 0  # the pool was small enough to force preemption along the way


def test_prefix_cache_off_shares_nothing():
    h = Harness(num_pages=32, page_size=4, prefix_cache=False)
    a = h.enqueue([1] * 17, 3)
    b = h.enqueue([1] * 17, 3)
    h.step()
    h.check()
    assert not set(a.block_table) & set(b.block_table)
    while h.sched.num_sequences:
        h.step()
    assert h.pool.num_cached == 0


def test_waiting_job_takes_pages_computed_by_another():
    h = Harness(num_pages=32, page_size=4, max_chunk_size=64)
    a = h.enqueue(list(range(13)), 10)
    b = h.enqueue(list(range(13)) + [9], 2)
    h.step()  # a computes pages 0..2 (claimed); b waits instead of computing them again
    assert b.num_cached_tokens == 0 and a.num_cached_tokens == 13
    h.step()
    h.check()
    assert b.block_table[:3] == a.block_table[:3]
    assert b.job.cached_pages == 3


def test_num_prefill_tokens_counts_the_backlog():
    h = Harness(num_pages=32, page_size=4, max_batch_size=1, max_chunk_size=8)
    h.enqueue(list(range(20)), 3)
    h.enqueue(list(range(50, 56)), 3)
    assert h.sched.num_prefill_tokens() == 26  # nothing admitted yet: both prompts whole
    h.step()  # the first is admitted and prefills 8 tokens; the second waits (batch size 1)
    assert h.sched.num_prefill_tokens() == (20 - 8) + 6


def test_preempted_in_the_step_of_its_partial_copy_records_no_slots():
    """A sequence admitted, given a partial-page copy and preempted within one step: the copy is dropped from the
    plan, so releasing it must not record that page as holding the copied tokens. (Found by the state machine:
    a later sequence copied stale slots from such a page.) None: a step; else (length, new, prefix, tail)."""
    h = Harness(num_pages=24, page_size=4, max_batch_size=6, max_chunk_size=8)
    script = [(6, 4, 0, 1), None, (1, 9, 0, 0), (1, 10, 0, 1), None, None, (22, 7, 0, 1), None, (1, 6, 0, 1),
              (29, 3, 1, 2), None, None, None, None, (4, 2, 0, 0), (23, 2, 0, 2), None, None, None, None]
    for op in script:
        if op is None:
            h.step()
        else:
            length, new, prefix, tail = op
            h.enqueue([(prefix * 3 + i) % 5 for i in range(length)] + [tail] * (tail % 3), new)
        h.check()
    assert h.sched.num_preemptions >= 2
