"""What a replica's cache holds, as routers index it: routing keys every `block_tokens` tokens of a sequence, published
as numbered batches of stored / evicted keys (replica side), with a full snapshot now and then for routers that
missed batches or joined late.

Routing keys: a folio page hash names its whole prefix (folio.hashing chains them), so the key of the page that
ends at token k says "this replica holds the first k tokens of this prompt". Indexing every page would cost a
router memory and work in proportion to the fleet's pages, which grows 16x from page size 256 to 16 for the same
cache. The keys (folio.router.keys) are a page every `dense_key_tokens` (64) in a sequence's first `dense_tokens`,
then the pages that end at a multiple of `block_tokens` (every block_tokens // page_size pages, at least 1): the
work follows the tokens, not the pages, at the price of matching long prefixes to the block below, while prompts
sharing only a short system prompt are still told apart.

Batches: `CacheEvents.add` takes the pool's PageEvents (with their depth) as the engine produces them and keeps the
routing keys among them; `publish` closes a batch under the next sequence number. A key stored and evicted within
one batch cancels out. The last `history` batches travel in every report, so a router that misses a few reports
loses nothing; one that misses more (a gap in the sequence numbers) or starts late rebuilds from the next snapshot
(the set of keys held after batch `seq`), which a replica includes every `snapshot_every` reports. Every call of a
replica's record_routing_stats publishes a batch (Serve's controller polls it each period; diagnostics such as
folio.serve.client.replica_stats call it too), so the history covers several periods.

Bounds: the replica keeps one key per cached block (num_pages / stride keys) and `history` batches; a report carries
at most history x (keys stored and evicted per period) plus, on a snapshot report, num_pages / stride keys.
"""

from __future__ import annotations

import base64
import binascii
import sys
from array import array
from collections import deque
from collections.abc import Iterable
from typing import Any

from folio.router.keys import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_DENSE_KEY_TOKENS,
    DEFAULT_DENSE_TOKENS,
    KEY_BYTES,
    block_stride,
    dense_pages,
    is_key_depth,
    page_key,
)

DEFAULT_HISTORY = 16
DEFAULT_SNAPSHOT_EVERY = 16

_UINT64 = "Q"
_NEEDS_BYTESWAP = sys.byteorder != "little"
_STORED = "stored"  # folio.cache.PageEventKind values (the router imports no engine code)
_EVICTED = "evicted"
_MOVED_TO_HOST = "moved_to_host"  # (the replica's host tier holds it: still a prefix hit, a copy instead of compute)


class EventsError(ValueError):
    """A report's batches or snapshot are malformed."""


def pack(keys: Iterable[int]) -> str:
    words = array(_UINT64, keys)
    if _NEEDS_BYTESWAP:
        words.byteswap()
    return base64.b64encode(words.tobytes()).decode("ascii")


def unpack(encoded: Any, what: str) -> array:
    if type(encoded) is not str:
        raise EventsError(f"{what} must be a base64 str, got {type(encoded).__name__}")
    try:
        # (strict: the alphabet and padding checked in C, where base64.b64decode's validate runs a regex first)
        raw = binascii.a2b_base64(encoded, strict_mode=True)
    except (binascii.Error, ValueError) as e:
        raise EventsError(f"{what} is not base64: {e}") from None
    if len(raw) % KEY_BYTES:
        raise EventsError(f"{what} holds {len(raw)} bytes, not a multiple of {KEY_BYTES}")
    words = array(_UINT64, raw)
    if _NEEDS_BYTESWAP:
        words.byteswap()
    return words


class CacheEvents:
    """Replica side. Not thread-safe: call from the engine thread (or under the caller's lock)."""

    def __init__(self, page_size: int, block_tokens: int = DEFAULT_BLOCK_TOKENS, *,
                 dense_tokens: int = DEFAULT_DENSE_TOKENS, dense_key_tokens: int = DEFAULT_DENSE_KEY_TOKENS,
                 history: int = DEFAULT_HISTORY,
                 snapshot_every: int = DEFAULT_SNAPSHOT_EVERY) -> None:
        if history < 1 or snapshot_every < 1:
            raise ValueError(f"history and snapshot_every must be >= 1, got {history} and {snapshot_every}")
        self.page_size = page_size
        self.block_tokens = block_tokens
        self.dense_tokens = dense_tokens
        self.stride = block_stride(page_size, block_tokens)
        self.dense_pages = dense_pages(page_size, dense_tokens)
        self.dense_key_tokens = dense_key_tokens
        self.dense_stride = block_stride(page_size, dense_key_tokens)
        self.seq = 0
        self.num_published_events = 0  # stored + evicted keys over all batches (net of cancellations)
        self._snapshot_every = snapshot_every
        self._num_reports = 0
        self._held: dict[int, None] = {}  # keys held now (an ordered set)
        self._stored: dict[int, None] = {}  # this batch's net changes
        self._evicted: dict[int, None] = {}
        self._host: dict[int, None] = {}  # held keys whose pages are in the replica's host tier
        self._moved: dict[int, None] = {}  # this batch's keys moved to the host tier (still held)
        self._returned: dict[int, None] = {}  # this batch's stored keys that were held on the host before it
        self._batches: deque[list] = deque(maxlen=history)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def add(self, events: Iterable[Any]) -> None:
        """folio.cache.PageEvent objects (kind, hash, depth), oldest first. A page moved to the replica's host tier
        stays held (batches list it apart: a router may count such a hit for less); stored again, it is back on
        the GPU."""
        stride, dense, dense_stride = self.stride, self.dense_pages, self.dense_stride
        for event in events:
            kind = event.kind.value
            stored = kind == _STORED
            if stored and not is_key_depth(event.depth, stride, dense, dense_stride):
                continue  # (an eviction is checked against the held keys whatever its depth: see resync)
            key = page_key(event.hash)
            if kind == _MOVED_TO_HOST:
                if key in self._held:
                    self._host[key] = self._moved[key] = None
                continue
            if self._host.pop(key, False) is None and self._moved.pop(key, False) is not None and stored:
                self._stored[key] = self._returned[key] = None  # back on the GPU, moved in an earlier batch
                continue
            if stored:
                if key in self._held:
                    continue
                self._held[key] = None
                if self._evicted.pop(key, False) is None:
                    continue  # evicted then stored again within the batch: no net change
                self._stored[key] = None
            elif event.kind.value == _EVICTED:
                if self._held.pop(key, False) is not None:
                    continue  # not a key we hold (stored before the log began)
                if self._stored.pop(key, False) is None and self._returned.pop(key, False) is not None:
                    continue  # stored within this batch: no net change
                self._evicted[key] = None

    def resync(self, page_hashes: Iterable[bytes]) -> None:
        """Some events were lost (the engine's buffer overflowed): hold exactly the keys of `page_hashes` (every
        ready page; keys of pages between blocks never match a router's lookup, so listing them is harmless) and
        make routers rebuild: the next report skips a sequence number and carries a snapshot."""
        self._held = dict.fromkeys(page_key(h) for h in page_hashes)
        self._stored.clear()
        self._evicted.clear()
        self._host.clear()
        self._moved.clear()
        self._returned.clear()
        self._batches.clear()
        self.seq += 1  # the gap routers will see
        self._num_reports = 0  # the next report carries a snapshot

    def publish(self) -> int:
        """Close the current batch (possibly empty) under the next sequence number; returns it."""
        self.seq += 1
        self.num_published_events += len(self._stored) + len(self._evicted) + len(self._moved)
        batch = [self.seq, pack(self._stored), pack(self._evicted)]
        if self._moved:  # (only then: reports of replicas without a host tier keep their three-field batches)
            batch.append(pack(self._moved))
        self._batches.append(batch)
        self._stored.clear()
        self._evicted.clear()
        self._moved.clear()
        self._returned.clear()
        return self.seq

    def report_fields(self) -> dict[str, Any]:
        """Publish a batch and return the report's routing-key fields (folio.router.digest): block_tokens, seq, the
        recent batches, and every snapshot_every-th report (the first one included) the held keys."""
        self.publish()
        fields: dict[str, Any] = {"block_tokens": self.block_tokens, "dense_tokens": self.dense_tokens,
                                  "dense_key_tokens": self.dense_key_tokens,
                                  "seq": self.seq,
                                  "batches": [list(b) for b in self._batches], "snapshot": None}
        if self._num_reports % self._snapshot_every == 0:
            fields["snapshot"] = {"seq": self.seq, "keys": pack(self._held)}
            if self._host:
                fields["snapshot"]["host_keys"] = pack(self._host)
        self._num_reports += 1
        return fields
