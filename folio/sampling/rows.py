"""One sampling call's rows and outputs: RowParams (a row's settings, draw, history, blocked tokens, what to
report) and SampleOutput, and the checks a call's arguments pass."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from folio.sampling.penalties import History
from folio.sampling.settings import SamplerSettings
from folio.sampling.state import SamplerState


@dataclass(frozen=True)
class RowParams:
    """One row of a sampling call.

    settings: the job's SamplerSettings.
    u: the job's uniform draw for this token, in [0, 1) (see folio.sampling.rng).
    history_ids: prompt + generated token ids, oldest first, for the penalties and DRY (ids outside the logits are
        ignored): a sequence of ints, or a 1-D int64 CPU tensor (cheaper to window than a long Python list).
    blocked_ids: token ids that must not be picked (e.g. stop tokens below min_new_tokens).
    vocab_size: number of real vocabulary entries; logits at and beyond it are masked (None: all columns are real).
    return_top_tokens: how many of the most probable final candidates to report.
    return_logits: report the processed logits (after penalties, bias and masks, before temperature).
    state: the job's sampler state (mirostat's mu; None: a fresh one).
    dry_breakers: token ids that break DRY matches (folio.sampling.dry.breaker_ids).
    """

    settings: SamplerSettings
    u: float
    history_ids: History = ()
    blocked_ids: Sequence[int] = ()
    vocab_size: int | None = None
    return_top_tokens: int = 0
    return_logits: bool = False
    state: SamplerState | None = None
    dry_breakers: Collection[int] = frozenset()

    @classmethod
    def unchecked(cls, settings: SamplerSettings, u: float, history_ids: History, blocked_ids: Sequence[int],
                  vocab_size: int | None, return_top_tokens: int, return_logits: bool,
                  state: SamplerState | None = None, dry_breakers: Collection[int] = frozenset()) -> RowParams:
        """A row built from values the caller has already validated (the generator: a validated job's
        settings, its own draws), without __post_init__'s checks: it builds one per sequence per step."""
        row = object.__new__(cls)
        row.__dict__.update(settings=settings, u=u, history_ids=history_ids, blocked_ids=blocked_ids,
                            vocab_size=vocab_size, return_top_tokens=return_top_tokens, return_logits=return_logits,
                            state=state, dry_breakers=dry_breakers)
        return row

    def __post_init__(self) -> None:
        if not isinstance(self.settings, SamplerSettings):
            raise TypeError(f"RowParams.settings must be a SamplerSettings, got {type(self.settings).__name__}")
        if not isinstance(self.u, float | int) or not 0.0 <= self.u < 1.0:
            raise ValueError(f"RowParams.u must be a number in [0, 1), got {self.u!r}")
        history = self.history_ids
        if isinstance(history, torch.Tensor) and (
                history.dim() != 1 or history.dtype != torch.int64 or history.device.type != "cpu"):
            raise ValueError("RowParams.history_ids as a tensor must be 1-D int64 on the CPU, got "
                             f"{tuple(history.shape)} {history.dtype} on {history.device}")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size < 1):
            raise ValueError(f"RowParams.vocab_size must be None or an int >= 1, got {self.vocab_size!r}")
        if not isinstance(self.return_top_tokens, int) or self.return_top_tokens < 0:
            raise ValueError(f"RowParams.return_top_tokens must be an int >= 0, got {self.return_top_tokens!r}")


@dataclass(frozen=True)
class SampleOutput:
    """Results of one call, all on the logits' device.

    token_ids: [B] int64, the picked tokens; -1 for a row where every token was masked (nothing could be picked).
    token_probs: [B] fp32, probability of the picked token under the final (truncated, renormalised) distribution.
    top_k_tokens / top_k_probs: [B, K] int64 / fp32 with K = the largest return_top_tokens in the call (None when
        no row asked): final probabilities sorted descending; past the last candidate the probabilities are 0 and
        the ids are other tokens. A row that asked for fewer takes its first columns.
    logits: [B, V] fp32 after penalties, bias and masks, before temperature (None when no row asked).
    """

    token_ids: torch.Tensor
    token_probs: torch.Tensor
    top_k_tokens: torch.Tensor | None = None
    top_k_probs: torch.Tensor | None = None
    logits: torch.Tensor | None = None


def _check_call(logits: torch.Tensor, rows: Sequence[RowParams]) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"sample(): logits must be [B, V] float32, got {tuple(logits.shape)} {logits.dtype}")
    if logits.shape[0] != len(rows) or not rows:
        raise ValueError(f"sample(): got {logits.shape[0]} logits rows for {len(rows)} RowParams (need >= 1, equal)")
    num_columns = logits.shape[1]
    for b, row in enumerate(rows):
        if row.vocab_size is not None and row.vocab_size > num_columns:
            raise ValueError(f"sample(): row {b} vocab_size {row.vocab_size} exceeds the {num_columns} logits columns")
        if row.return_top_tokens > num_columns:
            raise ValueError(f"sample(): row {b} asks for {row.return_top_tokens} top tokens of {num_columns}")
        for token_id in row.blocked_ids:
            if not 0 <= token_id < num_columns:
                raise ValueError(f"sample(): row {b} blocked token id {token_id} outside [0, {num_columns})")
        for token_id, _ in row.settings.token_bias:
            if token_id >= num_columns:
                raise ValueError(f"sample(): row {b} token_bias id {token_id} outside [0, {num_columns})")
