"""The partial-page index: which pages' recorded tokens could extend a sequence, for reuse of a partial match.

A page's recorded tokens (PageRecord.tokens: the token ids whose K/V are written in its first slots) make it a
candidate for any sequence with the same parent hash and namespace whose next tokens share a prefix with them.
Pages are filed under (parent hash, namespace, first token id, second token id), so a lookup only compares against
pages that already match MIN_PARTIAL_MATCH tokens; the pool keeps this index in step with every page's tokens.

A bucket is a list of (recorded tokens, page id) kept sorted, and a lookup bisects it: of strings in lexicographic
order, the longest common prefix with a query is found next to where the query would be inserted, and every string
sharing that prefix lies in one run, whose first entry is the answer. A bucket can hold thousands of pages (every
cached first page of prompts that begin alike, or every partial page after one shared system prompt): a lookup
that compared against each of them took a quarter of a GPU replica's engine thread in a burst of 1,000 short
prompts.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple

from folio.cache.page import PageRecord

# A page is a partial-reuse candidate if it has at least this many recorded tokens (the reference requires > 1:
# copying one slot saves less than the copy costs).
MIN_PARTIAL_MATCH = 2

PartialKey = tuple[bytes | None, bytes, int, int]  # (parent hash, namespace, first token id, second token id)


class PartialMatch(NamedTuple):
    page_id: int
    num_matching: int  # leading token ids (= K/V slots) of page_id that equal the caller's


def partial_key(page: PageRecord) -> PartialKey:
    """The bucket of a page with at least MIN_PARTIAL_MATCH recorded tokens."""
    return (page.parent, page.namespace, page.tokens[0], page.tokens[1])


class PartialIndex:
    """Owns PageRecord.tokens/namespace: set and clear them only through set_tokens() and clear_tokens()."""

    def __init__(self) -> None:
        # partial_key -> (recorded tokens, page id) of the pages with >= MIN_PARTIAL_MATCH recorded tokens filed
        # there, sorted; read by check().
        self.buckets: dict[PartialKey, list[tuple[tuple[int, ...], int]]] = {}

    def set_tokens(self, page: PageRecord, token_ids: Sequence[int], namespace: bytes) -> None:
        """Record `token_ids` as the page's written tokens, replacing any earlier record. The page's parent must be
        linked first: it is part of the key."""
        self.clear_tokens(page)
        page.tokens = tuple(token_ids)
        page.namespace = namespace
        if len(page.tokens) >= MIN_PARTIAL_MATCH:
            bisect.insort(self.buckets.setdefault(partial_key(page), []), (page.tokens, page.page_id))

    def clear_tokens(self, page: PageRecord) -> None:
        """Forget the page's recorded tokens, if any. Call before unlinking its parent (part of the key)."""
        if page.tokens is None:
            return
        if len(page.tokens) >= MIN_PARTIAL_MATCH:
            key = partial_key(page)
            bucket = self.buckets[key]
            entry = (page.tokens, page.page_id)
            at = bisect.bisect_left(bucket, entry)
            if at == len(bucket) or bucket[at] != entry:
                raise AssertionError(f"page {page.page_id} is missing from its partial-index bucket")
            del bucket[at]
            if not bucket:
                del self.buckets[key]
        page.tokens = None
        page.namespace = b""

    def best_match(self, parent_hash: bytes | None, token_ids: Sequence[int],
                   namespace: bytes) -> PartialMatch | None:
        """The indexed page after `parent_hash` in `namespace` sharing the longest common prefix with `token_ids`
        (ties: the page whose recorded tokens sort first, then the lowest page id), or None if none shares
        MIN_PARTIAL_MATCH tokens. O(log(candidates) * page_size)."""
        if len(token_ids) < MIN_PARTIAL_MATCH:
            return None
        bucket = self.buckets.get((parent_hash, namespace, token_ids[0], token_ids[1]))
        if not bucket:
            return None
        query = tuple(token_ids)
        at = bisect.bisect_left(bucket, (query,))  # (a 1-tuple sorts before every entry with the same tokens)
        longest = max(_common_prefix_len(bucket[i][0], query) for i in (at - 1, at) if 0 <= i < len(bucket))
        # Every entry of the bucket shares its first MIN_PARTIAL_MATCH tokens with the query, so longest >= 2; the
        # entries sharing `longest` tokens start at the first one not below the query's first `longest` tokens.
        first = bisect.bisect_left(bucket, (query[:longest],))
        return PartialMatch(bucket[first][1], longest)

    def clear(self) -> None:
        self.buckets.clear()


def _common_prefix_len(recorded: Sequence[int], token_ids: Sequence[int]) -> int:
    limit = min(len(recorded), len(token_ids))
    idx = 0
    while idx < limit and recorded[idx] == token_ids[idx]:
        idx += 1
    return idx
