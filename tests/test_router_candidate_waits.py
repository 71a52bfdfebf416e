"""The router's pass over its candidates (folio.router.cost.LoadTable.least_waiting): the native loop
(folio._native_cpu.CandidateWaits.least) against the numpy expression it replaces, as the oracle: the same waits,
bit for bit, and the same k least in the same order of (unshared wait, position), over random load tables with
ties, infinities and NaN; and whole policies on the two paths making the same decisions."""

from __future__ import annotations

import copy
import functools
import random

import numpy as np
import pytest
from test_router_policy import GEOMETRY, Clock, FakeReplica, prompt

from folio.router.cost import LoadTable, _native_scan
from folio.router.policy import PolicyConfig, PrefixRouterPolicy

needs_native = pytest.mark.skipif(_native_scan() is None, reason="folio._native_cpu is not built")


def random_table(rng: random.Random, num_slots: int, clock: Clock) -> LoadTable:
    """A load table whose columns least_waiting reads hold random values, many of them equal (rounded), some
    infinite, a few NaN."""
    table = LoadTable(clock=clock, capacity=num_slots)
    table.refresh()  # (its recomputed columns are overwritten below, and it is not stale again)

    def value(scale: float) -> float:
        roll = rng.random()
        if roll < 0.3:
            return 0.0
        if roll < 0.5:
            return round(rng.uniform(0, scale), 1)  # ties
        if roll < 0.52:
            return float("nan") if rng.random() < 0.5 else float("inf")
        return rng.uniform(-scale, scale)

    for name, scale in (("busy_until", 3.0), ("settled", 2.0), ("one_job_s", 1.0), ("fit_tokens", 500.0)):
        getattr(table, name)[:] = [value(scale) for _ in range(num_slots)]
    return table


def same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a, b, equal_nan=True) and np.array_equal(np.signbit(a), np.signbit(b))


@needs_native
@pytest.mark.parametrize("seed", range(40))
def test_native_waits_and_least_equal_numpys(seed):
    rng = random.Random(seed)
    clock = Clock()
    clock.now = rng.uniform(0, 2)
    num_slots = rng.choice([1, 2, 7, 64, 512])
    table = random_table(rng, num_slots, clock)
    num_candidates = rng.randrange(1, num_slots + 1)
    if rng.random() < 0.5:
        rows = slice(0, num_candidates)
    else:
        rows = np.array(rng.sample(range(num_slots), num_candidates), dtype=np.int64)
    uncached = rng.choice([0, 17, 250, 10_000])
    for k in {0, 1, min(8, num_candidates), num_candidates, num_candidates + 3}:
        wait_native, least_native = table.least_waiting(rows, num_candidates, uncached, k)
        with np.errstate(invalid="ignore"):  # (inf x 0: NaN on both paths)
            wait_numpy, least_numpy = table.least_waiting(rows, num_candidates, uncached, k, native=False)
        assert same_floats(wait_native, wait_numpy)
        assert least_native == least_numpy, (k, least_native, least_numpy)
        assert len(least_native) == min(k, num_candidates)


@needs_native
def test_native_pass_refuses_rows_outside_the_table():
    table = LoadTable(clock=Clock(), capacity=8)
    with pytest.raises(ValueError, match="outside the load table"):
        table.least_waiting(np.array([0, 8], dtype=np.int64), 2, 10, 2)
    with pytest.raises(ValueError, match="int64"):
        table.least_waiting(np.array([0, 1], dtype=np.int32), 2, 10, 2)


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native, id="native"),
                                    pytest.param(False, id="numpy")])
def test_among_equal_waits_the_earlier_candidates_are_scored(native):
    """Idle replicas that report alike wait alike: a router alone scores the first two candidates in the order
    given (on either path), and as it routes there they wait longer and the next ones take their place."""
    clock = Clock()
    policy = PrefixRouterPolicy(PolicyConfig(**GEOMETRY), clock=clock)
    policy.loads.least_waiting = functools.partial(LoadTable.least_waiting, policy.loads, native=native)
    replicas = [FakeReplica(f"r{i}") for i in range(30)]
    for replica in replicas:
        replica.report(policy)
    order = [r.replica_id for r in reversed(replicas)]  # candidates listed r29 first
    decision = policy.choose(order, prompt(0, num_pages=2))
    assert set(decision.shortlist) == {"r29", "r28"}
    first = decision.best
    policy.on_routed(first, decision)
    decision = policy.choose(order, prompt(1, num_pages=2))
    assert set(decision.shortlist) == ({"r29", "r28"} - {first}) | {"r27"}


@needs_native
@pytest.mark.parametrize("seed", range(3))
def test_policies_on_the_native_pass_and_on_numpy_decide_alike(seed):
    """Two policies fed the same reports of 40 replicas (loads drawn with many ties) and the same prompts, one
    scanning its candidates natively and one in numpy: every decision (shortlist in order, costs, cached tokens)
    is the same, as routing changes the loads between decisions."""
    rng = random.Random(seed)
    clock = Clock()
    policies = [PrefixRouterPolicy(PolicyConfig(seed=seed, **GEOMETRY), clock=clock) for _ in range(2)]
    native, python = policies
    python.loads.least_waiting = functools.partial(LoadTable.least_waiting, python.loads, native=False)
    replicas = [FakeReplica(f"r{i}", max_running=rng.choice([2, 4])) for i in range(40)]
    for step in range(200):
        clock.now += 0.01
        if step % 20 == 0:
            for replica in replicas:
                replica.backlog = rng.choice([0, 0, 100, 400])
                replica.running = rng.randrange(0, 3)
                if rng.random() < 0.2:
                    replica.store(prompt(rng.randrange(6), num_pages=8), rng.randrange(1, 8))
                stats = replica.stats()
                for policy in policies:
                    policy.report(replica.replica_id, copy.deepcopy(stats))
        candidates = [r.replica_id for r in rng.sample(replicas, rng.randrange(1, 41))]
        token_ids = prompt(rng.randrange(10), num_pages=rng.randrange(1, 9))
        decisions = [policy.choose(candidates, token_ids) for policy in policies]
        a, b = decisions
        assert a.shortlist == b.shortlist and a.costs == b.costs and a.num_cached_tokens == b.num_cached_tokens
        for policy, decision in zip(policies, decisions):
            policy.on_routed(decision.best, decision)
