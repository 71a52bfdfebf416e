"""The batched low-rank update of a step whose rows use several adapters (S-LoRA / Punica style), never merged into
the base weights: per fused projection, y[rows of adapter g] += (x @ A_g^T) @ B_g^T, rows without an adapter
untouched.

Two forms, chosen per row by the length of its run (consecutive rows of one adapter; a sequence's rows are
contiguous):
- long runs (prompt chunks, at least MIN_IN_PLACE_ROWS rows) update their slice of y in place from the adapter's
  own factors, one shrink product and one expand GEMM with beta = 1 each: no buffer of y's size, whatever the
  chunk length;
- the other rows (decode and verify rows, short chunks) take the masked update over the slot buffers
  (folio.lora.slots): every loaded adapter's factors in one GEMM pair, each row's product masked to its slot. In
  a step of short chunks only (decode and verify rows) that is every row of the step, base rows on slot -1, with
  no gather: the form a captured decode graph runs (`LoraBatch.for_graph`, over the graph's static buffer of row
  slots); otherwise the short adapter rows are gathered, updated and added back with one index_add_.

A step of long chunks whose rows mostly carry adapters also takes the masked update over every row when the slots
are narrow (max_loras x max_lora_rank <= MASKED_MAX_COLUMNS): one GEMM pair per projection for the whole step
instead of one per run plus the gathered rows' (a step of four 512-token prompts of four adapters launched eight
skinny GEMMs per projection and layer). The masked form multiplies every row by every slot's factors, max_loras
times the FLOPs of its own adapter's, which at narrow slots stays a few percent of the base GEMMs'; the output rows
are read and written once either way. With wide slots, or mostly base rows (whose output the masked form would
read and write for nothing), the runs update in place as above.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from folio.lora.adapter import LoraAdapter
from folio.lora.slots import LoraSlots

MIN_IN_PLACE_ROWS = 32
MASKED_MAX_COLUMNS = 256  # slot capacity (max_loras x max_lora_rank) up to which long runs may take the masked form
LayerLora = Callable[[str, torch.Tensor, torch.Tensor], None]  # (projection, x, y) at one layer: see LoraBatch.apply


@dataclass(frozen=True)
class _Run:
    start: int
    stop: int
    adapter: LoraAdapter


class LoraBatch:
    """Which adapter each row of a step uses, grouped for the update (see the module docstring)."""

    def __init__(self, slots: LoraSlots, runs: list[_Run], rows: torch.Tensor | None, mask: torch.Tensor | None):
        self.slots = slots
        self.runs = runs  # long runs, updated in place
        self.rows = rows  # [M] int64: the rows of the masked update (None: every row of the step)
        self.mask = mask  # [M or T, S]: each such row's slot (slots.mask); None: no row takes the masked update

    @classmethod
    def build(cls, row_adapters: list[tuple[LoraAdapter | None, int]], slots: LoraSlots,
              device: torch.device) -> LoraBatch | None:
        """row_adapters: per chunk in batch order, (its adapter or None, its number of rows); every adapter holds a
        slot of `slots`. None when no row has an adapter."""
        runs: list[_Run] = []
        start = 0
        for adapter, num_rows in row_adapters:
            if adapter is not None:
                if runs and runs[-1].adapter is adapter and runs[-1].stop == start:
                    runs[-1] = _Run(runs[-1].start, start + num_rows, adapter)
                else:
                    runs.append(_Run(start, start + num_rows, adapter))
            start += num_rows
        if not runs:
            return None
        long_runs = [r for r in runs if r.stop - r.start >= MIN_IN_PLACE_ROWS]
        if all(n < MIN_IN_PLACE_ROWS for _, n in row_adapters) or _masked_everywhere(row_adapters, slots):
            # every row, base rows on slot -1, no gather: the graphs' form (with a long base chunk in the step, its
            # rows would pay for the masked update for nothing: gathered below instead)
            row_slots = [s for adapter, n in row_adapters for s in [slots.slot_of(adapter)] * n]
            return cls(slots, [], None, slots.mask(_to_device([row_slots], device)[0]))
        short = [(i, slots.slot_of(r.adapter)) for r in runs if r.stop - r.start < MIN_IN_PLACE_ROWS
                 for i in range(r.start, r.stop)]
        if not short:
            return cls(slots, long_runs, None, None)
        rows, row_slots = _to_device([[i for i, _ in short], [s for _, s in short]], device)
        return cls(slots, long_runs, rows, slots.mask(row_slots))

    @classmethod
    def for_graph(cls, slots: LoraSlots, row_slots: torch.Tensor) -> LoraBatch:
        """Every row through the masked update, their slots read from row_slots ([T] int64, -1: base), a static
        buffer of a captured graph: the mask is computed inside the graph."""
        return cls(slots, [], None, slots.mask(row_slots))

    def at(self, layer_idx: int) -> LayerLora:
        return partial(self.apply, layer_idx)

    def apply(self, layer_idx: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's adapter update of `projection` at layer_idx (x: the projection's input rows [T, in],
        y: its output [T, out], or the residual stream it was added into)."""
        for run in self.runs:
            delta = run.adapter.layers[layer_idx].get(projection)
            if delta is not None:
                rows = slice(run.start, run.stop)
                y[rows].addmm_(x[rows] @ delta.a.t(), delta.b.t())
        if self.mask is not None:
            self.slots.apply(layer_idx, projection, x, y, self.mask, self.rows)


def _masked_everywhere(row_adapters: list[tuple[LoraAdapter | None, int]], slots: LoraSlots) -> bool:
    """Whether a step with long chunks takes the masked update over every row: narrow slots, and at least half
    of its rows carry an adapter (see the module docstring)."""
    if slots.max_loras * slots.max_lora_rank > MASKED_MAX_COLUMNS:
        return False
    with_adapter = sum(n for adapter, n in row_adapters if adapter is not None)
    return 2 * with_adapter >= sum(n for _, n in row_adapters)


def _to_device(lists: list[list[int]], device: torch.device) -> torch.Tensor:
    """Equal-length int lists as one [len(lists), n] int64 tensor on device, in one copy (pinned on CUDA: queued
    on the stream, no host wait)."""
    host = torch.tensor(lists, dtype=torch.int64)
    return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
