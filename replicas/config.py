"""ServeConfig: everything a folio deployment is configured by, in one frozen dataclass validated at the edge.

Load it from a dict (`serve run folio.serve.app:build_app key=value ...` passes strings, YAML passes typed values),
a YAML file, or command-line flags (`add_arguments` / `from_args`; files and flags are read by
folio.serve.config_sources). Values known only at run time (the number of cache pages a GPU's free memory holds, the
derived batch size) are not here: each replica reports them (ModelInfo). This module imports neither Ray nor torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from folio.serve import config_sources
from folio.serve.config_formats import (  # noqa: F401 (KV_FORMAT_OF_DTYPE, KV_FORMATS, WEIGHT_FORMATS re-exported)
    KV_FORMAT_OF_DTYPE,
    KV_FORMATS,
    WEIGHT_FORMATS,
    check_adapters,
    check_memory_formats,
    check_tensor_parallel,
)
from folio.serve.config_values import ConfigError, check_type, convert, positive
from folio.serve.ingress_mode import INGRESS_MODES

DTYPES, ROUTERS = ("float32", "float16", "bfloat16"), ("prefix", "pow2", "ray_prefix")
MIN_PAGE_SIZE = 16
DEFAULT_CPU_CACHE_TOKENS = 16384  # a CPU's cache (tests, the demo), in tokens, when neither size is given
DEFAULT_GPU_MEMORY_FRACTION = 0.85  # the share of a GPU's free memory the cache takes when neither size is given


@dataclass(frozen=True)
class ServeConfig:
    """A folio deployment: the model, each generator replica's engine, the Serve deployments, the ports.

    model_path: Hugging Face model directory (config.json, safetensors, tokenizer.json), readable on every node.
    device: "auto" (cuda when num_gpus > 0, else cpu), "cpu" or "cuda".
    dtype: float32 / float16 / bfloat16; None keeps the checkpoint's.
    draft_model_path / ngram: the speculative decoding drafter, at most one: a draft model directory (a smaller model
        with the target's vocabulary, loaded on each replica beside the target with the target's device and dtype,
        readable on every node), or n-grams of each request's own tokens (ngram: true). Neither: no speculation.
        The target verifies every draft (exact rejection sampling): completions keep the target's distribution.
    num_draft_tokens: most tokens drafted per sequence and step (each sequence's draft length adapts to how many of
        its drafts the target accepts).
    cache_tokens / cache_memory_fraction: KV-cache size per replica, in tokens (a multiple of page_size) or as a
        share of the GPU's free memory; at most one. Neither: 0.85 of free memory on a GPU, 16384 tokens on a CPU.
        On a GPU the largest step's activations are set aside first (folio.activation_reserve_bytes, from
        max_chunk_size and max_batch_size); a cache_tokens that leaves too little for them fails at start-up.
    page_size: tokens per KV-cache page (a power of two >= 16); also the prefix-sharing granularity.
    weight_format: the projections' weights: "fp8" (quantized per output channel on load: half a bf16 model's
        memory), "dense" (an FP8 checkpoint dequantized to dtype); None keeps the checkpoint's (FP8 checkpoints
        load as FP8). folio.model.fp8_checkpoint.
    kv_format: what the KV cache holds (folio.kv_formats): the model's dtype by name ("bf16", "fp16", "fp32"), or
        quantized codes with per-group scales: "fp8", "q8" (about half the bytes of bf16), "q4" (about a quarter),
        "q4h" (q4 after a Hadamard rotation; CPU replicas only). None: the model's dtype. A memory-sized cache
        (cache_memory_fraction) gets as many more pages as the format saves; cache_tokens stays a token count.
    host_cache_bytes: host memory each replica keeps pages evicted from its KV cache in, copied back on a prefix
        hit instead of computed again (folio.host_pages; pinned on a GPU). None: on a GPU a share of the node's RAM
        (folio.host_pages.DEFAULT_HOST_RAM_FRACTION, at most twice the GPU cache; set it when several replicas
        share a node), none on a CPU; 0: no host tier. host_write_through: copy every page to the host tier once
        computed, beside the steps that follow, so that evicting it costs no copy (false, the default: pages are
        copied as they are evicted; it measured faster, bench/host_tier.py).
    max_batch_size: sequences one replica runs at once. cuda_graphs: capture decode steps in CUDA graphs (None: on
        for a CUDA replica, under tensor parallelism too: every rank captures in lockstep).
    max_chunk_size: prompt tokens ingested per step (None: the engine's default); a multiple of page_size.
    gather_prompt_rows, gather_prompt_steps: DynamicGenerator's (None: its defaults; 0: off).
    max_seq_len: longest prompt + max_new_tokens of a request (None: the model's context).
    max_queue_size: requests waiting inside one replica's engine; beyond it the request fails RESOURCE_EXHAUSTED.
    admission_limit: requests the application sends to its generator replicas at once, over all its ingress
        replicas (each sends its share). None: what the replicas take, num_replicas x (max_batch_size +
        max_queue_size). Set it when the generator deployment autoscales (its capacity at the most replicas).
    max_queued_requests: requests waiting at the ingress (a FIFO queue, each ingress replica its share) for one of
        those slots; one more is refused at once with RESOURCE_EXHAUSTED and a retry hint, before it is tokenized.
        None: one replica's worth (max_batch_size + max_queue_size); 0: refuse whatever finds no slot.
    max_prompt_bytes: the longest text prompt (or negative prompt) in UTF-8 bytes, checked before tokenizing; None:
        what could still fit the context (its tokens x the vocabulary's longest token).
    max_stop_strings / max_stop_string_chars: most stop strings a request may give, and the longest one (each
        costs engine time per token); max_list_items: most entries of every other list field of a request.
    max_stream_messages_per_s: messages one replica streams per second over all its requests (folio.serve.pacing:
        with many streams open, each gets fewer messages carrying more tokens); 0: one per step with new tokens.
    num_replicas / num_gpus / num_cpus: generator replicas, and each one's Ray resources (fractions allowed;
        num_gpus 0 runs on the CPU); tensor_parallel_size: processes one replica's model is split over;
        tensor_parallel_all_reduce: how they sum their partial outputs, EngineOptions.tp_all_reduce ("auto": through
        the GPUs' memory where they have peer access, else NCCL; "peer": that or fail; "nccl").
    ingress_replicas / ingress_num_cpus: the CPU ingress deployment.
    token_channel: replicas send streamed chunks to the ingress over TCP (folio.serve.token_channel), else via Ray.
    ingress_mode: "direct" (clients reach the ingress replicas through HAProxy) or "proxy" (through Serve's proxy
        actors); folio.serve.ingress_mode. Set where the cluster starts: a cluster `folio serve` starts gets it; on
        others their environment decides (cluster.yaml, the Helm chart), and an ingress that differs logs it.
    grpc_port / http_port / http_host: where Serve listens (HAProxy, or its proxies). On a cluster `folio serve`
        starts, both bind http_host; elsewhere (`serve deploy`, KubeRay) Serve's gRPC servers bind every interface.
    app_name: the Serve application (gRPC clients send it as the "application" metadata when several are deployed).
    stall_timeout_s: a replica whose engine made no progress for this long while it had work fails its health check.
    health_check_period_s, graceful_shutdown_timeout_s: Serve's; shutdown lets in-flight requests finish this long.
    request_timeout_s: end-to-end limit Serve puts on a gRPC request, in either ingress mode (None: none).
    routing_block_tokens: tokens between two routing keys a replica reports to routers (folio.router.events): the
        granularity at which routers match prompts, whatever the page size.
    router: how the generator deployment's callers pick a replica: "prefix" (folio.router.ray_router's prefix-aware
        router), "pow2" (Ray Serve's default power of two choices) or "ray_prefix" (Ray's PrefixCacheAffinityRouter,
        text-based); the last two are baselines for bench/routing.py.
    router_options: extra keyword arguments of the router's initialize_state: folio.router.policy.PolicyConfig's fields
        for "prefix" (shortlist_size, routed_ttl_s, ...), PrefixCacheAffinityRouter's for "ray_prefix"
        (imbalanced_threshold, ...). A JSON object where options are strings.
    routing_stats_period_s / routing_stats_timeout_s: how often Serve polls each replica's record_routing_stats
        (the digest routers rank by), and how long one poll may take.
    warmup: run a short generation when a replica starts.
    lora_adapters: LoRA adapters every replica loads at start, {name: PEFT adapter directory} (readable on every
        node); requests name one in their `lora` field. ListLoras lists these and those loaded at run time.
    lora_admin: allow the admin RPCs LoadLora / UnloadLora (load or drop adapters while serving). Off by default:
        a client that may call them can make every replica read a path of its choosing.
    max_loras / max_lora_rank: most adapters loaded at once (config and run time together; LoadLora beyond it
        fails RESOURCE_EXHAUSTED) and their largest rank. A replica that may load adapters (lora_adapters set, or
        lora_admin) sets aside max_loras x max_lora_rank slots of every projection's factors beside its cache:
        captured decode steps apply adapters from them, and cost grows with that capacity, not with use.
    max_embedding_bytes: the most bytes of injected embeddings one request may carry (all its payloads). gRPC's
        own message limit (4 MiB by default in Serve's proxy) may refuse a large request first.
    max_constraint_chars: the largest constraint a request may carry, in characters: its response_format (JSON
        Schema text, pattern, grammar, or all its choices) and its banned_strings together. Larger ones fail with
        INVALID_ARGUMENT at the ingress, before a replica spends time compiling them.
    """

    model_path: str = "demo-model"
    device: str = "auto"
    dtype: str | None = None
    draft_model_path: str | None = None
    ngram: bool = False
    num_draft_tokens: int = 4
    cache_tokens: int | None = None
    cache_memory_fraction: float | None = None
    page_size: int = 256
    weight_format: str | None = None
    kv_format: str | None = None
    host_cache_bytes: int | None = None
    host_write_through: bool = False
    max_batch_size: int = 64
    cuda_graphs: bool | None = None
    max_chunk_size: int | None = None
    gather_prompt_rows: int | None = None
    gather_prompt_steps: int | None = None
    max_seq_len: int | None = None
    max_queue_size: int = 64
    max_queued_requests: int | None = None
    admission_limit: int | None = None
    max_prompt_bytes: int | None = None
    max_stop_strings: int = 32
    max_stop_string_chars: int = 256
    max_list_items: int = 1024
    max_stream_messages_per_s: float = 500.0
    num_replicas: int = 1
    num_gpus: float = 1.0
    num_cpus: float = 1.0
    tensor_parallel_size: int = 1
    tensor_parallel_all_reduce: str = "auto"
    ingress_replicas: int = 1
    ingress_num_cpus: float = 0.25
    token_channel: bool = True
    ingress_mode: str = "direct"
    grpc_port: int = 50051
    http_port: int = 8000
    http_host: str = "127.0.0.1"
    app_name: str = "folio"
    stall_timeout_s: float = 60.0
    health_check_period_s: float = 10.0
    graceful_shutdown_timeout_s: float = 60.0
    request_timeout_s: float | None = None
    routing_block_tokens: int = 256
    router: str = "prefix"
    router_options: dict | None = None
    routing_stats_period_s: float = 1.0
    routing_stats_timeout_s: float = 5.0
    warmup: bool = True
    max_constraint_chars: int = 65536
    lora_adapters: dict | None = None
    lora_admin: bool = False
    max_loras: int = 8
    max_lora_rank: int = 16
    max_embedding_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check_type(field.name, getattr(self, field.name), _field_types()[field.name])
        self._check_model()
        self._check_drafter()
        self._check_engine()
        self._check_deployment()

    # --- validation ---

    def _check_model(self) -> None:
        if not self.model_path:
            raise ConfigError("model_path: must name a model directory")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device: must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"dtype: must be one of {', '.join(DTYPES)} (or unset), got {self.dtype!r}")
        if self.device == "cpu" and self.num_gpus > 0:
            raise ConfigError("device: cpu with num_gpus > 0 would hold GPUs the replica never uses; set num_gpus 0")
        if self.device.startswith("cuda") and self.num_gpus == 0:
            raise ConfigError(f"device: {self.device} needs num_gpus > 0")
        check_tensor_parallel(self)

    def _check_drafter(self) -> None:
        if self.draft_model_path is not None and not self.draft_model_path:
            raise ConfigError("draft_model_path: must name a model directory, or be unset for no draft model")
        if self.draft_model_path is not None and self.ngram:
            raise ConfigError("draft_model_path / ngram: choose one drafter (a draft model, or n-grams of each "
                              "request's own tokens), not both")
        positive("num_draft_tokens", self.num_draft_tokens)

    def _check_engine(self) -> None:
        if self.page_size < MIN_PAGE_SIZE or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size: must be a power of two >= {MIN_PAGE_SIZE}, got {self.page_size}")
        if self.cache_tokens is not None and self.cache_memory_fraction is not None:
            raise ConfigError("cache_tokens / cache_memory_fraction: give at most one")
        if self.cache_tokens is not None and (self.cache_tokens <= 0 or self.cache_tokens % self.page_size):
            raise ConfigError(f"cache_tokens: must be a positive multiple of page_size ({self.page_size}), "
                              f"got {self.cache_tokens}")
        if self.cache_memory_fraction is not None and not 0 < self.cache_memory_fraction <= 1:
            raise ConfigError(f"cache_memory_fraction: must be in (0, 1], got {self.cache_memory_fraction}")
        if self.cache_memory_fraction is not None and self.resolved_device == "cpu":
            raise ConfigError("cache_memory_fraction: only for GPU replicas; give cache_tokens on a CPU")
        check_memory_formats(self.weight_format, self.kv_format, self.dtype, self.resolved_device,
                             self.host_cache_bytes)
        positive("max_batch_size", self.max_batch_size)
        if self.max_chunk_size is not None and (self.max_chunk_size <= 0 or self.max_chunk_size % self.page_size):
            raise ConfigError(f"max_chunk_size: must be a positive multiple of page_size ({self.page_size}), "
                              f"got {self.max_chunk_size}")
        for name in ("gather_prompt_rows", "gather_prompt_steps", "max_seq_len"):
            if getattr(self, name) is not None:
                positive(name, getattr(self, name), allow_zero=name != "max_seq_len")
        positive("max_queue_size", self.max_queue_size)
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ConfigError(f"max_queued_requests: must be >= 0 (or unset: one replica's worth), got "
                              f"{self.max_queued_requests}; there is no unbounded queue")
        for name in ("admission_limit", "max_prompt_bytes"):
            if getattr(self, name) is not None:
                positive(name, getattr(self, name))
        for name in ("max_stop_strings", "max_stop_string_chars", "max_list_items", "routing_block_tokens",
                     "routing_stats_period_s", "routing_stats_timeout_s", "max_constraint_chars",
                     "max_embedding_bytes", "max_loras", "max_lora_rank"):
            positive(name, getattr(self, name))
        if self.max_stream_messages_per_s < 0:
            raise ConfigError(f"max_stream_messages_per_s: must be >= 0 (0: no bound), got "
                              f"{self.max_stream_messages_per_s}")
        if self.router not in ROUTERS:
            raise ConfigError(f"router: must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.router_options is not None and not all(isinstance(k, str) for k in self.router_options):
            raise ConfigError("router_options: keys must be option names (strings)")
        check_adapters(self)

    def _check_deployment(self) -> None:
        for name in ("num_gpus", "num_cpus", "ingress_num_cpus"):
            positive(name, getattr(self, name), allow_zero=True)
        if self.num_gpus > 1 and self.num_gpus != int(self.num_gpus):
            raise ConfigError(f"num_gpus: above 1 it must be a whole number, got {self.num_gpus}")
        for name, port in (("grpc_port", self.grpc_port), ("http_port", self.http_port)):
            if not 1 <= port <= 65535:
                raise ConfigError(f"{name}: must be in [1, 65535], got {port}")
        if self.grpc_port == self.http_port:
            raise ConfigError(f"grpc_port / http_port: both are {self.grpc_port}")
        if self.ingress_mode not in INGRESS_MODES:
            raise ConfigError(f"ingress_mode: must be one of {', '.join(INGRESS_MODES)}, got {self.ingress_mode!r}")
        if not self.app_name or "/" in self.app_name:
            raise ConfigError(f"app_name: must be a non-empty name without '/', got {self.app_name!r}")
        for name in ("num_replicas", "ingress_replicas", "stall_timeout_s", "health_check_period_s",
                     "graceful_shutdown_timeout_s"):
            positive(name, getattr(self, name))
        if self.request_timeout_s is not None:
            positive("request_timeout_s", self.request_timeout_s)

    # --- derived values ---

    @property
    def speculative(self) -> bool:
        """Whether replicas draft tokens for the target to verify."""
        return self.ngram or self.draft_model_path is not None

    @property
    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if self.num_gpus > 0 else "cpu"
        return self.device

    @property
    def lora_capacity(self) -> int:
        """Adapters a replica makes room for: max_loras where adapters may be loaded at all, else 0."""
        return self.max_loras if (self.lora_adapters or self.lora_admin) else 0

    @property
    def max_ongoing_requests(self) -> int:
        """Requests one generator replica takes at once: a full batch plus a full engine queue."""
        return self.max_batch_size + self.max_queue_size

    @property
    def queued_requests(self) -> int:
        """max_queued_requests, resolved."""
        return self.max_ongoing_requests if self.max_queued_requests is None else self.max_queued_requests

    @property
    def resolved_admission_limit(self) -> int:
        """Requests the application sends to its generator replicas at once (over all ingress replicas)."""
        if self.admission_limit is not None:
            return self.admission_limit
        return self.num_replicas * self.max_ongoing_requests

    @property
    def ingress_admission_limit(self) -> int:
        """One ingress replica's share of the admission limit."""
        return max(1, math.ceil(self.resolved_admission_limit / self.ingress_replicas))

    @property
    def ingress_queue_limit(self) -> int:
        """One ingress replica's share of max_queued_requests."""
        return math.ceil(self.queued_requests / self.ingress_replicas)

    def cache_size(self) -> dict[str, Any]:
        """folio.Cache's sizing keyword: num_tokens or max_memory_fraction."""
        if self.cache_tokens is not None:
            return {"num_tokens": self.cache_tokens}
        if self.cache_memory_fraction is not None:
            return {"max_memory_fraction": self.cache_memory_fraction}
        if self.resolved_device == "cpu":
            return {"num_tokens": max(self.page_size, DEFAULT_CPU_CACHE_TOKENS // self.page_size * self.page_size)}
        return {"max_memory_fraction": DEFAULT_GPU_MEMORY_FRACTION}

    def replace(self, **changes: Any) -> ServeConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # --- loading ---

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ServeConfig:
        """Build from a mapping; strings are converted to each option's type ("4096", "true", "none")."""
        if not isinstance(values, Mapping):
            raise ConfigError(f"a folio config is a mapping of options, got {type(values).__name__}")
        types_ = _field_types()
        unknown = sorted(set(values) - set(types_))
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(map(repr, unknown))}; known: {', '.join(types_)}")
        return cls(**{name: convert(name, value, types_[name]) for name, value in values.items()})

    @classmethod
    def from_yaml(cls, path: str | Path) -> ServeConfig:
        try:
            return cls.from_dict(config_sources.read_yaml(path))
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None) -> None:
        """One flag per option plus --config FILE (folio.serve.config_sources); `defaults`: the caller's, shown in
        the help, as from_args applies them."""
        config_sources.add_arguments(ServeConfig, parser, defaults or {})

    @classmethod
    def from_args(cls, args: argparse.Namespace, **defaults: Any) -> ServeConfig:
        """Defaults (the caller's), then the --config file, then the flags given."""
        config = getattr(args, "config", None)
        file_values = cls.from_yaml(config).explicit_values() if config is not None else {}
        return cls.from_dict(config_sources.layered(cls, args, file_values, defaults))

    def explicit_values(self) -> dict[str, Any]:
        """Options that differ from the defaults."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}


@functools.cache
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(ServeConfig)
