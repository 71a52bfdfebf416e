"""PagePool, exact: page ids, eviction order, sharing, pending claims, partial pages, events, errors.

Every pool here is a CheckedPool: check() runs after every call, including calls that raise.
"""

from __future__ import annotations

import pytest

from folio.cache import (
    InvariantViolation,
    OutOfPages,
    PageEvent,
    PageEventKind,
    PageNotReady,
    PagePool,
    PageState,
    PageStateError,
    PartialMatch,
    PrefixLookup,
    RefcountUnderflow,
)
from folio.hashing import page_hashes

PAGE_SIZE = 4


class CheckedPool:
    """A PagePool whose every method call is followed by check()."""

    def __init__(self, num_pages: int, page_size: int = PAGE_SIZE, **kwargs) -> None:
        self.pool = PagePool(num_pages, page_size, **kwargs)
        self.pool.check()

    def __getattr__(self, name):
        attr = getattr(self.pool, name)
        if not callable(attr):
            return attr

        def checked(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            finally:
                self.pool.check()

        return checked


def stored(*hashes):
    return [PageEvent(PageEventKind.STORED, h) for h in hashes]


def evicted(*hashes):
    return [PageEvent(PageEventKind.EVICTED, h) for h in hashes]


def run_job(pool, tokens, namespace=b""):
    """Allocate, claim and fill one page per full page of `tokens` (a fresh job with no cache hits), record the
    partial rest, and return (page ids, hashes) without releasing anything."""
    hashes = page_hashes(tokens, PAGE_SIZE, namespace)
    page_ids = pool.allocate(-(-len(tokens) // PAGE_SIZE))
    for idx, page_hash in enumerate(hashes):
        parent = hashes[idx - 1] if idx else None
        assert pool.claim(page_ids[idx], page_hash, parent)
        assert pool.set_ready(page_ids[idx], page_hash, parent, tokens[idx * PAGE_SIZE:(idx + 1) * PAGE_SIZE],
                              namespace=namespace)
    rest = tokens[len(hashes) * PAGE_SIZE:]
    if rest:
        pool.record_tokens(page_ids[-1], hashes[-1] if hashes else None, rest, namespace=namespace)
    return page_ids, hashes


def chain(start, num_pages):
    return list(range(start, start + num_pages * PAGE_SIZE))


# ---- allocation order -----------------------------------------------------------------------------------------


def test_fresh_pool():
    pool = CheckedPool(10)
    assert (pool.num_pages, pool.page_size, pool.num_free, pool.num_cached, pool.num_in_use) == (10, 4, 10, 0, 0)
    assert pool.num_allocatable == 10
    assert pool.lookup(page_hashes(chain(0, 2), PAGE_SIZE)) == PrefixLookup(0, 0)
    assert list(pool.cached_hashes()) == [] and pool.drain_events() == []


def test_free_pages_lowest_id_first():
    pool = CheckedPool(8)
    assert pool.allocate(4) == [0, 1, 2, 3]
    assert [pool.refcount(p) for p in range(5)] == [1, 1, 1, 1, 0]
    pool.release([2, 0])  # anonymous pages: straight back to free
    assert pool.page_state(0) is PageState.FREE and pool.num_free == 6
    assert pool.allocate(3) == [0, 2, 4]
    assert pool.allocate(0) == []
    assert (pool.num_free, pool.num_in_use) == (3, 5)


def test_out_of_pages_changes_nothing():
    pool = CheckedPool(4)
    run_ids, hashes = run_job(pool, chain(0, 2))
    pool.release(run_ids)
    pool.drain_events()
    pool.allocate(1)
    with pytest.raises(OutOfPages) as info:
        pool.allocate(4)
    assert (info.value.num_requested, info.value.num_allocatable) == (4, 3)
    assert (pool.num_free, pool.num_cached, pool.num_in_use) == (1, 2, 1)
    assert pool.lookup(hashes) == PrefixLookup(2, 0) and pool.drain_events() == []
    with pytest.raises(ValueError, match="num_pages"):
        pool.allocate(-1)


# ---- eviction order -------------------------------------------------------------------------------------------


def test_eviction_is_leaf_first_then_lru():
    pool = CheckedPool(6)
    a_ids, a = run_job(pool, chain(0, 3))  # pages 0, 1, 2
    b_ids, b = run_job(pool, chain(100, 2))  # pages 3, 4
    assert (a_ids, b_ids) == ([0, 1, 2], [3, 4])
    pool.release(a_ids)  # chain A released first: least recently used
    pool.release(b_ids)
    pool.drain_events()
    # Free page 5 first, then chain A from its tail (leaf first), so its head survives longest; chain B untouched.
    assert pool.allocate(3) == [5, 2, 1]
    assert pool.drain_events() == evicted(a[2], a[1])
    assert pool.lookup(a) == PrefixLookup(1, 0) and pool.lookup(b) == PrefixLookup(2, 0)
    assert pool.allocate(3) == [0, 4, 3]
    assert pool.drain_events() == evicted(a[0], b[1], b[0])
    assert pool.num_cached == 0 and pool.num_allocatable == 0


def test_acquire_refreshes_recency():
    pool = CheckedPool(4)
    a_ids, a = run_job(pool, chain(0, 2))
    b_ids, b = run_job(pool, chain(100, 2))
    pool.release(a_ids)
    pool.release(b_ids)
    assert pool.acquire(a) == a_ids  # revive chain A: now more recent than B
    pool.release(a_ids)
    pool.drain_events()
    assert pool.allocate(2) == [3, 2]
    assert pool.drain_events() == evicted(b[1], b[0])


def test_shared_parent_outlives_both_branches():
    pool = CheckedPool(4)
    first_ids, first = run_job(pool, chain(0, 2))  # pages 0, 1
    pool.release(first_ids)
    [root_id] = pool.acquire(first[:1])  # second job shares page 0 and branches off
    [branch_id] = pool.allocate(1)
    branch = page_hashes(chain(0, 1) + [9, 9, 9, 9], PAGE_SIZE)
    assert (root_id, branch_id) == (0, 2)
    assert pool.set_ready(branch_id, branch[1], branch[0], [9, 9, 9, 9])
    pool.release([root_id, branch_id])
    pool.drain_events()
    # Page 1 is the oldest leaf; page 0 (recently reused) has two children and goes only after both.
    assert pool.allocate(4) == [3, 1, 2, 0]
    assert pool.drain_events() == evicted(first[1], branch[1], first[0])


def test_page_with_only_in_use_children_goes_after_all_leaves():
    pool = CheckedPool(5)
    old_ids, old = run_job(pool, chain(0, 2))  # pages 0, 1
    pool.release(old_ids)
    # A second job computes the same first page anonymously (page 2): set_ready finds page 0 ready and refuses.
    rerun_ids = pool.allocate(2)
    assert rerun_ids == [2, 3]
    assert pool.set_ready(2, old[0], None, chain(0, 1)) is False
    assert pool.refcount(2) == 1 and pool.lookup(old[:1]) == PrefixLookup(1, 0)
    # Its second page differs from page 1; its parent (old[0]) is held by cached page 0.
    other = page_hashes(chain(0, 1) + [7, 7, 7, 7], PAGE_SIZE)
    assert other[0] == old[0]
    assert pool.set_ready(3, other[1], old[0], [7, 7, 7, 7])
    leaf_ids, leaf = run_job(pool, chain(200, 1))  # page 4, released after page 0: more recent
    pool.release(leaf_ids)
    pool.drain_events()
    # Page 1 and page 4 are leaves; page 0 is named only by in-use page 3, so it goes last.
    assert pool.allocate(3) == [1, 4, 0]
    assert pool.drain_events() == evicted(old[1], leaf[0], old[0])
    pool.release([2, 3])  # page 2 is anonymous: freed; page 3 stays cached as an orphan (its parent is gone)
    assert pool.page_state(2) is PageState.FREE and pool.page_state(3) is PageState.CACHED
    assert pool.lookup(other) == PrefixLookup(0, 0) and other[1] in set(pool.cached_hashes())


# ---- sharing and revival --------------------------------------------------------------------------------------


def test_prompt_cache_hit_revives_pages():
    pool = CheckedPool(8)
    ids, hashes = run_job(pool, chain(0, 3))
    pool.release(ids)
    assert (pool.num_cached, pool.num_in_use) == (3, 0)
    assert pool.lookup(hashes + page_hashes(chain(0, 4), PAGE_SIZE)[3:]) == PrefixLookup(3, 0)
    assert pool.acquire(hashes[:2]) == ids[:2]
    assert [pool.page_state(p) for p in ids] == [PageState.IN_USE, PageState.IN_USE, PageState.CACHED]
    assert (pool.num_cached, pool.num_in_use, pool.num_allocatable) == (1, 2, 6)


def test_in_flight_sharing_counts_block_tables():
    pool = CheckedPool(8)
    ids, hashes = run_job(pool, chain(0, 2))
    assert pool.acquire(hashes) == ids  # a second job, same prefix, while the first still runs
    assert pool.acquire(hashes[:1]) == ids[:1]  # and a third sharing only page 0
    assert [pool.refcount(p) for p in ids] == [3, 2]
    pool.release(ids)
    pool.release(ids[:1])
    assert [pool.refcount(p) for p in ids] == [1, 1] and pool.num_cached == 0
    pool.release(ids)
    assert [pool.page_state(p) for p in ids] == [PageState.CACHED, PageState.CACHED]
    assert pool.drain_events() == stored(*hashes)  # sharing stores nothing new


# ---- pending claims -------------------------------------------------------------------------------------------


def test_pending_claim_is_visible_and_vanishes_on_release():
    pool = CheckedPool(8)
    hashes = page_hashes(chain(0, 3), PAGE_SIZE)
    ids = pool.allocate(3)
    assert pool.claim(ids[0], hashes[0], None) and pool.claim(ids[1], hashes[1], hashes[0])
    assert pool.lookup(hashes) == PrefixLookup(0, 2)
    [other] = pool.allocate(1)
    assert pool.claim(other, hashes[0], None) is False  # already pending
    with pytest.raises(PageNotReady, match="pending"):
        pool.acquire(hashes[:1])
    assert pool.set_ready(ids[0], hashes[0], None, chain(0, 1))
    assert pool.lookup(hashes) == PrefixLookup(1, 1)
    pool.release(ids)  # cancelled mid-prefill: the pending hash disappears, its page is freed
    assert pool.lookup(hashes) == PrefixLookup(1, 0)
    assert pool.page_state(ids[1]) is PageState.FREE and pool.page_state(ids[0]) is PageState.CACHED
    assert pool.claim(other, hashes[1], hashes[0])  # the hash can be claimed again
    assert list(pool.cached_hashes()) == [hashes[0]]


def test_lookup_stops_at_first_gap():
    pool = CheckedPool(8)
    hashes = page_hashes(chain(0, 4), PAGE_SIZE)
    ids = pool.allocate(4)
    for idx in (0, 1, 3):
        pool.claim(ids[idx], hashes[idx], hashes[idx - 1] if idx else None)
        pool.set_ready(ids[idx], hashes[idx], hashes[idx - 1] if idx else None, chain(idx * 4, 1))
    pool.claim(ids[2], hashes[2], hashes[1])
    assert pool.lookup(hashes) == PrefixLookup(2, 1)
    assert pool.lookup(hashes[1:]) == PrefixLookup(1, 1)
    assert pool.lookup([]) == PrefixLookup(0, 0)


def test_ready_page_supersedes_a_pending_claim():
    pool = CheckedPool(4)
    hashes = page_hashes(chain(0, 1), PAGE_SIZE)
    prefiller, generator = pool.allocate(2)
    assert pool.claim(prefiller, hashes[0], None)
    assert pool.set_ready(generator, hashes[0], None, chain(0, 1))  # generated the same page first
    assert pool.lookup(hashes) == PrefixLookup(1, 0)
    assert pool.set_ready(prefiller, hashes[0], None, chain(0, 1)) is False  # claim dropped: stays anonymous
    pool.release([prefiller])
    assert pool.page_state(prefiller) is PageState.FREE


def test_duplicate_page_can_be_swapped_for_the_ready_one():
    pool = CheckedPool(4)
    ids, hashes = run_job(pool, chain(0, 1))
    [mine] = pool.allocate(1)
    assert pool.set_ready(mine, hashes[0], None, chain(0, 1)) is False
    assert pool.drain_events() == stored(hashes[0])
    assert pool.acquire(hashes) == ids
    pool.release([mine])
    assert pool.refcount(ids[0]) == 2 and pool.page_state(mine) is PageState.FREE


# ---- partial pages --------------------------------------------------------------------------------------------


def test_partial_page_cached_and_found():
    pool = CheckedPool(8)
    ids, hashes = run_job(pool, chain(0, 1) + [50, 51, 52])  # page 1 holds 3 recorded tokens
    pool.release(ids)
    assert pool.page_state(ids[1]) is PageState.CACHED and pool.num_cached == 2
    assert pool.find_partial(hashes[0], [50, 51, 99]) == PartialMatch(ids[1], 2)
    assert pool.find_partial(hashes[0], [50, 51, 52, 53]) == (ids[1], 3)
    assert pool.find_partial(hashes[0], [50, 99]) is None  # a single matching token is not worth a copy
    assert pool.find_partial(hashes[0], [50]) is None
    assert pool.find_partial(None, [50, 51, 52]) is None  # other parent
    # Full ready pages are candidates too (their tokens come from set_ready).
    assert pool.find_partial(None, [0, 1, 2, 77]) == (ids[0], 3)


def test_partial_match_prefers_longest_then_first_in_token_order():
    pool = CheckedPool(8)
    pages = pool.allocate(3)
    pool.record_tokens(pages[0], None, [1, 2, 3])
    pool.record_tokens(pages[1], None, [1, 2])
    pool.record_tokens(pages[2], None, [1, 2, 3, 4])
    # [1, 2, 3] and [1, 2, 3, 4] both share 3 tokens: the one that sorts first (a prefix sorts before its extensions)
    assert pool.find_partial(None, [1, 2, 3, 9]) == (pages[0], 3)
    assert pool.find_partial(None, [1, 2, 3, 4]) == (pages[2], 4)  # in-use pages count too
    pool.record_tokens(pages[2], None, [1, 2])  # rolled back: replaces the record
    assert pool.find_partial(None, [1, 2, 3, 4]) == (pages[0], 3)
    # token order before page id: [1, 2, 3, 0] sorts before [1, 2, 3, 4] though its page id is higher
    pool.record_tokens(pages[0], None, [1, 2, 3, 4])
    pool.record_tokens(pages[2], None, [1, 2, 3, 0])
    assert pool.find_partial(None, [1, 2, 3, 9]) == (pages[2], 3)
    pool.record_tokens(pages[2], None, [1, 2, 3, 4])  # the same tokens on two pages: the lower id
    assert pool.find_partial(None, [1, 2, 3, 9]) == (pages[0], 3)
    pool.release(pages)
    assert pool.num_cached == 3


def test_partial_match_in_a_large_bucket_against_comparing_every_page():
    """Thousands of pages filed under one key (prompts that begin alike), tokens from a small alphabet so that long
    shared prefixes and ties are common: each answer is the one a comparison with every page gives."""
    import random

    rng = random.Random(0)
    page_size, num_pages = 16, 3000
    pool = PagePool(num_pages, page_size)
    ids = pool.allocate(num_pages)
    recorded = {}
    for page_id in ids:
        tokens = [7, 8] + [rng.randrange(3) for _ in range(rng.randrange(0, page_size - 1))]
        pool.record_tokens(page_id, None, tokens)
        recorded[page_id] = tuple(tokens)
    for page_id in rng.sample(ids, 500):  # rewritten records: the index drops the old entry
        tokens = [7, 8] + [rng.randrange(3) for _ in range(rng.randrange(0, page_size - 1))]
        pool.record_tokens(page_id, None, tokens)
        recorded[page_id] = tuple(tokens)
    pool.check()

    def every_page(query):
        best = None
        for page_id, tokens in recorded.items():
            num = 0
            while num < min(len(tokens), len(query)) and tokens[num] == query[num]:
                num += 1
            if num >= 2 and (best is None or (-num, tokens, page_id) < best):
                best = (-num, tokens, page_id)
        return None if best is None else (best[2], -best[0])

    for _ in range(300):
        query = [7, 8] + [rng.randrange(3) for _ in range(rng.randrange(0, page_size))]
        assert pool.find_partial(None, query) == every_page(query), query
    assert pool.find_partial(None, [7, 9, 0]) is None


def test_partial_pages_are_per_namespace():
    pool = CheckedPool(4)
    ids, _ = run_job(pool, [1, 2, 3], namespace=b"lora-a")
    pool.release(ids)
    assert pool.find_partial(None, [1, 2, 3], namespace=b"lora-a") == (ids[0], 3)
    assert pool.find_partial(None, [1, 2, 3]) is None
    assert pool.find_partial(None, [1, 2, 3], namespace=b"lora-b") is None


def test_pin_protects_the_copy_source():
    pool = CheckedPool(3)
    ids, hashes = run_job(pool, chain(0, 1) + [50, 51])
    pool.release(ids)
    match = pool.find_partial(hashes[0], [50, 51, 60])
    assert match == (1, 2)
    pool.pin(match.page_id)
    assert pool.refcount(1) == 1 and pool.num_allocatable == 2
    # Page 2 is free, then only page 0 is evictable: it is no leaf while pinned page 1 names it, yet allocatable.
    assert pool.allocate(2) == [2, 0]
    with pytest.raises(OutOfPages):
        pool.allocate(1)
    assert pool.find_partial(hashes[0], [50, 51]) == (1, 2)  # the source survived
    pool.unpin(1)
    assert pool.page_state(1) is PageState.CACHED
    assert pool.allocate(1) == [1]


def test_partial_child_is_evicted_before_its_parent():
    pool = CheckedPool(2)
    ids, hashes = run_job(pool, chain(0, 1) + [5, 6])
    pool.release(ids)
    pool.drain_events()
    assert pool.allocate(1) == [ids[1]]
    assert pool.drain_events() == [] and pool.lookup(hashes) == PrefixLookup(1, 0)


def test_pending_page_with_recorded_tokens_stays_as_partial():
    pool = CheckedPool(4)
    hashes = page_hashes(chain(0, 1), PAGE_SIZE)
    [page] = pool.allocate(1)
    assert pool.claim(page, hashes[0], None)
    pool.record_tokens(page, None, [0, 1])  # a chunk smaller than a page filled half of it
    pool.release([page])
    assert pool.lookup(hashes) == PrefixLookup(0, 0)
    assert pool.page_state(page) is PageState.CACHED and pool.find_partial(None, [0, 1, 2]) == (page, 2)


# ---- events, reset --------------------------------------------------------------------------------------------


def test_events_and_cached_hashes():
    pool = CheckedPool(3)
    ids, hashes = run_job(pool, chain(0, 2))
    assert pool.drain_events() == stored(*hashes) and pool.drain_events() == []
    assert set(pool.cached_hashes()) == set(hashes)  # in use counts as cached for the router
    pool.release(ids)
    assert pool.allocate(3) == [2, 1, 0]
    assert pool.drain_events() == evicted(hashes[1], hashes[0])
    assert list(pool.cached_hashes()) == []


def test_events_can_be_switched_off():
    pool = CheckedPool(3, record_events=False)
    ids, _ = run_job(pool, chain(0, 2))
    pool.release(ids)
    pool.allocate(3)
    assert pool.drain_events() == []


def test_reset_forgets_cached_pages():
    pool = CheckedPool(4)
    ids, hashes = run_job(pool, chain(0, 2) + [1, 2])
    with pytest.raises(PageStateError, match="in use"):
        pool.reset()
    pool.release(ids)
    pool.drain_events()
    pool.reset()
    assert (pool.num_free, pool.num_cached) == (4, 0)
    assert sorted(pool.drain_events(), key=lambda e: e.hash) == sorted(evicted(*hashes), key=lambda e: e.hash)
    assert pool.lookup(hashes) == PrefixLookup(0, 0) and pool.find_partial(hashes[1], [1, 2]) is None
    assert pool.allocate(4) == [0, 1, 2, 3]


# ---- errors ---------------------------------------------------------------------------------------------------


def test_release_errors_change_nothing():
    pool = CheckedPool(4)
    [page] = pool.allocate(1)
    with pytest.raises(RefcountUnderflow, match="2 releases"):
        pool.release([page, page])
    assert pool.refcount(page) == 1
    pool.release([page])
    with pytest.raises(RefcountUnderflow, match="double free"):
        pool.release([page])
    with pytest.raises(ValueError, match="out of range"):
        pool.release([4])


def test_hashing_errors():
    pool = CheckedPool(4)
    hashes = page_hashes(chain(0, 2), PAGE_SIZE)
    first, second, never = pool.allocate(3)
    assert pool.set_ready(first, hashes[0], None, chain(0, 1))
    with pytest.raises(PageStateError, match="already hashed"):
        pool.set_ready(first, hashes[0], None, chain(0, 1))
    with pytest.raises(PageStateError, match="already has a hash"):
        pool.claim(first, hashes[1], hashes[0])
    with pytest.raises(PageStateError, match="content is fixed"):
        pool.record_tokens(first, None, [1, 2])
    assert pool.claim(second, hashes[1], hashes[0])
    with pytest.raises(PageStateError, match="claimed for another hash"):
        pool.set_ready(second, hashes[0], None, chain(0, 1))
    with pytest.raises(PageStateError, match="follows parent"):
        pool.set_ready(second, hashes[1], None, chain(4, 1))
    with pytest.raises(PageStateError, match="follows parent"):
        pool.record_tokens(second, None, [1, 2])
    with pytest.raises(ValueError, match="needs 4 token ids"):
        pool.set_ready(second, hashes[1], hashes[0], [1, 2])
    with pytest.raises(ValueError, match="1..4 token ids"):
        pool.record_tokens(never, None, [])
    with pytest.raises(ValueError, match="16 bytes"):
        pool.claim(never, b"short", None)
    with pytest.raises(ValueError, match="parent hash"):
        pool.claim(never, hashes[1], b"x" * 3)
    with pytest.raises(ValueError, match="equals its parent"):
        pool.claim(never, hashes[1], hashes[1])


def test_state_errors():
    pool = CheckedPool(4)
    hashes = page_hashes(chain(0, 1), PAGE_SIZE)
    for call in (lambda: pool.claim(0, hashes[0], None), lambda: pool.set_ready(0, hashes[0], None, chain(0, 1)),
                 lambda: pool.record_tokens(0, None, [1, 2]), lambda: pool.pin(0)):
        with pytest.raises(PageStateError, match="page 0 \\(free"):
            call()
    ids, _ = run_job(pool, chain(0, 1))
    pool.release(ids)
    with pytest.raises(PageStateError, match="not in use"):  # cached pages must be acquired first
        pool.record_tokens(ids[0], None, [1, 2])
    with pytest.raises(PageNotReady, match="#1"):
        pool.acquire(hashes + page_hashes(chain(9, 1), PAGE_SIZE))
    assert pool.page_state(ids[0]) is PageState.CACHED  # the failed acquire took nothing
    with pytest.raises(ValueError):
        PagePool(0, 4)
    with pytest.raises(ValueError):
        PagePool(4, 0)


def test_check_catches_corruption():
    pool = PagePool(4, PAGE_SIZE)
    pool._pages[2].refcount = 1  # a "free" page with a reference
    with pytest.raises(InvariantViolation, match="refcount"):
        pool.check()
    pool = PagePool(4, PAGE_SIZE)
    ids, hashes = run_job(pool, chain(0, 1))
    pool.release(ids)
    del pool._ready[hashes[0]]
    with pytest.raises(InvariantViolation, match="ready-hash index"):
        pool.check()
    pool = PagePool(4, PAGE_SIZE)
    ids, hashes = run_job(pool, chain(0, 2))
    pool.release(ids)
    pool._eviction.put(ids[0], 0, 0)  # a parent queued although its child is cached
    with pytest.raises(InvariantViolation, match="eviction queue"):
        pool.check()
