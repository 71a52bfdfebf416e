"""LoraSlots: the loaded adapters' factors in buffers of a fixed capacity, and the masked low-rank update that reads
them, the form of the update that a captured CUDA graph runs (folio.model.decode_graphs).

Per layer and fused projection: A_all [S*R, in] and B_all [out, S*R], S = max_loras slots of R columns each (the
projection's capacity: max_lora_rank per fused part, q/k/v three, gate/up two, rounded up to RANK_ALIGNMENT). Slot s
holds one adapter's ProjectionDelta (folio.lora.adapter) in rows / columns s*R.., zeros after its rank, and zeros
where the adapter does not target the projection. Each row of a step carries its slot (-1: the base model), and

    y += ((x @ A_all^T) * mask) @ B_all^T,    mask[t, s*R + j] = 1 where row t's slot is s, else 0

updates every row with its own adapter: two GEMMs and one elementwise product whose shapes depend on the capacity
alone. No host sync, no shape that depends on which adapters a step uses: a graph captured once serves every mix of
adapters and base rows, and loading or unloading an adapter between steps only writes a slot.

Cost: the GEMMs cover every slot whatever the step uses, 2 x rows x S*R x (in + out) FLOPs per projection; at 8
slots of rank 16 on an 8B model next to nothing beside the base GEMMs, but it grows with max_loras * max_lora_rank,
as does the memory (lora_slot_bytes).

Steps in flight: slots are written by copies queued on the device's current stream, the stream every step runs on,
so a step launched ahead of a load (folio.pipeline) still reads the slots as they were when it was launched: a slot
freed by an unload and filled by a later load is rewritten only after every step queued before that load has run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from folio.lora.adapter import PROJECTIONS, AdapterError, LoraAdapter, part_sizes
from folio.model.config import ModelConfig

DEFAULT_MAX_LORAS = 8
DEFAULT_MAX_LORA_RANK = 16
RANK_ALIGNMENT = 8  # 16-byte aligned rows of bf16 factors for the GEMMs


@dataclass(frozen=True)
class SlotFactors:
    """One projection's buffers at one layer."""

    a: torch.Tensor  # [S*R, in]: slot s's A in rows s*R..
    b: torch.Tensor  # [out, S*R]: slot s's B (scale folded in) in columns s*R..
    slot_rank: int  # R


def slot_rank(num_parts: int, max_lora_rank: int) -> int:
    """Columns of one slot of a fused projection of num_parts parts."""
    return -(-num_parts * max_lora_rank // RANK_ALIGNMENT) * RANK_ALIGNMENT


def _layer_shapes(config: ModelConfig, max_lora_rank: int) -> list[dict[str, tuple[int, int, int]]]:
    """Per layer: projection -> (R, out, in); expert MLPs have none (adapters may not target them)."""
    sizes = part_sizes(config)
    moe = getattr(config, "moe", None)
    shapes = []
    for layer_idx in range(config.num_layers):
        routed = moe is not None and moe.layers[layer_idx]
        shapes.append({p: (slot_rank(len(sizes[p][0]), max_lora_rank), sum(sizes[p][0]), sizes[p][1])
                       for p in PROJECTIONS if not (routed and p in ("gate_up", "down"))})
    return shapes


def check_capacity(max_loras: object, max_lora_rank: object) -> tuple[int, int]:
    for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return max_loras, max_lora_rank


def check_rank(adapter: LoraAdapter, max_lora_rank: int) -> None:
    if adapter.rank > max_lora_rank:
        raise AdapterError(f"adapter {adapter.name!r} has rank {adapter.rank}, more than max_lora_rank={max_lora_rank}"
                           f" (the generator's LoRA slot capacity: DynamicGenerator(max_lora_rank=...))")


def lora_slot_bytes(config: ModelConfig, dtype: torch.dtype, max_loras: int, max_lora_rank: int) -> int:
    """Device bytes of the slot buffers of this capacity (allocated when a generator loads its first adapter)."""
    check_capacity(max_loras, max_lora_rank)
    element = torch.empty((), dtype=dtype).element_size()
    return sum(max_loras * r * (out + inp) * element
               for layer in _layer_shapes(config, max_lora_rank) for r, out, inp in layer.values())


class LoraSlots:
    def __init__(self, config: ModelConfig, max_loras: int, max_lora_rank: int, device: torch.device,
                 dtype: torch.dtype):
        self.max_loras, self.max_lora_rank = check_capacity(max_loras, max_lora_rank)
        self.dtype = dtype
        self.layers = [{p: SlotFactors(torch.zeros(max_loras * r, inp, device=device, dtype=dtype),
                                       torch.zeros(out, max_loras * r, device=device, dtype=dtype), r)
                        for p, (r, out, inp) in layer.items()}
                       for layer in _layer_shapes(config, max_lora_rank)]
        self.slot_range = torch.arange(max_loras, device=device)  # compared with each row's slot (the mask)
        self._slot_of: dict[LoraAdapter, int] = {}
        self._free = list(range(max_loras))

    # --- loading ---

    def check_fits(self, adapter: LoraAdapter) -> None:
        """AdapterError naming max_lora_rank / max_loras when `adapter` cannot take a slot now."""
        check_rank(adapter, self.max_lora_rank)
        if not self._free:
            raise AdapterError(f"max_loras={self.max_loras} adapters are loaded already: unload one before loading "
                               f"{adapter.name!r}, or raise DynamicGenerator(max_loras=...)")

    def assign(self, adapter: LoraAdapter) -> int:
        """Copy the adapter's factors into a free slot; returns the slot."""
        self.check_fits(adapter)
        if adapter in self._slot_of:
            raise ValueError(f"adapter {adapter.name!r} holds slot {self._slot_of[adapter]} already")
        slot = self._free.pop(0)
        for layer, deltas in zip(self.layers, adapter.layers):
            for projection, f in layer.items():
                cols = slice(slot * f.slot_rank, (slot + 1) * f.slot_rank)
                f.a[cols].zero_()  # (what an earlier occupant left)
                f.b[:, cols].zero_()
                delta = deltas.get(projection)
                if delta is not None:
                    rank = delta.a.shape[0]
                    f.a[cols.start:cols.start + rank].copy_(delta.a)
                    f.b[:, cols.start:cols.start + rank].copy_(delta.b)
        self._slot_of[adapter] = slot
        return slot

    def release(self, adapter: LoraAdapter) -> None:
        """Free the adapter's slot (its contents stay until the slot is filled again: no row refers to it)."""
        slot = self._slot_of.pop(adapter)
        self._free.append(slot)
        self._free.sort()

    def slot_of(self, adapter: LoraAdapter | None) -> int:
        return -1 if adapter is None else self._slot_of[adapter]

    @property
    def num_free(self) -> int:
        return len(self._free)

    # --- the update ---

    def mask(self, row_slots: torch.Tensor) -> torch.Tensor:
        """[T, S] in the factors' dtype: 1 at (row, its slot), 0 elsewhere (a row of slot -1: all 0)."""
        return (row_slots[:, None] == self.slot_range[None, :]).to(self.dtype)

    def apply(self, layer_idx: int, projection: str, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
              rows: torch.Tensor | None = None) -> None:
        """y += each row's update (x [T, in], y [T, out]); rows: [M] int64, the rows of x and y that mask [M, S]
        is of (None: all)."""
        f = self.layers[layer_idx].get(projection)
        if f is None:
            return
        if rows is not None:
            x = x.index_select(0, rows)
        shrunk = x @ f.a.t()  # [T, S*R]
        shrunk.view(x.shape[0], self.max_loras, f.slot_rank).mul_(mask[:, :, None])
        if rows is None:
            y.addmm_(shrunk, f.b.t())
        else:
            y.index_add_(0, rows, shrunk @ f.b.t())
