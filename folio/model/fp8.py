"""FP8 weights: e4m3 values with one fp32 scale per output channel, and the linear layer that runs on them.

A weight W [N, K] is stored as W_fp8 [N, K] float8_e4m3fn and scale [N] fp32 with W ~= W_fp8 * scale[:, None],
scale = amax(|W[n]|) / 448 (448: e4m3's largest finite value), so every row uses e4m3's whole range. Scales are
per row, so the fused q/k/v and gate/up weights are the concatenation of their parts' rows and scales.

The linear layer (`Fp8Linear.linear`):
- CUDA, decode-sized inputs (at most ops.LINEAR_MAX_ROWS rows): the native FP8 GEMV (native/cuda/gemv_fp8.cu,
  op `linear_fp8`), which streams the fp8 weight once (half the bf16 weight's bytes) and applies the scales in its
  epilogue;
- CUDA, larger inputs: torch._scaled_mm on fp8 tensor cores with per-token activation scales (x quantized per row
  to e4m3, scale_a [M, 1], scale_b [1, N], bf16 out), where this torch and device have the row-wise form (probed
  once per device against the dequantized product);
- CUDA without a working row-wise _scaled_mm: the weight dequantized to x's dtype and a 16-bit GEMM;
- elsewhere (CPU): the reference, the weight dequantized in fp32 and F.linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from folio import ops
from folio.reference_ops import linear_fp8 as reference_linear  # (dequantize in fp32 + F.linear)
from folio.reference_ops import quantize_rows_fp8

FP8_DTYPE = torch.float8_e4m3fn
_GEMV_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Fp8Weight:
    """A linear layer's weight in FP8: weight [N, K] float8_e4m3fn, scale [N] fp32 (W ~= weight * scale[:, None])."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.weight.dtype != FP8_DTYPE or self.weight.dim() != 2:
            raise ValueError(f"Fp8Weight.weight must be a 2-D {FP8_DTYPE}, got {self.weight.dtype} "
                             f"{list(self.weight.shape)}")
        if self.scale.dtype != torch.float32 or self.scale.shape != (self.weight.shape[0],):
            raise ValueError(f"Fp8Weight.scale must be float32 [{self.weight.shape[0]}], got {self.scale.dtype} "
                             f"{list(self.scale.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + 4 * self.scale.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in dtype, computed in fp32 and rounded once."""
        return (self.weight.float() * self.scale[:, None]).to(dtype)

    def rows(self, start: int, end: int) -> Fp8Weight:
        """Rows start..end-1 (views, no copy)."""
        return Fp8Weight(self.weight[start:end], self.scale[start:end])


def quantize(weight: torch.Tensor) -> Fp8Weight:
    """Per-output-channel quantization of a [N, K] weight: scale[n] = amax(|weight[n]|) / 448 (rows of zeros: a tiny
    positive scale), values rounded to nearest e4m3: the activations' per-row quantization
    (folio.reference_ops.quantize_rows_fp8), in fp32 on the weight's device."""
    if weight.dim() != 2:
        raise ValueError(f"quantize takes a 2-D [N, K] weight, got shape {list(weight.shape)}")
    values, scale = quantize_rows_fp8(weight.float())
    return Fp8Weight(values, scale.squeeze(1))


def cat(parts: list[torch.Tensor | Fp8Weight]) -> torch.Tensor | Fp8Weight:
    """Concatenate weights along their rows (q/k/v, gate/up). Where any part is FP8, all are: dense parts are
    quantized (a checkpoint that quantized only some of a fused group's projections)."""
    if not any(isinstance(p, Fp8Weight) for p in parts):
        return torch.cat(parts)
    fp8_parts = [p if isinstance(p, Fp8Weight) else quantize(p) for p in parts]
    return Fp8Weight(torch.cat([p.weight for p in fp8_parts]), torch.cat([p.scale for p in fp8_parts]))


def gemv_supported(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> bool:
    """Whether the native FP8 GEMV's fast path takes these arguments (host-side checks only, capture-safe): x [M, K]
    bf16/fp16 with M <= LINEAR_MAX_ROWS on the weight's CUDA device, K a multiple of 16, x's and the weight's rows
    dense and 16-byte aligned, bias None or a contiguous [N] of x's dtype."""
    if x.dim() != 2 or x.shape[0] > ops.LINEAR_MAX_ROWS or x.device.type != "cuda" or x.dtype not in _GEMV_DTYPES:
        return False
    w = weight.weight
    if w.device != x.device or w.shape[1] != x.shape[1] or x.shape[1] % 16 != 0:
        return False
    if not (ops._aligned_dense_rows(x, 8) and ops._aligned_dense_rows(w, 16) and weight.scale.is_contiguous()):
        return False
    return bias is None or (bias.dtype == x.dtype and bias.shape == (w.shape[0],) and bias.is_contiguous())


class Fp8Linear:
    """The FP8 linear layer of one model: its op set, and what it probed per device (never module globals)."""

    def __init__(self, op_set: ops.OpSet, device: torch.device | None = None, weights: object = None) -> None:
        """device, weights: a model's, to probe _scaled_mm now where they hold FP8 weights on CUDA: the probe
        synchronizes, which a decode graph being captured (batches past the GEMV's rows) must not."""
        self.ops = op_set
        self._scaled_mm_ok: dict[torch.device, bool] = {}
        layers = getattr(weights, "layers", ())
        if device is not None and device.type == "cuda" and any(isinstance(layer.qkv, Fp8Weight) for layer in layers):
            self._scaled_mm_ok[device] = _scaled_mm_works(device)

    def gemv_supported(self, x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> bool:
        return gemv_supported(x, weight, bias) and self.ops.native("linear_fp8", "cuda") is not None

    def linear(self, x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
               silu_gate: bool = False) -> torch.Tensor:
        """x [M, K] @ W.T (+ bias) in x.dtype; silu_gate: silu(gate) * up of a [gate; up] weight (see
        folio.reference_ops.linear_fp8)."""
        if self.gemv_supported(x, weight, bias):
            return self.ops.linear_fp8(x, weight.weight, weight.scale, bias, silu_gate)
        if self.scaled_mm_supported(x, weight):
            y = scaled_mm(x, weight, bias, self.ops)
            return self.ops.silu_and_mul(y) if silu_gate else y
        if x.device.type == "cuda" and x.dtype in _GEMV_DTYPES:
            # no FP8 GEMM here: the weight dequantized to x's dtype for one 16-bit tensor-core GEMM (fp32 GEMMs,
            # as the reference computes, run an order of magnitude slower)
            y = torch.nn.functional.linear(x, weight.dequantize(x.dtype), bias)
            return self.ops.silu_and_mul(y) if silu_gate else y
        return reference_linear(x, weight.weight, weight.scale, bias, silu_gate)

    def scaled_mm_supported(self, x: torch.Tensor, weight: Fp8Weight) -> bool:
        """CUDA, 16-bit x, N and K multiples of 16 (cuBLASLt's FP8 layout rule), and row-wise _scaled_mm works here."""
        if x.device.type != "cuda" or x.dtype not in _GEMV_DTYPES or x.dim() != 2:
            return False
        n, k = weight.shape
        if n % 16 or k % 16 or weight.weight.stride(1) != 1:
            return False
        if x.device not in self._scaled_mm_ok:
            self._scaled_mm_ok[x.device] = _scaled_mm_works(x.device)
        return self._scaled_mm_ok[x.device]


def scaled_mm(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
              op_set: ops.OpSet | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16) @ W.T on FP8 tensor cores with per-token scales of x (op quantize_rows_fp8: one fused
    kernel on CUDA) and per-channel scales of W. Row-wise scaling gives bf16 only; fp16 models get the bf16 result
    converted."""
    x_fp8, scale_a = (op_set or ops.OpSet()).quantize_rows_fp8(x)
    # mat2 [K, N] column-major: the transpose of the row-major [N, K] weight, as cuBLASLt wants it
    y = torch._scaled_mm(x_fp8, weight.weight.t(), scale_a=scale_a, scale_b=weight.scale[None, :],
                         out_dtype=torch.bfloat16)
    if bias is not None:
        y = y.add_(bias.to(y.dtype))
    return y.to(x.dtype)


def _scaled_mm_works(device: torch.device) -> bool:
    """Does row-wise torch._scaled_mm exist here (sm_89+, a torch that has it) and agree with the product of the same
    fp8 operands dequantized? (Against the unquantized x, the activations' rounding alone exceeds any tolerance that
    would still catch wrong scales.)"""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16, generator=gen)
    w = quantize(torch.randn(48, 64, device=device, generator=gen))
    try:
        got = scaled_mm(x, w).float()
    except (RuntimeError, TypeError, NotImplementedError, AttributeError, ValueError):
        return False
    x_fp8, scale_a = ops.OpSet().quantize_rows_fp8(x)
    want = (x_fp8.float() * scale_a) @ w.dequantize().t()
    # the same products summed in another order, rounded once to bf16 (relative 2^-8)
    return got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-2, atol=1e-2))
