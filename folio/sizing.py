"""How big a generator's steps get, and the device memory they need beside the KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from folio.lora.slots import DEFAULT_MAX_LORA_RANK, lora_slot_bytes

if TYPE_CHECKING:
    from folio.model.model import Model

DEFAULT_MAX_CHUNK_TOKENS = 2048
MAX_DERIVED_BATCH_SIZE = 256
# Prompt gathering's defaults with CUDA graphs (DynamicGenerator's gather_prompt_rows / gather_prompt_steps): from
# this many decoding rows a step's host time is mostly per row, and an eager forward adds several milliseconds; a
# few steps of waiting cost a prompt little of its time to first token at such a load. (Below it, at a chat
# replica's few dozen rows, an 8B step is bound by its weights' bytes whether eager or not: waiting would only
# add to time to first token.)
DEFAULT_GATHER_PROMPT_ROWS = 128
DEFAULT_GATHER_PROMPT_STEPS = 4
# Device memory that CUDA libraries take at their first use beside torch's tensors, kept free with the activations
# (activation_reserve_bytes): cuBLAS's workspaces (32 MiB a handle on Hopper), cuDNN's plans and the code of
# kernels loaded lazily at their first launch.
LIBRARY_RESERVE_BYTES = 256 << 20


def resolve_max_chunk_size(max_chunk_size: int | None, page_size: int) -> int:
    """DynamicGenerator's max_chunk_size: the given one, checked, or the default rounded to whole pages."""
    if max_chunk_size is None:
        return max(page_size, DEFAULT_MAX_CHUNK_TOKENS - DEFAULT_MAX_CHUNK_TOKENS % page_size)
    if not isinstance(max_chunk_size, int) or max_chunk_size < page_size or max_chunk_size % page_size:
        raise ValueError(f"max_chunk_size must be a positive multiple of the page size ({page_size}), "
                         f"got {max_chunk_size!r}")
    return max_chunk_size


def activation_reserve_bytes(model: Model, max_batch_size: int = MAX_DERIVED_BATCH_SIZE,
                             max_chunk_size: int | None = None, page_size: int = 256, max_loras: int = 0,
                             max_lora_rank: int = DEFAULT_MAX_LORA_RANK) -> int:
    """Device memory that a DynamicGenerator with these settings needs beside its cache (Cache's reserve_bytes):
    its largest eager step (a full prompt chunk with a decode row for every other running sequence) and, on
    CUDA, the memory pool of its captured decode graphs (one step of max_batch_size rows) and the libraries'
    own (LIBRARY_RESERVE_BYTES). max_loras > 0: LoRA adapters will be loaded (the generator's max_loras and
    max_lora_rank): their slot buffers, and as much again for the adapters' own factors (at most one slot each)."""
    positive_int("max_batch_size", max_batch_size)
    chunk = resolve_max_chunk_size(max_chunk_size, page_size)
    reserve = model.step_activation_bytes(chunk + max_batch_size, max_batch_size)
    if max_loras:
        reserve += 2 * lora_slot_bytes(model.config, model.dtype, max_loras, max_lora_rank)
    if model.device.type == "cuda":
        # the decode graphs' pool (a graph runs the forward; the sampler runs eagerly after it), the libraries'
        reserve += model.step_activation_bytes(max_batch_size, max_batch_size, sampling=False)
        reserve += LIBRARY_RESERVE_BYTES
    return reserve


def resolve_max_seq_len(max_seq_len: int | None, model_limit: int) -> int:
    if max_seq_len is None:
        return model_limit
    if max_seq_len < 1 or max_seq_len > model_limit:
        raise ValueError(f"max_seq_len must be in [1, {model_limit}] (the model's context), got {max_seq_len}")
    return max_seq_len


def resolve_max_batch_size(max_batch_size: int | None, paged: bool, num_pages: int) -> int:
    if not paged:
        if max_batch_size not in (None, 1):
            raise ValueError("paged=False runs one job at a time: max_batch_size must be None or 1")
        return 1
    if max_batch_size is None:
        return max(1, min(num_pages, MAX_DERIVED_BATCH_SIZE))
    return positive_int("max_batch_size", max_batch_size)


def positive_int(name: str, value: object, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return value


def resolve_gather(value: int | None, default: int, name: str) -> int:
    """A prompt-gathering setting: the given one (an integer >= 0, 0: off), or `default`."""
    return default if value is None else positive_int(name, value, least=0)
