"""Token bitmasks on the device: the grammar engines' format, ceil(V / 32) int32 words per row, bit (t % 32) of
word t // 32 set when token t is allowed."""

from __future__ import annotations

import math

import torch


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set logits [B, V] to -inf, in place, where bitmask [B, W] int32 (same device) has a clear bit; columns past
    W * 32 are masked too. Returns each row's number of allowed columns, [B] int64 on the device (no sync)."""
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {logits.shape[0]} logits rows")
    num_columns = logits.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = ((bitmask[:, :, None] >> shifts) & 1).bool().view(bitmask.shape[0], -1)
    width = min(bits.shape[1], num_columns)
    logits[:, :width].masked_fill_(~bits[:, :width], -math.inf)
    if width < num_columns:
        logits[:, width:] = -math.inf
    return bits[:, :width].sum(dim=1)
