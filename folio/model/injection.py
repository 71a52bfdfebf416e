"""Embedding rows injected at token positions: the forward-pass side of folio.embeddings.

A chunk of a prompt that holds placeholder tokens carries `InjectedSpan`s (which of its rows, with which values);
`ForwardBatch.build` gathers them into one row index and one value tensor for the batch and puts token id 0 at
those rows, so the embedding lookup never sees a placeholder id (they lie far beyond the vocabulary). The model
then overwrites the looked-up rows with the injected values (`Model.forward`, right after the lookup).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class InjectedSpan:
    """Rows offset .. offset + len(values) - 1 of a chunk's new tokens take `values` instead of their token
    embeddings."""

    offset: int  # first replaced row, counted from the chunk's first new token
    values: torch.Tensor  # [m, hidden_size] in the model's dtype, on its device


def gather(spans_per_chunk: Sequence[Sequence[InjectedSpan]], q_lens: Sequence[int], chunk_starts: np.ndarray,
           input_ids: np.ndarray, to_device: Callable[[np.ndarray, torch.dtype], torch.Tensor],
           ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The batch's injected rows ([R] int64 rows of the batch's T tokens) and their values ([R, H]); (None, None)
    without any. chunk_starts[i]: the batch row of chunk i's first token. Sets input_ids to 0 at those rows (in
    place, before it is copied to the device)."""
    rows: list[np.ndarray] = []
    values: list[torch.Tensor] = []
    for i, spans in enumerate(spans_per_chunk):
        for span in spans:
            num_rows = span.values.shape[0]
            if span.offset < 0 or span.offset + num_rows > q_lens[i]:
                raise ValueError(f"chunk {i}: injected rows {span.offset}..{span.offset + num_rows - 1} lie outside "
                                 f"its {q_lens[i]} tokens")
            rows.append(np.arange(num_rows, dtype=np.int64) + int(chunk_starts[i]) + span.offset)
            values.append(span.values)
    if not rows:
        return None, None
    flat_rows = np.concatenate(rows)
    if np.unique(flat_rows).shape[0] != flat_rows.shape[0]:
        raise ValueError("injected spans overlap: a row would be replaced twice")
    input_ids[flat_rows] = 0
    return to_device(flat_rows, torch.int64), values[0] if len(values) == 1 else torch.cat(values)
