"""A replica's engine objects from its ServeConfig: the model (and draft model), tokenizer, KV cache and generator.
Imports torch (through folio's engine)."""

from __future__ import annotations

import torch

from folio import Cache, DynamicGenerator, Model, Tokenizer
from folio.serve import speculation
from folio.serve.config import ServeConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_model(config: ServeConfig) -> Model:
    device = config.resolved_device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device} requested but torch sees no CUDA device "
                           f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
    dtype = _DTYPES[config.dtype] if config.dtype is not None else None
    return Model.from_pretrained(config.model_path, device=device, dtype=dtype, progress=False,
                                 weight_format=config.weight_format)


def build_generator(config: ServeConfig, max_queued_jobs: int | None = -1
                    ) -> tuple[Model, Model | None, Tokenizer, Cache, DynamicGenerator]:
    """A replica's model (and draft model), tokenizer, cache and generator, as the config says (no adapters, no
    warm-up, no engine thread: Engine.build adds those). max_queued_jobs -1: the replica's, max_ongoing_requests."""
    model = load_model(config)
    draft_model = speculation.load_draft_model(config, model)
    tokenizer = Tokenizer.from_pretrained(config.model_path)
    cache_size = config.cache_size()
    if model.device.type == "cuda":
        # leave room for the largest step's activations, the decode graphs and the draft model's cache (or fail
        # here, with the numbers)
        cache_size = speculation.gpu_cache_size(config, model, draft_model)
    cache = Cache(model, page_size=config.page_size, kv_format=config.kv_format, **cache_size)
    generator = DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer,
                                 max_batch_size=config.max_batch_size, max_seq_len=config.max_seq_len,
                                 max_chunk_size=config.max_chunk_size,
                                 # Serve sends a replica at most max_batch_size + max_queue_size requests; jobs
                                 # wait in the engine's queue until a step takes them in, even with free rows,
                                 # so the queue holds them all: the engine never refuses what was admitted.
                                 max_queued_jobs=config.max_ongoing_requests if max_queued_jobs == -1
                                 else max_queued_jobs,
                                 max_loras=max(1, config.lora_capacity), max_lora_rank=config.max_lora_rank,
                                 host_cache_bytes=config.host_cache_bytes,
                                 **speculation.generator_kwargs(config, draft_model))
    return model, draft_model, tokenizer, cache, generator
