"""Prefill attention on tensor cores: torch's bundled FlashAttention-2 (varlen) over the paged cache.

Our own `paged_attention` kernel runs prefill on CUDA cores (~15 TFLOP/s on an H200); FlashAttention-2 runs it on
tensor cores. Two ways to feed it the paged K/V:
- "flash_paged": FA2 reads the pages itself through the block table (needs page_size % 256 == 0 and a torch whose
  `_flash_attention_forward` takes `block_table`);
- "flash_gather": gather each sequence's context into contiguous K/V first (one index_select per layer), used only
  when the contexts are not much longer than the new tokens (mostly-prefill steps), else our kernel runs.
Varlen FA2 aligns the causal mask bottom-right, which is what a chunk continuing a cached context needs.

Which one runs ("auto"): the first that passes a small numerical probe against the reference on this device,
else our kernel ("paged"). FOLIO_PREFILL_ATTENTION=paged|flash_paged|flash_gather forces one (for benchmarks).
Decode-only steps never come here (paged_attention_decode, CUDA graphs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from folio import reference_ops

MODES = ("auto", "paged", "flash_paged", "flash_gather")
ENV_VAR = "FOLIO_PREFILL_ATTENTION"
FA2_PAGE_MULTIPLE = 256
# flash_gather: gather only when the contexts hold at most this many tokens per new token (else our kernel runs)
GATHER_MAX_CONTEXT_RATIO = 8
_PROBE_MAX_REL_ERR = 2e-2
_probed: dict[tuple, str] = {}


@dataclass(frozen=True)
class PrefillPlan:
    """Per-forward inputs of the flash path, shared by every layer."""

    mode: str  # "flash_paged" or "flash_gather"
    cu_seqlens_k: torch.Tensor  # [B+1] int32
    max_context_len: int
    kv_slots: torch.Tensor | None  # flash_gather: [sum(context_lens)] int64 flat cache slots, sequence by sequence


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
           max_k: int, scale: float, block_table: torch.Tensor | None = None) -> torch.Tensor:
    kwargs = {"scale": scale}
    if block_table is not None:
        kwargs["block_table"] = block_table
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, **kwargs)[0]


def _requested_mode() -> str:
    mode = os.environ.get(ENV_VAR, "auto")
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={mode!r}; expected one of {MODES}")
    return mode


def choose_mode(q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> str:
    """The prefill attention path for tensors shaped like these on this device (probed once per shape family)."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return "paged"
    requested = _requested_mode()
    if requested == "paged":
        return "paged"
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    key = (q.device, q.dtype, q.shape[1], num_kv_heads, head_dim, page_size, requested)
    if key not in _probed:
        candidates = ["flash_paged", "flash_gather"] if requested == "auto" else [requested]
        if page_size % FA2_PAGE_MULTIPLE:
            candidates = [c for c in candidates if c != "flash_paged"]
        _probed[key] = next((c for c in candidates if _probe(c, q, k_cache, scale)), "paged")
    return _probed[key]


def plan(mode: str, batch, page_size: int) -> PrefillPlan | None:
    """Per-forward tensors for `mode`, or None when this batch should run on our kernel."""
    if mode == "paged":
        return None
    total_k = batch.total_context_len
    if mode == "flash_gather" and total_k > GATHER_MAX_CONTEXT_RATIO * batch.num_tokens:
        return None
    context_lens = batch.context_lens
    cu_k = torch.zeros(context_lens.shape[0] + 1, dtype=torch.int32, device=context_lens.device)
    torch.cumsum(context_lens, 0, dtype=torch.int32, out=cu_k[1:])
    kv_slots = None
    if mode == "flash_gather":
        num_seqs = context_lens.shape[0]
        seq_idx = torch.repeat_interleave(torch.arange(num_seqs, device=cu_k.device), context_lens.long(),
                                          output_size=total_k)
        pos = torch.arange(total_k, device=cu_k.device) - cu_k[seq_idx].long()
        kv_slots = batch.block_tables[seq_idx, pos // page_size].long() * page_size + pos % page_size
    return PrefillPlan(mode, cu_k, batch.max_context_len, kv_slots)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch, prefill: PrefillPlan,
              scale: float) -> torch.Tensor:
    """Attention of the batch's new tokens q [T, Hq, D] over their contexts (already written to the cache)."""
    if prefill.mode == "flash_paged":
        return _flash(q, k_cache, v_cache, batch.cu_seqlens_q, prefill.cu_seqlens_k, batch.max_q_len,
                      prefill.max_context_len, scale, block_table=batch.block_tables)
    num_kv_heads, head_dim = k_cache.shape[2:]
    k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, prefill.kv_slots)
    v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, prefill.kv_slots)
    return _flash(q, k, v, batch.cu_seqlens_q, prefill.cu_seqlens_k, batch.max_q_len, prefill.max_context_len,
                  scale)


def _probe(mode: str, q_like: torch.Tensor, k_like: torch.Tensor, scale: float) -> bool:
    """Does `mode` run here and agree with the reference on a small two-sequence batch (one chunk continuing a
    cached context across pages, one whole prompt)?"""
    from folio.model.batch import ForwardBatch, SeqChunk

    device, dtype = q_like.device, q_like.dtype
    num_q_heads = q_like.shape[1]
    page_size, num_kv_heads, head_dim = k_like.shape[1:]
    gen = torch.Generator(device=device).manual_seed(0)
    n0, n1 = -(-300 // page_size), -(-37 // page_size)
    num_pages = n0 + n1 + 1
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
    pages = torch.randperm(num_pages, device="cpu").tolist()
    chunks = [SeqChunk([0] * 45, 255, pages[:n0]), SeqChunk([0] * 37, 0, pages[n0:n0 + n1])]
    batch = ForwardBatch.build(chunks, page_size, device)
    q = torch.randn(batch.num_tokens, num_q_heads, head_dim, device=device, dtype=dtype, generator=gen)
    try:
        prefill = plan(mode, batch, page_size)
        got = attention(q, k_cache, v_cache, batch, prefill, scale).float()
    except (RuntimeError, TypeError, ValueError):
        return False
    want = reference_ops.paged_attention(q.float(), k_cache.float(), v_cache.float(), batch.block_tables,
                                         batch.cu_seqlens_q, batch.context_lens, scale, batch.max_q_len)
    err = ((got - want).norm() / want.norm()).item()
    return err <= _PROBE_MAX_REL_ERR

