"""Sequence: the one runtime record of an enqueued job.

Everything the engine tracks about a job between steps lives here: its tokens, its pages (written by the KV cache
manager only), its place in the schedule (written by the scheduler only) and its sampling counters (written by the
generator). The job itself (folio.job) keeps what the user asked for and what it has emitted. Torch-free.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from folio.job import DynamicJob
    from folio.sampling.state import SamplerState


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # in the scheduler's queue: new, or preempted (its tokens kept, its pages released)
    RUNNING = "running"  # admitted: holds pages and a batch slot
    FINISHED = "finished"  # ended by a stop condition or max_new_tokens
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def is_live(self) -> bool:
        return self is SeqStatus.WAITING or self is SeqStatus.RUNNING  # (asked per token: identity, not ==)


@dataclass(eq=False)  # identity semantics: a Sequence is a dict key and a set member
class Sequence:
    """`token_ids` = prompt + sampled tokens; the K/V of the first `num_cached_tokens` are in the cache. Between
    steps at most one token (the last sampled) is not cached, except while the prompt is being prefilled or after
    a rollback."""

    job: DynamicJob
    token_ids: list[int]
    namespace: bytes = b""  # part of every page hash: anything besides the tokens that changes K/V
    status: SeqStatus = SeqStatus.WAITING

    # --- pages (KVCacheManager) ---
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # page_hashes[k] names full page k; the prompt's are known up front, later ones as pages fill
    page_hashes: list[bytes] = field(default_factory=list)
    claimed_page_idx: set[int] = field(default_factory=set)  # prompt pages this sequence promised to fill
    # leading block_table entries given back to the pool while running (RELEASED_PAGE: before every layer's window)
    num_released_pages: int = 0
    num_prefix_hit_tokens: int = 0  # prompt tokens reused from the cache at the first admission
    num_prefix_hit_pages: int = 0

    # --- schedule (Scheduler) ---
    admit_order: int = -1
    num_skips: int = 0  # times a later job was admitted ahead of this one
    started: bool = False
    num_prefill_target: int = 0  # prompt length at the first admission: the part reported as prefill progress
    # time.monotonic() when the first chunk of this sequence was planned: its wait in the queue ends there
    time_first_chunk: float | None = None

    # --- sampling (DynamicGenerator) ---
    num_sampled: int = 0  # tokens sampled so far; ahead of job.new_tokens while tokens wait to be emitted
    sampler_state: SamplerState | None = None  # per-job sampler state (mirostat's mu): kept across preemption

    # --- classifier-free guidance (folio.cfg): a CFG job's two sequences name each other ---
    cfg_partner: Sequence | None = None
    cfg_negative: bool = False  # the negative prompt's: fed and cached like any other, it samples and emits nothing
    prompt_len: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        # (read per row and step; a prompt never changes once its sequence exists)
        self.prompt_len = len(self.job.cfg_negative_ids) if self.cfg_negative else self.job.prompt_tokens

    @property
    def num_uncached_tokens(self) -> int:
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_uncached_tokens == 1

    @property
    def is_live(self) -> bool:
        return self.status.is_live

    def __repr__(self) -> str:
        return (f"Sequence(serial={self.job.serial}, status={self.status.value}, tokens={len(self.token_ids)}, "
                f"cached={self.num_cached_tokens}, pages={len(self.block_table)})")
