"""The flash prefill path's bookkeeping on the CPU: FA2 itself is replaced by a plain varlen causal attention, so
what is checked is the split into multi-token and one-token rows, the K/V gather through shuffled pages and the
cumulative lengths (the GPU test in test_model_gpu.py runs the real FA2)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from folio import reference_ops
from folio.model import flash
from folio.model.batch import ForwardBatch, SeqChunk
from folio.ops import OpSet


def new_state(dense_cudnn: bool = True) -> flash.FlashState:
    """A model's flash state: probes and the shapes seen start empty for every test."""
    return flash.FlashState(OpSet(), dense_cudnn=dense_cudnn)


def varlen_causal(q, k, v, cu_q, cu_k, max_q, max_k, scale, block_table=None, window=0):
    """Bottom-right aligned causal attention over packed sequences (FA2 varlen's semantics), with GQA; window > 0:
    FA2's left window of window - 1 keys before the query's own."""
    assert block_table is None
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cu_q) - 1):
        qs, ks = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]].repeat_interleave(group, dim=1)
        vs = v[cu_k[b]:cu_k[b + 1]].repeat_interleave(group, dim=1)
        n_q, n_k = qs.shape[0], ks.shape[0]
        assert n_q <= max_q and n_k <= max_k
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        mask = torch.arange(n_k)[None, :] <= torch.arange(n_k - n_q, n_k)[:, None]
        if window:
            mask &= torch.arange(n_k)[None, :] > torch.arange(n_k - n_q, n_k)[:, None] - window
        out[cu_q[b]:cu_q[b + 1]] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, -torch.inf).softmax(-1),
                                                vs)
    return out


def fused_inputs(batch: ForwardBatch, gen: torch.Generator, k_cache: torch.Tensor, v_cache: torch.Tensor):
    """q and the new tokens' K/V as column slices of one fused QKV output, the K/V also written to the cache."""
    qkv = torch.randn(batch.num_tokens, (6 + 2 * 2) * 16, generator=gen)
    qkv[:, 6 * 16 : 8 * 16] = k_cache.view(-1, 32)[batch.slot_mapping]
    qkv[:, 8 * 16 :] = v_cache.view(-1, 32)[batch.slot_mapping]
    return qkv[:, : 6 * 16].view(-1, 6, 16), qkv[:, 6 * 16 : 8 * 16].view(-1, 2, 16), qkv[:, 8 * 16 :].view(-1, 2, 16)


def build(lens, page_size=16, seed=0):
    """A batch of (context, new tokens) chunks over shuffled pages: the batch, random K/V caches, and q/k/v as
    fused_inputs makes them."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-ctx // page_size) for ctx, _ in lens]
    num_pages = sum(pages_per_seq) + 1
    k_cache = torch.randn(num_pages, page_size, 2, 16, generator=gen)
    v_cache = torch.randn(num_pages, page_size, 2, 16, generator=gen)
    order = torch.randperm(num_pages, generator=gen).tolist()
    chunks, used = [], 0
    for (ctx, new), n in zip(lens, pages_per_seq):
        chunks.append(SeqChunk([0] * new, ctx - new, order[used:used + n]))
        used += n
    batch = ForwardBatch.build(chunks, page_size, "cpu")
    return batch, k_cache, v_cache, fused_inputs(batch, gen, k_cache, v_cache)


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("lens", [
    [(300, 45), (37, 37), (290, 1)],
    [(64, 64)],
    [(5, 1), (700, 200), (17, 1), (1, 1), (33, 2)],
    # fresh prompts (no cached prefix) as one run: after the decoding rows, before them, alone; and split by one
    [(290, 1), (17, 1), (37, 37), (64, 64)],
    [(37, 37), (64, 64), (5, 1)],
    [(37, 37), (2, 2)],
    [(37, 37), (5, 1), (64, 64)],
])
def test_flash_gather_plan_matches_reference(monkeypatch, page_size, lens) -> None:
    monkeypatch.setattr(flash, "_flash", varlen_causal)
    batch, k_cache, v_cache, (q, k_new, v_new) = build(lens, page_size, seed=page_size + len(lens))
    state = new_state()
    prefill = flash.plan(state, "flash_gather", batch, page_size)
    assert prefill is not None
    assert (prefill.short_rows is None) == all(new > 1 for _, new in lens)
    long_rows = [i for i, row in enumerate(r for (ctx, new) in lens for r in [new > 1] * new) if row]
    contiguous = long_rows[-1] + 1 - long_rows[0] == len(long_rows)
    assert prefill.long_span == ((long_rows[0], long_rows[-1] + 1) if contiguous else None)
    assert prefill.fresh == all(ctx == new for ctx, new in lens if new > 1)
    want = reference_ops.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens_q,
                                         batch.context_lens, 0.25, batch.max_q_len, 0, 0.0)
    for new_kv in ({}, {"k_new": k_new, "v_new": v_new}):
        got = flash.attention(state, q, k_cache, v_cache, batch, prefill, 0.25, **new_kv)
        assert got.shape == q.shape and got.is_contiguous()
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    if prefill.fresh and prefill.long_span is not None:
        # the prompts' K/V come from k_new/v_new, not from the cache: poisoning their cache slots changes nothing
        poisoned = k_cache.clone()
        poisoned.view(-1, 32)[batch.slot_mapping[long_rows]] = float("nan")
        got = flash.attention(state, q, poisoned, v_cache, batch, prefill, 0.25, k_new=k_new, v_new=v_new)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("window,softcap", [(9, 0.0), (40, 0.0), (9, 2.0)])
def test_flash_gather_with_window_over_released_pages(monkeypatch, window, softcap) -> None:
    """Every layer windowed: the gather starts at each sequence's window (the pages before it are released: their
    entries RELEASED_PAGE, their slots NaN), FA2 gets the window; soft-capping runs on the paged op instead."""
    from folio.cache.window_release import RELEASED_PAGE

    monkeypatch.setattr(flash, "_flash", varlen_causal)
    lens = [(300, 45), (37, 37), (290, 1), (100, 3)]
    batch, k_cache, v_cache, (q, _, _) = build(lens, 16, seed=window)
    tables = batch.block_tables.clone()
    for b, (ctx, new) in enumerate(lens):
        for j in range(max(0, ctx - new - window + 1) // 16):
            k_cache[tables[b, j]] = float("nan")
            v_cache[tables[b, j]] = float("nan")
            tables[b, j] = RELEASED_PAGE
    want = reference_ops.paged_attention(q, k_cache, v_cache, tables, batch.cu_seqlens_q, batch.context_lens, 0.25,
                                         batch.max_q_len, window, softcap)
    assert not want.isnan().any()
    batch = dataclasses.replace(batch, block_tables=tables)
    prefill = flash.plan(new_state(), "flash_gather", batch, 16, released_window=window)
    got = flash.attention(new_state(), q, k_cache, v_cache, batch, prefill, 0.25, window=window, softcap=softcap)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


def test_flash_gather_declines_decode_only_and_huge_batches(monkeypatch) -> None:
    state = new_state()
    decode = ForwardBatch.build([SeqChunk([1], 9, [0]), SeqChunk([2], 3, [1])], 16, "cpu")
    assert flash.plan(state, "flash_gather", decode, 16) is None
    assert flash.plan(state, "paged", decode, 16) is None
    monkeypatch.setattr(flash, "GATHER_MAX_TOKENS", 100)
    big = ForwardBatch.build([SeqChunk([1] * 20, 90, list(range(7)))], 16, "cpu")
    assert flash.plan(state, "flash_gather", big, 16) is None


def test_cpu_and_fp32_never_take_the_flash_path() -> None:
    k_cache = torch.zeros(2, 16, 2, 16)
    assert flash.choose_mode(new_state(), torch.zeros(0, 4, 16), k_cache, 1.0) == "paged"
    assert flash.choose_mode(new_state(), torch.zeros(0, 4, 16, dtype=torch.bfloat16), k_cache, 1.0) == "paged"


def dense_causal(q, k, v, batch, length, scale):
    """cuDNN's dense batched attention replaced by the varlen reference over equal lengths."""
    cu = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32)
    return varlen_causal(q, k, v, cu, cu, length, length, scale)


@pytest.fixture
def dense_on_cpu(monkeypatch):
    """The equal-length dense path made to run on the CPU: its backend is the reference; calls are recorded."""
    calls = []
    monkeypatch.setattr(flash, "_flash", varlen_causal)
    monkeypatch.setattr(flash, "_dense_runs_on", lambda state, device: True)
    monkeypatch.setattr(flash, "dense_cudnn_ok", lambda *args: True)
    monkeypatch.setattr(flash, "DENSE_MIN_WORK", 2 * 40 * 40)

    def recorded(q, k, v, batch, length, scale):
        calls.append((batch, length))
        return dense_causal(q, k, v, batch, length, scale)

    monkeypatch.setattr(flash, "_cudnn_dense", recorded)
    return calls


@pytest.mark.parametrize("lens", [
    [(40, 40)] * 3,
    [(290, 1), (17, 1), (40, 40), (40, 40)],  # decoding rows first, then the prompts
    [(40, 40), (40, 40), (5, 1)],  # the prompts first
])
def test_equal_length_fresh_prompts_go_dense_from_their_second_step(dense_on_cpu, lens) -> None:
    batch, k_cache, v_cache, (q, k_new, v_new) = build(lens)
    state = new_state()
    want = reference_ops.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens_q,
                                         batch.context_lens, 0.25, batch.max_q_len, 0, 0.0)
    prompts = sum(new > 1 for _, new in lens)
    for step in range(3):
        prefill = flash.plan(state, "flash_gather", batch, 16)
        # the first step of a shape stays on FA2: cuDNN would build a plan for a shape that may never come back
        assert prefill.dense == (None if step == 0 else (prompts, 40))
        got = flash.attention(state, q, k_cache, v_cache, batch, prefill, 0.25, k_new=k_new, v_new=v_new)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
        assert len(dense_on_cpu) == step  # one dense call per step after the first
    # without the new K/V in hand (the dense path reads them, not the cache) the same plan runs FA2
    got = flash.attention(state, q, k_cache, v_cache, batch, prefill, 0.25)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4) and len(dense_on_cpu) == 2


@pytest.mark.parametrize("lens", [
    [(40, 40), (41, 41)],  # unequal lengths
    [(60, 40), (60, 40)],  # a cached prefix: the context is longer than the new tokens
    [(39, 39), (39, 39)],  # below DENSE_MIN_WORK (2 x 39^2 < 2 x 40^2)
    [(40, 40), (5, 1), (40, 40)],  # the prompts are not one run
])
def test_other_prompt_steps_never_go_dense(dense_on_cpu, lens) -> None:
    batch, *_ = build(lens)
    state = new_state()
    for _ in range(3):
        assert flash.plan(state, "flash_gather", batch, 16).dense is None


def test_a_shape_cudnn_refuses_falls_back_to_fa2_for_good(dense_on_cpu, monkeypatch) -> None:
    batch, k_cache, v_cache, (q, k_new, v_new) = build([(40, 40)] * 2)
    state = new_state()
    want = reference_ops.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens_q,
                                         batch.context_lens, 0.25, batch.max_q_len, 0, 0.0)

    def refuse(*args):
        dense_on_cpu.append("refused")
        raise RuntimeError("no execution plan")

    monkeypatch.setattr(flash, "_cudnn_dense", refuse)
    flash.plan(state, "flash_gather", batch, 16)
    prefill = flash.plan(state, "flash_gather", batch, 16)
    assert prefill.dense == (2, 40)
    for _ in range(2):  # every layer of that step: tried once, then FA2
        got = flash.attention(state, q, k_cache, v_cache, batch, prefill, 0.25, k_new=k_new, v_new=v_new)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    assert dense_on_cpu == ["refused"]
    assert flash.plan(state, "flash_gather", batch, 16).dense is None


def test_dense_path_is_off_on_the_cpu_and_when_disabled() -> None:
    assert not flash._dense_runs_on(new_state(), torch.device("cpu"))
    assert flash._dense_runs_on(new_state(), torch.device("cuda", 0))
    assert not flash._dense_runs_on(new_state(dense_cudnn=False), torch.device("cuda", 0))  # prefill_cudnn=False


def test_a_model_keeps_its_own_flash_state(tmp_path) -> None:
    """Probe results and the dense path's switch are per model (EngineOptions), never shared through globals."""
    from tiny_models import make_hf_model

    from folio.model.model import Model
    from folio.options import EngineOptions

    model = Model.from_pretrained(make_hf_model(tmp_path, "llama"), progress=False)
    other = model.with_options(EngineOptions(prefill_cudnn=False, ops_backend="reference"))
    assert model.flash_state.dense_cudnn and not other.flash_state.dense_cudnn
    assert model.flash_state is not other.flash_state and other.weights is model.weights
    assert model.flash_state.ops is model.ops and other.ops.backend == "reference"
