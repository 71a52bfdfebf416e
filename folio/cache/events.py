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
