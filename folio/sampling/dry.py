"""DRY ("don't repeat yourself"): a logit penalty on tokens that would extend a verbatim repeat of earlier context.

For the history h[0..n-1] (prompt + output, the newest dry_range tokens when dry_range > 0), a candidate token t has
match length L(t) = the longest L such that the last L tokens h[n-L..n-1] also occur as h[i-L+1..i] for some
i < n - 1 with h[i+1] = t, capped at dry_max_ngram. Matched tokens are never sequence breakers (a match stops at
one), and a breaker itself is never penalised. Every t with L(t) >= dry_allowed_length gets
    logit -= dry_multiplier * dry_base ** (L(t) - dry_allowed_length)
(capped at MAX_DRY_PENALTY, which is as good as a ban). This is the standard DRY (one penalty per token, from its
longest match), not the reference's variant (only the single longest suffix, scaled by occurrence counts).

The history stays on the host (it is each Sequence's token list); the matching is vectorised numpy over the
occurrences of the newest token, at most dry_max_ngram passes, and the penalties reach the logits in one scatter.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from folio.sampling.host import to_device
from folio.sampling.settings import DRY_DEFAULT_BREAKERS, SamplerSettings

if TYPE_CHECKING:
    from folio.sampling.rows import RowParams
    from folio.tokenizer import Tokenizer

# A penalty this large removes a token as surely as -inf, and keeps every logit finite.
MAX_DRY_PENALTY = 1e30


class BreakerSet(frozenset):
    """Token ids that break DRY matches, with a sorted array of them for vectorised lookups."""

    @functools.cached_property
    def array(self) -> np.ndarray:
        return np.array(sorted(self), dtype=np.int64)


_NO_BREAKERS = BreakerSet()


@functools.lru_cache(maxsize=16)
def breaker_ids(tokenizer: Tokenizer, breakers: tuple[str, ...] | None) -> BreakerSet:
    """The ids of `tokenizer`'s tokens whose text contains one of `breakers`; for None, DRY_DEFAULT_BREAKERS' plus
    every special token (computed once per tokenizer and breakers: a pass over the vocabulary)."""
    strings = DRY_DEFAULT_BREAKERS if breakers is None else breakers
    ids = {t for t in range(tokenizer.vocab_size) if any(b in tokenizer.id_to_piece(t) for b in strings)}
    if breakers is None:
        ids |= tokenizer.special_ids
    return BreakerSet(ids)


def breakers_for(job: Any) -> BreakerSet:
    """The DRY breakers of a job (empty when DRY is off or the job has no tokenizer bound)."""
    settings = job.gen_settings
    tokenizer = getattr(job, "_tokenizer", None)  # bound by the generator at enqueue
    if not settings.dry_active or tokenizer is None:
        return _NO_BREAKERS
    return breaker_ids(tokenizer, settings.dry_sequence_breakers)


def _as_array(ids: Collection[int]) -> np.ndarray:
    if isinstance(ids, BreakerSet):
        return ids.array
    return np.array(sorted(ids), dtype=np.int64)


def dry_penalties(history: Sequence[int] | torch.Tensor | np.ndarray, settings: SamplerSettings,
                  breakers: Collection[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, penalties >= 0) of one row: the tokens DRY penalises and by how much (see the module doc)."""
    empty = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    h = history.numpy() if isinstance(history, torch.Tensor) else np.asarray(history, dtype=np.int64)
    if settings.dry_range:
        h = h[-settings.dry_range:]
    n = len(h)
    if n < 2:
        return empty
    is_breaker = np.isin(h, _as_array(breakers)) if len(breakers) else np.zeros(n, dtype=bool)
    if is_breaker[-1]:
        return empty
    starts = np.flatnonzero(h[:-1] == h[-1])  # earlier occurrences of the newest token
    starts = starts[~is_breaker[starts + 1]]  # ... followed by a token that may be penalised
    if starts.size == 0:
        return empty
    lengths = np.ones(starts.size, dtype=np.int64)
    alive = np.arange(starts.size)
    for length in range(1, min(settings.dry_max_ngram, n - 1)):
        j = starts[alive] - length
        ok = j >= 0
        ok[ok] = (h[j[ok]] == h[n - 1 - length]) & ~is_breaker[j[ok]]
        alive = alive[ok]
        if alive.size == 0:
            break
        lengths[alive] += 1
    tokens = h[starts + 1]
    best: dict[int, int] = {}
    for token, length in zip(tokens.tolist(), lengths.tolist()):
        if length > best.get(token, 0):
            best[token] = length
    allowed = settings.dry_allowed_length
    hits = [(t, n_) for t, n_ in best.items() if n_ >= allowed]
    if not hits:
        return empty
    ids = np.array([t for t, _ in hits], dtype=np.int64)
    exponent = np.array([n_ - allowed for _, n_ in hits], dtype=np.float64)
    with np.errstate(over="ignore"):
        penalty = settings.dry_multiplier * np.power(settings.dry_base, exponent)
    return ids, np.minimum(penalty, MAX_DRY_PENALTY)


def apply_dry(work: torch.Tensor, rows: Sequence[RowParams], num_columns: int) -> None:
    """Subtract each DRY row's penalties from `work` [B, >= num_columns] in place (one scatter for the batch; ids
    at or beyond num_columns are ignored)."""
    index, values = [], []
    stride = work.shape[1]
    for b, row in enumerate(rows):
        if not row.settings.dry_active:
            continue
        ids, penalty = dry_penalties(row.history_ids, row.settings, row.dry_breakers)
        keep = (ids >= 0) & (ids < num_columns)
        index.append(ids[keep] + b * stride)
        values.append(-penalty[keep])
    if not index or not sum(len(i) for i in index):
        return
    flat_index = torch.from_numpy(np.concatenate(index))
    flat_values = torch.from_numpy(np.concatenate(values).astype(np.float32))
    # indices are distinct, so the add is deterministic
    work.view(-1).index_add_(0, to_device(flat_index, torch.int64, work.device),
                             to_device(flat_values, torch.float32, work.device))
