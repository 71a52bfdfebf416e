"""PagePool against a plain-Python model, driven by random job streams (hypothesis).

Jobs behave as the scheduler's do: look up and acquire the cached prefix, claim and fill the missing prompt pages,
reuse a partial page (pin, copy, unpin), generate tokens page by page (set_ready when a page fills, record_tokens
for the partial page), and finish, get cancelled or get preempted when allocation fails. Prompts come from a
three-token alphabet with shared stems, so prefixes collide all the time.

The model predicts every page's refcount and state, the ready and pending hashes, each page's recorded content,
the exact ids of free pages handed out, every event, every lookup and find_partial answer, and checks that eviction
never takes a page while a cached page still names it as parent. check() runs after every step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from folio.cache import OutOfPages, PageEvent, PageEventKind, PagePool, PageState, PrefixLookup
from folio.cache.host_tier import NO_TRANSFERS, HostTransfers, promote, take_transfers
from folio.hashing import hash_page, prompt_page_hashes

PAGE_SIZE = 4
STEMS = [[0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 0, 2, 2], [1, 1, 1, 1, 1], []]
prompts = st.builds(lambda stem, cut, tail: stem[:cut] + tail,
                    st.sampled_from(STEMS), st.integers(0, 8), st.lists(st.integers(0, 2), max_size=7)
                    ).filter(lambda tokens: len(tokens) > 0)


@dataclass
class Content:
    """What the model believes a page holds (mirrors record_tokens / set_ready)."""

    parent: bytes | None
    namespace: bytes
    tokens: tuple[int, ...]
    hash: bytes | None  # set for ready pages


@dataclass
class Job:
    tokens: list[int]
    namespace: bytes
    pages: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # chained hash of each completed page
    num_written: int = 0  # tokens whose K/V are in the job's pages

    def parent_of(self, page_idx: int) -> bytes | None:
        return self.hashes[page_idx - 1] if page_idx else None


class PoolMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.integers(3, 24))
    def setup(self, num_pages):
        self.pool = PagePool(num_pages, PAGE_SIZE)
        self.jobs: list[Job] = []
        self.pins: list[int] = []
        self.refcount: Counter[int] = Counter()
        self.content: dict[int, Content] = {}
        self.ready: dict[bytes, int] = {}
        self.pending: dict[bytes, int] = {}
        self.expected_events: list[PageEvent] = []

    # ---- model-checked pool operations ------------------------------------------------------------------------

    def allocate(self, num_pages: int) -> list[int] | None:
        in_use = +self.refcount
        allocatable = self.pool.num_pages - len(in_use)
        try:
            page_ids = self.pool.allocate(num_pages)
        except OutOfPages:
            assert num_pages > allocatable
            return None
        assert num_pages <= allocatable
        free = sorted(p for p in range(self.pool.num_pages) if p not in in_use and p not in self.content)
        num_from_free = min(num_pages, len(free))
        assert page_ids[:num_from_free] == free[:num_from_free]
        for page_id in page_ids[num_from_free:]:
            victim = self.content.pop(page_id)
            assert self.refcount[page_id] == 0
            if victim.hash is not None:
                # Leaf first: no cached page may still name the victim as its parent.
                assert not any(c.parent == victim.hash and self.refcount[p] == 0 for p, c in self.content.items())
                del self.ready[victim.hash]
                self.on_evicted(page_id, victim)
        for page_id in page_ids:
            self.refcount[page_id] = 1
        return page_ids

    def release(self, page_ids: list[int]) -> None:
        self.pool.release(page_ids)
        self.model_release(page_ids)

    def model_release(self, page_ids: list[int]) -> None:
        for page_id in page_ids:
            self.refcount[page_id] -= 1
            if self.refcount[page_id] == 0:
                self.drop_claims_of(page_id)

    def set_ready(self, job: Job, page_idx: int) -> None:
        page_id = job.pages[page_idx]
        page_hash, parent = job.hashes[page_idx], job.parent_of(page_idx)
        tokens = tuple(job.tokens[page_idx * PAGE_SIZE:(page_idx + 1) * PAGE_SIZE])
        accepted = self.pool.set_ready(page_id, page_hash, parent, tokens, namespace=job.namespace)
        assert accepted == (page_hash not in self.ready)
        if not accepted:
            self.content.pop(page_id, None)
            self.drop_claims_of(page_id)
            if self.refcount[page_id] == 1 and page_idx % 2:  # sometimes swap for the ready page
                job.pages[page_idx] = self.pool.acquire([page_hash])[0]
                self.refcount[job.pages[page_idx]] += 1
                self.release([page_id])
            return
        self.pending.pop(page_hash, None)
        self.ready[page_hash] = page_id
        self.content[page_id] = Content(parent, job.namespace, tokens, page_hash)
        self.expected_events.append(PageEvent(PageEventKind.STORED, page_hash))
        self.on_ready(page_id, self.content[page_id])

    def on_evicted(self, page_id: int, victim: Content) -> None:
        self.expected_events.append(PageEvent(PageEventKind.EVICTED, victim.hash))

    def on_ready(self, page_id: int, content: Content) -> None:
        """Page `page_id` became ready under content.hash (the host-tier machine mirrors it)."""

    def promote(self, job: Job, prompt_hashes: list[bytes]) -> None:
        """After the job took its ready prefix: pages the host-tier machine brings back."""

    def drop_claims_of(self, page_id: int) -> None:
        for page_hash, holder in list(self.pending.items()):
            if holder == page_id:
                del self.pending[page_hash]

    def record(self, job: Job, page_idx: int, num_tokens: int) -> None:
        start = page_idx * PAGE_SIZE
        tokens = tuple(job.tokens[start:start + num_tokens])
        self.pool.record_tokens(job.pages[page_idx], job.parent_of(page_idx), tokens, namespace=job.namespace)
        self.content[job.pages[page_idx]] = Content(job.parent_of(page_idx), job.namespace, tokens, None)

    def expected_lookup(self, hashes: list[bytes]) -> PrefixLookup:
        num_ready = 0
        while num_ready < len(hashes) and hashes[num_ready] in self.ready:
            num_ready += 1
        end = num_ready
        while end < len(hashes) and hashes[end] in self.pending:
            end += 1
        return PrefixLookup(num_ready, end - num_ready)

    def expected_partial(self, parent, tokens, namespace):
        """Every page compared: the longest common prefix (at least 2), ties to the page whose tokens sort first,
        then the lowest page id."""
        best = None  # (num matching, its tokens, page id)
        for page_id, c in self.content.items():
            if c.parent != parent or c.namespace != namespace:
                continue
            num = 0
            while num < min(len(c.tokens), len(tokens)) and c.tokens[num] == tokens[num]:
                num += 1
            if num >= 2 and (best is None or (-num, tuple(c.tokens), page_id) < (-best[0], best[1], best[2])):
                best = (num, tuple(c.tokens), page_id)
        return None if best is None else (best[2], best[0])

    def preempt(self, job: Job) -> None:
        self.release(job.pages)
        self.jobs.remove(job)

    # ---- rules ------------------------------------------------------------------------------------------------

    @rule(tokens=prompts, namespace=st.sampled_from([b"", b"", b"lora"]))
    def admit(self, tokens, namespace):
        job = Job(list(tokens), namespace)
        prompt_hashes = prompt_page_hashes(tokens, PAGE_SIZE, namespace)
        found = self.pool.lookup(prompt_hashes)
        assert found == self.expected_lookup(prompt_hashes)
        num_ready = found.num_ready
        job.pages = self.pool.acquire(prompt_hashes[:num_ready])
        assert job.pages == [self.ready[h] for h in prompt_hashes[:num_ready]]
        self.refcount.update(job.pages)
        job.hashes = prompt_hashes[:num_ready]
        job.num_written = num_ready * PAGE_SIZE
        self.jobs.append(job)
        self.promote(job, prompt_hashes)
        num_held = len(job.pages)
        fresh = self.allocate(len(prompt_hashes) - num_held)
        if fresh is None:
            return self.preempt(job)
        job.pages += fresh
        for page_idx in range(num_held, len(prompt_hashes)):
            page_hash = prompt_hashes[page_idx]
            expected = page_hash not in self.ready and page_hash not in self.pending
            parent = prompt_hashes[page_idx - 1] if page_idx else None
            assert self.pool.claim(job.pages[page_idx], page_hash, parent) == expected
            if expected:
                self.pending[page_hash] = job.pages[page_idx]
        self.reuse_partial(job)

    def reuse_partial(self, job: Job) -> None:
        start = job.num_written
        wanted = job.tokens[start:min(start + PAGE_SIZE - 1, len(job.tokens) - 1)]
        parent = job.parent_of(start // PAGE_SIZE)
        match = self.pool.find_partial(parent, wanted, namespace=job.namespace)
        assert match == self.expected_partial(parent, wanted, job.namespace)
        if match is None:
            return
        self.pool.pin(match.page_id)
        self.refcount[match.page_id] += 1
        if len(job.pages) <= start // PAGE_SIZE:
            dst = self.allocate(1)
            if dst is None:
                self.release([match.page_id])
                return self.preempt(job)
            job.pages += dst
        assert self.content[match.page_id].tokens[:match.num_matching] == tuple(wanted[:match.num_matching])
        self.release([match.page_id])
        job.num_written += match.num_matching
        self.record(job, start // PAGE_SIZE, match.num_matching)

    @precondition(lambda self: self.jobs)
    @rule(pick=st.integers(0, 63), sampled=st.sampled_from([None, None, None, 0, 1, 2]), record=st.booleans(),
          num_steps=st.integers(1, 4))
    def steps(self, pick, sampled, record, num_steps):
        job = self.jobs[pick % len(self.jobs)]
        for _ in range(num_steps):
            if job in self.jobs:
                self.step(job, sampled, record)

    def step(self, job: Job, sampled: int | None, record: bool) -> None:
        """One prefill chunk (up to the next page boundary) or one decode step of a job. sampled=None: the
        token is a function of the sequence (like greedy decoding), so equal prompts generate equal pages."""
        if job.num_written >= len(job.tokens) - 1:
            job.tokens.append(sum(job.tokens) % 3 if sampled is None else sampled)
            target = len(job.tokens) - 1
        else:
            target = min((job.num_written // PAGE_SIZE + 1) * PAGE_SIZE, len(job.tokens) - 1)
        missing = -(-target // PAGE_SIZE) - len(job.pages)
        if missing > 0:
            fresh = self.allocate(missing)
            if fresh is None:
                return self.preempt(job)
            job.pages += fresh
        first_completed = job.num_written // PAGE_SIZE
        job.num_written = target
        for page_idx in range(first_completed, target // PAGE_SIZE):
            tokens = job.tokens[page_idx * PAGE_SIZE:(page_idx + 1) * PAGE_SIZE]
            job.hashes.append(hash_page(job.parent_of(page_idx), tokens, job.namespace))
            self.set_ready(job, page_idx)
        if target % PAGE_SIZE and record:
            self.record(job, target // PAGE_SIZE, target % PAGE_SIZE)

    @precondition(lambda self: self.jobs)
    @rule(pick=st.integers(0, 63))
    def finish_or_cancel(self, pick):
        self.preempt(self.jobs[pick % len(self.jobs)])

    @precondition(lambda self: self.content)
    @rule(pick=st.integers(0, 63))
    def pin(self, pick):
        page_id = sorted(self.content)[pick % len(self.content)]
        self.pool.pin(page_id)
        self.refcount[page_id] += 1
        self.pins.append(page_id)

    @precondition(lambda self: self.pins)
    @rule()
    def unpin(self):
        page_id = self.pins.pop(0)
        self.pool.unpin(page_id)
        self.model_release([page_id])

    @precondition(lambda self: not self.jobs and not self.pins and not +self.refcount and self.content)
    @rule(roll=st.integers(0, 3))
    def reset(self, roll):
        if roll:  # rarely: a reset wipes what the other rules have built up
            return
        self.pool.reset()
        for _, c in sorted(self.content.items()):
            if c.hash is not None:
                self.expected_events.append(PageEvent(PageEventKind.EVICTED, c.hash))
        self.content.clear()
        self.ready.clear()
        self.on_reset()

    def on_reset(self) -> None:
        """After the pool's reset (the host-tier machine forgets its host entries)."""

    # ---- invariants -------------------------------------------------------------------------------------------

    @invariant()
    def pool_matches_model(self):
        self.pool.check()
        for page_id in range(self.pool.num_pages):
            assert self.pool.refcount(page_id) == self.refcount[page_id]
            if self.refcount[page_id]:
                state = PageState.IN_USE
            else:
                state = PageState.CACHED if page_id in self.content else PageState.FREE
            assert self.pool.page_state(page_id) is state, page_id
        assert set(self.pool.cached_hashes()) == set(self.ready)
        assert self.pool.num_allocatable == self.pool.num_pages - len(+self.refcount)
        assert self.pool.drain_events() == self.expected_events
        self.expected_events.clear()
        for page_hash in self.pending:
            assert self.pool.lookup([page_hash]) == PrefixLookup(0, 1)
        for job in self.jobs:
            assert self.pool.lookup(job.hashes) == self.expected_lookup(job.hashes)
        for page_hash, holder in self.ready.items():
            assert self.content[holder].hash == page_hash


TestPagePoolStateful = PoolMachine.TestCase
TestPagePoolStateful.settings = settings(max_examples=100, stateful_step_count=60, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


class HostPoolMachine(PoolMachine):
    """The same job streams over a pool with a host tier: evicted ready pages move to host slots (the oldest
    recycled when full), with write-through (drawn) every page made ready gets a slot and a mirror copy at once,
    prefix lookups continue into host-only entries (promote: pages allocated, registered as mirrors, pinned until
    the plan's transfers are taken), and the model predicts every slot, copy, ticket and event."""

    @initialize(num_pages=st.integers(3, 8), num_host_pages=st.integers(1, 12),  # small: evictions all the time
                write_through=st.booleans())
    def setup_host(self, num_pages, num_host_pages, write_through):
        self.pool = PagePool(num_pages, PAGE_SIZE, num_host_pages=num_host_pages, host_write_through=write_through)
        self.write_through = write_through
        self.jobs, self.pins, self.expected_events = [], [], []
        self.refcount, self.content, self.ready, self.pending = Counter(), {}, {}, {}
        # hash -> (slot, content, ticket of the plan whose copy fills the slot), oldest stored first
        self.host: dict[bytes, tuple[int, Content, int]] = {}
        self.mirrored: dict[bytes, int] = {}  # hash -> the GPU page holding it ready too
        self.free_slots = list(range(num_host_pages))
        self.reading: set[int] = set()
        self.to_host: list[tuple[int, int]] = []
        self.from_host: list[tuple[int, int]] = []
        self.mirror: list[tuple[int, int]] = []
        self.arriving: list[int] = []
        self.ticket, self.wait_ticket = 0, -1
        self.finished: list[tuple[list[int], bytes]] = []  # tokens of jobs that ended, to admit again

    def setup(self, num_pages):  # (the base machine's initializer is replaced by setup_host)
        raise AssertionError("unused")

    def take_slot(self) -> int | None:
        if self.free_slots:
            slot = min(self.free_slots)
            self.free_slots.remove(slot)
            return slot
        victim = next((h for h, (slot, _, _) in self.host.items() if slot not in self.reading), None)
        if victim is None:
            return None
        slot, _, ticket = self.host.pop(victim)
        if self.mirrored.pop(victim, None) is None:
            self.expected_events.append(PageEvent(PageEventKind.EVICTED, victim))
        elif ticket == self.ticket:  # its mirror copy, not made yet, is dropped
            self.mirror = [(page, s) for page, s in self.mirror if s != slot]
        return slot

    def on_evicted(self, page_id: int, victim: Content) -> None:
        if victim.hash in self.host:  # a mirror: no copy, its entry becomes the newest host-only one
            assert self.mirrored.pop(victim.hash) == page_id
            entry = self.host.pop(victim.hash)
            self.host[victim.hash] = entry
            self.wait_ticket = max(self.wait_ticket, entry[2])
        else:
            slot = self.take_slot()
            if slot is None:
                self.expected_events.append(PageEvent(PageEventKind.EVICTED, victim.hash))
                return
            self.host[victim.hash] = (slot, victim, self.ticket)
            self.to_host.append((page_id, slot))
        self.expected_events.append(PageEvent(PageEventKind.MOVED_TO_HOST, victim.hash))

    def on_ready(self, page_id: int, content: Content) -> None:
        if content.hash in self.host:  # held host-only: the slot's copy is as good
            self.mirrored[content.hash] = page_id
            return
        if not self.write_through:
            return
        slot = self.take_slot()
        if slot is None:
            return
        self.host[content.hash] = (slot, content, self.ticket)
        self.mirrored[content.hash] = page_id
        self.mirror.append((page_id, slot))

    def promote(self, job: Job, prompt_hashes: list[bytes]) -> None:
        wanted = prompt_hashes[len(job.pages):]
        num = 0
        while num < len(wanted) and wanted[num] in self.host and wanted[num] not in self.mirrored:
            num += 1
        num = min(num, self.pool.num_pages - len(+self.refcount))
        taken = [self.host[h] for h in wanted[:num]]
        self.reading.update(slot for slot, _, _ in taken)
        page_ids = promote(self.pool, prompt_hashes[len(job.pages):])
        assert len(page_ids) == num
        if not num:
            return
        free = sorted(p for p in range(self.pool.num_pages) if p not in +self.refcount and p not in self.content)
        for expected_page, page_id in zip(free, page_ids):
            assert page_id == expected_page  # free pages first, lowest id first (then eviction order)
        model_pages = self.allocate_model_only(page_ids)
        for page_hash, (slot, c, _), page_id in zip(wanted, taken, model_pages):
            self.pending.pop(page_hash, None)
            self.drop_claims_held_by_others(page_hash)
            self.ready[page_hash] = page_id
            self.content[page_id] = c
            self.refcount[page_id] += 1  # the pin
            self.arriving.append(page_id)
            self.from_host.append((slot, page_id))
            self.expected_events.append(PageEvent(PageEventKind.STORED, page_hash))
            self.mirrored[page_hash] = page_id
        job.pages += page_ids
        job.hashes += wanted[:num]
        job.num_written = len(job.pages) * PAGE_SIZE

    def allocate_model_only(self, page_ids: list[int]) -> list[int]:
        """Model the evictions of an allocation the pool already made (promote's), as allocate() would."""
        for page_id in page_ids:
            victim = self.content.pop(page_id, None)
            if victim is not None and victim.hash is not None:
                assert not any(c.parent == victim.hash and self.refcount[p] == 0 for p, c in self.content.items())
                del self.ready[victim.hash]
                self.on_evicted(page_id, victim)
            self.refcount[page_id] = 1
        return page_ids

    def drop_claims_held_by_others(self, page_hash: bytes) -> None:
        self.pending.pop(page_hash, None)

    def on_reset(self) -> None:
        for page_hash in self.host:
            if page_hash not in self.mirrored:
                self.expected_events.append(PageEvent(PageEventKind.EVICTED, page_hash))
        self.host.clear()
        self.mirrored.clear()
        self.free_slots = list(range(self.pool.host.num_host_pages))
        self.reading.clear()
        self.to_host.clear()
        self.from_host.clear()
        self.mirror.clear()
        self.wait_ticket = -1

    def preempt(self, job: Job) -> None:
        self.finished.append((list(job.tokens), job.namespace))
        super().preempt(job)

    @precondition(lambda self: self.finished)
    @rule(pick=st.integers(0, 63))
    def admit_again(self, pick):
        """A prompt seen before (a chat's next turn, a retried request): its pages are likely on the host now."""
        tokens, namespace = self.finished[pick % len(self.finished)]
        self.admit(tokens, namespace)

    @precondition(lambda self: self.content)
    @rule()
    def pressure(self):
        """Another job takes every allocatable page for a moment: whatever is cached moves to the host."""
        taken = self.allocate(self.pool.num_allocatable)
        self.release(taken)

    @rule()
    def end_plan(self):
        transfers = take_transfers(self.pool)
        expected = HostTransfers(tuple(self.to_host), tuple(self.from_host), tuple(self.mirror), self.ticket,
                                 self.wait_ticket)
        assert transfers == (expected if expected else NO_TRANSFERS)
        self.model_release(self.arriving)
        self.to_host, self.from_host, self.mirror, self.arriving = [], [], [], []
        self.reading.clear()
        self.ticket, self.wait_ticket = self.ticket + 1, -1

    @invariant()
    def host_matches_model(self):
        assert self.pool.host.hashes() == tuple(self.host)
        assert {h: e.slot for h, e in self.pool.host._entries.items()} == {h: s for h, (s, _, _) in self.host.items()}
        assert self.pool.host.mirrors() == self.mirrored
        assert set(self.host) & set(self.ready) == set(self.mirrored)
        assert all(self.ready[h] == page_id for h, page_id in self.mirrored.items())


TestHostPoolStateful = HostPoolMachine.TestCase
TestHostPoolStateful.settings = settings(max_examples=200, stateful_step_count=60, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
