"""The quantized KV cache formats (folio.kv_formats) against the spec by hand, the Cache's layout and sizes, and the
quantized reference ops against the unquantized ones over the dequantized cache (the oracle of the CUDA kernels)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from tiny_models import make_hf_model

from folio import kv_formats, ops
from folio import reference_ops as ref
from folio.kv_cache import Cache, page_bytes
from folio.kv_formats import KV_FORMAT_CODES, dequantize, quantize
from folio.model.model import Model

QUANTIZED = kv_formats.QUANTIZED_FORMATS
TINY = 2.0 ** -24  # the smallest float16 subnormal, the scale floor


def _group(values: list[float], size: int = 32) -> torch.Tensor:
    return torch.tensor(values + [0.0] * (size - len(values)))


# --- quantize / dequantize by hand ---


def test_q4_nibble_order_and_codes() -> None:
    codes, scales = quantize(_group([1.0, 2.0, -3.0, 7.0, -7.0]), "q4")  # amax 7 -> scale 1.0 exactly
    assert scales.tolist() == [1.0] and codes.dtype == torch.uint8 and codes.shape == (16,)
    # element 2i low nibble, 2i+1 high nibble, nibble = q + 8
    assert codes[:3].tolist() == [(1 + 8) | (2 + 8) << 4, (-3 + 8) | (7 + 8) << 4, (-7 + 8) | (0 + 8) << 4]
    assert codes[3:].tolist() == [0x88] * 13
    assert dequantize(codes, scales, "q4")[:5].tolist() == [1.0, 2.0, -3.0, 7.0, -7.0]


@pytest.mark.parametrize("fmt, qmax", [("q8", 127), ("q4", 7)])
def test_round_half_even(fmt: str, qmax: int) -> None:
    halves = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5]
    codes, scales = quantize(_group(halves + [float(qmax)]), fmt)  # scale 1.0
    got = dequantize(codes, scales, fmt)[: len(halves)].tolist()
    assert got == [0.0, 2.0, 2.0, 0.0, -2.0, -2.0, 4.0, -4.0]


def test_q8_is_int8_twos_complement() -> None:
    codes, _ = quantize(_group([127.0, -127.0, -1.0, 5.0]), "q8")
    assert codes[:4].tolist() == [127, 129, 255, 5]


def test_fp8_codes_round_to_nearest_even() -> None:
    # amax 448 -> scale 1.0; e4m3fn: 1.0 = 0x38, 448 = 0x7E; 1 + 1/16 ties to 1.0, 1 + 3/16 ties to 1.25 (0x3A)
    x = torch.tensor([448.0, 1.0, -1.0, 1.0625, 1.1875, 2.0 ** -9, 0.0, -448.0])
    codes, scales = quantize(x, "fp8")
    assert scales.tolist() == [1.0]
    assert codes.tolist() == [0x7E, 0x38, 0xB8, 0x38, 0x3A, 0x01, 0x00, 0xFE]
    assert dequantize(codes, scales, "fp8").tolist() == [448.0, 1.0, -1.0, 1.0, 1.25, 2.0 ** -9, 0.0, -448.0]


@pytest.mark.parametrize("fmt, qmax, top_code", [("fp8", 448, 0x7E), ("q8", 127, 127), ("q4", 7, 7 + 8)])
def test_saturation_where_the_float16_scale_rounds_down(fmt: str, qmax: int, top_code: int) -> None:
    # amax / qmax = 1.4 * 2**-24 rounds to the subnormal 2**-24: x / scale = 1.4 * qmax must saturate, not wrap
    # (fp8: not become NaN)
    amax = 1.4 * qmax * TINY
    codes, scales = quantize(_group([amax, -amax]), fmt)
    assert scales.tolist() == [TINY]
    first = codes[0].item() & 0xF if fmt == "q4" else codes[0].item()
    assert first == top_code
    back = dequantize(codes, scales, fmt)
    assert back[:2].tolist() == [qmax * TINY, -qmax * TINY]


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_zero_groups(fmt: str) -> None:
    x = torch.zeros(3, 64)
    x[1, 40] = 5.0  # one nonzero group among zero ones
    codes, scales = quantize(x, fmt)
    assert torch.isfinite(scales.float()).all() and (scales.float() > 0).all()
    assert scales[0].float().tolist() == [TINY] * scales.shape[-1]
    back = dequantize(codes, scales, fmt)
    assert (back[0] == 0).all() and (back[2] == 0).all()  # zero groups come back as exact zeros
    assert back[1, 40].item() == pytest.approx(5.0, rel=0.002 if fmt != "q4h" else 0.2)


def test_scale_is_rounded_to_float16_before_use() -> None:
    # amax / 127 = 1.00787...: its float16 is 1.0078125; the codes come from that value
    x = _group([128.0, 64.0])
    codes, scales = quantize(x, "q8")
    assert scales.item() == float(torch.tensor(128.0 / 127).half())
    assert codes[:2].tolist() == [127, round(64.0 / scales.item())]


def test_hadamard_is_orthonormal_and_symmetric() -> None:
    h = kv_formats.hadamard(32)
    assert torch.allclose(h @ h, torch.eye(32), atol=1e-6) and torch.equal(h, h.T)
    entry = float(torch.tensor(1 / math.sqrt(32), dtype=torch.float32))  # the fp32 entries a kernel uses
    assert set(h.unique().tolist()) == {-entry, entry}


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_bounds_on_random_data(fmt: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(512, 4, 128, generator=gen) * torch.rand(512, 4, 1, generator=gen) * 30).to(dtype)
    codes, scales = quantize(x, fmt)
    assert codes.shape == (512, 4, kv_formats.code_dim(fmt, 128)) and scales.dtype == torch.float16
    back = dequantize(codes, scales, fmt, torch.float32)
    xf = x.float()
    group = kv_formats.group_size(fmt, 128)
    step = scales.float().repeat_interleave(group, dim=-1)  # each element's scale
    err = (back - xf).abs()
    if fmt == "fp8":  # 3 mantissa bits: half an ulp is 2**-4 relative; subnormals below 2**-6 * scale
        assert (err <= torch.maximum(xf.abs() * 2.0 ** -4, step * 2.0 ** -10) * (1 + 1e-6)).all()
    elif fmt in ("q8", "q4"):  # round to nearest code: half a step
        assert (err <= step / 2 * (1 + 1e-6)).all()
    else:  # q4h: half a step per rotated element, and the rotation keeps each group's norm
        group_err = (back - xf).unflatten(-1, (-1, 32)).norm(dim=-1)
        assert (group_err <= scales.float() / 2 * math.sqrt(32) * (1 + 1e-5)).all()
    rel_rms = ((back - xf).norm() / xf.norm()).item()
    assert rel_rms < {"fp8": 0.035, "q8": 0.006, "q4": 0.11, "q4h": 0.11}[fmt]


def test_hadamard_helps_q4_with_outlier_channels() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 128, generator=gen)
    x[:, [3, 67]] *= 10  # a rotary pair of outlier channels, as K has in real models
    errors = {fmt: (dequantize(*quantize(x, fmt), fmt) - x).norm() / x.norm() for fmt in ("q4", "q4h")}
    assert errors["q4h"] < 0.6 * errors["q4"]


def test_format_resolution() -> None:
    assert kv_formats.resolve(None, torch.bfloat16, 64) is None
    assert kv_formats.resolve("bf16", torch.bfloat16, 64) is None
    with pytest.raises(ValueError, match="differs from the model's dtype"):
        kv_formats.resolve("fp16", torch.bfloat16, 64)
    with pytest.raises(ValueError, match="head_dim is 16"):
        kv_formats.resolve("q8", torch.float32, 16)
    assert kv_formats.resolve("fp8", torch.float32, 16) == "fp8"  # one scale per head: any even head_dim
    with pytest.raises(ValueError, match="unknown kv_format"):
        kv_formats.resolve("int4", torch.float32, 64)
    assert [kv_formats.format_name(c) for c in (1, 2, 3, 4)] == ["fp8", "q8", "q4", "q4h"]
    assert dict(KV_FORMAT_CODES) == {"fp8": 1, "q8": 2, "q4": 3, "q4h": 4}


# --- the cache ---


def _fake_model(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(num_layers=32, num_kv_heads=8, head_dim=head_dim), dtype=dtype)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_page_bytes_and_capacity(head_dim: int) -> None:
    model = _fake_model(head_dim)
    unquantized = page_bytes(model, 256)
    assert unquantized == 2 * 32 * 256 * 8 * head_dim * 2
    for fmt in QUANTIZED:
        dq = head_dim // 2 if fmt.startswith("q4") else head_dim
        groups = 1 if fmt == "fp8" else head_dim // 32
        assert page_bytes(model, 256, fmt) == 2 * 32 * 256 * 8 * (dq + 2 * groups)
    ratio = {fmt: unquantized / page_bytes(model, 256, fmt) for fmt in QUANTIZED}
    assert ratio["fp8"] >= 1.9 and ratio["q8"] >= 1.8 and ratio["q4"] >= 3.5 and ratio["q4h"] == ratio["q4"]


@pytest.fixture(scope="module")
def model64(tmp_path_factory) -> Model:
    path = make_hf_model(tmp_path_factory.mktemp("hd64"), "llama", head_dim=64, num_hidden_layers=2)
    return Model.from_pretrained(path, progress=False)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_cache_layout(model64: Model, fmt: str) -> None:
    cache = Cache(model64, num_tokens=64, page_size=16, kv_format=fmt)
    dq, ng = kv_formats.code_dim(fmt, 64), kv_formats.scale_dim(fmt, 64)
    assert cache.k.shape == cache.v.shape == (2, 4, 16, 2, dq) and cache.k.dtype == torch.uint8
    assert cache.k_scale.shape == cache.v_scale.shape == (2, 4, 16, 2, ng) and cache.k_scale.dtype == torch.float16
    assert cache.kv_format == fmt and cache.kv_format_code == KV_FORMAT_CODES[fmt]
    assert cache.page_tensors() == [cache.k, cache.v, cache.k_scale, cache.v_scale]
    assert cache.bytes == sum(t.numel() * t.element_size() for t in cache.page_tensors())


def test_unquantized_cache_is_unchanged(model64: Model) -> None:
    cache = Cache(model64, num_tokens=64, page_size=16, kv_format="fp32")
    assert cache.kv_format is None and cache.k_scale is None and cache.k.dtype == torch.float32
    assert cache.page_tensors() == [cache.k, cache.v] and cache.kv_format_code == 0
    assert cache.bytes == sum(t.numel() * t.element_size() for t in cache.page_tensors())
    with pytest.raises(ValueError, match="differs from the model's dtype"):
        Cache(model64, num_tokens=64, page_size=16, kv_format="bf16")


def test_cache_refuses_a_format_the_head_dim_does_not_fit(tmp_path) -> None:
    model = Model.from_pretrained(make_hf_model(tmp_path, "llama"), progress=False)  # head_dim 16
    with pytest.raises(ValueError, match="head_dim is 16"):
        Cache(model, num_tokens=64, page_size=16, kv_format="q4")


@pytest.mark.parametrize("fmt", ["fp8", "q4"])
def test_copy_page_slots_copies_codes_and_scales(model64: Model, fmt: str) -> None:
    cache = Cache(model64, num_tokens=64, page_size=16, kv_format=fmt)
    gen = torch.Generator().manual_seed(0)
    for t in cache.page_tensors():
        t.copy_(torch.randint(0, 256, t.shape, generator=gen).to(t.dtype) if t.dtype == torch.uint8
                else torch.rand(t.shape, generator=gen).to(t.dtype))
    before = [t.clone() for t in cache.page_tensors()]
    cache.copy_page_slots(3, 1, 5)
    for t, old in zip(cache.page_tensors(), before):
        want = old.clone()
        want[:, 1, :5] = old[:, 3, :5]
        assert torch.equal(t, want)


# --- the reference ops over quantized caches ---


def _random_quantized_cache(fmt: str, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen) * 2
    v = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen)
    (kc, ks), (vc, vs) = quantize(k, fmt), quantize(v, fmt)
    return kc, vc, ks, vs


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (20, 5.0)])
def test_attention_quant_equals_attention_over_the_dequantized_cache(fmt: str, window: int, softcap: float) -> None:
    num_pages, page_size, hkv, hq, d = 12, 16, 2, 4, 64
    kc, vc, ks, vs = _random_quantized_cache(fmt, num_pages, page_size, hkv, d, seed=1)
    k_full, v_full = dequantize(kc, ks, fmt), dequantize(vc, vs, fmt)  # the whole cache, the plain way
    code = KV_FORMAT_CODES[fmt]
    gen = torch.Generator().manual_seed(2)
    block_tables = torch.tensor([[7, 2, 9, 0], [4, 11, 0, 0], [5, 2, 8, 1]], dtype=torch.int32)  # page 2 shared
    context_lens = torch.tensor([50, 17, 64], dtype=torch.int32)
    q = torch.randn(3, hq, d, generator=gen)
    got = ref.paged_attention_decode_quant(q, kc, vc, ks, vs, block_tables, context_lens, 0.125, window, softcap, code)
    want = ref.paged_attention_decode(q, k_full, v_full, block_tables, context_lens, 0.125, window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    q_lens = [5, 1, 9]
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).bfloat16()
    got = ref.paged_attention_quant(q, kc, vc, ks, vs, block_tables, cu, context_lens, 0.125, 9, window, softcap,
                                    code)
    want = ref.paged_attention(q, k_full, v_full, block_tables, cu, context_lens, 0.125, 9, window, softcap)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_released_pages_are_never_read() -> None:
    kc, vc, ks, vs = _random_quantized_cache("q8", 6, 16, 1, 32, seed=3)
    q = torch.randn(1, 2, 32)
    tables = torch.tensor([[-1, -1, 3, 5]], dtype=torch.int32)  # pages before the window released
    lens = torch.tensor([60], dtype=torch.int32)
    got = ref.paged_attention_decode_quant(q, kc, vc, ks, vs, tables, lens, 0.2, 16, 0.0, KV_FORMAT_CODES["q8"])
    want = ref.paged_attention_decode(q, dequantize(kc, ks, "q8"), dequantize(vc, vs, "q8"), tables.clamp(min=0),
                                      lens, 0.2, 16, 0.0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_cache_write_quant(fmt: str, dtype: torch.dtype) -> None:
    num_pages, page_size, hq, hkv, d, t = 4, 16, 4, 2, 64, 9
    gen = torch.Generator().manual_seed(4)
    # q, k, v as strided views of one fused projection, as the model passes them
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype) * 3
    positions = torch.arange(20, 20 + t)
    slots = torch.tensor([5, 6, -1, 7, 40, 41, 42, 63, 0])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))

    def split(x):
        q, k, v = x.split([hq * d, hkv * d, hkv * d], dim=-1)
        return q.unflatten(-1, (hq, d)), k.unflatten(-1, (hkv, d)), v.unflatten(-1, (hkv, d))

    plain = qkv.clone()
    k_plain = torch.zeros(num_pages, page_size, hkv, d, dtype=dtype)
    v_plain = torch.zeros_like(k_plain)
    ref.rotary_cache_write(*split(plain), positions, inv_freq, k_plain, v_plain, slots)

    dq, ng = kv_formats.code_dim(fmt, d), kv_formats.scale_dim(fmt, d)
    kc = torch.zeros(num_pages, page_size, hkv, dq, dtype=torch.uint8)
    vc = torch.zeros_like(kc)
    ks = torch.zeros(num_pages, page_size, hkv, ng, dtype=torch.float16)
    vs = torch.zeros_like(ks)
    quant = qkv.clone()
    ref.rotary_cache_write_quant(*split(quant), positions, inv_freq, kc, vc, ks, vs, slots, KV_FORMAT_CODES[fmt])

    assert torch.equal(quant, plain)  # q and k rotated in place exactly as the unquantized op
    for codes, scales, plain_cache in ((kc, ks, k_plain), (vc, vs, v_plain)):
        want_codes, want_scales = quantize(plain_cache, fmt)  # unwritten slots: zeros either way
        written = torch.zeros(num_pages * page_size, dtype=torch.bool)
        written[slots[slots >= 0]] = True
        assert torch.equal(codes.view(-1, hkv, dq)[written], want_codes.view(-1, hkv, dq)[written])
        assert torch.equal(scales.view(-1, hkv, ng)[written], want_scales.view(-1, hkv, ng)[written])
        assert (codes.view(-1, hkv, dq)[~written] == 0).all()


def test_quant_ops_dispatch_to_the_reference_on_cpu() -> None:
    op_set = ops.OpSet()
    for name in ("rotary_cache_write_quant", "paged_attention_quant", "paged_attention_decode_quant"):
        assert op_set.implementation_name(name, "cpu") == "reference"


# --- on a GPU: the native kernels against these references ---


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64 on the CPU."""
    a, b = actual.double().cpu(), expected.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("fmt", ["fp8", "q8", "q4"])  # q4h has no CUDA kernel (Cache refuses it on CUDA)
def test_native_quant_ops_match_the_reference(fmt: str) -> None:
    native, device = ops.OpSet(backend="native"), torch.device("cuda")
    num_pages, page_size, hq, hkv, d, t = 8, 16, 8, 2, 128, 37
    gen = torch.Generator().manual_seed(5)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 3).bfloat16()
    positions = torch.arange(t) + 3
    slots = torch.randperm(num_pages * page_size, generator=gen)[:t]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    dq, ng = kv_formats.code_dim(fmt, d), kv_formats.scale_dim(fmt, d)
    caches = {}
    for impl, dev in ((ref, torch.device("cpu")), (native, device)):
        x = qkv.to(dev, copy=True)  # (the ops rotate q and k in place)
        q, k, v = x.split([hq * d, hkv * d, hkv * d], dim=-1)
        kc = torch.zeros(num_pages, page_size, hkv, dq, dtype=torch.uint8, device=dev)
        ks = torch.zeros(num_pages, page_size, hkv, ng, dtype=torch.float16, device=dev)
        tensors = (kc, kc.clone(), ks, ks.clone())
        impl.rotary_cache_write_quant(q.unflatten(-1, (hq, d)), k.unflatten(-1, (hkv, d)), v.unflatten(-1, (hkv, d)),
                                      positions.to(dev), inv_freq.to(dev), *tensors, slots.to(dev),
                                      KV_FORMAT_CODES[fmt])
        caches[impl is ref] = (x.cpu(), [c.cpu() for c in tensors])
    (x_ref, want), (x_nat, got) = caches[True], caches[False]
    # rotary: the device's sin/cos differ from the CPU's in the last bit (the unquantized op's test's tolerance)
    torch.testing.assert_close(x_nat, x_ref)
    # the cache write: the reference quantizer applied to the K and V the native op rotated itself gives its codes
    # and scales bit for bit (same fp32 arithmetic, IEEE division, round to nearest even)
    _, k_nat, v_nat = x_nat.split([hq * d, hkv * d, hkv * d], dim=-1)
    for x_written, codes, scales in ((k_nat, got[0], got[2]), (v_nat, got[1], got[3])):
        want_codes, want_scales = quantize(x_written.unflatten(-1, (hkv, d)), fmt)
        flat_codes, flat_scales = codes.view(-1, hkv, dq), scales.view(-1, hkv, ng)
        assert torch.equal(flat_codes[slots], want_codes)
        assert torch.equal(flat_scales[slots], want_scales)
        unwritten = torch.ones(flat_codes.shape[0], dtype=torch.bool)
        unwritten[slots] = False
        assert (flat_codes[unwritten] == 0).all() and (flat_scales[unwritten] == 0).all()
    # and the same codes as the reference op's, up to the few the rotary's last bit moved across a rounding edge
    for gc, gs, wc, ws in ((got[0], got[2], want[0], want[2]), (got[1], got[3], want[1], want[3])):
        assert (gc != wc).float().mean() < 0.05
        torch.testing.assert_close(gs, ws, rtol=1e-2, atol=0)

    kc, vc, ks, vs = [c.to(device) for c in got]
    tables = torch.tensor([[1, 4, 6, 0], [7, 2, 3, 5]], dtype=torch.int32, device=device)
    lens = torch.tensor([49, 64], dtype=torch.int32, device=device)
    q = torch.randn(2, hq, d, device=device).bfloat16()
    code = KV_FORMAT_CODES[fmt]
    out = native.paged_attention_decode_quant(q, kc, vc, ks, vs, tables, lens, d ** -0.5, 0, 0.0, code)
    want_out = ref.paged_attention_decode_quant(q, kc, vc, ks, vs, tables, lens, d ** -0.5, 0, 0.0, code)
    # (tests/test_kv_quant_gpu.py's measure and bound: the kernels round the dequantized tiles to bf16)
    assert rel_err(out, want_out) <= 2e-2
    cu = torch.tensor([0, 7, 19], dtype=torch.int32, device=device)
    q = torch.randn(19, hq, d, device=device).bfloat16()
    out = native.paged_attention_quant(q, kc, vc, ks, vs, tables, cu, lens, d ** -0.5, 12, 0, 0.0, code)
    want_out = ref.paged_attention_quant(q, kc, vc, ks, vs, tables, cu, lens, d ** -0.5, 12, 0, 0.0, code)
    assert rel_err(out, want_out) <= 2e-2
