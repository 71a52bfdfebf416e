"""The final sampling distribution of each row as a dense [B, V] tensor: what `sample()` draws from.

Speculative decoding needs the distribution itself, not a draw from it: a drafted token is accepted with a
probability that compares the target's probability of it with the drafter's. The steps are `sample()`'s (penalties,
bias, blocked tokens, DRY, vocabulary mask, then temperature, top-k, top-p, min-p and the extended samplers), so a
draw from these rows is a draw from the sampler -- except for skew, which changes the draw rather than the
distribution, and mirostat, whose mu comes from the rows' states (jobs with either do not take drafts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from folio.sampling.dry import apply_dry
from folio.sampling.host import to_device
from folio.sampling.penalties import apply_penalties
from folio.sampling.sampler import RowParams, _apply_bias_and_blocks, _pick_params, _plain_greedy_width, truncated_probs


def final_logits(logits: torch.Tensor, rows: Sequence[RowParams],
                 penalty_windows: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of `logits` [B, V] fp32 with each row's penalties, bias, blocked tokens and vocabulary mask applied."""
    num_columns = logits.shape[1]
    work = torch.nn.functional.pad(logits, (0, 1))  # the scratch column the penalties aim skipped entries at
    settings = [row.settings for row in rows]
    if penalty_windows is None:
        apply_penalties(work, settings, [row.history_ids for row in rows])
    else:
        apply_penalties(work, settings, windows=penalty_windows)
    _apply_bias_and_blocks(work, rows)
    apply_dry(work, rows, num_columns)
    x = work[:, :num_columns]
    if any(row.vocab_size is not None and row.vocab_size < num_columns for row in rows):
        vocab_sizes = to_device([row.vocab_size or num_columns for row in rows], torch.int64, x.device)
        x.masked_fill_(torch.arange(num_columns, device=x.device) >= vocab_sizes[:, None], -math.inf)
    return x


def probabilities(logits: torch.Tensor, rows: Sequence[RowParams],
                  penalty_windows: torch.Tensor | None = None) -> torch.Tensor:
    """[B, V] fp32: row b's final sampling distribution (a greedy row's is 1 at its argmax, the first on ties; a
    row where every token is masked is all zeros)."""
    num_columns = logits.shape[1]
    width = _plain_greedy_width(rows, num_columns)
    if width is not None:
        return _one_hot_argmax(logits[:, :width], num_columns)
    x = final_logits(logits, rows, penalty_windows)
    p = _pick_params(rows, num_columns, x.device)
    sorted_probs, candidate_ids, pickable = truncated_probs(x, rows, p)
    dense = torch.zeros_like(x).scatter_(1, candidate_ids, sorted_probs)
    if p.any_greedy:
        is_greedy = p.top_k[:, 0] == 1
        dense = torch.where(is_greedy[:, None], _one_hot_argmax(x, num_columns), dense)
    return torch.where(pickable[:, None], dense, 0.0)


def _one_hot_argmax(x: torch.Tensor, num_columns: int) -> torch.Tensor:
    values, ids = x.max(dim=1)
    dense = torch.zeros(x.shape[0], num_columns, dtype=torch.float32, device=x.device)
    dense.scatter_(1, ids[:, None], 1.0)
    return torch.where((values > -math.inf)[:, None], dense, 0.0)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of unnormalised non-negative weights `probs` [B, V] by inverse CDF with draws `u` [B] in
    [0, 1); -1 for a row of zeros. A zero-weight token is never picked."""
    cdf = probs.cumsum(dim=1)
    total = cdf[:, -1:]
    picked = torch.searchsorted(cdf, u.to(cdf.dtype)[:, None] * total, right=True).squeeze(1)
    # u * total may round up to total: clamp to the last token with weight
    last = probs.shape[1] - 1 - (probs.flip(1) > 0).to(torch.int8).argmax(dim=1)
    picked = torch.minimum(picked, last)
    return torch.where(total[:, 0] > 0, picked, -1)
