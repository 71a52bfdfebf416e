"""ModelConfig: the frozen, validated view of a Hugging Face model directory's config.json.

Only what the forward pass needs is kept. Anything in the config that would change the model's output and that we
do not implement (other rope scalings, MLP biases, other activations) raises NotSupportedError instead of being
ignored. Sliding windows become one window per layer (folio.model.windows).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from folio.model import windows
from folio.model.architectures import ARCHITECTURES, SUPPORTED_ARCHITECTURES

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# transformers' own default when a config names no rope_theta
_DEFAULT_ROPE_THETA = 10000.0


class ConfigError(ValueError):
    """config.json is malformed or inconsistent."""


class NotSupportedError(ValueError):
    """The model uses a feature that folio does not implement."""


@dataclass(frozen=True)
class RopeScaling:
    """Rope frequency scaling: "linear" (every frequency divided by factor) or Llama 3's "llama3" (the fields
    after factor are llama3's)."""

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class MoeConfig:
    """Routed experts (Mixtral, Qwen3-MoE; folio.model.moe): each token's MLP is the routing-weighted sum of the
    num_experts_per_tok experts whose router probabilities (softmax over num_experts) are highest."""

    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    norm_topk_prob: bool  # the top-k weights are divided by their sum
    layers: tuple[bool, ...]  # per layer: routed experts (True) or the dense MLP of intermediate_size


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections have a bias
    o_proj_bias: bool  # the output projection has a bias (Llama/Qwen3 attention_bias=True; never Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before rotary (Qwen3)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: torch.dtype  # the checkpoint's dtype; float32 when the config names none (transformers' default)
    # Sliding-window attention (folio.model.windows): one window per layer in tokens, 0 = the whole context.
    # Empty (the default for configs built in code): every layer attends to the whole context.
    layer_windows: tuple[int, ...] = ()
    # Gemma 2's attention logit soft-capping: each score s becomes softcap * tanh(s / softcap); 0.0 = none.
    attn_logit_softcap: float = 0.0
    # Model families (folio.model.families; the defaults are the Llama family's)
    hidden_activation: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh"
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden_size), in the model dtype
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale query_pre_attn_scalar**-0.5 (None: head_dim)
    final_logit_softcap: float = 0.0  # Gemma: logits become cap * tanh(logits / cap); 0.0 = none
    local_rope_theta: float | None = None  # Gemma 3: rotary base of local_rope_layers, unscaled
    local_rope_layers: tuple[int, ...] = ()
    moe: MoeConfig | None = None

    def __post_init__(self) -> None:
        try:
            layer_windows = windows.check_windows(self.layer_windows or (0,) * self.num_layers, self.num_layers)
        except windows.WindowConfigError as e:
            raise ConfigError(str(e)) from None
        object.__setattr__(self, "layer_windows", layer_windows)
        if not (self.attn_logit_softcap >= 0.0 and self.attn_logit_softcap != float("inf")):
            raise ConfigError(f"attn_logit_softcap={self.attn_logit_softcap!r} must be finite and >= 0 (0: none)")

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        config_path = model_dir / CONFIG_FILE
        if not config_path.is_file():
            raise FileNotFoundError(f"no {CONFIG_FILE} in model directory {model_dir}")
        raw = _read_json(config_path)
        generation_path = model_dir / GENERATION_CONFIG_FILE
        generation = _read_json(generation_path) if generation_path.is_file() else {}
        try:
            return cls.from_dict(raw, generation)
        except (ConfigError, NotSupportedError) as e:
            raise type(e)(f"{config_path}: {e}") from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        """Parse config.json's contents (and generation_config.json's, for eos/bos ids)."""
        generation = generation or {}
        architecture = _architecture(raw)
        arch = ARCHITECTURES[architecture]
        num_layers = _required(raw, "num_hidden_layers", int)
        hidden_size = _required(raw, "hidden_size", int)
        num_q_heads = _required(raw, "num_attention_heads", int)
        num_kv_heads = _optional(raw, "num_key_value_heads", int) or num_q_heads
        if num_q_heads % num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={num_q_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        head_dim = _optional(raw, "head_dim", int)
        if head_dim is None:
            if hidden_size % num_q_heads:
                raise ConfigError(
                    f"no head_dim and hidden_size={hidden_size} is not a multiple of "
                    f"num_attention_heads={num_q_heads}"
                )
            head_dim = hidden_size // num_q_heads
        if head_dim % 2:
            raise ConfigError(f"head_dim={head_dim} must be even for rotary embeddings")
        max_position_embeddings = _required(raw, "max_position_embeddings", int)

        # function-level import: families.py imports this module's errors and dataclasses
        from folio.model.families import family_fields

        family = family_fields(raw, arch, num_layers, hidden_size, max_position_embeddings)
        if raw.get("mlp_bias"):
            raise NotSupportedError("mlp_bias=true (biases on the MLP projections) is not supported")
        try:
            layer_windows = windows.layer_windows(raw, architecture, num_layers, max_position_embeddings)
        except windows.WindowConfigError as e:
            raise ConfigError(str(e)) from None
        layer_windows = family.pop("layer_windows", layer_windows)
        rope_theta, rope_scaling = family.pop("rope") if "rope" in family else _rope(raw, max_position_embeddings)
        has_bias = bool(raw.get("attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=_required(raw, "vocab_size", int),
            hidden_size=hidden_size,
            intermediate_size=_required(raw, "intermediate_size", int),
            num_layers=num_layers,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(_required(raw, "rms_norm_eps", (int, float))),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch.tie_word_embeddings_default)),
            attention_bias=arch.qkv_bias if arch.qkv_bias is not None else has_bias,
            o_proj_bias=arch.o_proj_bias if arch.o_proj_bias is not None else has_bias,
            qk_norm=arch.qk_norm,
            bos_token_id=_bos_token_id(raw, generation),
            eos_token_ids=_eos_token_ids(raw, generation),
            torch_dtype=_dtype(raw),
            layer_windows=layer_windows,
            **family,
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return data


def _required(raw: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in raw or raw[key] is None:
        raise ConfigError(f"missing required field {key!r}")
    return _positive_number(raw, key, kind)


def _optional(raw: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    return None if raw.get(key) is None else _positive_number(raw, key, kind)


def _positive_number(raw: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"field {key!r} = {value!r} has the wrong type")
    if value <= 0:
        raise ConfigError(f"field {key!r} = {value!r} must be positive")
    return value


def _architecture(raw: dict[str, Any]) -> str:
    names = raw.get("architectures")
    if not names or not isinstance(names, list):
        raise ConfigError(f"missing 'architectures'; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if len(names) != 1:
        raise NotSupportedError(f"expected exactly one architecture, got {names}")
    name = names[0]
    if name not in ARCHITECTURES:
        raise NotSupportedError(
            f"architecture {name!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return name


def _rope(raw: dict[str, Any], max_position_embeddings: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either spelling: transformers 4's rope_theta + rope_scaling or
    transformers 5's rope_parameters (which carries rope_theta inside)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope parameters must be an object, got {params!r}")
    if "full_attention" in params or "sliding_attention" in params:
        raise NotSupportedError("per-layer-type rope parameters are not supported")
    params = {**params, "rope_theta": params.get("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA)),
              "partial_rotary_factor": params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))}
    return rope_from_params(params, max_position_embeddings, _DEFAULT_ROPE_THETA)


def rope_from_params(params: dict[str, Any], max_position_embeddings: int,
                     default_theta: float) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) of one rope parameter set (transformers 5's rope_parameters, or one layer type's)."""
    theta = params.get("rope_theta", default_theta)
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise NotSupportedError(f"partial_rotary_factor={partial} is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type == "linear":
        if "factor" not in params:
            raise ConfigError("linear rope scaling is missing field 'factor'")
        return float(theta), RopeScaling(rope_type, float(params["factor"]))
    if rope_type != "llama3":
        raise NotSupportedError(f"rope type {rope_type!r} is not supported (rope_parameters / rope_scaling; "
                                "supported: 'default', 'linear', 'llama3')")
    try:
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", max_position_embeddings)
            ),
        )
    except KeyError as e:
        raise ConfigError(f"llama3 rope scaling is missing field {e.args[0]!r}") from None
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ConfigError(
            f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got {scaling.high_freq_factor} "
            f"and {scaling.low_freq_factor}"
        )
    return float(theta), scaling


def _dtype(raw: dict[str, Any]) -> torch.dtype:
    # transformers 4 writes torch_dtype, transformers 5 writes dtype
    name = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if name not in _DTYPES:
        raise NotSupportedError(f"dtype {name!r} is not supported; supported: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _token_ids(value: Any, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"field {key!r} = {value!r} must be an int or a list of ints")
    return tuple(ids)


def _eos_token_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    # generation_config.json usually lists every stop id (e.g. Llama 3 instruct's end-of-turn); keep both, in order
    ids = _token_ids(generation.get("eos_token_id"), "eos_token_id")
    ids += _token_ids(raw.get("eos_token_id"), "eos_token_id")
    return tuple(dict.fromkeys(ids))


def _bos_token_id(raw: dict[str, Any], generation: dict[str, Any]) -> int | None:
    for source in (raw, generation):
        ids = _token_ids(source.get("bos_token_id"), "bos_token_id")
        if ids:
            return ids[0]
    return None


def check_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype itself if folio runs models in it, else NotSupportedError."""
    if dtype not in _DTYPES.values():
        raise NotSupportedError(f"dtype {dtype} is not supported; supported: {', '.join(_DTYPES)}")
    return dtype
