"""The routing policy: rank candidate replicas for one request by what its prompt would cost on each.

    cost(r) = prefill_token_weight * uncached_prompt_tokens(r) + backlog_token_weight * prefill_backlog_tokens(r)
            + running_job_tokens * num_running(r) + queued_job_tokens * num_queued(r)
            + page_shortfall_weight * page_size * max(0, pages_needed(r) - num_allocatable_pages(r))

All in prompt tokens of prefill. uncached_prompt_tokens: what r would have to prefill of this prompt (the prompt less
the leading pages r holds). prefill_backlog_tokens: prompt tokens r must prefill before or beside ours (its
report's num_prefill_tokens plus what this router sent it since, less the matched pages this router sent it but no
report confirmed yet: a request following an in-flight prompt with the same prefix waits for those very pages
there instead of computing them again, so they are no extra delay). A backlog token weighs half a token of this
prompt: it only delays this request, while a token of its own also adds work that delays every later request on
that replica (under load, total prefill work is what sets everyone's wait). num_running / num_queued: jobs from r's last
report plus the requests this router sent it since (reports are a period old; without these a burst would pile
onto one replica), split by r's max_running. A running job costs little (a decode slot, a little bandwidth); a
queued job means waiting for a slot to free. The shortfall term penalises a replica that would have to preempt to
fit the request (pages_needed = uncached pages + 1 to grow into).

Lowest cost first. Two cases fall out of the formula: with no cached prefix anywhere the uncached term is equal
everywhere and requests spread by load; a hot prefix is replicated to a second replica once its holder is busier
than the prefix is worth. When the candidates' job counts spread by more than `imbalance_threshold` (max - min),
prefixes are ignored and the ranking is by job count alone until the load evens out, as every mature prefix router
does. Ties are broken by a seeded rng, so runs replay exactly.

`rank_replicas` is a pure function of its inputs. `PrefixRouterPolicy` holds the state around it (the index, the
clock, the rng) and is what a Ray Serve RequestRouter calls from `choose_replicas`: no I/O, no awaiting, and
O(prompt pages + candidates log candidates) per request, the hashing of the prompt (folio.hashing) included.
"""

from __future__ import annotations

import enum
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from folio.hashing import page_hashes
from folio.router.digest import DigestError, ReplicaDigest, page_keys, parse_digest
from folio.router.index import DEFAULT_MAX_ROUTED_PAGES, DEFAULT_ROUTED_TTL_S, Match, PrefixIndex, ReplicaId


class Mode(enum.Enum):
    """How a ranking was made."""

    AFFINITY = "affinity"  # by cost; some candidate holds part of the prompt
    LOAD = "load"  # by cost; no candidate holds any of the prompt, so load decides
    IMBALANCED = "imbalanced"  # by job count alone: the candidates' load spread exceeds the threshold


@dataclass(frozen=True)
class PolicyConfig:
    """Weights of the cost (see the module docstring, all in prompt tokens) and the index's settings.

    prefill_token_weight: cost of one token of this prompt to prefill (not cached on the replica).
    backlog_token_weight: cost of one token the replica must prefill for other jobs first.
    running_job_tokens / queued_job_tokens: cost of one running / queued job on the replica.
    page_shortfall_weight: cost per token of pages the replica lacks for the request (it would preempt).
    imbalance_threshold: max - min job count over the candidates above which prefixes are ignored.
    routed_ttl_s: how long a routed prompt's pages count as held before a report must confirm them.
    max_routed_pages: bound on each replica's record of routed pages.
    default_page_size: page size assumed for hashing before any replica has reported one.
    seed: the tie-breaking rng's seed.
    """

    prefill_token_weight: float = 1.0
    backlog_token_weight: float = 0.5
    running_job_tokens: float = 64.0
    queued_job_tokens: float = 1024.0
    page_shortfall_weight: float = 1.0
    imbalance_threshold: int = 16
    routed_ttl_s: float = DEFAULT_ROUTED_TTL_S
    max_routed_pages: int = DEFAULT_MAX_ROUTED_PAGES
    default_page_size: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prefill_token_weight", "backlog_token_weight", "running_job_tokens", "queued_job_tokens",
                     "page_shortfall_weight", "routed_ttl_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be >= 0, got {self.imbalance_threshold}")
        if self.default_page_size <= 0:
            raise ValueError(f"default_page_size must be positive, got {self.default_page_size}")


@dataclass(frozen=True, slots=True)
class CandidateView:
    """What the cost needs to know about one candidate. num_allocatable_pages None: unknown (no report yet)."""

    replica_id: ReplicaId
    num_cached_tokens: int
    page_size: int
    num_running: int = 0
    num_queued: int = 0
    num_backlog_tokens: int = 0
    num_allocatable_pages: int | None = None

    @property
    def num_jobs(self) -> int:
        return self.num_running + self.num_queued


@dataclass(frozen=True)
class Decision:
    """ranking: replica ids, best rank first, equal costs sharing a rank (Ray's choose_replicas shape; the
    framework tries the shortest queue inside a rank first). costs and num_cached_tokens: per candidate.
    page_keys / page_size_of: the prompt's full-page keys per page size and each candidate's page size, for
    on_routed."""

    ranking: list[list[ReplicaId]]
    mode: Mode
    costs: dict[ReplicaId, float]
    num_cached_tokens: dict[ReplicaId, int]
    num_prompt_tokens: int
    page_keys: dict[int, list[int]] = field(default_factory=dict)
    page_size_of: dict[ReplicaId, int] = field(default_factory=dict)

    @property
    def best(self) -> ReplicaId | None:
        return self.ranking[0][0] if self.ranking else None


def replica_cost(view: CandidateView, num_prompt_tokens: int, config: PolicyConfig) -> float:
    uncached = max(0, num_prompt_tokens - view.num_cached_tokens)
    cost = (config.prefill_token_weight * uncached + config.backlog_token_weight * view.num_backlog_tokens
            + config.running_job_tokens * view.num_running + config.queued_job_tokens * view.num_queued)
    if view.num_allocatable_pages is not None:
        pages_needed = math.ceil(uncached / view.page_size) + 1
        shortfall = max(0, pages_needed - view.num_allocatable_pages)
        cost += config.page_shortfall_weight * view.page_size * shortfall
    return cost


def rank_replicas(views: Sequence[CandidateView], num_prompt_tokens: int, config: PolicyConfig,
                  rng: random.Random) -> Decision:
    """Rank candidates, lowest cost first (pure apart from drawing tie-breakers from `rng`)."""
    if not views:
        return Decision([], Mode.LOAD, {}, {}, num_prompt_tokens)
    jobs = [v.num_jobs for v in views]
    if max(jobs) - min(jobs) > config.imbalance_threshold:
        mode = Mode.IMBALANCED
        costs = {v.replica_id: float(v.num_jobs) for v in views}
    else:
        mode = Mode.AFFINITY if any(v.num_cached_tokens for v in views) else Mode.LOAD
        costs = {v.replica_id: replica_cost(v, num_prompt_tokens, config) for v in views}
    tiebreak = {v.replica_id: rng.random() for v in views}
    ordered = sorted(costs, key=lambda r: (costs[r], tiebreak[r]))
    ranking: list[list[ReplicaId]] = []
    for replica_id in ordered:
        if ranking and costs[ranking[-1][0]] == costs[replica_id]:
            ranking[-1].append(replica_id)
        else:
            ranking.append([replica_id])
    cached = {v.replica_id: v.num_cached_tokens for v in views}
    return Decision(ranking, mode, costs, cached, num_prompt_tokens)


def split_jobs(num_jobs: int, digest: ReplicaDigest | None) -> tuple[int, int]:
    """(running, queued) estimate of num_jobs on a replica: up to max_running run, the rest queue; when the
    replica did not say its max_running, as many queue as its last report said."""
    if digest is None:
        return num_jobs, 0
    if digest.max_running:
        running = min(num_jobs, digest.max_running)
        return running, num_jobs - running
    queued = min(num_jobs, digest.num_queued)
    return num_jobs - queued, queued


class PrefixRouterPolicy:
    """The router's state (PrefixIndex) and policy behind one narrow API, for a RequestRouter subclass or a
    simulation to drive:

        policy.sync_replicas(ids)                      # replicas appeared / disappeared
        policy.report(replica_id, routing_stats)       # each replica's digest, when it changes
        decision = policy.choose(candidate_ids, prompt_token_ids)
        policy.on_routed(replica_id, decision)         # where the request actually went
        policy.remove_replica(replica_id)              # a replica died
    """

    def __init__(self, config: PolicyConfig | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or PolicyConfig()
        self.index = PrefixIndex(routed_ttl_s=self.config.routed_ttl_s, clock=clock,
                                 max_routed_pages=self.config.max_routed_pages)
        self._rng = random.Random(self.config.seed)
        self._num_rejected_reports = 0

    @property
    def num_rejected_reports(self) -> int:
        """Routing-stats dicts that were not valid digests (ignored)."""
        return self._num_rejected_reports

    # ---- replica set and reports ----------------------------------------------------------------------------

    def sync_replicas(self, replica_ids: Iterable[ReplicaId]) -> None:
        self.index.sync_replicas(replica_ids)

    def remove_replica(self, replica_id: ReplicaId) -> None:
        self.index.remove_replica(replica_id)

    def report(self, replica_id: ReplicaId, stats: Mapping[str, Any] | ReplicaDigest) -> bool:
        """Apply a replica's routing stats (a dict from folio.router.digest.build_digest, or a parsed digest). Returns
        whether it changed anything; an invalid dict is counted and ignored (a replica of another version must not
        break routing)."""
        if not isinstance(stats, ReplicaDigest):
            if not self._is_news(replica_id, stats):
                return False  # the same report again (routers see each one many times): skip decoding it
            try:
                stats = parse_digest(stats)
            except DigestError:
                self._num_rejected_reports += 1
                return False
        return self.index.report(replica_id, stats)

    def _is_news(self, replica_id: ReplicaId, stats: Mapping[str, Any]) -> bool:
        known = self.index.digest(replica_id)
        if known is None or not isinstance(stats, Mapping):
            return True
        epoch = stats.get("epoch")
        return (stats.get("instance_id", "") != known.instance_id or not isinstance(epoch, int)
                or epoch > known.epoch)

    # ---- routing --------------------------------------------------------------------------------------------

    def choose(self, candidate_ids: Sequence[ReplicaId], token_ids: Sequence[int], namespace: bytes = b"",
               *, num_jobs: Mapping[ReplicaId, int] | None = None) -> Decision:
        """Rank `candidate_ids` for a prompt of `token_ids` (hash namespace `namespace`, see folio.hashing).

        num_jobs: fresher job counts than the reports' (e.g. Ray's queue-length cache), per replica (fewer jobs
            than estimated also shrink the replica's estimated prefill backlog in proportion); replicas
        missing from it use their last report plus what was routed there since.
        """
        index = self.index
        digests = {replica_id: index.digest(replica_id) for replica_id in candidate_ids}
        fleet_page_size = self._fleet_page_size(digests.values())
        page_size_of = {r: fleet_page_size if d is None else d.page_size for r, d in digests.items()}
        keys_by_page_size: dict[int, list[int]] = {}
        matches: dict[ReplicaId, Match] = {}
        for size in set(page_size_of.values()):  # one size in any sane deployment
            # Every full prompt page will be held after prefill (on_routed records them all), but only the pages
            # before the last prompt token can be reused at admission (folio.hashing.prompt_page_hashes).
            keys = page_keys(page_hashes(token_ids, size, namespace))
            keys_by_page_size[size] = keys
            num_reusable = max(len(token_ids) - 1, 0) // size
            matches.update(index.match_all(keys[:num_reusable], [r for r in digests if page_size_of[r] == size]))
        views = []
        for replica_id, digest in digests.items():
            num_routed, num_routed_tokens = index.routed_since_report(replica_id)
            estimated_jobs = (0 if digest is None else digest.num_jobs) + num_routed
            backlog = num_routed_tokens + (0 if digest is None else digest.num_prefill_tokens)
            jobs = estimated_jobs
            if num_jobs is not None and replica_id in num_jobs:
                jobs = num_jobs[replica_id]
                if jobs < estimated_jobs:
                    # Jobs finished since the report, and their share of its backlog with them (all of it when
                    # none is left: a replica that just drained must not look busy until its next report).
                    backlog = backlog * jobs // estimated_jobs
            running, queued = split_jobs(jobs, digest)
            size = page_size_of[replica_id]
            match = matches[replica_id]
            # Matched pages no report confirmed yet are probably in the backlog still: this request would wait for
            # them there rather than compute them again, so that part of the backlog is not a delay of its own.
            in_flight = (match.num_pages - match.num_reported_pages) * size
            views.append(CandidateView(replica_id, match.num_pages * size, size, running, queued,
                                       max(0, backlog - in_flight),
                                       None if digest is None else digest.num_allocatable_pages))
        decision = rank_replicas(views, len(token_ids), self.config, self._rng)
        decision.page_keys.update(keys_by_page_size)
        decision.page_size_of.update(page_size_of)
        return decision

    def on_routed(self, replica_id: ReplicaId, decision: Decision) -> None:
        """The request of `decision` was sent to `replica_id`: its prompt pages will be there shortly."""
        size = decision.page_size_of.get(replica_id)
        keys = decision.page_keys.get(size) if size is not None else None
        if keys is None:  # routed outside the candidates it ranked: the most likely page size
            keys = next(iter(decision.page_keys.values()), [])
        num_cached = decision.num_cached_tokens.get(replica_id, 0)
        self.index.record_routed(replica_id, keys, max(0, decision.num_prompt_tokens - num_cached))

    def _fleet_page_size(self, digests: Iterable[ReplicaDigest | None]) -> int:
        """Page size for replicas that have not reported: the one most candidates reported, else the default."""
        sizes = Counter(d.page_size for d in digests if d is not None)
        if sizes:
            return sizes.most_common(1)[0][0]
        return self.config.default_page_size
