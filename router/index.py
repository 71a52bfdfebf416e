"""Which replica holds which routing keys, as one router sees it: exact, from the replicas' event batches
(folio.router.events), plus what this router routed to each replica recently.

Two sources per replica:
  - held: the keys its cache holds, rebuilt from its batches in sequence order (and from a snapshot after a gap or
    when the router joins late). Every router applying the same batches holds the same sets, whatever it routed.
  - routed: the block keys of prompts this router sent the replica, which it will hold once it has prefilled them
    but has not reported yet. Each entry lives `routed_ttl_s`; a stored event for the key replaces it sooner.

Matching: a routing key names its whole prefix (folio.hashing chains page hashes), and the pool evicts leaves
first, so a replica holding key k of a prompt holds keys 0..k-1 too; match() returns, per replica, the depth of the
deepest prompt key it is known to hold. Replicas are small-int slots (reused after a replica is removed). The held
keys live in folio.router.held_keys (a hash map from key to slots, native when built), so applying an event is one
map update and matching a prompt one lookup per key plus one step per replica found; the routed record, small,
maps keys to bitmasks of slots in Python.

Memory: per replica, one entry per held key (about num_pages / stride) and at most max_routed_keys routed entries;
per key across the fleet, one hash-map entry listing its holders.
Single-threaded: the caller (one router, one event loop) serialises calls.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from folio.router.digest import (
    COMMON_REPORT_FIELDS,
    COMMON_REPORT_KINDS,
    DIGEST_VERSION,
    Batch,
    ReplicaDigest,
    parse_digest,
)
from folio.router.held_keys import HeldKeys, deepest_in_masks, make_held_keys

ReplicaId = Hashable

DEFAULT_ROUTED_TTL_S = 10.0
DEFAULT_MAX_ROUTED_KEYS = 16_384


class Match(NamedTuple):
    """Leading blocks of a prompt a replica holds, and how many of them its events confirmed (the rest are blocks
    this router sent it recently: probably still being computed)."""

    num_blocks: int
    num_reported_blocks: int


@dataclass(eq=False)
class _Replica:
    slot: int
    digest: ReplicaDigest | None = None
    seq: int = 0  # last batch applied
    synced: bool = False  # keys are exact: every batch since a snapshot (or since the instance began) applied
    routed: dict[int, float] = field(default_factory=dict)  # key -> expiry, oldest routing first


@dataclass
class IndexStats:
    num_batches: int = 0
    num_events: int = 0
    num_gaps: int = 0  # reports whose batches did not follow the last one applied
    num_resyncs: int = 0  # snapshots applied


class PrefixIndex:
    def __init__(self, *, routed_ttl_s: float = DEFAULT_ROUTED_TTL_S, clock: Callable[[], float],
                 max_routed_keys: int = DEFAULT_MAX_ROUTED_KEYS, held: HeldKeys | None = None) -> None:
        """held: the held-key store (default: native when built, see folio.router.held_keys)."""
        if routed_ttl_s < 0:
            raise ValueError(f"routed_ttl_s must be >= 0, got {routed_ttl_s}")
        if max_routed_keys < 0:
            raise ValueError(f"max_routed_keys must be >= 0, got {max_routed_keys}")
        self._ttl_s = routed_ttl_s
        self._clock = clock
        self._max_routed_keys = max_routed_keys
        self._replicas: dict[ReplicaId, _Replica] = {}
        self._ids: list[ReplicaId | None] = []  # slot -> replica id
        self._free_slots: list[int] = []
        self._held = held if held is not None else make_held_keys()
        self._reads_reports = hasattr(self._held, "apply_report")
        self._routed: dict[int, int] = {}  # key -> bitmask of slots it was routed to
        self.stats = IndexStats()

    # ---- replicas -------------------------------------------------------------------------------------------

    @property
    def replica_ids(self) -> list[ReplicaId]:
        return list(self._replicas)

    @property
    def num_slots(self) -> int:
        """Slots ever used (an upper bound on slot numbers + 1)."""
        return len(self._ids)

    def __contains__(self, replica_id: ReplicaId) -> bool:
        return replica_id in self._replicas

    def slot_of(self, replica_id: ReplicaId) -> int:
        """The replica's slot, tracking it first if new."""
        state = self._replicas.get(replica_id)
        if state is None:
            state = self._add(replica_id)
        return state.slot

    def replica_at(self, slot: int) -> ReplicaId | None:
        return self._ids[slot] if slot < len(self._ids) else None

    def _add(self, replica_id: ReplicaId) -> _Replica:
        slot = self._free_slots.pop() if self._free_slots else len(self._ids)
        if slot == len(self._ids):
            self._ids.append(replica_id)
        else:
            self._ids[slot] = replica_id
        state = self._replicas[replica_id] = _Replica(slot)
        return state

    def remove_replica(self, replica_id: ReplicaId) -> int | None:
        """Forget a replica (it died or was scaled down); returns its freed slot, None if unknown."""
        state = self._replicas.pop(replica_id, None)
        if state is None:
            return None
        self._forget(state)
        self._ids[state.slot] = None
        self._free_slots.append(state.slot)
        return state.slot

    def sync_replicas(self, replica_ids: Iterable[ReplicaId]) -> list[int]:
        """Track exactly `replica_ids`; returns the slots freed."""
        wanted = set(replica_ids)
        freed = [self.remove_replica(r) for r in [r for r in self._replicas if r not in wanted]]
        for replica_id in wanted:
            self.slot_of(replica_id)
        return [slot for slot in freed if slot is not None]

    def digest(self, replica_id: ReplicaId) -> ReplicaDigest | None:
        state = self._replicas.get(replica_id)
        return None if state is None else state.digest

    def applied_seq(self, replica_id: ReplicaId, instance_id: str) -> int:
        """The last batch of `instance_id` applied for the replica (0: none, or another instance)."""
        state = self._replicas.get(replica_id)
        if state is None or state.digest is None or state.digest.instance_id != instance_id:
            return 0
        return state.seq

    def is_synced(self, replica_id: ReplicaId) -> bool:
        state = self._replicas.get(replica_id)
        return state is not None and state.synced

    def held_keys(self, replica_id: ReplicaId) -> frozenset[int]:
        state = self._replicas.get(replica_id)
        return frozenset() if state is None else frozenset(self._held.keys_of(state.slot))

    # ---- reports --------------------------------------------------------------------------------------------

    def report(self, replica_id: ReplicaId, digest: ReplicaDigest) -> bool:
        """Apply a replica's report; False (nothing changed) if it is not newer than the last one applied. A report
        from a new instance (the replica restarted) first forgets what the old one held."""
        return self._report(self._replicas.get(replica_id) or self._add(replica_id), digest)

    def report_stats(self, replica_id: ReplicaId, stats: Mapping[str, Any]) -> tuple[int, ReplicaDigest] | None:
        """Apply a replica's report as the dict it sent (folio.router.digest): its slot and the decoded report, or
        None (nothing changed) if it is not newer than the last one applied. Raises DigestError if it is not a
        report. One look-up of the replica, and only the batches it has not applied decoded: a router receives
        every replica's report each period, and each of them many times."""
        state = self._replicas.get(replica_id)
        previous = None if state is None else state.digest
        applied_seq = 0
        if (previous is not None and (type(stats) is dict or isinstance(stats, Mapping))
                and stats.get("instance_id", "") == previous.instance_id):
            epoch = stats.get("epoch")
            if type(epoch) is int and epoch <= previous.epoch:
                return None  # the same report again (routers see each one many times): skip decoding it
            if state.synced and self._reads_reports and stats.get("v") == DIGEST_VERSION:
                # Most reports: the next one of an instance in sync, read and its batches applied by the native index
                # in one call (folio.router.digest COMMON_REPORT_FIELDS: no snapshot, every field of its type,
                # well-formed batches). Anything else it leaves untouched, for the full decode below, which names
                # what is wrong.
                applied = self._held.apply_report(state.slot, stats, COMMON_REPORT_FIELDS, COMMON_REPORT_KINDS,
                                                  state.seq, bool(state.routed))
                if applied is not None:
                    return state.slot, self._applied(state, applied)
            applied_seq = state.seq
        digest = parse_digest(stats, applied_seq)
        if state is None:
            state = self._add(replica_id)  # (not before: a dict that is no report adds no replica)
        return (state.slot, digest) if self._report(state, digest) else None

    def _report(self, state: _Replica, digest: ReplicaDigest) -> bool:
        previous = state.digest
        if previous is not None and previous.instance_id == digest.instance_id and digest.epoch <= previous.epoch:
            return False
        if previous is not None and previous.instance_id != digest.instance_id:
            self._forget(state)
        state.digest = digest
        self._apply_events(state, digest)
        if state.routed:
            self._expire_routed(state, self._clock())
        return True

    @property
    def reads_reports(self) -> bool:
        """Whether the held-key store reads and applies most reports in one native call (KeyIndex.apply_report)."""
        return self._reads_reports

    def _applied(self, state: _Replica, applied: tuple) -> ReplicaDigest:
        """The bookkeeping of a report that KeyIndex.apply_report read and whose new batches it applied."""
        fields, first_seq, last_seq, num_batches, num_events, stored = applied
        digest = state.digest = ReplicaDigest(*fields)  # (its fields in order, up to packed_numbers)
        if num_batches:
            if first_seq != state.seq + 1:
                self.stats.num_gaps += 1
                state.synced = False  # as _apply_events: keep what is known; exact again at the next snapshot
            state.seq = last_seq
            self.stats.num_batches += num_batches
            self.stats.num_events += num_events
            if stored:
                self._confirm_routed(state, set(stored).intersection(state.routed))
        if state.routed:
            self._expire_routed(state, self._clock())
        return digest

    def _forget(self, state: _Replica) -> None:
        """Everything known about the replica's cache (it restarted); it keeps its slot."""
        self._held.clear(state.slot)
        _clear(self._routed, state.routed, 1 << state.slot)
        state.routed, state.seq, state.synced = {}, 0, False

    def _apply_events(self, state: _Replica, digest: ReplicaDigest) -> None:
        batches = [b for b in digest.batches if b.seq > state.seq]
        contiguous = bool(batches) and batches[0].seq == state.seq + 1
        snapshot = digest.snapshot
        if snapshot is not None and snapshot.seq >= state.seq and (not state.synced or not contiguous):
            self._replace_keys(state, snapshot.keys)
            state.seq, state.synced = snapshot.seq, True
            self.stats.num_resyncs += 1
            batches = [b for b in batches if b.seq > snapshot.seq]
            contiguous = not batches or batches[0].seq == state.seq + 1
        if batches and not contiguous:
            self.stats.num_gaps += state.synced
            state.synced = False  # keep what is known, apply what came; exact again at the next snapshot
        elif batches and state.seq == 0:
            state.synced = True  # every batch since the instance began: exact
        for batch in batches:
            self._apply_batch(state, batch)
            state.seq = batch.seq

    def _apply_batch(self, state: _Replica, batch: Batch) -> None:
        self._held.apply(state.slot, batch.stored, batch.evicted)
        if state.routed:
            self._confirm_routed(state, set(batch.stored).intersection(state.routed))
        self.stats.num_batches += 1
        self.stats.num_events += len(batch.stored) + len(batch.evicted)

    def _replace_keys(self, state: _Replica, new_keys) -> None:
        self._held.replace(state.slot, new_keys)
        if state.routed:
            holds, slot = self._held.holds, state.slot
            self._confirm_routed(state, [key for key in state.routed if holds(slot, key)])

    def _confirm_routed(self, state: _Replica, keys) -> None:
        """Routed keys the replica now reports holding: no longer a guess."""
        for key in keys:
            del state.routed[key]
        _clear(self._routed, keys, 1 << state.slot)

    # ---- the routed record ----------------------------------------------------------------------------------

    def record_routed(self, replica_id: ReplicaId, keys: Sequence[int]) -> None:
        """This router sent a request whose prompt has these block keys to the replica."""
        state = self._replicas.get(replica_id) or self._add(replica_id)
        bit = 1 << state.slot
        expiry = self._clock() + self._ttl_s
        routed, masks, holds, slot = state.routed, self._routed, self._held.holds, state.slot
        for key in keys:
            if holds(slot, key):
                continue
            if key in routed:
                del routed[key]  # re-insert: the dict stays in routing order for the size bound below
            else:
                masks[key] = masks.get(key, 0) | bit
            routed[key] = expiry
        while len(routed) > self._max_routed_keys:
            oldest = next(iter(routed))
            del routed[oldest]
            _clear(masks, (oldest,), bit)

    def _expire_routed(self, state: _Replica, now: float) -> None:
        # In routing order with one TTL, expiries only grow along the dict: the expired entries are a prefix.
        expired = []
        for key, expiry in state.routed.items():
            if expiry > now:
                break
            expired.append(key)
        for key in expired:
            del state.routed[key]
        _clear(self._routed, expired, 1 << state.slot)

    # ---- queries --------------------------------------------------------------------------------------------

    def match(self, keys: Sequence[int]) -> dict[int, Match]:
        """Per slot holding any leading key of `keys` (a prompt's routing keys, first first): how many leading keys
        it holds. O(len(keys) + replicas found)."""
        reported_of = dict(self._held.match(keys))
        depth_of = dict(reported_of)
        for slot, depth in deepest_in_masks(self._routed, keys) if self._routed else ():
            if depth > depth_of.get(slot, 0):
                depth_of[slot] = depth
        return {slot: Match(depth, reported_of.get(slot, 0)) for slot, depth in depth_of.items()}


def _clear(masks: dict[int, int], keys: Iterable[int], bit: int) -> None:
    for key in keys:
        mask = masks.get(key)
        if mask is None:
            continue
        mask &= ~bit
        if mask:
            masks[key] = mask
        else:
            del masks[key]
