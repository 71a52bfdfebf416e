"""Router keys: the first 8 bytes of a folio page hash as an int, and which pages' keys the router indexes.

Why 8 bytes: folio's page hashes are BLAKE2b outputs, so any 8 bytes of one are a uniform 64-bit key. With K keys
across all replicas in a router's index, a prompt's key falsely matches with probability about K / 2**64 (5e-13 for
512 replicas x 16,384 keys): exact in practice, at a quarter of the bytes of full hashes.

Which pages (folio.router.events explains why): in a sequence's first `dense_tokens` tokens, the pages ending at a
multiple of `dense_key_tokens` (every page when pages are that large), so that prompts sharing only a short system
prompt or template are told apart; after that, the pages ending at a multiple of `block_tokens` tokens, every
block_stride(page_size, block_tokens) pages.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

KEY_BYTES = 8
DEFAULT_BLOCK_TOKENS = 256
DEFAULT_DENSE_TOKENS = 256
DEFAULT_DENSE_KEY_TOKENS = 64


def page_key(page_hash: bytes) -> int:
    """The index key of a folio page hash: its first KEY_BYTES bytes as an unsigned little-endian int."""
    return int.from_bytes(page_hash[:KEY_BYTES], "little")


def page_keys(page_hashes: Sequence[bytes]) -> list[int]:
    return [int.from_bytes(h[:KEY_BYTES], "little") for h in page_hashes]


def dense_pages(page_size: int, dense_tokens: int = DEFAULT_DENSE_TOKENS) -> int:
    """Leading pages of a sequence that all carry routing keys."""
    return max(0, dense_tokens) // page_size


def block_stride(page_size: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> int:
    """Pages from one routing key to the next."""
    if page_size <= 0 or block_tokens <= 0:
        raise ValueError(f"page_size and block_tokens must be positive, got {page_size} and {block_tokens}")
    return max(1, block_tokens // page_size)


def is_key_depth(depth: int, stride: int, dense_pages: int = 0, dense_stride: int = 1) -> bool:
    """Whether the page at index `depth` of its sequence carries a routing key (-1: unknown depth, never)."""
    return depth >= 0 and ((depth + 1) % stride == 0 or (depth < dense_pages and (depth + 1) % dense_stride == 0))


def key_depths(num_pages: int, stride: int, dense_pages: int = 0, dense_stride: int = 1) -> list[int]:
    """The page indices carrying routing keys among a sequence's first num_pages pages, in order (the depths for
    which is_key_depth holds, built from ranges: a router asks for them on every decision, and at page size 16 a
    prompt spans hundreds of pages)."""
    dense_end = min(dense_pages, num_pages)
    if dense_end <= 0:
        return list(range(stride - 1, num_pages, stride))
    dense = set(range(dense_stride - 1, dense_end, dense_stride))
    dense.update(range(stride - 1, dense_end, stride))
    first_sparse = dense_end + (stride - 1 - dense_end) % stride  # the first depth >= dense_end keyed every stride
    return sorted(dense) + list(range(first_sparse, num_pages, stride))


def block_keys(keys: Sequence[int], stride: int, dense_pages: int = 0, dense_stride: int = 1) -> list[int]:
    """The routing keys among a sequence's page keys (first page first)."""
    return [keys[d] for d in key_depths(len(keys), stride, dense_pages, dense_stride)]


class KeyGeometry:
    """Where a fleet's routing keys fall (as the replicas report it): page size; a key every dense_key_tokens in
    the first dense_tokens of a sequence, then every block_tokens."""

    __slots__ = ("page_size", "block_tokens", "dense_tokens", "dense_key_tokens", "stride", "dense_pages",
                 "dense_stride", "_key_depths")

    def __init__(self, page_size: int, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 dense_tokens: int = DEFAULT_DENSE_TOKENS, dense_key_tokens: int = DEFAULT_DENSE_KEY_TOKENS) -> None:
        self.page_size, self.block_tokens, self.dense_tokens = page_size, block_tokens, dense_tokens
        self.dense_key_tokens = dense_key_tokens
        self.stride = block_stride(page_size, block_tokens)
        self.dense_pages = dense_pages(page_size, dense_tokens)
        self.dense_stride = block_stride(page_size, dense_key_tokens)
        self._key_depths: list[int] = []  # the depths of the first keys of a sequence, as many as asked for yet

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeyGeometry) and self.as_tuple() == other.as_tuple()

    def __hash__(self) -> int:
        return hash(self.as_tuple())

    def as_tuple(self) -> tuple[int, int, int, int]:
        return self.page_size, self.block_tokens, self.dense_tokens, self.dense_key_tokens

    def depths(self, num_pages: int) -> list[int]:
        return key_depths(num_pages, self.stride, self.dense_pages, self.dense_stride)

    def depths_of_keys(self, num_keys: int) -> list[int]:
        """The depths of a sequence's first num_keys routing keys (kept from call to call: a router asks on every
        decision, for prompts of a few lengths)."""
        known = self._key_depths
        if len(known) < num_keys:
            known = self._key_depths = self.depths(self.dense_pages + max(num_keys, 2 * len(known)) * self.stride)
        return known[:num_keys]

    def num_reusable_keys(self, num_prompt_tokens: int, depths: Sequence[int]) -> int:
        """How many of a prompt's keys (at `depths`, increasing) name pages a replica can reuse: pages before the
        prompt's last token, which is always computed."""
        return bisect_right(depths, max(num_prompt_tokens - 1, 0) // self.page_size - 1)

    def tokens_of(self, num_keys: int, depths: Sequence[int]) -> int:
        """Prompt tokens a replica holding the first num_keys keys (at `depths`) holds."""
        return 0 if num_keys <= 0 else (depths[num_keys - 1] + 1) * self.page_size
