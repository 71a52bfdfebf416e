"""What the pool reports about its cached hashes, for the router's per-replica index."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PageEventKind(enum.Enum):
    STORED = "stored"  # a hash became ready: a page now holds its K/V
    EVICTED = "evicted"  # the page holding a ready hash was evicted or forgotten (reset)


@dataclass(frozen=True, slots=True)
class PageEvent:
    kind: PageEventKind
    hash: bytes


class EventLog:
    """The events not yet drained, oldest first. A disabled log records nothing (no caller drains it)."""

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        self._events: list[PageEvent] = []

    def log(self, kind: PageEventKind, page_hash: bytes) -> None:
        if self._enabled:
            self._events.append(PageEvent(kind, page_hash))

    def drain(self) -> list[PageEvent]:
        """Every event logged since the last drain, oldest first; clears them."""
        events, self._events = self._events, []
        return events
