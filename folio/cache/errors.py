"""Exceptions raised by the page pool (folio.cache)."""

from __future__ import annotations


class OutOfPages(Exception):
    """An allocation asked for more pages than are free or evictable. Nothing was changed.

    Not a bug: the scheduler answers it by waiting or preempting a job.
    """

    def __init__(self, num_requested: int, num_allocatable: int) -> None:
        super().__init__(f"cannot allocate {num_requested} pages: only {num_allocatable} are free or evictable")
        self.num_requested = num_requested
        self.num_allocatable = num_allocatable


class PagePoolError(Exception):
    """The pool was used against its contract, or its internal state is inconsistent (a bug somewhere)."""


class PageStateError(PagePoolError):
    """An operation is not allowed in the page's current state (e.g. re-hashing a hashed page, claiming a free
    page, resetting while pages are in use)."""


class RefcountUnderflow(PagePoolError):
    """A release would drop a page's reference count below zero (double free)."""


class PageNotReady(PagePoolError):
    """acquire() was asked for a hash that no page holds ready (unknown, evicted, or still pending)."""


class InvariantViolation(PagePoolError):
    """check() found the pool's bookkeeping inconsistent."""
