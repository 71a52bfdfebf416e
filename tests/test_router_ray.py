"""The prefix-aware router inside Ray Serve (folio.router.ray_router).

Unit tests drive PrefixAwareRequestRouter directly with fake replicas (Serve's hooks as Serve calls them, no
cluster). The `ray` tests run a local cluster (loopback) with 2 generator replicas of the demo model behind the
ingress, routed by it: requests sharing a prefix land on the replica that holds it and hit its cache, different
prefixes spread, and a killed replica does not stop requests from being served.
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
import random
import time
import types

import pytest

pytest.importorskip("ray.serve")

from fakes import FakePool, free_port  # noqa: E402
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from folio.cache import PageEvent, PageEventKind  # noqa: E402
from folio.hashing import page_hashes  # noqa: E402
from folio.router.digest import build_digest  # noqa: E402
from folio.router.events import CacheEvents  # noqa: E402
from folio.router.ray_router import PrefixAwareRequestRouter, prompt_token_ids  # noqa: E402

PAGE_SIZE = 16
DEPLOYMENT = DeploymentID(name="Generator", app_name="test")


# --- fakes -------------------------------------------------------------------------------------------------------


class FakeReplica:
    """What a RequestRouter reads of a RunningReplica; `report()` plays the controller's stats broadcast of the
    replica's routing report (its pool's page events through CacheEvents, default key geometry)."""

    def __init__(self, name: str) -> None:
        self.replica_id = ReplicaID(name, DEPLOYMENT)
        self.routing_stats: dict = {}
        self.max_ongoing_requests = 16
        self.pool = FakePool()
        self.events = CacheEvents(PAGE_SIZE)
        self.epoch = 0
        self.queue_len = 0

    def hold(self, hashes) -> None:
        """A sequence's pages (these hashes, first page first) became ready in its pool."""
        self.events.add([PageEvent(PageEventKind.STORED, h, depth) for depth, h in enumerate(hashes)])

    def report(self, running: int = 0, queued: int = 0) -> None:
        self.epoch += 1
        self.queue_len = running + queued
        self.routing_stats = build_digest(self.pool, self.events, running, queued, self.epoch, instance_id="i",
                                          max_running=8)

    async def get_queue_len(self, *, deadline_s: float) -> int:  # Serve probes new replicas
        return self.queue_len


class Request:
    """Stands for folio.serve.schema.EngineRequest: the router reads input_ids only."""

    def __init__(self, input_ids) -> None:
        self.input_ids = tuple(input_ids)


REQUEST_IDS = itertools.count()
SUFFIXES = random.Random(0)


def pending(token_ids=None, request_id: str | None = None, as_kwarg: bool = False) -> PendingRequest:
    request_id = request_id or f"req-{next(REQUEST_IDS)}"
    args, kwargs = [], {}
    if token_ids is not None:
        if as_kwarg:
            kwargs["request"] = Request(token_ids)
        else:
            args.append(Request(token_ids))
    return PendingRequest(args=args, kwargs=kwargs,
                          metadata=RequestMetadata(request_id=request_id, internal_request_id=request_id))


def prompt(group: int, num_pages: int = 4, suffix: int = 7) -> list[int]:
    shared = [(group * 7919 + i * 31) % 900 + 50 for i in range(num_pages * PAGE_SIZE)]
    return shared + [SUFFIXES.randrange(50, 950) for _ in range(suffix)]


def make_router(replicas, **kwargs) -> PrefixAwareRequestRouter:
    """kwargs: PolicyConfig fields. Unless they say otherwise every candidate is scored (sampled=8; by default 2 of
    the 8 that wait least, drawn at random, are), so that rankings are exact."""
    router = PrefixAwareRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
                                      use_replica_queue_len_cache=True)
    router.initialize_state(**{"default_page_size": PAGE_SIZE, "sampled": 8, **kwargs})
    router.update_replicas(replicas)
    return router


def names(ranking) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranking]


def run(coro):
    return asyncio.run(coro)


# --- unit tests --------------------------------------------------------------------------------------------------


def test_the_class_loads_by_path_and_pickles():
    from ray.serve.config import RequestRouterConfig

    config = RequestRouterConfig(request_router_class="folio.router.ray_router:PrefixAwareRequestRouter",
                                 request_router_kwargs={"shortlist_size": 4})
    assert config.get_request_router_class() is PrefixAwareRequestRouter
    assert pickle.loads(pickle.dumps(PrefixAwareRequestRouter)) is PrefixAwareRequestRouter


def test_unknown_policy_option_is_an_error():
    router = PrefixAwareRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    with pytest.raises(TypeError, match="no_such_option"):
        router.initialize_state(no_such_option=3)


@pytest.mark.parametrize("sampled", [8, 2])
def test_reported_pages_attract_their_prefix(sampled):
    """With every candidate scored, and with the default sampling (a holder is always scored)."""
    async def go():
        replicas = [FakeReplica(f"r{i}") for i in range(3)]
        replicas[2].hold(page_hashes(prompt(1), PAGE_SIZE)[:4])
        for r in replicas:
            r.report()
        router = make_router(replicas, sampled=sampled)
        ranking = await router.choose_replicas(replicas, pending(prompt(1)))
        assert names(ranking)[0] == ["r2"]
        assert all(len(rank) == 1 for rank in ranking) and len(ranking) == 3  # one replica per rank
        assert router.decision_modes["affinity"] == 1
        # Another prefix is cached nowhere: ranked by load alone; r2 has a request on its way.
        ranking = await router.choose_replicas(replicas, pending(prompt(2)))
        assert router.decision_modes["load"] == 1 and names(ranking)[0] != ["r2"]
        assert sorted(names(ranking)) == [["r0"], ["r1"], ["r2"]]
        if sampled == 8:
            assert names(ranking)[-1] == ["r2"]

    run(go())


def test_a_burst_spreads_and_followers_find_their_leaders_pages_before_any_report():
    async def go():
        replicas = [FakeReplica(f"r{i}") for i in range(4)]
        router = make_router(replicas)  # no replica has reported yet, nothing was sent yet
        await asyncio.sleep(0.05)  # Serve probes the new replicas' queue lengths
        leaders = [pending(prompt(g)) for g in range(4)]
        chosen = [names(await router.choose_replicas(replicas, r))[0][0] for r in leaders]
        assert sorted(chosen) == ["r0", "r1", "r2", "r3"], "each request of the burst counts where it goes"
        for group in range(4):  # keyword arguments work too
            follower = pending(prompt(group), as_kwarg=True)
            assert names(await router.choose_replicas(replicas, follower))[0] == [chosen[group]]
        # Serve sent the first leader elsewhere (its replica was full): the record follows it.
        by_name = {r.replica_id.unique_id: r for r in replicas}
        elsewhere = next(name for name in by_name if name != chosen[0])
        router.on_request_routed(leaders[0], by_name[elsewhere].replica_id, None)
        router.replica_queue_len_cache.update(by_name[chosen[0]].replica_id, 16)
        ranking = await router.choose_replicas(replicas, pending(prompt(0)))
        assert names(ranking)[0] == [elsewhere]
        assert router.policy.num_rejected_reports == 0  # empty routing stats are not reports

    run(go())


def test_sent_requests_leave_the_in_transit_count():
    async def go():
        replicas = [FakeReplica(f"r{i}") for i in range(2)]
        router = make_router(replicas)
        await asyncio.sleep(0.05)  # Serve probes the new replicas' queue lengths
        request = pending(prompt(9))
        first = names(await router.choose_replicas(replicas, request))[0][0]
        other = "r1" if first == "r0" else "r0"
        # Retries of one request count once.
        await router.choose_replicas(replicas, request)
        ids = {r.replica_id.unique_id: r.replica_id for r in replicas}
        assert router._job_counts({i: None for i in ids.values()}) == {ids[first]: 1, ids[other]: 0}
        router.on_send_request(ids[first])  # the queue-length cache counts it now, in transit no more
        assert router._job_counts({i: None for i in ids.values()}) == {ids[first]: 1, ids[other]: 0}

    run(go())


def test_calls_without_a_prompt_rank_every_replica_by_load():
    async def go():
        replicas = [FakeReplica(f"r{i}") for i in range(3)]
        replicas[0].report(running=6)
        replicas[1].report(running=0)
        router = make_router(replicas)
        for request in (None, pending()):  # model_info(): no EngineRequest among the arguments
            ranking = await router.choose_replicas(replicas, request)
            assert sorted(name for rank in names(ranking) for name in rank) == ["r0", "r1", "r2"]
            assert names(ranking)[-1] == ["r0"]  # the busiest last; r2 (no report yet) counts as idle
        assert router.decision_modes["no_prompt"] == 2
        request = pending(prompt(5))
        await router.choose_replicas(replicas, request)
        assert request.routing_context.should_backoff  # every candidate was ranked: back off if all refuse
        assert prompt_token_ids(None) == () and prompt_token_ids(pending()) == ()

    run(go())


def test_fresh_queue_lengths_outrank_stale_reports():
    async def go():
        replicas = [FakeReplica(f"r{i}") for i in range(2)]
        for r in replicas:
            r.report()
        router = make_router(replicas)
        router.replica_queue_len_cache.update(replicas[0].replica_id, 5)
        router.replica_queue_len_cache.update(replicas[1].replica_id, 1)
        assert names(await router.choose_replicas(replicas, pending(prompt(6))))[0] == ["r1"]

    run(go())


def test_dead_and_new_replicas():
    async def go():
        replicas = [FakeReplica(f"r{i}") for i in range(3)]
        group = prompt(7)
        replicas[1].hold(page_hashes(group, PAGE_SIZE)[:4])
        for r in replicas:
            r.report()
        router = make_router(replicas)
        assert names(await router.choose_replicas(replicas, pending(group)))[0] == ["r1"]
        router.on_replica_actor_died(replicas[1].replica_id)
        assert replicas[1].replica_id not in router.policy.index
        alive = [replicas[0], replicas[2]]
        await router.choose_replicas(alive, pending(group))
        assert router.decision_modes["load"] == 1  # its pages died with it
        # The controller replaces it: the newcomer is tracked, and ranked, before its first report.
        newcomer = FakeReplica("r3")
        router.update_replicas([*alive, newcomer])
        assert set(router.policy.index.replica_ids) == {r.replica_id for r in (*alive, newcomer)}
        ranking = await router.choose_replicas([*alive, newcomer], pending(prompt(10)))
        assert {"r3"} <= {name for rank in names(ranking) for name in rank}
        # Its first report, broadcast through update_replicas, makes it the prefix's holder.
        newcomer.hold(page_hashes(group, PAGE_SIZE)[:4])
        newcomer.report()
        router.update_replicas([*alive, newcomer])
        assert names(await router.choose_replicas([*alive, newcomer], pending(group)))[0] == ["r3"]

    run(go())


def test_an_unreachable_holder_is_ranked_last_until_its_time_is_up(monkeypatch):
    """A call that failed as if its replica were gone (gRPC's only sign of a replica killed mid-call): the prefix's
    holder goes to the end of every ranking for UNREACHABLE_TTL_S, keeps its pages in the index, and comes back."""
    # the module the class runs in (another test may have imported a second copy of folio.router.ray_router)
    module = PrefixAwareRequestRouter._split_unreachable.__globals__

    async def go():
        replicas = [FakeReplica(f"r{i}") for i in range(3)]
        group, other_group = prompt(8), prompt(9)
        replicas[1].hold(page_hashes(group, PAGE_SIZE)[:4])
        replicas[1].hold(page_hashes(other_group, PAGE_SIZE)[:4])
        for r in replicas:
            r.report()
        router = make_router(replicas)
        assert names(await router.choose_replicas(replicas, pending(group)))[0] == ["r1"]
        now = [time.monotonic()]
        monkeypatch.setitem(module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))  # its clock only
        router.on_replica_actor_unavailable(replicas[1].replica_id)
        ranking = names(await router.choose_replicas(replicas, pending(group)))
        assert ranking[-1] == ["r1"] and sorted(ranking[:2]) == [["r0"], ["r2"]]
        assert replicas[1].replica_id in router.policy.index.replica_ids
        # When every candidate is unreachable there is nothing better: the policy ranks them as usual.
        assert names(await router.choose_replicas([replicas[1]], pending(group))) == [["r1"]]
        now[0] += module["UNREACHABLE_TTL_S"] + 0.1
        # (`group` was routed elsewhere meanwhile, and the router expects its pages there now: another group; and
        # fresh reports, so that the requests routed above weigh nowhere as load.)
        for r in replicas:
            r.report()
        router.update_replicas(replicas)
        assert names(await router.choose_replicas(replicas, pending(other_group)))[0] == ["r1"]

    run(go())


def test_a_busy_holder_loses_to_an_idle_replica():
    """The holder's 64 cached tokens save less than its queue costs (10 jobs wait for its 8 batch slots): ranked
    second, in an affinity decision."""
    async def go():
        replicas = [FakeReplica(f"r{i}") for i in range(2)]
        group = prompt(8)
        replicas[0].hold(page_hashes(group, PAGE_SIZE)[:4])
        replicas[0].report(running=8, queued=10)
        replicas[1].report()
        router = make_router(replicas, shortlist_size=1, sampled=1)
        decision = router.policy.choose([r.replica_id for r in replicas], group)
        assert decision.num_cached_tokens[replicas[0].replica_id] == 4 * PAGE_SIZE
        assert names(await router.choose_replicas(replicas, pending(group))) == [["r1"], ["r0"]]
        assert router.decision_modes["affinity"] == 1

    run(go())


# --- on a local Ray cluster --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from folio.demo import write_demo_model
    from folio.serve import local
    from folio.serve.config import ServeConfig

    model_dir = write_demo_model(tmp_path_factory.mktemp("router") / "demo-model")
    config = ServeConfig(model_path=str(model_dir), num_gpus=0, num_cpus=0.5, ingress_num_cpus=0.2, num_replicas=2,
                         cache_tokens=2048, page_size=PAGE_SIZE, max_batch_size=16, max_queue_size=16,
                         grpc_port=free_port(), http_port=free_port(), app_name="routed", router="prefix",
                         routing_stats_period_s=0.5)
    local.start_cluster(config)
    try:
        local.deploy(config)
        yield config
    finally:
        local.shutdown()


def _complete(prompts, max_new_tokens: int = 4):
    """Completions of token-id prompts, sent concurrently through the application's ingress."""
    from folio.serve.client import Client

    client = Client("routed")

    async def all_of():
        return await asyncio.gather(*(client.complete(list(p), max_new_tokens=max_new_tokens, stop_on_eos=False,
                                                      temperature=0.0) for p in prompts))

    return asyncio.run(all_of())


@pytest.mark.ray
def test_replicas_report_digests(cluster):
    from folio.router.digest import parse_digest
    from folio.serve.client import replica_stats

    digests = {name: parse_digest(stats) for name, stats in replica_stats("routed").items()}
    assert len(digests) == 2
    assert all(d.page_size == PAGE_SIZE and d.max_running == 16 and d.num_pages == 128 for d in digests.values())
    assert len({d.instance_id for d in digests.values()}) == 2


@pytest.mark.ray
def test_shared_prefixes_stick_to_one_replica_and_hit_its_cache(cluster):
    # 8 pages: routing keys fall every 64 tokens at the start of a prompt (folio.router.keys), so the router sees
    # the whole prefix cached. On a loaded machine two identical replicas' first prefill-rate measurements differ by
    # up to a few times; routers weigh them against the fleet's by their counts (folio.router.cost), and a prefix
    # worth 128 of ~140 prompt tokens outweighs what remains.
    prefix_pages = 8
    rng = random.Random(0)
    prefixes = [[rng.randrange(50, 950) for _ in range(prefix_pages * PAGE_SIZE)] for _ in range(8)]

    def with_suffix(prefix):
        return prefix + [rng.randrange(50, 950) for _ in range(rng.randrange(5, 15))]

    leaders = _complete([with_suffix(p) for p in prefixes])  # concurrently: no prefix is cached anywhere yet
    home = [c.finish.replica_id for c in leaders]
    assert len(set(home)) == 2, f"different prefixes spread over the replicas: {home}"
    # Reports sampled during the burst show prefill backlog for a while: the followers below must meet both
    # replicas idle, so that only the prefix differs.
    time.sleep(4 * cluster.routing_stats_period_s)
    for _ in range(2):  # followers one at a time: the prefix decides, not the load
        for group, prefix in enumerate(prefixes):
            completion = _complete([with_suffix(prefix)])[0]
            usage = completion.finish.usage
            assert completion.finish.replica_id == home[group], (group, completion.finish.replica_id, home, usage)
            assert usage.cached_tokens >= prefix_pages * PAGE_SIZE, usage


@pytest.mark.ray
def test_requests_are_served_after_a_replica_is_killed(cluster):
    """Runs last: it takes one of the two replicas down (Serve starts a replacement)."""
    import ray

    from folio.serve.client import generator_replicas

    prefix = [random.Random(1).randrange(50, 950) for _ in range(4 * PAGE_SIZE)]
    home = _complete([prefix + [7, 8, 9]])[0].finish.replica_id
    ray.kill(generator_replicas("routed")[home], no_restart=True)
    # Over gRPC the killed process may still answer a call for a moment after ray.kill (and after Ray reports
    # the actor dead): every request must be served, wherever it went, and the rest must go elsewhere.
    completions = [_complete([prefix + [10 + i, 11, 12]])[0] for i in range(12)]
    assert all(c.finish.usage.completion_tokens == 4 for c in completions)
    moved = [c for c in completions if c.finish.replica_id != home]
    assert moved and completions[-1].finish.replica_id != home, [c.finish.replica_id for c in completions]
    # The prefix's new home computed it once; the requests after it reuse it there.
    assert all(c.finish.usage.cached_tokens == 4 * PAGE_SIZE for c in moved[1:]), \
        [(c.finish.replica_id, c.finish.usage) for c in completions]
