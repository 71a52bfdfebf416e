"""A replica's engine objects from its ServeConfig: the model (and draft model), tokenizer, KV cache and generator.
Imports torch (through folio's engine).

tensor_parallel_size N > 1: this process is rank 0 (its generator serves the requests) and N - 1 processes it starts
on this machine hold the other shards (folio.tp_launch.start_local_ranks), rank r on the replica's GPU r; the cache's
mirror (Cache.mirror) runs every forward on them too, and `close_tensor_parallel(cache)` ends them. CUDA graphs are
off there unless the config asks for them (cuda_graphs: true): every rank captures in lockstep
(folio.model.decode_graphs), and a replica whose capture fails does not start."""

from __future__ import annotations

import torch

from folio import Cache, DynamicGenerator, Model, Tokenizer, tp_launch
from folio.options import EngineOptions
from folio.serve import speculation
from folio.serve.config import ServeConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_model(config: ServeConfig, ranks: tp_launch.LocalRanks | None = None) -> Model:
    """The replica's model; ranks: rank 0's shard of it (the other ranks load theirs)."""
    device = config.resolved_device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device} requested but torch sees no CUDA device "
                           f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
    return Model.from_pretrained(config.model_path, progress=False, **_model_kwargs(config),
                                 tensor_parallel=None if ranks is None else ranks.tp)


def _model_kwargs(config: ServeConfig) -> dict:
    dtype = _DTYPES[config.dtype] if config.dtype is not None else None
    options = EngineOptions(tp_all_reduce=config.tensor_parallel_all_reduce)  # (the same on every rank)
    return {"device": config.resolved_device, "dtype": dtype, "weight_format": config.weight_format, "options": options}


def close_tensor_parallel(cache: Cache) -> None:
    """End a tensor-parallel replica's other ranks (nothing for one process)."""
    ranks = getattr(cache.mirror, "local_ranks", None)
    if ranks is not None:
        ranks.close()


def build_generator(config: ServeConfig, max_queued_jobs: int | None = -1
                    ) -> tuple[Model, Model | None, Tokenizer, Cache, DynamicGenerator]:
    """A replica's model (and draft model), tokenizer, cache and generator, as the config says (no adapters, no
    warm-up, no engine thread: Engine.build adds those). max_queued_jobs -1: the replica's, max_ongoing_requests."""
    ranks = None
    if config.tensor_parallel_size > 1:
        ranks = tp_launch.start_local_ranks(config.model_path, config.tensor_parallel_size, _model_kwargs(config))
    try:
        return _build(config, max_queued_jobs, ranks)
    except BaseException:
        if ranks is not None:  # (the other ranks' processes, GPU memory and process group go too)
            ranks.close(grace_s=0.0)
        raise


def _build(config: ServeConfig, max_queued_jobs: int | None, ranks: tp_launch.LocalRanks | None
           ) -> tuple[Model, Model | None, Tokenizer, Cache, DynamicGenerator]:
    model = load_model(config, ranks)
    if ranks is not None:
        ranks.wait_ready()
    draft_model = speculation.load_draft_model(config, model)
    tokenizer = Tokenizer.from_pretrained(config.model_path)
    cache_size = config.cache_size()
    if model.device.type == "cuda":
        # leave room for the largest step's activations, the decode graphs and the draft model's cache (or fail
        # here, with the numbers)
        cache_size = speculation.gpu_cache_size(config, model, draft_model)
    cache = Cache(model, page_size=config.page_size, kv_format=config.kv_format, **cache_size)
    if ranks is not None:
        ranks.attach(cache)
    generator = DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer,
                                 max_batch_size=config.max_batch_size, max_seq_len=config.max_seq_len,
                                 max_chunk_size=config.max_chunk_size, gather_prompt_rows=config.gather_prompt_rows,
                                 gather_prompt_steps=config.gather_prompt_steps,
                                 # Serve sends a replica at most max_batch_size + max_queue_size requests; jobs
                                 # wait in the engine's queue until a step takes them in, even with free rows,
                                 # so the queue holds them all: the engine never refuses what was admitted.
                                 max_queued_jobs=config.max_ongoing_requests if max_queued_jobs == -1
                                 else max_queued_jobs,
                                 max_loras=max(1, config.lora_capacity), max_lora_rank=config.max_lora_rank,
                                 host_cache_bytes=config.host_cache_bytes,
                                 host_write_through=config.host_write_through,
                                 cuda_graphs=config.cuda_graphs,
                                 **speculation.generator_kwargs(config, draft_model))
    return model, draft_model, tokenizer, cache, generator
