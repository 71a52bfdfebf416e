"""Pure-torch references for the native sampling ops (sample_rows, apply_penalties, mask_tokens).

folio/reference_ops.py holds the references of the model ops; these three belong to the sampler's hot path and
live here until the sampler's owner adopts them (move freely: nothing outside tests imports this module).
The exact semantics are written in native/cpu/kernels.h; this file restates them with torch, row by row.
"""

from __future__ import annotations

import torch

# float32(0.01), as the kernels compare float32 temperatures with it
GREEDY_TEMPERATURE = float(torch.tensor(0.01, dtype=torch.float32))
WEIGHT_SCALE = 2.0**40  # fixed-point scale of sampling weights (kSampleWeightScale)


def _keys_and_mass(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weights [V] fp32 in [0, 1] -> (keys: their bit patterns as int64, mass: floor(w * 2^40) int64)."""
    keys = weights.view(torch.int32).long()  # w >= 0, so the bit pattern orders like the value
    mass = torch.floor(weights.double() * WEIGHT_SCALE).long()
    return keys, mass


def _top_p_threshold(keys: torch.Tensor, mass: torch.Tensor, threshold: int, top_p: float) -> int:
    """Largest key t such that the kept mass with key >= t reaches max(1, floor(top_p * kept mass))."""
    kept = keys >= threshold
    kept_keys, kept_mass = keys[kept], mass[kept]
    target = max(1, int(max(0.0, top_p) * float(kept_mass.sum().item())))
    unique_keys, inverse = torch.unique(kept_keys, return_inverse=True)  # ascending
    mass_per_key = torch.zeros_like(unique_keys).scatter_add_(0, inverse, kept_mass)
    cumulative = mass_per_key.flip(0).cumsum(0)  # from the largest key down
    idx = int(torch.nonzero(cumulative >= target)[0].item()) if bool((cumulative >= target).any()) else -1
    return int(unique_keys.flip(0)[idx].item())


def sample_row_reference(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, u: float
) -> int:
    """One row: logits [V] fp32 -> token id (see native/cpu/kernels.h for the definition)."""
    row = logits.float().cpu()
    vocab = row.numel()
    argmax = int(torch.argmax(torch.where(row.isnan(), float("-inf"), row)).item())
    if not temperature >= GREEDY_TEMPERATURE:
        return argmax
    inv_temperature = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32)
    z = row * inv_temperature
    max_z = z[argmax]
    if not bool(torch.isfinite(max_z)):
        return argmax
    weights = torch.exp(z - max_z)
    weights = torch.where(weights.isnan(), 0.0, weights)
    keys, mass = _keys_and_mass(weights)

    threshold = 0
    if 0 < top_k < vocab:
        threshold = int(torch.topk(keys, top_k).values[-1].item())
    if top_p < 1.0:
        threshold = _top_p_threshold(keys, mass, threshold, top_p)
    if min_p > 0.0:
        min_p_key = int(torch.tensor([min_p], dtype=torch.float32).view(torch.int32).item())
        threshold = max(threshold, min_p_key)

    kept_mass = torch.where(keys >= threshold, mass, 0)
    total = int(kept_mass.sum().item())
    if total == 0:
        return argmax
    target = int(float(u) * float(total))
    cumulative = kept_mass.cumsum(0)
    return int(torch.nonzero(cumulative > target)[0].item())


def sample_rows_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """logits [B, V] fp32; per-row temperature/top_p/min_p/u [B] fp32, top_k [B] int32 -> token ids [B] int64."""
    params = [t.cpu().tolist() for t in (temperature, top_k, top_p, min_p, u)]
    ids = [sample_row_reference(logits[b], *(p[b] for p in params)) for b in range(logits.shape[0])]
    return torch.tensor(ids, dtype=torch.int64, device=logits.device)


def apply_penalties_reference(
    logits: torch.Tensor, history: torch.Tensor, rep: torch.Tensor, freq: torch.Tensor, pres: torch.Tensor
) -> None:
    """In place on logits [B, V] fp32; history [B, H] int64 padded with -1; rep/freq/pres [B] fp32."""
    vocab = logits.shape[1]
    for b in range(logits.shape[0]):
        ids = history[b]
        ids = ids[(ids >= 0) & (ids < vocab)]
        if ids.numel() == 0:
            continue
        unique_ids, counts = torch.unique(ids, return_counts=True)
        values = logits[b, unique_ids]
        values = torch.where(values > 0, values / rep[b], values * rep[b])
        logits[b, unique_ids] = values - (freq[b] * counts.float() + pres[b])


def mask_tokens_reference(logits: torch.Tensor, token_ids: torch.Tensor) -> None:
    """In place: logits[b, id] = -inf for every id of token_ids[b] ([B, K] int64) inside [0, V)."""
    vocab = logits.shape[1]
    for b in range(logits.shape[0]):
        ids = token_ids[b]
        logits[b, ids[(ids >= 0) & (ids < vocab)]] = float("-inf")


def sample_row_margin(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, u: float
) -> float:
    """How close row's sampling decisions come to a boundary, as a fraction of the kept mass (1.0 = far).

    Kernels compute exp() with different rounding than torch (a few ulps), which moves weights by ~1e-7
    relative; a row whose top-k, top-p or final draw sits closer than that to a boundary may legitimately
    pick a neighbouring token. Tests skip exact comparison for rows whose margin is tiny.
    """
    row = logits.float().cpu()
    vocab = row.numel()
    argmax = int(torch.argmax(torch.where(row.isnan(), float("-inf"), row)).item())
    if not temperature >= GREEDY_TEMPERATURE:
        return 1.0
    inv_temperature = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32)
    z = row * inv_temperature
    weights = torch.exp(z - z[argmax])
    weights = torch.where(weights.isnan(), 0.0, weights)
    keys, mass = _keys_and_mass(weights)
    margin = 1.0
    threshold = 0
    if 0 < top_k < vocab:
        top = torch.topk(weights.double(), min(top_k + 1, vocab)).values
        if top_k < vocab and top[top_k - 1] != top[top_k]:
            margin = min(margin, float((top[top_k - 1] - top[top_k]) / top[0]))
        threshold = int(torch.topk(keys, top_k).values[-1].item())
    if top_p < 1.0:
        kept = keys >= threshold
        total = float(mass[kept].sum().item())
        target = max(1.0, max(0.0, top_p) * total)
        sorted_mass = torch.sort(weights[kept].double(), descending=True).values.cumsum(0) * WEIGHT_SCALE
        margin = min(margin, float((sorted_mass - target).abs().min() / total))
        threshold = _top_p_threshold(keys, mass, threshold, top_p)
    if min_p > 0.0:
        margin = min(margin, float((weights.double() - min_p).abs().min()))
        min_p_key = int(torch.tensor([min_p], dtype=torch.float32).view(torch.int32).item())
        threshold = max(threshold, min_p_key)
    kept_mass = torch.where(keys >= threshold, mass, 0)
    total = float(kept_mass.sum().item())
    if total > 0:
        target = float(u) * total
        margin = min(margin, float((kept_mass.cumsum(0).double() - target).abs().min() / total))
    return margin
