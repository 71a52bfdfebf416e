"""Speculative decoding on a generator replica: the drafter a ServeConfig chooses (draft_model_path or ngram), loaded
once per replica beside the target, and what it adds to the GPU memory a replica sets aside.

Imports torch (through folio's engine): import it only where a model runs.
"""

from __future__ import annotations

from typing import Any

from folio import Model, activation_reserve_bytes
from folio.kv_cache import page_bytes
from folio.serve.config import ServeConfig
from folio.speculative.build import draft_graph_rows, target_graph_rows

# Device memory that speculative decoding's first verify and acceptance steps take outside torch's allocator, beside
# folio.sizing.LIBRARY_RESERVE_BYTES: the code of the kernels they launch first (loaded lazily, after the cache took
# the free memory). On an H200 a replica with n-gram drafting and a cache of all free memory ran out of memory in its
# first full-chunk forward without it.
SPECULATION_LIBRARY_BYTES = 256 << 20


def load_draft_model(config: ServeConfig, model: Model) -> Model | None:
    """The draft model of config.draft_model_path on the target's device, in its dtype, with its engine options
    (None without one). Load it before the cache is sized: its weights are then no longer free memory."""
    if config.draft_model_path is None:
        return None
    return Model.from_pretrained(config.draft_model_path, device=model.device, dtype=model.dtype, progress=False,
                                 options=model.options)


def generator_kwargs(config: ServeConfig, draft_model: Model | None) -> dict[str, Any]:
    """DynamicGenerator's speculative decoding keywords ({} without a drafter)."""
    if not config.speculative:
        return {}
    # a verify row feeds the last sampled token and every draft
    return {"draft_model": draft_model, "use_ngram_draft": config.ngram,
            "num_draft_tokens": config.num_draft_tokens, "max_q_size": 1 + config.num_draft_tokens}


def target_rows_per_step(config: ServeConfig) -> int:
    """Most rows (decode rows plus drafted tokens) a decode step of the target feeds: what its decode graphs are
    captured for (DynamicGenerator)."""
    return target_graph_rows(config.max_batch_size, config.num_draft_tokens if config.speculative else None)


def draft_reserve_bytes(config: ServeConfig, draft_model: Model) -> int:
    """The draft model's activations and decode graphs, an upper bound: a draft forward feeds up to
    draft_graph_rows rows and ingests the target's prompt chunks. Counted beside the target's although the two never
    run at once (cached blocks of one may serve the other): a safe overestimate, small for a small draft model."""
    rows = draft_graph_rows(config.max_batch_size)
    return activation_reserve_bytes(draft_model, rows, config.max_chunk_size, config.page_size)


def gpu_cache_size(config: ServeConfig, model: Model, draft_model: Model | None) -> dict[str, Any]:
    """folio.Cache's sizing keywords for the target's cache on a GPU. The generator makes the draft model's cache
    with as many pages after it, so with a draft model both caches share what the config gives the cache: a
    memory fraction is split in proportion to their page sizes, and a token count's draft pages are reserved."""
    size = config.cache_size()
    reserve = activation_reserve_bytes(model, target_rows_per_step(config), config.max_chunk_size, config.page_size,
                                       max_loras=config.lora_capacity, max_lora_rank=config.max_lora_rank)
    if config.speculative and model.device.type == "cuda":
        reserve += SPECULATION_LIBRARY_BYTES
    if draft_model is None:
        return {**size, "reserve_bytes": reserve}
    reserve += draft_reserve_bytes(config, draft_model)
    # the target's pages in its kv_format; the generator makes the draft's cache unquantized (the draft model's dtype)
    target_page_bytes = page_bytes(model, config.page_size, config.kv_format)
    draft_page_bytes = page_bytes(draft_model, config.page_size)
    if "max_memory_fraction" in size:
        # Cache takes fraction * (free - reserve) // target_page_bytes pages: scaled, both caches fit the fraction
        share = target_page_bytes / (target_page_bytes + draft_page_bytes)
        return {"max_memory_fraction": size["max_memory_fraction"] * share, "reserve_bytes": reserve}
    num_pages = size["num_tokens"] // config.page_size
    return {**size, "reserve_bytes": reserve + num_pages * draft_page_bytes}
