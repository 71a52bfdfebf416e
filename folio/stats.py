"""StepStats: what one engine step did, returned by `DynamicGenerator.step()` and kept as `last_step_stats`.

Benchmarks, tests and the serving layer read these instead of reaching into the engine. Host times are wall-clock
seconds spent on the host in each phase of the step (the device may run concurrently, see folio.pipeline).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# Host phases of a step, in the order they run.
PHASES = ("plan", "draft", "forward", "sample", "launch_ahead", "wait_tokens", "emit")


@dataclass
class StepStats:
    step_idx: int = 0
    num_rows: int = 0  # sequences that fed tokens to the forward (a prompt chunk, decode row or verify row each)
    num_prompt_tokens: int = 0  # prompt tokens computed (not counting those reused from the cache)
    num_decode_rows: int = 0  # rows feeding one sampled token
    num_verify_rows: int = 0  # rows feeding drafted tokens, every one with logits
    num_sampled: int = 0  # tokens sampled (a verify row's accepted drafts included)
    num_rolled_back: int = 0  # sampled tokens undone (banned strings)
    num_drafted: int = 0  # tokens drafted into verify rows
    num_accepted_drafts: int = 0
    num_started: int = 0  # jobs admitted for the first time
    num_finished: int = 0  # jobs that ended (any reason, errors included)
    num_failed: int = 0
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0  # prompt tokens reused from the cache by first admissions this step
    num_pages_in_use: int = 0
    num_pages_cached: int = 0
    num_pages_free: int = 0
    num_running: int = 0  # after the step
    num_waiting: int = 0
    launched_ahead: bool = False  # the step's forward was launched during the previous step
    used_graph: bool = False  # the forward replayed a captured decode graph
    host_s: dict[str, float] = field(default_factory=dict)  # phase -> seconds (PHASES)
    total_s: float = 0.0

    def add_time(self, phase: str, seconds: float) -> None:
        self.host_s[phase] = self.host_s.get(phase, 0.0) + seconds

    def lap(self, phase: str, since: float) -> float:
        """Add the time since `since` (time.perf_counter()) to `phase`; returns now."""
        now = time.perf_counter()
        self.add_time(phase, now - since)
        return now

    def count_rows(self, chunks: Iterable[Any]) -> None:
        """Rows of the forward that ran (folio.scheduler.Chunk)."""
        for chunk in chunks:
            self.num_rows += 1
            if chunk.verify:
                self.num_verify_rows += 1
            elif chunk.is_prompt:
                self.num_prompt_tokens += chunk.num_tokens
            else:
                self.num_decode_rows += 1
