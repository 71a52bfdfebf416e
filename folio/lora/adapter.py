"""LoRA adapters: reading PEFT adapter directories, validating them against the model, and the per-layer low-rank
factors folio applies beside the fused projections.

A PEFT LoRA adapter changes a linear layer y = x W^T into y = x W^T + scale * (x A^T) B^T, A [r, in], B [out, r],
scale = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). folio fuses q/k/v into one `qkv` weight and gate/up
into `gate_up` (folio.model.loader), so an adapter's factors are grouped the same way: per layer and fused
projection, one `ProjectionDelta` whose A stacks the targeted parts' A along the rank and whose B places each part's
B (scale folded in) in that part's output rows and rank columns, zero elsewhere. One shrink and one expand product
per fused projection then update every targeted part at once, in the right slices.

Only what is implemented is accepted: plain LoRA on q/k/v/o/gate/up/down. DoRA, trained biases, embedding or lm_head
targets, per-module rank or alpha patterns and the other PEFT variants are refused with an error naming the field.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from folio.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT module name -> (folio's fused projection, index of the part within it)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")

# adapter_config.json fields whose non-default values change the computation in ways folio does not implement
_UNSUPPORTED_FIELDS = ("use_dora", "lora_bias", "modules_to_save", "rank_pattern", "alpha_pattern", "fan_in_fan_out",
                       "layer_replication", "trainable_token_indices", "target_parameters", "alora_invocation_tokens",
                       "use_qalora", "megatron_config")

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT's saved names; the prefix is optional)
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """The adapter cannot be used with this model: unsupported feature, missing file, wrong shapes."""


@dataclass(frozen=True)
class ProjectionDelta:
    """The low-rank update of one fused projection: y += (x @ a.T) @ b.T."""

    a: torch.Tensor  # [R, in]: the targeted parts' A, stacked along the rank (R = rank * targeted parts)
    b: torch.Tensor  # [out, R]: part i's B times the scale in its output rows and rank columns, zero elsewhere


@dataclass(frozen=True, eq=False)  # identity semantics: a loaded adapter is a dict key
class LoraAdapter:
    name: str
    adapter_id: bytes  # digest of the factors and the scale: the page-hash namespace (folio.hashing)
    rank: int
    scale: float
    target_modules: tuple[str, ...]
    layers: tuple[dict[str, ProjectionDelta], ...]  # per layer: fused projection name -> its update (if targeted)


def part_sizes(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], int]]:
    """Fused projection -> (output rows of each part, input features)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"qkv": ((config.q_size, config.kv_size, config.kv_size), hidden), "o_proj": ((hidden,), config.q_size),
            "gate_up": ((inter, inter), hidden), "down": ((hidden,), inter)}


def read_adapter_config(path: Path) -> dict[str, Any]:
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(f"{path}: no {CONFIG_FILE} (a PEFT adapter directory holds {CONFIG_FILE} and "
                           f"{WEIGHTS_FILE})")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{config_path}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path}: expected a JSON object")
    return config


def load_peft_adapter(name: str, path: str | Path, model_config: ModelConfig, device: torch.device,
                      dtype: torch.dtype) -> LoraAdapter:
    """Read a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) for a model of
    `model_config`; its factors go to `device` in `dtype`."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"adapter path {path} is not a directory")
    adapter_config = read_adapter_config(path)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        other = " (adapter_model.bin is not read: pickled weights; save with safe_serialization)" if (
            path / "adapter_model.bin").is_file() else ""
        raise AdapterError(f"{path}: no {WEIGHTS_FILE}{other}")
    return adapter_from_state_dict(name, adapter_config, load_file(weights_path), model_config, device, dtype)


def adapter_from_state_dict(name: str, adapter_config: dict[str, Any], state_dict: dict[str, torch.Tensor],
                            model_config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> LoraAdapter:
    """An adapter from in-memory tensors under PEFT's names (`...layers.N.self_attn.q_proj.lora_A.weight`) and a
    PEFT-style config dict (r, lora_alpha, use_rslora, target_modules): what load_peft_adapter reads from disk."""
    if not isinstance(name, str) or not name:
        raise AdapterError(f"adapter name must be a non-empty string, got {name!r}")
    rank, scale, targets = _check_config(adapter_config)
    factors = _collect_factors(state_dict, targets, model_config)
    sizes = part_sizes(model_config)
    layers = []
    for layer_idx in range(model_config.num_layers):
        layer: dict[str, ProjectionDelta] = {}
        for projection in PROJECTIONS:
            parts = [(module, part) for module, (proj, part) in TARGETS.items()
                     if proj == projection and (layer_idx, module) in factors]
            if parts:
                layer[projection] = _projection_delta(layer_idx, projection, parts, factors, sizes[projection], rank,
                                                      scale, torch.device(device), dtype)
        layers.append(layer)
    return LoraAdapter(name, _digest(rank, scale, factors), rank, scale, tuple(sorted(targets)), tuple(layers))


def _check_config(config: dict[str, Any]) -> tuple[int, float, set[str]]:
    """(rank, scale, target module names) of a PEFT LoRA config; AdapterError naming the field otherwise."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r}: only LORA adapters are supported")
    for field in _UNSUPPORTED_FIELDS:
        if config.get(field):
            raise AdapterError(f"{field}={config[field]!r} is not supported (plain LoRA only)")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"bias={config['bias']!r}: adapters that train biases are not supported (bias='none')")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"r must be a positive integer, got {rank!r}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    targets = config.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise AdapterError(f"target_modules={targets!r}: give a list of module names among {sorted(TARGETS)} "
                           f"(patterns are not supported)")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise AdapterError(f"target_modules {unknown} not supported: LoRA applies to {sorted(TARGETS)} only "
                           f"(no embedding or lm_head targets)")
    return rank, scale, set(targets)


def _collect_factors(state_dict: dict[str, torch.Tensor], targets: set[str],
                     model_config: ModelConfig) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, module) -> {"A": tensor, "B": tensor}; every tensor must be a LoRA factor of a target module."""
    num_layers = model_config.num_layers
    moe = getattr(model_config, "moe", None)
    factors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in TARGETS:
            raise AdapterError(f"adapter weight {key!r} is not a LoRA factor of {sorted(TARGETS)} (DoRA magnitudes, "
                               f"biases, embeddings and lm_head are not supported)")
        layer_idx, module, which = int(match.group(1)), match.group(2), match.group(3)
        if module not in targets:
            raise AdapterError(f"adapter weight {key!r}: {module} is not in target_modules {sorted(targets)}")
        if layer_idx >= num_layers:
            raise AdapterError(f"adapter weight {key!r}: layer {layer_idx} but the model has {num_layers} layers")
        if moe is not None and moe.layers[layer_idx] and TARGETS[module][0] in ("gate_up", "down"):
            raise AdapterError(f"adapter weight {key!r}: layer {layer_idx} routes experts; target_modules on expert "
                               f"MLPs are not supported")
        factors.setdefault((layer_idx, module), {})[which] = tensor
    for (layer_idx, module), pair in factors.items():
        if len(pair) != 2:
            raise AdapterError(f"layer {layer_idx} {module}: lora_{'B' if 'A' in pair else 'A'} is missing")
    if not factors:
        raise AdapterError("the adapter holds no LoRA weights")
    return factors


def _projection_delta(layer_idx: int, projection: str, parts: list[tuple[str, int]],
                      factors: dict[tuple[int, str], dict[str, torch.Tensor]], sizes: tuple[tuple[int, ...], int],
                      rank: int, scale: float, device: torch.device, dtype: torch.dtype) -> ProjectionDelta:
    out_sizes, in_features = sizes
    row_starts = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
    a = torch.zeros(rank * len(parts), in_features, dtype=torch.float32)
    b = torch.zeros(sum(out_sizes), rank * len(parts), dtype=torch.float32)
    for k, (module, part) in enumerate(parts):
        fa, fb = factors[(layer_idx, module)]["A"], factors[(layer_idx, module)]["B"]
        want_a, want_b = (rank, in_features), (out_sizes[part], rank)
        if tuple(fa.shape) != want_a or tuple(fb.shape) != want_b:
            raise AdapterError(f"layer {layer_idx} {module}: lora_A {list(fa.shape)} and lora_B {list(fb.shape)}, "
                               f"expected {list(want_a)} and {list(want_b)} (r={rank}; is this adapter made for "
                               f"this model?)")
        a[k * rank:(k + 1) * rank] = fa.float()
        rows = slice(row_starts[part], row_starts[part] + out_sizes[part])
        b[rows, k * rank:(k + 1) * rank] = fb.float() * scale
    return ProjectionDelta(a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))


def _digest(rank: int, scale: float, factors: dict[tuple[int, str], dict[str, torch.Tensor]]) -> bytes:
    """Content identity of the adapter (factors as given, rank and scale): equal for the same weights however they
    were loaded, different for any other weights under the same name."""
    hasher = hashlib.blake2b(digest_size=16)
    hasher.update(f"lora r={rank} scale={scale!r}".encode())
    for (layer_idx, module), pair in sorted(factors.items()):
        for which in ("A", "B"):
            tensor = pair[which].detach().to("cpu").contiguous()
            hasher.update(f"{layer_idx}.{module}.{which}{tuple(tensor.shape)}{tensor.dtype}".encode())
            hasher.update(tensor.view(torch.uint8).numpy().tobytes())
    return hasher.digest()


def random_adapter(name: str, model_config: ModelConfig, rank: int, target_modules: tuple[str, ...],
                   device: torch.device | str, dtype: torch.dtype, seed: int = 0, std: float = 0.02) -> LoraAdapter:
    """An adapter of random factors (benchmarks): every layer, the given targets, lora_alpha = rank."""
    gen = torch.Generator().manual_seed(seed)
    sizes = part_sizes(model_config)
    state = {}
    for layer_idx in range(model_config.num_layers):
        for module in target_modules:
            projection, part = TARGETS[module]
            out_sizes, in_features = sizes[projection]
            prefix = f"model.layers.{layer_idx}.{'mlp' if projection in ('gate_up', 'down') else 'self_attn'}.{module}"
            state[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * std
            state[f"{prefix}.lora_B.weight"] = torch.randn(out_sizes[part], rank, generator=gen) * std
    config = {"r": rank, "lora_alpha": rank, "target_modules": list(target_modules)}
    return adapter_from_state_dict(name, config, state, model_config, device, dtype)
