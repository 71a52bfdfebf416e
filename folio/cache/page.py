"""The pool's record of one page, and the checks on what a page may be told. Internal to folio.cache: the scheduler
only sees page ids."""

from __future__ import annotations

import enum

from folio.cache.errors import PageStateError
from folio.hashing import HASH_SIZE


class PageState(enum.Enum):
    FREE = "free"  # no content; handed out first by allocate()
    IN_USE = "in_use"  # refcount >= 1: listed in at least one block table (or pinned)
    CACHED = "cached"  # refcount 0 but content kept (a ready hash, or recorded partial tokens); evictable


class PageRecord:
    """Mutable bookkeeping of one page.

    hash/ready: None = anonymous; a hash with ready=False = pending (claimed, being filled); ready=True = the page
    holds that hash's K/V. has_parent/parent: the page names `parent` (None = it is a sequence's first page) as the
    hash of the page before it; set once the page has a claim, a ready hash or recorded tokens. tokens/namespace:
    token ids whose K/V are written in slots [0, len(tokens)), for partial-page reuse. stamp: pool clock when the
    page was last acquired or released (recency for eviction). depth: the page's index in its sequence while it is
    ready (-1: unknown), for the router's events.
    """

    __slots__ = ("page_id", "state", "refcount", "hash", "ready", "has_parent", "parent", "tokens", "namespace",
                 "stamp", "depth")

    def __init__(self, page_id: int) -> None:
        self.page_id = page_id
        self.state = PageState.FREE
        self.refcount = 0
        self.hash: bytes | None = None
        self.ready = False
        self.has_parent = False
        self.parent: bytes | None = None
        self.tokens: tuple[int, ...] | None = None
        self.namespace = b""
        self.stamp = 0
        self.depth = -1

    @property
    def is_pending(self) -> bool:
        return self.hash is not None and not self.ready

    def check_parent(self, parent_hash: bytes | None, operation: str) -> None:
        """Raise PageStateError if the page is linked to another parent than `parent_hash` (a link never
        changes while it lasts)."""
        if self.has_parent and self.parent != parent_hash:
            shown = "None" if parent_hash is None else parent_hash.hex()
            raise PageStateError(f"{operation}: {self.describe()} follows parent "
                                 f"{'None' if self.parent is None else self.parent.hex()}, not {shown}")

    def describe(self) -> str:
        """Short human-readable state for error messages."""
        if self.ready:
            content = f"ready hash {self.hash.hex()}"
        elif self.hash is not None:
            content = f"pending hash {self.hash.hex()}"
        elif self.tokens is not None:
            content = f"{len(self.tokens)} recorded tokens"
        else:
            content = "anonymous"
        return f"page {self.page_id} ({self.state.value}, refcount {self.refcount}, {content})"


def check_hashes(page_hash: bytes, parent_hash: bytes | None) -> None:
    """Raise ValueError unless `page_hash` is a hash and `parent_hash` None or another hash."""
    if not isinstance(page_hash, bytes) or len(page_hash) != HASH_SIZE:
        raise ValueError(f"page hash must be {HASH_SIZE} bytes, got {page_hash!r}")
    if parent_hash is not None and (not isinstance(parent_hash, bytes) or len(parent_hash) != HASH_SIZE):
        raise ValueError(f"parent hash must be None or {HASH_SIZE} bytes, got {parent_hash!r}")
    if page_hash == parent_hash:
        raise ValueError(f"page hash {page_hash.hex()} equals its parent hash")
