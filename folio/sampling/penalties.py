"""Repetition (CTRL-style), presence and frequency penalties over each row's recent history, batched.

The token at distance j from the newest (j = 0 newest) has strength w(j) = 1 up to j = range, then
1 - (j - range) / decay, and 0 from range + decay on (the reference's linear fade; range -1 = the whole history at
full strength). For each distinct token in the window the repetition and presence penalties use the strength at its
newest occurrence (the largest) and the frequency penalty sums the strengths of all occurrences:
    logit' = (logit / r if logit > 0 else logit * r) - presence * w_newest - frequency * sum(w)
    with r = 1 + (repetition_penalty - 1) * w_newest
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from folio.sampling.host import to_device
from folio.sampling.settings import SamplerSettings

History = Sequence[int] | torch.Tensor


def history_windows(histories: Sequence[History], sizes: list[int], width: int, dump_column: int,
                     device: torch.device) -> torch.Tensor:
    """[B, width] ids, each row's window right-aligned (newest last), left-padded with `dump_column`; ids outside
    [0, dump_column) also become `dump_column`, so that they change nothing. Built in one host array (numpy slice
    copies, one transfer)."""
    ids = np.full((len(sizes), width), dump_column, dtype=np.int64)
    for row, (history, size) in enumerate(zip(histories, sizes)):
        if size:
            values = history.numpy() if isinstance(history, torch.Tensor) else history
            ids[row, width - size:] = values[len(values) - size:]
    np.putmask(ids, (ids < 0) | (ids > dump_column), dump_column)
    return to_device(torch.from_numpy(ids), torch.int64, device)


def window_size(settings: SamplerSettings, history_len: int) -> int:
    """How many of a history's newest ids the penalties read."""
    window = settings.penalty_window
    return history_len if window is None else min(window, history_len)


def apply_penalties(work: torch.Tensor, settings: Sequence[SamplerSettings], histories: Sequence[History] = (),
                    windows: torch.Tensor | None = None) -> None:
    """Penalise `work` [B, V + 1] in place; its last column is a scratch column that absorbs skipped entries.
    The ids come from `histories` (host sequences, windowed here) or from `windows`: [B, width] ids on the
    device, already windowed, right-aligned and padded with the scratch column's index (DeviceHistories)."""
    device = work.device
    batch, dump_column = work.shape[0], work.shape[1] - 1
    if windows is None:
        sizes = [window_size(s, len(h)) for s, h in zip(settings, histories)]
        width = max(sizes)
        if width == 0:
            return
        ids = history_windows(histories, sizes, width, dump_column, device)
    else:
        ids, width = windows, windows.shape[1]
        if width == 0:
            return

    per_row = to_device([v for s in settings for v in (
        s.token_repetition_range if s.token_repetition_range >= 0 else width, s.token_repetition_decay,
        s.token_repetition_penalty, s.token_presence_penalty, s.token_frequency_penalty)], torch.float64, device)
    per_row = per_row.view(batch, 5)
    sustain, decay = per_row[:, 0:1].long(), per_row[:, 1:2].long()
    repetition, presence, frequency = per_row[:, 2:5].float().split(1, dim=1)
    distance = torch.arange(width - 1, -1, -1, device=device)[None, :]
    weight = 1.0 - (distance - sustain).clamp(min=0) / decay.clamp(min=1)
    weight = torch.where(distance < sustain + decay, weight, 0.0).to(torch.float32)

    # Group equal ids per row. The stable sort keeps each group oldest-first, so its last entry is the newest
    # occurrence; group sums come from a cumulative sum (deterministic, unlike atomic scatter-adds, so a row gets
    # bit-identical penalties alone or batched).
    sorted_ids, order = ids.sort(dim=1, stable=True)
    sorted_weight = weight.gather(1, order)
    boundary = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    edge = torch.ones(batch, 1, dtype=torch.bool, device=device)
    is_first = torch.cat([edge, boundary], dim=1)
    is_last = torch.cat([boundary, edge], dim=1)
    positions = torch.arange(width, device=device).expand(batch, width)
    group_start = torch.where(is_first, positions, 0).cummax(dim=1).values
    cumulative = sorted_weight.to(torch.float64).cumsum(dim=1)
    before_group = cumulative.gather(1, group_start) - sorted_weight.gather(1, group_start).to(torch.float64)
    weight_sum = (cumulative - before_group).to(torch.float32)

    columns = torch.where(is_last, sorted_ids, dump_column)  # one write per distinct token
    values = work.gather(1, columns)
    factor = 1.0 + (repetition - 1.0) * sorted_weight
    values = torch.where(values > 0, values / factor, values * factor)
    values = values - presence * sorted_weight - frequency * weight_sum
    work.scatter_(1, columns, values)
