"""The routing report: what a generator replica tells routers through `record_routing_stats` (built replica side,
decoded router side): its load, its measured speeds, and the changes to the routing keys its cache holds.

The Serve controller polls every replica each `request_routing_stats_period_s` and broadcasts every replica's dict
to every router. A report carries the replica's last few batches of cache events (folio.router.events), not its whole
cache, so its size follows the cache's rate of change, not its size; a snapshot of the held keys comes every few
reports for routers that missed batches. Format (plain JSON-able types, version 2):

    v                      2
    instance_id            str: changes when the replica restarts (its cache is then empty); "" if unknown
    epoch                  int: increases with every report of one instance; older reports are ignored
    num_running            int: jobs the engine is running (admitted)
    num_queued             int: jobs waiting inside the replica
    max_running            int: jobs the engine runs at once (its max batch size); 0 if unknown
    num_prefill_tokens     int: prompt tokens of running and queued jobs not prefilled yet
    num_received           int: requests the replica received since it started (every router's: a router tells
                           its share of the traffic from it, folio.router.cost)
    page_size              int: tokens per page
    num_pages              int: pages in the pool
    num_free_pages         int: pages with no content
    num_allocatable_pages  int: free + cached (evictable) pages: what a new job can get without preemption
    prefill_tokens_per_s   float: measured prefill speed (0: not measured yet)    (folio.router.rates)
    decode_step_s          float: measured seconds per decode step (0: not yet)
    mean_new_tokens        float: tokens generated per finished job (0: not yet)
    prefill_samples,       int, optional: the observations behind each of the three (engine steps, finished jobs);
    decode_samples,        absent (a replica of an earlier version): SAMPLES_UNKNOWN, trusted as fully measured
    finished_samples
    block_tokens           int: tokens between two routing keys past dense_tokens   (folio.router.events)
    dense_tokens           int: leading tokens of a sequence with a routing key every dense_key_tokens
    dense_key_tokens       int
    seq                    int: sequence number of the newest batch
    batches                list of [seq, stored, evicted] or [seq, stored, evicted, moved]: the last few batches,
                           oldest first; stored / evicted / moved are base64 of little-endian uint64 routing keys;
                           moved: keys whose pages went to the replica's host tier (still held: a hit costs a copy)
    snapshot               null, or {"seq": s, "keys": base64[, "host_keys": base64]}: every key held after batch
                           s (and those of them held in the host tier)
"""

from __future__ import annotations

import math
import operator
import struct
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from folio.router.events import CacheEvents, EventsError, unpack
from folio.router.keys import page_key, page_keys  # noqa: F401 (re-exported: the router's key of a page hash)
from folio.router.rates import ReplicaRates

DIGEST_VERSION = 2

_INT_FIELDS = ("epoch", "num_running", "num_queued", "max_running", "num_prefill_tokens", "num_received", "page_size",
               "num_pages", "num_free_pages", "num_allocatable_pages", "block_tokens", "dense_tokens",
               "dense_key_tokens", "seq")
_FLOAT_FIELDS = ("prefill_tokens_per_s", "decode_step_s", "mean_new_tokens")
# ReplicaDigest's numeric fields in its order: the counts up to num_allocatable_pages, the rates, then the geometry
_NUM_COUNTS = 10
_NUMBER_FIELDS = (*_INT_FIELDS[:_NUM_COUNTS], *_FLOAT_FIELDS, *_INT_FIELDS[_NUM_COUNTS:])
_NUMBERS = operator.itemgetter(*_NUMBER_FIELDS)
_INTS = operator.itemgetter(*(_NUMBER_FIELDS.index(name) for name in _INT_FIELDS))
_FLOATS = operator.itemgetter(*(_NUMBER_FIELDS.index(name) for name in _FLOAT_FIELDS))
_REPORTED_TYPES = tuple(float if name in _FLOAT_FIELDS else int for name in _NUMBER_FIELDS)
_SAMPLE_FIELDS = ("prefill_samples", "decode_samples", "finished_samples")
# What a report without the sample counts (an earlier version's) is read as: as many observations as it takes to
# trust its rates over the fleet's (folio.router.cost).
SAMPLES_UNKNOWN = 1 << 30
_POSITIVE = operator.itemgetter(*(_NUMBER_FIELDS.index(name)
                                  for name in ("page_size", "block_tokens", "dense_key_tokens", "seq")))
# ReplicaDigest.numbers(): every number of a report, in ReplicaDigest's order, as float64s
NUMBER_FIELDS = (*_NUMBER_FIELDS, *_SAMPLE_FIELDS)
_DIGEST_NUMBERS = operator.attrgetter(*NUMBER_FIELDS)
_PACK_NUMBERS = struct.Struct(f"={len(NUMBER_FIELDS)}d").pack
# The common report, what build_digest writes (every field, the numbers of the types it writes, no snapshot), as the
# native key index reads it and applies its batches in one call (KeyIndex.apply_report, from folio.router.index,
# which checks the version, the instance and the epoch first): ReplicaDigest's fields up to finished_samples in its
# order, then the snapshot and the batches, each with its kind (exact types): s str, i int >= 0, p int > 0, q int >= 0
# and the newest seq of a batch, f float in [0, inf), n None, b the batch list (each [seq, stored, evicted(, moved)],
# keys base64 of little-endian uint64). It returns those fields, then their numbers packed as numbers() packs them.
# Most reports a router reads are this; anything else takes parse_digest.
_KINDS = {"instance_id": "s", "page_size": "p", "block_tokens": "p", "dense_key_tokens": "p", "seq": "q",
          "snapshot": "n", "batches": "b", **dict.fromkeys(_FLOAT_FIELDS, "f")}
COMMON_REPORT_FIELDS = ("instance_id", *NUMBER_FIELDS, "snapshot", "batches")
COMMON_REPORT_KINDS = "".join(_KINDS.get(name, "i") for name in COMMON_REPORT_FIELDS)


class DigestError(ValueError):
    """A routing-stats dict that is not a valid report."""


class PoolLike(Protocol):
    """The part of folio.cache.PagePool a report reads (duck-typed: the router imports no engine code)."""

    page_size: int
    num_pages: int
    num_free: int
    num_allocatable: int


@dataclass(slots=True)  # (read-only; not frozen for the same reason as ReplicaDigest)
class Batch:
    seq: int
    stored: array
    evicted: array
    moved: array = field(default_factory=lambda: array("Q"))  # held keys now in the replica's host tier


@dataclass(slots=True)
class Snapshot:
    seq: int
    keys: array
    host_keys: array = field(default_factory=lambda: array("Q"))  # of `keys`, those held in the host tier


@dataclass(slots=True)
class ReplicaDigest:
    """A decoded report (treat it as read-only; not frozen because a frozen dataclass's __init__ sets each field
    through object.__setattr__, which a router pays for every report of every replica)."""

    instance_id: str
    epoch: int
    num_running: int
    num_queued: int
    max_running: int
    num_prefill_tokens: int
    num_received: int
    page_size: int
    num_pages: int
    num_free_pages: int
    num_allocatable_pages: int
    prefill_tokens_per_s: float
    decode_step_s: float
    mean_new_tokens: float
    block_tokens: int
    dense_tokens: int
    dense_key_tokens: int
    seq: int
    prefill_samples: int = SAMPLES_UNKNOWN
    decode_samples: int = SAMPLES_UNKNOWN
    finished_samples: int = SAMPLES_UNKNOWN
    # numbers(), once packed (the native index packs them as it reads a report)
    packed_numbers: bytes | None = field(default=None, repr=False, compare=False)
    # the batches after the reader's applied seq, decoded (empty where the native index applied them as it read the
    # report: folio.router.index)
    batches: tuple[Batch, ...] = ()
    snapshot: Snapshot | None = None

    @property
    def num_jobs(self) -> int:
        return self.num_running + self.num_queued

    def numbers(self) -> bytes:
        """Its numbers (NUMBER_FIELDS: epoch .. finished_samples) as float64s in native byte order, packed: the
        form in which folio.router.cost reads every replica's report at once."""
        if self.packed_numbers is None:
            self.packed_numbers = _PACK_NUMBERS(*_DIGEST_NUMBERS(self))
        return self.packed_numbers


def build_digest(pool: PoolLike, events: CacheEvents, running: int, queued: int, epoch: int, *,
                 instance_id: str = "", max_running: int = 0, num_prefill_tokens: int = 0, num_received: int = 0,
                 rates: ReplicaRates | None = None) -> dict[str, Any]:
    """The report of a replica whose pool is `pool` and whose pool events went into `events` (this closes a batch
    of them). Call where the pool and the job counts are consistent (the engine thread, between steps)."""
    if len(instance_id) > 64:
        raise ValueError(f"instance_id must be at most 64 characters, got {len(instance_id)}")
    return {
        "v": DIGEST_VERSION,
        "instance_id": instance_id,
        "epoch": int(epoch),
        "num_running": int(running),
        "num_queued": int(queued),
        "max_running": int(max_running),
        "num_prefill_tokens": int(num_prefill_tokens),
        "num_received": int(num_received),
        "page_size": int(pool.page_size),
        "num_pages": int(pool.num_pages),
        "num_free_pages": int(pool.num_free),
        "num_allocatable_pages": int(pool.num_allocatable),
        **(rates or ReplicaRates()).fields(),
        **events.report_fields(),
    }


def parse_digest(stats: Mapping[str, Any], applied_seq: int = 0) -> ReplicaDigest:
    """Decode a dict from build_digest. Raises DigestError if it is not one (wrong version, missing or mistyped
    field, malformed keys). applied_seq: the reader already applied this instance's batches up to that seq; those
    are left out (not checked either): a report repeats its last batches, and decoding them again at every report
    would cost more than applying the new one."""
    if type(stats) is not dict and not isinstance(stats, Mapping):
        raise DigestError(f"a digest is a mapping, got {type(stats).__name__}")
    if stats.get("v") != DIGEST_VERSION:
        raise DigestError(f"unsupported digest version {stats.get('v')!r} (expected {DIGEST_VERSION})")
    # (Exact type checks: a bool is not a count.) Every number is fetched in one C call and checked in bulk: a router
    # parses every replica's report each period, and a Python loop over the fields was most of that time.
    try:
        numbers = _NUMBERS(stats)
    except KeyError as e:
        raise DigestError(f"digest field {e.args[0]!r} is missing") from None
    floats = _FLOATS(numbers)
    prefill_rate, decode_step, new_tokens = floats
    # the common case, what build_digest writes (ints; floats for the rates) all in range, checked in bulk (a NaN
    # fails its comparison); anything else is checked field by field, naming the first bad one
    if not (tuple(map(type, numbers)) == _REPORTED_TYPES and min(numbers) >= 0 and 0 <= prefill_rate < math.inf
            and 0 <= decode_step < math.inf and 0 <= new_tokens < math.inf):
        _check_numbers(numbers)
        floats = tuple(map(float, floats))
    page_size, block_tokens, dense_key_tokens, seq = _POSITIVE(numbers)
    if page_size == 0 or block_tokens == 0 or dense_key_tokens == 0:
        raise DigestError("digest fields 'page_size', 'block_tokens' and 'dense_key_tokens' must be positive")
    instance_id = stats.get("instance_id", "")
    if not isinstance(instance_id, str):
        raise DigestError(f"digest field 'instance_id' must be a str, got {instance_id!r}")
    get = stats.get
    samples = (get("prefill_samples", SAMPLES_UNKNOWN), get("decode_samples", SAMPLES_UNKNOWN),
               get("finished_samples", SAMPLES_UNKNOWN))
    if not (tuple(map(type, samples)) == (int, int, int) and min(samples) >= 0):
        for name, value in zip(_SAMPLE_FIELDS, samples):
            if type(value) is not int or value < 0:
                raise DigestError(f"digest field {name!r} must be a non-negative int, got {value!r}")
    try:
        batches = tuple(_batch(b) for b in _new_batches(_list(stats.get("batches"), "batches"), applied_seq))
        snapshot = _snapshot(stats.get("snapshot"))
    except EventsError as e:
        raise DigestError(str(e)) from None
    if any(b.seq > seq for b in batches) or (snapshot is not None and snapshot.seq > seq):
        raise DigestError("a batch or the snapshot is newer than the report's seq")
    return ReplicaDigest(instance_id, *numbers[:_NUM_COUNTS], *floats, *numbers[_NUM_COUNTS + 3:], *samples,
                         batches=batches, snapshot=snapshot)


def _check_numbers(numbers: tuple) -> None:
    """The slow path's checks, naming the first bad field: exact ints (a bool is not a count), non-negative; finite
    non-negative numbers for the rates (ints allowed)."""
    for name, value in zip(_INT_FIELDS, _INTS(numbers)):
        if type(value) is not int or value < 0:
            raise DigestError(f"digest field {name!r} must be a non-negative int, got {value!r}")
    for name, value in zip(_FLOAT_FIELDS, _FLOATS(numbers)):
        if (type(value) is not float and type(value) is not int) or not 0 <= value < math.inf:
            raise DigestError(f"digest field {name!r} must be a finite non-negative number, got {value!r}")


def _list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise EventsError(f"digest field {what!r} must be a list, got {type(value).__name__}")
    return value


def _new_batches(batches: list, applied_seq: int) -> list:
    """The batches after applied_seq, oldest first. A report lists its batches oldest first with increasing seqs
    (folio.router.events), so the scan walks back from the newest and stops at the first applied one: a report
    repeats up to DEFAULT_HISTORY batches, a router that keeps up reads one. Anything malformed met on the way
    goes on to _batch (and fails there)."""
    if not applied_seq:
        return batches
    first = len(batches)
    while first > 0 and not _is_applied(batches[first - 1], applied_seq):
        first -= 1
    return batches[first:]


def _is_applied(value: Any, applied_seq: int) -> bool:
    try:
        return value[0] <= applied_seq
    except (TypeError, IndexError, KeyError):
        return False  # malformed: not known to be applied, so _batch sees it (and refuses it)


def _batch(value: Any) -> Batch:
    if type(value) is not list or len(value) not in (3, 4) or type(value[0]) is not int or value[0] < 1:
        raise EventsError(f"a batch is [seq >= 1, stored, evicted(, moved)], got {value!r:.80}")
    batch = Batch(value[0], unpack(value[1], "a batch's stored keys"), unpack(value[2], "a batch's evicted keys"))
    if len(value) == 4:
        batch.moved = unpack(value[3], "a batch's moved keys")
    return batch


def _snapshot(value: Any) -> Snapshot | None:
    if value is None:
        return None
    seq = value.get("seq") if isinstance(value, Mapping) else None
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise EventsError(f"a snapshot is {{'seq': int >= 1, 'keys': base64}}, got {value!r:.80}")
    snapshot = Snapshot(value["seq"], unpack(value.get("keys"), "the snapshot's keys"))
    if "host_keys" in value:
        snapshot.host_keys = unpack(value["host_keys"], "the snapshot's host keys")
    return snapshot
