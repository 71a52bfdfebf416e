"""The memory and layout options of a ServeConfig (weight format, KV-cache format, host tier, tensor parallelism):
their names, checks and flag help. The names repeat folio.model.fp8_checkpoint.WEIGHT_FORMATS and folio.kv_formats'
(tests/test_serving_units.py checks they agree): the serving config imports no torch."""

from __future__ import annotations

from folio.options import TP_ALL_REDUCE_MODES  # (folio.options imports no torch)
from folio.serve.config_values import ConfigError, positive

WEIGHT_FORMATS = ("fp8", "dense")
KV_FORMATS = ("bf16", "fp16", "fp32", "fp8", "q8", "q4", "q4h")
# kv_format names of the unquantized caches, by ServeConfig.dtype: a cache in another dtype than the model's is refused
KV_FORMAT_OF_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# q4h has no CUDA kernel: only the reference ops run it, which a served replica never selects on a GPU.
CPU_ONLY_KV_FORMATS = ("q4h",)

# Help of the flags whose values a name alone does not tell (the others: ServeConfig's docstring).
FLAG_HELP = {
    "weight_format": f"projection weights: {' / '.join(WEIGHT_FORMATS)}; none keeps the checkpoint's",
    "kv_format": f"KV-cache format: {' / '.join(KV_FORMATS)}; none: the model's dtype (q8 ~1/2, q4 ~1/4 of bf16's "
                 "bytes per token; q4h CPU only)",
    "host_cache_bytes": "bytes of host memory per replica keeping evicted KV pages for prefix reuse (e.g. "
                        "68719476736 for 64 GiB); 0: off; none: a share of RAM on a GPU, off on a CPU",
    "host_write_through": "true: copy each KV page to the host tier once computed (evictions then copy nothing); "
                          "false: copy pages as they are evicted",
    "cuda_graphs": "true / false: capture decode steps in CUDA graphs; none: on for a CUDA replica",
    "tensor_parallel_size": "processes (GPUs) one replica's model is split over, on one machine; on GPUs "
                            "num_gpus must equal it",
    "tensor_parallel_all_reduce": "with tensor_parallel_size > 1: auto (through the GPUs' memory where they have "
                                  "peer access, else NCCL), peer (that, or fail at start), nccl",
    "ingress_mode": "direct: HAProxy in front of ingress replicas that serve gRPC / HTTP themselves; proxy: "
                    "Serve's proxy actors",
}


def check_tensor_parallel(config) -> None:
    """ConfigError where a ServeConfig's tensor-parallel replica does not fit: one GPU a rank (num_gpus = size; rank
    r on the replica's GPU r, so no device index), no draft model (it would run unsplit on rank 0's GPU beside its
    shard), no LoRA adapters (not split yet)."""
    size, num_gpus, device = config.tensor_parallel_size, config.num_gpus, config.resolved_device
    draft_model_path, lora = config.draft_model_path, bool(config.lora_adapters or config.lora_admin)
    positive("tensor_parallel_size", size)
    all_reduce = config.tensor_parallel_all_reduce
    if all_reduce not in TP_ALL_REDUCE_MODES:
        raise ConfigError(f"tensor_parallel_all_reduce: must be one of {', '.join(TP_ALL_REDUCE_MODES)}, "
                          f"got {all_reduce!r}")
    if size == 1:
        if all_reduce != "auto":
            raise ConfigError(f"tensor_parallel_all_reduce: {all_reduce} applies to tensor_parallel_size > 1 only")
        return
    if device.startswith("cuda:"):
        raise ConfigError(f"tensor_parallel_size: rank r runs on the replica's GPU r; device {device} names one GPU "
                          "(use cuda or auto)")
    if lora:
        raise ConfigError("tensor_parallel_size: LoRA adapters are not supported with tensor parallelism yet")
    if device != "cpu" and num_gpus != size:
        raise ConfigError(f"tensor_parallel_size: {size} ranks take one GPU each: set num_gpus {size} (got {num_gpus})")
    if draft_model_path is not None:
        raise ConfigError("tensor_parallel_size: a draft model is not supported with tensor parallelism yet "
                          "(n-gram drafting is)")


def check_memory_formats(weight_format: str | None, kv_format: str | None, dtype: str | None, device: str,
                         host_cache_bytes: int | None) -> None:
    """ConfigError naming the field where a value is unknown or does not fit the others."""
    if weight_format is not None and weight_format not in WEIGHT_FORMATS:
        raise ConfigError(f"weight_format: must be one of {', '.join(WEIGHT_FORMATS)} (or unset: the "
                          f"checkpoint's format), got {weight_format!r}")
    if kv_format is not None and kv_format not in KV_FORMATS:
        raise ConfigError(f"kv_format: must be one of {', '.join(KV_FORMATS)} (or unset: the model's dtype), "
                          f"got {kv_format!r}")
    if dtype is not None and kv_format in KV_FORMAT_OF_DTYPE.values() and kv_format != KV_FORMAT_OF_DTYPE[dtype]:
        raise ConfigError(f"kv_format: an unquantized cache holds the model's dtype ({dtype}: "
                          f"{KV_FORMAT_OF_DTYPE[dtype]}), got {kv_format!r}")
    if kv_format in CPU_ONLY_KV_FORMATS and device != "cpu":
        raise ConfigError(f"kv_format: {kv_format} has no CUDA kernel (CPU replicas only); use q4 on a GPU")
    if host_cache_bytes is not None:
        positive("host_cache_bytes", host_cache_bytes, allow_zero=True)


def check_adapters(config) -> None:
    """ConfigError where a ServeConfig's static LoRA adapters are misnamed, lack a directory or exceed max_loras."""
    from folio.serve.adapters import ADAPTER_NAME

    adapters = config.lora_adapters or {}
    for name, path in adapters.items():
        if not ADAPTER_NAME.fullmatch(name):
            raise ConfigError(f"lora_adapters: {name!r} is not an adapter name (1-64 letters, digits, '.', '_', '-')")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"lora_adapters: {name}: must be an adapter directory, got {path!r}")
    if len(adapters) > config.max_loras:
        raise ConfigError(f"lora_adapters: {len(adapters)} adapters, more than max_loras ({config.max_loras})")
