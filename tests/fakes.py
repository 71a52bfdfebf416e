"""Small stand-ins shared by the router and serving tests."""

from __future__ import annotations

import time

# A loopback port nobody listens on, outside the ranges Ray's processes bind from (folio.serve.ports).
from folio.serve.ports import free_loopback_port as free_port  # noqa: F401 (the tests' name for it)

PAGE_SIZE = 16


class FakePool:
    """The PagePool attributes a routing digest reads."""

    def __init__(self, hashes=(), num_pages: int = 1024, page_size: int = PAGE_SIZE) -> None:
        self.hashes = list(hashes)
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_free = num_pages - len(self.hashes)
        self.num_allocatable = num_pages

    def cached_hashes(self):
        return iter(tuple(self.hashes))


def wait_for(predicate, timeout_s: float, interval_s: float = 0.1):
    """predicate()'s first truthy value, polled every interval_s; its last value once timeout_s has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)
