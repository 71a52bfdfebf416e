"""The prefix-aware routing policy (folio.router.policy over folio.router.index and folio.router.cost) with fake
replicas and an injected clock.

A fake replica reports the way a real one does: its cache's page events (with depths) go through
folio.router.events.CacheEvents into folio.router.digest reports, with its load and measured rates. Costs are checked
against the documented formula (folio.router.cost), written out here in plain Python:

    wait     = max(0, busy_until - now)
               + max(0, jobs + 1 - max_running) / max_running * new_tokens * decode_step
               + jobs / max_running * decode_step                              (max_running: at least 1)
    ttft     = max(0, wait - min(in_flight / prefill_rate, max(0, busy_until - now))) + uncached / prefill_rate
               + new_tokens * decode_step if the replica lacks ceil(uncached / page_size) + 1 allocatable pages

busy_until: a report sets it to its arrival + backlog / prefill_rate, a request routed there at time t to
max(busy_until, t) + its uncached tokens / prefill_rate. cached: the prompt's tokens up to the deepest routing key the
replica holds or was sent (among the pages before the prompt's last token); in_flight: the part of it no event
confirmed yet, whose discount is capped at the prefill still queued there; uncached = prompt - cached. jobs: the
report's plus those routed since, or the caller's fresh count. Routing keys (folio.router.keys): in the first
DENSE_TOKENS a page every DENSE_KEY_TOKENS, then every BLOCK_TOKENS.
Affinity, load, bursts, ties, the draining backlog, the routed (in-flight) record and its TTL, evictions, restarts,
replica death and birth, the fleet's geometry, and the shortlist (the holders plus `sampled` of the `shortlist_size`
replicas that wait least, counting the page shortfall of a request sharing nothing) against brute force over every
replica.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter, defaultdict

import numpy as np
import pytest
from fakes import FakePool

from folio.cache import PageEvent, PageEventKind
from folio.hashing import page_hashes
from folio.router.cost import RATE_PRIOR_SAMPLES, LoadTable
from folio.router.digest import ReplicaDigest, build_digest
from folio.router.events import CacheEvents
from folio.router.keys import KeyGeometry, page_key
from folio.router.policy import Mode, PolicyConfig, PrefixRouterPolicy
from folio.router.rates import ReplicaRates

PAGE_SIZE = 16
BLOCK_TOKENS = 64  # a routing key every 4 pages (pages 3, 7, 11, ...)
DENSE_TOKENS = 64  # and in the first 4 pages
DENSE_KEY_TOKENS = 32  # every 2 pages (pages 1 and 3): keys on pages 1, 3, 7, 11, ...
GEOMETRY = {"default_page_size": PAGE_SIZE, "default_block_tokens": BLOCK_TOKENS, "default_dense_tokens": DENSE_TOKENS,
            "default_dense_key_tokens": DENSE_KEY_TOKENS}
# Score every one of the 8 replicas that wait least (by default 2 of them, drawn at random, are): tests that check
# each replica's cost or an exact choice use it; test_sampled_* test the default.
EXACT = {"shortlist_size": 8, "sampled": 8, **GEOMETRY}
REPLICAS = ("r0", "r1", "r2", "r3")
DEFAULTS = PolicyConfig()  # default_prefill_tokens_per_s, default_decode_step_s, default_new_tokens
W = DEFAULTS.recompute_weight  # a replica holding less of the prompt than the best-placed one pays W x the difference



# Every test here runs over both held-key stores (folio.router.held_keys): the native one and its Python twin.
pytestmark = pytest.mark.usefixtures("held_keys_implementation")

def is_key_depth(depth: int) -> bool:
    """Written out: the page ends at a multiple of BLOCK_TOKENS, or lies in the first DENSE_TOKENS and ends at a
    multiple of DENSE_KEY_TOKENS."""
    end = (depth + 1) * PAGE_SIZE
    return depth >= 0 and (end % BLOCK_TOKENS == 0 or (end <= DENSE_TOKENS and end % DENSE_KEY_TOKENS == 0))


def test_the_oracles_key_pages():
    assert [d for d in range(16) if is_key_depth(d)] == [1, 3, 7, 11, 15]


def test_key_depths_are_the_pages_the_definition_keys():
    """KeyGeometry.depths builds the list from ranges; the definition, written out, tests each page."""
    for page_size, dense_tokens, dense_key_tokens in itertools.product([1, 3, 16, 48, 64, 100, 256, 512],
                                                                       [0, 64, 200, 256, 1000], [16, 64, 96]):
        geometry = KeyGeometry(page_size, BLOCK_TOKENS, dense_tokens, dense_key_tokens)
        block_pages, dense_key_pages = max(1, BLOCK_TOKENS // page_size), max(1, dense_key_tokens // page_size)
        dense_pages = dense_tokens // page_size
        for num_pages in (0, 1, 2, 5, 17, 64, 300):
            keyed = [d for d in range(num_pages)
                     if (d + 1) % block_pages == 0 or (d < dense_pages and (d + 1) % dense_key_pages == 0)]
            assert geometry.depths(num_pages) == keyed, (page_size, dense_tokens, dense_key_tokens, num_pages)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeReplica:
    """A replica as routers see it: the pages its cache holds (page hash -> depth), published through CacheEvents;
    its load and measured rates; reported with a growing epoch."""

    def __init__(self, replica_id: str, *, instance_id: str = "a", max_running: int = 8,
                 num_pages: int = 1024) -> None:
        self.replica_id = replica_id
        self.instance_id = instance_id
        self.pool = FakePool(num_pages=num_pages, page_size=PAGE_SIZE)
        self.events = CacheEvents(PAGE_SIZE, BLOCK_TOKENS, dense_tokens=DENSE_TOKENS, dense_key_tokens=DENSE_KEY_TOKENS)
        self.cached: dict[bytes, int] = {}
        self.running = self.queued = self.backlog = 0
        self.received = 0  # requests received from every router
        self.max_running = max_running
        self.rates = ReplicaRates()
        self.epoch = 0

    def store(self, token_ids, num_pages: int | None = None, *, first_page: int = 0) -> None:
        """The pages [first_page, num_pages) of a sequence become ready, in order."""
        hashes = page_hashes(list(token_ids), PAGE_SIZE)[:num_pages]
        new = [(h, d) for d, h in enumerate(hashes) if d >= first_page and h not in self.cached]
        self.cached.update(new)
        self.events.add([PageEvent(PageEventKind.STORED, h, d) for h, d in new])

    def evict(self, page_hashes_: list[bytes]) -> None:
        gone = [(h, self.cached.pop(h)) for h in page_hashes_ if h in self.cached]
        self.events.add([PageEvent(PageEventKind.EVICTED, h, d) for h, d in gone])

    def held_keys(self) -> set[int]:
        return {page_key(h) for h, d in self.cached.items() if is_key_depth(d)}

    def stats(self) -> dict:
        self.epoch += 1
        return build_digest(self.pool, self.events, self.running, self.queued, self.epoch,
                            instance_id=self.instance_id, max_running=self.max_running,
                            num_prefill_tokens=self.backlog, num_received=self.received, rates=self.rates)

    def report(self, policy: PrefixRouterPolicy) -> bool:
        return policy.report(self.replica_id, self.stats())


def prompt(group: int, num_pages: int, suffix: int = 5) -> list[int]:
    """num_pages full pages shared by every prompt of `group`, then `suffix` tokens."""
    shared = [group * 100_000 + i for i in range(num_pages * PAGE_SIZE)]
    return shared + [random.Random(group).randrange(10**6) + 10**7 + i for i in range(suffix)]


def measured(prefill: float, step: float, new: float, samples: int = 10**9) -> ReplicaRates:
    """Rates behind `samples` observations each (by default so many that a replica's own rates decide)."""
    return ReplicaRates(prefill_tokens_per_s=prefill, decode_step_s=step, mean_new_tokens=new,
                        prefill_samples=samples, decode_samples=samples, finished_samples=samples)


def hashes_of(token_ids: list[int]) -> list[bytes]:
    return page_hashes(token_ids, PAGE_SIZE)


# ---- the documented formula, in plain Python --------------------------------------------------------------------


def settled_s(jobs: float, max_running: int, step: float, new: float) -> float:
    """The part of the wait that does not drain with time: waiting for a batch slot, and a fuller batch."""
    slots = max(max_running, 1)
    return max(jobs + 1 - slots, 0) / slots * new * step + jobs / slots * step


def wait_s(jobs: float, backlog: float, max_running: int, prefill: float, step: float, new: float) -> float:
    """The wait right after a report of `backlog` tokens to prefill (the clock has not moved since)."""
    return backlog / prefill + settled_s(jobs, max_running, step, new)


def shortfall_s(uncached: int, allocatable: int, step: float, new: float) -> float:
    """A job's decode time where the replica lacks the pages for `uncached` tokens (it waits for pages to free)."""
    return new * step if math.ceil(uncached / PAGE_SIZE) + 1 > allocatable else 0.0


def ttft_s(wait: float, prefill_wait: float, prompt_len: int, cached: int, in_flight: int, prefill: float,
           step: float, new: float, allocatable: int | None = None) -> float:
    """prefill_wait: the prefill queued on the replica now (max(0, busy_until - now)), the most the in-flight
    discount can take off."""
    uncached = prompt_len - cached
    cost = max(wait - min(in_flight / prefill, prefill_wait), 0.0) + uncached / prefill
    if allocatable is not None:
        cost += shortfall_s(uncached, allocatable, step, new)
    return cost


def reusable_key_depths(prompt_len: int) -> list[int]:
    """Depths of the prompt's routing keys on pages before its last token (a replica can reuse those)."""
    return [d for d in range(max(prompt_len - 1, 0) // PAGE_SIZE) if is_key_depth(d)]


def cached_tokens(token_ids: list[int], keys: set[int]) -> int:
    """Prompt tokens up to the deepest reusable routing key among `keys` (brute force over every key)."""
    hashes = hashes_of(token_ids)
    depths = [d for d in reusable_key_depths(len(token_ids)) if page_key(hashes[d]) in keys]
    return (max(depths) + 1) * PAGE_SIZE if depths else 0


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def fleet(clock):
    policy = PrefixRouterPolicy(PolicyConfig(routed_ttl_s=10.0, **EXACT), clock=clock)
    replicas = {r: FakeReplica(r) for r in REPLICAS}
    policy.sync_replicas(replicas)
    for replica in replicas.values():
        replica.report(policy)
    return policy, replicas


def route(policy: PrefixRouterPolicy, token_ids: list[int], candidates=REPLICAS):
    decision = policy.choose(list(candidates), token_ids)
    policy.on_routed(decision.best, decision)
    return decision


def flat(decision) -> list[str]:
    assert all(len(rank) == 1 for rank in decision.ranking)
    return [rank[0] for rank in decision.ranking]


# ---- configuration ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [
    {"shortlist_size": 0}, {"sampled": 0}, {"sampled": 9}, {"routed_ttl_s": -1}, {"max_routed_keys": -1},
    {"default_page_size": 0}, {"default_block_tokens": 0}, {"default_dense_key_tokens": 0},
    {"default_prefill_tokens_per_s": 0.0}, {"default_decode_step_s": -1.0}, {"default_new_tokens": 0}])
def test_invalid_config_is_an_error(values):
    with pytest.raises(ValueError):
        PolicyConfig(**values)


def test_unknown_config_option_is_an_error():
    with pytest.raises(TypeError, match="no_such_option"):
        PolicyConfig(no_such_option=3)


# ---- affinity and load ------------------------------------------------------------------------------------------


def test_affinity_same_prefix_goes_to_the_replica_holding_it(fleet):
    policy, replicas = fleet
    tokens = prompt(1, num_pages=8)  # 133 tokens: keys on pages 1, 3 and 7, all before the last token
    replicas["r2"].store(tokens, 8)
    replicas["r2"].report(policy)
    decision = policy.choose(list(REPLICAS), tokens)
    assert decision.mode == Mode.AFFINITY and decision.best == "r2"
    assert decision.num_cached_tokens == {"r0": 0, "r1": 0, "r2": 8 * PAGE_SIZE, "r3": 0}
    # A longer prompt of the same group matches the same 8 pages.
    longer = tokens + list(range(3 * PAGE_SIZE))
    assert policy.choose(list(REPLICAS), longer).num_cached_tokens["r2"] == 8 * PAGE_SIZE


def test_longer_match_wins(fleet):
    policy, replicas = fleet
    tokens = prompt(1, num_pages=8)
    replicas["r0"].store(tokens, 3)  # a key on page 1: 32 tokens
    replicas["r1"].store(tokens, 6)  # keys on pages 1, 3: 64 tokens
    replicas["r2"].store(tokens, 1)  # page 0 carries no key (dense keys every 2 pages): nothing
    for r in ("r0", "r1", "r2"):
        replicas[r].report(policy)
    decision = policy.choose(list(REPLICAS), tokens)
    assert flat(decision)[:2] == ["r1", "r0"]
    assert decision.num_cached_tokens == {"r0": 32, "r1": 64, "r2": 0, "r3": 0}


def test_the_last_prompt_token_is_always_computed(fleet):
    """A prompt of exactly 8 pages: its last page holds the token that is fed last, so 7 pages (keys up to page 3) are
    reusable."""
    policy, replicas = fleet
    tokens = prompt(1, num_pages=8, suffix=0)
    replicas["r0"].store(tokens, 8)
    replicas["r0"].report(policy)
    assert policy.choose(list(REPLICAS), tokens).num_cached_tokens["r0"] == 4 * PAGE_SIZE
    assert policy.choose(list(REPLICAS), tokens[:PAGE_SIZE]).mode == Mode.LOAD  # nothing before the last page


def test_no_cached_prefix_anywhere_ranks_by_load(fleet):
    policy, replicas = fleet
    for replica, running in zip(replicas.values(), (3, 1, 2, 1)):
        replica.running = running
        replica.report(policy)
    decision = policy.choose(list(REPLICAS), prompt(7, num_pages=4))
    assert decision.mode == Mode.LOAD
    assert sorted(flat(decision)[:2]) == ["r1", "r3"] and flat(decision)[2:] == ["r2", "r0"]


def test_burst_without_reports_spreads_over_replicas(fleet):
    """Reports are a period old: requests routed since count as load, so a burst does not pile onto one replica."""
    policy, _ = fleet
    chosen = [route(policy, prompt(group, num_pages=2)).best for group in range(8)]
    assert sorted(chosen) == sorted(REPLICAS * 2)


def test_ties_are_broken_by_the_seed(clock):
    def choices(seed):
        policy = PrefixRouterPolicy(PolicyConfig(seed=seed, **EXACT), clock=clock)
        policy.sync_replicas(REPLICAS)
        return [flat(policy.choose(list(REPLICAS), prompt(g, 2))) for g in range(12)]

    assert choices(1) == choices(1)
    assert all(sorted(ranking) == sorted(REPLICAS) for ranking in choices(1))
    assert len({ranking[0] for ranking in choices(1)}) > 1  # all equal: the first is drawn each time
    assert choices(1) != choices(2)


def test_backlog_and_queued_jobs_count_against_a_replica(clock):
    policy = PrefixRouterPolicy(PolicyConfig(**EXACT), clock=clock)
    prefill, step, new = 1000.0, 0.01, 100.0
    tokens = prompt(1, num_pages=4)  # 69 tokens, cached nowhere
    r0, r1 = FakeReplica("r0", max_running=4), FakeReplica("r1", max_running=4)
    for replica in (r0, r1):
        replica.rates = measured(prefill, step, new)
    r0.running, r0.backlog = 1, 1000
    r1.running = 3
    r0.report(policy)
    r1.report(policy)
    decision = policy.choose(["r0", "r1"], tokens)
    assert decision.costs == pytest.approx({
        "r0": 1000 / prefill + 1 / 4 * step + 69 / prefill,  # its backlog
        "r1": 3 / 4 * step + 69 / prefill})  # a fuller batch steps slower
    assert decision.best == "r1"
    # With 2 batch slots, 3 running jobs and this one: one waits for a slot (a job's whole decode).
    r1.max_running = 2
    r1.report(policy)
    decision = policy.choose(["r0", "r1"], tokens)
    assert decision.costs["r1"] == pytest.approx((3 + 1 - 2) / 2 * new * step + 3 / 2 * step + 69 / prefill)
    assert decision.best == "r0"


def test_page_shortfall_counts_against_a_full_replica(clock):
    policy = PrefixRouterPolicy(PolicyConfig(**EXACT), clock=clock)
    full, roomy = FakeReplica("full", num_pages=100), FakeReplica("roomy", num_pages=100)
    full.pool.num_allocatable = 10  # a prompt of 160 tokens needs 10 pages + 1
    roomy.pool.num_allocatable, roomy.running = 11, 1
    full.report(policy)
    roomy.report(policy)
    decision = policy.choose(["full", "roomy"], prompt(3, num_pages=10, suffix=0))
    prefill, step, new = DEFAULTS.default_prefill_tokens_per_s, DEFAULTS.default_decode_step_s, \
        DEFAULTS.default_new_tokens
    assert decision.costs == pytest.approx({"full": 160 / prefill + new * step,
                                            "roomy": 1 / 8 * step + 160 / prefill})
    assert decision.best == "roomy"


def test_in_flight_prefix_is_not_counted_as_backlog(fleet, clock):
    """A follower of an in-flight prompt would wait for the very pages it shares: that part of the replica's
    backlog is no extra delay; no more than the backlog still queued there is taken off, though."""
    policy, _ = fleet
    first = route(policy, prompt(5, num_pages=8, suffix=3))
    follower = policy.choose(list(REPLICAS), prompt(5, num_pages=8, suffix=4))
    prefill, step, new = DEFAULTS.default_prefill_tokens_per_s, DEFAULTS.default_decode_step_s, \
        DEFAULTS.default_new_tokens
    # The first request left 131 tokens to prefill there; the follower shares 128 of them, computes 4 of its own.
    wait = wait_s(1, 131, 8, prefill, step, new)
    assert follower.costs[first.best] == pytest.approx(wait - 128 / prefill + 4 / prefill)
    assert follower.best == first.best and follower.num_cached_tokens[first.best] == 128
    # 100 tokens' prefill later only 31 tokens' remain queued: the discount is those 31 tokens', not 128's.
    clock.now = 100 / prefill
    follower = policy.choose(list(REPLICAS), prompt(5, num_pages=8, suffix=4))
    assert follower.costs[first.best] == pytest.approx(settled_s(1, 8, step, new) + 4 / prefill)
    assert follower.costs[first.best] > 4 / prefill  # uncapped: max(wait - 128 tokens' prefill, 0) = 0 of waiting


def test_repeated_reports_are_not_decoded_again(fleet, monkeypatch):
    policy, replicas = fleet
    replica = replicas["r0"]
    stats = replica.stats()
    assert policy.report("r0", stats)

    def fail(_):
        raise AssertionError("decoded a report it already had")

    monkeypatch.setattr("folio.router.index.parse_digest", fail)
    assert not policy.report("r0", stats)


# ---- cost and shortlist against brute force ---------------------------------------------------------------------


@pytest.mark.parametrize("sampled", [8, 2])
@pytest.mark.parametrize("seed", range(4))
def test_costs_and_shortlist_against_brute_force_over_every_replica(seed, sampled):
    """64 replicas with random loads, free pages (some too few for long prompts), cached prefixes (a few hold a deep
    page without its ancestors) and requests routed since their reports at random times (reports arrived over time:
    some backlogs have drained, some in-flight discounts are capped by what is still queued); rates equal everywhere
    (measured by some, the fleet median for the others). The policy scores the holders and `sampled` of the 8 whose
    wait plus page shortfall for a request sharing nothing is least. Scoring all 8, its best choice costs the minimum
    of the formula over all 64: the pruning never changes the answer when rates are equal (a non-holder costs exactly
    that sum plus the prompt's prefill and the recompute charge, the same for all of them). Scoring 2 drawn at
    random, the others it scores are among those 8. Either way the costs it reports are the formula's, and its
    ranking lists every replica once: the shortlist, best first, then the rest by predicted wait."""
    rng = random.Random(seed)
    prefill, step, new = 2000.0, 0.02, 64.0
    clock = Clock()
    policy = PrefixRouterPolicy(PolicyConfig(shortlist_size=8, sampled=sampled, seed=seed, **GEOMETRY), clock=clock)
    groups = [[g * 10**6 + rng.randrange(10**5) for _ in range(16 * PAGE_SIZE)] for g in range(6)]

    def request() -> list[int]:
        group = rng.choice(groups)
        return group[:rng.randrange(1, len(group) + 1)] + [rng.randrange(10**5) for _ in range(rng.randrange(1, 40))]

    replicas = {f"r{i}": FakeReplica(f"r{i}", max_running=rng.choice([2, 4, 8])) for i in range(64)}
    for replica in replicas.values():
        if rng.random() < 0.5:  # prompts are up to 296 tokens: 19 pages, and one more
            replica.pool.num_allocatable = rng.randrange(0, 16)
        replica.rates = measured(prefill if rng.random() < 0.7 else 0.0, step if rng.random() < 0.7 else 0.0,
                                 new if rng.random() < 0.7 else 0.0)
        if rng.random() < 0.25:
            replica.store(rng.choice(groups), rng.randrange(1, 17))
        if rng.random() < 0.06:
            deep = rng.randrange(3, 16)
            replica.store(rng.choice(groups), deep + 1, first_page=deep)
        replica.report(policy)  # a first round: every replica's rates are known from here on
    busy_until: dict[str, float] = {}
    for replica_id, replica in replicas.items():
        clock.now += rng.uniform(0, 0.02)
        replica.running = rng.randrange(0, 10)
        replica.queued = rng.randrange(0, 4) if rng.random() < 0.3 else 0
        replica.backlog = rng.randrange(0, 3000)
        replica.report(policy)
        busy_until[replica_id] = clock.now + replica.backlog / prefill
    ids = list(replicas)
    routed_jobs, routed_keys = Counter(), defaultdict(set)
    clock.now += rng.uniform(0, 0.5)
    for _ in range(rng.randrange(4, 10)):
        clock.now += rng.uniform(0, 0.15)  # routed requests: at random times
        tokens = request()
        decision = policy.choose(ids, tokens)
        target = decision.best if rng.random() < 0.7 else rng.choice(ids)
        policy.on_routed(target, decision)
        routed_jobs[target] += 1
        uncached = len(tokens) - decision.num_cached_tokens.get(target, 0)
        busy_until[target] = max(busy_until[target], clock.now) + uncached / prefill
        routed_keys[target] |= set(decision.keys) - replicas[target].held_keys()

    num_affinity = num_drained = num_capped = num_short = 0
    sampled_sets = set()
    for _ in range(15):
        clock.now += rng.uniform(0, 0.02)
        tokens = request()
        decision = policy.choose(ids, tokens)
        costs, waits, unshared, holders, cached_of = {}, {}, {}, set(), {}
        for replica_id, replica in replicas.items():
            held = replica.held_keys()
            cached = cached_tokens(tokens, held | routed_keys[replica_id])
            in_flight = cached - cached_tokens(tokens, held)
            prefill_wait = max(busy_until[replica_id] - clock.now, 0.0)
            waits[replica_id] = prefill_wait + settled_s(
                replica.running + replica.queued + routed_jobs[replica_id], replica.max_running, step, new)
            unshared[replica_id] = waits[replica_id] + shortfall_s(len(tokens), replica.pool.num_allocatable, step,
                                                                   new)
            costs[replica_id] = ttft_s(waits[replica_id], prefill_wait, len(tokens), cached, in_flight, prefill, step,
                                       new, replica.pool.num_allocatable)
            num_drained += busy_until[replica_id] < clock.now
            num_capped += in_flight / prefill > prefill_wait
            if cached:
                holders.add(replica_id)
            cached_of[replica_id] = cached
        most_cached = max(cached_of.values())  # every holder is scored
        num_copies = sum(cached == most_cached for cached in cached_of.values()) if most_cached else 1
        for replica_id in replicas:
            costs[replica_id] += W / num_copies * (most_cached - cached_of[replica_id]) / prefill
        assert decision.costs == pytest.approx({r: costs[r] for r in decision.costs}, rel=1e-9, abs=1e-12)
        assert [decision.costs[r] for r in decision.shortlist] == sorted(decision.costs.values())
        others = set(decision.shortlist) - holders
        eighth_least = sorted(unshared.values())[7]
        assert holders <= set(decision.shortlist) and len(others) <= sampled
        assert all(unshared[r] <= eighth_least + 1e-9 for r in others)
        # The shortfall changed which 8 are least: a replica among them by wait alone is not.
        eighth_least_wait = sorted(waits.values())[7]
        num_short += any(waits[r] < eighth_least_wait and unshared[r] > eighth_least + 1e-9 for r in ids)
        if sampled == 8:
            assert costs[decision.best] == pytest.approx(min(costs.values()), rel=1e-9, abs=1e-12)
        sampled_sets.add(frozenset(others))
        ranking = flat(decision)
        assert sorted(ranking) == sorted(ids) and ranking[:len(decision.shortlist)] == decision.shortlist
        rest = [waits[r] for r in ranking[len(decision.shortlist):]]
        assert all(a <= b + 1e-9 for a, b in zip(rest, rest[1:]))
        assert (decision.mode == Mode.AFFINITY) == bool(holders)
        num_affinity += bool(holders)
    assert num_affinity > 0 and num_drained > 0 and num_capped > 0 and num_short > 0, (
        num_affinity, num_drained, num_capped, num_short)
    assert sampled == 8 or len(sampled_sets) > 1  # drawn afresh for each request


@pytest.mark.parametrize("w", [-0.1, math.inf, math.nan])
def test_a_recompute_weight_must_be_finite_and_non_negative(w):
    with pytest.raises(ValueError, match="recompute_weight"):
        PolicyConfig(recompute_weight=w)


def test_a_router_alone_scores_the_replicas_that_wait_least(clock):
    """By default 2 of the replicas that wait least are scored besides holders. A router alone knows every request
    sent since the reports, so it takes the two that wait least, and as it routes there they wait longer and others
    take their place."""
    policy = PrefixRouterPolicy(PolicyConfig(**GEOMETRY), clock=clock)
    assert (policy.config.shortlist_size, policy.config.sampled) == (8, 2)
    replicas = [FakeReplica(f"r{i}") for i in range(20)]
    for i, replica in enumerate(replicas):
        replica.backlog = 100 * i  # r0, r1, r2, ... wait least
        replica.report(policy)
    assert policy.loads.num_routers == 1.0
    for group in range(5):
        decision = policy.choose([r.replica_id for r in replicas], prompt(group, num_pages=2))
        assert decision.mode == Mode.LOAD and set(decision.shortlist) == {"r0", "r1"}
    chosen = Counter()
    for group in range(40):
        decision = policy.choose([r.replica_id for r in replicas], prompt(100 + group, num_pages=2))
        assert len(decision.shortlist) == 2
        policy.on_routed(decision.best, decision)
        chosen[decision.best] += 1
    assert len(chosen) > 2 and "r19" not in chosen  # spread over the least waiting as they fill
    assert chosen["r0"] >= chosen["r3"]


def test_several_routers_draw_the_scored_replicas_from_those_that_wait_least(clock):
    """Routers sharing a fleet see the same reports and would all send to the same least-waiting replicas: each
    draws the 2 it scores at random from the 8 x routers that wait least, afresh for each request."""
    policy = PrefixRouterPolicy(PolicyConfig(**GEOMETRY), clock=clock)
    replicas = [FakeReplica(f"r{i}") for i in range(40)]
    for i, replica in enumerate(replicas):
        replica.backlog = 100 * i
        replica.report(policy)
    busiest = replicas[-1]
    for group in range(10):  # this router sends 10 requests, and the replica receives 30: two other routers
        policy.on_routed(busiest.replica_id, policy.choose([r.replica_id for r in replicas], prompt(group, 2)))
    busiest.received = 30
    busiest.report(policy)
    assert policy.loads.num_routers == pytest.approx(3.0)
    drawn = Counter()
    for group in range(300):
        decision = policy.choose([r.replica_id for r in replicas], prompt(100 + group, num_pages=2))
        assert decision.mode == Mode.LOAD and len(decision.shortlist) == 2
        drawn.update(decision.shortlist)
    assert set(drawn) == {f"r{i}" for i in range(24)}  # every one of the 24 that wait least, never another
    assert min(drawn.values()) > 5


def test_of_many_holders_of_one_depth_the_least_waiting_are_scored(clock):
    """A prefix held by 30 replicas in full and by 12 in part: of each group the 8 that wait least are scored (and 2
    least waiting of the fleet), and the choice is the one scoring every holder makes."""
    tokens = prompt(3, num_pages=8)
    replicas = [FakeReplica(f"r{i}") for i in range(50)]
    rng = random.Random(0)
    for i, replica in enumerate(replicas):
        if i < 30:
            replica.store(tokens)
        elif i < 42:
            replica.store(tokens, 4)
        replica.backlog = rng.randrange(0, 5000)
    pruned = PrefixRouterPolicy(PolicyConfig(**GEOMETRY), clock=clock)
    every = PrefixRouterPolicy(PolicyConfig(holders_per_depth=1000, **GEOMETRY), clock=clock)
    for replica in replicas:
        stats = replica.stats()
        pruned.report(replica.replica_id, stats)
        every.report(replica.replica_id, stats)
    ids = [r.replica_id for r in replicas]
    decision, brute = pruned.choose(ids, tokens), every.choose(ids, tokens)
    assert len(brute.shortlist) >= 42 and len(decision.shortlist) <= 8 + 8 + 2
    full = sorted(range(30), key=lambda i: replicas[i].backlog)
    part = sorted(range(30, 42), key=lambda i: replicas[i].backlog)
    scored = {int(r[1:]) for r in decision.shortlist}
    assert set(full[:8]) <= scored and not scored & set(full[8:])
    assert set(part[:8]) <= scored and not scored & set(part[8:])
    assert decision.best == brute.best and decision.costs[decision.best] == brute.costs[brute.best]


def test_holders_per_depth_must_be_positive():
    with pytest.raises(ValueError, match="holders_per_depth"):
        PolicyConfig(holders_per_depth=0)


def test_the_shortlist_finds_a_replica_with_room_past_those_that_lack_pages(clock):
    policy = PrefixRouterPolicy(PolicyConfig(**EXACT), clock=clock)
    replicas = [FakeReplica(f"r{i}", num_pages=100) for i in range(9)]
    for replica in replicas[:8]:
        replica.pool.num_allocatable = 2  # long decodes hold their pages; the batch has room
    replicas[8].backlog = 10  # waits 10 tokens' prefill longer, and has the pages
    for replica in replicas:
        replica.report(policy)
    decision = policy.choose([r.replica_id for r in replicas], prompt(4, num_pages=10))
    prefill = DEFAULTS.default_prefill_tokens_per_s
    penalty = DEFAULTS.default_new_tokens * DEFAULTS.default_decode_step_s
    brute = {r.replica_id: (r.backlog + 165) / prefill + (penalty if r.pool.num_allocatable < 12 else 0.0)
             for r in replicas}
    assert min(brute, key=brute.get) == "r8"
    # Chosen by wait alone, r0..r7 (cost 2.6 s) would be scored and r8 (0.04 s) not: the shortlist counts the page
    # shortfall of a request sharing nothing.
    assert decision.best == "r8" and decision.costs["r8"] == pytest.approx(brute["r8"])


def test_an_in_flight_prefix_prefilled_since_is_no_discount(clock):
    prefill, step, new = 1000.0, 0.01, 50.0
    # (no recompute charge: the cap on the discount alone decides)
    policy = PrefixRouterPolicy(PolicyConfig(routed_ttl_s=100.0, recompute_weight=0.0, **EXACT), clock=clock)
    busy, idle = FakeReplica("busy", max_running=2), FakeReplica("idle", max_running=2)
    busy.running = 3
    for replica in (busy, idle):
        replica.rates = measured(prefill, step, new)
        replica.report(policy)
    leader = prompt(5, num_pages=32, suffix=3)  # 515 tokens
    policy.on_routed("busy", policy.choose(["busy", "idle"], leader))  # Serve sent it to "busy"
    clock.now = 5.0  # its 0.515 s of prefill are long done; no report since (the routed record lasts 100 s)
    decision = policy.choose(["busy", "idle"], prompt(5, num_pages=32, suffix=4))  # 516 tokens, 512 shared
    assert decision.num_cached_tokens["busy"] == 512
    # busy: no prefill left, 4 jobs for 2 batch slots; then 4 tokens of its own. idle: the whole prompt.
    assert decision.costs == pytest.approx({"busy": settled_s(4, 2, step, new) + 4 / prefill,
                                            "idle": 0.516})
    # The discount for the in-flight 512 tokens is capped at the prefill still queued on "busy" (none): without the
    # cap "busy" would cost 0.77 - 0.512 + 0.004 = 0.262 and win.
    assert decision.best == "idle"


@pytest.mark.parametrize("w", [W, 0.0, 1.0])
@pytest.mark.parametrize("jobs, max_running", [(1, 4), (6, 4), (0, 1)])
def test_a_holder_wins_while_its_wait_is_below_the_prefill_time_it_saves(clock, jobs, max_running, w):
    """The holder of the prompt's first 512 tokens against an idle replica: it wins while its predicted wait is below
    512 tokens' prefill and the recompute charge (w of it), and loses once its backlog pushes the wait past that.
    The crossover backlog comes from the formula."""
    prefill, step, new = 1000.0, 0.01, 50.0
    tokens = prompt(2, num_pages=32, suffix=20)
    cached = 32 * PAGE_SIZE
    crossover = ((1 + w) * cached / prefill - wait_s(jobs, 0, max_running, prefill, step, new)) * prefill  # tokens
    assert crossover > 10
    for backlog, winner in ((math.floor(crossover) - 1, "holder"), (math.ceil(crossover) + 1, "idle")):
        policy = PrefixRouterPolicy(PolicyConfig(recompute_weight=w, **EXACT), clock=clock)
        holder, idle = FakeReplica("holder", max_running=max_running), FakeReplica("idle", max_running=max_running)
        holder.store(tokens, 32)
        holder.running, holder.backlog = jobs, backlog
        for replica in (holder, idle):
            replica.rates = measured(prefill, step, new)
            replica.report(policy)
        decision = policy.choose(["idle", "holder"], tokens)
        assert decision.num_cached_tokens == {"idle": 0, "holder": cached}
        assert decision.costs == pytest.approx({
            "idle": len(tokens) / prefill + w * cached / prefill,
            "holder": wait_s(jobs, backlog, max_running, prefill, step, new) + (len(tokens) - cached) / prefill})
        assert decision.best == winner


@pytest.mark.parametrize("num_holders, winner", [(1, "holder0"), (3, "idle")])
def test_the_recompute_charge_is_shared_among_the_copies_of_a_prefix(clock, num_holders, winner):
    """The same 1 s backlog on every holder of a 512-token prefix: one holder keeps the request (an idle replica
    pays the prefill and the whole recompute charge, W x 0.512 s), while with three holders the idle replica pays a
    third of that charge and wins: a prefix that several replicas serve spreads at a fraction of the price."""
    prefill, step, new = 1000.0, 0.01, 50.0
    tokens = prompt(4, num_pages=32, suffix=20)
    cached = 32 * PAGE_SIZE
    policy = PrefixRouterPolicy(PolicyConfig(**EXACT), clock=clock)
    holders = [FakeReplica(f"holder{i}") for i in range(num_holders)]
    idle = FakeReplica("idle")
    for replica in (*holders, idle):
        replica.rates = measured(prefill, step, new)
        if replica is not idle:
            replica.store(tokens, 32)
            replica.backlog = 1000
        replica.report(policy)
    ids = [r.replica_id for r in (*holders, idle)]
    decision = policy.choose(ids, tokens)
    holder_s = wait_s(0, 1000, holders[0].max_running, prefill, step, new) + (len(tokens) - cached) / prefill
    idle_s = len(tokens) / prefill + W / num_holders * cached / prefill
    assert decision.costs == pytest.approx({**{h.replica_id: holder_s for h in holders}, "idle": idle_s})
    assert cached / prefill * (1 + W / 3) < holder_s - (len(tokens) - cached) / prefill < cached / prefill * (1 + W)
    assert decision.best == winner


def test_fresh_job_counts_override_the_reports(fleet):
    """num_jobs (Ray's queue-length cache) replaces the report's job count plus what was routed since; the prefill
    backlog stays (it drains with time)."""
    policy, replicas = fleet
    prefill, step, new = 1000.0, 0.01, 50.0
    tokens = prompt(2, num_pages=8)  # 133 tokens
    for replica in replicas.values():
        replica.rates = measured(prefill, step, new)
        replica.running, replica.queued, replica.backlog = 6, 4, 2000
        replica.report(policy)
    holder = replicas["r1"]
    holder.store(tokens, 8)
    holder.report(policy)
    routed_to = route(policy, prompt(9, num_pages=2)).best  # one more job there, 37 more tokens
    num_jobs = {"r0": 2, "r1": 0, "r2": 14}  # r3: no fresh count
    decision = policy.choose(list(REPLICAS), tokens, num_jobs=num_jobs)

    def expected(replica_id):
        jobs = num_jobs.get(replica_id, 10 + (replica_id == routed_to))
        backlog = 2000 + 37 * (replica_id == routed_to)
        cached = 128 if replica_id == "r1" else 0
        return wait_s(jobs, backlog, 8, prefill, step, new) + (133 - cached) / prefill + W * (128 - cached) / prefill

    assert decision.costs == pytest.approx({r: expected(r) for r in REPLICAS})
    assert decision.best == "r1"
    # More jobs than the reports said: the holder's prefix no longer pays for its wait.
    assert policy.choose(list(REPLICAS), tokens, num_jobs={"r1": 30}).best != "r1"


def test_a_reported_backlog_drains_as_time_passes(clock):
    """The prefill backlog is a FIFO: a report sets when the replica's prefill work ends (its arrival + backlog at
    its rate), a routed request extends it from then or from now, whichever is later, and it drains with time."""
    prefill, step, new = 1000.0, 0.01, 50.0
    policy = PrefixRouterPolicy(PolicyConfig(**EXACT), clock=clock)
    replica = FakeReplica("r0")
    replica.rates = measured(prefill, step, new)
    replica.running, replica.backlog = 1, 2000
    replica.report(policy)
    probe = prompt(8, num_pages=3)  # 53 tokens, cached nowhere

    def prefill_wait(jobs):
        return policy.choose(["r0"], probe).costs["r0"] - 53 / prefill - settled_s(jobs, 8, step, new)

    assert prefill_wait(1) == pytest.approx(2.0)
    clock.now = 0.5
    assert prefill_wait(1) == pytest.approx(1.5)
    policy.on_routed("r0", policy.choose(["r0"], prompt(3, num_pages=10, suffix=0)))  # 160 tokens after the 2000
    assert prefill_wait(2) == pytest.approx(1.66)
    clock.now = 3.0  # all of it prefilled by now
    assert prefill_wait(2) == pytest.approx(0.0)
    policy.on_routed("r0", policy.choose(["r0"], prompt(4, num_pages=5, suffix=0)))  # 80 tokens, from now
    assert prefill_wait(3) == pytest.approx(0.08)
    clock.now = 4.0
    replica.backlog = 300
    replica.report(policy)  # the report's backlog, from its arrival; its job count replaces the routed ones
    assert prefill_wait(1) == pytest.approx(0.3)


def test_a_replicas_rates_weigh_against_the_fleets_by_their_observations(clock):
    """rate = (n x own + RATE_PRIOR_SAMPLES x fleet median) / (n + RATE_PRIOR_SAMPLES), per rate, n its count."""
    reported = {"a": (700.0, 0.03, 20.0, 1), "b": (2300.0, 0.01, 60.0, 2), "c": (1500.0, 0.02, 40.0, 400)}
    policy = PrefixRouterPolicy(PolicyConfig(**EXACT), clock=clock)
    for replica_id, (prefill, step, new, samples) in reported.items():
        replica = FakeReplica(replica_id, max_running=2)
        replica.rates = measured(prefill, step, new, samples)
        replica.running = 3  # one waits for a batch slot: the wait uses all three rates
        replica.report(policy)
    fleet = (1500.0, 0.02, 40.0)  # the medians
    tokens = prompt(6, num_pages=6)  # 101 tokens, cached nowhere
    decision = policy.choose(list(reported), tokens)
    for replica_id, (*own, samples) in reported.items():
        weight = samples / (samples + RATE_PRIOR_SAMPLES)
        prefill, step, new = (weight * value + (1 - weight) * median for value, median in zip(own, fleet))
        assert decision.costs[replica_id] == pytest.approx(wait_s(3, 0, 2, prefill, step, new) + 101 / prefill)


def test_a_first_slow_measurement_does_not_send_a_prompt_from_its_prefix(clock):
    """Two idle replicas of one deployment; the first prefill steps measured one at 700 tokens/s, the other at
    2,300 (one prompt in a step against four, on a loaded host). The slower holds 64 of a 110-token prompt: taken
    at face value, 46 tokens there cost more than 110 on the other (no recompute charge here: the rates alone
    decide)."""
    policy = PrefixRouterPolicy(PolicyConfig(recompute_weight=0.0, **EXACT), clock=clock)
    holder, other = FakeReplica("holder"), FakeReplica("other")
    tokens = prompt(7, num_pages=4, suffix=46)
    holder.store(tokens, 4)
    for replica, prefill in ((holder, 700.0), (other, 2300.0)):
        for _ in range(2):
            replica.rates.observe_step(110, 0, 110 / prefill)
        replica.rates.observe_step(0, 1, 0.02)
        replica.report(policy)
    assert 46 / 700 > 110 / 2300  # what face value would choose
    decision = policy.choose(["holder", "other"], tokens)
    assert decision.num_cached_tokens["holder"] == 64
    assert decision.best == "holder", decision.costs


def test_the_fleet_median_is_numpys():
    """folio.router.cost._median, where refresh takes the fleet's rates from, gives np.median's value: odd and even
    counts, ties, one value."""
    from folio.router.cost import _median

    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 4, 7, 64, 511, 512):
        for values in (rng.random(n) * 10.0 ** rng.integers(-3, 5), rng.choice([0.5, 1.0, 2.0], n),
                       np.round(rng.random(n) * 10)):
            assert _median(values) == float(np.median(values))


def test_unmeasured_rates_use_the_fleet_median_and_the_defaults_only_when_nothing_is_measured(clock):
    tokens = prompt(6, num_pages=6)  # 101 tokens, cached nowhere
    reported = {"a": (1000.0, 0.01, 40.0), "b": (0.0, 0.05, 50.0), "c": (4000.0, 0.0, 300.0), "d": (1500.0, 0.02, 0.0)}
    policy = PrefixRouterPolicy(PolicyConfig(**EXACT), clock=clock)
    for replica_id, rates in reported.items():
        replica = FakeReplica(replica_id, max_running=2)
        replica.rates = measured(*rates)
        replica.running = 3  # one waits for a batch slot: the wait uses all three rates
        replica.report(policy)
    median = (1500.0, 0.02, 50.0)  # over the replicas that measured each
    decision = policy.choose(["a", "b", "c", "d", "silent"], tokens)  # "silent" never reported: no load
    for replica_id, rates in reported.items():
        prefill, step, new = (value or fleet for value, fleet in zip(rates, median))
        assert decision.costs[replica_id] == pytest.approx(
            wait_s(3, 0, 2, prefill, step, new) + 101 / prefill), replica_id
    assert decision.costs["silent"] == pytest.approx(101 / median[0])
    # Nothing measured anywhere: the configured defaults.
    config = PolicyConfig(default_prefill_tokens_per_s=500.0, default_decode_step_s=0.05, default_new_tokens=10.0,
                          **EXACT)
    policy = PrefixRouterPolicy(config, clock=clock)
    replica = FakeReplica("a", max_running=2)
    replica.running = 3
    replica.report(policy)
    decision = policy.choose(["a", "silent"], tokens)
    assert decision.costs == pytest.approx({"a": wait_s(3, 0, 2, 500.0, 0.05, 10.0) + 101 / 500.0,
                                            "silent": 101 / 500.0})


def test_routed_requests_raise_the_predicted_wait_until_the_next_report(fleet):
    policy, replicas = fleet
    prefill, step, new = DEFAULTS.default_prefill_tokens_per_s, DEFAULTS.default_decode_step_s, \
        DEFAULTS.default_new_tokens
    probe = prompt(8, num_pages=3)  # 53 tokens, cached nowhere

    def cost_of(replica_id):
        return policy.choose(list(REPLICAS), probe).costs[replica_id]

    assert cost_of("r2") == pytest.approx(53 / prefill)
    first = policy.choose(list(REPLICAS), prompt(3, num_pages=10))  # 165 tokens
    policy.on_routed("r2", first)
    second = policy.choose(list(REPLICAS), prompt(4, num_pages=5))  # 85 tokens
    policy.on_routed("r2", second)
    assert cost_of("r2") == pytest.approx(wait_s(2, 165 + 85, 8, prefill, step, new) + 53 / prefill)
    replicas["r2"].report(policy)  # its report counts them (or not) from now on
    assert cost_of("r2") == pytest.approx(53 / prefill)


# ---- evictions, the routed record and its TTL -------------------------------------------------------------------


def test_evicted_pages_stop_attracting_requests(fleet):
    policy, replicas = fleet
    tokens = prompt(1, num_pages=8)
    holder = replicas["r3"]
    holder.store(tokens, 8)
    holder.report(policy)
    assert policy.choose(list(REPLICAS), tokens).best == "r3"
    holder.evict(hashes_of(tokens)[2:8][::-1])  # evicted leaves first: pages 2..7 are gone
    holder.report(policy)
    assert policy.choose(list(REPLICAS), tokens).num_cached_tokens["r3"] == 2 * PAGE_SIZE
    holder.evict(hashes_of(tokens)[:2][::-1])
    holder.report(policy)
    decision = policy.choose(list(REPLICAS), tokens)
    assert decision.mode == Mode.LOAD and set(decision.num_cached_tokens.values()) == {0}


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
    tokens = prompt(2, num_pages=4)  # keys on pages 1 and 3: 64 tokens

    def cached_on(replica_id):
        return policy.choose(list(REPLICAS), tokens).num_cached_tokens.get(replica_id, 0)

    target = route(policy, tokens).best
    clock.now = 5.0  # a report within the TTL does not drop them: the request may still be queued
    replicas[target].report(policy)
    assert cached_on(target) == 64
    clock.now = 20.0  # past the TTL, but no report since: still counted
    assert cached_on(target) == 64
    replicas[target].report(policy)  # the report after the TTL speaks for them: not held
    assert cached_on(target) == 0
    assert policy.choose(list(REPLICAS), tokens).mode == Mode.LOAD


def test_routed_pages_confirmed_by_a_report_survive_the_ttl(fleet, clock):
    policy, replicas = fleet
    tokens = prompt(2, num_pages=4)
    target = route(policy, tokens).best
    clock.now = 11.0
    replicas[target].store(tokens, 4)
    replicas[target].report(policy)
    decision = policy.choose(list(REPLICAS), tokens)
    assert decision.best == target and decision.num_cached_tokens[target] == 64


def test_a_deep_key_without_its_ancestors_matches_to_its_depth(fleet):
    """A routing key names its whole prefix: a replica reported holding page 7 of a prompt (its ancestors evicted
    while it was in use) matches 8 pages."""
    policy, replicas = fleet
    tokens = prompt(3, num_pages=10)
    replicas["r1"].store(tokens, 8, first_page=7)
    replicas["r1"].report(policy)
    decision = policy.choose(list(REPLICAS), tokens)
    assert decision.best == "r1" and decision.num_cached_tokens["r1"] == 8 * PAGE_SIZE


# ---- reports, replica death and new replicas --------------------------------------------------------------------


def test_stale_reports_are_ignored_and_a_restart_resets_the_replica(fleet):
    policy, replicas = fleet
    tokens = prompt(1, num_pages=4)
    replica = replicas["r1"]
    stale = replica.stats()
    replica.store(tokens, 4)
    assert replica.report(policy)
    assert not policy.report("r1", stale)  # an older epoch
    assert policy.choose(list(REPLICAS), tokens).num_cached_tokens["r1"] == 64
    route(policy, tokens)  # goes to r1 and is recorded there
    restarted = FakeReplica("r1", instance_id="b")  # a new instance: empty cache, epochs from 1 again
    assert restarted.report(policy)
    decision = policy.choose(list(REPLICAS), tokens)
    assert decision.mode == Mode.LOAD and decision.num_cached_tokens["r1"] == 0


def test_replica_death_removes_it_from_the_index(fleet):
    policy, replicas = fleet
    tokens = prompt(1, num_pages=4)
    replicas["r0"].store(tokens, 4)
    replicas["r0"].report(policy)
    route(policy, prompt(9, num_pages=4))
    policy.remove_replica("r0")
    assert "r0" not in policy.index
    decision = policy.choose(["r1", "r2", "r3"], tokens)
    assert decision.mode == Mode.LOAD and "r0" not in flat(decision)
    # Its keys are gone from the inverted index too: a replica later added under the same id starts empty.
    policy.sync_replicas(REPLICAS)
    decision = policy.choose(list(REPLICAS), tokens)
    assert decision.mode == Mode.LOAD and decision.num_cached_tokens["r0"] == 0


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


def test_key_geometry_comes_from_the_reports(clock):
    """Before any report the configured geometry; then what most replicas report, dense_key_tokens included."""
    policy = PrefixRouterPolicy(PolicyConfig(default_page_size=256, shortlist_size=8, sampled=8), clock=clock)
    assert policy.geometry().as_tuple() == (256, 256, 256, 64)  # folio.router.keys' defaults
    # Pages of 32 tokens, a key every 3 pages in the first 4 (page 2), then every 4 (page 3). The policy's default
    # dense_key_tokens (64: every 2 pages) would put keys on pages 1 and 3 instead.
    geometry = (32, 128, 128, 96)
    tokens = prompt(1, num_pages=10)  # 165 tokens: 5 pages of 32
    hashes = page_hashes(tokens, 32)
    for replica_id, page_size, holds in (("r0", 32, True), ("r1", 32, False), ("r2", 16, False)):
        events = CacheEvents(page_size, 128, dense_tokens=128, dense_key_tokens=96)
        if holds:  # pages 0..2: the key on page 2 only
            events.add([PageEvent(PageEventKind.STORED, h, d) for d, h in enumerate(hashes[:3])])
        policy.report(replica_id, build_digest(FakePool(page_size=page_size), events, 0, 0, 1))
    assert policy.geometry().as_tuple() == geometry
    assert policy.prompt_keys(tokens) == [page_key(hashes[2]), page_key(hashes[3])]
    decision = policy.choose(["r0", "r1", "r2", "r3"], tokens)  # r3 has not reported
    assert decision.best == "r0" and decision.num_cached_tokens["r0"] == 3 * 32


# ---- several routers sharing a fleet ----------------------------------------------------------------------------


def _load_report(received: int, backlog: int = 0) -> ReplicaDigest:
    return ReplicaDigest(instance_id="", epoch=1, num_running=0, num_queued=0, max_running=8,
                         num_prefill_tokens=backlog, num_received=received, page_size=16, num_pages=100,
                         num_free_pages=0, num_allocatable_pages=100, prefill_tokens_per_s=1000.0, decode_step_s=0.02,
                         mean_new_tokens=50.0, block_tokens=64, dense_tokens=0, dense_key_tokens=64, seq=1,
                         prefill_samples=100, decode_samples=100, finished_samples=100)


def test_a_router_counts_the_routers_sharing_the_fleet_from_what_the_replicas_received():
    """Its own requests against what the replicas report receiving: with three routers sending alike, it counts
    three, and a request it routes weighs three until the next report (the others send as many meanwhile)."""
    clock = Clock()
    loads = LoadTable(clock=clock)
    loads.set_report(0, _load_report(received=0))
    assert loads.num_routers == 1.0
    for _ in range(10):
        loads.add_routed(0, 0)
    clock.now += 1.0
    loads.set_report(0, _load_report(received=30))  # 10 of ours, 20 from two other routers
    assert loads.num_routers == pytest.approx(3.0)
    before = loads.waits(np.array([0]), 0)[0][0]
    loads.add_routed(0, 500)
    assert loads.waits(np.array([0]), 0)[0][0] - before == pytest.approx(3 * 500 / 1000.0 + 3 * 0.02 / 8)
    for _ in range(10):  # alone from now on: the estimate follows within its window
        clock.now += 1.0
        for _ in range(10):
            loads.add_routed(0, 0)
        clock.now += 1.0
        loads.set_report(0, _load_report(received=int(loads.received[0]) + 10))
    assert 1.0 <= loads.num_routers < 3.0


def test_a_lone_router_counts_one():
    clock = Clock()
    loads = LoadTable(clock=clock)
    loads.set_report(0, _load_report(received=5))
    for step in range(1, 6):
        for _ in range(4):
            loads.add_routed(0, 100)
        clock.now += 1.0
        loads.set_report(0, _load_report(received=5 + 4 * step))
        assert loads.num_routers == 1.0
