"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): each token runs through the top-k of E experts its router picks,
and the MLP's output is their outputs weighted by the routing weights.

Routing, as transformers does it: router logits in the model dtype, softmax in fp32, top-k, the k weights divided
by their sum where the model says so (Mixtral always; Qwen3-MoE with norm_topk_prob).

The experts' GEMMs run on the (token, expert) pairs grouped by expert, by one of three paths:
- grouped: `torch._grouped_mm` over all experts at once, where it exists for this device and dtype (probed once
  per device and dtype against a per-group product) and the shapes are aligned. No host synchronization, so decode
  graphs capture it.
- loop: one GEMM pair per expert that has tokens. It must learn the group sizes on the host (one sync per layer).
- dense: while a CUDA graph is being captured without the grouped path (no sync allowed), every expert runs on every
  token and the routing weights (0 where not routed) select; E / k times the work, for decode-sized batches only.
All three sum each token's k weighted outputs in fp32 and round once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from folio.model.config import MoeConfig
from folio.model.loader import ExpertWeights
from folio.model.mlp import ActAndMul

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Routing(NamedTuple):
    weights: torch.Tensor  # [T, k] fp32
    expert_ids: torch.Tensor  # [T, k] int64
    order: torch.Tensor  # [T * k] int64: the (token, slot) pairs t * k + j, grouped by expert, stably
    group_ends: torch.Tensor  # [E] int32: cumulative pair counts per expert


def route(x: torch.Tensor, router: torch.Tensor, moe: MoeConfig, linear: Linear) -> Routing:
    """x: [T, H], router: [E, H] -> each token's top-k experts and weights, and the pairs grouped by expert."""
    probs = linear(x, router).float().softmax(dim=-1)  # [T, E]
    weights, expert_ids = probs.topk(moe.num_experts_per_tok, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    flat_ids = expert_ids.flatten()
    order = flat_ids.argsort(stable=True)
    # counted by a scatter, not bincount: bincount sizes its output from the data (a host sync on CUDA)
    counts = torch.zeros(moe.num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    return Routing(weights, expert_ids, order, counts.cumsum(0, dtype=torch.int32))


class MoE:
    """The expert MLP of a model; keeps what it probes per device and dtype (never in module globals)."""

    def __init__(self, config: MoeConfig) -> None:
        self.config = config
        self._grouped_ok: dict[tuple[torch.device, torch.dtype], bool] = {}

    def forward(self, x: torch.Tensor, experts: ExpertWeights, linear: Linear, act_and_mul: ActAndMul,
                path: str | None = None) -> torch.Tensor:
        """x: [T, H] -> [T, H] in x.dtype. path: "grouped", "loop" or "dense" (tests); None: the best that works
        here (see the module docstring)."""
        routing = route(x, experts.router, self.config, linear)
        if path is None:
            if self.grouped_supported(x, experts):
                path = "grouped"
            elif x.is_cuda and torch.cuda.is_current_stream_capturing():
                path = "dense"
            else:
                path = "loop"
        if path == "dense":
            return _dense(x, experts, routing, linear, act_and_mul)
        rows = x[routing.order // self.config.num_experts_per_tok]  # [T*k, H], grouped by expert
        if path == "grouped":
            # mat_b [E, K, N] as views of the [E, N, K] weights: the column-major layout _grouped_mm takes
            hidden = act_and_mul(torch._grouped_mm(rows, experts.gate_up.transpose(1, 2), offs=routing.group_ends))
            grouped_out = torch._grouped_mm(hidden, experts.down.transpose(1, 2), offs=routing.group_ends)
        elif path == "loop":
            grouped_out = _loop(rows, experts, routing, linear, act_and_mul)
        else:
            raise ValueError(f"path={path!r}: expected 'grouped', 'loop' or 'dense'")
        return _combine(grouped_out, routing, x.dtype)

    def grouped_supported(self, x: torch.Tensor, experts: ExpertWeights) -> bool:
        """Does torch._grouped_mm work for x's device and dtype (probed once), and are these shapes aligned?"""
        key = (x.device, x.dtype)
        if key not in self._grouped_ok:
            self._grouped_ok[key] = _grouped_mm_works(x.device, x.dtype)
        per_16_bytes = 16 // x.element_size()
        aligned = x.shape[1] % per_16_bytes == 0 and experts.down.shape[2] % per_16_bytes == 0
        return self._grouped_ok[key] and aligned and experts.gate_up.dtype == x.dtype


def activation_bytes(moe: MoeConfig, hidden_size: int, num_tokens: int, element: int) -> int:
    """An upper bound on what one MoE layer holds at once beside the residual stream (any path): routing, the
    grouped rows, the gate/up product and its activation (with fp32 copies of a non-native activation), the
    grouped output and its unsorted copy, the fp32 weighted outputs and their sum."""
    pairs = num_tokens * moe.num_experts_per_tok
    inter = moe.expert_intermediate_size
    routing = num_tokens * moe.num_experts * (element + 8) + pairs * 40
    grouped = pairs * (3 * hidden_size + 3 * inter) * element + pairs * 3 * inter * 4
    combine = pairs * hidden_size * 4 + num_tokens * hidden_size * (4 + element)
    return routing + grouped + combine


def _loop(rows: torch.Tensor, experts: ExpertWeights, routing: Routing, linear: Linear,
          act_and_mul: ActAndMul) -> torch.Tensor:
    out = torch.empty_like(rows)
    # the one host sync of this path: which experts have tokens, and where their rows are
    ends = routing.group_ends.tolist()
    start = 0
    for expert, end in enumerate(ends):
        if end > start:
            hidden = act_and_mul(linear(rows[start:end], experts.gate_up[expert]))
            out[start:end] = linear(hidden, experts.down[expert])
        start = end
    return out


def _dense(x: torch.Tensor, experts: ExpertWeights, routing: Routing, linear: Linear,
           act_and_mul: ActAndMul) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(experts.gate_up.shape[0]):
        weight = (routing.weights * (routing.expert_ids == expert)).sum(dim=-1, keepdim=True)  # [T, 1], 0: not routed
        expert_out = linear(act_and_mul(linear(x, experts.gate_up[expert])), experts.down[expert])
        out.addcmul_(expert_out.float(), weight)
    return out.to(x.dtype)


def _combine(grouped_out: torch.Tensor, routing: Routing, dtype: torch.dtype) -> torch.Tensor:
    """[T*k, H] outputs in expert order -> [T, H]: each token's k outputs weighted and summed in fp32. Summed over a
    reshape, not index_add_ (whose atomics would make the order of the k terms vary from run to run)."""
    num_tokens, top_k = routing.weights.shape
    by_pair = torch.empty_like(grouped_out)
    by_pair[routing.order] = grouped_out
    weighted = by_pair.view(num_tokens, top_k, -1).float() * routing.weights[:, :, None]
    return weighted.sum(dim=1).to(dtype)


def _grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Does torch._grouped_mm exist for `dtype` on this device and agree with per-group products (an empty group
    included)?"""
    gen = torch.Generator(device=device).manual_seed(0)  # (the global generator's state stays untouched)
    a = torch.randn(24, 32, device=device, dtype=dtype, generator=gen)
    b = torch.randn(3, 40, 32, device=device, dtype=dtype, generator=gen)  # [E, N, K]
    ends = [8, 8, 24]
    try:
        got = torch._grouped_mm(a, b.transpose(1, 2), offs=torch.tensor(ends, dtype=torch.int32, device=device))
        want = torch.cat([a[s:e].float() @ b[g].float().t() for g, (s, e) in enumerate(zip([0] + ends, ends))])
        return got.shape == want.shape and bool(torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2))
    except (RuntimeError, TypeError, NotImplementedError, AttributeError):
        return False
