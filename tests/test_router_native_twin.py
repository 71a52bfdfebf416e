"""folio.router's report path on the native key index (KeyIndex.apply_report: most reports read and applied in one
call) against its Python twin (every report decoded in full by folio.router.digest), as the oracle: the same
decisions, held keys and digests over the same lossy stream of reports. (Not under test_router_events.py's
per-implementation fixture: this test builds both itself.)"""

from __future__ import annotations

import json
import random

import pytest
from test_router_events import DENSE_KEY_TOKENS, PAGE_SIZE, Clock, PoolDriver, numbers_of, report

from folio.router.events import CacheEvents
from folio.router.policy import PolicyConfig, PrefixRouterPolicy


@pytest.mark.parametrize("seed", range(3))
def test_policies_on_the_native_index_and_its_python_twin_decide_alike(seed, monkeypatch):
    """Two policies, one on the native index (which reads most reports in one call) and one on the Python twin (which
    decodes every report in full), fed the same reports of six replicas sharing prompt stems (arriving out of turn,
    some lost, some repeated, some corrupted) and the same prompts: every decision (costs, cached tokens, the
    shortlist's order up to exact ties) and every replica's held keys are the same. (Exact ties keep the order in
    which match() lists holders: the order they came to hold a key natively, slot order in the twin.)"""
    from folio.ops import native_key_index
    from folio.router import index
    from folio.router.held_keys import PyHeldKeys

    rng = random.Random(3000 + seed)
    clock = Clock()
    policies = []
    native_class = native_key_index()
    if native_class is None:
        pytest.skip("folio._native_cpu is not built")
    for held in (native_class, PyHeldKeys):
        monkeypatch.setattr(index, "make_held_keys", held)
        policies.append(PrefixRouterPolicy(PolicyConfig(default_page_size=PAGE_SIZE, seed=seed), clock=clock))
    native, python = policies
    assert native.index.reads_reports and not python.index.reads_reports
    read = []
    applied = native.index._applied
    native.index._applied = lambda state, native_read: read.append(state) or applied(state, native_read)
    num_hits = 0
    replicas = [f"r{n}" for n in range(6)]
    stems = PoolDriver(random.Random(seed)).stems
    drivers, streams = {}, {}
    for n, replica_id in enumerate(replicas):
        drivers[replica_id] = PoolDriver(random.Random(100 * seed + n))
        drivers[replica_id].stems = stems
        streams[replica_id] = CacheEvents(PAGE_SIZE, 8, dense_tokens=0, history=3, snapshot_every=7,
                                          dense_key_tokens=DENSE_KEY_TOKENS)
    epochs = dict.fromkeys(replicas, 0)
    last = {}
    for step in range(400):
        clock.now += 0.05
        replica_id = rng.choice(replicas)
        driver = drivers[replica_id]
        for _ in range(rng.randrange(1, 4)):
            driver.step()
        streams[replica_id].add(driver.drain())
        epochs[replica_id] += 1
        stats = report(driver, streams[replica_id], epochs[replica_id], instance_id=replica_id)
        if rng.random() < 0.15:
            continue  # lost
        if rng.random() < 0.1 and replica_id in last:
            stats = last[replica_id]  # an old one again
        elif stats["batches"] and rng.random() < 0.05:
            stats["batches"][-1][1] = "not base64!"
        last[replica_id] = stats
        assert native.report(replica_id, json.loads(json.dumps(stats))) == python.report(replica_id, stats)
        if step % 3 == 0:
            tokens = drivers[rng.choice(replicas)].prompt()
            decisions = [policy.choose(replicas, tokens) for policy in policies]
            a, b = decisions
            assert (a.mode, a.costs, a.num_cached_tokens, a.keys) == (b.mode, b.costs, b.num_cached_tokens, b.keys)
            assert [a.costs[r] for r in a.shortlist] == [b.costs[r] for r in b.shortlist]
            assert sorted(a.order) == sorted(b.order)
            num_hits += any(a.num_cached_tokens.values())
            for policy, decision in zip(policies, decisions):
                policy.on_routed(a.best, decision)
    for replica_id in replicas:
        assert native.index.held_keys(replica_id) == python.index.held_keys(replica_id)
        assert native.index.is_synced(replica_id) == python.index.is_synced(replica_id)
        assert numbers_of(native.index.digest(replica_id)) == numbers_of(python.index.digest(replica_id))
    assert native.num_rejected_reports == python.num_rejected_reports > 0
    assert native.index.stats == python.index.stats
    assert len(read) > 150 and num_hits > 40, (len(read), num_hits)  # mostly the native path, mostly prompts it holds
