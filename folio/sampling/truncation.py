"""The extended samplers' stages, batched over rows that each carry their own parameters ([B, 1] tensors on the
logits' device; a row with a stage off gets parameters that make it a no-op, and a stage no row uses is skipped).

They work on the candidates sorted by logit, descending, as folio.sampling.sampler's `truncated_probs` holds them:
  pre_softmax: temperature (1 for temperature_last rows) and quadratic smoothing, on the sorted logits;
  after top-k, top-p and min-p: top-a, tail-free, locally typical, mirostat (each on the distribution the previous
    one left, renormalised), then temperature_last and dynamic temperature (p^(1/T) renormalised), then XTC;
  skewed: the draw u -> u^(e^-skew).
Every truncation keeps at least one token (the most probable remaining one; for locally typical sampling the
most typical one), so a row never ends up empty. Locally typical sampling may drop the most probable tokens, so
kept candidates need not form a prefix any more; the caller draws with that in mind. XTC can reorder
probabilities: its rows are sorted again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from folio.sampling.host import to_device
from folio.sampling.settings import SamplerSettings
from folio.sampling.state import mirostat_mu

if TYPE_CHECKING:
    from folio.sampling.rows import RowParams

# As in top-p: mass within this distance of the target counts as reaching it.
_MASS_SLACK = 1e-6
# Mirostat v1 estimates the Zipf exponent from this many of the most probable candidates (the paper's m).
MIROSTAT_V1_M = 100
# Dynamic temperatures are clamped to at least this (a lower one is greedy among the candidates anyway).
_MIN_POST_TEMPERATURE = 1e-4

_FIELDS = ("temp_last", "temperature", "smoothing", "top_a", "tfs", "typical", "mirostat", "min_temp", "max_temp",
           "temp_exponent", "xtc_threshold", "xtc_probability", "skew")
# Parameters of a row with every extended stage off (greedy rows, and rows of plain settings in a mixed batch).
_OFF = (0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0)


def _entry(s: SamplerSettings) -> tuple:
    if not s.uses_extended_samplers:
        return _OFF
    return (float(s.temperature_last), s.temperature, s.smoothing_factor, s.top_a,
            s.tfs if 0.0 < s.tfs < 1.0 else 1.0, s.typical if 0.0 < s.typical < 1.0 else 1.0, s.mirostat,
            s.min_temp, s.max_temp, s.temp_exponent, s.xtc_threshold, s.xtc_probability, s.skew)


@dataclass(frozen=True)
class ExtendedParams:
    """Per-row parameters [B, 1] (float32, mu float64) and which stages some row uses."""

    columns: dict[str, torch.Tensor]
    mu: torch.Tensor | None
    vocab: torch.Tensor | None  # mirostat v1's N: the row's real vocabulary size
    active: frozenset[str]

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self.columns[name]
        except KeyError:
            raise AttributeError(name) from None


def extended_params(rows: Sequence[RowParams], per_row_settings: Callable, num_columns: int,
                    device: torch.device) -> ExtendedParams | None:
    """The rows' extended parameters, or None when no row uses an extended sampler. per_row_settings: the
    sampler's table builder (one entry per distinct settings object, gathered per row on the device)."""
    if not any(row.settings.uses_extended_samplers for row in rows):
        return None
    per_row, _, table = per_row_settings(rows, _entry, device)
    values = per_row.float()
    columns = {name: values[:, k:k + 1] for k, name in enumerate(_FIELDS)}
    active = set()
    for t in table:
        entry = dict(zip(_FIELDS, t))
        active |= {name for name in ("temp_last", "smoothing", "top_a", "xtc_probability", "skew") if entry[name]}
        active |= {name for name in ("tfs", "typical") if entry[name] < 1.0}
        active |= {f"mirostat{entry['mirostat']}"} if entry["mirostat"] else set()
        active |= {"dynamic"} if entry["max_temp"] > entry["min_temp"] else set()
    mu = vocab = None
    if active & {"mirostat1", "mirostat2"}:
        mu = to_device([mirostat_mu(row.settings, row.state) for row in rows], torch.float64, device)[:, None]
        vocab = to_device([row.vocab_size or num_columns for row in rows], torch.float64, device)[:, None]
    return ExtendedParams(columns, mu, vocab, frozenset(active))


def pre_softmax(sorted_logits: torch.Tensor, temperature: torch.Tensor, ext: ExtendedParams | None) -> torch.Tensor:
    """Logits sorted descending (finite, row max first) -> the scaled logits that the softmax takes."""
    if ext is None:
        return sorted_logits / temperature
    temperature = torch.where(ext.temp_last > 0, 1.0, temperature)
    if "smoothing" in ext.active:
        gap = sorted_logits - sorted_logits[:, 0:1]
        smoothed = -ext.smoothing * gap * gap
        sorted_logits = torch.where(ext.smoothing > 0, smoothed, sorted_logits)
    return sorted_logits / temperature


def _renormalise(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(dim=1, keepdim=True)


def _keep_top(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Truncate to `keep` but never below the most probable remaining token; renormalised."""
    top = torch.zeros_like(keep).scatter_(1, probs.argmax(dim=1, keepdim=True), True)
    return _renormalise(probs * (keep | top))


def _entropy(probs: torch.Tensor) -> torch.Tensor:
    return -torch.where(probs > 0, probs * probs.clamp(min=1e-38).log(), 0.0).sum(dim=1, keepdim=True)


def _power(probs: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """p^(1/T) renormalised, in log space relative to the row's largest p (zeros stay zero)."""
    log_p = probs.clamp(min=1e-38).log()
    scaled = torch.exp((log_p - log_p.max(dim=1, keepdim=True).values) / temperature)
    return _renormalise(torch.where(probs > 0, scaled, 0.0))


def tail_free(probs: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Tail-free sampling over the n sorted candidates: d2_i = |p_i - 2 p_(i+1) + p_(i+2)| for i < n - 2,
    normalised to sum 1; with i the first index where their cumulative sum exceeds z, keep candidates 0..i (the
    original's centring: d2_i is the curvature at candidate i + 1). All n when the d2 are all 0 (n <= 2 included)."""
    n = (probs > 0).sum(dim=1, keepdim=True)
    width = probs.shape[1]
    if width < 3:
        return probs
    first = probs[:, :-1] - probs[:, 1:]
    second = (first[:, :-1] - first[:, 1:]).abs()
    index = torch.arange(width - 2, device=probs.device)[None, :]
    second = torch.where(index < n - 2, second, 0.0)
    total = second.sum(dim=1, keepdim=True)
    cumulative = second.cumsum(dim=1) / total.clamp(min=1e-38)
    crossed = (cumulative > z) & (index < n - 2) & (total > 0)
    first_cross = torch.where(crossed, index, width).min(dim=1, keepdim=True).values
    rank = torch.arange(width, device=probs.device)[None, :]
    return _keep_top(probs, rank <= first_cross)


def locally_typical(probs: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Keep the tokens closest in surprise (-log p) to the entropy, the smallest such set whose mass reaches
    `mass` (ties in closeness: the more probable first)."""
    entropy = _entropy(probs)
    distance = (-probs.clamp(min=1e-38).log() - entropy).abs()
    distance = torch.where(probs > 0, distance, math.inf)
    order = distance.argsort(dim=1, stable=True)
    in_order = probs.gather(1, order)
    mass_before = in_order.cumsum(dim=1) - in_order
    keep_in_order = mass_before < mass - _MASS_SLACK
    keep_in_order[:, 0] = True  # at least the most typical token
    keep = torch.zeros_like(keep_in_order).scatter_(1, order, keep_in_order)
    return _renormalise(probs * keep)


def mirostat_v2(probs: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """Keep tokens with surprise -log2 p <= mu."""
    return _keep_top(probs, probs.double().log2() >= -mu)


def mirostat_v1(probs: torch.Tensor, mu: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """Top-k with k from the Zipf exponent s estimated over the m most probable remaining candidates:
    s = sum(t_i b_i) / sum(t_i^2), t_i = ln((i+2)/(i+1)), b_i = ln(p_i / p_(i+1)); eps = s - 1;
    k = (eps * 2^mu / (1 - N^-eps))^(1/s), floored, at least 1."""
    m = min(MIROSTAT_V1_M, probs.shape[1])
    top = probs.topk(m, dim=1, sorted=True).values.double()
    i = torch.arange(m - 1, device=probs.device, dtype=torch.float64)[None, :]
    t = torch.log((i + 2) / (i + 1))
    valid = top[:, 1:] > 0
    b = torch.where(valid, torch.log(top[:, :-1] / top[:, 1:].clamp(min=1e-300)), 0.0)
    t = torch.where(valid, t, 0.0)
    s = (t * b).sum(dim=1, keepdim=True) / (t * t).sum(dim=1, keepdim=True).clamp(min=1e-300)
    s = s.clamp(min=1e-6)
    eps = s - 1
    log_n = vocab.log()
    small = eps.abs() < 1e-9
    ratio = torch.where(small, 1.0 / log_n, eps / -torch.expm1(-eps.where(~small, 1.0) * log_n))
    log_k = (ratio.log() + mu * math.log(2.0)) / s
    k = log_k.clamp(max=math.log(probs.shape[1] + 1.0)).exp().floor().clamp(min=1.0)
    rank = (probs > 0).cumsum(dim=1) - 1  # rank among the remaining candidates (sorted descending)
    return _keep_top(probs, (rank < k) & (probs > 0))


def xtc(probs: torch.Tensor, threshold: torch.Tensor, probability: torch.Tensor) -> torch.Tensor:
    """XTC in expectation (see SamplerSettings): rows with at least two tokens at p >= threshold scale all of them
    but the least probable (the last in sorted order) by (1 - probability), the other tokens by
    1 + probability * m / (1 - m)."""
    top_choice = (probs >= threshold) & (probs > 0)
    count = top_choice.sum(dim=1, keepdim=True)
    rank = top_choice.cumsum(dim=1)
    excluded = top_choice & (rank < count) & (count >= 2)
    m = (probs * excluded).sum(dim=1, keepdim=True)
    up = 1.0 + probability * m / (1.0 - m).clamp(min=1e-38)
    scaled = torch.where(excluded, probs * (1.0 - probability), probs * up)
    return _renormalise(scaled)


def after_truncation(probs: torch.Tensor, candidate_ids: torch.Tensor, ext: ExtendedParams
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The stages after top-k / top-p / min-p, in order, on renormalised probabilities sorted descending by logit.
    Returns the final probabilities and their ids, sorted descending by final probability."""
    active = ext.active
    if "top_a" in active:
        p_max = probs[:, 0:1]
        probs = _keep_top(probs, probs >= ext.top_a * p_max * p_max)
    if "tfs" in active:
        probs = torch.where(ext.tfs < 1.0, tail_free(probs, ext.tfs), probs)
    if "typical" in active:
        probs = torch.where(ext.typical < 1.0, locally_typical(probs, ext.typical), probs)
    if "mirostat1" in active:
        probs = torch.where(ext.mirostat == 1, mirostat_v1(probs, ext.mu, ext.vocab), probs)
    if "mirostat2" in active:
        probs = torch.where(ext.mirostat == 2, mirostat_v2(probs, ext.mu), probs)
    if "temp_last" in active:
        probs = torch.where(ext.temp_last > 0, _power(probs, ext.temperature), probs)
    if "dynamic" in active:
        n = (probs > 0).sum(dim=1, keepdim=True)
        normalised = _entropy(probs) / n.clamp(min=2).float().log()
        temperature = ext.min_temp + (ext.max_temp - ext.min_temp) * normalised.clamp(0.0, 1.0) ** ext.temp_exponent
        dynamic = _power(probs, temperature.clamp(min=_MIN_POST_TEMPERATURE))
        probs = torch.where((ext.max_temp > ext.min_temp) & (n > 1), dynamic, probs)
    if "xtc_probability" in active:
        probs = torch.where(ext.xtc_probability > 0, xtc(probs, ext.xtc_threshold, ext.xtc_probability), probs)
        probs, order = probs.sort(dim=1, descending=True, stable=True)
        candidate_ids = candidate_ids.gather(1, order)
    return probs, candidate_ids


def skewed(u: torch.Tensor, ext: ExtendedParams | None) -> torch.Tensor:
    """The draws [B, 1] after skew: u^(e^-skew) (u = 0 stays 0)."""
    if ext is None or "skew" not in ext.active:
        return u
    return u.double().pow(torch.exp(-ext.skew.double())).to(u.dtype)
