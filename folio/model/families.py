"""The config.json fields of the Gemma 2 / Gemma 3, Phi-3 and mixture-of-experts (Mixtral, Qwen3-MoE) families.

config.py parses what every architecture shares; `family_fields` adds the ModelConfig fields these families set,
read off transformers' configuration and modeling code (its defaults apply where config.json leaves a field out):
- Gemma 2 / 3: gelu-tanh MLP (`hidden_activation`), embeddings times sqrt(hidden_size), attention scale
  query_pre_attn_scalar**-0.5, final logit soft-capping, sliding layers from `layer_types` (else every
  `sliding_window_pattern`-th layer is global). Gemma 2 soft-caps attention logits; Gemma 3 rotates its sliding
  layers with its own base (`rope_local_base_freq`, or rope_parameters["sliding_attention"]) and scales only the
  global layers' rotary (linear).
- Phi-3 / Qwen3-MoE: `sliding_window` (Qwen3-MoE: with `use_sliding_window`) windows every layer.
- Mixtral / Qwen3-MoE: the routed experts (MoeConfig).
"""

from __future__ import annotations

from typing import Any

from folio.model import windows
from folio.model.architectures import Architecture
from folio.model.config import ConfigError, MoeConfig, NotSupportedError, RopeScaling, rope_from_params

GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
# config.json's activation name -> ModelConfig.hidden_activation
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_ABSENT = object()
# transformers' Gemma2Config / Gemma3TextConfig defaults
_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    GEMMA2: {"query_pre_attn_scalar": 256, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
             "sliding_window": 4096, "sliding_window_pattern": 2, "rope_theta": 10_000.0},
    GEMMA3: {"query_pre_attn_scalar": 256, "final_logit_softcapping": None, "attn_logit_softcapping": None,
             "sliding_window": 4096, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
             "rope_local_base_freq": 10_000.0},
}
# Qwen3MoeConfig defaults (Mixtral's: 8 experts, top 2)
_MOE_DEFAULTS = {"mixtral": (8, 2), "qwen3_moe": (128, 8)}


def family_fields(raw: dict[str, Any], arch: Architecture, num_layers: int, hidden_size: int,
                  max_position_embeddings: int) -> dict[str, Any]:
    """ModelConfig fields beyond the Llama family's. Keys "rope" ((rope_theta, rope_scaling)) and "layer_windows"
    replace what config.py derives for every architecture."""
    fields: dict[str, Any] = {"hidden_activation": _activation(raw, arch)}
    if arch.name in (GEMMA2, GEMMA3):
        fields.update(_gemma(raw, arch.name, num_layers, hidden_size, max_position_embeddings))
    elif arch.name == "Phi3ForCausalLM":
        fields["layer_windows"] = _every_layer(_window(raw.get("sliding_window")), num_layers,
                                               max_position_embeddings)
    elif arch.moe_layout == "qwen3_moe":
        # unlike Qwen3, every layer: transformers' Qwen3MoeConfig drops sliding_window without use_sliding_window
        window = _window(raw.get("sliding_window")) if raw.get("use_sliding_window") else 0
        fields["layer_windows"] = _every_layer(window, num_layers, max_position_embeddings)
    if arch.moe_layout is not None:
        fields["moe"] = _moe(raw, arch.moe_layout, num_layers)
    return fields


def _activation(raw: dict[str, Any], arch: Architecture) -> str:
    # Gemma's MLP reads hidden_activation (its configs also carry a hidden_act that transformers ignores)
    key, default = ("hidden_activation", "gelu_pytorch_tanh") if arch.sandwich_norms else ("hidden_act", "silu")
    name = raw.get(key) or default
    if name not in ACTIVATIONS:
        raise NotSupportedError(f"{key}={name!r} is not supported (supported: {', '.join(map(repr, ACTIVATIONS))})")
    return ACTIVATIONS[name]


def _gemma(raw: dict[str, Any], name: str, num_layers: int, hidden_size: int,
           max_position_embeddings: int) -> dict[str, Any]:
    defaults = _GEMMA_DEFAULTS[name]

    def get(key: str) -> Any:  # absent: transformers' default; null stays None
        value = raw.get(key, _ABSENT)
        return defaults.get(key) if value is _ABSENT else value

    if raw.get("use_bidirectional_attention"):
        raise NotSupportedError("use_bidirectional_attention=true is not supported (folio attends causally)")
    attn_softcap = _softcap(get("attn_logit_softcapping"), "attn_logit_softcapping")
    if name == GEMMA3 and attn_softcap:
        raise NotSupportedError(f"attn_logit_softcapping={attn_softcap} is not supported for Gemma 3 "
                                "(transformers' Gemma 3 attention does not apply it)")
    scalar = get("query_pre_attn_scalar")
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ConfigError(f"field 'query_pre_attn_scalar' = {scalar!r} must be a positive number")
    sliding = _sliding_layers(raw, get("sliding_window_pattern"), num_layers)
    window = _window(get("sliding_window"))
    if window >= max_position_embeddings:
        window = 0  # masks nothing within the supported context (windows.layer_windows does the same)
    fields: dict[str, Any] = {
        "embed_scale": hidden_size**0.5,
        "query_pre_attn_scalar": float(scalar),
        "final_logit_softcap": _softcap(get("final_logit_softcapping"), "final_logit_softcapping"),
        "attn_logit_softcap": attn_softcap,
        "layer_windows": tuple(window if s else 0 for s in sliding),
    }
    if name == GEMMA3:
        global_rope, local_theta = _gemma3_rope(raw, defaults, max_position_embeddings)
        fields.update(rope=global_rope, local_rope_theta=local_theta,
                      local_rope_layers=tuple(i for i, s in enumerate(sliding) if s))
    return fields


def _sliding_layers(raw: dict[str, Any], pattern: Any, num_layers: int) -> list[bool]:
    types = raw.get("layer_types")
    if types is None:
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise ConfigError(f"field 'sliding_window_pattern' = {pattern!r} must be a positive int")
        return [(i + 1) % pattern != 0 for i in range(num_layers)]
    try:
        return [t == windows.SLIDING for t in windows.check_layer_types(types, num_layers)]
    except windows.WindowConfigError as e:
        raise ConfigError(str(e)) from None


def _gemma3_rope(raw: dict[str, Any], defaults: dict[str, Any],
                 max_position_embeddings: int) -> tuple[tuple[float, RopeScaling | None], float]:
    """((theta, scaling) of the global layers, theta of the sliding ones), from transformers 5's per-layer-type
    rope_parameters or transformers 4's rope_theta + rope_scaling + rope_local_base_freq."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:
        full = {**(params or raw.get("rope_scaling") or {})}
        full.setdefault("rope_theta", raw.get("rope_theta", defaults["rope_theta"]))
        local = {"rope_theta": raw.get("rope_local_base_freq", defaults["rope_local_base_freq"])}
    theta, scaling = rope_from_params(full, max_position_embeddings, defaults["rope_theta"])
    if scaling is not None and scaling.rope_type != "linear":
        raise NotSupportedError(f"Gemma 3 rope scaling {scaling.rope_type!r} is not supported (only 'linear')")
    local_theta, local_scaling = rope_from_params(local, max_position_embeddings, defaults["rope_local_base_freq"])
    if local_scaling is not None:
        raise NotSupportedError(f"rope scaling {local_scaling.rope_type!r} of the sliding layers "
                                "(rope_parameters['sliding_attention']) is not supported")
    return (theta, scaling), local_theta


def _moe(raw: dict[str, Any], layout: str, num_layers: int) -> MoeConfig | None:
    default_experts, default_top_k = _MOE_DEFAULTS[layout]
    if layout == "mixtral":
        num_experts = _int(raw, "num_local_experts", default_experts)
        expert_size = _int(raw, "intermediate_size", None)
        norm_topk_prob = True  # Mixtral always renormalizes its top-k weights
        moe_layers = (True,) * num_layers
    else:
        experts_key = "num_experts" if "num_experts" in raw else "num_local_experts"
        num_experts = _int(raw, experts_key, default_experts, minimum=0)
        expert_size = _int(raw, "moe_intermediate_size", 768)
        norm_topk_prob = raw.get("norm_topk_prob", False)
        if not isinstance(norm_topk_prob, bool):
            raise ConfigError(f"field 'norm_topk_prob' = {norm_topk_prob!r} must be true or false")
        step = _int(raw, "decoder_sparse_step", 1)
        dense = raw.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in dense):
            raise ConfigError(f"field 'mlp_only_layers' = {dense!r} must list layer indices < {num_layers}")
        moe_layers = tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    if not any(moe_layers):
        return None
    top_k = _int(raw, "num_experts_per_tok", default_top_k)
    if top_k > num_experts:
        raise ConfigError(f"num_experts_per_tok={top_k} is more than the {num_experts} experts")
    return MoeConfig(num_experts, top_k, expert_size, norm_topk_prob, moe_layers)


def _every_layer(window: int, num_layers: int, max_position_embeddings: int) -> tuple[int, ...]:
    return (window if window < max_position_embeddings else 0,) * num_layers


def _window(value: Any) -> int:
    """`sliding_window` in tokens; null: 0 (none)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"field 'sliding_window' = {value!r} must be a positive int (or null for none)")
    return value


def _softcap(value: Any, key: str) -> float:
    """A soft-capping field: null means none (0.0)."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"field {key!r} = {value!r} must be a positive number (or null for none)")
    return float(value)


def _int(raw: dict[str, Any], key: str, default: int | None, minimum: int = 1) -> int:
    value = raw.get(key, default)
    if value is None:
        raise ConfigError(f"missing required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"field {key!r} = {value!r} must be an int >= {minimum}")
    return value
