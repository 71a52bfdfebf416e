"""The replica side of prefix routing and a router's index of it, checked against oracles.

- folio.cache.PagePool's events carry each page's depth (its index in its sequence).
- folio.router.events.CacheEvents, fed a real pool's events at random points: its batches, replayed in order, give
  exactly the routing keys of the pool's ready pages. The oracle is computed from the hashes this test registered:
  the keys (folio.router.keys.page_key) of the READY pages whose depth carries a routing key (in the first dense_tokens
  every dense_key_tokens-th page, and every stride-th page).
- folio.router.index.PrefixIndex: exact while fewer than `history` reports in a row are lost; after a longer loss a
  gap, and exact again at the next snapshot; a restarted replica is forgotten; stale reports are ignored; routers fed
  the same reports agree; match() against brute force.
- folio.router.digest: JSON round trip, malformed reports.

Randomness is seeded, nothing depends on time (the index gets an injected clock).
"""

from __future__ import annotations

import json
import math
import random
import types
from collections import Counter

import pytest
from fakes import FakePool

from folio.cache import OutOfPages, PageEvent, PageEventKind, PagePool
from folio.hashing import page_hashes
from folio.router.digest import (
    DIGEST_VERSION,
    SAMPLES_UNKNOWN,
    DigestError,
    ReplicaDigest,
    build_digest,
    parse_digest,
)
from folio.router.events import CacheEvents, pack
from folio.router.index import Match, PrefixIndex
from folio.router.keys import page_key
from folio.router.policy import Mode, PolicyConfig, PrefixRouterPolicy
from folio.router.rates import ReplicaRates

PAGE_SIZE = 4
# Keys in the dense region every page unless a test says otherwise (the default, 64 tokens, is 16 of these pages;
# GEOMETRIES and test_dense_keys_every_few_pages_* cover a spacing of several pages).
DENSE_KEY_TOKENS = PAGE_SIZE
STORED, EVICTED = PageEventKind.STORED, PageEventKind.EVICTED
DEFAULTS_PREFILL = PolicyConfig().default_prefill_tokens_per_s
# (block_tokens, dense_tokens, dense_key_tokens) over pages of 4 tokens. Every page in the dense region: strides 4, 2,
# 1, 1 (a block shorter than a page) and 3, with 0, 2 and 1 dense leading pages. Then a dense key every 2 pages in
# 4 dense pages before a stride of 4 (keys at 1, 3, 7, 11), every 3 pages in 6 before a stride of 8 (2, 5, 7), and
# every 3 pages in 5 under a stride of 2 (the dense spacing is wider than the blocks': 1, 2, 3, 5, 7, ...).
GEOMETRIES = [(16, 0, DENSE_KEY_TOKENS), (8, 8, DENSE_KEY_TOKENS), (4, 0, DENSE_KEY_TOKENS), (2, 0, DENSE_KEY_TOKENS),
              (12, 4, DENSE_KEY_TOKENS), (16, 16, 2 * PAGE_SIZE), (32, 24, 3 * PAGE_SIZE), (8, 20, 3 * PAGE_SIZE)]



# Every test here runs over both held-key stores (folio.router.held_keys): the native one and its Python twin.
pytestmark = pytest.mark.usefixtures("held_keys_implementation")

def is_key_depth(depth: int, block_tokens: int, dense_tokens: int, dense_key_tokens: int = DENSE_KEY_TOKENS) -> bool:
    """The oracle's rule, written out here: in the first dense_tokens, every dense_key_tokens-th page (the page ending
    at a multiple of dense_key_tokens, rounded down to whole pages, at least every page); everywhere, every stride-th
    page (ending at a multiple of block_tokens); no page of unknown depth (-1)."""
    if depth < 0:
        return False
    stride = max(1, block_tokens // PAGE_SIZE)
    dense_stride = max(1, dense_key_tokens // PAGE_SIZE)
    in_dense_region = depth < dense_tokens // PAGE_SIZE
    return depth % stride == stride - 1 or (in_dense_region and depth % dense_stride == dense_stride - 1)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class PoolDriver:
    """A real PagePool used the way the engine uses it: a job looks up and acquires its prompt's cached prefix,
    allocates the rest (which evicts cached pages), registers its full pages in order (set_ready with the parent's
    hash), runs a while and releases. Prompts branch off a few shared stems at random points, so pages are shared,
    revived and evicted at every depth; now and then the idle pool is reset."""

    def __init__(self, rng: random.Random, *, num_pages: int = 40, num_stems: int = 4, max_pages: int = 14) -> None:
        self.rng = rng
        self.pool = PagePool(num_pages, PAGE_SIZE)
        self.stems = [[rng.randrange(1000) for _ in range(max_pages * PAGE_SIZE)] for _ in range(num_stems)]
        self.max_pages = max_pages
        self.depth_of: dict[bytes, int] = {}  # every hash registered -> its page's index in its sequence
        self.running: list[list[int]] = []
        self.num_events = Counter()

    def prompt(self) -> list[int]:
        rng = self.rng
        stem = rng.choice(self.stems)
        tokens = stem[:rng.randrange(len(stem) + 1)] + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
        return tokens[:self.max_pages * PAGE_SIZE]

    def start_job(self) -> None:
        tokens = self.prompt()
        hashes = page_hashes(tokens, PAGE_SIZE)
        found = self.pool.lookup(hashes).num_ready
        acquired = self.pool.acquire(hashes[:found])
        try:
            page_ids = acquired + self.pool.allocate(-(-len(tokens) // PAGE_SIZE) - found)
        except OutOfPages:
            self.pool.release(acquired)
            return
        for idx in range(found, len(hashes)):
            assert self.pool.set_ready(page_ids[idx], hashes[idx], hashes[idx - 1] if idx else None,
                                       tokens[idx * PAGE_SIZE:(idx + 1) * PAGE_SIZE])
            self.depth_of[hashes[idx]] = idx
        self.running.append(page_ids)

    def finish_job(self) -> None:
        self.pool.release(self.running.pop(self.rng.randrange(len(self.running))))

    def step(self) -> None:
        rng = self.rng
        if not self.running and rng.random() < 0.03:
            self.pool.reset()
        elif self.running and (len(self.running) >= 4 or rng.random() < 0.45):
            self.finish_job()
        else:
            self.start_job()

    def drain(self) -> list[PageEvent]:
        """The pool's events since the last drain; checks each carries its page's depth."""
        events = self.pool.drain_events()
        for event in events:
            assert event.depth == self.depth_of[event.hash], event
            self.num_events[event.kind] += 1
        return events

    def oracle(self, block_tokens: int, dense_tokens: int, dense_key_tokens: int = DENSE_KEY_TOKENS) -> set[int]:
        return {page_key(h) for h in self.pool.cached_hashes()
                if is_key_depth(self.depth_of[h], block_tokens, dense_tokens, dense_key_tokens)}

    def keys_ever(self, block_tokens: int, dense_tokens: int, at_key_depth: bool) -> set[int]:
        return {page_key(h) for h, d in self.depth_of.items()
                if is_key_depth(d, block_tokens, dense_tokens) == at_key_depth}

    def expected_match(self, tokens: list[int], block_tokens: int, dense_tokens: int,
                       dense_key_tokens: int = DENSE_KEY_TOKENS) -> tuple[list[int], int]:
        """A prompt's routing keys and how many leading ones the pool holds (the leading pages its own lookup finds:
        without tier-1 evictions in this driver, the ready pages are closed under taking parents)."""
        hashes = page_hashes(tokens, PAGE_SIZE)
        depths = [d for d in range(len(hashes)) if is_key_depth(d, block_tokens, dense_tokens, dense_key_tokens)]
        num_ready = self.pool.lookup(hashes).num_ready
        return [page_key(hashes[d]) for d in depths], sum(1 for d in depths if d < num_ready)


def report(driver: PoolDriver, events: CacheEvents, epoch: int, instance_id: str = "a") -> dict:
    """A report as a router receives it (through JSON)."""
    stats = build_digest(driver.pool, events, len(driver.running), 0, epoch, instance_id=instance_id)
    return json.loads(json.dumps(stats))


def replica_reports(seed: int, num_reports: int, *, history: int, snapshot_every: int, block_tokens: int = 8,
                    dense_tokens: int = 0, instance_id: str = "a") -> list[tuple[dict, set[int]]]:
    """A replica's reports, each with the oracle's keys at that report (every event added before it)."""
    rng = random.Random(seed)
    driver = PoolDriver(rng)
    events = CacheEvents(PAGE_SIZE, block_tokens, dense_tokens=dense_tokens, history=history,
                         snapshot_every=snapshot_every, dense_key_tokens=DENSE_KEY_TOKENS)
    reports = []
    for epoch in range(1, num_reports + 1):
        for _ in range(rng.randrange(1, 4)):
            driver.step()
        events.add(driver.drain())
        reports.append((report(driver, events, epoch, instance_id), driver.oracle(block_tokens, dense_tokens)))
    return reports


# ---- the pool's event depths ------------------------------------------------------------------------------------


def fill(pool: PagePool, tokens: list[int], num_cached: int = 0) -> list[int]:
    """A job: acquire the first num_cached pages, allocate and register the rest in order. Returns its page ids."""
    hashes = page_hashes(tokens, PAGE_SIZE)
    page_ids = pool.acquire(hashes[:num_cached]) + pool.allocate(len(hashes) - num_cached)
    for idx in range(num_cached, len(hashes)):
        assert pool.set_ready(page_ids[idx], hashes[idx], hashes[idx - 1] if idx else None,
                              tokens[idx * PAGE_SIZE:(idx + 1) * PAGE_SIZE])
    return page_ids


def described(events: list[PageEvent]) -> list[tuple[PageEventKind, bytes, int]]:
    return [(e.kind, e.hash, e.depth) for e in events]


def test_pool_events_carry_each_pages_depth_in_its_sequence():
    pool = PagePool(6, PAGE_SIZE)
    tokens = list(range(4 * PAGE_SIZE))
    hashes = page_hashes(tokens, PAGE_SIZE)
    first = fill(pool, tokens)
    assert described(pool.drain_events()) == [(STORED, h, d) for d, h in enumerate(hashes)]
    # A second sequence shares the first two pages: its own pages continue from depth 2.
    branch = tokens[:2 * PAGE_SIZE] + [900 + i for i in range(2 * PAGE_SIZE)]
    branch_hashes = page_hashes(branch, PAGE_SIZE)
    second = fill(pool, branch, num_cached=2)
    assert described(pool.drain_events()) == [(STORED, branch_hashes[2], 2), (STORED, branch_hashes[3], 3)]
    # Evicted pages report the depth they were stored with.
    pool.release(second)
    pool.release(first)
    pool.allocate(6)
    evicted = pool.drain_events()
    assert {e.kind for e in evicted} == {EVICTED}
    assert sorted((e.hash, e.depth) for e in evicted) == sorted(
        [(h, d) for d, h in enumerate(hashes)] + [(branch_hashes[2], 2), (branch_hashes[3], 3)])


def test_pool_reset_and_re_registered_pages_keep_their_depths():
    pool = PagePool(8, PAGE_SIZE)
    tokens = list(range(3 * PAGE_SIZE))
    hashes = page_hashes(tokens, PAGE_SIZE)
    pool.release(fill(pool, tokens))
    pool.drain_events()
    pool.reset()
    assert sorted((e.kind, e.hash, e.depth) for e in pool.drain_events()) == sorted(
        (EVICTED, h, d) for d, h in enumerate(hashes))
    fill(pool, tokens)  # registered again after the reset: the same depths
    assert described(pool.drain_events()) == [(STORED, h, d) for d, h in enumerate(hashes)]


def test_a_page_whose_parent_is_not_ready_has_unknown_depth():
    """Documented: depth -1 when the parent was not ready as the page became ready (and so for its children)."""
    pool = PagePool(4, PAGE_SIZE)
    tokens = list(range(3 * PAGE_SIZE))
    hashes = page_hashes(tokens, PAGE_SIZE)
    second, third = pool.allocate(2)
    assert pool.set_ready(second, hashes[1], hashes[0], tokens[PAGE_SIZE:2 * PAGE_SIZE])
    assert pool.set_ready(third, hashes[2], hashes[1], tokens[2 * PAGE_SIZE:])
    assert described(pool.drain_events()) == [(STORED, hashes[1], -1), (STORED, hashes[2], -1)]
    # CacheEvents never publishes a key of unknown depth.
    events = CacheEvents(PAGE_SIZE, PAGE_SIZE, dense_tokens=0, dense_key_tokens=DENSE_KEY_TOKENS)
    events.add([PageEvent(STORED, hashes[1], -1), PageEvent(STORED, hashes[2], -1)])
    assert events.num_held == 0


@pytest.mark.parametrize("seed", range(3))
def test_random_job_streams_log_every_pages_depth(seed):
    """PoolDriver.drain checks every event's depth against the index the page was registered at."""
    driver = PoolDriver(random.Random(seed))
    for _ in range(600):
        driver.step()
        driver.drain()
    assert driver.num_events[STORED] > 200 and driver.num_events[EVICTED] > 100
    assert max(driver.depth_of.values()) >= 10


# ---- CacheEvents against the oracle -----------------------------------------------------------------------------


@pytest.mark.parametrize("block_tokens, dense_tokens, dense_key_tokens", GEOMETRIES)
@pytest.mark.parametrize("seed", range(2))
def test_batches_replay_to_the_keys_of_the_pools_ready_pages(seed, block_tokens, dense_tokens, dense_key_tokens):
    """Events go into CacheEvents at random points and reports are built at random points. Every batch holds net
    changes only (a key stored and evicted within one batch cancels: it is in neither list), replaying the batches in
    order gives the oracle exactly, every snapshot equals the oracle at its seq, and a PrefixIndex fed every report
    holds the oracle's keys and matches prompts as the pool's own lookup does."""
    rng = random.Random(seed)
    history, snapshot_every = 3, 5
    driver = PoolDriver(rng)
    events = CacheEvents(PAGE_SIZE, block_tokens, dense_tokens=dense_tokens, history=history,
                         snapshot_every=snapshot_every, dense_key_tokens=dense_key_tokens)
    index = PrefixIndex(clock=Clock())
    replayed: set[int] = set()
    model: set[int] = set()  # the oracle as of the last events added
    touched: dict[int, set[PageEventKind]] = {}  # key-depth keys in this batch's raw events
    num_round_trips = num_snapshots = num_reports = num_matched = 0
    stepped = False  # steps since the last events were added
    for _ in range(500):
        driver.step()
        stepped = True
        if rng.random() < 0.4:
            stepped = False
            added = driver.drain()
            events.add(added)
            model = driver.oracle(block_tokens, dense_tokens, dense_key_tokens)
            assert events.num_held == len(model)
            for event in added:
                if is_key_depth(event.depth, block_tokens, dense_tokens, dense_key_tokens):
                    touched.setdefault(page_key(event.hash), set()).add(event.kind)
        if rng.random() < 0.25:
            num_reports += 1
            digest = parse_digest(report(driver, events, num_reports))
            assert (digest.block_tokens, digest.dense_tokens, digest.dense_key_tokens) == (
                block_tokens, dense_tokens, dense_key_tokens)
            assert digest.seq == num_reports
            assert [b.seq for b in digest.batches] == list(range(max(1, num_reports - history + 1), num_reports + 1))
            batch = digest.batches[-1]
            stored, evicted = set(batch.stored), set(batch.evicted)
            assert len(stored) == len(batch.stored) and len(evicted) == len(batch.evicted)
            assert stored.isdisjoint(replayed) and evicted <= replayed  # net changes only
            num_round_trips += sum(1 for key, kinds in touched.items()
                                   if kinds == {STORED, EVICTED} and (key in replayed) == (key in model))
            replayed = (replayed - evicted) | stored
            assert replayed == model
            touched = {}
            if digest.snapshot is not None:
                num_snapshots += 1
                assert digest.snapshot.seq == digest.seq
                assert len(set(digest.snapshot.keys)) == len(digest.snapshot.keys)
                assert set(digest.snapshot.keys) == model
            assert index.report("r", digest)
            assert index.is_synced("r") and index.held_keys("r") == model
            if not stepped:  # the pool is as the reported events left it: its own lookup is the oracle
                for _ in range(3):
                    keys, num_held = driver.expected_match(driver.prompt(), block_tokens, dense_tokens,
                                                           dense_key_tokens)
                    found = index.match(keys)
                    assert found == ({index.slot_of("r"): Match(num_held, num_held)} if num_held else {})
                    num_matched += num_held > 0
    assert num_snapshots == -(-num_reports // snapshot_every)  # the first report, then every snapshot_every-th
    assert num_round_trips > 0, "the stream should store and evict some key within one batch"
    assert num_matched > 5


def test_a_key_stored_and_evicted_within_one_batch_cancels():
    events = CacheEvents(PAGE_SIZE, PAGE_SIZE, dense_tokens=0,
                         dense_key_tokens=DENSE_KEY_TOKENS)  # every page carries a key
    hashes = page_hashes(list(range(3 * PAGE_SIZE)), PAGE_SIZE)
    keys = [page_key(h) for h in hashes]
    events.add([PageEvent(STORED, hashes[0], 0)])
    assert events.publish() == 1
    events.add([PageEvent(STORED, hashes[1], 1), PageEvent(EVICTED, hashes[1], 1),  # stored, then evicted
                PageEvent(EVICTED, hashes[0], 0), PageEvent(STORED, hashes[0], 0),  # evicted, then stored again
                PageEvent(STORED, hashes[2], 2)])
    digest = parse_digest(build_digest(FakePool(page_size=PAGE_SIZE), events, 0, 0, 1))
    assert [(b.seq, list(b.stored), list(b.evicted)) for b in digest.batches] == [(1, [keys[0]], []),
                                                                               (2, [keys[2]], [])]
    assert sorted(digest.snapshot.keys) == sorted([keys[0], keys[2]])
    # An eviction of a key never stored (its store predates the log) publishes nothing.
    events.add([PageEvent(EVICTED, hashes[1], 1)])
    assert events.publish() == 3 and events.num_held == 2
    assert [(b.seq, list(b.stored), list(b.evicted))
            for b in parse_digest(build_digest(FakePool(page_size=PAGE_SIZE), events, 0, 0, 2)).batches][-2:] == [
        (3, [], []), (4, [], [])]


def test_a_reader_past_some_batches_decodes_only_the_newer_ones_and_still_refuses_a_malformed_one():
    events = CacheEvents(PAGE_SIZE, PAGE_SIZE, dense_tokens=0, dense_key_tokens=DENSE_KEY_TOKENS)
    hashes = page_hashes(list(range(3 * PAGE_SIZE)), PAGE_SIZE)
    for page, page_hash in enumerate(hashes):
        events.add([PageEvent(STORED, page_hash, page)])
        if page < 2:
            events.publish()  # (build_digest publishes the last batch itself)
    stats = build_digest(FakePool(page_size=PAGE_SIZE), events, 0, 0, 1)
    assert [b.seq for b in parse_digest(stats).batches] == [1, 2, 3]
    assert [(b.seq, list(b.stored)) for b in parse_digest(stats, applied_seq=2).batches] == [
        (3, [page_key(hashes[2])])]
    assert parse_digest(stats, applied_seq=3).batches == ()
    broken = {**stats, "batches": [*stats["batches"][:-1], [3, "not base64!", ""]]}
    with pytest.raises(DigestError, match="base64"):
        parse_digest(broken, applied_seq=2)
    garbled = {**stats, "batches": [*stats["batches"][:-1], "junk"]}
    with pytest.raises(DigestError, match="a batch is"):
        parse_digest(garbled, applied_seq=2)


@pytest.mark.parametrize("block_tokens, dense_tokens, dense_key_tokens, key_depths", [
    # A key every 3 pages in the first 6 (pages 2, 5), then every 8 pages (7, 15).
    (32, 24, 3 * PAGE_SIZE, [2, 5, 7, 15]),
    # A key every 2 pages in the first 5 (1, 3: page 4 is in the dense region but ends at no multiple of 8 tokens),
    # then every 4 pages (3, 7, 11, ...).
    (16, 20, 2 * PAGE_SIZE, [1, 3, 7, 11, 15, 19]),
])
def test_dense_keys_every_few_pages_are_published_and_matched_at_the_same_depths(block_tokens, dense_tokens,
                                                                               dense_key_tokens, key_depths):
    """dense_key_tokens of several pages: the keys a replica publishes are those of the pages at the depths written
    out here (stored, evicted, and in the snapshot), the oracle's rule agrees, and a router fed the report (through
    JSON) takes the same geometry from it: its prompt keys are those pages' keys, and a prompt sharing a prefix with
    the replica's sequence is matched to the deepest of them it shares."""
    num_pages = 20
    tokens = list(range(num_pages * PAGE_SIZE))
    hashes = page_hashes(tokens, PAGE_SIZE)
    assert [d for d in range(num_pages) if is_key_depth(d, block_tokens, dense_tokens, dense_key_tokens)] == key_depths
    keys = [page_key(hashes[d]) for d in key_depths]
    events = CacheEvents(PAGE_SIZE, block_tokens, dense_tokens=dense_tokens, dense_key_tokens=dense_key_tokens,
                         history=2)
    events.add([PageEvent(STORED, h, d) for d, h in enumerate(hashes)])
    assert events.num_held == len(key_depths)
    stats = json.loads(json.dumps(build_digest(FakePool(page_size=PAGE_SIZE), events, 0, 0, 1, instance_id="a")))
    digest = parse_digest(stats)
    assert (digest.block_tokens, digest.dense_tokens, digest.dense_key_tokens) == (
        block_tokens, dense_tokens, dense_key_tokens)
    assert [(b.seq, list(b.stored), list(b.evicted)) for b in digest.batches] == [(1, keys, [])]
    assert sorted(digest.snapshot.keys) == sorted(keys)
    # The router side.
    policy = PrefixRouterPolicy(PolicyConfig(default_page_size=PAGE_SIZE, shortlist_size=2, sampled=2))
    assert policy.report("r", stats)
    assert policy.geometry().as_tuple() == (PAGE_SIZE, block_tokens, dense_tokens, dense_key_tokens)
    assert policy.geometry().depths(num_pages) == key_depths
    assert policy.prompt_keys(tokens + [9999]) == keys
    for shared_pages in range(1, num_pages + 1):
        other = tokens[:shared_pages * PAGE_SIZE] + [5000 + i for i in range(3 * PAGE_SIZE)]
        deepest = max((d for d in key_depths if d < shared_pages), default=-1)
        decision = policy.choose(["r", "idle"], other)
        assert decision.num_cached_tokens["r"] == (deepest + 1) * PAGE_SIZE, shared_pages
        assert decision.mode == (Mode.AFFINITY if deepest >= 0 else Mode.LOAD)
    # Evicted (leaves first): the same keys, withdrawn; nothing else is published.
    events.add([PageEvent(EVICTED, h, d) for d, h in reversed(list(enumerate(hashes)))])
    assert events.num_held == 0
    digest = parse_digest(build_digest(FakePool(page_size=PAGE_SIZE), events, 0, 0, 2, instance_id="a"))
    assert (digest.batches[-1].seq, list(digest.batches[-1].stored), sorted(digest.batches[-1].evicted)) == (
        2, [], sorted(keys))


# ---- PrefixIndex: lost reports, resync, restart, stale reports, several routers --------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_lost_reports_keep_the_index_exact_until_a_gap_then_a_snapshot_restores_it(seed):
    """The router sees some reports. Losing at most history-1 in a row loses no batch: the index stays synced and
    exact. A longer loss is a gap (counted, not synced, keys kept as they are); the next report with a snapshot makes
    it exact again (counted as a resync)."""
    history, snapshot_every = 4, 7
    reports = replica_reports(seed, 260, history=history, snapshot_every=snapshot_every)
    rng = random.Random(1000 + seed)
    index = PrefixIndex(clock=Clock())
    synced, last_seq, gaps, resyncs = False, 0, 0, 0
    losses = Counter()
    num_inexact = 0
    position = 0
    while position < len(reports):
        stats, oracle = reports[position]
        seq = position + 1
        digest = parse_digest(stats)
        lost = seq - last_seq - 1
        losses["short" if lost < history else "long"] += bool(lost)
        contiguous = lost <= history - 1
        if digest.snapshot is not None and (not synced or not contiguous):
            synced, resyncs = True, resyncs + 1
        elif not contiguous:
            gaps += synced
            synced = False
        assert index.report("r", digest)
        assert index.is_synced("r") == synced
        assert (index.stats.num_gaps, index.stats.num_resyncs) == (gaps, resyncs)
        if synced:
            assert index.held_keys("r") == oracle
        else:
            num_inexact += index.held_keys("r") != oracle
        last_seq = seq
        position += 1 + rng.choice([0, 0, 0, 0, 1, 2, history - 1, history - 1, history, history + 2,
                                    2 * history + snapshot_every])
    assert losses["short"] >= 5 and losses["long"] >= 3 and gaps >= 2 and resyncs >= 3
    assert num_inexact > 0, "some gap should leave the index inexact until its snapshot"


def numbers_of(digest: ReplicaDigest | None) -> list | None:
    """A digest's fields but its decoded batches and snapshot, with their types (a bool is not a count), and its
    numbers as folio.router.cost reads them (packed by the native index as it reads a report, else by the digest)."""
    if digest is None:
        return None
    return [(name, getattr(digest, name), type(getattr(digest, name))) for name in ReplicaDigest.__slots__
            if name not in ("batches", "snapshot", "packed_numbers")] + [digest.numbers()]


@pytest.mark.parametrize("seed", range(3))
def test_the_native_decode_of_reports_applies_what_the_full_decode_does(seed, held_keys_implementation):
    """PrefixRouterPolicy.report with the native index reads a report and applies its batches in one call
    (KeyIndex.apply_report); fed the same lossy stream, with some batches corrupted and routed prompts between
    reports, it must hold the keys, sync state, counts, routed records and digests of an index fed fully decoded
    digests (the Python twin), and refuse the same reports. With the Python twin the policy decodes every report in
    full: the same holds."""
    from folio.router.held_keys import PyHeldKeys

    native = held_keys_implementation == "native"
    history = 4
    reports = replica_reports(seed, 200, history=history, snapshot_every=9)
    rng = random.Random(2000 + seed)
    clock = Clock()
    policy = PrefixRouterPolicy(PolicyConfig(default_page_size=PAGE_SIZE), clock=clock)
    assert policy.index.reads_reports == native
    native_applied = []
    applied = policy.index._applied
    policy.index._applied = lambda state, read: native_applied.append(applied(state, read)) or native_applied[-1]
    reference = PrefixIndex(clock=clock, held=PyHeldKeys())
    position, num_corrupted = 0, 0
    while position < len(reports):
        stats = json.loads(json.dumps(reports[position][0]))
        if stats["batches"] and rng.random() < 0.1:  # a malformed newest batch: the whole report is refused
            stats["batches"][-1][rng.choice([1, 2])] = rng.choice(["not base64!", "AAAA", 7, ""])
            stats["batches"][-1][1:3] = [v if v != "" else "AA==" for v in stats["batches"][-1][1:3]]
            num_corrupted += 1
        try:
            expected = reference.report("r", parse_digest(stats, reference.applied_seq("r", "a")))
        except DigestError:
            expected = False
        assert policy.report("r", stats) == expected
        assert policy.index.held_keys("r") == reference.held_keys("r")
        assert policy.index.is_synced("r") == reference.is_synced("r")
        assert policy.index.applied_seq("r", "a") == reference.applied_seq("r", "a")
        assert policy.index.stats == reference.stats
        assert numbers_of(policy.index.digest("r")) == numbers_of(reference.digest("r"))
        keys = [rng.getrandbits(64) for _ in range(3)] + rng.sample(sorted(reference.held_keys("r")) or [0], 1)
        policy.index.record_routed("r", keys)
        reference.record_routed("r", keys)
        assert policy.index.match(keys) == reference.match(keys)
        position += 1 + rng.choice([0, 0, 0, 1, history - 1, history, history + 3])
    assert policy.num_rejected_reports == num_corrupted >= 3
    # (the others came after a gap, when only a snapshot resyncs, or carried one, or were corrupted)
    if native:
        assert len(native_applied) >= 15, "the native path should have applied the in-sync reports"
    else:
        assert not native_applied


def test_stale_and_repeated_reports_are_ignored():
    reports = replica_reports(3, 8, history=4, snapshot_every=3)
    index = PrefixIndex(clock=Clock())
    digests = [parse_digest(stats) for stats, _ in reports]
    assert index.report("r", digests[0]) and index.report("r", digests[4])
    assert index.held_keys("r") == reports[4][1]
    assert not index.report("r", digests[2])  # an older epoch arriving late
    assert not index.report("r", digests[4])  # the same report again
    assert index.held_keys("r") == reports[4][1] and index.digest("r") is digests[4]
    assert index.report("r", digests[5]) and index.held_keys("r") == reports[5][1] and index.is_synced("r")
    # The policy skips them before decoding (a mapping with the same instance and an old epoch).
    policy = PrefixRouterPolicy(PolicyConfig(default_page_size=PAGE_SIZE))
    assert policy.report("r", reports[4][0]) and not policy.report("r", reports[2][0])
    assert not policy.report("r", reports[4][0]) and policy.num_rejected_reports == 0


@pytest.mark.parametrize("see_first_report", [True, False])
def test_a_restarted_replica_is_forgotten(see_first_report):
    """A new instance_id: what the old instance held is dropped from the index, whatever the new epochs."""
    old = replica_reports(4, 12, history=4, snapshot_every=50, instance_id="old")
    new = replica_reports(5, 3, history=4, snapshot_every=50, instance_id="new")
    index = PrefixIndex(clock=Clock())
    for stats, _ in old:
        index.report("r", parse_digest(stats))
    old_keys = old[-1][1]
    assert index.held_keys("r") == old_keys and len(old_keys) > 5
    shown = new if see_first_report else new[1:]  # the new instance's first report (with its snapshot) lost
    for stats, oracle in shown[:2]:
        assert index.report("r", parse_digest(stats))  # epochs 1, 2 < the old instance's 12
        assert index.held_keys("r") == oracle
    for key in old_keys - shown[1][1]:
        assert index.match([key]) == {}


def test_resync_after_lost_events_makes_routers_rebuild():
    """The engine lost events (its buffer overflowed) and calls resync with every ready page: the next report skips
    a sequence number and carries a snapshot of those pages' keys. A router that sees it rebuilds at once; one that
    misses it sees a gap and rebuilds at the next snapshot. From then on both hold exactly the oracle's keys, plus
    keys of pages between key depths that the resync listed (documented as harmless: no prompt looks them up)."""
    block_tokens, dense_tokens = 8, 0
    rng = random.Random(7)
    driver = PoolDriver(rng)
    events = CacheEvents(PAGE_SIZE, block_tokens, dense_tokens=dense_tokens, history=4, snapshot_every=5,
                         dense_key_tokens=DENSE_KEY_TOKENS)
    seeing, missing = PrefixIndex(clock=Clock()), PrefixIndex(clock=Clock())
    epoch = 0
    for _ in range(12):
        driver.step()
        events.add(driver.drain())
        epoch += 1
        digest = parse_digest(report(driver, events, epoch))
        for index in (seeing, missing):
            index.report("r", digest)
    assert seeing.held_keys("r") == driver.oracle(block_tokens, dense_tokens)
    for _ in range(10):  # the events of these steps never reach CacheEvents
        driver.step()
        driver.drain()
    events.resync(driver.pool.cached_hashes())
    epoch += 1
    digest = parse_digest(report(driver, events, epoch))
    assert digest.seq == seeing.digest("r").seq + 2 and [b.seq for b in digest.batches] == [digest.seq]
    assert digest.snapshot is not None and digest.snapshot.seq == digest.seq
    resyncs = seeing.stats.num_resyncs
    assert seeing.report("r", digest)
    assert seeing.stats.num_resyncs == resyncs + 1 and seeing.is_synced("r")
    assert seeing.held_keys("r") == {page_key(h) for h in driver.pool.cached_hashes()}
    key_keys = driver.keys_ever(block_tokens, dense_tokens, at_key_depth=True)
    caught_up = False
    for step in range(30):
        for _ in range(rng.randrange(1, 4)):
            driver.step()
        events.add(driver.drain())
        epoch += 1
        digest = parse_digest(report(driver, events, epoch))
        seeing.report("r", digest)
        gaps = missing.stats.num_gaps
        missing.report("r", digest)
        if step == 0:
            assert digest.snapshot is None and missing.stats.num_gaps == gaps + 1
        caught_up = caught_up or digest.snapshot is not None
        assert missing.is_synced("r") == caught_up
        oracle = driver.oracle(block_tokens, dense_tokens)
        key_keys |= driver.keys_ever(block_tokens, dense_tokens, at_key_depth=True)
        between = driver.keys_ever(block_tokens, dense_tokens, at_key_depth=False)
        for index in (seeing, missing) if caught_up else (seeing,):
            held = index.held_keys("r")
            assert index.is_synced("r")
            assert held & key_keys == oracle and held - oracle <= between
        for _ in range(3):
            keys, num_held = driver.expected_match(driver.prompt(), block_tokens, dense_tokens)
            found = seeing.match(keys).get(seeing.slot_of("r"))
            assert (found.num_reported_blocks if found else 0) == num_held
    assert caught_up and missing.held_keys("r") == seeing.held_keys("r")


def test_a_key_published_by_resync_is_withdrawn_when_its_page_is_evicted():
    pool = PagePool(8, PAGE_SIZE)
    events = CacheEvents(PAGE_SIZE, PAGE_SIZE, dense_tokens=0,
                         dense_key_tokens=DENSE_KEY_TOKENS)  # every page of known depth carries a key
    tokens = list(range(2 * PAGE_SIZE))
    hashes = page_hashes(tokens, PAGE_SIZE)
    # Two jobs compute the same first page; the engine's cache manager keeps the loser's anonymous page (it does not
    # swap it for the winner's), so the loser's second page names a parent that only a cached page holds.
    [winner] = pool.allocate(1)
    loser = pool.allocate(2)
    assert pool.set_ready(winner, hashes[0], None, tokens[:PAGE_SIZE])
    pool.release([winner])
    assert not pool.set_ready(loser[0], hashes[0], None, tokens[:PAGE_SIZE])
    others = pool.allocate(pool.num_free + 1)  # evicts the winner's cached page
    assert pool.set_ready(loser[1], hashes[1], hashes[0], tokens[PAGE_SIZE:])  # parent gone: depth -1
    events.add(pool.drain_events())
    events.resync(pool.cached_hashes())  # events were lost meanwhile
    index = PrefixIndex(clock=Clock())
    index.report("r", parse_digest(build_digest(pool, events, 1, 0, 1)))
    pool.release(loser + others)
    pool.allocate(pool.num_pages)  # evicts everything
    events.add(pool.drain_events())
    index.report("r", parse_digest(build_digest(pool, events, 0, 0, 2)))
    assert list(pool.cached_hashes()) == []
    # The eviction of the depth -1 page withdraws the key the resync published (else: Match(2, 2) for a replica
    # holding nothing).
    assert index.match([page_key(h) for h in hashes]) == {}


def test_a_router_that_applied_every_batch_since_the_instance_began_is_synced():
    """No snapshot needed when the first batch a router applies is the instance's first (seq 1); one that joins
    after batch 1 left the history waits for a snapshot."""
    reports = replica_reports(6, 3, history=4, snapshot_every=50)
    digest = parse_digest(reports[1][0])
    assert digest.snapshot is None and [b.seq for b in digest.batches] == [1, 2]
    index = PrefixIndex(clock=Clock())
    assert index.report("r", digest)  # batches 1 and 2; the first report (with the snapshot) was lost
    assert index.held_keys("r") == reports[1][1]  # exact
    assert index.is_synced("r")
    assert index.report("r", parse_digest(reports[2][0])) and index.is_synced("r")
    assert index.held_keys("r") == reports[2][1]
    late = replica_reports(6, 3, history=2, snapshot_every=50)  # the same replica, a shorter history
    digest = parse_digest(late[2][0])
    assert digest.snapshot is None and [b.seq for b in digest.batches] == [2, 3]
    index = PrefixIndex(clock=Clock())
    assert index.report("r", digest)
    assert not index.is_synced("r")


def test_routers_fed_the_same_reports_hold_the_same_keys():
    """Several ingress routers: each sees the replicas in its own order (other slots), routes other prompts, and one
    loses reports (never history of them in a row); per replica they hold the same keys, the oracle's, and match
    every prompt to the same replicas by reported keys."""
    history = 4
    streams = {f"r{i}": replica_reports(20 + i, 60, history=history, snapshot_every=9) for i in range(3)}
    rng = random.Random(8)
    routers = [PrefixIndex(clock=Clock()) for _ in range(3)]
    for router, order in zip(routers, (["r0", "r1", "r2"], ["r2", "r0", "r1"], ["r1", "r2", "r0"])):
        for replica_id in order:
            router.slot_of(replica_id)
    assert routers[0].slot_of("r0") != routers[1].slot_of("r0")
    lost_in_row = Counter()
    for position in range(60):
        for number, router in enumerate(routers):
            for replica_id in rng.sample(sorted(streams), 3):
                stats, oracle = streams[replica_id][position]
                if number == 2:  # this router loses reports, never `history` in a row (nor the first or last)
                    if 0 < position < 59 and lost_in_row[replica_id] < history - 1 and rng.random() < 0.5:
                        lost_in_row[replica_id] += 1
                        continue
                    lost_in_row[replica_id] = 0
                assert router.report(replica_id, parse_digest(stats))
                router.record_routed(replica_id, [rng.getrandbits(64) for _ in range(3)])
                assert router.held_keys(replica_id) == oracle and router.is_synced(replica_id)
    for replica_id in streams:
        assert len({router.held_keys(replica_id) for router in routers}) == 1
    prompts = [sorted(stream[-1][1])[:k] for stream in streams.values() for k in (1, 3, 8)]
    for keys in prompts:
        views = [{router.replica_at(slot): m.num_reported_blocks for slot, m in router.match(keys).items()
                  if m.num_reported_blocks} for router in routers]
        assert views[0] == views[1] == views[2]


# ---- match() against brute force --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_match_finds_each_replicas_deepest_leading_key(seed):
    """Per replica: the deepest leading key of the prompt it holds (reported) or was routed (not confirmed by a
    stored event yet), and the deepest it holds; a replica holding a deep key without its ancestors counts to that
    key (documented: a key names its whole prefix)."""
    rng = random.Random(seed)
    # Prompts as chains of page hashes branching off each other.
    chains: list[list[bytes]] = [[rng.randbytes(16) for _ in range(10)]]
    for _ in range(5):
        base = rng.choice(chains)
        chains.append(base[:rng.randrange(len(base) + 1)] + [rng.randbytes(16) for _ in range(rng.randrange(1, 8))])
    every_hash = sorted({h for chain in chains for h in chain})
    by_key = {page_key(h): h for h in every_hash}
    clock = Clock()
    index = PrefixIndex(clock=clock, routed_ttl_s=100.0)
    replicas = [f"r{i}" for i in range(12)]
    events = {r: CacheEvents(PAGE_SIZE, PAGE_SIZE, dense_tokens=0, history=4,
                             dense_key_tokens=DENSE_KEY_TOKENS) for r in replicas}
    held: dict[str, set[int]] = {}
    routed: dict[str, set[int]] = {r: set() for r in replicas}
    num_orphans = 0
    for epoch in (1, 2, 3):
        for replica_id in replicas:
            before = held.get(replica_id, set())
            if epoch == 1:
                now = {page_key(h) for h in rng.sample(every_hash, rng.randrange(len(every_hash) // 2))}
            else:  # evict some, store some
                now = {k for k in before if rng.random() < 0.7} | {
                    page_key(h) for h in rng.sample(every_hash, rng.randrange(4))}
            events[replica_id].add([PageEvent(EVICTED, by_key[k], 0) for k in sorted(before - now)]
                                   + [PageEvent(STORED, by_key[k], 0) for k in sorted(now - before)])
            index.report(replica_id, parse_digest(build_digest(FakePool(page_size=PAGE_SIZE), events[replica_id],
                                                               0, 0, epoch)))
            routed[replica_id] -= now - before  # a stored event confirms a routed key
            held[replica_id] = now
        for replica_id in rng.sample(replicas, 4):  # this router sends prompts there
            chain = rng.choice(chains)
            keys = [page_key(h) for h in chain[:rng.randrange(1, len(chain) + 1)]]
            index.record_routed(replica_id, keys)
            routed[replica_id] |= set(keys) - held[replica_id]
        for chain in chains:
            for length in range(1, len(chain) + 1):
                keys = [page_key(h) for h in chain[:length]]
                expected = {}
                for replica_id in replicas:
                    deepest = max((d + 1 for d, k in enumerate(keys) if k in held[replica_id] | routed[replica_id]),
                                  default=0)
                    reported = max((d + 1 for d, k in enumerate(keys) if k in held[replica_id]), default=0)
                    if deepest:
                        expected[index.slot_of(replica_id)] = Match(deepest, reported)
                    num_orphans += reported > 0 and keys[0] not in held[replica_id]
                assert index.match(keys) == expected
    assert num_orphans > 0, "some replica should hold a deep key without its ancestors"


def test_routed_keys_are_confirmed_by_stored_events_and_bounded():
    clock = Clock()
    index = PrefixIndex(clock=clock, routed_ttl_s=10.0, max_routed_keys=5)
    keys = list(range(1, 9))
    index.record_routed("r", keys)  # the 3 oldest drop out of the bounded record
    slot = index.slot_of("r")
    assert index.match(keys[:3]) == {} and index.match(keys) == {slot: Match(8, 0)}
    assert index.match(keys[:4]) == {slot: Match(4, 0)}
    # A stored event confirms a routed key: an eviction then withdraws it at once, well within the TTL.
    events = CacheEvents(PAGE_SIZE, PAGE_SIZE, dense_tokens=0, dense_key_tokens=DENSE_KEY_TOKENS)
    index.report("r", parse_digest(build_digest(FakePool(page_size=PAGE_SIZE), events, 0, 0, 1)))  # (snapshot)
    page = random.Random(0).randbytes(16)
    index.record_routed("r", [page_key(page)])
    assert index.match([page_key(page)]) == {slot: Match(1, 0)}
    events.add([PageEvent(STORED, page, 0)])
    index.report("r", parse_digest(build_digest(FakePool(page_size=PAGE_SIZE), events, 0, 0, 2)))
    assert index.match([page_key(page)]) == {slot: Match(1, 1)}
    events.add([PageEvent(EVICTED, page, 0)])
    index.report("r", parse_digest(build_digest(FakePool(page_size=PAGE_SIZE), events, 0, 0, 3)))
    assert index.match([page_key(page)]) == {}
    # Unconfirmed keys last until the first report after their TTL.
    clock.now = 11.0
    assert index.match(keys) == {slot: Match(8, 0)}
    index.report("r", parse_digest(build_digest(FakePool(page_size=PAGE_SIZE), events, 0, 0, 4)))
    assert index.match(keys) == {}


def test_a_routed_key_confirmed_by_a_snapshot_is_withdrawn_with_its_page():
    index = PrefixIndex(clock=Clock(), routed_ttl_s=10.0)
    events = CacheEvents(PAGE_SIZE, PAGE_SIZE, dense_tokens=0, dense_key_tokens=DENSE_KEY_TOKENS)
    page = random.Random(1).randbytes(16)
    index.record_routed("r", [page_key(page)])
    events.add([PageEvent(STORED, page, 0)])
    index.report("r", parse_digest(build_digest(FakePool(page_size=PAGE_SIZE), events, 0, 0, 1)))  # a snapshot
    assert index.match([page_key(page)]) == {index.slot_of("r"): Match(1, 1)}
    events.add([PageEvent(EVICTED, page, 0)])
    index.report("r", parse_digest(build_digest(FakePool(page_size=PAGE_SIZE), events, 0, 0, 2)))
    assert index.match([page_key(page)]) == {}


# ---- the report format ------------------------------------------------------------------------------------------


def test_digest_round_trips_through_json():
    events = CacheEvents(PAGE_SIZE, 8, dense_tokens=4, history=2, dense_key_tokens=DENSE_KEY_TOKENS)
    hashes = page_hashes(list(range(6 * PAGE_SIZE)), PAGE_SIZE)
    events.add([PageEvent(STORED, h, d) for d, h in enumerate(hashes)])  # keys at depths 0, 1, 3, 5
    events.publish()
    events.add([PageEvent(EVICTED, hashes[5], 5)])
    pool = FakePool(page_size=PAGE_SIZE, num_pages=77)
    pool.num_free, pool.num_allocatable = 11, 40
    rates = ReplicaRates(prefill_tokens_per_s=1234.5, decode_step_s=0.025, mean_new_tokens=77.0, prefill_samples=3,
                         decode_samples=9, finished_samples=2)
    stats = build_digest(pool, events, running=3, queued=1, epoch=7, instance_id="x", max_running=8,
                         num_prefill_tokens=100, num_received=42, rates=rates)
    assert set(stats) == {"v", "instance_id", "epoch", "num_running", "num_queued", "max_running",
                          "num_prefill_tokens", "num_received", "page_size", "num_pages", "num_free_pages",
                          "num_allocatable_pages",
                          "prefill_tokens_per_s", "decode_step_s", "mean_new_tokens", "block_tokens", "dense_tokens",
                          "dense_key_tokens", "seq", "batches", "snapshot", "prefill_samples", "decode_samples",
                          "finished_samples"}
    digest = parse_digest(json.loads(json.dumps(stats)))
    assert (digest.prefill_samples, digest.decode_samples, digest.finished_samples) == (3, 9, 2)
    # A replica of the version before the sample counts: its rates are taken as fully measured.
    earlier = {name: value for name, value in stats.items() if not name.endswith("_samples")}
    assert parse_digest(earlier).prefill_samples == parse_digest(earlier).finished_samples == SAMPLES_UNKNOWN
    assert (digest.instance_id, digest.epoch, digest.num_running, digest.num_queued, digest.num_jobs,
            digest.max_running, digest.num_prefill_tokens, digest.num_received) == ("x", 7, 3, 1, 4, 8, 100, 42)
    assert (digest.page_size, digest.num_pages, digest.num_free_pages, digest.num_allocatable_pages) == (
        PAGE_SIZE, 77, 11, 40)
    assert (digest.prefill_tokens_per_s, digest.decode_step_s, digest.mean_new_tokens) == (1234.5, 0.025, 77.0)
    assert (digest.block_tokens, digest.dense_tokens, digest.dense_key_tokens, digest.seq) == (
        8, 4, DENSE_KEY_TOKENS, 2)
    keys = [page_key(hashes[d]) for d in (0, 1, 3, 5)]
    assert [(b.seq, list(b.stored), list(b.evicted)) for b in digest.batches] == [(1, keys, []), (2, [], [keys[3]])]
    assert digest.snapshot.seq == 2 and sorted(digest.snapshot.keys) == sorted(keys[:3])


def test_a_report_carries_the_caches_changes_not_the_cache():
    """A snapshot lists every held key; the reports between snapshots carry only the last batches."""
    num_pages = 4096
    events = CacheEvents(PAGE_SIZE, PAGE_SIZE, dense_tokens=0, history=8, snapshot_every=16,
                         dense_key_tokens=DENSE_KEY_TOKENS)
    hashes = page_hashes(list(range(num_pages * PAGE_SIZE)), PAGE_SIZE)
    events.add([PageEvent(STORED, h, d) for d, h in enumerate(hashes)])
    pool = FakePool(page_size=PAGE_SIZE, num_pages=num_pages)
    sizes = [len(json.dumps(build_digest(pool, events, 0, 0, epoch, instance_id="i" * 64))) for epoch in range(1, 18)]
    all_keys = num_pages * 8 * 4 // 3  # base64 of every key
    assert sizes[0] > 2 * all_keys  # the snapshot, and the first batch that stored every key
    assert all(all_keys < size < all_keys + 1000 for size in sizes[1:8])  # the first batch, while in the history
    assert max(sizes[8:16]) < 1000  # nothing changed since
    assert sizes[16] > all_keys  # the next snapshot


def valid_stats() -> dict:
    events = CacheEvents(PAGE_SIZE, PAGE_SIZE, dense_tokens=0, dense_key_tokens=DENSE_KEY_TOKENS)
    events.add([PageEvent(STORED, bytes(range(16)), 0)])
    events.publish()
    return build_digest(FakePool(page_size=PAGE_SIZE), events, 1, 0, epoch=3)  # seq 2


@pytest.mark.parametrize("change, message", [
    ({"v": 1}, "version"),
    ({"v": DIGEST_VERSION + 1}, "version"),
    ({"v": None}, "version"),
    ({"epoch": -1}, "epoch"),
    ({"num_running": -2}, "num_running"),
    ({"num_prefill_tokens": -5}, "num_prefill_tokens"),
    ({"prefill_tokens_per_s": -0.5}, "prefill_tokens_per_s"),
    ({"decode_step_s": float("nan")}, "decode_step_s"),
    ({"decode_step_s": math.inf}, "decode_step_s"),
    ({"prefill_tokens_per_s": math.inf}, "prefill_tokens_per_s"),
    ({"mean_new_tokens": 1e400}, "mean_new_tokens"),
    ({"num_queued": True}, "num_queued"),
    ({"mean_new_tokens": False}, "mean_new_tokens"),
    ({"prefill_samples": -1}, "prefill_samples"),
    ({"decode_samples": 2.0}, "decode_samples"),
    ({"finished_samples": True}, "finished_samples"),
    ({"num_running": "3"}, "num_running"),
    ({"epoch": 3.0}, "epoch"),
    ({"seq": None}, "seq"),
    ({"page_size": 0}, "page_size"),
    ({"block_tokens": 0}, "block_tokens"),
    ({"dense_key_tokens": 0}, "dense_key_tokens"),
    ({"dense_key_tokens": -4}, "dense_key_tokens"),
    ({"dense_key_tokens": True}, "dense_key_tokens"),
    ({"dense_key_tokens": 4.0}, "dense_key_tokens"),
    ({"dense_key_tokens": None}, "dense_key_tokens"),
    ({"instance_id": 5}, "instance_id"),
    ({"batches": "[]"}, "batches"),
    ({"batches": [[1, ""]]}, "batch"),
    ({"batches": [(1, "", "")]}, "batch"),
    ({"batches": [["1", "", ""]]}, "batch"),
    ({"batches": [[0, "", ""]]}, "batch"),
    ({"batches": [[1, "not base64!", ""]]}, "base64"),
    ({"batches": [[1, "", "AAAA"]]}, "multiple"),
    ({"batches": [[1, 5, ""]]}, "base64"),
    ({"batches": [[3, "", ""]]}, "newer"),
    ({"snapshot": {"seq": 9, "keys": ""}}, "newer"),
    ({"snapshot": {"seq": 0, "keys": ""}}, "snapshot"),
    ({"snapshot": {"keys": ""}}, "snapshot"),
    ({"snapshot": []}, "snapshot"),
    ({"snapshot": {"seq": 1, "keys": "@@@@"}}, "base64"),
])
def test_malformed_digests_are_rejected(change, message):
    stats = valid_stats()
    parse_digest(stats)  # valid as built
    stats = stats | change
    with pytest.raises(DigestError, match=message):
        parse_digest(stats)
    policy = PrefixRouterPolicy(PolicyConfig(default_page_size=PAGE_SIZE))
    assert not policy.report("r0", stats) and policy.num_rejected_reports == 1
    # As the next report of an instance in sync (what the native index reads in one call): refused alike, with
    # nothing changed. (Its batches at or before the applied seq are not read: those changes leave it valid.)
    if "batches" not in change and "epoch" not in change:
        index = PrefixIndex(clock=Clock())
        assert index.report_stats("r0", valid_stats()) and index.is_synced("r0")
        before = (numbers_of(index.digest("r0")), index.held_keys("r0"), index.applied_seq("r0", ""))
        with pytest.raises(DigestError, match=message):
            index.report_stats("r0", stats | {"epoch": 4})
        assert (numbers_of(index.digest("r0")), index.held_keys("r0"), index.applied_seq("r0", "")) == before


@pytest.mark.parametrize("samples", [True, False])
def test_the_common_report_reads_as_the_full_decode_reads_it(samples):
    """The next report of an instance in sync, as build_digest writes it, is read and applied in one call where the
    index is native (KeyIndex.apply_report, folio.router.digest COMMON_REPORT_FIELDS): the same numbers, of the same
    types, as the full decode, and the same keys held; a report of an earlier version (no sample counts) or a
    mapping that is not a dict takes the full decode to the same result."""
    first = json.loads(json.dumps(valid_stats()))  # holds the key of bytes(range(16)), a snapshot at seq 2
    stats = first | {"epoch": 4, "seq": 3, "snapshot": None,
                     "batches": first["batches"] + [[3, pack([5, 6]), first["batches"][0][1]]]}
    if not samples:
        for name in ("prefill_samples", "decode_samples", "finished_samples"):
            del stats[name]
    full = parse_digest(stats, applied_seq=2)
    for given in (stats, types.MappingProxyType(stats)):
        index = PrefixIndex(clock=Clock())
        assert index.report_stats("r", first) and index.is_synced("r")
        read = []
        applied = index._applied
        index._applied = lambda state, native_read: read.append(applied(state, native_read)) or read[-1]
        slot, digest = index.report_stats("r", given)
        assert numbers_of(digest) == numbers_of(full) and index.digest("r") is digest
        assert index.held_keys("r") == {5, 6} and index.applied_seq("r", "") == 3
        assert read == ([digest] if index.reads_reports and samples and given is stats else [])
    assert not samples or full.prefill_samples == stats["prefill_samples"]


def test_a_digest_that_is_not_a_mapping_is_rejected():
    with pytest.raises(DigestError, match="mapping"):
        parse_digest([("v", DIGEST_VERSION)])
    with pytest.raises(DigestError, match="seq"):
        parse_digest({k: v for k, v in valid_stats().items() if k != "seq"})
    with pytest.raises(DigestError, match="dense_key_tokens"):  # a version 2 report must say where its keys fall
        parse_digest({k: v for k, v in valid_stats().items() if k != "dense_key_tokens"})


@pytest.mark.parametrize("change", [{"batches": [[True, "", ""]]}, {"snapshot": {"seq": True, "keys": ""}}])
def test_a_bool_sequence_number_is_rejected(change):
    with pytest.raises(DigestError):
        parse_digest(valid_stats() | change)


@pytest.mark.parametrize("field", ["decode_step_s", "prefill_tokens_per_s", "mean_new_tokens"])
def test_a_report_with_an_infinite_rate_is_rejected_and_routing_goes_on(field):
    """A replica reporting a non-finite rate (e.g. a step timed at 0 s upstream) is not a valid report: it is counted
    and ignored, so the replica is ranked as one that has not reported (no load, the fleet's rates) and every cost
    stays finite; the other replica's report is applied as usual."""
    policy = PrefixRouterPolicy(PolicyConfig(default_page_size=PAGE_SIZE, shortlist_size=2, sampled=2))
    sane = valid_stats() | {"decode_step_s": 0.02, "max_running": 4}  # 1 running job
    assert policy.report("sane", json.loads(json.dumps(sane)))
    broken = valid_stats() | {field: math.inf, "max_running": 4}
    with pytest.raises(DigestError, match=field):
        parse_digest(json.loads(json.dumps(broken)))
    assert not policy.report("broken", json.loads(json.dumps(broken)))
    assert policy.num_rejected_reports == 1 and policy.index.digest("broken") is None
    tokens = list(range(10 * PAGE_SIZE))
    decision = policy.choose(["sane", "broken"], tokens)
    prefill = DEFAULTS_PREFILL  # "sane" measured none: the default
    assert all(math.isfinite(cost) for cost in decision.costs.values()), decision.costs
    # sane: 1 job of 4 batch slots (no slot wait, a fuller batch), then the prompt; broken: the prompt alone.
    assert decision.costs == pytest.approx({"sane": 1 / 4 * 0.02 + len(tokens) / prefill,
                                            "broken": len(tokens) / prefill})
    assert decision.best == "broken" and decision.mode == Mode.LOAD


def test_events_key_encoding_round_trips():
    keys = [0, 1, 2**63, 2**64 - 1, 12345678901234567890]
    events = CacheEvents(PAGE_SIZE, dense_key_tokens=DENSE_KEY_TOKENS)
    stats = build_digest(FakePool(page_size=PAGE_SIZE), events, 0, 0, 1) | {
        "snapshot": {"seq": 1, "keys": pack(keys)}}
    assert list(parse_digest(json.loads(json.dumps(stats))).snapshot.keys) == keys
