"""The partial-page index: which pages' recorded tokens could extend a sequence, for reuse of a partial match.

A page's recorded tokens (PageRecord.tokens: the token ids whose K/V are written in its first slots) make it a
candidate for any sequence with the same parent hash and namespace whose next tokens share a prefix with them.
Pages are filed under (parent hash, namespace, first token id, second token id), so a lookup only compares against
pages that already match MIN_PARTIAL_MATCH tokens; the pool keeps this index in step with every page's tokens.
"""

from __future__ import annotations

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

    def __init__(self, pages: list[PageRecord]) -> None:
        self._pages = pages  # the pool's page list, shared (the pool never rebinds it)
        # partial_key -> ids of the pages with >= MIN_PARTIAL_MATCH recorded tokens filed there; read by check().
        self.buckets: dict[PartialKey, set[int]] = {}

    def set_tokens(self, page: PageRecord, token_ids: Sequence[int], namespace: bytes) -> None:
        """Record `token_ids` as the page's written tokens, replacing any earlier record. The page's parent must be
        linked first: it is part of the key."""
        self.clear_tokens(page)
        page.tokens = tuple(token_ids)
        page.namespace = namespace
        if len(page.tokens) >= MIN_PARTIAL_MATCH:
            self.buckets.setdefault(partial_key(page), set()).add(page.page_id)

    def clear_tokens(self, page: PageRecord) -> None:
        """Forget the page's recorded tokens, if any. Call before unlinking its parent (part of the key)."""
        if page.tokens is None:
            return
        if len(page.tokens) >= MIN_PARTIAL_MATCH:
            key = partial_key(page)
            bucket = self.buckets[key]
            bucket.discard(page.page_id)
            if not bucket:
                del self.buckets[key]
        page.tokens = None
        page.namespace = b""

    def best_match(self, parent_hash: bytes | None, token_ids: Sequence[int],
                   namespace: bytes) -> PartialMatch | None:
        """The indexed page after `parent_hash` in `namespace` sharing the longest common prefix with `token_ids`
        (ties: lowest page id), or None if none shares MIN_PARTIAL_MATCH tokens. O(candidates * page_size)."""
        if len(token_ids) < MIN_PARTIAL_MATCH:
            return None
        candidates = self.buckets.get((parent_hash, namespace, token_ids[0], token_ids[1]))
        if not candidates:
            return None
        best: PartialMatch | None = None
        for page_id in sorted(candidates):
            num_matching = _common_prefix_len(self._pages[page_id].tokens, token_ids)
            if best is None or num_matching > best.num_matching:
                best = PartialMatch(page_id, num_matching)
        return best

    def clear(self) -> None:
        self.buckets.clear()


def _common_prefix_len(recorded: Sequence[int], token_ids: Sequence[int]) -> int:
    limit = min(len(recorded), len(token_ids))
    idx = 0
    while idx < limit and recorded[idx] == token_ids[idx]:
        idx += 1
    return idx
