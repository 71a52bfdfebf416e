"""Attention over a quantized K/V cache (folio.kv_formats): the cache write and the attention of one layer through
the `*_quant` ops. The format goes in as an int constant (Cache.kv_format_code) so that a decode graph captures it.

Prefill: a step whose prompt rows are fresh prompts (no cached prefix) forming one run attends over the K/V in
hand, in the model's dtype, on FlashAttention-2 or cuDNN (folio.model.flash), as the unquantized path does: the
new tokens' keys are exactly their context; its decoding rows take the quantized decode kernel. Every other step
(a cached prefix, soft-capping) takes the paged kernel over the codes: FA2 reads K/V only as stored in the model's
dtype. So a prompt's own attention sees its unrounded K/V, and later steps see the codes (the prefix cache's pages
are the codes either way)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from folio.model import flash

if TYPE_CHECKING:
    from folio.kv_cache import Cache
    from folio.model.batch import ForwardBatch
    from folio.model.model import Model
    from folio.ops import OpSet


def prefill_plan(model: Model, batch: ForwardBatch, cache: Cache, q_like: torch.Tensor) -> flash.PrefillPlan | None:
    """A flash plan for a step over a quantized cache whose multi-token rows are fresh prompts forming one run (with
    decoding rows beside them or not); None otherwise (the paged kernel)."""
    if model.options.prefill_attention == "paged":
        return None
    cfg = model.config
    # (the probe reads only this tensor's shape, dtype and device: a page of an unquantized cache)
    k_like = torch.empty(1, cache.page_size, cfg.num_kv_heads, cfg.head_dim, device=q_like.device, dtype=q_like.dtype)
    if flash.choose_mode(model.flash_state, q_like, k_like, model.attention_scale, "flash_gather") != "flash_gather":
        return None
    plan = flash.plan(model.flash_state, "flash_gather", batch, cache.page_size, model.released_window)
    return plan if plan is not None and plan.fresh and plan.long_span is not None else None


def attend(ops: OpSet, cache: Cache, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           batch: ForwardBatch, inv_freq: torch.Tensor, scale: float, window: int, softcap: float,
           prefill: flash.PrefillPlan | None = None, flash_state: flash.FlashState | None = None) -> torch.Tensor:
    """Rotary on q [T, Hq, D] and k [T, Hkv, D] in place, K/V quantized into the batch's slots, then attention of
    q over the layer's cache: [T, Hq, D] in q's dtype. prefill (from prefill_plan): fresh prompts, attended over
    the rotated k and v on tensor cores."""
    code = cache.kv_format_code
    k_cache, v_cache = cache.k[layer_idx], cache.v[layer_idx]
    k_scale, v_scale = cache.k_scale[layer_idx], cache.v_scale[layer_idx]
    ops.rotary_cache_write_quant(q, k, v, batch.positions, inv_freq, k_cache, v_cache, k_scale, v_scale,
                                 batch.slot_mapping, code)
    if prefill is not None and softcap == 0:
        def decode_rows(short_q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
            return ops.paged_attention_decode_quant(short_q, k_cache, v_cache, k_scale, v_scale, tables, lens, scale,
                                                    window, softcap, code)

        # (k stands in for the cache in flash.attention's strided-input check: only its head count is read)
        return flash.attention(flash_state, q, k.unsqueeze(0), None, batch, prefill, scale, k_new=k, v_new=v,
                               window=window, decode_rows=decode_rows)
    if batch.max_q_len == 1:
        return ops.paged_attention_decode_quant(q, k_cache, v_cache, k_scale, v_scale, batch.block_tables,
                                                batch.context_lens, scale, window, softcap, code)
    return ops.paged_attention_quant(q, k_cache, v_cache, k_scale, v_scale, batch.block_tables, batch.cu_seqlens_q,
                                     batch.context_lens, scale, batch.max_q_len, window, softcap, code)
