"""Exact acceptance of drafted tokens by rejection sampling, batched on the device.

For each position of a verify row, with p the target's final distribution there (folio.sampling.distribution) and q
the drafter's (a point mass on the drafted token for n-gram drafts and greedy draft-model drafts):
  accept the drafted token d with probability min(1, p(d) / q(d));
  on rejection emit a draw from the residual max(0, p - q), normalised, and stop;
  past the last draft (every draft accepted) emit a draw from p.
Each emitted token is then distributed exactly as the target's sampler would have drawn it (the standard argument of
Leviathan et al. and Chen et al., 2023). For a greedy row p is a point mass on the argmax, so a draft is kept exactly
when it is the argmax and the emitted token is always the argmax: greedy output equals decoding without drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from folio.sampling.distribution import draw


@dataclass
class Verdicts:
    """Per position (rows' positions concatenated), on the device: whether the drafted token there is accepted
    (False at each row's last position, which has no draft), and the token emitted if the row stops there."""

    accepted: torch.Tensor  # [P] bool
    emitted_ids: torch.Tensor  # [P] int64


def verdicts(target_probs: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
             u_accept: torch.Tensor, u_residual: torch.Tensor) -> Verdicts:
    """target_probs: [P, V] fp32; draft_ids: [P] int64, -1 where no token was drafted (a row's last position);
    draft_probs: [P, V] fp32 drafter distributions (zero rows where nothing was drafted), or None when every
    draft is a point mass; u_accept, u_residual: [P] draws in [0, 1)."""
    has_draft = draft_ids >= 0
    safe_ids = draft_ids.clamp(min=0)[:, None]
    p_draft = target_probs.gather(1, safe_ids).squeeze(1)
    if draft_probs is None:
        q_draft = has_draft.to(p_draft.dtype)
        # max(0, p - q) with q a point mass on d: p without d
        residual = target_probs.scatter(1, safe_ids, torch.where(has_draft[:, None], 0.0, p_draft[:, None]))
    else:
        q_draft = draft_probs.gather(1, safe_ids).squeeze(1)
        residual = (target_probs - draft_probs).clamp_(min=0.0)
    # accept when u < p/q, written as u * q < p (q > 0 wherever a token was drafted from it)
    accepted = has_draft & (u_accept.to(p_draft.dtype) * q_draft < p_draft)
    # p <= q everywhere leaves no residual; then p == q and the draft is always accepted, so this draw is unused
    # (p itself keeps it well defined)
    empty = residual.sum(dim=1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs, residual)
    return Verdicts(accepted, draw(residual, u_residual))


def greedy_verdicts(logits: torch.Tensor, draft_ids: torch.Tensor, vocab_size: int) -> Verdicts:
    """`verdicts` for rows that are all plain greedy (no penalties, bias or blocked tokens): the argmax decides."""
    argmax = logits[:, :vocab_size].argmax(dim=1)
    return Verdicts(argmax == draft_ids, argmax)


def num_accepted(accepted: list[bool], num_drafts: list[int]) -> list[int]:
    """Host side: per row, the drafts accepted before the first rejection (`accepted` as read back, rows' positions
    concatenated, each row num_drafts + 1 long)."""
    counts, offset = [], 0
    for k in num_drafts:
        n = 0
        while n < k and accepted[offset + n]:
            n += 1
        counts.append(n)
        offset += k + 1
    return counts
