"""What the pool reports about its cached hashes, for the router's per-replica index."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class PageEventKind(enum.Enum):
    STORED = "stored"  # a hash became ready: a page now holds its K/V
    EVICTED = "evicted"  # the page holding a ready hash was evicted or forgotten (reset), from either tier
    MOVED_TO_HOST = "moved_to_host"  # evicted from the GPU into the host tier (folio.cache.host_tier): still held


@dataclass(frozen=True, slots=True)
class PageEvent:
    """depth: the page's index in its sequence (its tokens are [depth * page_size, (depth + 1) * page_size)), or -1
    when the pool could not tell (the page's parent was not ready when it became ready). Not part of equality: two
    events about the same hash are the same event."""

    kind: PageEventKind
    hash: bytes
    depth: int = field(default=-1, compare=False)


class EventLog:
    """The events not yet drained, oldest first. A disabled log records nothing (no caller drains it)."""

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        self._events: list[PageEvent] = []

    def log(self, kind: PageEventKind, page_hash: bytes, depth: int = -1) -> None:
        if self._enabled:
            self._events.append(PageEvent(kind, page_hash, depth))

    def drain(self) -> list[PageEvent]:
        """Every event logged since the last drain, oldest first; clears them."""
        events, self._events = self._events, []
        return events
