"""The reference ops against independent, straightforward computations (loops, transformers' own functions)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from folio import reference_ops as ref

GEN_SEED = 1234


def randn(*shape: int, dtype: torch.dtype = torch.float32, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(GEN_SEED)


# ---------------------------------------------------------------- norms and activations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(gen, dtype) -> None:
    x = randn(7, 48, dtype=dtype, gen=gen) * 3
    norm = LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * randn(48, gen=gen))
    norm = norm.to(dtype)
    got = ref.rms_norm(x, norm.weight, 1e-5)
    assert got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), norm(x).float(), rtol=tol, atol=tol)


def test_rms_norm_by_hand(gen) -> None:
    x, w = randn(3, 10, gen=gen), randn(10, gen=gen)
    for row in range(3):
        rms = math.sqrt(sum(v * v for v in x[row].tolist()) / 10 + 1e-6)
        want = [xi / rms * wi for xi, wi in zip(x[row].tolist(), w.tolist())]
        assert ref.rms_norm(x, w, 1e-6)[row].tolist() == pytest.approx(want, rel=1e-5)


def test_fused_add_rms_norm_updates_both_in_place(gen) -> None:
    x, residual, w = randn(5, 32, gen=gen), randn(5, 32, gen=gen), randn(32, gen=gen)
    want_residual = residual + x
    want_x = ref.rms_norm(want_residual, w, 1e-6)
    x_ptr, residual_ptr = x.data_ptr(), residual.data_ptr()
    assert ref.fused_add_rms_norm(x, residual, w, 1e-6) is None
    assert (x.data_ptr(), residual.data_ptr()) == (x_ptr, residual_ptr)
    torch.testing.assert_close(residual, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(x, want_x, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul_by_hand(gen, dtype) -> None:
    x = randn(4, 2 * 6, dtype=dtype, gen=gen)
    got = ref.silu_and_mul(x)
    assert got.shape == (4, 6) and got.dtype == dtype
    for n in range(4):
        for f in range(6):
            gate, up = float(x[n, f]), float(x[n, 6 + f])
            want = gate / (1 + math.exp(-gate)) * up
            assert float(got[n, f]) == pytest.approx(want, rel=1e-3 if dtype == torch.float16 else 1e-5, abs=1e-3)


# ---------------------------------------------------------------- rotary + cache write


def hf_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin the way transformers' rotary embedding module builds them: [T, D]."""
    freqs = positions.float()[:, None] @ inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def test_rotary_cache_write_matches_transformers(gen) -> None:
    num_tokens, num_q_heads, num_kv_heads, head_dim, num_pages, page_size = 9, 4, 2, 8, 5, 4
    q = randn(num_tokens, num_q_heads, head_dim, gen=gen)
    k = randn(num_tokens, num_kv_heads, head_dim, gen=gen)
    v = randn(num_tokens, num_kv_heads, head_dim, gen=gen)
    positions = torch.tensor([0, 1, 2, 3, 17, 18, 5, 100, 4000], dtype=torch.int64)
    inv_freq = 1.0 / (500.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    slots = torch.tensor([3, 4, 5, 6, -1, 19, 0, -1, 12], dtype=torch.int64)
    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), 7.0)
    v_cache = torch.full_like(k_cache, 7.0)

    cos, sin = hf_cos_sin(positions, inv_freq)
    # transformers works on [batch, heads, T, D]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    want_q, want_k = want_q[0].transpose(0, 1), want_k[0].transpose(0, 1)
    v_before = v.clone()

    ref.rotary_cache_write(q, k, v, positions, inv_freq, k_cache, v_cache, slots)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(v, v_before)

    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    written = set()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            written.add(slot)
            assert torch.equal(flat_k[slot], k[t]) and torch.equal(flat_v[slot], v[t])
    untouched = [s for s in range(num_pages * page_size) if s not in written]
    assert (flat_k[untouched] == 7.0).all() and (flat_v[untouched] == 7.0).all()


def test_rotary_cache_write_bf16_keeps_dtype(gen) -> None:
    q = randn(3, 2, 8, dtype=torch.bfloat16, gen=gen)
    k = randn(3, 1, 8, dtype=torch.bfloat16, gen=gen)
    v = randn(3, 1, 8, dtype=torch.bfloat16, gen=gen)
    k_cache = torch.zeros(2, 16, 1, 8, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    q32, k32 = q.float(), k.float()
    positions = torch.tensor([5, 6, 7])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    ref.rotary_cache_write(q, k, v, positions, inv_freq, k_cache, v_cache, torch.tensor([16, 17, 18]))
    cos, sin = hf_cos_sin(positions, inv_freq)
    want_q, _ = apply_rotary_pos_emb(q32.transpose(0, 1)[None], k32.transpose(0, 1)[None], cos[None], sin[None])
    assert q.dtype == torch.bfloat16
    torch.testing.assert_close(q.float(), want_q[0].transpose(0, 1), rtol=1e-2, atol=1e-2)
    assert torch.equal(k_cache[1, :3], k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["fused", "head-major"])
def test_rotary_cache_write_writes_through_strided_views(gen, dtype, layout) -> None:
    """q, k, v as the column slices of one fused QKV output (or [H, T, D] buffers transposed) give bit for bit
    what contiguous copies give, with q and k rotated inside their buffer and everything else left alone."""
    num_tokens, num_q_heads, num_kv_heads, head_dim = 6, 4, 2, 8
    widths = [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    if layout == "fused":
        qkv = randn(num_tokens, sum(widths), dtype=dtype, gen=gen)
        q, k, v = [x.unflatten(-1, (-1, head_dim)) for x in qkv.split(widths, dim=-1)]
    else:
        q, k, v = [randn(h, num_tokens, head_dim, dtype=dtype, gen=gen).transpose(0, 1)
                   for h in (num_q_heads, num_kv_heads, num_kv_heads)]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    dense_q, dense_k, dense_v = [x.contiguous() for x in (q, k, v)]
    v_before = v.clone()
    positions = torch.tensor([0, 7, 8, 300, 4000, 5])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    slots = torch.tensor([2, -1, 9, 0, 15, 4])
    caches = [torch.full((4, 4, num_kv_heads, head_dim), 7.0, dtype=dtype) for _ in range(4)]

    ref.rotary_cache_write(q, k, v, positions, inv_freq, caches[0], caches[1], slots)
    ref.rotary_cache_write(dense_q, dense_k, dense_v, positions, inv_freq, caches[2], caches[3], slots)
    for got, want in ((q, dense_q), (k, dense_k), (v, v_before), (caches[0], caches[2]), (caches[1], caches[3])):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    if layout == "fused":  # the rotation landed in the fused buffer itself
        torch.testing.assert_close(qkv, torch.cat([dense_q.flatten(1), dense_k.flatten(1), v_before.flatten(1)], 1),
                                   rtol=0, atol=0)


# ---------------------------------------------------------------- paged attention


def naive_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [Q, Hq, D] for the last Q positions of a sequence whose full k/v are [N, Hkv, D]; loops over queries
    and heads."""
    num_q, num_q_heads, _ = q.shape
    num_ctx, num_kv_heads, _ = k.shape
    out = torch.empty(num_q, num_q_heads, q.shape[2])
    for i in range(num_q):
        pos = num_ctx - num_q + i
        for h in range(num_q_heads):
            kv_head = h // (num_q_heads // num_kv_heads)
            scores = (k[: pos + 1, kv_head] @ q[i, h]) * scale
            out[i, h] = torch.softmax(scores, dim=0) @ v[: pos + 1, kv_head]
    return out


class PagedSetup:
    """Dense per-sequence K/V scattered into shuffled pages of a NaN-filled cache (unwritten slots poison)."""

    def __init__(self, context_lens: list[int], page_size: int, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, gen: torch.Generator) -> None:
        pages_needed = [-(-n // page_size) for n in context_lens]
        num_pages = sum(pages_needed) + 2
        perm = torch.randperm(num_pages, generator=gen).tolist()
        self.k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), float("nan"))
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        self.dense_k, self.dense_v, tables = [], [], []
        for n, needed in zip(context_lens, pages_needed):
            table, perm = perm[:needed], perm[needed:]
            k, v = randn(n, num_kv_heads, head_dim, gen=gen), randn(n, num_kv_heads, head_dim, gen=gen)
            for pos in range(n):
                self.k_cache[table[pos // page_size], pos % page_size] = k[pos]
                self.v_cache[table[pos // page_size], pos % page_size] = v[pos]
            self.dense_k.append(k)
            self.dense_v.append(v)
            tables.append(table)
        max_blocks = max(pages_needed)
        self.block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
        self.context_lens = torch.tensor(context_lens, dtype=torch.int32)


@pytest.mark.parametrize("page_size", [16, 32])
def test_paged_attention_matches_naive(gen, page_size) -> None:
    num_q_heads, num_kv_heads, head_dim, scale = 6, 2, 8, 0.3
    context_lens = [37, 5, 64, 1, 20]
    q_lens = [37, 2, 17, 1, 1]  # a whole prompt, chunks over cached pages, decode rows
    setup = PagedSetup(context_lens, page_size, num_q_heads, num_kv_heads, head_dim, gen)
    q = randn(sum(q_lens), num_q_heads, head_dim, gen=gen)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    got = ref.paged_attention(q, setup.k_cache, setup.v_cache, setup.block_tables, cu, setup.context_lens,
                              scale, max(q_lens), 0, 0.0)
    for b in range(len(q_lens)):
        want = naive_causal_attention(q[cu[b] : cu[b + 1]], setup.dense_k[b], setup.dense_v[b], scale)
        torch.testing.assert_close(got[cu[b] : cu[b + 1]], want, rtol=1e-5, atol=1e-5)


def test_paged_attention_rejects_more_queries_than_context(gen) -> None:
    setup = PagedSetup([3], 16, 2, 1, 8, gen)
    q = randn(4, 2, 8, gen=gen)
    with pytest.raises(ValueError, match="4 queries but max_q_len=4, context_len=3"):
        ref.paged_attention(q, setup.k_cache, setup.v_cache, setup.block_tables,
                            torch.tensor([0, 4], dtype=torch.int32), setup.context_lens, 1.0, 4, 0, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_paged_attention_with_one_query(gen, dtype) -> None:
    num_q_heads, num_kv_heads, head_dim, scale = 8, 2, 16, 0.25
    context_lens = [1, 16, 17, 90, 33, 48]
    setup = PagedSetup(context_lens, 16, num_q_heads, num_kv_heads, head_dim, gen)
    k_cache, v_cache = setup.k_cache.to(dtype), setup.v_cache.to(dtype)
    q = randn(len(context_lens), num_q_heads, head_dim, dtype=dtype, gen=gen)
    cu = torch.arange(len(context_lens) + 1, dtype=torch.int32)
    decode = ref.paged_attention_decode(q, k_cache, v_cache, setup.block_tables, setup.context_lens, scale, 0, 0.0)
    general = ref.paged_attention(q, k_cache, v_cache, setup.block_tables, cu, setup.context_lens, scale, 1, 0, 0.0)
    assert decode.dtype == dtype and not decode.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(decode.float(), general.float(), rtol=tol, atol=tol)
    if dtype == torch.float32:
        for b in range(len(context_lens)):
            want = naive_causal_attention(q[b : b + 1], setup.dense_k[b], setup.dense_v[b], scale)
            torch.testing.assert_close(decode[b : b + 1], want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- page copy


def test_copy_page_slots(gen) -> None:
    k_cache = randn(3, 5, 16, 2, 4, gen=gen)
    v_cache = randn(3, 5, 16, 2, 4, gen=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    ref.copy_page_slots(k_cache, v_cache, 1, 4, 9)
    for layer in range(3):
        for page in range(5):
            for slot in range(16):
                source = (layer, 1, slot) if (page == 4 and slot < 9) else (layer, page, slot)
                assert torch.equal(k_cache[layer, page, slot], k_before[source])
                assert torch.equal(v_cache[layer, page, slot], v_before[source])


def test_copy_page_slots_rejects_bad_slot_count(gen) -> None:
    k_cache = randn(1, 2, 16, 1, 4, gen=gen)
    with pytest.raises(ValueError, match="num_slots=17 outside"):
        ref.copy_page_slots(k_cache, k_cache.clone(), 0, 1, 17)
