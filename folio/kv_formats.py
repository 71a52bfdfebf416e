"""The KV cache formats: names, codes, sizes, and the reference quantize / dequantize every kernel is tested against.

Unquantized caches hold K/V in the model's dtype ("bf16", "fp16", "fp32"; kv_format None is the model's dtype).
Quantized caches hold one uint8 tensor of codes and one float16 tensor of scales each for K and V:
  codes  [..., Dq]     Dq = D for fp8/q8, D/2 for q4/q4h (two codes a byte)
  scales [..., D // G] G the group size along head_dim: D for fp8 (one scale per token and head), 32 otherwise

Quantizing one group x[0:G] (computed in fp32; K after rotary, as the unquantized cache would hold it):
  scale = float16(max(max|x| / QMAX, 2**-24))     the fp16 value is stored AND used to quantize (no fp32 scale)
  fp8: byte = bits of float8_e4m3fn(clamp(x / scale, -448, 448))   (round to nearest even, saturating)
  q8:  byte = bits of int8(clamp(round_half_even(x / scale), -127, 127))
  q4:  nibble = clamp(round_half_even(x / scale), -7, 7) + 8 (1..15); element 2i in the low nibble of byte i,
       element 2i+1 in the high nibble
  q4h: q4 of each group of 32 multiplied by the orthonormal Sylvester Hadamard matrix H/sqrt(32) first (fp32,
       entries +-float32(1/sqrt(32))); dequantizing multiplies by it again (it is its own inverse)
Dequantizing: float(code) * float(scale) in fp32, then the requested dtype.

A scale rounds to float16 infinity for max|x| > 65504 * QMAX (458k for q4, 29M for fp8): far beyond K/V values.
"""

from __future__ import annotations

import math
from types import MappingProxyType

import torch

UNQUANTIZED_DTYPES = MappingProxyType({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32})
QUANTIZED_FORMATS = ("fp8", "q8", "q4", "q4h")
# The int code the `*_quant` ops take (a plain int, so a captured decode graph holds it as a constant).
KV_FORMAT_CODES = MappingProxyType({"fp8": 1, "q8": 2, "q4": 3, "q4h": 4})
FORMATS_BY_CODE = MappingProxyType({code: name for name, code in KV_FORMAT_CODES.items()})
QMAX = MappingProxyType({"fp8": 448.0, "q8": 127.0, "q4": 7.0, "q4h": 7.0})
GROUP_SIZE = 32  # along head_dim, for q8 / q4 / q4h (fp8: the whole head)
MIN_SCALE = 2.0 ** -24  # the smallest float16 subnormal: an all-zero group still gets a finite, nonzero scale
SCALE_DTYPE = torch.float16
CODE_DTYPE = torch.uint8


def format_name(kv_format: str | int) -> str:
    """The quantized format's name, from its name or its op code (KV_FORMAT_CODES)."""
    if isinstance(kv_format, int) and not isinstance(kv_format, bool) and kv_format in FORMATS_BY_CODE:
        return FORMATS_BY_CODE[kv_format]
    if kv_format in KV_FORMAT_CODES:
        return kv_format
    raise ValueError(f"unknown quantized kv_format {kv_format!r}; expected one of {QUANTIZED_FORMATS} "
                     f"or their codes {dict(KV_FORMAT_CODES)}")


def resolve(kv_format: str | None, model_dtype: torch.dtype, head_dim: int) -> str | None:
    """The quantized format a cache of a `model_dtype` model with `head_dim` uses, or None for an unquantized
    cache (kv_format None, or the name of the model's own dtype). Raises ValueError for anything else."""
    if kv_format is None:
        return None
    if kv_format in UNQUANTIZED_DTYPES:
        if UNQUANTIZED_DTYPES[kv_format] != model_dtype:
            raise ValueError(f"kv_format={kv_format!r} differs from the model's dtype {model_dtype}: an unquantized "
                             f"cache holds the model's dtype (kv_format None); quantized formats: "
                             f"{QUANTIZED_FORMATS}")
        return None
    if kv_format not in KV_FORMAT_CODES:
        raise ValueError(f"unknown kv_format {kv_format!r}; expected None, one of {tuple(UNQUANTIZED_DTYPES)} "
                         f"(the model's dtype) or one of {QUANTIZED_FORMATS}")
    group = group_size(kv_format, head_dim)
    if head_dim % group or head_dim % 2:
        raise ValueError(f"kv_format={kv_format!r} needs head_dim divisible by {group}, and the model's head_dim "
                         f"is {head_dim}")
    return kv_format


def group_size(kv_format: str, head_dim: int) -> int:
    """Elements that share one scale: the whole head for fp8, GROUP_SIZE for the integer formats."""
    return head_dim if format_name(kv_format) == "fp8" else GROUP_SIZE


def code_dim(kv_format: str, head_dim: int) -> int:
    """Bytes of codes per token and head (Dq)."""
    return head_dim // 2 if format_name(kv_format).startswith("q4") else head_dim


def scale_dim(kv_format: str, head_dim: int) -> int:
    """float16 scales per token and head (D // G)."""
    return head_dim // group_size(kv_format, head_dim)


def bytes_per_head_token(kv_format: str | None, head_dim: int, model_dtype: torch.dtype) -> int:
    """Bytes one token's K (or V) of one kv head takes: codes and scales, or head_dim elements unquantized."""
    if kv_format is None:
        return head_dim * torch.empty((), dtype=model_dtype).element_size()
    return code_dim(kv_format, head_dim) + 2 * scale_dim(kv_format, head_dim)


def bytes_per_element(kv_format: str | None, head_dim: int, model_dtype: torch.dtype) -> float:
    """Average bytes per K/V element, scales included (e.g. q4 at head_dim 128: 0.5625)."""
    return bytes_per_head_token(kv_format, head_dim, model_dtype) / head_dim


def _check_x(x: torch.Tensor, head_dim: int, kv_format: str) -> None:
    if not x.is_floating_point():
        raise TypeError(f"quantize needs a floating-point tensor, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != head_dim or head_dim % group_size(kv_format, head_dim) or head_dim % 2:
        raise ValueError(f"{kv_format}: last dim {tuple(x.shape)[-1:]} must be a head_dim divisible by "
                         f"{group_size(kv_format, head_dim)}")


def hadamard(size: int = GROUP_SIZE, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix H/sqrt(size) [size, size] fp32: orthonormal and symmetric, so
    x @ H rotates each row and (x @ H) @ H = x. size a power of two."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"size={size} must be a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / math.sqrt(size)).to(device)


def _rotate_groups(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] fp32 with every group of GROUP_SIZE multiplied by hadamard()."""
    groups = x.unflatten(-1, (-1, GROUP_SIZE))
    return (groups @ hadamard(GROUP_SIZE, x.device)).flatten(-2)


def quantize(x: torch.Tensor, kv_format: str | int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (codes uint8 [..., Dq], scales float16 [..., D // G]) per the module doc."""
    name = format_name(kv_format)
    head_dim = x.shape[-1] if x.dim() else 0
    _check_x(x, head_dim, name)
    xf = x.float()
    if name == "q4h":
        xf = _rotate_groups(xf)
    group = group_size(name, head_dim)
    groups = xf.unflatten(-1, (-1, group))  # [..., D // G, G]
    amax = groups.abs().amax(dim=-1, keepdim=True)
    scales = (amax / QMAX[name]).clamp(min=MIN_SCALE).to(SCALE_DTYPE)  # rounded before use
    scaled = groups / scales.float()
    if name == "fp8":
        codes = scaled.clamp(-QMAX[name], QMAX[name]).to(torch.float8_e4m3fn).view(CODE_DTYPE)
    elif name == "q8":
        codes = scaled.round().clamp(-127, 127).to(torch.int8).view(CODE_DTYPE)
    else:
        nibbles = (scaled.round().clamp(-7, 7) + 8).to(CODE_DTYPE).flatten(-2)
        codes = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return codes.reshape(*x.shape[:-1], code_dim(name, head_dim)), scales.squeeze(-1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, kv_format: str | int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(codes uint8 [..., Dq], scales float16 [..., D // G]) -> x [..., D] in dtype, computed in fp32."""
    name = format_name(kv_format)
    if codes.dtype != CODE_DTYPE or scales.dtype != SCALE_DTYPE:
        raise TypeError(f"dequantize takes uint8 codes and float16 scales, got {codes.dtype} and {scales.dtype}")
    head_dim = 2 * codes.shape[-1] if name.startswith("q4") else codes.shape[-1]
    if codes.shape[:-1] != scales.shape[:-1] or scales.shape[-1] != scale_dim(name, head_dim):
        raise ValueError(f"{name}: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not fit")
    if name == "fp8":
        values = codes.view(torch.float8_e4m3fn).float()
    elif name == "q8":
        values = codes.view(torch.int8).float()
    else:
        low, high = (codes & 0xF).float() - 8, (codes >> 4).float() - 8
        values = torch.stack((low, high), dim=-1).flatten(-2)
    x = (values.unflatten(-1, (scales.shape[-1], -1)) * scales.float()[..., None]).flatten(-2)
    if name == "q4h":
        x = _rotate_groups(x)
    return x.to(dtype)
