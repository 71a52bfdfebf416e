"""The model and cache on a CUDA device (reference ops on the GPU) against transformers on the CPU."""

from __future__ import annotations

import pytest
import torch
from tiny_models import LLAMA3_ROPE, hf_logits, load_hf_model, make_hf_model

from folio import ops
from folio.kv_cache import Cache
from folio.model.batch import ForwardBatch, SeqChunk
from folio.model.model import Model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT = list(range(5, 60))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float().cpu() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("arch, overrides", [("llama", {"rope_parameters": LLAMA3_ROPE}), ("qwen2", {}),
                                             ("qwen3", {"tie": True})])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_cuda_prefill_and_decode_match_transformers(tmp_path, monkeypatch, arch, overrides, dtype, tolerance) -> None:
    linear_rows = []  # rows of every input that the model sends to the decode GEMV (ops.linear)
    real_linear = ops.linear
    monkeypatch.setattr(ops, "linear",
                        lambda x, w, b=None, **fused: linear_rows.append(x.shape[0]) or real_linear(x, w, b, **fused))
    path = make_hf_model(tmp_path, arch, **overrides)
    want = hf_logits(load_hf_model(path), PROMPT)
    model = Model.from_pretrained(path, device="cuda", dtype=dtype, progress=False)
    assert model.device == torch.device("cuda", torch.cuda.current_device())
    assert model.weights.layers[0].qkv.device == model.device and model.weights.layers[0].qkv.dtype == dtype
    cache = Cache(model, num_tokens=8 * 16, page_size=16)
    table = [6, 1, 7, 3]
    split = 37
    prefill = model.forward(ForwardBatch.build([SeqChunk(PROMPT[:split], 0, table, "all")], 16, model.device), cache)
    decode = [
        model.forward(ForwardBatch.build([SeqChunk([PROMPT[pos]], pos, table, "last")], 16, model.device), cache)
        for pos in range(split, len(PROMPT))
    ]
    got = torch.cat([prefill, *decode])
    assert got.device == model.device and got.dtype == torch.float32
    assert rel_err(got, want) <= tolerance
    # prefill (37 rows) stays on F.linear; each decode step sends qkv, o_proj, gate_up, down and lm_head
    assert linear_rows == [1] * (len(decode) * (4 * model.config.num_layers + 1))


def test_cache_sized_from_free_memory(tmp_path) -> None:
    model = Model.from_pretrained(make_hf_model(tmp_path, "llama"), device="cuda", progress=False)
    free_bytes, _ = torch.cuda.mem_get_info(model.device)
    cache = Cache(model, page_size=256, max_memory_fraction=0.01)
    assert cache.num_pages == int(free_bytes * 0.01) // cache.bytes_per_page
    assert cache.bytes == cache.k.numel() * 4 * 2
    with pytest.raises(ValueError, match=r"max_memory_fraction=1.5 must be in \(0, 1\]"):
        Cache(model, max_memory_fraction=1.5)


@pytest.mark.parametrize("mode, page_size", [("flash_paged", 256), ("flash_gather", 16), ("flash_gather", 256)])
def test_flash_prefill_attention_matches_reference(mode, page_size) -> None:
    """The tensor-core prefill path on a mixed batch: a chunk continuing a cached context across pages, a whole
    prompt, a decode row; shuffled pages. flash_paged needs a torch whose FA2 takes a block table."""
    from folio import reference_ops
    from folio.model import flash

    gen = torch.Generator(device="cuda").manual_seed(1)
    lens = [(300, 45), (37, 37), (290, 1)]  # (context, new tokens)
    pages_per_seq = [-(-ctx // page_size) for ctx, _ in lens]
    num_pages = sum(pages_per_seq) + 2
    k_cache = torch.randn(num_pages, page_size, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn(num_pages, page_size, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    order = torch.randperm(num_pages).tolist()
    chunks, used = [], 0
    for (ctx, new), n in zip(lens, pages_per_seq):
        chunks.append(SeqChunk([0] * new, ctx - new, order[used:used + n]))
        used += n
    batch = ForwardBatch.build(chunks, page_size, "cuda")
    q = torch.randn(batch.num_tokens, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = 128**-0.5
    chosen = flash.choose_mode(q, k_cache, scale, mode)
    if chosen == "paged":
        pytest.skip(f"{mode} does not run with this torch (probe failed)")
    prefill = flash.plan(chosen, batch, page_size)
    assert prefill is not None and prefill.mode == mode
    got = flash.attention(q, k_cache, v_cache, batch, prefill, scale).float()
    want = reference_ops.paged_attention(q.float(), k_cache.float(), v_cache.float(), batch.block_tables,
                                         batch.cu_seqlens_q, batch.context_lens, scale, batch.max_q_len)
    assert ((got - want).norm() / want.norm()).item() < 1e-2

