"""Small stand-ins shared by the router and serving tests."""

from __future__ import annotations

import os
import random
import socket
import time

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


# Ray's own processes bind ports while a test's cluster starts: workers from 10002-19999 (ray's default worker
# range) and everything else from the kernel's ephemeral range (32768 and up on Linux). A port picked from either
# can be taken between the pick and Serve's proxy binding it, so tests pick from the gap between them.
_TEST_PORTS = range(20000, 32768)
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback TCP port nobody listens on right now, outside the ranges Ray's processes bind from, and not one
    this process handed out before."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(1000):
        port = rng.choice(_TEST_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {_TEST_PORTS}")


def wait_for(predicate, timeout_s: float, interval_s: float = 0.1):
    """predicate()'s first truthy value, polled every interval_s; its last value once timeout_s has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)
