"""The routing policy: send each request to the replica where it would get its first token soonest.

For one request: its prompt's routing keys (folio.router.keys: page hashes every block of tokens, computed once),
the replicas holding its longest prefixes (folio.router.index, exact from the replicas' cache events), and each
replica's predicted time to first token (folio.router.cost, in seconds from measured rates). Only a shortlist is
scored: the replicas holding some of the prompt plus two of the `shortlist_size` that wait least (the two least
waiting, or a random draw where several routers share the fleet: PolicyConfig); everything else is a vector
operation over all replicas. Lowest predicted time first; the draws and exact ties come from a seeded rng, so runs
replay exactly.

`PrefixRouterPolicy` is what a Ray Serve RequestRouter (folio.router.ray_router) or a simulation drives:

    policy.sync_replicas(ids)                      # replicas appeared / disappeared
    policy.report(replica_id, routing_stats)       # each replica's report (folio.router.digest), when it changes
    decision = policy.choose(candidate_ids, prompt_token_ids)
    policy.on_routed(replica_id, decision)         # where the request actually went
    policy.remove_replica(replica_id)              # a replica died

No I/O, no awaiting; O(prompt pages) to hash (or pass `keys`), O(prompt blocks + holders + shortlist) in Python and
O(replicas) in numpy per decision.
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

import numpy as np

from folio.hashing import page_hashes
from folio.router.cost import CostDefaults, LoadTable
from folio.router.digest import DigestError, ReplicaDigest
from folio.router.index import DEFAULT_MAX_ROUTED_KEYS, DEFAULT_ROUTED_TTL_S, Match, PrefixIndex, ReplicaId
from folio.router.keys import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_DENSE_KEY_TOKENS,
    DEFAULT_DENSE_TOKENS,
    KeyGeometry,
    page_keys,
)


class Mode(enum.Enum):
    """How a ranking was made."""

    AFFINITY = "affinity"  # some candidate holds part of the prompt
    LOAD = "load"  # none does: predicted waits alone decide


@dataclass(frozen=True)
class PolicyConfig:
    """shortlist_size / sampled: besides the replicas holding part of the prompt, `sampled` replicas from the
        `shortlist_size` that wait least (times the routers sharing the fleet, folio.router.cost) are scored: the
        least waiting of them where this router routes alone, a random draw where several do (ingress routers share
        a view of the fleet a report period old, and all would send their next requests to the same replica).
    holders_per_depth: of the replicas holding the same number of the prompt's blocks, the `holders_per_depth`
        that wait least are scored, the others not: they differ from those mostly by their waits (their measured
        rates aside), and a prefix held across a large fleet (a common system prompt) would otherwise make every
        decision score hundreds.
    routed_ttl_s / max_routed_keys: the index's record of prompts routed but not reported yet.
    default_page_size / default_*_tokens: where routing keys fall (folio.router.keys)
        before any replica has reported its own.
    default_*: rates assumed before any replica has measured its own (folio.router.cost.CostDefaults).
    recompute_weight: a replica whose cache holds less of the prompt than the best-placed candidates' is charged
        recompute_weight / n of the prefill time of the difference, on top of its own time to first token, n being
        the number of candidates that hold that much (the prefix's copies). The recompute delays the requests
        behind it there; what it buys differs with n. A prefix on one replica, sent elsewhere because that replica
        is busy with other work, costs a whole recompute to spare a wait its later requests may not meet again. A
        prefix that n replicas already serve is in demand enough to need them, and one more copy takes 1/n of that
        demand's load. With 1.5, bench/routing_sim.py's templates stay with their holders while its hot prefix
        spreads at a fraction of that price (bench/RESULTS.md); one weight for every prefix had to stay at 0.45 or
        less to keep the hot-spot burst's load max:mean <= 1.3, and then sent templates away from busy holders.
    seed: the tie-breaking rng's seed."""

    shortlist_size: int = 8
    sampled: int = 2
    holders_per_depth: int = 8
    routed_ttl_s: float = DEFAULT_ROUTED_TTL_S
    max_routed_keys: int = DEFAULT_MAX_ROUTED_KEYS
    default_page_size: int = 256
    default_block_tokens: int = DEFAULT_BLOCK_TOKENS
    default_dense_tokens: int = DEFAULT_DENSE_TOKENS
    default_dense_key_tokens: int = DEFAULT_DENSE_KEY_TOKENS
    default_prefill_tokens_per_s: float = CostDefaults.prefill_tokens_per_s
    default_decode_step_s: float = CostDefaults.decode_step_s
    default_new_tokens: float = CostDefaults.mean_new_tokens
    recompute_weight: float = 1.5
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.sampled <= self.shortlist_size:
            raise ValueError(f"need 1 <= sampled <= shortlist_size, got {self.sampled} and {self.shortlist_size}")
        if self.holders_per_depth < 1:
            raise ValueError(f"holders_per_depth must be >= 1, got {self.holders_per_depth}")
        if not 0 <= self.recompute_weight < math.inf:
            raise ValueError(f"recompute_weight must be a finite number >= 0, got {self.recompute_weight}")
        if self.routed_ttl_s < 0 or self.max_routed_keys < 0:
            raise ValueError("routed_ttl_s and max_routed_keys must be >= 0")
        for name in ("default_page_size", "default_block_tokens", "default_dense_key_tokens",
                     "default_prefill_tokens_per_s",
                     "default_decode_step_s", "default_new_tokens"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass
class Decision:
    """shortlist: the scored replicas, best first, with their predicted seconds (costs) and cached prompt tokens;
    ranking: every candidate, the shortlist first and then the others by predicted wait (Ray's choose_replicas
    shape: one replica per rank); order: the same as positions in the candidate list (no replica id hashed: a
    caller holding objects per candidate, Ray's RunningReplica, picks them by position)."""

    shortlist: list[ReplicaId]
    mode: Mode
    costs: dict[ReplicaId, float]
    num_cached_tokens: dict[ReplicaId, int]
    num_prompt_tokens: int
    keys: list[int] = field(default_factory=list)  # the prompt's routing keys, for on_routed
    _order: Callable[[], list[int]] = field(default=lambda: [], repr=False)
    _candidates: Sequence[ReplicaId] = field(default=(), repr=False)

    @property
    def best(self) -> ReplicaId | None:
        return self.shortlist[0] if self.shortlist else None

    @property
    def order(self) -> list[int]:
        return self._order()

    @property
    def ranking(self) -> list[list[ReplicaId]]:
        candidates = self._candidates
        return [[candidates[pos]] for pos in self._order()]


class PrefixRouterPolicy:
    def __init__(self, config: PolicyConfig | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config = config or PolicyConfig()
        self.index = PrefixIndex(routed_ttl_s=config.routed_ttl_s, clock=clock,
                                 max_routed_keys=config.max_routed_keys)
        self.loads = LoadTable(CostDefaults(config.default_prefill_tokens_per_s, config.default_decode_step_s,
                                            config.default_new_tokens), clock=clock)
        self._rng = random.Random(config.seed)
        self._num_rejected_reports = 0
        # The last candidate list, its slots, and each slot's position in it (-1: not a candidate).
        self._candidates: tuple[list, np.ndarray, list[int], np.ndarray | slice] = (
            [], np.zeros(0, dtype=np.int64), [], slice(0, 0))
        self._geometry: KeyGeometry | None = None  # the one most replicas reported

    @property
    def num_rejected_reports(self) -> int:
        """Routing-stats dicts that were not valid reports (ignored)."""
        return self._num_rejected_reports

    # ---- replica set and reports ----------------------------------------------------------------------------

    def sync_replicas(self, replica_ids: Iterable[ReplicaId]) -> None:
        for slot in self.index.sync_replicas(replica_ids):
            self.loads.clear(slot)
        self._forget_candidates()

    def _forget_candidates(self) -> None:
        """After replicas came or went: the candidates' slots, and the geometry most of them reported."""
        self._candidates = ([], self._candidates[1][:0], [], slice(0, 0))
        self._geometry = None

    def remove_replica(self, replica_id: ReplicaId) -> None:
        slot = self.index.remove_replica(replica_id)
        if slot is not None:
            self.loads.clear(slot)
            self._forget_candidates()

    def report(self, replica_id: ReplicaId, stats: Mapping[str, Any] | ReplicaDigest) -> bool:
        """Apply a replica's report (a dict from folio.router.digest.build_digest, or a parsed one). Returns whether
        it changed anything; an invalid dict is counted and ignored (a replica of another version must not break
        routing)."""
        if isinstance(stats, ReplicaDigest):
            if not self.index.report(replica_id, stats):
                return False
            slot = self.index.slot_of(replica_id)
        else:
            try:
                applied = self.index.report_stats(replica_id, stats)
            except DigestError:
                self._num_rejected_reports += 1
                return False
            if applied is None:
                return False
            slot, stats = applied
        self.loads.set_report(slot, stats)
        geometry = self._geometry
        # (a report of the geometry most replicas report cannot make another one the most reported)
        if geometry is not None and (stats.page_size, stats.block_tokens, stats.dense_tokens,
                                     stats.dense_key_tokens) != geometry.as_tuple():
            self._geometry = None
        return True

    # ---- routing --------------------------------------------------------------------------------------------

    def geometry(self) -> KeyGeometry:
        """Where routing keys fall, as most replicas reported; the configured defaults before any report."""
        if self._geometry is None:
            reported = Counter((d.page_size, d.block_tokens, d.dense_tokens, d.dense_key_tokens)
                               for r in self.index.replica_ids if (d := self.index.digest(r)) is not None)
            config = self.config
            self._geometry = KeyGeometry(*(reported.most_common(1)[0][0] if reported else (
                config.default_page_size, config.default_block_tokens, config.default_dense_tokens,
                config.default_dense_key_tokens)))
        return self._geometry

    def prompt_keys(self, token_ids: Sequence[int], namespace: bytes = b"") -> list[int]:
        """The routing keys of a prompt (hash it once; choose() takes them as `keys`)."""
        geometry = self.geometry()
        depths = geometry.depths(len(token_ids) // geometry.page_size)
        if not depths:
            return []
        hashed = page_keys(page_hashes(token_ids[:(depths[-1] + 1) * geometry.page_size], geometry.page_size,
                                       namespace))
        return [hashed[d] for d in depths]

    def choose(self, candidate_ids: Sequence[ReplicaId], token_ids: Sequence[int] = (), namespace: bytes = b"",
               *, num_jobs: Mapping[ReplicaId, int] | Callable[[list[ReplicaId]], Mapping[ReplicaId, int]] | None
               = None, keys: Sequence[int] | None = None, num_prompt_tokens: int | None = None) -> Decision:
        """Rank `candidate_ids` for a prompt of `token_ids` (hash namespace `namespace`, see folio.hashing), or of
        `num_prompt_tokens` tokens whose routing keys are `keys` (from prompt_keys).

        num_jobs: fresher job counts than the reports' (e.g. Ray's queue-length cache), per replica, for the
            replicas scored; or a function giving them for a list of replica ids, asked once for the shortlist (a
            mapping of every candidate would cost a fleet of hundreds a pass over all of them per request). The
            shortlist's draw from the least waiting uses the reports' counts plus what was routed since.
        """
        if not candidate_ids:
            return Decision([], Mode.LOAD, {}, {}, 0)
        candidate_ids = candidate_ids if type(candidate_ids) is list else list(candidate_ids)
        if keys is None:
            keys = self.prompt_keys(token_ids, namespace)
        prompt_len = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
        geometry = self.geometry()
        depths = geometry.depths_of_keys(len(keys))
        num_reusable = geometry.num_reusable_keys(prompt_len, depths)
        slots, position_of, rows = self._slots(candidate_ids)
        loads = self.loads
        # Several routers choosing at once from the same view spread over as many times the candidates, each scoring
        # a random draw of them. A router alone knows every request sent since the reports (its own) and scores the
        # least waiting: a draw would leave a replica idle while it sends to busier ones (on a few replicas, a new
        # prefix's home), as power-of-two choices does. Least by what a request sharing nothing would wait there,
        # page shortfall included; among equal waits, the earlier candidate.
        routers = loads.num_routers
        k = min(len(slots), round(self.config.shortlist_size * routers))
        wait, least = loads.least_waiting(rows, len(slots), prompt_len, k)
        matches = self.index.match(keys[:num_reusable]) if num_reusable else {}
        shortlist = {}
        for slot, match in matches.items():
            if slot < len(position_of) and position_of[slot] >= 0:
                shortlist[position_of[slot]] = match
        mode = Mode.AFFINITY if shortlist else Mode.LOAD
        holders = shortlist
        num_copies = 0  # the candidates holding the most of the prompt, all of them (not only those scored)
        if len(shortlist) > self.config.holders_per_depth:
            deepest = max(match.num_blocks for match in shortlist.values())
            num_copies = sum(match.num_blocks == deepest for match in shortlist.values())
            shortlist = self._least_waiting_per_depth(shortlist, wait)
        sampled = min(self.config.sampled, len(least))
        if routers < 1.5:
            picks = least[:sampled]
        else:
            picks = self._rng.sample(least, sampled)
        for pos in picks:
            if pos not in shortlist:
                shortlist[pos] = holders.get(pos)  # (a holder not scored for its wait may still be among these)
        fresh = (num_jobs([candidate_ids[pos] for pos in shortlist]) if callable(num_jobs) else num_jobs) or {}
        scored = []
        # A replica that would compute again what another holds also costs the fleet that prefill time: the requests
        # that queue behind it there wait for it too ...
        cached_of = {pos: 0 if match is None else geometry.tokens_of(match.num_blocks, depths)
                     for pos, match in shortlist.items()}
        most_cached = max(cached_of.values(), default=0)
        # ... shared among the replicas holding that much of it (see PolicyConfig.recompute_weight)
        recompute_weight = self.config.recompute_weight / max(
            num_copies or sum(c == most_cached for c in cached_of.values()), 1)
        for pos, match in shortlist.items():
            slot = int(slots[pos])
            cached = cached_of[pos]
            prefill_rate, prefill_wait, fit_tokens, one_job_s = loads.terms(slot)
            # Matched keys no event confirmed yet are in that replica's backlog: this request waits for them there
            # rather than computing them again, so they are not a delay of its own on top of the wait.
            in_flight = 0 if match is None else cached - geometry.tokens_of(match.num_reported_blocks, depths)
            discount = min(in_flight / prefill_rate, prefill_wait)  # what is queued
            uncached = max(prompt_len - cached, 0)
            # its own prefill, and where the replica lacks the pages for it, a job's decode time to free some
            jobs = fresh.get(candidate_ids[pos]) if fresh else None
            own_wait = float(wait[pos]) if jobs is None else loads.wait_with_jobs(slot, jobs)
            cost = max(own_wait - discount, 0.0) + uncached / prefill_rate + (
                one_job_s if uncached > fit_tokens else 0.0)
            if recompute_weight and cached < most_cached:
                cost += recompute_weight * (most_cached - cached) / prefill_rate
            scored.append((cost, self._rng.random(), pos, cached))
        scored.sort()
        positions = [pos for _, _, pos, _ in scored]

        def order() -> list[int]:
            by_wait = np.argsort(wait, kind="stable")
            rest = np.ones(len(wait), dtype=bool)
            rest[positions] = False
            return positions + by_wait[rest[by_wait]].tolist()

        return Decision([candidate_ids[pos] for pos in positions], mode,
                        {candidate_ids[pos]: cost for cost, _, pos, _ in scored},
                        {candidate_ids[pos]: cached for _, _, pos, cached in scored}, prompt_len, list(keys), order,
                        candidate_ids)

    def _least_waiting_per_depth(self, holders: dict[int, Match], wait: np.ndarray) -> dict[int, Match]:
        """Of the holders (candidate position -> match) holding the same number of blocks, the
        holders_per_depth that wait least."""
        limit = self.config.holders_per_depth
        by_depth: dict[int, list[int]] = {}
        for pos, match in holders.items():
            by_depth.setdefault(match.num_blocks, []).append(pos)
        kept = {}
        for positions in by_depth.values():
            if len(positions) > limit:
                least = np.argpartition(wait[positions], limit - 1)[:limit]
                positions = [positions[i] for i in least.tolist()]
            for pos in positions:
                kept[pos] = holders[pos]
        return kept

    def _slots(self, candidate_ids: Sequence[ReplicaId]) -> tuple[np.ndarray, list[int], np.ndarray | slice]:
        """The candidates' slots, every slot's position among the candidates (-1: not one; a list, read per holder
        of the prompt, where numpy's scalar indexing costs several times more), and what selects the
        candidates' rows of the load table (a slice where the candidates are the first slots in order, as all of a
        fleet's replicas usually are: a view instead of a gather); kept for the next call with the same candidates
        (a router's candidates rarely change)."""
        cached_ids, slots, position_of, rows = self._candidates
        if len(cached_ids) == len(candidate_ids) and cached_ids == candidate_ids:
            # (list equality tests each pair for identity first: the latest equal candidates are kept, so that a
            # router whose replica ids came again as new objects, as a Serve broadcast renews them all, compares
            # them without __eq__ from the next call on; the first pair tells)
            if cached_ids[0] is not candidate_ids[0]:
                self._candidates = (list(candidate_ids), slots, position_of, rows)
            return slots, position_of, rows
        slots = np.array([self.index.slot_of(r) for r in candidate_ids], dtype=np.int64)
        self.loads.ensure(int(slots.max()))
        positions = np.full(self.index.num_slots, -1, dtype=np.int64)
        positions[slots] = np.arange(len(slots))
        position_of = positions.tolist()
        rows = slice(0, len(slots)) if np.array_equal(slots, np.arange(len(slots))) else slots
        self._candidates = (list(candidate_ids), slots, position_of, rows)
        return slots, position_of, rows

    def on_routed(self, replica_id: ReplicaId, decision: Decision) -> None:
        """The request of `decision` was sent to `replica_id`: its prompt's blocks will be there shortly."""
        self.index.record_routed(replica_id, decision.keys)
        cached = decision.num_cached_tokens.get(replica_id, 0)
        self.loads.add_routed(self.index.slot_of(replica_id), max(0, decision.num_prompt_tokens - cached))
