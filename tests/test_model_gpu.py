"""The model and cache on a CUDA device (reference ops on the GPU) against transformers on the CPU."""

from __future__ import annotations

import pytest
import torch
from tiny_models import LLAMA3_ROPE, hf_logits, load_hf_model, make_hf_model

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
    path = make_hf_model(tmp_path, arch, **overrides)
    want = hf_logits(load_hf_model(path), PROMPT)
    model = Model.from_pretrained(path, device="cuda", dtype=dtype, progress=False)
    linear_rows = []  # rows of every input that the model sends to the decode GEMV (its op set's linear)
    real_linear = model.ops.linear
    monkeypatch.setattr(model.ops, "linear",
                        lambda x, w, b=None, **fused: linear_rows.append(x.shape[0]) or real_linear(x, w, b, **fused))
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
    del cache
    # memory kept for activations is set aside before the fraction is taken ...
    free_bytes, _ = torch.cuda.mem_get_info(model.device)
    reserve = free_bytes // 2
    cache = Cache(model, page_size=256, max_memory_fraction=0.02, reserve_bytes=reserve)
    assert cache.num_pages == int((free_bytes - reserve) * 0.02) // cache.bytes_per_page
    del cache
    # ... and a cache of a given size that leaves less than it free is refused before anything is allocated
    free_bytes, _ = torch.cuda.mem_get_info(model.device)
    with pytest.raises(ValueError, match="reserved for activations do not fit"):
        Cache(model, num_tokens=256, page_size=256, reserve_bytes=free_bytes)
    assert torch.cuda.mem_get_info(model.device)[0] == free_bytes
    Cache(model, num_tokens=256, page_size=256, reserve_bytes=free_bytes // 2)


def paged_batch(lens: list[tuple[int, int]], page_size: int, gen: torch.Generator):
    """A CUDA batch of (context, new tokens) chunks over shuffled pages, and random bf16 K/V caches (Llama-3-8B
    heads: 8 kv heads of 128)."""
    pages_per_seq = [-(-ctx // page_size) for ctx, _ in lens]
    num_pages = sum(pages_per_seq) + 2
    k_cache = torch.randn(num_pages, page_size, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn(num_pages, page_size, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    order = torch.randperm(num_pages).tolist()
    chunks, used = [], 0
    for (ctx, new), n in zip(lens, pages_per_seq):
        chunks.append(SeqChunk([0] * new, ctx - new, order[used:used + n]))
        used += n
    return ForwardBatch.build(chunks, page_size, "cuda"), k_cache, v_cache


@pytest.mark.parametrize("mode, page_size", [("flash_paged", 256), ("flash_gather", 16), ("flash_gather", 256)])
def test_flash_prefill_attention_matches_reference(mode, page_size) -> None:
    """The tensor-core prefill path on a mixed batch: a chunk continuing a cached context across pages, a whole
    prompt, a decode row; shuffled pages. flash_paged needs a torch whose FA2 takes a block table."""
    from folio import reference_ops
    from folio.model import flash
    from folio.ops import OpSet

    state = flash.FlashState(OpSet("native"))
    gen = torch.Generator(device="cuda").manual_seed(1)
    batch, k_cache, v_cache = paged_batch([(300, 45), (37, 37), (290, 1)], page_size, gen)  # (context, new)
    q = torch.randn(batch.num_tokens, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = 128**-0.5
    chosen = flash.choose_mode(state, q, k_cache, scale, mode)
    if chosen == "paged":
        pytest.skip(f"{mode} does not run with this torch (probe failed)")
    prefill = flash.plan(state, chosen, batch, page_size)
    assert prefill is not None and prefill.mode == mode
    got = flash.attention(state, q, k_cache, v_cache, batch, prefill, scale).float()
    want = reference_ops.paged_attention(q.float(), k_cache.float(), v_cache.float(), batch.block_tables,
                                         batch.cu_seqlens_q, batch.context_lens, scale, batch.max_q_len, 0, 0.0)
    assert ((got - want).norm() / want.norm()).item() < 1e-2



@pytest.mark.parametrize("page_size", [16, 256])
def test_cudnn_dense_prefill_matches_reference(monkeypatch, page_size) -> None:
    """Equal-length fresh prompts (with a decoding row beside them) on cuDNN's dense attention, from the second
    step of their shape on; q/k/v are strided slices of one fused QKV output, as the model passes them."""
    from folio import reference_ops
    from folio.model import flash
    from folio.ops import OpSet

    state = flash.FlashState(OpSet("native"))
    monkeypatch.setattr(flash, "DENSE_MIN_WORK", 3 * 300 * 300)  # a small case (the default wants 4M)
    gen = torch.Generator(device="cuda").manual_seed(3)
    batch, k_cache, v_cache = paged_batch([(290, 1), (300, 300), (300, 300), (300, 300)], page_size, gen)
    qkv = torch.randn(batch.num_tokens, (32 + 2 * 8) * 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    qkv[:, 32 * 128 : 40 * 128] = k_cache.view(-1, 8 * 128)[batch.slot_mapping]
    qkv[:, 40 * 128 :] = v_cache.view(-1, 8 * 128)[batch.slot_mapping]
    q = qkv[:, : 32 * 128].view(-1, 32, 128)
    k_new, v_new = qkv[:, 32 * 128 : 40 * 128].view(-1, 8, 128), qkv[:, 40 * 128 :].view(-1, 8, 128)
    scale = 128**-0.5
    mode = flash.choose_mode(state, q, k_cache, scale, "flash_gather")
    assert mode == "flash_gather"
    assert flash.dense_cudnn_ok(state, q.device, q.dtype, 32, 8, 128, scale), "cuDNN's dense attention fails here"
    want = reference_ops.paged_attention(q.float(), k_cache.float(), v_cache.float(), batch.block_tables,
                                         batch.cu_seqlens_q, batch.context_lens, scale, batch.max_q_len, 0, 0.0)
    outputs = []
    for step in range(2):
        prefill = flash.plan(state, mode, batch, page_size)
        assert prefill.dense == (None if step == 0 else (3, 300))
        outputs.append(flash.attention(state, q, k_cache, v_cache, batch, prefill, scale, k_new=k_new,
                                       v_new=v_new).float())
    assert state.dense_calls == 1
    for got in outputs:
        assert got.shape == q.shape
        assert ((got - want).norm() / want.norm()).item() < 1e-2
    # cuDNN (step 2) and FA2 (step 1) differ only by rounding
    assert ((outputs[1] - outputs[0]).norm() / outputs[0].norm()).item() < 1e-2


def test_logits_gemm_writes_fp32_directly() -> None:
    """Past the GEMV's rows, the logits come from one GEMM with fp32 output: the 16-bit product without its
    rounding to bf16 (so within bf16's rounding of it), and that path is the one taken on this device."""
    from types import SimpleNamespace

    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(3000, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    probes = SimpleNamespace(_mm_fp32_ok={})  # the model's per-instance probe cache, alone
    got = Model._mm_fp32(probes, x, weight)
    assert probes._mm_fp32_ok[(x.device, x.dtype)], "torch.mm(out_dtype=float32) is not used on this device"
    rounded = torch.nn.functional.linear(x, weight).float()
    exact = x.double() @ weight.double().t()
    assert got.dtype == torch.float32 and got.shape == (256, 3000)
    assert ((got.double() - exact).abs().max() <= (rounded.double() - exact).abs().max()).item()
    assert torch.allclose(got, rounded, rtol=1e-2, atol=1e-2)


def _bf16_model(**shape) -> Model:
    """A random bf16 Llama of the given shape, built on the GPU (no files)."""
    import transformers

    from folio.model.config import ModelConfig

    config = transformers.LlamaConfig(**shape, max_position_embeddings=4096, rms_norm_eps=1e-5)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            hf = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    raw = config.to_dict()
    raw.update(dtype="bfloat16", architectures=["LlamaForCausalLM"])
    return Model.from_state_dict(ModelConfig.from_dict(raw), hf.state_dict())


# (context, new tokens) of each sequence: equal fresh prompts (cuDNN's dense path from their second step) beside
# decode rows; prompts continuing cached prefixes (the flash path gathers their contexts from the cache); a full
# decode batch, where the sampler's buffers are most of the step.
_STEPS = {
    "fresh prompts and decode rows": [(1024, 1024)] * 8 + [(300, 1)] * 16,
    "cached prefixes": [(1280, 256), (2048, 1024)] + [(700, 1)] * 4,
    "decode rows": [(300, 1)] * 256,
}


@pytest.mark.parametrize("step", sorted(_STEPS))
@pytest.mark.parametrize("sampler", ["native", "torch, full sort"])
def test_step_activation_bytes_bounds_the_allocator_peak(step, sampler) -> None:
    """Model.step_activation_bytes against the caching allocator's own peak over a forward and its sampling: the
    native sampler (default settings), or the torch one at its largest (top tokens asked for, no top-k: a sort
    of the whole vocabulary). The bound must hold and stay within 2.5x of the peak, or the cache it sizes gives
    memory away -- except where the native sampler samples a full decode batch: the bound counts the torch
    path's buffers, which that step does not allocate."""
    from folio.sampling import RowParams, SamplerSettings, sample

    model = _bf16_model(num_hidden_layers=2, hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=128, intermediate_size=3584, vocab_size=32000)
    page_size = 256
    lens = _STEPS[step]
    cache = Cache(model, num_tokens=sum(-(-ctx // page_size) for ctx, _ in lens) * page_size, page_size=page_size)
    chunks, used = [], 0
    for ctx, new in lens:
        pages = -(-ctx // page_size)
        chunks.append(SeqChunk([7] * new, ctx - new, list(range(used, used + pages))))
        used += pages
    batch = ForwardBatch.build(chunks, page_size, model.device)
    full_sort = sampler != "native"
    settings = SamplerSettings(top_k=0, top_p=0.9) if full_sort else SamplerSettings()
    rows = [RowParams(settings, u=0.5, return_top_tokens=5 if full_sort else 0) for _ in lens]
    model.forward(batch, cache)  # first call: probes, plans and library workspaces are made once, not per step
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = sample(model.forward(batch, cache), rows, in_place=True)
    assert out.token_ids.shape == (len(lens),)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    multi_token_context = sum(ctx for ctx, new in lens if new > 1)
    bound = model.step_activation_bytes(batch.num_tokens, len(lens), max_context_tokens=multi_token_context)
    print(f"{step}, {sampler}: peak {peak / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB "
          f"({bound / peak:.2f}x)")
    assert peak <= bound
    if full_sort or step != "decode rows":
        assert bound <= 2.5 * peak
