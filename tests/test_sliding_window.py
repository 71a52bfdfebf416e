"""Sliding-window attention and attention soft-capping (GitHub issue 22, item 1).

Oracles: a brute-force masked softmax for the ops (reference, native CPU, and on a GPU the CUDA kernels and the
flash paths), Hugging Face transformers for the model's logits and greedy generation (Mistral with a small window on
every layer, Qwen2 with max_window_layers), and the page pool's own counts for the pages released before a window.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import DEMO_TOKENIZER_FILES
from tiny_models import hf_logits, load_hf_model, make_hf_model

import folio
from folio import reference_ops
from folio.cache.manager import KVCacheManager
from folio.cache.pool import PagePool
from folio.cache.window_release import RELEASED_PAGE
from folio.kv_cache import Cache
from folio.model.batch import ForwardBatch, SeqChunk
from folio.model.config import ConfigError, ModelConfig
from folio.model.model import Model
from folio.ops import load_native
from folio.options import EngineOptions
from folio.sequence import Sequence

NATIVE_CPU = load_native("cpu")
MAX_REL_ERR = 1e-4
WINDOW = 16


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


# --- the ops against a brute-force masked softmax ---


def brute_force(q, k_ctx, v_ctx, q_pos, scale, window, softcap):
    """q: [Q, Hq, D] at positions q_pos [Q]; k_ctx, v_ctx: [K, Hkv, D] at positions 0..K-1 -> [Q, Hq, D] fp32."""
    group = q.shape[1] // k_ctx.shape[1]
    k = k_ctx.float().repeat_interleave(group, 1)
    v = v_ctx.float().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    j = torch.arange(k.shape[0])[None, :]
    i = q_pos[:, None]
    visible = (j <= i) & ((j > i - window) if window else True)
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def paged_case(context_lens, page_size, num_kv_heads=2, group=3, head_dim=16, seed=0, release=0, q_lens=None):
    """Random caches holding each sequence's context in shuffled pages; returns (caches, block_tables, contexts).
    release: a window; the pages wholly before the window of each sequence's first query (q_lens new tokens each,
    default 1) get RELEASED_PAGE entries and NaN contents: they must not be read."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // page_size) for n in context_lens]
    num_pages = sum(pages) + 2
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    tables, contexts, used = [], [], 0
    for n, num in zip(context_lens, pages):
        table = perm[used:used + num]
        used += num
        contexts.append((k_cache[table].reshape(-1, num_kv_heads, head_dim)[:n].clone(),
                         v_cache[table].reshape(-1, num_kv_heads, head_dim)[:n].clone()))
        tables.append(table)
    if release:
        for table, n, m in zip(tables, context_lens, q_lens or [1] * len(context_lens)):
            dead = max(0, n - m - release + 1) // page_size  # before the first query's window
            for j in range(dead):
                k_cache[table[j]] = float("nan")
                v_cache[table[j]] = float("nan")
                table[j] = RELEASED_PAGE
    width = max(pages)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, block_tables, contexts


OPS_BACKENDS = ["reference"] + (["native"] if NATIVE_CPU is not None else [])


def op(backend, name):
    return getattr(reference_ops if backend == "reference" else NATIVE_CPU, name)


@pytest.mark.parametrize("backend", OPS_BACKENDS)
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (1, 0.0), (5, 0.0), (24, 0.0), (0, 2.5), (13, 2.5)])
@pytest.mark.parametrize("page_size", [4, 16])
def test_decode_op_against_brute_force(backend, window, softcap, page_size) -> None:
    lens = [1, 7, 40, 77]
    k_cache, v_cache, tables, contexts = paged_case(lens, page_size, seed=page_size + window)
    q = torch.randn(len(lens), 6, 16, generator=torch.Generator().manual_seed(5))
    got = op(backend, "paged_attention_decode")(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32),
                                                0.3, window, softcap)
    for b, n in enumerate(lens):
        want = brute_force(q[b:b + 1], *contexts[b], torch.tensor([n - 1]), 0.3, window, softcap)
        assert rel_err(got[b:b + 1], want) <= 1e-5, f"sequence {b}"


@pytest.mark.parametrize("backend", OPS_BACKENDS)
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (1, 0.0), (6, 0.0), (24, 0.0), (0, 3.0), (9, 3.0)])
@pytest.mark.parametrize("page_size", [4, 16])
def test_prefill_op_against_brute_force(backend, window, softcap, page_size) -> None:
    """Runs that continue a cached context (chunked prefill), a whole prompt and a one-token row."""
    lens, q_lens = [70, 33, 50], [21, 33, 1]
    k_cache, v_cache, tables, contexts = paged_case(lens, page_size, seed=7 * page_size + window)
    q = torch.randn(sum(q_lens), 6, 16, generator=torch.Generator().manual_seed(6))
    cu = torch.tensor([0, 21, 54, 55], dtype=torch.int32)
    got = op(backend, "paged_attention")(q, k_cache, v_cache, tables, cu, torch.tensor(lens, dtype=torch.int32),
                                         0.25, max(q_lens), window, softcap)
    for b, (n, m) in enumerate(zip(lens, q_lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want = brute_force(q[rows], *contexts[b], torch.arange(n - m, n), 0.25, window, softcap)
        assert rel_err(got[rows], want) <= 1e-5, f"sequence {b}"


@pytest.mark.parametrize("backend", OPS_BACKENDS)
def test_released_pages_before_the_window_are_never_read(backend) -> None:
    """Entries before the window are RELEASED_PAGE and their pages hold NaN: nothing of them reaches the output."""
    lens, window = [40, 77, 5], 9
    k_cache, v_cache, tables, contexts = paged_case(lens, 4, release=window)
    assert (tables == RELEASED_PAGE).any()
    q = torch.randn(3, 6, 16, generator=torch.Generator().manual_seed(1))
    lens_t = torch.tensor(lens, dtype=torch.int32)
    got = op(backend, "paged_attention_decode")(q, k_cache, v_cache, tables, lens_t, 0.3, window, 1.5)
    prefill = op(backend, "paged_attention")(q, k_cache, v_cache, tables, torch.arange(4, dtype=torch.int32),
                                             lens_t, 0.3, 1, window, 1.5)
    for b, n in enumerate(lens):
        want = brute_force(q[b:b + 1], *contexts[b], torch.tensor([n - 1]), 0.3, window, 1.5)
        assert rel_err(got[b:b + 1], want) <= 1e-5 and rel_err(prefill[b:b + 1], want) <= 1e-5


@pytest.mark.skipif(NATIVE_CPU is None, reason="folio._native_cpu is not built")
def test_native_checks_window_arguments_and_released_entries() -> None:
    k_cache, v_cache, tables, _ = paged_case([40], 4)
    q, lens = torch.randn(1, 6, 16), torch.tensor([40], dtype=torch.int32)
    with pytest.raises(ValueError, match="window"):
        NATIVE_CPU.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.3, -1, 0.0)
    with pytest.raises(ValueError, match="softcap"):
        NATIVE_CPU.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.3, 0, float("nan"))
    tables[0, 5] = RELEASED_PAGE  # positions 20..23: inside a window of 30
    with pytest.raises(ValueError, match="block_tables"):
        NATIVE_CPU.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.3, 30, 0.0)
    NATIVE_CPU.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.3, 16, 0.0)  # before a window of 16
    with pytest.raises(ValueError, match="window"):
        reference_ops.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.3, -2, 0.0)


# --- config ---


def config(arch: str, **fields) -> ModelConfig:
    raw = dict(architectures=[arch], num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
               intermediate_size=128, vocab_size=100, max_position_embeddings=8192, rms_norm_eps=1e-6, **fields)
    return ModelConfig.from_dict(raw)


def test_config_layer_windows() -> None:
    assert config("MistralForCausalLM", sliding_window=4096).layer_windows == (4096,) * 4  # Mistral-7B-v0.1
    assert config("MistralForCausalLM", sliding_window=None).layer_windows == (0,) * 4
    assert config("MistralForCausalLM", sliding_window=8192).layer_windows == (0,) * 4  # never masks anything
    assert config("LlamaForCausalLM").layer_windows == (0,) * 4
    qwen = dict(sliding_window=64, max_window_layers=1)
    assert config("Qwen2ForCausalLM", **qwen).layer_windows == (0,) * 4  # without use_sliding_window
    assert config("Qwen2ForCausalLM", use_sliding_window=True, **qwen).layer_windows == (0, 64, 64, 64)
    assert config("Qwen3ForCausalLM", use_sliding_window=True, sliding_window=64).layer_windows == (0,) * 4  # 28
    types = ["sliding_attention", "full_attention"] * 2
    assert config("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=32,
                  layer_types=types).layer_windows == (32, 0, 32, 0)
    assert config("MistralForCausalLM").attn_logit_softcap == 0.0


@pytest.mark.parametrize("fields,match", [
    (dict(sliding_window=0), "sliding_window"),
    (dict(sliding_window=-4), "sliding_window"),
    (dict(sliding_window="4096"), "sliding_window"),
])
def test_config_refuses_nonsense_windows(fields, match) -> None:
    with pytest.raises(ConfigError, match=match):
        config("MistralForCausalLM", **fields)


@pytest.mark.parametrize("fields,match", [
    (dict(layer_types=["sliding_attention"] * 3), "layer_types"),
    (dict(layer_types=["local"] * 4), "layer_types"),
    (dict(max_window_layers=-1), "max_window_layers"),
    (dict(use_sliding_window="yes"), "use_sliding_window"),
])
def test_config_refuses_nonsense_qwen_windows(fields, match) -> None:
    with pytest.raises(ConfigError, match=match):
        config("Qwen2ForCausalLM", **{"use_sliding_window": True, "sliding_window": 32, **fields})


# --- the model against transformers ---

MODELS = {
    "mistral": dict(arch="mistral", sliding_window=WINDOW),
    "qwen2": dict(arch="qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
}
PROMPT_LENS = (83, 61)
BACKENDS = ["reference"] + (["auto"] if NATIVE_CPU is not None else [])


@pytest.fixture(scope="module", params=list(MODELS))
def windowed(request, tmp_path_factory):
    spec = dict(MODELS[request.param])
    path = make_hf_model(tmp_path_factory.mktemp(request.param), spec.pop("arch"), **spec)
    hf = load_hf_model(path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    model = Model.from_pretrained(path, progress=False)
    assert any(model.config.layer_windows)
    return model, prompts, [hf_logits(hf, p) for p in prompts]


def forward(model, cache, chunks):
    return model.forward(ForwardBatch.build(chunks, cache.page_size, model.device), cache)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [16, 64])
def test_model_matches_transformers(windowed, backend, page_size) -> None:
    """Whole prompt, then chunked prefill (chunks start mid-page), then both prompts decoded together."""
    model, prompts, want = windowed
    model = model.with_options(EngineOptions(ops_backend=backend))
    pages = [-(-n // page_size) for n in (*PROMPT_LENS, PROMPT_LENS[0])]
    cache = Cache(model, num_tokens=(sum(pages) + 1) * page_size, page_size=page_size)
    cache.k.fill_(float("nan"))  # a slot read before it is written poisons the logits
    cache.v.fill_(float("nan"))
    ids = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(page_size)).add(1).tolist()
    tables = [ids[:pages[0]], ids[pages[0]:pages[0] + pages[1]], ids[pages[0] + pages[1]:]]
    whole = forward(model, cache, [SeqChunk(prompts[0], 0, tables[0], "all")])
    assert rel_err(whole, want[0]) <= MAX_REL_ERR

    got, start = [], 0
    for size in (5, 20, 1, 33, 24):
        got.append(forward(model, cache, [SeqChunk(prompts[0][start:start + size], start, tables[2], "all")]))
        start += size
    assert rel_err(torch.cat(got), want[0]) <= MAX_REL_ERR

    split = 30
    first = forward(model, cache, [SeqChunk(prompts[1][:split], 0, tables[1], "all")])
    rows = [first]
    for pos in range(split, PROMPT_LENS[1]):  # prompt 1 decodes beside prompt 0's (re-fed) tail
        chunks = [SeqChunk([prompts[1][pos]], pos, tables[1], "last"),
                  SeqChunk([prompts[0][pos]], pos, tables[2], "last")]
        logits = forward(model, cache, chunks)
        rows.append(logits[:1])
        assert rel_err(logits[1:], want[0][pos:pos + 1]) <= MAX_REL_ERR
    assert rel_err(torch.cat(rows), want[1]) <= MAX_REL_ERR


# --- the generator: greedy past the window, and pages released before it ---


@pytest.fixture(scope="module")
def mistral_engine(tmp_path_factory, demo_dir):
    config = json.loads((demo_dir / "config.json").read_text())
    path = tmp_path_factory.mktemp("windowed-mistral")
    make_hf_model(path, "mistral", vocab_size=config["vocab_size"], max_position_embeddings=1024,
                  sliding_window=WINDOW, bos_token_id=config.get("bos_token_id"),
                  eos_token_id=config.get("eos_token_id"))
    for name in DEMO_TOKENIZER_FILES:
        if (demo_dir / name).exists():
            shutil.copy(demo_dir / name, path / name)
    return path, folio.Model.from_pretrained(path, progress=False), folio.Tokenizer.from_pretrained(path)


def greedy_job(ids, max_new_tokens):
    return folio.DynamicJob(input_ids=ids, max_new_tokens=max_new_tokens,
                            gen_settings=folio.SamplerSettings.greedy(), stop_conditions=[])


def check_greedy_past_the_window(generator: folio.DynamicGenerator, path, tokenizer) -> None:
    """3 windows of greedy tokens from a prompt shorter than 2 windows, the pool checked at every step, equal to
    transformers' greedy choices (one whole forward per token, no stop token)."""
    prompt = tokenizer.encode("The lighthouse keeper walked along the shore at dawn, counting the gulls")
    assert len(prompt) < WINDOW * 2
    job = greedy_job(prompt, 3 * WINDOW)
    generator.enqueue(job)
    while generator.num_remaining_jobs():
        generator.step()
        generator.cache_manager.check()
    hf, ids = load_hf_model(path), list(prompt)
    for _ in range(3 * WINDOW):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
    assert job.generated_ids == ids[len(prompt):]


def test_generator_greedy_past_the_window_equals_transformers(mistral_engine) -> None:
    path, model, tokenizer = mistral_engine
    cache = folio.Cache(model, num_tokens=1024, page_size=16)
    generator = folio.DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer, max_chunk_size=16)
    check_greedy_past_the_window(generator, path, tokenizer)


def test_generator_releases_pages_before_the_window(mistral_engine) -> None:
    _, model, tokenizer = mistral_engine
    page_size = 16
    generator = folio.DynamicGenerator(model=model, cache=folio.Cache(model, num_tokens=4096, page_size=page_size),
                                       tokenizer=tokenizer, max_chunk_size=32)
    manager = generator.cache_manager
    assert manager.window == WINDOW
    long_prompt = (tokenizer.encode("Ships and harbours and the open sea, " * 12))[:150]
    job = greedy_job(long_prompt, 40)
    generator.enqueue(job)
    seq = None
    while generator.num_remaining_jobs():
        generator.step()
        manager.check()
        seq = next(iter(generator.scheduler.active), seq)
        if seq is not None and seq.num_cached_tokens > 100:
            break
    held = len(seq.block_table) - seq.num_released_pages
    assert seq.num_released_pages == (seq.num_cached_tokens - WINDOW + 1) // page_size >= 5
    assert seq.block_table[:seq.num_released_pages] == [RELEASED_PAGE] * seq.num_released_pages
    assert manager.num_in_use == held <= -(-WINDOW // page_size) + 2  # a window's pages and the one being filled
    assert manager.num_cached >= seq.num_released_pages  # released full pages stay cached under their hash

    hits_before = manager.stats().num_hit_pages
    short = greedy_job(long_prompt[:70], 2)  # its first 4 pages are among the released ones
    generator.enqueue(short)
    while generator.num_remaining_jobs():
        generator.step()
        manager.check()
    assert manager.stats().num_hit_pages - hits_before == (70 - 1) // page_size
    assert len(job.generated_ids) == 40


def test_rollback_takes_released_pages_back() -> None:
    pool = PagePool(16, 4)
    manager = KVCacheManager(16, 4, pool=pool, window=6)
    job = greedy_job(list(range(1, 30)), 8)
    seq = Sequence(job=job, token_ids=list(range(1, 30)))
    manager.start(seq)
    assert manager.allocate(seq, 29)
    manager.commit(seq, 28)  # the next token (position 28) sees 23..28: pages 0..4 (positions 0..19) are dead
    assert seq.num_released_pages == 5 and pool.num_in_use == 3
    manager.check()
    seq.token_ids += [40, 41, 42, 43, 44]
    manager.allocate(seq, 34)
    manager.commit(seq, 33)
    released = seq.num_released_pages
    manager.rollback(seq, 5)  # back to position 28: its window reaches page 5 and on again
    assert seq.num_released_pages == (seq.num_cached_tokens - 6 + 1) // 4 <= released
    assert RELEASED_PAGE not in seq.block_table[seq.num_released_pages:]
    manager.check()
    manager.free(seq)
    assert pool.num_in_use == 0
    manager.check()


# --- CUDA (run by the lead on an H100) ---


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (37, 0.0), (200, 0.0), (0, 30.0), (64, 30.0)])
def test_cuda_kernels_match_reference(dtype, window, softcap) -> None:
    """Decode on the tensor-core (MMA) and CUDA-core (SIMT) kernels with long contexts (several splits, pages
    before the window released), prefill on the paged kernel, against the reference ops."""
    if not torch.cuda.is_available() or load_native("cuda") is None:
        pytest.skip("needs CUDA and folio._native_cuda")
    native = load_native("cuda")
    lens, q_lens = [1, 130, 700, 2100], [1, 50, 300, 7]
    k_cache, v_cache, tables, _ = paged_case(lens, 16, num_kv_heads=2, group=4, head_dim=128, release=window,
                                             q_lens=q_lens)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 8, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = reference_ops.paged_attention_decode(q.float(), k_cache.float(), v_cache.float(), tables, lens_t,
                                                128**-0.5, window, softcap)
    dev = [t.cuda() for t in (q, k_cache, v_cache, tables, lens_t)]
    for use_mma in (True, False):
        got = native.paged_attention_decode(*dev, 128**-0.5, window, softcap, use_mma=use_mma)
        assert rel_err(got.cpu(), want) <= 2e-2, f"use_mma={use_mma}"
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    qp = torch.randn(sum(q_lens), 8, 128, generator=torch.Generator().manual_seed(4)).to(dtype)
    args = (k_cache, v_cache, tables, cu, lens_t, 128**-0.5, max(q_lens), window, softcap)
    want = reference_ops.paged_attention(qp.float(), *(a.float() if a.is_floating_point() else a for a in args[:2]),
                                         *args[2:])
    got = native.paged_attention(qp.cuda(), *(a.cuda() if isinstance(a, torch.Tensor) else a for a in args))
    assert rel_err(got.cpu(), want) <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["flash_gather", "flash_paged"])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (37, 0.0), (37, 20.0)])
def test_cuda_flash_prefill_with_window(mode, window, softcap) -> None:
    """flash.attention (FA2 with its left window; soft-capping falls back to our kernel) against the reference,
    pages before the window released; a mode that cannot run here falls back to 'paged' in choose_mode."""
    from folio import ops
    from folio.model import flash

    if not torch.cuda.is_available() or load_native("cuda") is None:
        pytest.skip("needs CUDA and folio._native_cuda")
    page_size = 256 if mode == "flash_paged" else 16
    lens, q_lens = [600, 300, 900], [200, 300, 1]
    k_cache, v_cache, tables, _ = paged_case(lens, page_size, head_dim=128, release=window, q_lens=q_lens)
    state = flash.FlashState(ops.OpSet(), windowed=True)
    k_cache, v_cache = k_cache.bfloat16().cuda(), v_cache.bfloat16().cuda()
    q = torch.randn(sum(q_lens), 6, 128, generator=torch.Generator().manual_seed(8)).bfloat16().cuda()
    if flash.choose_mode(state, q, k_cache, 128**-0.5, mode) != mode:
        pytest.skip(f"{mode} does not run here")
    block_tables = [tables[b, :-(-n // page_size)].tolist() for b, n in enumerate(lens)]
    chunks = [SeqChunk([0] * m, n - m, t) for n, m, t in zip(lens, q_lens, block_tables)]
    batch = ForwardBatch.build(chunks, page_size, "cuda")
    prefill = flash.plan(state, mode, batch, page_size, released_window=window)
    got = flash.attention(state, q, k_cache, v_cache, batch, prefill, 128**-0.5, window=window, softcap=softcap)
    want = reference_ops.paged_attention(q.float().cpu(), k_cache.float().cpu(), v_cache.float().cpu(),
                                         batch.block_tables.cpu(), batch.cu_seqlens_q.cpu(), batch.context_lens.cpu(),
                                         128**-0.5, batch.max_q_len, window, softcap)
    assert rel_err(got.float().cpu(), want) <= 2e-2


@pytest.mark.gpu
def test_cuda_generator_with_graphs_equals_transformers(mistral_engine) -> None:
    """The windowed Mistral on CUDA (decode graphs captured with each layer's window, pages released before it)
    generates greedily what transformers does on the CPU."""
    if not torch.cuda.is_available() or load_native("cuda") is None:
        pytest.skip("needs CUDA and folio._native_cuda")
    path, _, tokenizer = mistral_engine
    model = folio.Model.from_pretrained(path, device="cuda", progress=False)
    generator = folio.DynamicGenerator(model=model, cache=folio.Cache(model, num_tokens=2048, page_size=16),
                                       tokenizer=tokenizer, max_chunk_size=16)
    assert generator.cache_manager.window == WINDOW
    check_greedy_past_the_window(generator, path, tokenizer)
