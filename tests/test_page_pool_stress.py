"""PagePool under a long random stream: 10,000 jobs with shared prefixes, cancellations and preemptions.

At the end every page must be free or cached and all counts must add up: nothing leaked.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from folio.cache import OutOfPages, PageEventKind, PagePool, PageState
from folio.hashing import hash_page, prompt_page_hashes

PAGE_SIZE = 16
NUM_PAGES = 80
NUM_JOBS = 10_000
MAX_ACTIVE_JOBS = 24


@dataclass
class Job:
    tokens: list[int]
    namespace: bytes
    max_new_tokens: int
    prompt_hashes: list[bytes]
    pages: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    num_written: int = 0
    num_generated: int = 0

    def parent_of(self, page_idx: int) -> bytes | None:
        return self.hashes[page_idx - 1] if page_idx else None


class Stream:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.pool = PagePool(NUM_PAGES, PAGE_SIZE)
        self.stems = [[self.rng.randrange(40) for _ in range(self.rng.randrange(0, 120))] for _ in range(12)]
        self.active: list[Job] = []
        self.num_preempted = 0
        self.num_cache_hit_pages = 0
        self.num_partial_hits = 0

    def new_job(self) -> Job:
        stem = self.rng.choice(self.stems)
        tokens = stem[:self.rng.randrange(len(stem) + 1)] + [self.rng.randrange(40)
                                                             for _ in range(self.rng.randrange(1, 24))]
        namespace = self.rng.choice([b"", b"", b"", b"adapter-1"])
        return Job(tokens, namespace, self.rng.randrange(0, 40),
                   prompt_page_hashes(tokens, PAGE_SIZE, namespace))

    def admit(self, job: Job) -> None:
        found = self.pool.lookup(job.prompt_hashes)
        job.pages = self.pool.acquire(job.prompt_hashes[:found.num_ready])
        job.hashes = job.prompt_hashes[:found.num_ready]
        job.num_written = found.num_ready * PAGE_SIZE
        self.num_cache_hit_pages += found.num_ready
        self.active.append(job)
        start = job.num_written
        match = self.pool.find_partial(job.parent_of(len(job.pages)), job.tokens[start:len(job.tokens) - 1],
                                       namespace=job.namespace)
        if match is not None and match.num_matching < PAGE_SIZE:
            self.pool.pin(match.page_id)
            ok = self.grow(job, len(job.pages) + 1)
            self.pool.unpin(match.page_id)
            if ok:
                job.num_written += match.num_matching
                self.num_partial_hits += 1
                self.pool.record_tokens(job.pages[-1], job.parent_of(len(job.pages) - 1),
                                        job.tokens[start:job.num_written], namespace=job.namespace)

    def grow(self, job: Job, num_pages: int) -> bool:
        """Allocate pages up to num_pages, claiming prompt pages; preempt the job when pages run out."""
        missing = num_pages - len(job.pages)
        if missing <= 0:
            return True
        try:
            fresh = self.pool.allocate(missing)
        except OutOfPages:
            self.finish(job, record=False)
            self.num_preempted += 1
            return False
        for page_id in fresh:
            page_idx = len(job.pages)
            job.pages.append(page_id)
            if page_idx < len(job.prompt_hashes):
                self.pool.claim(page_id, job.prompt_hashes[page_idx],
                                job.prompt_hashes[page_idx - 1] if page_idx else None)
        return True

    def advance(self, job: Job) -> None:
        if job.num_written >= len(job.tokens) - 1:
            if job.num_generated >= job.max_new_tokens:
                return self.finish(job, record=self.rng.random() < 0.7)
            job.tokens.append(sum(job.tokens[-3:]) % 40)  # deterministic "greedy" continuation
            job.num_generated += 1
            target = len(job.tokens) - 1
        else:
            chunk = self.rng.choice([PAGE_SIZE, 3 * PAGE_SIZE])
            target = min((job.num_written // PAGE_SIZE) * PAGE_SIZE + chunk, len(job.tokens) - 1)
        if not self.grow(job, -(-target // PAGE_SIZE)):
            return
        first_completed = job.num_written // PAGE_SIZE
        job.num_written = target
        for page_idx in range(first_completed, target // PAGE_SIZE):
            tokens = job.tokens[page_idx * PAGE_SIZE:(page_idx + 1) * PAGE_SIZE]
            job.hashes.append(hash_page(job.parent_of(page_idx), tokens, job.namespace))
            self.pool.set_ready(job.pages[page_idx], job.hashes[page_idx], job.parent_of(page_idx), tokens,
                                namespace=job.namespace)

    def finish(self, job: Job, record: bool) -> None:
        if record and job.num_written % PAGE_SIZE:
            page_idx = job.num_written // PAGE_SIZE
            self.pool.record_tokens(job.pages[page_idx], job.parent_of(page_idx),
                                    job.tokens[page_idx * PAGE_SIZE:job.num_written], namespace=job.namespace)
        self.pool.release(job.pages)
        self.active.remove(job)

    def run(self) -> None:
        for job_idx in range(NUM_JOBS):
            self.admit(self.new_job())
            while len(self.active) >= MAX_ACTIVE_JOBS or (self.active and self.rng.random() < 0.5):
                job = self.rng.choice(self.active)
                if self.rng.random() < 0.05:
                    self.finish(job, record=self.rng.random() < 0.5)  # cancelled
                else:
                    self.advance(job)
            if job_idx % 100 == 0:
                self.pool.check()
        while self.active:
            self.finish(self.active[0], record=True)


def test_ten_thousand_jobs_leak_no_page():
    stream = Stream(seed=20240611)
    stream.run()
    pool = stream.pool
    pool.check()
    states = [pool.page_state(page_id) for page_id in range(NUM_PAGES)]
    assert PageState.IN_USE not in states and pool.num_in_use == 0
    assert pool.num_free == states.count(PageState.FREE) and pool.num_cached == states.count(PageState.CACHED)
    assert pool.num_free + pool.num_cached == pool.num_allocatable == NUM_PAGES
    assert all(pool.refcount(page_id) == 0 for page_id in range(NUM_PAGES))
    # Replaying the event log gives exactly the ready hashes that remain.
    ready: set[bytes] = set()
    for event in pool.drain_events():
        if event.kind is PageEventKind.STORED:
            assert event.hash not in ready
            ready.add(event.hash)
        else:
            ready.remove(event.hash)
    assert ready == set(pool.cached_hashes())
    # The stream exercised what it is meant to: cache hits, partial reuse, eviction pressure, preemption.
    assert stream.num_cache_hit_pages > 1000 and stream.num_partial_hits > 100
    assert stream.num_preempted > 10
    pool.reset()
    assert pool.num_free == NUM_PAGES
