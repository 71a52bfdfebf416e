"""Which replica holds which pages, as one router sees it: each replica's last digest, reconciled with what this
router routed there recently.

Two sources per replica:
  - reported: the page keys of the replica's latest digest (folio.router.digest). A new report replaces the previous
    one, so pages the replica evicted stop counting as soon as it says so.
  - routed: the prompt pages of requests this router sent to the replica, which it will hold shortly (once it
    prefilled them) but has not reported yet. Each expires `routed_ttl_s` after routing; an expired entry still
    counts until the replica's next report, which speaks for it from then on (it lists the page or proves it
    gone). Until that TTL a report that lacks the page does not drop it: the request may still be queued there.

Matching: a page key names the page's whole prefix (folio.hashing chains hashes), and the pool evicts leaves
first, so a replica holding page k holds pages 0..k-1 too. match() therefore returns the depth of the DEEPEST
prompt page the replica is known to hold, which equals the number of leading pages it holds, and stays right when a
bounded digest lists a page without its ancestors.

An inverted index (key -> replicas) makes matching a prompt against every candidate O(prompt pages + holders of
those pages) instead of O(prompt pages x replicas). A report costs O(size of the digest). Replica ids are any
hashable values. Single-threaded: the caller (one router, one event loop) serialises calls.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from folio.router.digest import ReplicaDigest

ReplicaId = Hashable

DEFAULT_ROUTED_TTL_S = 10.0
DEFAULT_MAX_ROUTED_PAGES = 65_536


class Match(NamedTuple):
    """Leading pages of a prompt a replica holds, and how many of them its reports confirmed (the rest are pages
    this router sent it recently: probably still being computed)."""

    num_pages: int
    num_reported_pages: int


@dataclass(eq=False)
class _Replica:
    digest: ReplicaDigest | None = None
    reported: frozenset[int] = frozenset()
    routed: dict[int, float] = field(default_factory=dict)  # key -> expiry time, oldest routing first
    num_routed_since_report: int = 0
    num_routed_tokens_since_report: int = 0  # prompt tokens to prefill, as estimated when routing


class PrefixIndex:
    def __init__(self, *, routed_ttl_s: float = DEFAULT_ROUTED_TTL_S, clock: Callable[[], float],
                 max_routed_pages: int = DEFAULT_MAX_ROUTED_PAGES) -> None:
        """max_routed_pages bounds each replica's routed record (the oldest entries go first) for replicas that
        stop reporting without dying."""
        if routed_ttl_s < 0:
            raise ValueError(f"routed_ttl_s must be >= 0, got {routed_ttl_s}")
        if max_routed_pages < 0:
            raise ValueError(f"max_routed_pages must be >= 0, got {max_routed_pages}")
        self._ttl_s = routed_ttl_s
        self._clock = clock
        self._max_routed_pages = max_routed_pages
        self._replicas: dict[ReplicaId, _Replica] = {}
        self._reported_holders: dict[int, set[ReplicaId]] = {}
        self._routed_holders: dict[int, set[ReplicaId]] = {}

    # ---- replicas -------------------------------------------------------------------------------------------

    @property
    def replica_ids(self) -> list[ReplicaId]:
        return list(self._replicas)

    def __contains__(self, replica_id: ReplicaId) -> bool:
        return replica_id in self._replicas

    def add_replica(self, replica_id: ReplicaId) -> None:
        """Start tracking a replica with an empty index (no-op if tracked)."""
        self._replicas.setdefault(replica_id, _Replica())

    def remove_replica(self, replica_id: ReplicaId) -> None:
        """Forget a replica (it died or was scaled down); no-op if unknown."""
        state = self._replicas.pop(replica_id, None)
        if state is None:
            return
        _unindex(self._reported_holders, state.reported, replica_id)
        _unindex(self._routed_holders, state.routed, replica_id)

    def sync_replicas(self, replica_ids: Iterable[ReplicaId]) -> None:
        """Track exactly `replica_ids`: forget the others, add the new ones."""
        wanted = set(replica_ids)
        for replica_id in [r for r in self._replicas if r not in wanted]:
            self.remove_replica(replica_id)
        for replica_id in wanted:
            self.add_replica(replica_id)

    def digest(self, replica_id: ReplicaId) -> ReplicaDigest | None:
        state = self._replicas.get(replica_id)
        return None if state is None else state.digest

    def routed_since_report(self, replica_id: ReplicaId) -> tuple[int, int]:
        """(requests, prompt tokens to prefill) this router sent the replica since its last applied report."""
        state = self._replicas.get(replica_id)
        if state is None:
            return 0, 0
        return state.num_routed_since_report, state.num_routed_tokens_since_report

    # ---- updates --------------------------------------------------------------------------------------------

    def report(self, replica_id: ReplicaId, digest: ReplicaDigest) -> bool:
        """Apply a replica's digest; returns False (nothing changed) if it is not newer than the last one applied.

        A digest from a new instance (the replica restarted) resets everything known about the replica first.
        """
        self.add_replica(replica_id)
        state = self._replicas[replica_id]
        previous = state.digest
        if previous is not None and previous.instance_id == digest.instance_id and digest.epoch <= previous.epoch:
            return False
        if previous is not None and previous.instance_id != digest.instance_id:
            self.remove_replica(replica_id)
            self.add_replica(replica_id)
            state = self._replicas[replica_id]
        new_keys = digest.page_keys
        _unindex(self._reported_holders, state.reported - new_keys, replica_id)
        _index(self._reported_holders, new_keys - state.reported, replica_id)
        state.reported = new_keys
        state.digest = digest
        state.num_routed_since_report = 0
        state.num_routed_tokens_since_report = 0
        self._expire_routed(replica_id, state, self._clock())
        return True

    def record_routed(self, replica_id: ReplicaId, keys: Sequence[int], num_prefill_tokens: int = 0) -> None:
        """This router sent a request whose prompt pages have these keys to the replica, which will have to
        prefill about num_prefill_tokens of it (the prompt less what it holds)."""
        self.add_replica(replica_id)
        state = self._replicas[replica_id]
        state.num_routed_since_report += 1
        state.num_routed_tokens_since_report += num_prefill_tokens
        expiry = self._clock() + self._ttl_s
        routed = state.routed
        for key in keys:
            if key in routed:
                del routed[key]  # re-insert: the dict stays in routing order for the size bound below
            else:
                self._routed_holders.setdefault(key, set()).add(replica_id)
            routed[key] = expiry
        while len(routed) > self._max_routed_pages:
            oldest = next(iter(routed))
            del routed[oldest]
            _unindex(self._routed_holders, (oldest,), replica_id)

    def _expire_routed(self, replica_id: ReplicaId, state: _Replica, now: float) -> None:
        # The record is in routing order and every entry lives routed_ttl_s, so expiries only grow along it
        # (given a clock that does not go back): the expired entries are a prefix.
        routed = state.routed
        expired = []
        for key, expiry in routed.items():
            if expiry > now:
                break
            expired.append(key)
        for key in expired:
            del routed[key]
        _unindex(self._routed_holders, expired, replica_id)

    # ---- queries --------------------------------------------------------------------------------------------

    def match(self, replica_id: ReplicaId, keys: Sequence[int]) -> int:
        """Number of leading pages of `keys` (a prompt's page keys, first page first) the replica holds."""
        state = self._replicas.get(replica_id)
        if state is None:
            return 0
        for depth in range(len(keys), 0, -1):
            key = keys[depth - 1]
            if key in state.reported or key in state.routed:
                return depth
        return 0

    def match_all(self, keys: Sequence[int], replica_ids: Iterable[ReplicaId]) -> dict[ReplicaId, Match]:
        """match() for each of `replica_ids` at once (unknown replicas match nothing), with the part a report
        confirmed, through the inverted index: O(len(keys) + holders visited)."""
        held = dict.fromkeys(replica_ids, 0)
        reported = dict.fromkeys(held, 0)
        num_unreported = len(reported)
        for depth in range(len(keys), 0, -1):
            if not num_unreported:
                break
            key = keys[depth - 1]
            for replica_id in self._reported_holders.get(key, ()):
                if reported.get(replica_id) == 0:
                    reported[replica_id] = depth
                    num_unreported -= 1
                    held[replica_id] = max(held[replica_id], depth)
            for replica_id in self._routed_holders.get(key, ()):
                if held.get(replica_id) == 0:
                    held[replica_id] = depth
        return {replica_id: Match(held[replica_id], reported[replica_id]) for replica_id in held}


def _index(holders: dict[int, set[ReplicaId]], keys: Iterable[int], replica_id: ReplicaId) -> None:
    for key in keys:
        holders.setdefault(key, set()).add(replica_id)


def _unindex(holders: dict[int, set[ReplicaId]], keys: Iterable[int], replica_id: ReplicaId) -> None:
    for key in keys:
        replicas = holders.get(key)
        if replicas is None:
            continue
        replicas.discard(replica_id)
        if not replicas:
            del holders[key]
