"""LoRA adapters: PEFT adapter loading and validation (adapter), the loaded set (registry), and the batched
low-rank update of steps whose rows use several adapters (apply), over the fixed-capacity slot buffers that captured
decode graphs read (slots). See docs/architecture.md."""

from folio.lora.adapter import AdapterError, LoraAdapter, adapter_from_state_dict, load_peft_adapter, random_adapter
from folio.lora.apply import LoraBatch
from folio.lora.registry import LoraInfo, LoraRegistry
from folio.lora.slots import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, LoraSlots, lora_slot_bytes

__all__ = ["DEFAULT_MAX_LORAS", "DEFAULT_MAX_LORA_RANK", "AdapterError", "LoraAdapter", "LoraBatch", "LoraInfo",
           "LoraRegistry", "LoraSlots", "adapter_from_state_dict", "load_peft_adapter", "lora_slot_bytes",
           "random_adapter"]
