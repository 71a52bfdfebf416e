"""Typed results emitted by `DynamicGenerator.iterate()`.

Field names follow the reference generator (`stage`, `eos`, `eos_reason`, `text`, `token_ids`, ...) so code written
against it reads naturally, but each stage is its own dataclass instead of a dict of strings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from folio.job import DynamicJob


class Stage(str, enum.Enum):
    STARTED = "started"
    PREFILL = "prefill"
    STREAMING = "streaming"


class EosReason(str, enum.Enum):
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    MAX_NEW_TOKENS = "max_new_tokens"
    END_FILTER = "end_filter"  # the job's filter completed its output
    # The job failed (its error is in `StreamingResult.error`); the generator keeps serving the other jobs.
    ERROR = "error"


@dataclass
class Result:
    job: DynamicJob
    serial: int
    identifier: Any

    stage: Stage = field(init=False)
    eos: bool = field(init=False, default=False)


@dataclass
class StartedResult(Result):
    """The job left the queue: it is active and owns (or shares) pages."""

    def __post_init__(self) -> None:
        self.stage = Stage.STARTED


@dataclass
class PrefillResult(Result):
    """Prompt ingestion progress. `curr_progress` counts prompt tokens whose K/V are in the cache."""

    curr_progress: int = 0
    max_progress: int = 0

    def __post_init__(self) -> None:
        self.stage = Stage.PREFILL


@dataclass
class StreamingResult(Result):
    """One per sampled token. `text` and `token_ids` are what the text pipeline released with this token (possibly
    several tokens' worth after a hold, possibly nothing while text is held)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_probs: list[float] | None = None
    top_k_tokens: list[list[int]] | None = None
    top_k_probs: list[list[float]] | None = None
    logits: torch.Tensor | None = None  # [n, vocab] fp32, one row per released token
    eos: bool = False
    # Banned strings (DynamicJob(banned_strings=)): a banned string matched, and the job rolled back to the token
    # where it began. These tokens were undone (never released) and this text, held until now, dropped.
    suppressed_text: str = ""
    suppressed_tokens: list[int] = field(default_factory=list)

    # Set on the final result of a job only (eos=True).
    eos_reason: EosReason | None = None
    eos_triggering_token_id: int | None = None
    eos_triggering_token_str: str | None = None
    eos_triggering_string: str | None = None
    held_text: str = ""
    full_completion: str | None = None
    new_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    cached_pages: int | None = None
    accepted_draft_tokens: int | None = None  # speculative decoding: drafted tokens accepted (0 without drafts)
    rejected_draft_tokens: int | None = None
    time_enqueued: float | None = None
    time_prefill: float | None = None
    time_generate: float | None = None
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.stage = Stage.STREAMING

    @classmethod
    def released(cls, job: DynamicJob, serial: int, identifier: Any, text: str, token_ids: list[int]
                 ) -> StreamingResult:
        """A result of released text and ids alone: one per job and step, so made without the generated __init__'s
        two dozen assignments (its other fields read their class defaults until set)."""
        result = object.__new__(cls)
        result.__dict__.update(job=job, serial=serial, identifier=identifier, stage=Stage.STREAMING, text=text,
                               token_ids=token_ids, suppressed_tokens=[])
        return result


def merge_into(into: StreamingResult, more: StreamingResult) -> None:
    """Append `more`'s released text, ids and per-token extras to `into` (one result for one step of a job)."""
    into.text += more.text
    into.token_ids += more.token_ids
    for name in ("token_probs", "top_k_tokens", "top_k_probs"):
        extra = getattr(more, name)
        if extra:
            setattr(into, name, (getattr(into, name) or []) + extra)
    if more.logits is not None:
        import torch

        into.logits = more.logits if into.logits is None else torch.cat([into.logits, more.logits])
