"""LoraRegistry: the adapters loaded into one generator, by name, and the per-step grouping of rows by adapter.

Loading and unloading happen between steps (the generator is driven from one thread; DynamicGeneratorAsync's
`run_in_engine` runs them there). A job names its adapter (`DynamicJob(lora=name)`); the generator resolves the
name at enqueue and the job keeps the adapter object, so a step never looks names up. Unloading an adapter that a
queued or running job uses is refused (those jobs would otherwise run without it, or fail mid-way): cancel them or
wait for them to end first.

Each loaded adapter also holds a slot of the fixed-capacity buffers that decode rows are updated from
(folio.lora.slots; max_loras adapters of rank up to max_lora_rank), allocated at the first load: `on_slots`, when
set (the runner), is called then, once, to capture the decode graphs again with the update in them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from folio.lora.adapter import LoraAdapter, load_peft_adapter
from folio.lora.apply import LoraBatch
from folio.lora.slots import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, LoraSlots, check_capacity, check_rank

if TYPE_CHECKING:
    from folio.job import DynamicJob
    from folio.model.model import Model


@dataclass(frozen=True)
class LoraInfo:
    name: str
    rank: int
    scale: float
    target_modules: tuple[str, ...]
    adapter_id: str  # hex digest of the adapter's content (its page-hash namespace)


class LoraRegistry:
    def __init__(self, model: Model, max_loras: int = DEFAULT_MAX_LORAS, max_lora_rank: int = DEFAULT_MAX_LORA_RANK):
        self.model = model
        self.max_loras, self.max_lora_rank = check_capacity(max_loras, max_lora_rank)
        self._adapters: dict[str, LoraAdapter] = {}
        self.slots: LoraSlots | None = None  # allocated at the first load
        self.on_slots: Callable[[LoraSlots], None] | None = None

    # --- loading ---

    def load(self, name: str, path: str | Path) -> LoraInfo:
        """Load a PEFT adapter directory under `name` (which must not be loaded already)."""
        self._check_new(name)
        model = self.model
        return self.add(load_peft_adapter(name, path, model.config, model.device, model.dtype))

    def add(self, adapter: LoraAdapter) -> LoraInfo:
        """Register an adapter built in memory (folio.lora.adapter_from_state_dict, random_adapter)."""
        self._check_new(adapter.name)
        for delta in (d for layer in adapter.layers for d in layer.values()):
            if delta.a.device != self.model.device or delta.a.dtype != self.model.dtype:
                raise ValueError(f"adapter {adapter.name!r} is {delta.a.dtype} on {delta.a.device}, the model is "
                                 f"{self.model.dtype} on {self.model.device}")
        if len(adapter.layers) != self.model.config.num_layers:
            raise ValueError(f"adapter {adapter.name!r} has {len(adapter.layers)} layers, the model "
                             f"{self.model.config.num_layers}")
        if self.slots is None:
            check_rank(adapter, self.max_lora_rank)  # (refused before anything is allocated)
            model = self.model
            self.slots = LoraSlots(model.config, self.max_loras, self.max_lora_rank, model.device, model.dtype)
            if self.on_slots is not None:
                self.on_slots(self.slots)
        self.slots.assign(adapter)
        self._adapters[adapter.name] = adapter
        return _info(adapter)

    def unload(self, name: str, live_jobs: Iterable[DynamicJob]) -> None:
        """Forget adapter `name`; refused (RuntimeError) while any of live_jobs (queued or running) uses it. Its
        cached pages stay in the prefix cache under its namespace until evicted: they match only a reload of the
        same weights."""
        adapter = self.get(name)
        users = sum(1 for job in live_jobs if job.lora_adapter is adapter)
        if users:
            raise RuntimeError(f"adapter {name!r} is used by {users} queued or running job(s): cancel them or wait "
                               f"for them to end before unloading it")
        del self._adapters[name]
        self.slots.release(adapter)

    def _check_new(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter name must be a non-empty string, got {name!r}")
        if name in self._adapters:
            raise ValueError(f"an adapter named {name!r} is loaded already: unload it first")

    # --- lookup ---

    def get(self, name: str) -> LoraAdapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            loaded = sorted(self._adapters) or "none"
            raise ValueError(f"lora={name!r}: no adapter of that name is loaded (loaded: {loaded})")
        return adapter

    def resolve(self, name: str | None) -> LoraAdapter | None:
        """A job's `lora` field -> its adapter (None: the base model); ValueError naming the field otherwise."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise ValueError(f"lora must be an adapter name (str) or None, got {type(name).__name__}")
        return self.get(name)

    def infos(self) -> list[LoraInfo]:
        return [_info(a) for a in self._adapters.values()]

    @property
    def loaded(self) -> bool:
        return bool(self._adapters)

    # --- steps ---

    def batch(self, row_adapters: list[tuple[LoraAdapter | None, int]],
              device: torch.device) -> LoraBatch | None:
        """The step's grouping (None: no row has an adapter). row_adapters: per chunk, (adapter, rows)."""
        return LoraBatch.build(row_adapters, self.slots, device) if self.slots is not None else None

    def slot_of(self, adapter: LoraAdapter | None) -> int:
        """The adapter's slot (-1: None, the base model): what a captured graph's row reads."""
        return -1 if adapter is None else self.slots.slot_of(adapter)


def _info(adapter: LoraAdapter) -> LoraInfo:
    return LoraInfo(adapter.name, adapter.rank, adapter.scale, adapter.target_modules, adapter.adapter_id.hex())
