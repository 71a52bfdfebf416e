"""Pure-torch references for the native sampling ops (sample_rows, apply_penalties, mask_tokens).

folio/reference_ops.py holds the references of the model ops; these three serve the sampler's hot path and live
here until the sampler's owner adopts them (move freely: nothing outside tests imports this module).
The semantics are folio.sampling's (see native/cpu/kernels.h), restated with integer masses so that they are
exact: a kernel may only differ where exp()'s rounding moves a decision across a boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# float32(0.01): the kernels compare float32 temperatures with it
GREEDY_TEMPERATURE = float(torch.tensor(0.01, dtype=torch.float32))
WEIGHT_SCALE = 2.0**40  # fixed-point scale of sampling weights (kSampleWeightScale)
TOP_P_SLACK = 1e-6


@dataclass(frozen=True)
class RowDraw:
    token_id: int
    prob: float
    margin: float  # distance of the closest decision from its boundary, relative to the mass involved (1.0: far)


def _ranks_to_reach(ranked_mass: torch.Tensor, kept: int, target: int) -> tuple[int, float]:
    """(number of leading ranks whose inclusive mass first reaches target, relative distance from the boundary)."""
    cumulative = ranked_mass[:kept].cumsum(0)
    reached = cumulative >= target
    count = int(torch.nonzero(reached)[0].item()) + 1 if bool(reached.any()) else kept
    total = max(int(cumulative[-1].item()), 1)
    margin = float((cumulative.double() - target).abs().min().item()) / total
    return count, margin


def sample_row_reference(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, u: float
) -> RowDraw:
    """One row: logits [V] fp32 -> the drawn token, its probability, and how close the draw came to a boundary."""
    row = logits.float().cpu()
    vocab = row.numel()
    finite = torch.where(row.isnan(), float("-inf"), row)
    if not bool((finite > float("-inf")).any()):
        return RowDraw(-1, 0.0, 1.0)
    argmax = int(torch.argmax(finite).item())  # the first maximal index
    if not temperature >= GREEDY_TEMPERATURE or top_k == 1 or bool(torch.isinf(row[argmax])):
        return RowDraw(argmax, 1.0, 1.0)
    t = torch.tensor(temperature, dtype=torch.float32)
    weight = torch.exp(row / t - row[argmax] / t)
    weight = torch.where(weight.isnan(), 0.0, weight)
    order = torch.sort(weight, descending=True, stable=True).indices
    ranked_weight = weight[order]
    ranked_mass = torch.floor(ranked_weight.double() * WEIGHT_SCALE).long()

    margin = 1.0
    kept = vocab
    if 0 < top_k < vocab:
        kept = top_k
        if ranked_weight[top_k - 1] != ranked_weight[top_k]:
            gap = (ranked_weight[top_k - 1] - ranked_weight[top_k]) / ranked_weight[top_k - 1]
            margin = min(margin, float(gap.item()))
    if top_p < 1.0:
        kept_mass = int(ranked_mass[:kept].sum().item())
        target = -(-((float(top_p) - TOP_P_SLACK) * kept_mass) // 1)  # ceil
        kept, m = _ranks_to_reach(ranked_mass, kept, max(1, int(target)))
        margin = min(margin, m)
    if min_p > 0.0:
        above = int((ranked_weight[:kept] >= min_p).sum().item())
        margin = min(margin, float(((ranked_weight[:kept].double() - min_p).abs() / min_p).min().item()))
        kept = max(above, 1)
    total = int(ranked_mass[:kept].sum().item())
    target = min(total, int(float(u) * float(total)) + 1)
    count, m = _ranks_to_reach(ranked_mass, kept, target)
    rank = count - 1
    return RowDraw(int(order[rank].item()), float(ranked_mass[rank].item()) / total, min(margin, m))


def sample_rows_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> list[RowDraw]:
    """logits [B, V] fp32; temperature/top_p/min_p/u [B] fp32, top_k [B] int32 -> one RowDraw per row."""
    params = [t.cpu().tolist() for t in (temperature, top_k, top_p, min_p, u)]
    return [sample_row_reference(logits[b], *(p[b] for p in params)) for b in range(logits.shape[0])]


def _strength(distance: torch.Tensor, sustain: int, decay: int) -> torch.Tensor:
    fade = 1.0 - (distance - sustain).clamp(min=0).float() / max(decay, 1)
    return torch.where(distance < sustain + decay, fade, 0.0)


def apply_penalties_reference(
    logits: torch.Tensor,
    history: torch.Tensor,
    rep: torch.Tensor,
    freq: torch.Tensor,
    pres: torch.Tensor,
    sustain: torch.Tensor,
    decay: torch.Tensor,
) -> None:
    """In place on logits [B, V] fp32; history [B, H] int64, newest last, ids outside [0, V) ignored;
    rep/freq/pres [B] fp32; sustain/decay [B] int32 (strength fade, see native/common/params.h)."""
    vocab, width = logits.shape[1], history.shape[1]
    distance = torch.arange(width - 1, -1, -1)
    for b in range(logits.shape[0]):
        ids = history[b].cpu()
        valid = (ids >= 0) & (ids < vocab)
        strength = _strength(distance, int(sustain[b]), int(decay[b]))
        for token_id in torch.unique(ids[valid]).tolist():
            mine = valid & (ids == token_id)
            newest = strength[mine].max()  # strength never grows with distance
            total = strength[mine].sum()
            factor = 1.0 + (rep[b].cpu() - 1.0) * newest
            value = logits[b, token_id].cpu()
            value = value / factor if value > 0 else value * factor
            logits[b, token_id] = value - pres[b].cpu() * newest - freq[b].cpu() * total


def mask_tokens_reference(logits: torch.Tensor, token_ids: torch.Tensor) -> None:
    """In place: logits[b, id] = -inf for every id of token_ids[b] ([B, K] int64) inside [0, V)."""
    vocab = logits.shape[1]
    for b in range(logits.shape[0]):
        ids = token_ids[b]
        logits[b, ids[(ids >= 0) & (ids < vocab)]] = float("-inf")
