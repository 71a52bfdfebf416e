"""LoRA adapters: PEFT adapter loading and validation (adapter), the loaded set (registry), and the batched
low-rank update of steps whose rows use several adapters (apply). See docs/architecture.md."""

from folio.lora.adapter import AdapterError, LoraAdapter, adapter_from_state_dict, load_peft_adapter, random_adapter
from folio.lora.apply import LoraBatch
from folio.lora.registry import LoraInfo, LoraRegistry

__all__ = ["AdapterError", "LoraAdapter", "LoraBatch", "LoraInfo", "LoraRegistry", "adapter_from_state_dict",
           "load_peft_adapter", "random_adapter"]
