"""PrefixAwareRequestRouter: Ray Serve's RequestRouter around folio.router.policy, for the generator deployment.

    RequestRouterConfig(request_router_class="folio.router.ray_router:PrefixAwareRequestRouter",
                        request_router_kwargs={...PolicyConfig fields...}, request_routing_stats_period_s=1)

One instance lives in each process that holds a handle to the generator deployment (the ingress replicas), and
Serve calls it on that process's event loop:
  - initialize_state(**request_router_kwargs): the policy's settings (folio.router.policy.PolicyConfig; the
    defaults need no tuning).
  - update_replicas(replicas): the replica set changed, or a replica's routing stats did (Serve broadcasts every
    replica's record_routing_stats dict, the report of folio.router.digest, as part of its replica info). Each new
    report's cache-event batches are applied to the index once (every ingress replica's router applies the same
    batches, so all of them see the same cache state).
  - choose_replicas(candidates, pending_request): ranks, best first. Pure and non-blocking: hashes the prompt's
    token ids (the EngineRequest the ingress sends, first positional argument) and asks the policy, which predicts
    each replica's time to first token. Calls without a prompt (model_info, tokenize) and replicas that reported
    nothing yet are ranked by predicted wait alone.
  - The request's prompt pages are recorded for the replica ranked first as soon as it is chosen (they will be
    there shortly: the in-flight case no report shows yet), and the request counts in that replica's load until
    on_send_request; on_request_routed corrects the record when Serve sent it elsewhere (rank 0 was full).
  - on_replica_actor_died(replica_id): forget the replica at once, before the controller says so.
  - on_replica_actor_unavailable(replica_id): a call to the replica failed as if it were gone (the only sign a
    replica killed mid-call gives when calls go over gRPC). It is ranked last for UNREACHABLE_TTL_S: the
    controller drops a dead one within that time, and a live one (a network blip) comes back by itself.

Serve tries rank 0 first (the shortest queue inside a rank), a replica at max_ongoing_requests rejects, and then
the next rank is tried: returning every candidate ranked means a full replica costs a retry, not a backoff.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from folio.hashing import sequence_namespace
from folio.router.policy import Decision, PolicyConfig, PrefixRouterPolicy

# Decisions waiting for on_request_routed. A request cancelled while routing never gets that call, so the map is
# bounded (oldest dropped).
MAX_PENDING_DECISIONS = 4096
# A request chosen for a replica counts there until Serve sends it (on_send_request), at most this long.
IN_TRANSIT_TTL_S = 1.0
# A replica a call just failed to reach is ranked after every other for this long (see on_replica_actor_unavailable).
UNREACHABLE_TTL_S = 5.0


class PrefixAwareRequestRouter(RequestRouter):
    _policy: PrefixRouterPolicy | None = None

    def initialize_state(self, **kwargs: Any) -> None:
        """kwargs: folio.router.policy.PolicyConfig's fields (unknown names raise TypeError)."""
        self._policy = PrefixRouterPolicy(PolicyConfig(**kwargs))
        self._expected: OrderedDict[str, _Expected] = OrderedDict()  # request key -> where it should go
        self._in_transit: dict[ReplicaID, deque[float]] = {}  # chosen, not sent yet: when chosen, oldest first
        self._unreachable_until: dict[ReplicaID, float] = {}  # time.monotonic() until which it is ranked last
        self._candidate_ids: tuple[list[RunningReplica], list[ReplicaID]] = ([], [])  # (_ids_of)
        self.decision_modes: Counter[str] = Counter()  # how rankings were made, for diagnostics and tests

    @property
    def policy(self) -> PrefixRouterPolicy:
        if self._policy is None:  # Serve calls initialize_state right after construction; be safe anyway
            self.initialize_state()
        return self._policy

    # ---- replicas and their reports ---------------------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.policy.sync_replicas(self.curr_replicas)
        self._candidate_ids = ([], [])
        for replica_id in [r for r in self._in_transit if r not in self.curr_replicas]:
            del self._in_transit[replica_id]
        for replica in replicas:
            self._apply_report(replica)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.remove_replica(replica_id)
        self._in_transit.pop(replica_id, None)
        self._unreachable_until.pop(replica_id, None)

    def on_replica_actor_unavailable(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_unavailable(replica_id)
        self._unreachable_until[replica_id] = time.monotonic() + UNREACHABLE_TTL_S

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
        candidate_replicas, unreachable = self._split_unreachable(candidate_replicas)
        # (no reports applied here: Serve broadcasts new routing stats through update_replicas, and a pass over every
        # candidate per request would cost a fleet of 512 replicas about as much as the decision itself)
        token_ids = prompt_token_ids(pending_request)
        decision = self.policy.choose(self._ids_of(candidate_replicas), token_ids, prompt_namespace(pending_request),
                                      num_jobs=self._job_counts)
        self.decision_modes[decision.mode.value if token_ids else "no_prompt"] += 1
        if pending_request is not None and decision.best is not None:
            self._expect(pending_request, decision, bool(token_ids))
        # One replica per rank, ties already broken by the policy's rng: Serve sends to rank 0 unless it is full,
        # so the replica this router expects is the one it gets.
        return [[candidate_replicas[pos]] for pos in decision.order] + [[r] for r in unreachable]

    def _ids_of(self, candidates: list[RunningReplica]) -> list[ReplicaID]:
        """The candidates' replica ids, kept for the next call with the same candidates (Serve passes its replica
        wrappers, reused from call to call, and reading each one's id is a Python property: at hundreds of replicas
        a pass over them costs more than the decision)."""
        cached, ids = self._candidate_ids
        if len(cached) != len(candidates) or cached != candidates:
            ids = [r.replica_id for r in candidates]
            self._candidate_ids = (list(candidates), ids)
        return ids

    def _split_unreachable(self, candidates: list[RunningReplica]
                           ) -> tuple[list[RunningReplica], list[RunningReplica]]:
        """(the candidates to rank, the ones a call recently failed to reach), the latter empty when every
        candidate is in it (then there is nothing better to try)."""
        if not self._unreachable_until:
            return candidates, []
        now = time.monotonic()
        for replica_id in [r for r, until in self._unreachable_until.items() if until <= now]:
            del self._unreachable_until[replica_id]
        unreachable = [r for r in candidates if r.replica_id in self._unreachable_until]
        if not unreachable or len(unreachable) == len(candidates):
            return candidates, []
        return [r for r in candidates if r.replica_id not in self._unreachable_until], unreachable

    def on_send_request(self, replica_id: ReplicaID) -> None:
        # Serve's queue-length cache counts the request from now on. (Which request is not said: the oldest one
        # chosen for this replica leaves the in-transit count; when Serve sent one elsewhere, its entry expires.)
        super().on_send_request(replica_id)
        sent = self._in_transit.get(replica_id)
        if sent:
            sent.popleft()

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        expected = self._expected.pop(_request_key(pending_request), None)
        if expected is not None and expected.replica_id != replica_id and expected.decision is not None:
            self.policy.on_routed(replica_id, expected.decision)  # rank 0 was full: it went elsewhere

    def _expect(self, pending_request: PendingRequest, decision: Decision, has_prompt: bool) -> None:
        """Count the request where it will most likely go, now rather than when Serve confirms it: a routing task
        routes a burst of requests back to back, before any of them is sent, and without this every request of
        the burst would see the same loads, and a follower would not see its leader's prefix."""
        key = _request_key(pending_request)
        if key in self._expected:
            return  # a retry of a request already counted (its first choice refused it)
        best = decision.best
        self._expected[key] = _Expected(best, decision if has_prompt else None)
        while len(self._expected) > MAX_PENDING_DECISIONS:
            self._expected.popitem(last=False)
        if has_prompt:
            self.policy.on_routed(best, decision)
        self._in_transit.setdefault(best, deque()).append(time.monotonic())

    def _job_counts(self, replica_ids: list[ReplicaID]) -> dict[ReplicaID, int]:
        """Requests on each of these replicas (the policy asks for the ones it scores): Serve's queue-length cache
        where it has a fresh entry (updated on every send, completion and rejection, so fresher than a digest a
        period old) plus the requests chosen for it and not sent yet. Replicas without an entry are left to the
        policy (last digest + what was routed since)."""
        cache = self.replica_queue_len_cache
        horizon = time.monotonic() - IN_TRANSIT_TTL_S
        counts = {}
        for replica_id in replica_ids:
            queue_len = cache.get(replica_id)
            if queue_len is None:
                continue
            sent = self._in_transit.get(replica_id)
            while sent and sent[0] < horizon:  # chosen, never sent (cancelled, or sent elsewhere)
                sent.popleft()
            counts[replica_id] = queue_len + (len(sent) if sent else 0)
        return counts


@dataclass(frozen=True, slots=True)
class _Expected:
    replica_id: ReplicaID
    decision: Decision | None  # None: the call had no prompt


def prompt_token_ids(pending_request: PendingRequest | None) -> Sequence[int]:
    """The prompt's token ids: `input_ids` of the first argument that has them (folio.serve.schema.EngineRequest),
    positional or keyword; () when the call carries no prompt."""
    if pending_request is None:
        return ()
    for value in (*pending_request.args, *pending_request.kwargs.values()):
        input_ids = getattr(value, "input_ids", None)
        if input_ids is not None:
            return input_ids
    return ()


def prompt_namespace(pending_request: PendingRequest | None) -> bytes:
    """The hash namespace the replica will file the prompt's pages under (folio.hashing.sequence_namespace): the
    LoRA adapter's id and the injected embeddings' digest that the ingress put on the request (hex strings); b""
    for the base model and a prompt of tokens only."""
    if pending_request is None:
        return b""
    for value in (*pending_request.args, *pending_request.kwargs.values()):
        adapter_id = getattr(value, "lora_adapter_id", None)
        if adapter_id is not None:
            embeddings = getattr(value, "embeddings_digest", "")
            return sequence_namespace(adapter_id=bytes.fromhex(adapter_id) if adapter_id else None,
                                      embeddings_digest=bytes.fromhex(embeddings) if embeddings else None)
    return b""


def _request_key(pending_request: PendingRequest) -> str:
    return pending_request.metadata.internal_request_id
