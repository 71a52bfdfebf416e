"""PrefixAwareRequestRouter: Ray Serve's RequestRouter around router.policy, for the generator deployment.

    RequestRouterConfig(request_router_class="router.ray_router:PrefixAwareRequestRouter",
                        request_router_kwargs={...PolicyConfig fields...}, request_routing_stats_period_s=1)

One instance lives in each process that holds a handle to the generator deployment (the ingress replicas), and
Serve calls it on that process's event loop:
  - initialize_state(**request_router_kwargs): the policy's weights, thresholds and TTL (router.policy.PolicyConfig).
  - update_replicas(replicas): the replica set changed, or a replica's routing stats did (Serve broadcasts every
    replica's record_routing_stats dict, the digest of router.digest, as part of its replica info).
  - choose_replicas(candidates, pending_request): ranks, best first. Pure and non-blocking: reads each candidate's
    last digest (parsed once per epoch), hashes the prompt's token ids (the EngineRequest the ingress sends, first
    positional argument) and asks the policy. Calls without a prompt (model_info, tokenize) and replicas that
    reported nothing yet are ranked by load alone.
  - on_request_routed(...): a replica accepted the request: its prompt pages will be there shortly (the in-flight
    case the reports cannot show yet).
  - on_replica_actor_died(replica_id): forget the replica at once, before the controller says so.

Serve tries rank 0 first (the shortest queue inside a rank), a replica at max_ongoing_requests rejects, and then
the next rank is tried: returning every candidate ranked means a full replica costs a retry, not a backoff.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from router.policy import Decision, PolicyConfig, PrefixRouterPolicy

logger = logging.getLogger("ray.serve")

# Decisions waiting for on_request_routed. A request that is cancelled while routing never gets that call, so the
# map is bounded (oldest dropped): a dropped decision only means its prompt's pages are not recorded as routed.
MAX_PENDING_DECISIONS = 4096


class PrefixAwareRequestRouter(RequestRouter):
    _policy: PrefixRouterPolicy | None = None

    def initialize_state(self, **kwargs: Any) -> None:
        """kwargs: router.policy.PolicyConfig's fields (unknown names raise TypeError)."""
        self._policy = PrefixRouterPolicy(PolicyConfig(**kwargs))
        self._decisions: OrderedDict[str, Decision] = OrderedDict()
        self.decision_modes: Counter[str] = Counter()  # how rankings were made, for diagnostics and tests

    @property
    def policy(self) -> PrefixRouterPolicy:
        if self._policy is None:  # Serve calls initialize_state right after construction; be safe anyway
            self.initialize_state()
        return self._policy

    # ---- replicas and their reports ---------------------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        policy = self.policy
        policy.sync_replicas(self.curr_replicas)
        for replica in replicas:
            self._apply_report(replica)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.remove_replica(replica_id)

    def _apply_report(self, replica: RunningReplica) -> None:
        stats = replica.routing_stats
        if stats:  # {} until the controller's first poll of the replica answered
            self.policy.report(replica.replica_id, stats)  # skips decoding a digest it has seen (same epoch)

    # ---- routing ----------------------------------------------------------------------------------------------

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Every candidate is in the ranking: when all of them refused, retrying at once would spin.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        by_id = {}
        for replica in candidate_replicas:
            by_id[replica.replica_id] = replica
            self._apply_report(replica)
        token_ids = prompt_token_ids(pending_request)
        decision = self.policy.choose(list(by_id), token_ids, num_jobs=self._fresh_queue_lens(by_id))
        self.decision_modes[decision.mode.value if token_ids else "no_prompt"] += 1
        logger.info("DEBUGROUTE %s %s costs=%s cached=%s qlens=%s", decision.mode, len(token_ids),
                    {r.unique_id: c for r, c in decision.costs.items()},
                    {r.unique_id: c for r, c in decision.num_cached_tokens.items()},
                    {r.unique_id: c for r, c in self._fresh_queue_lens(by_id).items()})
        if token_ids and pending_request is not None:
            self._remember(pending_request, decision)
        return [[by_id[replica_id] for replica_id in rank] for rank in decision.ranking]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        decision = self._decisions.pop(_request_key(pending_request), None)
        if decision is not None:
            self.policy.on_routed(replica_id, decision)

    def _fresh_queue_lens(self, by_id: dict[ReplicaID, RunningReplica]) -> dict[ReplicaID, int]:
        """Requests each replica runs, from Serve's queue-length cache where it has a fresh entry: updated on
        every send, completion and rejection, so fresher than a digest a period old."""
        cache = self.replica_queue_len_cache
        lens = {}
        for replica_id in by_id:
            queue_len = cache.get(replica_id)
            if queue_len is not None:
                lens[replica_id] = queue_len
        return lens

    def _remember(self, pending_request: PendingRequest, decision: Decision) -> None:
        key = _request_key(pending_request)
        self._decisions.pop(key, None)  # a retry of the same request replaces its decision
        self._decisions[key] = decision
        while len(self._decisions) > MAX_PENDING_DECISIONS:
            self._decisions.popitem(last=False)


def prompt_token_ids(pending_request: PendingRequest | None) -> Sequence[int]:
    """The prompt's token ids: `input_ids` of the first argument that has them (replicas.schema.EngineRequest),
    positional or keyword; () when the call carries no prompt."""
    if pending_request is None:
        return ()
    for value in (*pending_request.args, *pending_request.kwargs.values()):
        input_ids = getattr(value, "input_ids", None)
        if input_ids is not None:
            return input_ids
    return ()


def _request_key(pending_request: PendingRequest) -> str:
    return pending_request.metadata.internal_request_id
