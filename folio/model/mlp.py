"""The gated MLP's activations, and Gemma's logit soft-capping.

SiLU runs as the native `silu_and_mul` op; Gemma's tanh-approximated GELU is computed here in fp32 and rounded
once, like the native op does for SiLU (transformers rounds after the GELU and again after the product).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from folio import ops

ActAndMul = Callable[[torch.Tensor], torch.Tensor]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [N, 2F] -> gelu_tanh(x[:, :F]) * x[:, F:] : [N, F] in x.dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate.float(), approximate="tanh").mul_(up.float()).to(x.dtype)


def act_and_mul(op_set: ops.OpSet, activation: str) -> ActAndMul:
    """The gated activation named by ModelConfig.hidden_activation."""
    if activation == "silu":
        return op_set.silu_and_mul
    if activation == "gelu_tanh":
        return gelu_tanh_and_mul
    raise ValueError(f"hidden_activation={activation!r}: expected 'silu' or 'gelu_tanh'")


def act_and_mul_temp_bytes(activation: str, num_rows: int, width: int, dtype: torch.dtype) -> int:
    """Device bytes the activation of [num_rows, 2 * width] holds beside its input and output (fp32 copies)."""
    if activation == "silu" or dtype == torch.float32:
        return 0
    return 3 * num_rows * width * 4  # gate and up in fp32, and the fp32 product


def softcap_(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """In place: logits = cap * tanh(logits / cap) (Gemma's final logit soft-capping); cap 0.0: unchanged."""
    if cap:
        logits.div_(cap).tanh_().mul_(cap)
    return logits
