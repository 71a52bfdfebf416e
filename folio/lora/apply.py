"""The batched low-rank update of a step whose rows use several adapters (S-LoRA / Punica style), never merged into
the base weights: per fused projection, y[rows of adapter g] += (x @ A_g^T) @ B_g^T, rows without an adapter
untouched.

A step's rows are split by length of their runs (consecutive rows of one adapter; a sequence's rows are contiguous):
- long runs (prompt chunks, at least MIN_IN_PLACE_ROWS rows) update their slice of y in place, one shrink product
  and one expand GEMM with beta = 1 each: no buffer of y's size, whatever the chunk length;
- the other rows (decode and verify rows, short chunks) are gathered in adapter order and updated together: on CUDA
  with torch._grouped_mm over the stacked factors of every loaded adapter (`LoraStacks`; a group per adapter, empty
  for those absent from the step), else a loop over the adapters present; the [rows, out] update is added back with
  one index_add_.

Steps with adapter rows run eagerly, outside the captured decode graphs (folio.model.decode_graphs): a graph bakes
in the addresses of the factors and the shapes of the grouping, so it would need adapters stacked into buffers of a
fixed capacity (max adapters x max rank, preallocated) and per-row adapter slots in static buffers, plus a second
set of captured graphs so that steps without adapters do not pay for them. Adapters can then come and go between
any two steps with nothing to recapture; steps without adapter rows keep the graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from folio.lora.adapter import PROJECTIONS, LoraAdapter

MIN_IN_PLACE_ROWS = 32
LayerLora = Callable[[str, torch.Tensor, torch.Tensor], None]  # (projection, x, y) at one layer: see LoraBatch.apply
RANK_ALIGNMENT = 8  # torch._grouped_mm needs 16-byte aligned strides: ranks padded to 8 bf16 elements


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Does torch._grouped_mm run on this device and dtype, with an empty group, and agree with the loop?"""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(24, 64, device=device, dtype=dtype, generator=gen)
    w = torch.randn(3, 16, 64, device=device, dtype=dtype, generator=gen)  # [G, N, K]: used transposed, as stacked
    offs = torch.tensor([10, 10, 24], dtype=torch.int32, device=device)
    try:
        got = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        want = torch.cat([x[:10].float() @ w[0].float().t(), x[10:].float() @ w[2].float().t()])
        return bool(torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


class LoraStacks:
    """The loaded adapters' factors stacked per layer and projection, padded to one rank, for torch._grouped_mm:
    slot g holds adapters[g]; zeros where an adapter does not target a projection. Rebuilt when adapters are
    loaded or unloaded (never per step)."""

    def __init__(self, adapters: tuple[LoraAdapter, ...], num_layers: int):
        self.adapters = adapters
        self.slot_of = {adapter: g for g, adapter in enumerate(adapters)}
        max_rank = max(a.max_projection_rank for a in adapters)
        rank = -(-max_rank // RANK_ALIGNMENT) * RANK_ALIGNMENT
        # per layer: projection -> (a [G, R, in], b [G, out, R]); absent where no adapter targets it
        self.layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for layer_idx in range(num_layers):
            stacked = {}
            for projection in PROJECTIONS:
                deltas = [a.layers[layer_idx].get(projection) for a in adapters]
                present = next((d for d in deltas if d is not None), None)
                if present is None:
                    continue
                in_features, out_features = present.a.shape[1], present.b.shape[0]
                a = present.a.new_zeros(len(adapters), rank, in_features)
                b = present.b.new_zeros(len(adapters), out_features, rank)
                for g, d in enumerate(deltas):
                    if d is not None:
                        a[g, : d.a.shape[0]] = d.a
                        b[g, :, : d.b.shape[1]] = d.b
                stacked[projection] = (a, b)
            self.layers.append(stacked)


@dataclass(frozen=True)
class _Run:
    start: int
    stop: int
    adapter: LoraAdapter


class LoraBatch:
    """Which adapter each row of a step uses, grouped for the update (see the module docstring)."""

    def __init__(self, runs: list[_Run], gathered: list[tuple[LoraAdapter, int]], perm: torch.Tensor | None,
                 offs: torch.Tensor | None, stacks: LoraStacks | None):
        self.runs = runs  # long runs, updated in place
        self.gathered = gathered  # (adapter, number of its gathered rows), in the order of perm
        self.perm = perm  # [M] int64: the gathered rows, grouped by adapter
        self.offs = offs  # [G] int32: grouped_mm's cumulative group ends, one group per stack slot
        self.stacks = stacks  # None: the loop over adapters

    @classmethod
    def build(cls, row_adapters: list[tuple[LoraAdapter | None, int]], device: torch.device,
              stacks: LoraStacks | None = None) -> LoraBatch | None:
        """row_adapters: per chunk in batch order, (its adapter or None, its number of rows). stacks: the loaded
        adapters' stacks when torch._grouped_mm works here (None: loop). None when no row has an adapter."""
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
        short: dict[LoraAdapter, list[int]] = {}
        for r in runs:
            if r.stop - r.start < MIN_IN_PLACE_ROWS:
                short.setdefault(r.adapter, []).extend(range(r.start, r.stop))
        if stacks is not None:  # slot order, so that each adapter's rows are grouped_mm's group of its slot
            short = dict(sorted(short.items(), key=lambda item: stacks.slot_of[item[0]]))
        gathered = [(adapter, len(rows)) for adapter, rows in short.items()]
        perm = offs = None
        if gathered:
            on_cuda = device.type == "cuda"
            rows = torch.tensor([i for rows in short.values() for i in rows], dtype=torch.int64)
            perm = (rows.pin_memory() if on_cuda else rows).to(device, non_blocking=True)
            if stacks is not None:
                counts = [0] * len(stacks.adapters)
                for adapter, n in gathered:
                    counts[stacks.slot_of[adapter]] = n
                ends = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
                offs = (ends.pin_memory() if on_cuda else ends).to(device, non_blocking=True)
        return cls(long_runs, gathered, perm, offs, stacks if gathered else None)

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
        if self.perm is None:
            return
        if self.stacks is not None:
            stacked = self.stacks.layers[layer_idx].get(projection)
            if stacked is None:
                return
            a, b = stacked
            shrunk = torch._grouped_mm(x.index_select(0, self.perm), a.transpose(1, 2), offs=self.offs)
            update = torch._grouped_mm(shrunk, b.transpose(1, 2), offs=self.offs)
        else:
            update = self._loop_update(layer_idx, projection, x, y.shape[1])
            if update is None:
                return
        y.index_add_(0, self.perm, update)

    def _loop_update(self, layer_idx: int, projection: str, x: torch.Tensor, out_features: int) -> torch.Tensor | None:
        """The gathered rows' update, one shrink and one expand product per adapter present."""
        deltas = [adapter.layers[layer_idx].get(projection) for adapter, _ in self.gathered]
        if all(d is None for d in deltas):
            return None
        xs = x.index_select(0, self.perm)
        update = xs.new_zeros(xs.shape[0], out_features)
        offset = 0
        for (_, n), delta in zip(self.gathered, deltas):
            if delta is not None:
                torch.mm(xs[offset:offset + n] @ delta.a.t(), delta.b.t(), out=update[offset:offset + n])
            offset += n
        return update
