"""The prefix-aware router's pure parts (folio.router.digest, folio.router.index, folio.router.policy) with fake
replicas and an injected clock: affinity, load, imbalance fallback, evictions, the routed (in-flight) record and its
TTL, replica death and birth, the digest's bound, and agreement with a real folio PagePool."""

from __future__ import annotations

import json
import random

import pytest
from fakes import FakePool

from folio.cache import PagePool
from folio.hashing import page_hashes
from folio.router.digest import (
    DigestError,
    build_digest,
    digest_size_bound,
    page_key,
    page_keys,
    parse_digest,
    select_hashes,
)
from folio.router.index import PrefixIndex
from folio.router.policy import CandidateView, Mode, PolicyConfig, PrefixRouterPolicy, rank_replicas

PAGE_SIZE = 16
REPLICAS = ("r0", "r1", "r2", "r3")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeReplica:
    """A replica as the router sees it: a pool's hashes and job counts, reported with a growing epoch."""

    def __init__(self, replica_id: str, *, instance_id: str = "a") -> None:
        self.replica_id = replica_id
        self.instance_id = instance_id
        self.pool = FakePool()
        self.running = 0
        self.queued = 0
        self.epoch = 0

    def report(self, policy: PrefixRouterPolicy) -> bool:
        self.epoch += 1
        stats = build_digest(self.pool, self.running, self.queued, self.epoch, instance_id=self.instance_id)
        return policy.report(self.replica_id, stats)


def prompt(group: int, num_pages: int, suffix: int = 5) -> list[int]:
    """num_pages full pages shared by every prompt of `group`, then `suffix` tokens of this prompt's own."""
    shared = [group * 100_000 + i for i in range(num_pages * PAGE_SIZE)]
    return shared + [random.Random(group).randrange(10**6) + 10**7 + i for i in range(suffix)]


def hashes_of(token_ids: list[int]) -> list[bytes]:
    return page_hashes(token_ids, PAGE_SIZE)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fleet(clock):
    policy = PrefixRouterPolicy(PolicyConfig(routed_ttl_s=10.0, default_page_size=PAGE_SIZE), clock=clock)
    replicas = {r: FakeReplica(r) for r in REPLICAS}
    policy.sync_replicas(replicas)
    for replica in replicas.values():
        replica.report(policy)
    return policy, replicas


def route(policy: PrefixRouterPolicy, token_ids: list[int], candidates=REPLICAS):
    decision = policy.choose(list(candidates), token_ids)
    policy.on_routed(decision.best, decision)
    return decision


# ---- affinity and load ------------------------------------------------------------------------------------------


def test_affinity_same_prefix_goes_to_the_replica_holding_it(fleet):
    policy, replicas = fleet
    tokens = prompt(1, num_pages=8)
    replicas["r2"].pool.hashes = hashes_of(tokens)[:8]
    replicas["r2"].report(policy)
    decision = policy.choose(list(REPLICAS), tokens)
    assert decision.mode == Mode.AFFINITY and decision.ranking[0] == ["r2"]
    assert decision.num_cached_tokens == {"r0": 0, "r1": 0, "r2": 8 * PAGE_SIZE, "r3": 0}
    # A longer prompt of the same group matches the same 8 pages.
    longer = tokens + list(range(3 * PAGE_SIZE))
    assert policy.choose(list(REPLICAS), longer).best == "r2"


def test_longer_match_wins(fleet):
    policy, replicas = fleet
    tokens = prompt(1, num_pages=8)
    replicas["r0"].pool.hashes = hashes_of(tokens)[:3]
    replicas["r1"].pool.hashes = hashes_of(tokens)[:6]
    for r in ("r0", "r1"):
        replicas[r].report(policy)
    decision = policy.choose(list(REPLICAS), tokens)
    assert decision.ranking[0] == ["r1"] and decision.ranking[1] == ["r0"]


def test_no_cached_prefix_anywhere_spreads_by_load(fleet):
    policy, replicas = fleet
    for replica, running in zip(replicas.values(), (3, 1, 2, 1)):
        replica.running = running
        replica.report(policy)
    decision = policy.choose(list(REPLICAS), prompt(7, num_pages=4))
    assert decision.mode == Mode.LOAD
    assert sorted(decision.ranking[0]) == ["r1", "r3"]  # equal cost shares a rank
    assert decision.ranking[1:] == [["r2"], ["r0"]]


def test_burst_without_reports_spreads_over_replicas(fleet):
    """Reports are a period old: requests routed since count as load, so a burst does not pile onto one replica."""
    policy, _ = fleet
    chosen = [route(policy, prompt(group, num_pages=2)).best for group in range(8)]
    assert sorted(chosen) == sorted(REPLICAS * 2)


def test_ties_are_broken_by_the_seed(clock):
    def choices(seed):
        policy = PrefixRouterPolicy(PolicyConfig(seed=seed, default_page_size=PAGE_SIZE), clock=clock)
        policy.sync_replicas(REPLICAS)
        return [policy.choose(list(REPLICAS), prompt(g, 2)).ranking[0] for g in range(6)]

    assert choices(1) == choices(1)
    assert all(sorted(rank) == sorted(REPLICAS) for rank in choices(1))  # all equal: one rank, shuffled


def test_busy_holder_loses_to_an_idle_replica_when_the_prefix_is_worth_less():
    config = PolicyConfig()
    views = [CandidateView("holder", num_cached_tokens=256, page_size=PAGE_SIZE, num_running=4, num_queued=2),
             CandidateView("idle", num_cached_tokens=0, page_size=PAGE_SIZE)]
    decision = rank_replicas(views, 300, config, random.Random(0))
    # holder: 44 uncached + 4 * 64 + 2 * 1024; idle: 300 uncached.
    assert decision.costs == {"holder": 44 + 256 + 2048, "idle": 300}
    assert decision.best == "idle"
    views[0] = CandidateView("holder", num_cached_tokens=4096, page_size=PAGE_SIZE, num_running=4, num_queued=2)
    assert rank_replicas(views, 5000, config, random.Random(0)).best == "holder"


def test_page_shortfall_counts_against_a_full_replica():
    config = PolicyConfig()
    views = [CandidateView("full", 0, PAGE_SIZE, num_allocatable_pages=2),
             CandidateView("roomy", 0, PAGE_SIZE, num_running=1, num_allocatable_pages=100)]
    decision = rank_replicas(views, 10 * PAGE_SIZE, config, random.Random(0))
    assert decision.costs["full"] == 10 * PAGE_SIZE + (11 - 2) * PAGE_SIZE
    assert decision.best == "roomy"


def test_backlog_and_queued_jobs_count_against_a_replica(clock):
    policy = PrefixRouterPolicy(PolicyConfig(default_page_size=PAGE_SIZE), clock=clock)
    tokens = prompt(1, num_pages=4)
    policy.report("r0", build_digest(FakePool(), 1, 0, epoch=1, num_prefill_tokens=1000))
    policy.report("r1", build_digest(FakePool(), 3, 0, epoch=1))
    decision = policy.choose(["r0", "r1"], tokens)
    # r0: 69 uncached + 0.5 * 1000 backlog + 1 * 64; r1: 69 + 3 * 64.
    assert decision.costs == {"r0": 69 + 500 + 64, "r1": 69 + 192} and decision.best == "r1"
    # Past its max_running, r1's jobs queue: 2 running + 1 queued.
    policy.report("r1", build_digest(FakePool(), 3, 0, epoch=2, max_running=2))
    assert policy.choose(["r0", "r1"], tokens).costs["r1"] == 69 + 2 * 64 + 1024


def test_in_flight_prefix_is_not_counted_as_backlog(fleet):
    """A follower of an in-flight prompt would wait for the very pages it shares: that part of the replica's
    backlog is no extra delay."""
    policy, _ = fleet
    first = route(policy, prompt(5, num_pages=8, suffix=3))
    follower = policy.choose(list(REPLICAS), prompt(5, num_pages=8, suffix=4))
    # The first request left 131 tokens to prefill on its replica; 128 of them are the shared pages.
    assert follower.costs[first.best] == 4 + 0.5 * (131 - 128) + 64
    assert follower.best == first.best


def test_repeated_reports_are_not_decoded_again(fleet, monkeypatch):
    policy, replicas = fleet
    stats = build_digest(FakePool(), 0, 0, epoch=replicas["r0"].epoch, instance_id="a")

    def fail(_):
        raise AssertionError("decoded a report it already had")

    monkeypatch.setattr("folio.router.policy.parse_digest", fail)
    assert not policy.report("r0", stats)


def test_imbalance_falls_back_to_load(fleet):
    policy, replicas = fleet
    tokens = prompt(1, num_pages=128)  # 2,048 cached tokens outweigh 16 running jobs
    holder = replicas["r0"]
    holder.pool.hashes = hashes_of(tokens)
    holder.running = 17
    holder.report(policy)
    decision = policy.choose(list(REPLICAS), tokens)
    assert decision.mode == Mode.IMBALANCED and "r0" not in decision.ranking[0]
    assert decision.ranking[-1] == ["r0"]
    holder.running = 16  # a spread of 16 is within the default threshold: affinity again
    holder.report(policy)
    decision = policy.choose(list(REPLICAS), tokens)
    assert decision.mode == Mode.AFFINITY and decision.best == "r0"


def test_fresh_job_counts_override_the_reports(fleet):
    policy, replicas = fleet
    tokens = prompt(1, num_pages=64)
    replicas["r0"].pool.hashes = hashes_of(tokens)
    replicas["r0"].report(policy)
    assert policy.choose(list(REPLICAS), tokens).best == "r0"
    decision = policy.choose(list(REPLICAS), tokens, num_jobs={"r0": 30})
    assert decision.mode == Mode.IMBALANCED and decision.best != "r0"


def test_a_drained_replica_sheds_its_reported_backlog(fleet):
    policy, replicas = fleet
    tokens = prompt(2, num_pages=4)
    holder = replicas["r1"]
    holder.pool.hashes = hashes_of(tokens)
    holder.epoch += 1
    stats = build_digest(holder.pool, 4, 0, holder.epoch, instance_id=holder.instance_id, num_prefill_tokens=2000)
    assert policy.report("r1", stats)
    assert policy.choose(list(REPLICAS), tokens).best != "r1"  # its report: a long prefill backlog
    idle = {r: 0 for r in REPLICAS}
    assert policy.choose(list(REPLICAS), tokens, num_jobs=idle).best == "r1"  # those jobs are done since


# ---- evictions, the routed record and its TTL -------------------------------------------------------------------


def test_evicted_pages_stop_attracting_requests(fleet):
    policy, replicas = fleet
    tokens = prompt(1, num_pages=8)
    holder = replicas["r3"]
    holder.pool.hashes = hashes_of(tokens)
    holder.report(policy)
    assert policy.choose(list(REPLICAS), tokens).best == "r3"
    holder.pool.hashes = hashes_of(tokens)[:2]  # evicted leaves first: pages 2..7 are gone
    holder.report(policy)
    assert policy.index.match("r3", page_keys(hashes_of(tokens))) == 2
    holder.pool.hashes = []
    holder.report(policy)
    decision = policy.choose(list(REPLICAS), tokens)
    assert decision.mode == Mode.LOAD and sorted(decision.ranking[0]) == sorted(REPLICAS)


def test_routed_but_not_yet_reported_pages_attract_followers(fleet):
    """The in-flight case: the first request of a group is routed by load; followers go where it went, before
    any report shows its pages."""
    policy, _ = fleet
    first = route(policy, prompt(5, num_pages=32, suffix=3))
    assert first.mode == Mode.LOAD
    for suffix in (4, 9, 11):
        follower = route(policy, prompt(5, num_pages=32, suffix=suffix))
        assert follower.mode == Mode.AFFINITY and follower.best == first.best
        assert follower.num_cached_tokens[first.best] == 32 * PAGE_SIZE


def test_routed_pages_expire_after_the_ttl_unless_reported(fleet, clock):
    policy, replicas = fleet
    tokens = prompt(2, num_pages=4)
    keys = page_keys(hashes_of(tokens))
    target = route(policy, tokens).best
    clock.now = 5.0  # a report within the TTL does not drop them: the request may still be queued
    replicas[target].report(policy)
    assert policy.index.match(target, keys) == 4
    clock.now = 20.0  # past the TTL, but no report since: still counted
    assert policy.index.match(target, keys) == 4
    replicas[target].report(policy)  # the report after the TTL speaks for them: not held
    assert policy.index.match(target, keys) == 0
    assert policy.choose(list(REPLICAS), tokens).mode == Mode.LOAD


def test_routed_pages_confirmed_by_a_report_survive_the_ttl(fleet, clock):
    policy, replicas = fleet
    tokens = prompt(2, num_pages=4)
    target = route(policy, tokens).best
    clock.now = 11.0
    replicas[target].pool.hashes = hashes_of(tokens)
    replicas[target].report(policy)
    assert policy.choose(list(REPLICAS), tokens).best == target


def test_match_counts_the_ancestors_of_a_reported_page():
    """A page key names its whole prefix: a bounded digest that lists a deep page without its ancestors still
    matches the leading pages."""
    index = PrefixIndex(clock=FakeClock())
    hashes = hashes_of(prompt(3, num_pages=10))
    index.report("r", parse_digest(build_digest(FakePool([hashes[6]]), 0, 0, epoch=1)))
    assert index.match("r", page_keys(hashes)) == 7
    assert index.match("r", page_keys(hashes[:5])) == 0
    assert index.match_all(page_keys(hashes), ["r", "unknown"]) == {"r": (7, 7), "unknown": (0, 0)}
    index.record_routed("r", page_keys(hashes[:9]))
    assert index.match_all(page_keys(hashes), ["r"]) == {"r": (9, 7)}


def test_routed_record_is_bounded():
    index = PrefixIndex(clock=FakeClock(), max_routed_pages=5)
    keys = list(range(1, 9))
    index.record_routed("r", keys)
    assert index.match("r", keys[:3]) == 0 and index.match("r", keys) == 8
    assert index.match("r", keys[:4]) == 4


# ---- reports, replica death and new replicas --------------------------------------------------------------------


def test_stale_reports_are_ignored_and_a_restart_resets_the_replica(fleet):
    policy, replicas = fleet
    tokens = prompt(1, num_pages=4)
    keys = page_keys(hashes_of(tokens))
    replica = replicas["r1"]
    replica.pool.hashes = hashes_of(tokens)
    assert replica.report(policy)
    stale = build_digest(FakePool(), 0, 0, epoch=1, instance_id="a")
    assert not policy.report("r1", stale)
    assert policy.index.match("r1", keys) == 4
    route(policy, tokens)  # goes to r1 and is recorded there
    restarted = build_digest(FakePool(), 0, 0, epoch=1, instance_id="b")  # a new instance: empty cache
    assert policy.report("r1", restarted)
    assert policy.index.match("r1", keys) == 0


def test_replica_death_removes_it_from_the_index(fleet):
    policy, replicas = fleet
    tokens = prompt(1, num_pages=4)
    replicas["r0"].pool.hashes = hashes_of(tokens)
    replicas["r0"].report(policy)
    route(policy, prompt(9, num_pages=4))
    policy.remove_replica("r0")
    assert "r0" not in policy.index
    decision = policy.choose(["r1", "r2", "r3"], tokens)
    assert decision.mode == Mode.LOAD and "r0" not in decision.costs
    # Its pages are gone from the inverted index too: a replica later added under the same id starts empty.
    policy.sync_replicas(REPLICAS)
    assert policy.index.match("r0", page_keys(hashes_of(tokens))) == 0
    assert policy.index.match_all(page_keys(hashes_of(tokens)), REPLICAS) == dict.fromkeys(REPLICAS, (0, 0))


def test_new_replica_starts_empty_and_takes_unmatched_requests(fleet):
    policy, replicas = fleet
    for replica in replicas.values():
        replica.running = 4
        replica.report(policy)
    policy.sync_replicas([*REPLICAS, "r4"])
    decision = policy.choose([*REPLICAS, "r4"], prompt(8, num_pages=3))
    assert decision.best == "r4" and decision.num_cached_tokens["r4"] == 0
    policy.sync_replicas(["r1", "r4"])  # scaled down: the others are forgotten
    assert sorted(policy.index.replica_ids) == ["r1", "r4"]


def test_page_size_comes_from_the_reports(clock):
    policy = PrefixRouterPolicy(PolicyConfig(default_page_size=256), clock=clock)
    tokens = prompt(1, num_pages=4)
    hashes = page_hashes(tokens, 32)
    policy.report("r0", build_digest(FakePool(hashes, page_size=32), 0, 0, epoch=1))
    policy.report("r1", build_digest(FakePool([], page_size=32), 0, 0, epoch=1))
    decision = policy.choose(["r0", "r1", "r2"], tokens)  # r2 has not reported: the fleet's page size
    assert decision.best == "r0" and decision.num_cached_tokens["r0"] == 2 * 32
    assert decision.page_size_of == {"r0": 32, "r1": 32, "r2": 32}


# ---- the digest -------------------------------------------------------------------------------------------------


def test_digest_round_trips_through_json():
    hashes = hashes_of(prompt(1, num_pages=5))
    stats = build_digest(FakePool(hashes), running=3, queued=1, epoch=7, instance_id="x", max_running=8,
                         num_prefill_tokens=100)
    assert set(stats) == {"v", "instance_id", "epoch", "num_running", "num_queued", "max_running",
                          "num_prefill_tokens", "page_size", "num_pages", "num_free_pages", "num_allocatable_pages",
                          "num_ready_pages", "hashes"}
    digest = parse_digest(json.loads(json.dumps(stats)))
    assert digest.page_keys == frozenset(page_key(h) for h in hashes) and digest.complete
    assert (digest.epoch, digest.num_running, digest.num_queued, digest.max_running, digest.num_prefill_tokens,
            digest.instance_id, digest.page_size, digest.num_ready_pages) == (7, 3, 1, 8, 100, "x", PAGE_SIZE, 5)


def test_digest_stays_under_its_bound_for_a_pool_of_100k_pages():
    num_pages = 100_000
    pool = PagePool(num_pages, PAGE_SIZE, record_events=False)
    token_ids = list(range(num_pages * PAGE_SIZE))
    hashes = hashes_of(token_ids)
    page_ids = pool.allocate(num_pages)
    for idx, (page_id, page_hash) in enumerate(zip(page_ids, hashes)):
        pool.set_ready(page_id, page_hash, hashes[idx - 1] if idx else None,
                       token_ids[idx * PAGE_SIZE:(idx + 1) * PAGE_SIZE])
    pool.release(page_ids)
    for max_hashes in (0, 64, 1024):
        stats = build_digest(pool, 0, 0, epoch=1, max_hashes=max_hashes, instance_id="i" * 64)
        assert len(json.dumps(stats)) <= digest_size_bound(max_hashes)
        digest = parse_digest(stats)
        assert digest.num_ready_pages == num_pages and len(digest.page_keys) == max_hashes
        assert digest.page_keys == frozenset(page_keys(hashes[num_pages - max_hashes:]))  # the newest
        assert not digest.complete
    assert digest_size_bound(1024) < 12_000


def test_select_hashes_keeps_the_newest():
    assert select_hashes([b"a", b"b", b"c"], 5) == [b"a", b"b", b"c"]
    assert list(select_hashes([b"a", b"b", b"c"], 2)) == [b"b", b"c"]
    assert list(select_hashes([b"a"], 0)) == []
    with pytest.raises(ValueError):
        select_hashes([], -1)


def test_digest_of_a_real_pool_matches_its_ready_hashes():
    """Built from a real PagePool after jobs, sharing and evictions: the digest lists exactly the pool's ready
    hashes, and the router's match equals what the pool's own lookup finds."""
    pool = PagePool(12, PAGE_SIZE)
    prompts = [prompt(1, 4), prompt(1, 4, suffix=PAGE_SIZE + 3), prompt(2, 3), prompt(3, 5)]
    for token_ids in prompts:
        hashes = hashes_of(token_ids)
        found = pool.lookup(hashes).num_ready
        page_ids = pool.acquire(hashes[:found]) + pool.allocate(-(-len(token_ids) // PAGE_SIZE) - found)
        for idx in range(found, len(hashes)):
            pool.set_ready(page_ids[idx], hashes[idx], hashes[idx - 1] if idx else None,
                           token_ids[idx * PAGE_SIZE:(idx + 1) * PAGE_SIZE])
        pool.release(page_ids)
        pool.check()
    evicted = [e for e in pool.drain_events() if e.kind.value == "evicted"]
    assert evicted, "the scenario should evict pages"
    digest = parse_digest(build_digest(pool, running=0, queued=0, epoch=1))
    ready = list(pool.cached_hashes())
    assert digest.page_keys == frozenset(page_keys(ready)) and digest.complete
    assert (digest.num_pages, digest.num_free_pages, digest.num_allocatable_pages) == (
        pool.num_pages, pool.num_free, pool.num_allocatable)
    index = PrefixIndex(clock=FakeClock())
    index.report("r", digest)
    for token_ids in prompts:
        hashes = hashes_of(token_ids)
        assert index.match("r", page_keys(hashes)) == pool.lookup(hashes).num_ready


@pytest.mark.parametrize("change, message", [
    ({"v": 2}, "version"),
    ({"epoch": -1}, "epoch"),
    ({"num_running": "3"}, "num_running"),
    ({"page_size": 0}, "page_size"),
    ({"hashes": "not base64!"}, "base64"),
    ({"hashes": "AAAA"}, "multiple"),
    ({"instance_id": 5}, "instance_id"),
])
def test_malformed_digests_are_rejected(change, message, clock):
    stats = build_digest(FakePool(), 0, 0, epoch=1) | change
    with pytest.raises(DigestError, match=message):
        parse_digest(stats)
    policy = PrefixRouterPolicy(clock=clock)
    assert not policy.report("r0", stats) and policy.num_rejected_reports == 1
