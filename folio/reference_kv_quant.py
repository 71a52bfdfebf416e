"""Reference ops over quantized K/V caches (folio.kv_formats): today's reference ops, composed.

Each op is the unquantized reference op (folio.reference_ops) applied to the dequantized cache, which is the
definition the native kernels are tested against:
- rotary_cache_write_quant: rotary on q and k in place exactly as rotary_cache_write, then K (rotated, in k's dtype:
  what an unquantized cache of that dtype would hold) and V quantized into the slots, codes and scales;
- paged_attention_decode_quant / paged_attention_quant: the attention ops over the pages the block tables name,
  dequantized in fp32.
They are reachable as folio.reference_ops.<name> (the registry's reference namespace).

Shapes: k_cache, v_cache [P, S, Hkv, Dq] uint8; k_scale, v_scale [P, S, Hkv, D // G] float16 (folio.kv_formats);
kv_format the int code of KV_FORMAT_CODES (1 fp8, 2 q8, 3 q4, 4 q4h).
"""

from __future__ import annotations

import torch

from folio import kv_formats


def rotary_cache_write_quant(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_format: int,
) -> None:
    """rotary_cache_write into a quantized cache: q [T, Hq, D] and k [T, Hkv, D] rotated in place, then K and V
    quantized into the slots of slot_mapping [T] int64 (< 0: not written)."""
    name = kv_formats.format_name(kv_format)
    num_tokens, num_kv_heads, head_dim = k.shape
    _check_cache(k_cache, k_scale, name, head_dim, "k")
    _check_cache(v_cache, v_scale, name, head_dim, "v")
    # The unquantized op rotates q and k; its cache write is pointed nowhere (every slot -1).
    nowhere = torch.full((num_tokens,), -1, dtype=torch.int64, device=k.device)
    scratch = torch.empty(1, 1, num_kv_heads, head_dim, dtype=k.dtype, device=k.device)
    ref.rotary_cache_write(q, k, v, positions, inv_freq, scratch, scratch, nowhere)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        codes, group_scales = kv_formats.quantize(x[keep], name)
        # view (not reshape): a non-contiguous cache must fail loudly instead of writing into a copy
        cache.view(-1, num_kv_heads, cache.shape[-1])[slots] = codes
        scales.view(-1, num_kv_heads, scales.shape[-1])[slots] = group_scales


def paged_attention_decode_quant(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
    kv_format: int,
) -> torch.Tensor:
    """paged_attention_decode over the dequantized cache: q [B, Hq, D] -> [B, Hq, D]."""
    k, v, tables = _dequantized_pages(q, k_cache, v_cache, k_scale, v_scale, block_tables, kv_format)
    return ref.paged_attention_decode(q, k, v, tables, context_lens, scale, window, softcap)


def paged_attention_quant(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_q_len: int,
    window: int,
    softcap: float,
    kv_format: int,
) -> torch.Tensor:
    """paged_attention (causal prefill / chunked prefill) over the dequantized cache: q [T, Hq, D] -> [T, Hq, D]."""
    k, v, tables = _dequantized_pages(q, k_cache, v_cache, k_scale, v_scale, block_tables, kv_format)
    return ref.paged_attention(q, k, v, tables, cu_seqlens_q, context_lens, scale, max_q_len, window, softcap)


def _check_cache(cache: torch.Tensor, scales: torch.Tensor, name: str, head_dim: int, which: str) -> None:
    want_codes, want_scales = kv_formats.code_dim(name, head_dim), kv_formats.scale_dim(name, head_dim)
    if cache.dtype != kv_formats.CODE_DTYPE or scales.dtype != kv_formats.SCALE_DTYPE:
        raise TypeError(f"{which}_cache / {which}_scale must be uint8 / float16, got {cache.dtype} / {scales.dtype}")
    if cache.dim() != 4 or cache.shape[-1] != want_codes or scales.shape != (*cache.shape[:-1], want_scales):
        raise ValueError(f"{name} at head_dim {head_dim}: {which}_cache {tuple(cache.shape)} must be [P, S, Hkv, "
                         f"{want_codes}] and {which}_scale {tuple(scales.shape)} [P, S, Hkv, {want_scales}]")


def _dequantized_pages(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
    block_tables: torch.Tensor, kv_format: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pages block_tables names, dequantized in fp32 ([N, S, Hkv, D] each), and the block tables
    renumbered into them. Negative entries (pages released before a window, never read) become page 0."""
    name = kv_formats.format_name(kv_format)
    head_dim = q.shape[-1]
    _check_cache(k_cache, k_scale, name, head_dim, "k")
    _check_cache(v_cache, v_scale, name, head_dim, "v")
    tables = block_tables.long()
    pages = torch.unique(tables[tables >= 0])
    if pages.numel() == 0:
        pages = torch.zeros(1, dtype=torch.int64, device=tables.device)
    renumbered = torch.searchsorted(pages, tables.clamp(min=0)).to(block_tables.dtype)
    renumbered = renumbered.masked_fill(tables < 0, 0)
    pages = pages.to(k_cache.device)
    # fp32, not q's dtype: a kernel multiplies code by scale in fp32 and uses the product as it is
    k = kv_formats.dequantize(k_cache[pages], k_scale[pages], name, torch.float32)
    v = kv_formats.dequantize(v_cache[pages], v_scale[pages], name, torch.float32)
    return k, v, renumbered


# Last: folio.reference_ops re-exports this module's ops from its own end, so whichever of the two is imported
# first, the other finds these functions defined.
from folio import reference_ops as ref  # noqa: E402
