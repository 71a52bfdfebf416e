"""The routing digest: what a generator replica reports about its KV cache and load through
`record_routing_stats`, in a compact, bounded form (built replica side, decoded router side).

The Serve controller polls every replica each `request_routing_stats_period_s` and broadcasts every replica's dict
to every router, so the transfer costs routers x replicas x digest size per period: the digest must stay small
however large the cache is. Format (plain JSON-able types, version 1):

    v                      1
    instance_id            str: changes when the replica restarts (its cache is then empty); "" if unknown
    epoch                  int: increases with every report of one instance; older reports are ignored
    num_running            int: jobs the engine is running (admitted)
    num_queued             int: jobs waiting inside the replica
    max_running            int: jobs the engine runs at once (its max batch size); 0 if unknown
    num_prefill_tokens     int: prompt tokens of running and queued jobs not prefilled yet; 0 if unknown
    page_size              int: tokens per page (the router hashes prompts with it)
    num_pages              int: pages in the pool
    num_free_pages         int: pages with no content
    num_allocatable_pages  int: free + cached (evictable) pages: what a new job can get without preemption
    num_ready_pages        int: page hashes the pool holds ready (cached or in use), >= the number listed below
    hashes                 str: base64 of concatenated 8-byte page keys (see page_key), at most max_hashes of them

Why truncated 8-byte hashes: folio's page hashes are BLAKE2b outputs, so any 8 bytes of one are a uniform 64-bit
key. With K keys across all replicas in a router's index, a prompt page falsely matches with probability about
K / 2**64 (1e-14 for 64 replicas x 2,048 keys): exact in practice, at half the bytes of full hashes and without the
false positives of a Bloom filter, whose rate grows without bound as a fixed-size filter fills with a large cache.

Which hashes when the pool holds more than max_hashes: the newest ones, in the pool's store order
(`cached_hashes()` lists ready hashes in the order they became ready). A sequence's pages are stored first page
first, so the newest hashes are mostly the DEEPEST pages of the sequences computed last; a page hash names its
whole prefix, so the router counts every page before a reported page as held too (folio.router.index), and one reported
page stands for its whole chain, shared system prompt included. A prefix in use keeps getting new descendants
(the pages after it), so it stays represented; a prefix nobody extended lately drops out of the digest before it
drops out of the cache, which costs a hit, never a false one. (In bench/routing_sim.py at 256 hashes per digest,
newest-only beat oldest-half + newest-half and oldest-only: 87.5% hit rate against 85.6% and 83.7%.) The bound is
exact: len(hashes) <= max_hashes, and the encoded digest stays under digest_size_bound(max_hashes) bytes of JSON.
"""

from __future__ import annotations

import base64
import binascii
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from folio.hashing import HASH_SIZE

DIGEST_VERSION = 1
KEY_BYTES = 8
"""Bytes of a page hash kept in a digest key."""

DEFAULT_MAX_HASHES = 1024

_SNAPSHOT_ATTEMPTS = 8
_UINT64 = "Q"  # 8 bytes on every platform CPython supports
_NEEDS_BYTESWAP = sys.byteorder != "little"
assert array(_UINT64).itemsize == KEY_BYTES and HASH_SIZE % KEY_BYTES == 0
# Everything in the JSON encoding but the hashes: key names, a 64-character instance id, 11 integers < 2**63.
_FIXED_JSON_BYTES = 512
_INT_FIELDS = ("epoch", "num_running", "num_queued", "max_running", "num_prefill_tokens", "page_size", "num_pages",
               "num_free_pages", "num_allocatable_pages", "num_ready_pages")


class DigestError(ValueError):
    """A routing-stats dict that is not a valid digest."""


class PoolLike(Protocol):
    """The part of folio.cache.PagePool a digest reads (duck-typed: the router imports no engine code)."""

    page_size: int
    num_pages: int
    num_free: int
    num_allocatable: int

    def cached_hashes(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class ReplicaDigest:
    """A decoded digest. page_keys are the reported pages' 8-byte keys as ints (see page_key)."""

    instance_id: str
    epoch: int
    num_running: int
    num_queued: int
    max_running: int
    num_prefill_tokens: int
    page_size: int
    num_pages: int
    num_free_pages: int
    num_allocatable_pages: int
    num_ready_pages: int
    page_keys: frozenset[int]

    @property
    def complete(self) -> bool:
        """Every ready page of the pool is listed (the pool held at most max_hashes)."""
        return len(self.page_keys) >= self.num_ready_pages

    @property
    def num_jobs(self) -> int:
        return self.num_running + self.num_queued


def page_key(page_hash: bytes) -> int:
    """The index key of a folio page hash: its first KEY_BYTES bytes as an unsigned little-endian int."""
    return int.from_bytes(page_hash[:KEY_BYTES], "little")


def page_keys(page_hashes: Sequence[bytes]) -> list[int]:
    return [int.from_bytes(h[:KEY_BYTES], "little") for h in page_hashes]


def select_hashes(ready_hashes: Sequence[bytes], max_hashes: int) -> Sequence[bytes]:
    """At most max_hashes of `ready_hashes` (oldest first): the newest ones."""
    if max_hashes < 0:
        raise ValueError(f"max_hashes must be >= 0, got {max_hashes}")
    return ready_hashes[len(ready_hashes) - max_hashes:] if len(ready_hashes) > max_hashes else ready_hashes


def build_digest(pool: PoolLike, running: int, queued: int, epoch: int, max_hashes: int = DEFAULT_MAX_HASHES,
                 *, instance_id: str = "", max_running: int = 0, num_prefill_tokens: int = 0) -> dict[str, Any]:
    """The digest of `pool` (a folio.cache.PagePool) and the replica's job counts, as a JSON-able dict.
    max_running / num_prefill_tokens: see the module docstring (0: unknown).

    Safe to call from another thread than the engine's: the pool's hash snapshot is retried if the engine changes
    the index mid-copy. O(num_ready_pages) to snapshot, O(max_hashes) to encode.
    """
    if len(instance_id) > 64:
        raise ValueError(f"instance_id must be at most 64 characters, got {len(instance_id)}")
    ready = _snapshot(pool)
    packed = pack_keys(select_hashes(ready, max_hashes))
    return {
        "v": DIGEST_VERSION,
        "instance_id": instance_id,
        "epoch": int(epoch),
        "num_running": int(running),
        "num_queued": int(queued),
        "max_running": int(max_running),
        "num_prefill_tokens": int(num_prefill_tokens),
        "page_size": int(pool.page_size),
        "num_pages": int(pool.num_pages),
        "num_free_pages": int(pool.num_free),
        "num_allocatable_pages": int(pool.num_allocatable),
        "num_ready_pages": len(ready),
        "hashes": base64.b64encode(packed).decode("ascii"),
    }


def parse_digest(stats: Mapping[str, Any]) -> ReplicaDigest:
    """Decode a dict from build_digest. Raises DigestError if it is not one (wrong version, missing or mistyped
    field, hashes not a whole number of keys)."""
    if not isinstance(stats, Mapping):
        raise DigestError(f"a digest is a mapping, got {type(stats).__name__}")
    if stats.get("v") != DIGEST_VERSION:
        raise DigestError(f"unsupported digest version {stats.get('v')!r} (expected {DIGEST_VERSION})")
    values = {}
    for name in _INT_FIELDS:
        value = stats.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise DigestError(f"digest field {name!r} must be a non-negative int, got {value!r}")
        values[name] = value
    if values["page_size"] == 0:
        raise DigestError("digest field 'page_size' must be positive")
    instance_id = stats.get("instance_id", "")
    if not isinstance(instance_id, str):
        raise DigestError(f"digest field 'instance_id' must be a str, got {instance_id!r}")
    encoded = stats.get("hashes")
    if not isinstance(encoded, str):
        raise DigestError(f"digest field 'hashes' must be a base64 str, got {type(encoded).__name__}")
    try:
        packed = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as e:
        raise DigestError(f"digest field 'hashes' is not base64: {e}") from None
    if len(packed) % KEY_BYTES:
        raise DigestError(f"digest field 'hashes' holds {len(packed)} bytes, not a multiple of {KEY_BYTES}")
    keys = array(_UINT64, packed)
    if _NEEDS_BYTESWAP:
        keys.byteswap()
    return ReplicaDigest(instance_id=instance_id, page_keys=frozenset(keys), **values)


def pack_keys(page_hashes: Sequence[bytes]) -> bytes:
    """The first KEY_BYTES bytes of each hash, concatenated (one C-level pass: a digest packs thousands)."""
    joined = b"".join(page_hashes)
    if len(joined) != HASH_SIZE * len(page_hashes):
        raise ValueError(f"page hashes must be {HASH_SIZE} bytes each")
    words = array(_UINT64, joined)  # HASH_SIZE // KEY_BYTES words per hash; the first one is the key
    return words[::HASH_SIZE // KEY_BYTES].tobytes()


def digest_size_bound(max_hashes: int) -> int:
    """Most bytes a digest with at most max_hashes keys takes as JSON."""
    return _FIXED_JSON_BYTES + 4 * ((max_hashes * KEY_BYTES + 2) // 3)


def _snapshot(pool: PoolLike) -> Sequence[bytes]:
    # PagePool.cached_hashes() copies its index in one call; that copy raises RuntimeError if the engine thread
    # changes the index meanwhile. It is O(num_ready_pages) and the engine thread rarely holds the GIL that long,
    # so a retry nearly always succeeds.
    for _ in range(_SNAPSHOT_ATTEMPTS - 1):
        try:
            return tuple(pool.cached_hashes())
        except RuntimeError:
            continue
    return tuple(pool.cached_hashes())
