"""CUDA kernels over quantized K/V caches (fp8, q8, q4) against their oracles.

- rotary_cache_write_quant: q and k bit-identical to the unquantized CUDA op (rotary_cache_write), and the codes and
  scales in the written slots bit-identical to folio.kv_formats.quantize of the kernel's own rotated k (and of v),
  computed on the CPU; unwritten slots untouched.
- paged_attention_decode_quant / paged_attention_quant: folio.reference_ops' ops of the same names (the unquantized
  reference attention over the dequantized cache, fp32, on the CPU) within twice the dtype's tolerance of
  tests/test_native_ops.py: the kernels round to float16 what a 16-bit cache never rounds (q, and q8 / q4 codes
  times their scales on the tensor-core kernel; each dequantized element to q's dtype on the CUDA-core one).
  Shapes cover head_dim 64/96/128, GQA 1/4/8/32 (the tensor-core kernel and the CUDA-core fallback), page sizes 16
  and 256, contexts crossing pages, windows (with the pages before them released: -1 in the block table),
  soft-capping, and long rows split over several blocks.
- copy_page_slots over uint8 codes and float16 scales (CPU and CUDA).
Every case but the CPU copy needs a GPU (marker `gpu`).
"""

from __future__ import annotations

import pytest
import torch
from test_native_ops import (
    NATIVE,
    TOLERANCE,
    _marks,
    captured,
    gen,
    on_cpu,
    poison_next_alloc,
    randn,
    rel_err,
    same_bits,
)

from folio import kv_formats
from folio import reference_ops as ref

CUDA = _marks("cuda")
FORMATS = ("fp8", "q8", "q4")
CODES = kv_formats.KV_FORMAT_CODES


def _inv_freq(head_dim: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def quantized_cache(num_pages: int, page_size: int, kv_heads: int, head_dim: int, name: str, g: torch.Generator,
                    device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of random K (or V) values, with some heads of very different magnitudes (so the scales
    matter) and a few all-zero heads (the minimum scale)."""
    x = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=g)
    x *= torch.exp(torch.randn(num_pages, page_size, kv_heads, 1, generator=g) * 1.5)
    x[torch.rand(num_pages, page_size, kv_heads, generator=g) < 0.02] = 0.0
    codes, scales = kv_formats.quantize(x.to(torch.bfloat16), name)
    return codes.to(device), scales.to(device)


def paged_tables(context_lens: list[int], page_size: int, num_pages: int, g: torch.Generator, window: int = 0):
    """Shuffled block tables [B, max_blocks] int32 (unused tail entries -1) and context_lens [B] int32. With a
    window, the pages wholly before each row's window are -1 too: released, and the kernels must not read them."""
    max_blocks = max(-(-c // page_size) for c in context_lens)
    pages = torch.randperm(num_pages, generator=g)
    tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, context in enumerate(context_lens):
        blocks = -(-context // page_size)
        tables[b, :blocks] = pages[used : used + blocks].to(torch.int32)
        used += blocks
        if window > 0:
            first_visible = max(0, context - window)  # decode: the row's query is at position context - 1
            tables[b, : first_visible // page_size] = -1
    assert used <= num_pages
    return tables.cuda(), torch.tensor(context_lens, dtype=torch.int32, device="cuda")


def caches_for(context_lens, page_size, kv_heads, head_dim, name, g, window=0):
    num_pages = sum(-(-c // page_size) for c in context_lens) + 3
    k_codes, k_scales = quantized_cache(num_pages, page_size, kv_heads, head_dim, name, g)
    v_codes, v_scales = quantized_cache(num_pages, page_size, kv_heads, head_dim, name, g)
    tables, lens = paged_tables(context_lens, page_size, num_pages, g, window)
    return k_codes, v_codes, k_scales, v_scales, tables, lens


def assert_close(actual, expected, dtype):
    err = rel_err(actual, expected)
    tolerance = 2 * TOLERANCE[dtype]  # (see the module docstring)
    assert err <= tolerance, f"rel err {err:.3g} > {tolerance} ({dtype})"


# ------------------------------------------------------------------------------------------------ cache write


@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("num_tokens,q_heads,kv_heads,head_dim,page_size",
                         [(1, 32, 8, 128, 256), (37, 8, 8, 64, 16), (300, 12, 4, 96, 16), (5, 4, 1, 256, 16)])
def test_cache_write_is_bit_exact(_, dtype, name, num_tokens, q_heads, kv_heads, head_dim, page_size):
    g = gen(num_tokens * head_dim + q_heads + len(name))
    num_pages = 3 + num_tokens // page_size
    # q, k, v as column slices of one fused projection (strided views), as the model passes them
    qkv = randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device="cuda", g=g, scale=2.0)
    qkv[:, -kv_heads * head_dim:][torch.rand(num_tokens, kv_heads * head_dim, generator=g).cuda() < 0.01] *= 300.0
    q, k, v = [x.unflatten(-1, (-1, head_dim)) for x in qkv.split(
        [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)]
    if num_tokens > 1:
        v[1] = 0.0  # an all-zero token: the minimum scale
    positions = torch.randint(0, 40000, (num_tokens,), generator=g).cuda()
    slots = torch.randperm(num_pages * page_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1
    slots = slots.cuda()
    inv_freq = _inv_freq(head_dim).cuda()
    code_dim, scale_dim = kv_formats.code_dim(name, head_dim), kv_formats.scale_dim(name, head_dim)
    # caches full of random bytes: every unwritten slot must keep its bytes
    k_cache = torch.randint(0, 256, (num_pages, page_size, kv_heads, code_dim), generator=g, dtype=torch.uint8).cuda()
    v_cache = torch.randint(0, 256, k_cache.shape, generator=g, dtype=torch.uint8).cuda()
    k_scale = torch.randn(num_pages, page_size, kv_heads, scale_dim, generator=g).to(torch.float16).cuda()
    v_scale = torch.randn(k_scale.shape, generator=g).to(torch.float16).cuda()
    before = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]

    # today's op on copies: the quantized op must rotate q and k to the same bits
    q_plain, k_plain, v_plain = q.clone(), k.clone(), v.clone()
    plain_cache = torch.zeros(num_pages, page_size, kv_heads, head_dim, dtype=dtype, device="cuda")
    NATIVE["cuda"].rotary_cache_write(q_plain, k_plain, v_plain, positions, inv_freq, plain_cache,
                                      plain_cache.clone(), slots)
    v_before = v.clone()
    NATIVE["cuda"].rotary_cache_write_quant(q, k, v, positions, inv_freq, k_cache, v_cache, k_scale, v_scale, slots,
                                            CODES[name])
    assert same_bits(q, q_plain) and same_bits(k, k_plain), "q / k rotated differently from rotary_cache_write"
    assert same_bits(v, v_before), "v was written"

    written = slots[slots >= 0].cpu()
    for x, cache, scales, (cache_before, scales_before) in ((k, k_cache, k_scale, before[0::2]),
                                                             (v, v_cache, v_scale, before[1::2])):
        want_codes, want_scales = kv_formats.quantize(x.cpu()[(slots >= 0).cpu()], name)
        flat = cache.cpu().view(-1, kv_heads, code_dim)
        flat_scales = scales.cpu().view(-1, kv_heads, scale_dim)
        assert same_bits(flat_scales[written], want_scales), "scales differ from kv_formats.quantize"
        mismatched = (flat[written] != want_codes).sum().item()
        assert mismatched == 0, f"{mismatched} code bytes differ from kv_formats.quantize"
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[written] = False
        assert torch.equal(flat[untouched], cache_before.cpu().view(-1, kv_heads, code_dim)[untouched])
        assert same_bits(flat_scales[untouched], scales_before.cpu().view(-1, kv_heads, scale_dim)[untouched])


# ------------------------------------------------------------------------------------------------ decode


DECODE_CASES = [
    # context_lens, q_heads, kv_heads, head_dim, page_size
    ([1, 17, 300, 1000], 32, 8, 128, 16),      # Llama-3-8B shape (tensor cores), contexts crossing pages
    ([255, 257, 1500, 3], 32, 8, 128, 256),    # the engine's default page size
    ([5000, 4097], 8, 8, 128, 256),            # GQA 1, long rows: split over many blocks
    ([40, 700, 2049], 16, 2, 64, 16),          # head_dim 64, GQA 8
    ([33, 600], 32, 1, 128, 16),               # GQA 32: more heads than the tensor-core kernel takes (CUDA cores)
    ([70, 513], 12, 4, 96, 16),                # head_dim 96: the CUDA-core kernel's generic path
]


@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("context_lens,q_heads,kv_heads,head_dim,page_size", DECODE_CASES)
@pytest.mark.parametrize("dtype,window,softcap", [(torch.bfloat16, 0, 0.0), (torch.float16, 0, 0.0),
                                                  (torch.bfloat16, 200, 0.0), (torch.bfloat16, 0, 5.0),
                                                  (torch.float16, 37, 30.0)], ids=["bf16", "fp16", "window",
                                                                                   "softcap", "fp16-both"])
def test_decode_matches_reference(_, name, context_lens, q_heads, kv_heads, head_dim, page_size, dtype, window,
                                  softcap):
    g = gen(sum(context_lens) + head_dim + q_heads + len(name) + window)
    k_codes, v_codes, k_scales, v_scales, tables, lens = caches_for(context_lens, page_size, kv_heads, head_dim,
                                                                    name, g, window)
    q = randn(len(context_lens), q_heads, head_dim, dtype=dtype, device="cuda", g=g)
    scale = head_dim**-0.5
    args = (q, k_codes, v_codes, k_scales, v_scales, tables, lens, scale, window, softcap, CODES[name])
    poison_next_alloc(q.shape, dtype, "cuda")
    out = NATIVE["cuda"].paged_attention_decode_quant(*args)
    expected = ref.paged_attention_decode_quant(*on_cpu(*args))
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_as_accurate_as_16bit_kernel_on_dequantized_cache(_, name, dtype):
    """The tensor-core kernel over quantized pages (attention_mma_quant.cu) against the fp32 reference is no less
    accurate than the 16-bit op over the cache dequantized to q's dtype, give or take 2^-10 (an ulp of a float16
    output at its largest element: a rounding either may take). The 16-bit op rounds every K / V element to q's
    dtype; this kernel keeps the codes exact and rounds q, P times V's scales and q8 / q4 codes times their scales
    to float16, so with bfloat16 q it is the more accurate one (a numeric model of both on these caches: fp8 2.7e-3
    against 2.0e-2, q8 1.8e-3 against 6.6e-3, q4 1.5e-3 against 1.6e-2)."""
    g = gen(11 + len(name))
    k_codes, v_codes, k_scales, v_scales, tables, lens = caches_for([3000, 40, 700], 16, 8, 128, name, g)
    q = randn(3, 32, 128, dtype=dtype, device="cuda", g=g)
    args = (q, k_codes, v_codes, k_scales, v_scales, tables, lens, 128**-0.5, 0, 0.0, CODES[name])
    out = NATIVE["cuda"].paged_attention_decode_quant(*args)
    expected = ref.paged_attention_decode_quant(*on_cpu(*args))
    k = kv_formats.dequantize(k_codes, k_scales, name, dtype)
    v = kv_formats.dequantize(v_codes, v_scales, name, dtype)
    plain = NATIVE["cuda"].paged_attention_decode(q, k, v, tables, lens, 128**-0.5, 0, 0.0)
    assert rel_err(out, expected) <= rel_err(plain, expected) + 2**-10


@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
@pytest.mark.parametrize("name", FORMATS)
def test_decode_replays_in_a_cuda_graph(_, name):
    g = gen(5 + len(name))
    k_codes, v_codes, k_scales, v_scales, tables, lens = caches_for([3000, 40, 700], 16, 8, 128, name, g)
    q = randn(3, 32, 128, dtype=torch.bfloat16, device="cuda", g=g)
    args = (q, k_codes, v_codes, k_scales, v_scales, tables, lens, 128**-0.5, 0, 0.0, CODES[name])
    eager = NATIVE["cuda"].paged_attention_decode_quant(*args)
    graph, out = captured(lambda: NATIVE["cuda"].paged_attention_decode_quant(*args))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), "the graph replay differs from the eager call (nondeterminism?)"


@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("q_heads,kv_heads", [(32, 8), (32, 1)], ids=["tensor-cores", "cuda-cores"])
def test_decode_rows_far_shorter_than_the_table_in_a_graph(_, name, q_heads, kv_heads):
    """A graph captured with tables 512 pages wide (8,192 keys), as a decode graph's are for max_seq_len, replayed as
    the rows' lengths change: each row splits by its own length, and every replay gives the reference's answer."""
    g = gen(23 + len(name) + kv_heads)
    k_codes, v_codes, k_scales, v_scales, tables, lens = caches_for([8192] * 3, 16, kv_heads, 128, name, g)
    q = randn(3, q_heads, 128, dtype=torch.bfloat16, device="cuda", g=g)
    args = (q, k_codes, v_codes, k_scales, v_scales, tables, lens, 128**-0.5, 0, 0.0, CODES[name])
    graph, out = captured(lambda: NATIVE["cuda"].paged_attention_decode_quant(*args))
    for lengths in ([8192, 4000, 2049], [1, 700, 65], [300, 8192, 16]):
        lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        assert_close(out, ref.paged_attention_decode_quant(*on_cpu(*args)), torch.bfloat16)


# ------------------------------------------------------------------------------------------------ prefill


PREFILL_CASES = [
    # (q_len, context_len) per sequence, q_heads, kv_heads, head_dim, page_size
    ([(5, 5), (64, 300), (1, 17)], 32, 8, 128, 16),   # whole prompt, a chunk over cached pages, one token
    ([(40, 1100), (3, 260)], 16, 2, 64, 256),
    ([(9, 70), (16, 16)], 12, 4, 96, 16),
]


@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("runs,q_heads,kv_heads,head_dim,page_size", PREFILL_CASES)
@pytest.mark.parametrize("dtype,window,softcap", [(torch.bfloat16, 0, 0.0), (torch.float16, 50, 20.0)],
                         ids=["bf16", "fp16-window-softcap"])
def test_prefill_matches_reference(_, name, runs, q_heads, kv_heads, head_dim, page_size, dtype, window, softcap):
    g = gen(sum(c for _, c in runs) + head_dim + len(name) + window)
    context_lens = [c for _, c in runs]
    k_codes, v_codes, k_scales, v_scales, tables, lens = caches_for(context_lens, page_size, kv_heads, head_dim,
                                                                    name, g)
    q_lens = [n for n, _ in runs]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = randn(sum(q_lens), q_heads, head_dim, dtype=dtype, device="cuda", g=g)
    args = (q, k_codes, v_codes, k_scales, v_scales, tables, cu, lens, head_dim**-0.5, max(q_lens), window, softcap,
            CODES[name])
    poison_next_alloc(q.shape, dtype, "cuda")
    out = NATIVE["cuda"].paged_attention_quant(*args)
    expected = ref.paged_attention_quant(*on_cpu(*args))
    assert_close(out, expected, dtype)


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
def test_quant_ops_refuse_wrong_arguments(_):
    g = gen(3)
    k_codes, v_codes, k_scales, v_scales, tables, lens = caches_for([20], 16, 2, 64, "q8", g)
    q = randn(1, 4, 64, dtype=torch.bfloat16, device="cuda", g=g)
    native = NATIVE["cuda"]

    def decode(q_=q, k_=k_codes, ks_=k_scales, fmt=CODES["q8"]):
        return native.paged_attention_decode_quant(q_, k_, v_codes, ks_, v_scales, tables, lens, 0.125, 0, 0.0, fmt)

    decode()
    with pytest.raises(ValueError, match="kv_format"):
        decode(fmt=CODES["q4h"])
    with pytest.raises(TypeError, match="float16 or bfloat16 'q'"):
        decode(q_=q.float())
    with pytest.raises(TypeError, match="'k_cache' must be"):
        decode(k_=k_codes.view(torch.int8))
    with pytest.raises(TypeError, match="'k_scale' must be"):
        decode(ks_=k_scales.float())
    with pytest.raises(ValueError, match="'k_scale' has shape"):
        decode(ks_=k_scales[..., :1].contiguous())
    with pytest.raises(ValueError, match="code bytes per head"):
        decode(fmt=CODES["q4"])  # q8 caches are twice as wide as q4's


# ------------------------------------------------------------------------------------------------ page copy


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=_marks("cpu")), pytest.param("cuda", marks=CUDA)])
def test_copy_page_slots_copies_codes_and_scales(device):
    g = gen(8)
    codes = torch.randint(0, 256, (3, 5, 16, 2, 64), generator=g, dtype=torch.uint8).to(device)
    scales = torch.randn(3, 5, 16, 2, 4, generator=g).to(torch.float16).to(device)
    for k_cache in (codes, scales):
        v_cache = k_cache.flip(0).contiguous()
        expected = [k_cache.clone(), v_cache.clone()]
        ref.copy_page_slots(*expected, 1, 3, 7)
        NATIVE[device].copy_page_slots(k_cache, v_cache, 1, 3, 7)
        assert same_bits(k_cache, expected[0]) and same_bits(v_cache, expected[1])


# ------------------------------------------------------------------------------------------------ in the model


@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
@pytest.mark.parametrize("name", FORMATS)
def test_fresh_prompts_over_a_quantized_cache_prefill_on_tensor_cores(_, name):
    """Fresh prompts attend over their own K/V on FlashAttention-2 / cuDNN (folio.model.quant_attention), a decoding
    row beside them over the codes: the cache gets the same codes as on the paged kernel, and the logits stay within
    the format's accuracy bound of the paged kernel's over the codes (mean KL, the issue's bounds: fp8 / q8 0.005,
    q4 0.05)."""
    from test_fp8_weights_gpu import REALISTIC, kl_rows, realistic_state

    from folio.kv_cache import Cache
    from folio.model import quant_attention
    from folio.model.batch import ForwardBatch, SeqChunk
    from folio.model.config import ModelConfig
    from folio.model.model import Model
    from folio.options import EngineOptions

    config = ModelConfig.from_dict(REALISTIC)
    flash_model = Model.from_state_dict(config, realistic_state(config))
    paged_model = flash_model.with_options(EngineOptions(prefill_attention="paged"))
    prompts = torch.randint(0, config.vocab_size, (2, 192), generator=torch.Generator().manual_seed(3)).tolist()
    page_size = 64
    logits, caches = [], []
    new_prompt = torch.randint(0, config.vocab_size, (192,), generator=torch.Generator().manual_seed(4)).tolist()
    q_like = torch.empty(0, config.num_q_heads, config.head_dim, device="cuda", dtype=torch.bfloat16)
    for model in (flash_model, paged_model):
        cache = Cache(model, num_tokens=10 * page_size, page_size=page_size, kv_format=name)
        chunks = [SeqChunk(p, 0, [3 * i, 3 * i + 1, 3 * i + 2], "all") for i, p in enumerate(prompts)]
        # then a step of one decoding row (the first prompt's next token) beside a fresh prompt
        mixed = [SeqChunk([prompts[0][-1]], 192, [0, 1, 2, 6], "last"), SeqChunk(new_prompt, 0, [7, 8, 9], "all")]
        out = []
        for step in (chunks, mixed):
            batch = ForwardBatch.build(step, page_size, model.device)
            if model is flash_model:
                assert quant_attention.prefill_plan(model, batch, cache, q_like) is not None
            out.append(model.forward(batch, cache).float())
        logits.append(torch.cat(out))
        caches.append(cache)
    bound = 0.05 if name == "q4" else 0.005
    assert kl_rows(logits[1], logits[0]).mean().item() <= bound
    # the cache write does not depend on the attention path: layer 0's codes and scales are the same (later layers'
    # K/V follow from the earlier layers' outputs)
    for a, b in zip(caches[0].page_tensors(), caches[1].page_tensors()):
        assert torch.equal(a[0], b[0])
