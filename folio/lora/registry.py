"""LoraRegistry: the adapters loaded into one generator, by name, and the per-step grouping of rows by adapter.

Loading and unloading happen between steps (the generator is driven from one thread; DynamicGeneratorAsync's
`run_in_engine` runs them there). A job names its adapter (`DynamicJob(lora=name)`); the generator resolves the
name at enqueue and the job keeps the adapter object, so a step never looks names up. Unloading an adapter that a
queued or running job uses is refused (those jobs would otherwise run without it, or fail mid-way): cancel them or
wait for them to end first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from folio.lora.adapter import LoraAdapter, load_peft_adapter
from folio.lora.apply import LoraBatch, LoraStacks, grouped_mm_works

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
    def __init__(self, model: Model):
        self.model = model
        self._adapters: dict[str, LoraAdapter] = {}
        self._grouped: bool | None = None  # torch._grouped_mm works on the model's device and dtype (probed once)
        self._stacks: LoraStacks | None = None

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
        self._adapters[adapter.name] = adapter
        self._restack()
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
        self._restack()

    def _check_new(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter name must be a non-empty string, got {name!r}")
        if name in self._adapters:
            raise ValueError(f"an adapter named {name!r} is loaded already: unload it first")

    def _restack(self) -> None:
        """The grouped path's stacks follow the loaded set (a step in flight keeps the stacks it was built with)."""
        if self._grouped is None:
            self._grouped = grouped_mm_works(self.model.device, self.model.dtype)
        adapters = tuple(self._adapters.values())
        self._stacks = LoraStacks(adapters, self.model.config.num_layers) if self._grouped and adapters else None

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

    @property
    def grouped(self) -> bool:
        """Whether steps use torch._grouped_mm (known once an adapter was loaded)."""
        return bool(self._grouped)

    # --- steps ---

    def batch(self, row_adapters: list[tuple[LoraAdapter | None, int]],
              device: torch.device) -> LoraBatch | None:
        """The step's grouping (None: no row has an adapter). row_adapters: per chunk, (adapter, rows)."""
        return LoraBatch.build(row_adapters, device, self._stacks)


def _info(adapter: LoraAdapter) -> LoraInfo:
    return LoraInfo(adapter.name, adapter.rank, adapter.scale, adapter.target_modules, adapter.adapter_id.hex())
