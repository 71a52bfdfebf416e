"""Releasing the pages before a running sequence's sliding window. Torch-free; the KV cache manager's helper.

Where every layer of the model attends to a window of at most `window` tokens (folio.model.windows.released_window),
the query at position i reads keys i - window < j <= i only, so the pages wholly before the window of a sequence's
next token (position num_cached_tokens) are never read again. They go back to the pool while the sequence runs, as
a finished job's do: full pages stay cached under their hash, findable as a prefix by later prompts. Their
block-table entries become RELEASED_PAGE; the attention kernels start at each row's window and never read them
(the CPU binding checks that). A rollback that reaches back before the window takes the pages back by hash.
"""

from __future__ import annotations

from folio.cache.pool import PagePool
from folio.sequence import Sequence

# The block-table entry of a page released before its sequence ended.
RELEASED_PAGE = -1


def num_dead_pages(seq: Sequence, window: int, page_size: int) -> int:
    """Leading pages that no query at or after position num_cached_tokens reads (window 0: none)."""
    if window == 0:
        return 0
    return max(0, seq.num_cached_tokens - window + 1) // page_size


def held_pages(seq: Sequence, begin: int = 0) -> list[int]:
    """The sequence's block-table entries from `begin` on that name pages it holds (not released ones)."""
    return seq.block_table[max(begin, seq.num_released_pages):]


def release_before_window(pool: PagePool, seq: Sequence, window: int, page_size: int) -> None:
    """Give back the pages wholly before the window of the sequence's next token (they were committed: full pages
    keep their hash in the pool when the prefix cache is on)."""
    dead = min(num_dead_pages(seq, window, page_size), len(seq.block_table))
    first = seq.num_released_pages
    if dead <= first:
        return
    pool.release(seq.block_table[first:dead])
    seq.block_table[first:dead] = [RELEASED_PAGE] * (dead - first)
    seq.num_released_pages = dead


def restore_window(pool: PagePool, seq: Sequence, window: int, page_size: int, prefix_cache: bool) -> bool:
    """After a rollback: take back by hash the released pages that the window of the new next token reaches
    again. False, changing nothing, where one of them is gone (evicted, or never hashed without the prefix cache):
    the caller then computes the sequence again from the start."""
    dead = num_dead_pages(seq, window, page_size)
    last = seq.num_released_pages
    if dead >= last:
        return True
    hashes = seq.page_hashes[dead:last]
    if not prefix_cache or len(hashes) != last - dead or pool.lookup(hashes).num_ready != last - dead:
        return False
    seq.block_table[dead:last] = pool.acquire(hashes)
    seq.num_released_pages = dead
    return True
