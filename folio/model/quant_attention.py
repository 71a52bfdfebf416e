"""Attention over a quantized K/V cache (folio.kv_formats): the cache write and the attention of one layer through
the `*_quant` ops. The format goes in as an int constant (Cache.kv_format_code) so that a decode graph captures it.

Prefill takes the paged kernel here, not FlashAttention (folio.model.flash gathers the cache's K/V as they are
stored, in the model's dtype)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from folio.kv_cache import Cache
    from folio.model.batch import ForwardBatch
    from folio.ops import OpSet


def attend(ops: OpSet, cache: Cache, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           batch: ForwardBatch, inv_freq: torch.Tensor, scale: float, window: int, softcap: float) -> torch.Tensor:
    """Rotary on q [T, Hq, D] and k [T, Hkv, D] in place, K/V quantized into the batch's slots, then attention of
    q over the layer's cache: [T, Hq, D] in q's dtype."""
    code = cache.kv_format_code
    k_cache, v_cache = cache.k[layer_idx], cache.v[layer_idx]
    k_scale, v_scale = cache.k_scale[layer_idx], cache.v_scale[layer_idx]
    ops.rotary_cache_write_quant(q, k, v, batch.positions, inv_freq, k_cache, v_cache, k_scale, v_scale,
                                 batch.slot_mapping, code)
    if batch.max_q_len == 1:
        return ops.paged_attention_decode_quant(q, k_cache, v_cache, k_scale, v_scale, batch.block_tables,
                                                batch.context_lens, scale, window, softcap, code)
    return ops.paged_attention_quant(q, k_cache, v_cache, k_scale, v_scale, batch.block_tables, batch.cu_seqlens_q,
                                     batch.context_lens, scale, batch.max_q_len, window, softcap, code)
