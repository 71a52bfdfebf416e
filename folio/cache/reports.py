"""What the KV cache manager reports: prefix-cache counters (PrefixCacheStats) and the pool's state between two
steps for the router's digest (CacheSnapshot). Both are re-exported by folio.cache.manager."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counted over first admissions (a preempted sequence re-reading its own pages is not a hit)."""

    num_queried_tokens: int  # prompt tokens of sequences admitted for the first time
    num_hit_tokens: int  # of those, tokens whose K/V came from the cache (whole pages and copied slots)
    num_hit_pages: int  # whole pages reused
    num_partial_copies: int  # partial pages whose leading slots were copied
    num_evicted_pages: int  # ready pages dropped to make room (from the GPU, or from the host tier when it is on)
    num_host_hit_pages: int = 0  # of num_hit_pages, pages copied back from the host tier
    num_pages_to_host: int = 0  # pages moved GPU -> host tier since the start (evicted, kept)
    num_pages_from_host: int = 0  # pages moved host tier -> GPU since the start (prefix hits, first or not)
    num_copies_to_host: int = 0  # GPU -> host copies since the start (write-backs at eviction, write-through)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


@dataclass(frozen=True)
class CacheSnapshot:
    """The pool's state between two steps, for the router's digest (folio.router.digest reads these names)."""

    page_size: int
    num_pages: int
    num_free: int
    num_cached: int
    num_in_use: int
    num_allocatable: int
    ready_hashes: tuple[bytes, ...]  # every ready page hash (cached or in use), in the order they became ready

    def cached_hashes(self) -> Iterator[bytes]:
        return iter(self.ready_hashes)
