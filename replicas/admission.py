"""Admission control at the ingress: a request runs only while the generator replicas have room for it, waits in a
bounded FIFO queue here otherwise, and is refused at once with RESOURCE_EXHAUSTED and a retry hint when that queue
is full -- before any work is spent on it (not even tokenizing).

Why here, and why the waiting happens here: Serve's own bounds act later and worse. A request over a deployment's
max_ongoing_requests waits in the caller's router, which retries replicas with backoff: thousands of such waiters
starve the ingress's event loop, and a replica that frees a slot idles until some waiter's backoff ends. The ingress
knows how many requests it has sent and the replicas' capacity (ServeConfig.ingress_admission_limit): it sends no
more than they hold, so Serve's router always finds a replica with room, and hands a freed slot to the oldest waiter
at once.

The retry hint is the time the requests ahead need to free a slot at the recent completion rate.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from folio.serve.errors import Overloaded

MIN_RETRY_AFTER_S = 0.1
MAX_RETRY_AFTER_S = 30.0
RATE_WINDOW_S = 10.0


class Admission:
    """One ingress replica's requests: at most `limit` sent to the replicas, at most `max_waiting` more waiting for
    a slot. Event-loop only (no locking)."""

    def __init__(self, limit: int, max_waiting: int = 0, clock=time.monotonic):
        if limit < 1 or max_waiting < 0:
            raise ValueError(f"limit must be >= 1 and max_waiting >= 0, got {limit}, {max_waiting}")
        self.limit = limit
        self.max_waiting = max_waiting
        self.in_flight = 0  # holding a slot
        self.num_refused = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._clock = clock
        self._finished_at: collections.deque[float] = collections.deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        """Hold one slot for the block, waiting for one if the queue has room; raises Overloaded (with
        retry_after_s) when it has none."""
        await self._acquire()
        try:
            yield
        finally:
            self._finished_at.append(self._clock())
            self._release()

    async def _acquire(self) -> None:
        if self.in_flight < self.limit and not self._waiters:
            self.in_flight += 1
            return
        if len(self._waiters) >= self.max_waiting:
            self.num_refused += 1
            retry_s = self.retry_after_s()
            raise Overloaded(f"the server is at capacity ({self.in_flight} requests running, {len(self._waiters)} "
                             f"waiting, the limits are {self.limit} and {self.max_waiting}); retry after "
                             f"{retry_s:.1f} s", retry_after_s=retry_s)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # a finished request handed its slot over (in_flight unchanged)
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # handed a slot just as the caller left: pass it on
            else:
                self._waiters.remove(waiter)
            raise

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the oldest waiter
                return
        self.in_flight -= 1

    def completion_rate(self) -> float:
        """Requests finished per second over the last RATE_WINDOW_S (0 without any)."""
        now = self._clock()
        while self._finished_at and self._finished_at[0] < now - RATE_WINDOW_S:
            self._finished_at.popleft()
        if not self._finished_at:
            return 0.0
        span = max(now - self._finished_at[0], 1.0)
        return len(self._finished_at) / span

    def retry_after_s(self) -> float:
        """When one more request would find room in the queue: once the waiters ahead, and one more, have had a
        slot freed for them."""
        rate = self.completion_rate()
        if rate <= 0:
            return MAX_RETRY_AFTER_S if self.in_flight else MIN_RETRY_AFTER_S
        ahead = max(1, self.in_flight + len(self._waiters) - self.limit - self.max_waiting + 1)
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, ahead / rate))
