"""Page hashes: the one definition, shared by the engine's page pool and the router.

A page hash names a page's *whole prefix*: it chains the previous page's hash, the hash namespace and the page's
token ids, so two pages get equal hashes exactly when every token before and in them is equal and they were computed
under the same namespace (the namespace covers everything else that changes K/V: LoRA adapter, embeddings).

Digest: BLAKE2b with a 16-byte digest over

    prev_hash (16 bytes; ROOT_MARKER for a sequence's first page)
    ‖ len(namespace) as uint64 little-endian ‖ namespace
    ‖ token ids as int64 little-endian

The namespace length is included so that no (namespace, token ids) pair can be re-split into another one.
Only full pages are hashed. This module must stay torch-free (the router imports it).
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

HASH_SIZE = 16
"""Bytes in a page hash."""

ROOT_MARKER = b"folio.page.root\x00"
"""Stands in for the previous page's hash when hashing a sequence's first page."""

assert len(ROOT_MARKER) == HASH_SIZE

# array('q') holds C long longs, 8 bytes on every platform CPython supports; the byte order is the host's.
_INT64 = "q"
_NEEDS_BYTESWAP = sys.byteorder != "little"
assert array(_INT64).itemsize == 8


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as consecutive int64 little-endian values (the byte form that is hashed)."""
    packed = array(_INT64, token_ids)
    if _NEEDS_BYTESWAP:
        packed.byteswap()
    return packed.tobytes()


def _digest(prev_hash: bytes | None, token_bytes: bytes | memoryview, namespace: bytes) -> bytes:
    if prev_hash is None:
        prev_hash = ROOT_MARKER
    elif len(prev_hash) != HASH_SIZE:
        raise ValueError(f"prev_hash must be {HASH_SIZE} bytes or None, got {len(prev_hash)} bytes")
    hasher = hashlib.blake2b(digest_size=HASH_SIZE)
    hasher.update(prev_hash)
    hasher.update(struct.pack("<Q", len(namespace)))
    hasher.update(namespace)
    hasher.update(token_bytes)
    return hasher.digest()


def hash_page(prev_hash: bytes | None, token_ids: Sequence[int], namespace: bytes = b"") -> bytes:
    """Hash of one page given the hash of the page before it (None for a sequence's first page).

    The caller decides what a page is; the pool and router only ever hash full pages of `page_size` tokens.
    """
    return _digest(prev_hash, pack_token_ids(token_ids), namespace)


def page_hashes(token_ids: Sequence[int], page_size: int, namespace: bytes = b"") -> list[bytes]:
    """Chained hashes of every FULL page of `token_ids` (len(token_ids) // page_size of them), first page first."""
    return _chained_hashes(token_ids, len(token_ids) // _checked_page_size(page_size), page_size, namespace)


def prompt_page_hashes(token_ids: Sequence[int], page_size: int, namespace: bytes = b"") -> list[bytes]:
    """Chained hashes of the prompt pages that can be shared at admission.

    Only pages fully covered by `token_ids[:-1]` count: the last prompt token is always fed by the first decode
    step, so its K/V are not in the cache after prefill and the page holding it cannot be ready yet. That is
    (len(token_ids) - 1) // page_size pages (none for an empty prompt). Each equals page_hashes' hash of that page.
    """
    num_pages = max(len(token_ids) - 1, 0) // _checked_page_size(page_size)
    return _chained_hashes(token_ids, num_pages, page_size, namespace)


def _checked_page_size(page_size: int) -> int:
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    return page_size


def _chained_hashes(token_ids: Sequence[int], num_pages: int, page_size: int, namespace: bytes) -> list[bytes]:
    # Pack once and hash slices of one buffer: one array conversion instead of one per page.
    packed = memoryview(pack_token_ids(token_ids[: num_pages * page_size]))
    page_bytes = page_size * 8
    hashes: list[bytes] = []
    prev_hash: bytes | None = None
    for page_idx in range(num_pages):
        prev_hash = _digest(prev_hash, packed[page_idx * page_bytes : (page_idx + 1) * page_bytes], namespace)
        hashes.append(prev_hash)
    return hashes


def sequence_namespace(adapter_id: bytes | None = None, embeddings_digest: bytes | None = None) -> bytes:
    """The hash namespace of a sequence: empty for the base model with token ids only, else a length-prefixed
    record of the LoRA adapter's identity (its content digest, not its name: an adapter reloaded under the same
    name with other weights must not match) and the digest of the embeddings injected into the prompt. Each part
    is tagged, so an adapter id can never read as an embeddings digest."""
    parts = []
    for tag, value in ((b"lora", adapter_id), (b"embeddings", embeddings_digest)):
        if value:
            parts.append(tag + struct.pack("<Q", len(value)) + value)
    return b"".join(parts)
