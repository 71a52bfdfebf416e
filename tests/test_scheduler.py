"""The scheduler, the KV cache manager and the page pool together, without a model (torch-free).

A fake KV store records which token each cache slot holds: writing a chunk fills its slots, a partial-page copy
copies slots. After every step, every cached position of every running sequence must hold that sequence's token —
whatever pages were shared, revived, copied, evicted or preempted on the way. That is the oracle for prefix reuse.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from folio.cache import PagePool
from folio.cache.manager import KVCacheManager
from folio.scheduler import Scheduler, StepPlan
from folio.sequence import SeqStatus, Sequence


@dataclass(eq=False)
class FakeJob:
    max_new_tokens: int
    prompt_tokens: int
    max_skips: int | None = 4


class Harness:
    """ahead: plan each next step with plan_ahead before the sampled tokens are appended, as the generator's
    decode_ahead does: copies and prompt chunks are written at once (the device runs them then), the rows fed
    ahead when the step is taken, and chunks of sequences that left in between are dropped."""

    def __init__(self, num_pages: int, page_size: int, max_batch_size: int = 8, max_chunk_size: int = 32,
                 prefix_cache: bool = True, ahead: bool = False, num_host_pages: int = 0, write_through: bool = False,
                 gather_rows: int = 0, gather_steps: int = 0):
        # inspected by check(); the manager is its only user
        self.pool = PagePool(num_pages, page_size, num_host_pages=num_host_pages, host_write_through=write_through)
        self.host_slots: dict[tuple[int, int], int] = {}  # (host slot, slot) -> token copied there
        self.cache = KVCacheManager(num_pages, page_size, prefix_cache, pool=self.pool)
        self.sched = Scheduler(self.cache, max_batch_size, max_chunk_size, gather_rows, gather_steps)
        self.slots: dict[tuple[int, int], int] = {}  # (page, slot) -> token written there
        self.finished = 0
        self.ahead = ahead
        self.num_steps_ahead = 0
        self._ahead_plan: StepPlan | None = None
        self._fed: set[Sequence] = set()  # the sequences whose rows the ahead plan feeds
        self.outputs: dict[Sequence, list[int]] = {}  # tokens of each sequence when it finished

    def enqueue(self, prompt: list[int], max_new_tokens: int) -> Sequence:
        seq = Sequence(job=FakeJob(max_new_tokens, len(prompt)), token_ids=list(prompt))
        self.sched.add(seq)
        return seq

    def step(self) -> None:
        plan, self._ahead_plan = self._ahead_plan, None
        if plan is not None:
            plan.chunks = [c for c in plan.chunks if c.seq in self.sched.active]
            self._write(plan, [c for c in plan.chunks if c.seq in self._fed], copies=False)
        else:
            plan = self.sched.plan()
            self._write(plan, plan.chunks)
        self.sched.commit(plan)
        sampled = [c.seq for c in plan.chunks if c.wants_logits and c.seq in self.sched.active]
        if self.ahead and sampled:
            fed = [seq for seq in sampled if seq.num_sampled + 1 < seq.job.max_new_tokens]
            ahead = self.sched.plan_ahead(fed)
            if ahead is not None:
                assert [c.seq for c in ahead.chunks[:len(fed)]] == fed
                assert all(c.end - c.start == 1 and c.start == len(c.seq.token_ids) for c in ahead.chunks[:len(fed)])
                self._write(ahead, ahead.chunks[len(fed):])
                self._ahead_plan, self._fed = ahead, set(fed)
                self.num_steps_ahead += 1
        for seq in sampled:
            # A deterministic "model": sequences with equal histories continue equally, so generated pages
            # collide too and exercise dedup of generated content.
            seq.token_ids.append((sum(seq.token_ids[-3:]) * 7 + len(seq.token_ids)) % 5)
            seq.num_sampled += 1
            if seq.num_sampled >= seq.job.max_new_tokens:
                self.sched.remove(seq)
                seq.status = SeqStatus.FINISHED
                self.outputs[seq] = list(seq.token_ids)
                self.finished += 1

    def _write(self, plan: StepPlan, chunks: list, copies: bool = True) -> None:
        """The fake forward pass, in the device's order (folio.cache.host_tier): GPU -> host copies, the plan's
        slot copies, then the chunks' tokens into their slots, each chunk first reading every position before it
        (what attention reads), then the host -> GPU copies, which run beside the forward: no chunk may need them."""
        size = self.pool.page_size
        transfers = plan.transfers if copies else None
        for page, host_slot in (transfers.mirror + transfers.to_host) if transfers else ():
            for slot in range(size):
                self.host_slots[(host_slot, slot)] = self.slots.get((page, slot))
        for copy in plan.copies if copies else ():
            for slot in range(copy.num_slots):
                self.slots[(copy.dst_page, slot)] = self.slots[(copy.src_page, slot)]
        for chunk in chunks:
            seq = chunk.seq
            for pos in range(chunk.start):
                assert self.slots.get((seq.block_table[pos // size], pos % size)) == seq.token_ids[pos], (
                    f"a chunk reads position {pos} before its K/V are there")
            for pos in range(chunk.start, chunk.end):
                self.slots[(seq.block_table[pos // size], pos % size)] = seq.token_ids[pos]
        for host_slot, page in transfers.from_host if transfers else ():
            for slot in range(size):
                self.slots[(page, slot)] = self.host_slots[(host_slot, slot)]

    def check(self) -> None:
        self.pool.check()
        size = self.pool.page_size
        # copies a rollback left for the next step count as done: nothing reads the cache before they run
        slots = dict(self.slots)
        for copy in self.cache.pending_copies:
            for slot in range(copy.num_slots):
                slots[(copy.dst_page, slot)] = self.slots[(copy.src_page, slot)]
        refs: dict[int, int] = {}
        for seq in self.sched.active:
            assert len(seq.block_table) * size >= seq.num_cached_tokens
            for page in seq.block_table:
                refs[page] = refs.get(page, 0) + 1
            for pos in range(seq.num_cached_tokens):
                page = seq.block_table[pos // size]
                assert slots.get((page, pos % size)) == seq.token_ids[pos], (
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
        self.seqs: list[Sequence] = []

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

    @precondition(lambda self: not self.h.ahead and any(s.num_sampled for s in self.h.sched.active))
    @rule(pick=st.integers(0, 1000), fraction=st.floats(0.0, 1.0))
    def rollback(self, pick, fraction):
        """Forget some generated tokens of a running sequence: the K/V of what it keeps must still be its own,
        through released pages, copy-on-write of shared ones and the re-fed last token."""
        running = [s for s in self.h.sched.active if s.num_sampled]
        seq = running[pick % len(running)]
        num_tokens = round(fraction * seq.num_sampled)
        self.h.cache.rollback(seq, num_tokens)
        seq.num_sampled -= num_tokens

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


class AheadSchedulerMachine(SchedulerMachine):
    """The same rules with every next step planned ahead (plan_ahead) where the pool allows."""

    def __init__(self):
        super().__init__()
        self.h = Harness(num_pages=24, page_size=4, max_batch_size=6, max_chunk_size=8, ahead=True)


TestAheadSchedulerMachine = AheadSchedulerMachine.TestCase
TestAheadSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)


class HostTierSchedulerMachine(SchedulerMachine):
    """The same rules over a small pool with a host tier (write-through or not, planning ahead or not): evicted
    prefixes come back from host slots, fetched beside the forward of the plan that brings them back, so no chunk
    of that plan may read them; every position a chunk reads and every cached one must hold its token."""

    def __init__(self):
        super().__init__()
        self.h = None

    @initialize(write_through=st.booleans(), ahead=st.booleans())
    def setup_host(self, write_through, ahead):
        self.h = Harness(num_pages=12, page_size=4, max_batch_size=4, max_chunk_size=8, ahead=ahead,
                         num_host_pages=16, write_through=write_through)

    @precondition(lambda self: self.seqs)
    @rule(pick=st.integers(0, 1000), new=st.integers(1, 4))
    def enqueue_again(self, pick, new):
        """A prompt seen before: its pages are likely on the host by now."""
        seq = self.seqs[pick % len(self.seqs)]
        if seq.prompt_len + new <= 12 * 4:
            self.seqs.append(self.h.enqueue(list(seq.token_ids[:seq.prompt_len]), new))


TestHostTierSchedulerMachine = HostTierSchedulerMachine.TestCase
TestHostTierSchedulerMachine.settings = settings(max_examples=80, stateful_step_count=60, deadline=None)


@pytest.mark.parametrize("num_pages", [40, 400])
@pytest.mark.parametrize("gather", [0, 3])
def test_planning_ahead_changes_no_output(num_pages, gather):
    """Every next step planned before the sampled tokens are known (prefill, admission, prefix reuse, partial
    copies included) gives each job the tokens that planning after them gives; with a small pool, planning
    ahead falls back to plan() (which may preempt) rather than preempting itself. Gathering prompt tokens
    (gather rows and steps of 3) changes when prompts are fed, never what any job gets."""
    rng = random.Random(3)
    jobs = []
    for _ in range(60):
        base = rng.randrange(4)
        jobs.append(([base] * rng.randrange(1, 20) + [rng.randrange(5) for _ in range(rng.randrange(0, 12))],
                     rng.randrange(1, 9)))
    outputs = {}
    for ahead in (False, True):
        h = Harness(num_pages=num_pages, page_size=4, max_batch_size=8, max_chunk_size=16, ahead=ahead,
                    gather_rows=gather, gather_steps=gather)
        seqs = []
        for prompt, new in jobs:
            seqs.append(h.enqueue(prompt, new))
            if len(seqs) % 3 == 0:
                h.step()
                h.check()
        while h.sched.num_sequences:
            h.step()
            h.check()
        assert h.finished == len(jobs) and h.pool.num_in_use == 0
        assert (h.num_steps_ahead > 0) is ahead
        outputs[ahead] = [h.outputs[seq] for seq in seqs]
    assert outputs[True] == outputs[False]


def _decoding(h: Harness, count: int) -> list[Sequence]:
    """`count` sequences of 4-token prompts, stepped until all of them decode."""
    seqs = [h.enqueue([1, 2, 3, k], 100) for k in range(count)]
    while not all(s.num_sampled for s in seqs):
        h.step()
    return seqs


@pytest.mark.parametrize("prompt_len, num_decoding, waits", [
    (8, 3, 3),    # a short prompt beside 3 decoding rows waits the step limit, then is fed
    (16, 3, 0),   # a whole chunk is ready: fed at once
    (8, 1, 0),    # fewer decoding rows than gather_rows: fed at once
])
def test_gathered_prompts_wait_for_a_whole_chunk_or_the_step_limit(prompt_len, num_decoding, waits):
    h = Harness(num_pages=64, page_size=4, max_chunk_size=16, gather_rows=2, gather_steps=3)
    decoding = _decoding(h, num_decoding)
    prompt = h.enqueue(list(range(5, 5 + prompt_len)), 4)
    steps_without = 0
    while prompt.num_cached_tokens == 0:
        before = [s.num_sampled for s in decoding]
        h.step()
        h.check()
        assert [s.num_sampled for s in decoding] == [n + 1 for n in before]  # decoding goes on meanwhile
        steps_without += prompt.num_cached_tokens == 0
        assert steps_without <= 3
    assert steps_without == waits
    # the first prompt now decodes too (so at least two rows do): a second short one waits the whole limit anew
    second = h.enqueue(list(range(30, 38)), 4)
    for _ in range(3):
        h.step()
        assert second.num_cached_tokens == 0
    h.step()
    assert second.num_cached_tokens == 8


def test_gathering_feeds_the_prompts_that_came_meanwhile_together():
    """Prompts arriving one a step while rows decode are fed in one step once a chunk's worth has come."""
    h = Harness(num_pages=64, page_size=4, max_chunk_size=16, gather_rows=2, gather_steps=8)
    _decoding(h, 3)
    prompts, fed_at = [], {}
    for step in range(6):
        if step < 3:
            prompts.append(h.enqueue([40 + step] * 6, 4))  # 6 tokens each: 18 >= 16 after the third
        h.step()
        for k, seq in enumerate(prompts):
            if seq.num_cached_tokens and k not in fed_at:
                fed_at[k] = step
    assert fed_at == {0: 2, 1: 2, 2: 2}


def test_a_full_cache_does_not_walk_the_queue_and_admits_in_order_once_pages_free(monkeypatch):
    """While no page is left beyond the admission reserve, no queued job can fit: a plan must not test each of them
    (a burst of thousands against a full cache did so at every step); once pages free, they are admitted in order."""
    h = Harness(num_pages=8, page_size=4, max_batch_size=8, max_chunk_size=64)
    running = h.enqueue([1, 2, 3, 4], max_new_tokens=3)  # 7 tokens: 2 pages
    h.step()
    h.step()
    assert len(running.block_table) == 2
    held = h.pool.allocate(h.pool.num_allocatable)  # the rest of the cache, in use elsewhere
    queued = [h.enqueue([9, 9, k], max_new_tokens=2) for k in range(1000)]
    calls = []
    fits = h.sched._fits
    monkeypatch.setattr(h.sched, "_fits", lambda group: calls.append(group) or fits(group))
    while h.sched.active:
        h.step()
    assert h.finished == 1 and calls == [] and all(seq.status is SeqStatus.WAITING for seq in queued)
    h.pool.release(held)
    h.step()
    admitted = [seq for seq in queued if seq.status is SeqStatus.RUNNING]
    assert admitted and admitted == queued[:len(admitted)] and len(calls) >= len(admitted)


def test_ten_thousand_jobs_leak_no_page():
    rng = random.Random(7)
    h = Harness(num_pages=64, page_size=8, max_batch_size=32, max_chunk_size=64)
    submitted = cancelled = 0
    live: list[Sequence] = []
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
    assert b.num_prefix_hit_pages == 3


def test_num_prefill_tokens_counts_the_backlog():
    h = Harness(num_pages=32, page_size=4, max_batch_size=1, max_chunk_size=8)
    h.enqueue(list(range(20)), 3)
    h.enqueue(list(range(50, 56)), 3)
    assert h.sched.num_prefill_tokens() == 26  # nothing admitted yet: both prompts whole
    h.step()  # the first is admitted and prefills 8 tokens; the second waits (batch size 1)
    assert h.sched.num_prefill_tokens() == (20 - 8) + 6


def test_num_prefill_tokens_of_a_queued_prompt_excludes_the_pages_the_pool_holds():
    """A queued job whose leading pages another job already computed counts only what its admission would compute:
    the router's backlog estimate (folio.router.cost) must not charge cache hits as work."""
    h = Harness(num_pages=32, page_size=4, max_batch_size=1, max_chunk_size=64)
    first = h.enqueue(list(range(13)), 8)
    h.step()  # the first prefills all 13 tokens: pages 0..2 become ready; it keeps the only batch slot
    assert first.num_cached_tokens == 13
    h.enqueue(list(range(13)) + [77, 78, 79], 2)  # 16 tokens, pages 0..2 shared: 12 reusable, 4 to compute
    h.enqueue(list(range(100, 110)), 2)  # nothing shared: 10 to compute
    assert h.sched.num_prefill_tokens() == 4 + 10


def test_num_prefill_tokens_counts_a_prefix_shared_in_the_queue_once():
    """Queued prompts sharing a prefix no job has computed yet: the first computes it, the others take its pages in
    flight when admitted, so the backlog holds the prefix once (a burst of one new system prompt must not look
    like seconds of prefill to the router)."""
    h = Harness(num_pages=32, page_size=4, max_batch_size=1, max_chunk_size=64)
    prefix = list(range(12))  # 3 full pages
    h.enqueue(prefix + [100, 101, 102], 2)
    h.enqueue(prefix + [200, 201, 202], 2)
    h.enqueue(prefix[:8] + [300, 301, 302, 303, 304], 2)  # shares 2 of the 3 pages
    h.enqueue(list(range(500, 510)), 2)
    assert h.sched.num_prefill_tokens() == 15 + 3 + 5 + 10
    h.step()  # the first is admitted and prefills; the others reuse its pages, in flight or ready
    assert h.sched.num_prefill_tokens() == 3 + 5 + 10


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


def test_rollback_copies_a_registered_page_instead_of_writing_into_it():
    """Rolling back into a full page that the pool holds ready (others may share it) swaps in a private page with
    the kept slots copied; the re-fed token is written there, and the sequence then continues exactly as one that
    was never rolled back."""
    plain = Harness(num_pages=32, page_size=4, max_chunk_size=64)
    want = plain.enqueue(list(range(1, 10)), 8)
    while plain.sched.num_sequences:
        plain.step()
    h = Harness(num_pages=32, page_size=4, max_chunk_size=64)
    seq = h.enqueue(list(range(1, 10)), 8)
    while seq.num_sampled < 6:  # 15 tokens, 14 cached: pages 0-2 full and ready
        h.step()
    shared = seq.block_table[2]
    assert h.pool.is_ready(shared) and len(seq.token_ids) == 15
    h.cache.rollback(seq, 5)
    seq.num_sampled -= 5
    assert seq.token_ids == want.token_ids[:10] and seq.num_cached_tokens == 9
    assert seq.block_table[2] != shared and h.pool.refcount(shared) == 0  # kept in the cache for its hash
    assert len(seq.block_table) == 3
    h.step()  # runs the copy of slot 0 of the old page, re-feeds position 9
    h.check()
    while h.sched.num_sequences:
        h.step()
        h.check()
    assert h.outputs[seq] == plain.outputs[want]
    with pytest.raises(ValueError, match="generated tokens"):
        h.cache.rollback(h.enqueue([1, 2, 3], 2), 1)
