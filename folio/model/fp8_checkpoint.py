"""Which weights load as FP8, and how: quantizing a dense checkpoint on load, or reading an FP8 checkpoint.

`weight_format` (Model.from_pretrained / from_state_dict): None keeps the checkpoint's format (FP8 checkpoints load
as FP8, dense ones in the model dtype); "fp8" quantizes dense projections per output channel as each tensor is
loaded (the device never holds the dense model and its FP8 copy together: one dense tensor at a time); "dense"
dequantizes an FP8 checkpoint into the model dtype.

FP8 means the attention and dense-MLP projections (q/k/v/o, gate/up/down). Embeddings, lm_head, norms, biases, MoE
routers and MoE experts stay in the model dtype: experts in FP8 need an FP8 grouped GEMM (not done), so an FP8
checkpoint's experts are dequantized on load.

FP8 checkpoints read here (config.json's quantization_config), all float8_e4m3fn weights:
- quant_method "fp8" with `weight_scale` per tensor (scalar) or per channel ([N] or [N, 1]): loaded as they are;
- quant_method "fp8" with `weight_block_size` and block scales `weight_scale_inv` [ceil(N/bn), ceil(K/bk)]
  (DeepSeek / Qwen FP8): dequantized in fp32 and requantized per channel (one more e4m3 rounding; FP8 GEMMs on
  128x128 blocks are not done);
- quant_method "compressed-tensors", format "float-quantized" / "naive-quantized", 8-bit float weights with
  strategy "channel" ([N, 1] scales), "tensor" (scalar) or "block" (as above).
`input_scale` tensors (static activation scales) are ignored: activations are quantized per token, dynamically, by
the prefill GEMM (folio.model.fp8.scaled_mm), and the decode GEMV reads them unquantized.
Anything else raises ValueError naming the config field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from folio.model import architectures as names
from folio.model import fp8
from folio.model.architectures import ARCHITECTURES
from folio.model.config import ModelConfig

WEIGHT_FORMATS = (None, "dense", "fp8")
DEFAULT_BLOCK_SIZE = (128, 128)
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")
_COMPRESSED_FORMATS = ("float-quantized", "naive-quantized")
_STRATEGIES = ("channel", "tensor", "block")

Read = Callable[[str], "torch.Tensor | None"]  # a checkpoint tensor by name (None: not in the checkpoint)


@dataclass(frozen=True)
class Fp8Layout:
    """An FP8 checkpoint's quantization, from its quantization_config."""

    method: str  # "fp8" or "compressed-tensors"
    block_size: tuple[int, int]  # rows, columns of a block of block-wise scales


def check_weight_format(weight_format: str | None) -> None:
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format={weight_format!r}: expected one of {WEIGHT_FORMATS}")


def checkpoint_layout(model_dir: str | Path) -> Fp8Layout | None:
    """The FP8 layout named by config.json's quantization_config; None where it has none."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    return layout_from_config(raw.get("quantization_config"))


def layout_from_config(config: Any) -> Fp8Layout | None:
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"quantization_config = {config!r} must be an object")
    method = config.get("quant_method")
    if method == "fp8":
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt = {fmt!r} is not supported (only 'e4m3')")
        return Fp8Layout(method, _block_size(config.get("weight_block_size"), "quantization_config.weight_block_size"))
    if method == "compressed-tensors":
        return Fp8Layout(method, _compressed_tensors_block(config))
    raise ValueError(f"quantization_config.quant_method = {method!r} is not supported (supported: 'fp8' with "
                     f"float8_e4m3fn weights, 'compressed-tensors' with 8-bit float weights)")


def _compressed_tensors_block(config: dict[str, Any]) -> tuple[int, int]:
    fmt = config.get("format")
    if fmt not in _COMPRESSED_FORMATS:
        raise ValueError(f"quantization_config.format = {fmt!r} is not supported (supported: {_COMPRESSED_FORMATS})")
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"quantization_config.config_groups = {groups!r} must be a non-empty object")
    block = DEFAULT_BLOCK_SIZE
    for group_name, group in groups.items():
        field = f"quantization_config.config_groups.{group_name}.weights"
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise ValueError(f"{field} = {weights!r} must be an object")
        for key, want in (("num_bits", 8), ("type", "float")):
            if weights.get(key) != want:
                raise ValueError(f"{field}.{key} = {weights.get(key)!r} is not supported (only {want!r})")
        strategy = weights.get("strategy")
        if strategy not in _STRATEGIES:
            raise ValueError(f"{field}.strategy = {strategy!r} is not supported (supported: {_STRATEGIES})")
        if strategy == "block":
            block = _block_size(weights.get("block_structure"), f"{field}.block_structure")
    return block


def _block_size(value: Any, field: str) -> tuple[int, int]:
    if value is None:
        return DEFAULT_BLOCK_SIZE
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"{field} = {value!r} must be [rows, columns] of positive ints")
    return value[0], value[1]


def quantizable_names(config: ModelConfig) -> frozenset[str]:
    """Checkpoint names of the weights that run as FP8: every layer's attention projections and dense-MLP
    projections (not MoE experts or routers)."""
    arch = ARCHITECTURES[config.architecture]
    attention = [names.QKV_PROJ] if arch.fused_projections else [p + ".weight" for p in
                                                                 (names.Q_PROJ, names.K_PROJ, names.V_PROJ)]
    attention.append(names.O_PROJ + ".weight")
    mlp = [names.GATE_UP_PROJ] if arch.fused_projections else [names.GATE_PROJ, names.UP_PROJ]
    mlp.append(names.DOWN_PROJ)
    out = []
    for layer_idx in range(config.num_layers):
        routed = config.moe is not None and config.moe.layers[layer_idx]
        out += [names.layer_prefix(layer_idx) + n for n in attention + ([] if routed else mlp)]
    return frozenset(out)


class Converter:
    """Turns each loaded checkpoint tensor into what the model keeps: an Fp8Weight for the FP8 projections, else a
    tensor in the model dtype. Called by folio.model.loader.load_tensors once per expected tensor."""

    ignored_suffixes = SCALE_SUFFIXES  # tensors read through `read`, beside their weight

    def __init__(self, config: ModelConfig, dtype: torch.dtype, weight_format: str | None,
                 layout: Fp8Layout | None) -> None:
        check_weight_format(weight_format)
        self.dtype = dtype
        self.layout = layout
        self.fp8_names = quantizable_names(config) if weight_format == "fp8" or (
            weight_format is None and layout is not None) else frozenset()

    def __call__(self, name: str, tensor: torch.Tensor, read: Read) -> torch.Tensor | fp8.Fp8Weight:
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
            decoded = self._decode(name, tensor, read)
            if name in self.fp8_names:
                return decoded if isinstance(decoded, fp8.Fp8Weight) else fp8.quantize(decoded)
            return decoded.dequantize(self.dtype) if isinstance(decoded, fp8.Fp8Weight) else decoded.to(self.dtype)
        if name in self.fp8_names:
            return fp8.quantize(tensor)
        return tensor.to(self.dtype)

    def _decode(self, name: str, tensor: torch.Tensor, read: Read) -> fp8.Fp8Weight | torch.Tensor:
        """An FP8 checkpoint weight: per-channel as stored (Fp8Weight), or block-wise dequantized (fp32)."""
        if self.layout is None:
            raise ValueError(f"weight {name!r} is {tensor.dtype} but config.json has no quantization_config")
        if tensor.dtype != torch.float8_e4m3fn:
            raise ValueError(f"weight {name!r} is {tensor.dtype}: only float8_e4m3fn weights are supported")
        if tensor.dim() != 2 or not name.endswith(".weight"):
            raise ValueError(f"float8 tensor {name!r} of shape {list(tensor.shape)}: only 2-D weights are supported "
                             "(fused 3-D experts in FP8 are not)")
        base = name[: -len(".weight")]
        scale, scale_name = read(base + ".weight_scale"), base + ".weight_scale"
        if scale is None:
            scale, scale_name = read(base + ".weight_scale_inv"), base + ".weight_scale_inv"
        if scale is None:
            raise ValueError(f"weight {name!r} is float8 but the checkpoint holds no {base}.weight_scale or "
                             f"{base}.weight_scale_inv")
        scale = scale.float()
        rows, cols = tensor.shape
        if scale.numel() == 1:  # per tensor
            return fp8.Fp8Weight(tensor, scale.reshape(1).expand(rows).contiguous())
        if scale.shape in ((rows,), (rows, 1)):  # per channel
            return fp8.Fp8Weight(tensor, scale.reshape(rows).contiguous())
        block_rows, block_cols = self.layout.block_size
        if scale.shape == (math.ceil(rows / block_rows), math.ceil(cols / block_cols)):
            full = scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
            return tensor.float() * full
        raise ValueError(f"{scale_name} has shape {list(scale.shape)}: expected a scalar, [{rows}] or [{rows}, 1] "
                         f"(per channel), or [{math.ceil(rows / block_rows)}, {math.ceil(cols / block_cols)}] "
                         f"({block_rows}x{block_cols} blocks) for weight {list(tensor.shape)}")


def converter_for(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype,
                  weight_format: str | None) -> Converter | None:
    """The converter loading `model_dir` needs; None where the checkpoint loads as it is (dense, kept dense)."""
    check_weight_format(weight_format)
    layout = checkpoint_layout(model_dir)
    if layout is None and weight_format != "fp8":
        return None
    return Converter(config, dtype, weight_format, layout)


def quantize_state(tensors: dict[str, torch.Tensor], config: ModelConfig,
                   weight_format: str | None) -> dict[str, torch.Tensor | fp8.Fp8Weight]:
    """In place (and returned): the FP8 projections of an in-memory state dict's tensors, for weight_format "fp8"."""
    check_weight_format(weight_format)
    if weight_format == "fp8":
        for name in quantizable_names(config):
            tensors[name] = fp8.quantize(tensors[name])
    return tensors
