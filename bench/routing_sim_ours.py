"""bench/routing_sim.py's adapter for folio's router: the real folio.router code, fed every report period with the
reports (folio.router.digest) the simulated replicas build from their real page pools' events; and the
decision-time measurement at a scale the simulation does not reach.

Several ingress routers (OurRouter instances over the same replicas) receive the same report of a replica at one
tick, as Serve's controller broadcasts one record to every router: a replica's report is built once per tick.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from array import array

from folio.router.digest import DIGEST_VERSION, ReplicaDigest, Snapshot, build_digest
from folio.router.events import DEFAULT_HISTORY, CacheEvents, pack
from folio.router.keys import KeyGeometry
from folio.router.policy import PolicyConfig, PrefixRouterPolicy
from folio.router.rates import ReplicaRates


class _Reporter:
    """One simulated replica's report source: its pool's events and its measured rates."""

    def __init__(self, replica, args: argparse.Namespace) -> None:
        self.events = CacheEvents(replica.page_size, getattr(args, "block_tokens", 256))
        # The simulated replica's speeds are constants of the simulation: what measuring them at length would give.
        self.rates = ReplicaRates(prefill_tokens_per_s=replica.prefill_rate, decode_step_s=args.decode_step,
                                  prefill_samples=1000, decode_samples=1000)
        self.epoch = 0
        self.last: tuple[float, dict] | None = None
        self.num_events = 0
        _observe_finished(replica, self.rates)

    def report(self, replica, now: float) -> dict:
        if self.last is not None and self.last[0] == now:
            return self.last[1]
        drained = replica.pool.drain_events()
        self.num_events += len(drained)
        self.events.add(drained)
        self.epoch += 1
        digest = build_digest(replica.pool, self.events, replica.num_running, len(replica.waiting), self.epoch,
                              instance_id=f"sim-{replica.replica_id}", max_running=replica.max_running,
                              num_prefill_tokens=replica.num_prefill_tokens(now),
                              num_received=replica.num_requests, rates=self.rates)
        self.last = (now, digest)
        return digest


def _observe_finished(replica, rates: ReplicaRates) -> None:
    """Wrap the replica's finish() to measure tokens generated per job, as the engine's replica does."""
    finish = replica.finish

    def observed(job) -> None:
        rates.observe_finished(job.req.num_response_tokens)
        finish(job)

    replica.finish = observed


def reporter_of(replica, args: argparse.Namespace) -> _Reporter:
    """The replica's report source, one per replica however many routers read it (kept on the replica)."""
    found = getattr(replica, "folio_reporter", None)
    if found is None:
        found = replica.folio_reporter = _Reporter(replica, args)
    return found


class OurRouter:
    name = "ours"

    def __init__(self, replicas: list, args: argparse.Namespace, clock) -> None:
        self.replicas = replicas
        self.args = args
        self.policy = PrefixRouterPolicy(PolicyConfig(default_page_size=args.page_size, seed=args.seed),
                                         clock=clock)
        self.ids = list(range(len(replicas)))
        self.policy.sync_replicas(self.ids)
        self.reporters = [reporter_of(r, args) for r in replicas]
        self.digest_bytes = 0
        # Requests sent to a replica holding less of the prompt than the best-placed candidate (the cost model chose
        # to compute the difference again), and that difference in tokens: where hit rate goes for balance.
        self.num_past_holder = self.tokens_past_holder = 0

    def key_events_per_replica_s(self) -> float:
        """Routing-key events (stored + evicted, net) the replicas published per replica and report period."""
        reports = sum(r.epoch for r in self.reporters)
        return sum(r.events.num_published_events for r in self.reporters) / max(reports, 1)

    def route(self, req, now: float) -> int:
        prompt = req.conv.token_ids[:req.num_prompt_tokens].tolist()
        decision = self.policy.choose(self.ids, prompt)
        self.policy.on_routed(decision.best, decision)
        cached = decision.num_cached_tokens
        shortfall = max(cached.values(), default=0) - cached.get(decision.best, 0)
        if shortfall > 0:
            self.num_past_holder += 1
            self.tokens_past_holder += shortfall
        return decision.best

    def tick(self, now: float) -> None:
        for replica, reporter in zip(self.replicas, self.reporters):
            digest = reporter.report(replica, now)
            if reporter.epoch % 16 == 1:  # sampled: encoding JSON costs more than the report itself
                self.digest_bytes = max(self.digest_bytes, len(json.dumps(digest)))
            self.policy.report(replica.replica_id, digest)


# ---- decision time at scale -------------------------------------------------------------------------------------


class DecisionState:
    def __init__(self, policy: PrefixRouterPolicy, ids: list[int], prefixes: list[list[int]], block_tokens: int,
                 rng: random.Random) -> None:
        self.policy, self.ids, self.prefixes, self.block_tokens, self.rng = policy, ids, prefixes, block_tokens, rng
        self.epoch = 1
        self.history: dict[int, list] = {}  # replica -> its last batches, as reports carry them
        self.shared_prefix: list[int] = []  # a prefix on many replicas (build_decision_state's shared_holders)


def _digest(replica: int, epoch: int, keys: array, batches: tuple, page_size: int, rng: random.Random,
            snapshot: bool) -> ReplicaDigest:
    return ReplicaDigest(
        instance_id=f"r{replica}", epoch=epoch, num_running=rng.randint(0, 32), num_queued=rng.randint(0, 4),
        max_running=32, num_prefill_tokens=rng.randint(0, 8192), num_received=0, page_size=page_size, num_pages=8192,
        num_free_pages=0, num_allocatable_pages=4096, prefill_tokens_per_s=rng.uniform(6000, 10000),
        decode_step_s=0.03, mean_new_tokens=200.0, block_tokens=256, dense_tokens=0, dense_key_tokens=64, seq=epoch,
        batches=batches, snapshot=Snapshot(epoch, keys) if snapshot else None)


def build_decision_state(num_replicas: int, num_prefixes: int, page_size: int, rng: random.Random,
                         shared_holders: int = 0) -> DecisionState:
    """A router whose index holds num_prefixes cached prefixes (chains of 1-16 routing keys, random 64-bit keys as
    BLAKE2b-derived keys are) spread over num_replicas replicas, each prefix on one to three of them; and, with
    shared_holders, one more prefix of 8 keys (a common system prompt) on that many replicas
    (DecisionState.shared_prefix)."""
    policy = PrefixRouterPolicy(PolicyConfig(default_page_size=256, default_dense_tokens=0, seed=0))
    ids = list(range(num_replicas))
    policy.sync_replicas(ids)
    held: list[list[int]] = [[] for _ in ids]
    prefixes = []
    for _ in range(num_prefixes):
        chain = [rng.getrandbits(64) for _ in range(rng.randint(1, 16))]
        prefixes.append(chain)
        for replica in rng.sample(ids, rng.randint(1, 3)):
            held[replica].extend(chain)
    shared = [rng.getrandbits(64) for _ in range(8)] if shared_holders else []
    for replica in rng.sample(ids, min(shared_holders, len(ids))):
        held[replica].extend(shared)
    for replica in ids:
        policy.report(replica, _digest(replica, 1, array("Q", held[replica]), (), page_size, rng, True))
    state = DecisionState(policy, ids, prefixes, 256, rng)
    state.shared_prefix = shared
    return state


def time_decisions(state: DecisionState, num_decisions: int, shared: bool = False) -> list[float]:
    """Seconds per decision (choose + on_routed) for prompts that extend a cached prefix (most) or share nothing,
    or with `shared`, that all extend state.shared_prefix; their routing keys computed beforehand (the ingress
    hashes a prompt once)."""
    rng, policy = state.rng, state.policy
    prompts = []
    for i in range(num_decisions):
        base = state.shared_prefix if shared else rng.choice(state.prefixes) if i % 4 else []
        keys = base + [rng.getrandbits(64) for _ in range(rng.randint(1, 8))]
        prompts.append((keys, len(keys) * state.block_tokens + rng.randint(1, 255)))
    times = []
    for keys, num_tokens in prompts:
        start = time.perf_counter()
        decision = policy.choose(state.ids, keys=keys, num_prompt_tokens=num_tokens)
        policy.on_routed(decision.best, decision)
        times.append(time.perf_counter() - start)
    return times


def time_event_apply(state: DecisionState, events_per_replica: int) -> float:
    """Seconds to apply one report per replica, each carrying events_per_replica new events (half stored, half
    evicted: a replica's events of one period) among its last DEFAULT_HISTORY batches, as the JSON-able dict a
    router receives from Serve (decoding included) and the cost table's refresh that follows, as a router does each
    period."""
    rng, policy = state.rng, state.policy
    state.epoch += 1
    reports = []
    for replica in state.ids:
        held = sorted(policy.index.held_keys(replica))
        evicted = rng.sample(held, min(len(held), events_per_replica // 2))
        stored = [rng.getrandbits(64) for _ in range(events_per_replica - len(evicted))]
        history = state.history.setdefault(replica, [])
        history.append([state.epoch, pack(stored), pack(evicted)])
        del history[:-DEFAULT_HISTORY]
        digest = _digest(replica, state.epoch, array("Q"), (), 16, rng, False)
        report = {field: getattr(digest, field) for field in digest.__slots__ if field not in ("batches", "snapshot")}
        reports.append(json.loads(json.dumps({"v": DIGEST_VERSION, **report, "batches": list(history),
                                              "snapshot": None})))
    start = time.perf_counter()
    for replica, report in zip(state.ids, reports):
        policy.report(replica, report)
    policy.loads.refresh()  # the reports' loads are written into the cost arrays here (at the next decision)
    return time.perf_counter() - start


def busy_replica_key_events(page_size: int, prefill_tokens: float, prompt_tokens: int) -> int:
    """Routing-key events of a replica that prefills `prefill_tokens` of prompts of prompt_tokens sharing nothing:
    each prompt's keys stored (folio.router.keys at the default geometry), and as many evicted."""
    num_keys = len(KeyGeometry(page_size).depths(prompt_tokens // page_size))
    return max(2, round(2 * num_keys * prefill_tokens / prompt_tokens))


def summarize(times: list[float]) -> tuple[float, float]:
    ordered = sorted(times)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
