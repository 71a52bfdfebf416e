"""Tiny random Hugging Face models of each supported architecture, saved as safetensors for tests.

Weights are drawn with a larger spread than transformers' init (which makes attention nearly uniform and zeroes
biases and norm offsets) so that a wrong bias, norm or rotary shows up in the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}

TINY_SIZES: dict[str, Any] = dict(
    num_hidden_layers=3,
    hidden_size=96,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=250,  # deliberately not a multiple of 32
    intermediate_size=160,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
# Gemma: windows no shorter than max_position_embeddings (tests that shorten them say so), soft-caps small enough
# to bite at these sizes, an attention scalar other than head_dim, and (Gemma 3) a local rotary base and linear
# scaling of the global layers that differ.
GEMMA_COMMON: dict[str, Any] = dict(sliding_window=512, query_pre_attn_scalar=24, final_logit_softcapping=5.0,
                                    pad_token_id=0)
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": None},  # MistralConfig defaults to a 4096 window
    "gemma2": {**GEMMA_COMMON, "attn_logit_softcapping": 8.0},
    "gemma3": {**GEMMA_COMMON, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
               "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}},
    "phi3": {"pad_token_id": 0},  # Phi3Config's default pad id is past the tiny vocabulary
    "mixtral": {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True,
                  "mlp_only_layers": [1]},
}

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so that the tiny head_dim has low, medium and high frequency bands
    "original_max_position_embeddings": 64,
}


def build_hf_model(arch: str, dtype: torch.dtype = torch.float32, tie: bool = False, seed: int = 0,
                   **overrides: Any) -> transformers.PreTrainedModel:
    config_name, model_name = ARCHS[arch]
    settings = {**TINY_SIZES, **ARCH_DEFAULTS.get(arch, {}), "tie_word_embeddings": tie, **overrides}
    config = getattr(transformers, config_name)(**settings)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    _randomize(model, seed)
    model = model.to(dtype)
    model.config.dtype = dtype
    model.config.architectures = [model_name]  # save_pretrained adds it; set it for config-only saves too
    return model


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("mlp.gate.weight"):
                param.copy_(noise)  # routers: clear top-k choices, no near-ties that rounding could flip
            elif name.endswith(".bias"):
                param.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(0.12 * noise)


def make_hf_model(path: str | Path, arch: str, dtype: torch.dtype = torch.float32, tie: bool = False, *,
                  seed: int = 0, max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Save a tiny random model of `arch` (a key of ARCHS) to `path`; returns the path.

    overrides replace config fields (e.g. rope_parameters=LLAMA3_ROPE); max_shard_size saves a sharded checkpoint.
    """
    path = Path(path)
    model = build_hf_model(arch, dtype, tie, seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def make_sharded_hf_model(path: str | Path, arch: str, max_shard_size: str = "40KB", **kwargs: Any) -> Path:
    """Like make_hf_model, saved as several shards with a model.safetensors.index.json."""
    return make_hf_model(path, arch, max_shard_size=max_shard_size, **kwargs)


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.no_grad()
def hf_logits(model: transformers.PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(token_ids), vocab] of one sequence run whole (causal: row p depends on tokens 0..p)."""
    ids = torch.tensor([token_ids], dtype=torch.int64)
    return model(input_ids=ids).logits[0].float()


def nan_cache(model, num_pages: int, page_size: int):
    """A folio Cache of num_pages pages filled with NaN: a slot read before it was written shows in the logits."""
    from folio.kv_cache import Cache

    cache = Cache(model, num_tokens=num_pages * page_size, page_size=page_size)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    return cache


def run_chunks(model, cache, chunks) -> torch.Tensor:
    """One forward of `chunks` (folio.model.batch.SeqChunk) over `cache`: the logits rows they ask for."""
    from folio.model.batch import ForwardBatch

    return model.forward(ForwardBatch.build(chunks, cache.page_size, model.device), cache)
