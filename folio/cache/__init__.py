"""Page bookkeeping for the paged KV cache (torch-free)."""

from folio.cache.errors import (
    InvariantViolation,
    OutOfPages,
    PageNotReady,
    PagePoolError,
    PageStateError,
    RefcountUnderflow,
)
from folio.cache.events import PageEvent, PageEventKind
from folio.cache.page import PageState
from folio.cache.partial_index import MIN_PARTIAL_MATCH, PartialMatch
from folio.cache.pool import PagePool, PrefixLookup

__all__ = [
    "MIN_PARTIAL_MATCH",
    "InvariantViolation",
    "OutOfPages",
    "PageEvent",
    "PageEventKind",
    "PageNotReady",
    "PagePool",
    "PagePoolError",
    "PageStateError",
    "PageState",
    "PartialMatch",
    "PrefixLookup",
    "RefcountUnderflow",
]
