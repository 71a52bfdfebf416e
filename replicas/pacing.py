"""How often a replica sends each streamed request a message: as soon as tokens come while the replica streams few
requests, in larger, rarer messages once it streams many.

Every message a replica streams costs Ray Serve's path to the client (the replica's and the ingress's event loops,
the proxy) about the same whatever it carries, and a replica's event loop shares the process, and the GIL, with its
engine thread: at one message per request per engine step, a few hundred streams spend more CPU moving messages
than the engine has left to run steps. So a replica bounds the messages it sends per second over all its streams:
with N streams open, each waits N / max_messages_per_s seconds after its last message before sending the next,
which carries every token that came meanwhile. The first message of a request (its first tokens) and a request's
end are never held back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StreamPacer:
    def __init__(self, max_messages_per_s: float) -> None:
        self.max_messages_per_s = max_messages_per_s  # 0: no bound (a message per engine step that made tokens)
        self.num_streams = 0

    def interval_s(self) -> float:
        """The least time between two messages of one stream now."""
        return self.num_streams / self.max_messages_per_s if self.max_messages_per_s > 0 else 0.0

    def hold_s(self, last_sent_s: float | None) -> float:
        """How long a stream that last sent at last_sent_s (time.monotonic(); None: never) waits before its next."""
        if last_sent_s is None:
            return 0.0
        return max(0.0, last_sent_s + self.interval_s() - time.monotonic())

    @contextmanager
    def stream(self) -> Iterator[None]:
        """Counts an open stream while the block runs."""
        self.num_streams += 1
        try:
            yield
        finally:
            self.num_streams -= 1
