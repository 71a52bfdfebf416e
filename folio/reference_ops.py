"""Pure-torch reference ops: the oracle that the native CPU/CUDA kernels are tested against.

Every function computes in fp32 and returns (or writes) the input dtype. They are written to be obviously right,
not fast: per-sequence loops and dense gathers are fine here. Signatures are fixed by the spec; the native module
must match them exactly so that `folio.ops` can swap one for the other per op.

Shapes: T new tokens, B sequences, Hq/Hkv query/kv heads, D head_dim, P pages, S page_size, L layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [N, H], weight: [H] -> [N, H] in x.dtype."""
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.float()).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x; x[:] = rms_norm(residual) * weight.  x, residual: [N, H], weight: [H].

    The norm reads the residual after it is rounded to its dtype, as a kernel that stores the residual
    and then normalizes it would (and as transformers does).
    """
    residual.copy_((residual.float() + x.float()).to(residual.dtype))
    x.copy_(rms_norm(residual, weight, eps))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [N, 2F] -> silu(x[:, :F]) * x[:, F:] : [N, F]."""
    half = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[:, :half]) * xf[:, half:]).to(x.dtype)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_gate: bool = False
) -> torch.Tensor:
    """x: [M, K], weight: [N, K], bias: [N] or None -> x @ weight.T + bias : [M, N] in x.dtype.

    torch.nn.functional.linear itself (cuBLAS on CUDA), not an fp32 recomputation: it is what the model runs when the
    native GEMV does not apply. The native kernel is tested against fp32 math directly.

    silu_gate: weight is [gate; up] and the result is silu_and_mul of the product, [M, N / 2] (the native GEMV's
    fusion, spelled out)."""
    y = F.linear(x, weight, bias)
    return silu_and_mul(y) if silu_gate else y


def linear_fp8(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
    silu_gate: bool = False,
) -> torch.Tensor:
    """x: [M, K], weight: [N, K] float8_e4m3fn, weight_scale: [N] fp32, bias: [N] or None -> [M, N] in x.dtype:
    x @ (weight * weight_scale[:, None]).T + bias, in fp32 and rounded once (folio.model.fp8's weight layout).

    silu_gate: weight is [gate; up] and the result is silu_and_mul of the rounded product, [M, N / 2]."""
    w = weight.float() * weight_scale.float()[:, None]
    y = F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)
    return silu_and_mul(y) if silu_gate else y


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) dynamic FP8 quantization of activations x [M, K] (16-bit): (codes [M, K]
    float8_e4m3fn, scale [M, 1] fp32) with scale = max(max|x[m]| / 448, 1e-12) and codes = e4m3(x / scale), the
    division in fp32, rounded to nearest even and saturated to +-448. Computed a block of rows at a time, so that a
    long prompt's fp32 copy of x is never whole (16k tokens of a 14336-wide down_proj input would be 940 MB)."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    amax = x.abs().amax(dim=1, keepdim=True).float()
    # (a tensor divisor: torch turns division by a Python scalar into a multiplication by its reciprocal on CUDA)
    # (a row of zeros gets a tiny scale rather than 0: its codes are 0 either way, and dividing by it stays finite)
    scale = (amax / torch.full_like(amax, fp8_max)).clamp_(min=1e-12)
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    for start in range(0, x.shape[0], 2048):
        end = start + 2048
        out[start:end] = (x[start:end].float() / scale[start:end]).clamp_(-fp8_max, fp8_max)
    return out, scale


def _rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] fp32; cos, sin: [T, D/2] fp32. Rotates pairs (i, i + D/2) (HF rotate_half convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rotary_cache_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Rotary on q [T, Hq, D] and k [T, Hkv, D] in place, then k and v [T, Hkv, D] into the caches.

    positions: [T] int64; inv_freq: [D/2] fp32; k_cache, v_cache: [P, S, Hkv, D];
    slot_mapping: [T] int64 flat slot in [0, P*S), or < 0 to skip writing that token.
    q, k and v may be strided views, e.g. `qkv.split([Hq*D, Hkv*D, Hkv*D], dim=-1)` of one fused [T, (Hq+2*Hkv)*D]
    projection, each `.unflatten(-1, (H, D))`: the rotated q and k are written through the views into that buffer.
    """
    angles = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, D/2]
    cos, sin = angles.cos(), angles.sin()
    q.copy_(_rotate_neox(q.float(), cos, sin).to(q.dtype))
    k.copy_(_rotate_neox(k.float(), cos, sin).to(k.dtype))

    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    # view (not reshape): a non-contiguous cache must fail loudly instead of writing into a copy
    k_slots = k_cache.view(-1, num_kv_heads, head_dim)
    v_slots = v_cache.view(-1, num_kv_heads, head_dim)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_slots[slots] = k[keep].to(k_cache.dtype)
    v_slots[slots] = v[keep].to(v_cache.dtype)


def _check_window_softcap(window: int, softcap: float) -> None:
    """The attention ops' `window` (int tokens >= 0, 0 = the whole context) and `softcap` (finite float >= 0,
    0 = none)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: the whole context), got {window!r}")
    if not (isinstance(softcap, (int, float)) and 0.0 <= softcap < float("inf")):
        raise ValueError(f"softcap must be a finite float >= 0 (0.0: none), got {softcap!r}")


def _first_visible_key(first_query_pos: int, window: int) -> int:
    """The first key position a query at first_query_pos (or later) can see: 0 without a window. Keys before it
    are never read, so their pages may have been released (folio.cache.manager)."""
    return max(0, first_query_pos - window + 1) if window > 0 else 0


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, begin: int, end: int) -> torch.Tensor:
    """cache: [P, S, Hkv, D], block_table: [max_blocks] -> positions [begin, end) as [end - begin, Hkv, D] fp32.
    Only the pages holding those positions are read."""
    page_size = cache.shape[1]
    pos = torch.arange(begin, end, device=cache.device)
    pages = block_table.to(cache.device).long()[pos // page_size]
    return cache[pages, pos % page_size].float()


def _scores(q: torch.Tensor, k: torch.Tensor, equation: str, scale: float, softcap: float) -> torch.Tensor:
    """scale * q.k, soft-capped (softcap * tanh(s / softcap)) when softcap > 0."""
    scores = torch.einsum(equation, q, k) * scale
    return softcap * torch.tanh(scores / softcap) if softcap > 0 else scores


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float) -> torch.Tensor:
    """q: [Q, Hq, D], k/v: [K, Hkv, D] fp32, mask: [Q, K] bool (True = may attend) -> [Q, Hq, D] fp32."""
    group = q.shape[1] // k.shape[1]
    # q head h reads kv head h // group
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = _scores(q, k, "qhd,khd->hqk", scale, softcap)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_q_len: int,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """Causal attention of new queries over paged K/V.

    q: [T, Hq, D]; k_cache, v_cache: [P, S, Hkv, D]; block_tables: [B, max_blocks] int32;
    cu_seqlens_q: [B+1] int32; context_lens: [B] int32 -> out [T, Hq, D].
    Sequence b's queries are rows cu[b]..cu[b+1]-1 at positions context_lens[b]-qlen_b .. context_lens[b]-1.
    window: 0, or the query at position i sees keys j with i - window < j <= i (pages wholly before its first
    query's window are never read); softcap: 0.0, or each score s = scale * q.k becomes softcap * tanh(s / softcap).
    """
    _check_window_softcap(window, softcap)
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for b, context_len in enumerate(lens):
        q_begin, q_end = cu[b], cu[b + 1]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        if q_len > max_q_len or q_len > context_len:
            raise ValueError(
                f"sequence {b}: {q_len} queries but max_q_len={max_q_len}, context_len={context_len}"
            )
        k_begin = _first_visible_key(context_len - q_len, window)
        k = _gather_context(k_cache, block_tables[b], k_begin, context_len)
        v = _gather_context(v_cache, block_tables[b], k_begin, context_len)
        q_pos = torch.arange(context_len - q_len, context_len, device=q.device)
        k_pos = torch.arange(k_begin, context_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if window > 0:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        out[q_begin:q_end] = _attend(q[q_begin:q_end].float(), k, v, mask, scale, softcap).to(q.dtype)
    return out


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """One query per sequence, at position context_lens[b]-1, attending to all positions < context_lens[b]
    (with a window: only the last `window` of them; softcap as in paged_attention).

    q: [B, Hq, D]; block_tables: [B, max_blocks] int32; context_lens: [B] int32 -> out [B, Hq, D].
    Computed for the whole batch at once (each row's keys padded to one width, masked by length), independently
    of paged_attention's per-sequence loop so the two check each other.
    """
    _check_window_softcap(window, softcap)
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    max_blocks = block_tables.shape[1]
    width = max_blocks * page_size if window == 0 else min(window, max_blocks * page_size)
    lens = context_lens.long().to(q.device)[:, None]  # [B, 1]
    pos = (lens - width).clamp(min=0) + torch.arange(width, device=q.device)[None, :]  # [B, K] key positions
    valid = pos < lens  # [B, K]
    blocks = (pos // page_size).clamp(max=max_blocks - 1)
    pages = block_tables.to(q.device).long().gather(1, blocks)  # only pages at or after each window's start
    slots = (pos % page_size)
    k = k_cache[pages, slots].float().repeat_interleave(group, dim=2)  # [B, K, Hq, D]
    v = v_cache[pages, slots].float().repeat_interleave(group, dim=2)
    scores = _scores(q.float(), k, "bhd,bkhd->bhk", scale, softcap)
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    # slots past the context may hold anything (NaN included); 0 * NaN would leak into the sum
    v = v.masked_fill(~valid[:, :, None, None], 0.0)
    return torch.einsum("bhk,bkhd->bhd", scores.softmax(dim=-1), v).to(q.dtype)


def copy_page_slots(
    k_cache: torch.Tensor, v_cache: torch.Tensor, src_page: int, dst_page: int, num_slots: int
) -> None:
    """Copy slots [0, num_slots) of page src_page to page dst_page in every layer.

    k_cache, v_cache: [L, P, S, Hkv, D]. Used to reuse the matching head of a cached partial page.
    """
    page_size = k_cache.shape[2]
    if not 0 <= num_slots <= page_size:
        raise ValueError(f"num_slots={num_slots} outside [0, page_size={page_size}]")
    k_cache[:, dst_page, :num_slots] = k_cache[:, src_page, :num_slots]
    v_cache[:, dst_page, :num_slots] = v_cache[:, src_page, :num_slots]


# The quantized-cache ops (folio.reference_kv_quant), in this namespace so that folio.ops finds every reference here.
from folio.reference_kv_quant import (  # noqa: E402, F401  (re-exported)
    paged_attention_decode_quant,
    paged_attention_quant,
    rotary_cache_write_quant,
)
