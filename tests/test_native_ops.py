"""Native kernels (folio._native_cpu, folio._native_cuda) against the torch references.

Oracles: folio.reference_ops for the model ops, tests/native_reference.py for the sampling ops. Every check draws
fresh random inputs; outputs are poisoned with NaN first where the test can reach them (in-place ops, and fresh
outputs on CUDA through the caching allocator), and every compared output must be free of NaN.
CUDA cases carry the `gpu` marker; every case skips when its module was not built.
"""

from __future__ import annotations

import importlib
import math

import native_reference as sref
import pytest
import torch

from folio import ops
from folio import reference_ops as ref


def _import_native(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            return None
        raise


NATIVE = {"cpu": _import_native("folio._native_cpu"), "cuda": _import_native("folio._native_cuda")}
# max|a - b| / max|b| allowed per dtype (fp32: summation order only)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def _marks(device: str) -> list:
    marks = [pytest.mark.skipif(NATIVE[device] is None, reason=f"folio._native_{device} is not built")]
    if device == "cuda":
        marks += [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
    return marks


def cases(cpu_dtypes=(torch.float32, torch.bfloat16, torch.float16),
          cuda_dtypes=(torch.bfloat16, torch.float16, torch.float32)):
    out = []
    for device, dtypes in (("cpu", cpu_dtypes), ("cuda", cuda_dtypes)):
        for dtype in dtypes:
            out.append(pytest.param(device, dtype, marks=_marks(device), id=f"{device}-{str(dtype)[6:]}"))
    return out


DEVICES = [pytest.param(d, marks=_marks(d), id=d) for d in ("cpu", "cuda")]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert not actual.isnan().any(), "output holds NaN: an element was not written"
    a, b = actual.double().cpu(), expected.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    err = rel_err(actual, expected)
    assert err <= TOLERANCE[dtype], f"rel err {err:.3g} > {TOLERANCE[dtype]} ({dtype})"


def on_cpu(*args):
    """CPU copies of the tensor arguments (others unchanged): references always run on the CPU, in fp32 without
    TF32, so a CUDA result is compared with an oracle that shares none of its device's code paths."""
    return [a.detach().cpu().clone() if isinstance(a, torch.Tensor) else a for a in args]


def poison_next_alloc(shape, dtype, device) -> None:
    """Leave a freed poisoned block of this size in the CUDA caching allocator: the op's fresh output lands on it
    (NaN for floats, an out-of-range id for integers)."""
    if device == "cuda":
        block = torch.full(shape, float("nan") if dtype.is_floating_point else -12345, dtype=dtype, device=device)
        del block


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype, device, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------- norms, MLP


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (33, 1000), (3, 4096), (2, 13)])
def test_rms_norm(device, dtype, rows, hidden):
    g = gen(rows * 7 + hidden)
    x = randn(rows, hidden, dtype=dtype, device=device, g=g, scale=3.0)
    weight = randn(hidden, dtype=dtype, device=device, g=g)
    poison_next_alloc((rows, hidden), dtype, device)
    out = NATIVE[device].rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, ref.rms_norm(*on_cpu(x, weight), 1e-5), dtype)


@pytest.mark.parametrize("device,dtype", cases(cpu_dtypes=(torch.bfloat16,), cuda_dtypes=(torch.bfloat16,)))
def test_rms_norm_strided_rows_and_fp32_weight(device, dtype):
    g = gen(1)
    wide = randn(9, 300, dtype=dtype, device=device, g=g)
    x = wide[:, 20:276]  # a view: row stride 300
    weight = randn(256, dtype=torch.float32, device=device, g=g)
    assert_close(NATIVE[device].rms_norm(x, weight, 1e-6), ref.rms_norm(*on_cpu(x, weight), 1e-6), dtype)


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 96), (17, 2048), (4, 7)])
def test_fused_add_rms_norm(device, dtype, rows, hidden):
    g = gen(rows + hidden)
    x = randn(rows, hidden, dtype=dtype, device=device, g=g)
    residual = randn(rows, hidden, dtype=dtype, device=device, g=g, scale=4.0)
    weight = randn(hidden, dtype=dtype, device=device, g=g)
    x_ref, residual_ref, weight_ref = on_cpu(x, residual, weight)
    ref.fused_add_rms_norm(x_ref, residual_ref, weight_ref, 1e-6)
    assert NATIVE[device].fused_add_rms_norm(x, residual, weight, 1e-6) is None
    assert_close(residual, residual_ref, dtype)
    assert_close(x, x_ref, dtype)


@pytest.mark.parametrize("device,dtype", cases())
# 70000 rows: more than a CUDA grid's y dimension (65535), where the kernel once put its rows (a 65536-token
# prompt step failed with "invalid argument")
@pytest.mark.parametrize("rows,width", [(1, 1), (6, 352), (3, 1377), (64, 2048), (70_000, 8), (70_000, 3)])
def test_silu_and_mul(device, dtype, rows, width):
    g = gen(rows * width)
    x = randn(rows, 2 * width, dtype=dtype, device=device, g=g, scale=3.0)
    poison_next_alloc((rows, width), dtype, device)
    out = NATIVE[device].silu_and_mul(x)
    assert out.shape == (rows, width)
    assert_close(out, ref.silu_and_mul(x.cpu()), dtype)


# ---------------------------------------------------------------------------------------------- rotary + cache


def _inv_freq(head_dim: int, theta: float, llama3: bool) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if llama3:  # Llama-3 style: long wavelengths divided by a factor, short ones kept, a smooth band between
        wavelen = 2 * math.pi / inv_freq
        smooth = ((8192 / wavelen) - 1.0) / (4.0 - 1.0)
        scaled = torch.where(wavelen > 8192 / 1.0, inv_freq / 8.0, inv_freq)
        band = (wavelen <= 8192 / 1.0) & (wavelen >= 8192 / 4.0)
        inv_freq = torch.where(band, (1 - smooth) * inv_freq / 8.0 + smooth * inv_freq, scaled)
    return inv_freq


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize(
    "num_tokens,q_heads,kv_heads,head_dim,page_size,llama3",
    [(1, 4, 4, 64, 16, False), (13, 8, 2, 128, 16, True), (40, 6, 2, 80, 256, False), (7, 12, 4, 64, 256, True)],
)
def test_rotary_cache_write(device, dtype, num_tokens, q_heads, kv_heads, head_dim, page_size, llama3):
    g = gen(num_tokens * head_dim + page_size)
    num_pages = 4 + (num_tokens // page_size)
    # q, k, v as views of one fused projection, the way the model hands them over
    qkv = randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device, g=g)
    q = qkv[:, : q_heads * head_dim].view(num_tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, (q_heads + kv_heads) * head_dim :].view(num_tokens, kv_heads, head_dim)
    positions = torch.randint(0, 40000, (num_tokens,), generator=g).to(device)
    slots = torch.randperm(num_pages * page_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1  # tokens whose K/V are not written
    slots = slots.to(device)
    inv_freq = _inv_freq(head_dim, 500000.0 if llama3 else 10000.0, llama3).to(device)
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)

    q_ref, k_ref, v_ref, positions_ref, inv_freq_ref, k_cache_ref, v_cache_ref, slots_ref = on_cpu(
        q, k, v, positions, inv_freq, k_cache, v_cache, slots)
    ref.rotary_cache_write(q_ref, k_ref, v_ref, positions_ref, inv_freq_ref, k_cache_ref, v_cache_ref, slots_ref)
    NATIVE[device].rotary_cache_write(q, k, v, positions, inv_freq, k_cache, v_cache, slots)

    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    written = slots_ref[slots_ref >= 0]
    for cache, cache_ref in ((k_cache.cpu(), k_cache_ref), (v_cache.cpu(), v_cache_ref)):
        flat, flat_ref = cache.view(-1, kv_heads, head_dim), cache_ref.view(-1, kv_heads, head_dim)
        assert_close(flat[written], flat_ref[written], dtype)
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[written] = False
        assert flat[untouched].isnan().all(), "a slot outside slot_mapping was written"


def same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bitwise equality, NaN included (a cache slot that is not written keeps the NaN it was poisoned with)."""
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32}[actual.element_size()]
    return (actual.shape == expected.shape and actual.dtype == expected.dtype
            and torch.equal(actual.view(as_int).cpu(), expected.view(as_int).cpu()))


def rotary_views(layout, num_tokens, q_heads, kv_heads, head_dim, dtype, device, g):
    """q, k, v [T, H, D] with a dense last dim laid out as `layout`, and the memory around them that the op must
    leave alone. "fused": the column slices of one [T, (Hq + 2 Hkv) D] QKV output, as the model hands them over;
    "fused-offset": the same inside a wider buffer, so neither the base nor the token stride is 16-byte aligned;
    "padded-heads": head stride D + 6; "head-major": [H, T, D] buffers transposed (token stride D)."""
    widths = [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    if layout in ("fused", "fused-offset"):
        pad = 3 if layout == "fused-offset" else 0
        buf = randn(num_tokens, pad + sum(widths) + pad, dtype=dtype, device=device, g=g)
        qkv = buf[:, pad : pad + sum(widths)]
        views = [x.unflatten(-1, (-1, head_dim)) for x in qkv.split(widths, dim=-1)]
        return views, [buf[:, :pad], buf[:, pad + sum(widths) :]]
    views, gaps = [], []
    for heads in (q_heads, kv_heads, kv_heads):
        if layout == "padded-heads":
            buf = randn(num_tokens, heads, head_dim + 6, dtype=dtype, device=device, g=g)
            views.append(buf[..., :head_dim])
            gaps.append(buf[..., head_dim:])
        else:
            views.append(randn(heads, num_tokens, head_dim, dtype=dtype, device=device, g=g).transpose(0, 1))
    return views, gaps


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("layout", ["fused", "fused-offset", "padded-heads", "head-major"])
@pytest.mark.parametrize(
    "num_tokens,q_heads,kv_heads,head_dim,page_size",
    [(1, 4, 2, 64, 16), (300, 8, 2, 128, 16), (9, 3, 1, 10, 4)],
)
def test_rotary_cache_write_strided_views_match_contiguous(device, dtype, layout, num_tokens, q_heads, kv_heads,
                                                           head_dim, page_size):
    g = gen(num_tokens + head_dim)
    (q, k, v), gaps = rotary_views(layout, num_tokens, q_heads, kv_heads, head_dim, dtype, device, g)
    dense = [x.clone(memory_format=torch.contiguous_format) for x in (q, k, v)]
    v_before, gaps_before = v.clone(), [gap.clone() for gap in gaps]
    num_pages = 2 + num_tokens // page_size
    positions = torch.randint(0, 40000, (num_tokens,), generator=g).to(device)
    slots = torch.randperm(num_pages * page_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1
    slots = slots.to(device)
    inv_freq = _inv_freq(head_dim, 10000.0, False).to(device)
    shape = (num_pages, page_size, kv_heads, head_dim)
    caches = [torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(4)]

    # the public entry point (an op set) takes the views as they are
    ops.OpSet("native").rotary_cache_write(q, k, v, positions, inv_freq, caches[0], caches[1], slots)
    NATIVE[device].rotary_cache_write(*dense, positions, inv_freq, caches[2], caches[3], slots)

    assert same_bits(q, dense[0]) and same_bits(k, dense[1]), "q, k rotated in place differ from the dense run"
    assert same_bits(caches[0], caches[2]) and same_bits(caches[1], caches[3]), "caches differ from the dense run"
    assert same_bits(v, v_before), "v was written"
    assert all(same_bits(gap, before) for gap, before in zip(gaps, gaps_before)), "memory beside q, k, v written"


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_cache_write_rejects_overlapping_layouts(device):
    native = NATIVE[device]
    g = gen(6)
    num_tokens, q_heads, kv_heads, head_dim = 4, 4, 2, 16
    widths = [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    qkv = randn(num_tokens, sum(widths), dtype=torch.float32, device=device, g=g)
    q, k, v = [x.unflatten(-1, (-1, head_dim)) for x in qkv.split(widths, dim=-1)]
    positions = torch.arange(num_tokens, device=device)
    inv_freq = _inv_freq(head_dim, 10000.0, False).to(device)
    k_cache = torch.zeros(2, 16, kv_heads, head_dim, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(num_tokens, device=device)
    before = qkv.clone()

    def call(q_, k_, v_):
        native.rotary_cache_write(q_, k_, v_, positions, inv_freq, k_cache, v_cache, slots)

    flat = randn(num_tokens * q_heads * head_dim * 2, dtype=torch.float32, device=device, g=g)
    with pytest.raises(ValueError, match="'q' must have a contiguous last dimension"):
        call(flat.view(num_tokens, q_heads, 2 * head_dim)[..., ::2], k, v)
    with pytest.raises(ValueError, match="'q' is written in place but its elements overlap"):
        call(q[:1].expand(num_tokens, -1, -1), k, v)  # token stride 0
    with pytest.raises(ValueError, match="'k' is written in place but its elements overlap"):
        call(q, flat.as_strided((num_tokens, kv_heads, head_dim), (kv_heads * head_dim, head_dim // 2, 1)), v)
    with pytest.raises(ValueError, match="'k' is written in place but its elements overlap"):
        call(q, flat.as_strided((num_tokens, kv_heads, head_dim), (head_dim, head_dim, 1)), v)  # tokens share heads
    with pytest.raises(ValueError, match="'q' and 'k' share memory"):
        call(q, q[:, :kv_heads], v)
    with pytest.raises(ValueError, match="'q' and 'k' share memory"):  # k's slice starts one column early
        shifted = qkv[:, q_heads * head_dim - 1 : (q_heads + kv_heads) * head_dim - 1]
        call(q, shifted.unflatten(-1, (kv_heads, head_dim)), v)
    with pytest.raises(ValueError, match="'q' and 'v' share memory"):
        call(q, k, q[:, -kv_heads:])
    with pytest.raises(ValueError, match="'k' and 'v' share memory"):
        call(q, k, k)
    assert torch.equal(qkv, before), "a refused call wrote"
    # v is only read: one element may stand for several (here every head of a token reads the same one)
    call(q, k, v[:, :1].expand(-1, kv_heads, -1))


# ---------------------------------------------------------------------------------------------- paged attention


def make_paged_kv(context_lens, page_size, kv_heads, head_dim, dtype, device, g, width=None):
    """Random K/V caches and shuffled block tables holding each sequence's pages (padding: valid random pages), `width`
    pages wide (default: one more than the longest sequence's)."""
    blocks = [-(-c // page_size) for c in context_lens]
    max_blocks = max(blocks) + 1 if width is None else width
    num_pages = sum(blocks) + 3
    perm = torch.randperm(num_pages, generator=g)
    block_tables = torch.randint(0, num_pages, (len(context_lens), max_blocks), generator=g, dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks):
        block_tables[b, :n] = perm[start : start + n].to(torch.int32)
        start += n
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache = randn(*shape, dtype=dtype, device=device, g=g)
    v_cache = randn(*shape, dtype=dtype, device=device, g=g)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return k_cache, v_cache, block_tables.to(device), lens


DECODE_SHAPES = [
    # context_lens, group (Hq/Hkv), kv_heads, head_dim, page_size
    ([1, 15, 16, 17, 100, 33], 4, 2, 128, 16),
    ([255, 256, 257, 3], 1, 4, 64, 256),
    ([1, 47, 513], 3, 2, 80, 16),
    ([700, 5], 3, 2, 128, 256),
    ([31, 64, 65], 4, 1, 64, 16),
]


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("context_lens,group,kv_heads,head_dim,page_size", DECODE_SHAPES)
def test_paged_attention_decode(device, dtype, context_lens, group, kv_heads, head_dim, page_size):
    g = gen(sum(context_lens) + head_dim)
    k_cache, v_cache, block_tables, lens = make_paged_kv(context_lens, page_size, kv_heads, head_dim, dtype, device, g)
    q = randn(len(context_lens), group * kv_heads, head_dim, dtype=dtype, device=device, g=g)
    scale = head_dim**-0.5
    poison_next_alloc(q.shape, dtype, device)
    out = NATIVE[device].paged_attention_decode(q, k_cache, v_cache, block_tables, lens, scale, 0, 0.0)
    want = ref.paged_attention_decode(*on_cpu(q, k_cache, v_cache, block_tables, lens), scale, 0, 0.0)
    assert_close(out, want, dtype)


@pytest.mark.parametrize("_", [pytest.param(None, marks=_marks("cuda"), id="cuda")])
def test_cuda_paged_attention_split_merge_repeats_and_replays(_):
    """Split contexts and their merge: calls in a row, of other shapes in between, and replays of a captured graph
    all give the same bits (no state carried between launches)."""
    native = NATIVE["cuda"]
    g = gen(77)
    k_cache, v_cache, block_tables, lens = make_paged_kv([1, 300, 2049, 64], 16, 2, 128, torch.bfloat16, "cuda", g)
    q = randn(4, 8, 128, dtype=torch.bfloat16, device="cuda", g=g)
    first = native.paged_attention_decode(q, k_cache, v_cache, block_tables, lens, 0.1, 0, 0.0)
    assert_close(first, ref.paged_attention_decode(*on_cpu(q, k_cache, v_cache, block_tables, lens), 0.1, 0, 0.0),
                 torch.bfloat16)
    other = make_paged_kv([5, 700], 256, 2, 128, torch.bfloat16, "cuda", g)  # fewer rows, other splits
    native.paged_attention_decode(q[:2], *other, 0.1, 0, 0.0)
    for _ in range(3):
        assert torch.equal(native.paged_attention_decode(q, k_cache, v_cache, block_tables, lens, 0.1, 0, 0.0), first)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        native.paged_attention_decode(q, k_cache, v_cache, block_tables, lens, 0.1, 0, 0.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = native.paged_attention_decode(q, k_cache, v_cache, block_tables, lens, 0.1, 0, 0.0)
    for _ in range(3):
        out.zero_()
        graph.replay()
        assert torch.equal(out, first)


def captured(call):
    """`call()` captured in a CUDA graph (after a warm-up call on a side stream): the graph, and the tensor it
    returned, which each replay rewrites."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


# Lengths of the same six rows in turn, under a table 512 pages of 16 wide (8,192 keys).
WIDE_TABLE_LENGTHS = ([1, 64, 65, 300, 2049, 8192], [2, 700, 129, 8191, 16, 1000], [5000, 5000, 17, 1, 64, 8000])


@pytest.mark.parametrize("device,dtype",
                         cases(cpu_dtypes=(torch.float32,), cuda_dtypes=(torch.bfloat16, torch.float32)))
@pytest.mark.parametrize("head_dim", [128, 80])
def test_paged_attention_decode_rows_far_shorter_than_the_table(device, dtype, head_dim):
    """A decode graph's block tables are as wide as max_seq_len whatever its rows hold (on CUDA the splits are planned
    for the width, and each row divides its keys into those its own length gets). One call, on CUDA captured in a
    graph, replayed as the lengths change (and the workspace holds the last replay's partials): the reference's
    answer every time. head_dim 128 in bfloat16 runs the tensor-core kernel, the others the CUDA-core one."""
    g = gen(91 + head_dim)
    k_cache, v_cache, tables, lens = make_paged_kv(WIDE_TABLE_LENGTHS[0], 16, 2, head_dim, dtype, device, g, width=512)
    q = randn(len(lens), 8, head_dim, dtype=dtype, device=device, g=g)

    def call():
        return NATIVE[device].paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.1, 0, 0.0)

    run = call
    if device == "cuda":
        graph, out = captured(call)

        def run():
            graph.replay()
            return out

    for lengths in WIDE_TABLE_LENGTHS:
        lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        want = ref.paged_attention_decode(*on_cpu(q, k_cache, v_cache, tables, lens), 0.1, 0, 0.0)
        assert_close(run(), want, dtype)


@pytest.mark.parametrize("device,dtype", cases(cpu_dtypes=(torch.float32,), cuda_dtypes=(torch.bfloat16,)))
def test_paged_attention_prefill_rows_far_shorter_than_the_table(device, dtype):
    """Prefill rows (the CUDA-core kernel, causal) under a table 256 pages of 16 wide: each row splits by its own
    length."""
    runs = [(3, 10), (40, 300), (1, 2000), (17, 17), (5, 4096)]
    g = gen(404)
    k_cache, v_cache, tables, lens = make_paged_kv([c for _, c in runs], 16, 2, 64, dtype, device, g, width=256)
    q_lens = [n for n, _ in runs]
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=device)
    q = randn(sum(q_lens), 8, 64, dtype=dtype, device=device, g=g)
    args = (q, k_cache, v_cache, tables, cu, lens, 0.125, max(q_lens), 0, 0.0)
    assert_close(NATIVE[device].paged_attention(*args), ref.paged_attention(*on_cpu(*args)), dtype)


@pytest.mark.parametrize("device,dtype", cases(cpu_dtypes=(torch.float32,), cuda_dtypes=(torch.bfloat16,)))
def test_paged_attention_decode_strided_q(device, dtype):
    g = gen(5)
    k_cache, v_cache, block_tables, lens = make_paged_kv([40, 9], 16, 2, 64, dtype, device, g)
    fused = randn(2, 16 * 64, dtype=dtype, device=device, g=g)
    q = fused[:, : 8 * 64].view(2, 8, 64)  # token stride 1024, as a slice of a fused QKV output
    out = NATIVE[device].paged_attention_decode(q, k_cache, v_cache, block_tables, lens, 0.125, 0, 0.0)
    want = ref.paged_attention_decode(*on_cpu(q, k_cache, v_cache, block_tables, lens), 0.125, 0, 0.0)
    assert_close(out, want, dtype)


PREFILL_SHAPES = [
    # (q_len, context_len) per sequence, group, kv_heads, head_dim, page_size
    ([(5, 5), (1, 17), (16, 40), (33, 33)], 4, 2, 128, 16),
    ([(7, 300), (1, 1), (20, 256)], 1, 3, 64, 256),
    ([(9, 9), (3, 50)], 3, 2, 80, 16),
    ([(0, 12), (64, 100), (2, 2)], 4, 1, 64, 256),
]


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("runs,group,kv_heads,head_dim,page_size", PREFILL_SHAPES)
def test_paged_attention_prefill(device, dtype, runs, group, kv_heads, head_dim, page_size):
    g = gen(sum(c for _, c in runs) + head_dim)
    context_lens = [c for _, c in runs]
    k_cache, v_cache, block_tables, lens = make_paged_kv(context_lens, page_size, kv_heads, head_dim, dtype, device, g)
    q_lens = [n for n, _ in runs]
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=device)
    q = randn(sum(q_lens), group * kv_heads, head_dim, dtype=dtype, device=device, g=g)
    scale = head_dim**-0.5
    args = (q, k_cache, v_cache, block_tables, cu, lens, scale, max(q_lens), 0, 0.0)
    poison_next_alloc(q.shape, dtype, device)
    out = NATIVE[device].paged_attention(*args)
    assert_close(out, ref.paged_attention(*on_cpu(*args)), dtype)


# ---------------------------------------------------------------------------------------------- page copy


@pytest.mark.parametrize("device,dtype", cases(cpu_dtypes=(torch.float32, torch.bfloat16)))
@pytest.mark.parametrize("src,dst,num_slots", [(1, 3, 5), (2, 0, 16), (4, 4, 7), (0, 2, 0)])
def test_copy_page_slots(device, dtype, src, dst, num_slots):
    g = gen(src * 10 + dst + num_slots)
    shape = (3, 5, 16, 2, 64)
    k_cache = randn(*shape, dtype=dtype, device=device, g=g)
    v_cache = randn(*shape, dtype=dtype, device=device, g=g)
    k_ref, v_ref = on_cpu(k_cache, v_cache)
    ref.copy_page_slots(k_ref, v_ref, src, dst, num_slots)
    NATIVE[device].copy_page_slots(k_cache, v_cache, src, dst, num_slots)
    assert torch.equal(k_cache.cpu(), k_ref) and torch.equal(v_cache.cpu(), v_ref)


# ---------------------------------------------------------------------------------------------- sampling


def _sampling_batch(rows: int, vocab: int, device: str, g: torch.Generator):
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[:, ::97] = float("-inf")  # blocked tokens
    logits[::5, 10:20] = logits[::5, 10:11]  # exact ties
    if rows > 2:
        logits[2] = float("-inf")  # nothing pickable
    temperature = torch.tensor([0.0, 0.005, 0.5, 1.0, 1.7, 0.8])[torch.randint(0, 6, (rows,), generator=g)]
    top_k = torch.tensor([0, 1, 5, 50, vocab + 5, 0], dtype=torch.int32)[torch.randint(0, 6, (rows,), generator=g)]
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.0, 2.0])[torch.randint(0, 5, (rows,), generator=g)]
    min_p = torch.tensor([0.0, 0.05, 0.2, 0.0])[torch.randint(0, 4, (rows,), generator=g)]
    u = torch.rand(rows, generator=g)
    return [t.to(device) for t in (logits, temperature, top_k, top_p, min_p, u)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,vocab", [(64, 1003), (8, 32000), (3, 7)])
def test_sample_rows_matches_reference(device, rows, vocab):
    batch = _sampling_batch(rows, vocab, device, gen(rows + vocab))
    poison_next_alloc((rows,), torch.int64, device)
    token_ids, probs = NATIVE[device].sample_rows(*batch)
    assert token_ids.dtype == torch.int64 and probs.dtype == torch.float32
    expected = sref.sample_rows_reference(*batch)
    compared = 0
    for b, draw in enumerate(expected):
        if draw.margin < 1e-5:
            continue  # a decision this close to a boundary may flip with exp()'s rounding
        compared += 1
        assert int(token_ids[b]) == draw.token_id, f"row {b}: {int(token_ids[b])} != {draw.token_id}"
        assert abs(float(probs[b]) - draw.prob) <= 1e-5 * max(draw.prob, 1e-3), f"row {b}"
    assert compared >= rows * 0.9


@pytest.mark.parametrize("device", DEVICES)
def test_sample_rows_follows_the_filtered_distribution(device):
    """Independent of the reference: u on a fine grid must reproduce softmax/top-k/top-p/min-p frequencies."""
    vocab, num_draws = 40, 4000
    logits_row = torch.randn(vocab, generator=gen(3)) * 2
    temperature, top_k, top_p, min_p = 0.7, 12, 0.8, 0.03
    probs = torch.softmax(logits_row.double() / temperature, dim=0)
    order = torch.argsort(probs, descending=True)
    head = probs[order[:top_k]] / probs[order[:top_k]].sum()
    n_top_p = int((head.cumsum(0) < top_p).sum()) + 1  # smallest head whose mass reaches top_p
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[order[:n_top_p]] = True
    keep &= probs >= min_p * probs.max()
    expected = torch.where(keep, probs, 0.0)
    expected /= expected.sum()

    def full(value, dtype=torch.float32):
        return torch.full((num_draws,), value, dtype=dtype, device=device)

    u = ((torch.arange(num_draws, dtype=torch.float64) + 0.5) / num_draws).float().to(device)
    token_ids, token_probs = NATIVE[device].sample_rows(
        logits_row.to(device).expand(num_draws, vocab), full(temperature), full(top_k, torch.int32), full(top_p),
        full(min_p), u,
    )
    freq = torch.bincount(token_ids.cpu(), minlength=vocab).double() / num_draws
    assert float((freq - expected).abs().max()) <= 1.5 / num_draws
    torch.testing.assert_close(token_probs.cpu().double(), expected[token_ids.cpu()], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_sample_rows_agrees_with_folio_sampler(device):
    """The kernel implements folio.sampling's definition; only decisions at a boundary may differ."""
    from folio.sampling import RowParams, SamplerSettings, sample

    g = gen(17)
    rows, vocab = 48, 500
    logits = (torch.randn(rows, vocab, generator=g) * 2.5).to(device)
    settings = [SamplerSettings(temperature=t, top_k=k, top_p=p, min_p=m, token_repetition_penalty=1.0)
                for t, k, p, m in [(0.8, 50, 0.8, 0.0), (1.2, 0, 0.95, 0.05), (0.0, 0, 0.0, 0.0), (0.6, 5, 1.0, 0.2)]]
    row_settings = [settings[b % len(settings)] for b in range(rows)]
    u = torch.rand(rows, generator=g)
    params = [RowParams(settings=s, u=float(u[b])) for b, s in enumerate(row_settings)]
    theirs = sample(logits, params)

    def column(fn, dtype=torch.float32):
        return torch.tensor([fn(s) for s in row_settings], dtype=dtype, device=device)

    top_p = column(lambda s: s.top_p if s.top_p_active else 2.0)
    args = (logits, column(lambda s: s.temperature), column(lambda s: s.top_k, torch.int32), top_p,
            column(lambda s: s.min_p), u.to(device))
    token_ids, probs = NATIVE[device].sample_rows(*args)
    reference = sref.sample_rows_reference(*args)
    compared = 0
    for b, draw in enumerate(reference):
        if draw.margin < 1e-5:
            continue
        compared += 1
        assert int(token_ids[b]) == int(theirs.token_ids[b]), f"row {b} ({row_settings[b]})"
        assert abs(float(probs[b]) - float(theirs.token_probs[b])) <= 1e-4, f"row {b}"
    assert compared >= rows * 0.9


def _penalty_batch(rows, vocab, history_len, device, g):
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(device)
    history = torch.randint(0, min(vocab, 40), (rows, history_len), generator=g)  # many repeats
    if history_len:
        history[:, :5] = -1  # left padding
        history[0, -1], history[-1, -2] = vocab + 3, -7  # out of range: ignored
    rep = 1.0 + torch.rand(rows, generator=g)
    freq = torch.rand(rows, generator=g) * 0.5
    pres = torch.rand(rows, generator=g) * 0.5
    sustain = torch.randint(0, history_len + 2, (rows,), generator=g, dtype=torch.int32)
    decay = torch.randint(0, history_len + 2, (rows,), generator=g, dtype=torch.int32)
    return logits, *[t.to(device) for t in (history, rep, freq, pres, sustain, decay)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "rows,vocab,history_len", [(8, 500, 64), (3, 32000, 1000), (2, 10, 0), (2, 300, 3000), (2, 50, 10000)]
)
def test_apply_penalties(device, rows, vocab, history_len):
    logits, *rest = _penalty_batch(rows, vocab, history_len, device, gen(rows + vocab + history_len))
    expected = logits.clone()
    sref.apply_penalties_reference(expected, *rest)
    NATIVE[device].apply_penalties(logits, *rest)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_apply_penalties_agrees_with_folio_sampler(device):
    from folio.sampling import RowParams, SamplerSettings, sample

    g = gen(23)
    rows, vocab = 6, 200
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(device)
    histories = [torch.randint(0, 60, (n,), generator=g).tolist() for n in (0, 1, 30, 100, 7, 64)]
    settings = [SamplerSettings(token_repetition_penalty=1.3, token_repetition_range=r, token_repetition_decay=d,
                                token_frequency_penalty=0.2, token_presence_penalty=0.3)
                for r, d in [(-1, 0), (5, 0), (10, 8), (-1, 0), (0, 4), (20, 30)]]
    params = [RowParams(settings=s, u=0.5, history_ids=h, return_logits=True) for s, h in zip(settings, histories)]
    theirs = sample(logits, params).logits

    width = max(len(h) for h in histories)
    history = torch.tensor([[-1] * (width - len(h)) + h for h in histories], dtype=torch.int64, device=device)

    def column(fn, dtype=torch.float32):
        return torch.tensor([fn(s) for s in settings], dtype=dtype, device=device)

    mine = logits.clone()
    NATIVE[device].apply_penalties(
        mine, history, column(lambda s: s.token_repetition_penalty), column(lambda s: s.token_frequency_penalty),
        column(lambda s: s.token_presence_penalty),
        column(lambda s: width if s.token_repetition_range < 0 else s.token_repetition_range, torch.int32),
        column(lambda s: s.token_repetition_decay, torch.int32),
    )
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_mask_tokens(device):
    g = gen(11)
    logits = torch.randn(4, 300, generator=g).to(device)
    token_ids = torch.randint(-1, 310, (4, 9), generator=g).to(device)
    expected = logits.clone()
    sref.mask_tokens_reference(expected, token_ids)
    NATIVE[device].mask_tokens(logits, token_ids)
    assert torch.equal(logits, expected)


# ---------------------------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_name_the_argument(device):
    native = NATIVE[device]
    g = gen(2)
    k_cache, v_cache, block_tables, lens = make_paged_kv([20], 16, 2, 64, torch.float32, device, g)
    q = randn(1, 4, 64, dtype=torch.float32, device=device, g=g)
    with pytest.raises(TypeError, match="'k_cache'"):
        native.paged_attention_decode(q, k_cache.half(), v_cache, block_tables, lens, 1.0, 0, 0.0)
    with pytest.raises(TypeError, match="'block_tables'"):
        native.paged_attention_decode(q, k_cache, v_cache, block_tables.long(), lens, 1.0, 0, 0.0)
    with pytest.raises(ValueError, match="'context_lens'"):
        native.paged_attention_decode(q, k_cache, v_cache, block_tables, lens[:0], 1.0, 0, 0.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        native.paged_attention_decode(q[:, :3], k_cache, v_cache, block_tables, lens, 1.0, 0, 0.0)
    with pytest.raises(ValueError, match="'weight'"):
        native.rms_norm(q[0], torch.ones(65, device=device), 1e-6)
    with pytest.raises(ValueError, match="'num_slots'"):
        native.copy_page_slots(k_cache[None], v_cache[None], 0, 1, 17)
    row = torch.zeros(2, device=device)
    with pytest.raises(ValueError, match="'u'"):
        native.sample_rows(torch.zeros(2, 5, device=device), row, row.int(), row, row, torch.zeros(3, device=device))


@pytest.mark.skipif(NATIVE["cpu"] is None, reason="folio._native_cpu is not built")
def test_cpu_checks_index_tensors():
    g = gen(4)
    k_cache, v_cache, block_tables, lens = make_paged_kv([20], 16, 2, 64, torch.float32, "cpu", g)
    q = randn(1, 4, 64, dtype=torch.float32, device="cpu", g=g)
    block_tables[0, 0] = k_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_tables\[0, 0\]"):
        NATIVE["cpu"].paged_attention_decode(q, k_cache, v_cache, block_tables, lens, 1.0, 0, 0.0)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_q_len"):
        NATIVE["cpu"].paged_attention(q, k_cache, v_cache, block_tables, cu, torch.tensor([0], dtype=torch.int32),
                                      1.0, 1, 0, 0.0)


# ---------------------------------------------------------------------------------------------- CUDA only

CUDA = _marks("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "context_lens,q_heads,kv_heads,head_dim,page_size",
    [
        ([4000, 1, 2500, 700], 32, 8, 128, 16),  # splits over the context (flash-decoding path)
        ([16384, 3], 32, 8, 128, 256),
        ([3000, 17], 16, 2, 64, 32),  # group 8
        ([1200, 45], 14, 2, 128, 64),  # group 7: padded head tile
        ([900, 300], 32, 2, 96, 16),  # group 16: two head chunks, generic head dim
        ([513], 8, 8, 256, 128),  # group 1, largest generic head dim
    ],
)
@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
def test_cuda_decode_long_contexts_and_wide_groups(_, dtype, context_lens, q_heads, kv_heads, head_dim, page_size):
    g = gen(sum(context_lens) + q_heads)
    k_cache, v_cache, block_tables, lens = make_paged_kv(context_lens, page_size, kv_heads, head_dim, dtype, "cuda", g)
    q = randn(len(context_lens), q_heads, head_dim, dtype=dtype, device="cuda", g=g)
    poison_next_alloc(q.shape, dtype, "cuda")
    out = NATIVE["cuda"].paged_attention_decode(q, k_cache, v_cache, block_tables, lens, head_dim**-0.5, 0, 0.0)
    expected = ref.paged_attention_decode(*on_cpu(q, k_cache, v_cache, block_tables, lens), head_dim**-0.5, 0, 0.0)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
def test_cuda_prefill_chunk_over_long_context(_):
    """Few query rows over a long cached prefix: the prefill path splits the context too."""
    dtype = torch.bfloat16
    g = gen(99)
    runs = [(64, 3000), (5, 2049)]
    k_cache, v_cache, block_tables, lens = make_paged_kv([c for _, c in runs], 16, 2, 128, dtype, "cuda", g)
    cu = torch.tensor([0, 64, 69], dtype=torch.int32, device="cuda")
    q = randn(69, 8, 128, dtype=dtype, device="cuda", g=g)
    args = (q, k_cache, v_cache, block_tables, cu, lens, 128**-0.5, 64, 0, 0.0)
    assert_close(NATIVE["cuda"].paged_attention(*args), ref.paged_attention(*on_cpu(*args)), dtype)


@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
def test_cuda_decode_replays_in_a_cuda_graph(_):
    """No host synchronization inside: the op captures into a graph, and replays follow new inputs."""
    dtype = torch.bfloat16
    g = gen(7)
    k_cache, v_cache, block_tables, lens = make_paged_kv([3000, 40, 700], 16, 8, 128, dtype, "cuda", g)
    q = randn(3, 32, 128, dtype=dtype, device="cuda", g=g)
    native = NATIVE["cuda"]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        native.paged_attention_decode(q, k_cache, v_cache, block_tables, lens, 0.1, 0, 0.0)  # warm up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = native.paged_attention_decode(q, k_cache, v_cache, block_tables, lens, 0.1, 0, 0.0)
    for step in range(3):
        q.copy_(randn(3, 32, 128, dtype=dtype, device="cuda", g=g))
        lens.copy_(torch.tensor([3000 - step, 40 + step, 700], dtype=torch.int32))
        graph.replay()
        want = ref.paged_attention_decode(*on_cpu(q, k_cache, v_cache, block_tables, lens), 0.1, 0, 0.0)
        assert_close(out, want, dtype)


# Decode shapes for both CUDA decode kernels: the tensor-core kernel takes 16-bit caches with head_dim 64 or 128
# and up to 16 query heads per kv head (the other rows of DECODE_SHAPES fall back to the CUDA-core kernel either way).
BOTH_DECODE_KERNEL_SHAPES = [
    *DECODE_SHAPES,
    ([2048, 1, 130, 16], 16, 1, 128, 64),  # group 16: all 16 rows of the mma; splits over a long context
    ([4000, 3], 8, 2, 64, 256),  # 4000 keys: not a whole number of 16-key tiles per split
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("context_lens,group,kv_heads,head_dim,page_size", BOTH_DECODE_KERNEL_SHAPES)
@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
def test_cuda_decode_tensor_core_and_cuda_core_kernels(_, dtype, context_lens, group, kv_heads, head_dim, page_size):
    """use_mma=False (EngineOptions.decode_attention="simt") selects the CUDA-core decode kernel, True the
    tensor-core one where it applies; both match the CPU reference. Where the tensor-core kernel applies the two
    results must differ in some bits (it rounds the softmax weights to the cache dtype), which shows that the
    argument picked it; an op set passes it from its options."""
    g = gen(sum(context_lens) + 7 * group)
    k_cache, v_cache, block_tables, lens = make_paged_kv(context_lens, page_size, kv_heads, head_dim, dtype, "cuda", g)
    q = randn(len(context_lens), group * kv_heads, head_dim, dtype=dtype, device="cuda", g=g)
    scale = head_dim**-0.5
    expected = ref.paged_attention_decode(*on_cpu(q, k_cache, v_cache, block_tables, lens), scale, 0, 0.0)
    outs = {}
    for kernel in ("mma", "simt"):
        poison_next_alloc(q.shape, dtype, "cuda")
        outs[kernel] = NATIVE["cuda"].paged_attention_decode(q, k_cache, v_cache, block_tables, lens, scale, 0, 0.0,
                                                             use_mma=kernel == "mma")
        assert_close(outs[kernel], expected, dtype)
        via_op_set = ops.OpSet(decode_attention=kernel).paged_attention_decode(q, k_cache, v_cache, block_tables,
                                                                               lens, scale, 0, 0.0)
        assert torch.equal(via_op_set, outs[kernel])
    if head_dim in (64, 128) and group <= 16:
        assert not torch.equal(outs["mma"], outs["simt"]), "the tensor-core kernel did not run"


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
def test_cuda_dependent_kernel_chain_matches_serialized_calls(_, pdl):
    """The decode kernels launch early (programmatic dependent launch, sm_90; pdl=True) and wait on the device for
    the kernel before them: a chain in which every kernel reads what the previous one wrote (GEMV -> attention ->
    GEMV -> add + RMSNorm -> gated GEMV -> GEMV ...), run plainly and replayed from a CUDA graph, gives the same
    bits as the same calls with a host synchronization after each one. pdl=False (EngineOptions.pdl) launches
    them in plain stream order, with the same bits."""
    native = NATIVE["cuda"]
    dtype, hidden, heads, kv_heads, head_dim, layers = torch.bfloat16, 1024, 8, 2, 128, 6
    g = gen(31)
    k_cache, v_cache, block_tables, lens = make_paged_kv([700, 33], 64, kv_heads, head_dim, dtype, "cuda", g)
    w_q = randn(heads * head_dim, hidden, dtype=dtype, device="cuda", g=g, scale=hidden**-0.5)
    w_o = randn(hidden, heads * head_dim, dtype=dtype, device="cuda", g=g, scale=hidden**-0.5)
    w_gate_up = randn(2 * 2048, hidden, dtype=dtype, device="cuda", g=g, scale=hidden**-0.5)
    w_down = randn(hidden, 2048, dtype=dtype, device="cuda", g=g, scale=2048**-0.5)
    norm_weight = randn(hidden, dtype=dtype, device="cuda", g=g)
    x0 = randn(2, hidden, dtype=dtype, device="cuda", g=g)

    def chain(x, residual, sync):
        def done(t):
            if sync:
                torch.cuda.synchronize()
            return t

        for _ in range(layers):
            q = done(native.linear(x, w_q, pdl=pdl)).view(2, heads, head_dim)
            attn = done(native.paged_attention_decode(q, k_cache, v_cache, block_tables, lens, head_dim**-0.5, 0,
                                                      0.0, pdl=pdl))
            h = done(native.linear(attn.view(2, -1), w_o, pdl=pdl))
            done(native.fused_add_rms_norm(h, residual, norm_weight, 1e-6, pdl=pdl))
            gated = done(native.linear(h, w_gate_up, silu_gate=True, pdl=pdl))
            x = done(native.linear(gated, w_down, pdl=pdl))
        return x

    expected = chain(x0.clone(), x0.clone(), sync=True)
    for attempt in range(3):
        got = chain(x0.clone(), x0.clone(), sync=False)
        diff = (got.float() - expected.float()).abs().max()
        assert torch.equal(got, expected), f"eager run {attempt}: max diff {diff}"
    x, residual = x0.clone(), x0.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(x.clone(), residual.clone(), sync=False)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x, residual, sync=False)
    for replay in range(3):
        x.copy_(x0)
        residual.copy_(x0)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected), f"replay {replay}: max diff {(out.float() - expected.float()).abs().max()}"


@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
def test_cuda_sampling_large_vocab_matches_cpu_kernel(_):
    """CUDA and CPU kernels share the integer-mass definition: same tokens except at exp() rounding boundaries."""
    assert NATIVE["cpu"] is not None, "setup.py builds folio._native_cpu whenever it builds folio._native_cuda"
    batch = _sampling_batch(256, 128256, "cpu", gen(5))
    ids_cpu, probs_cpu = NATIVE["cpu"].sample_rows(*batch)
    ids_gpu, probs_gpu = NATIVE["cuda"].sample_rows(*[t.cuda() for t in batch])
    mismatches = int((ids_cpu != ids_gpu.cpu()).sum())
    assert mismatches <= 2, f"{mismatches} of 256 rows differ"
    same = ids_cpu == ids_gpu.cpu()
    torch.testing.assert_close(probs_gpu.cpu()[same], probs_cpu[same], rtol=1e-5, atol=1e-7)


def _assert_cuda_sampling_matches_cpu_kernel(batch, max_mismatches: int) -> None:
    """Both kernels on the same CPU batch. Ids must agree except in up to max_mismatches rows (the two exps may
    differ by an ulp, which can only flip a decision that sits on a boundary); probs to those ulps."""
    assert NATIVE["cpu"] is not None, "setup.py builds folio._native_cpu whenever it builds folio._native_cuda"
    ids_cpu, probs_cpu = NATIVE["cpu"].sample_rows(*batch)
    poison_next_alloc((batch[0].shape[0],), torch.int64, "cuda")
    ids_gpu, probs_gpu = NATIVE["cuda"].sample_rows(*[t.cuda() for t in batch])
    ids_gpu, probs_gpu = ids_gpu.cpu(), probs_gpu.cpu()
    assert not probs_gpu.isnan().any()
    differ = (ids_cpu != ids_gpu).nonzero().flatten().tolist()
    detail = f"rows {differ}: cuda {ids_gpu[differ].tolist()}, cpu {ids_cpu[differ].tolist()}"
    assert len(differ) <= max_mismatches, detail
    same = ids_cpu == ids_gpu
    torch.testing.assert_close(probs_gpu[same], probs_cpu[same], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("top_k", [1, 2, 50, 1000, 1024, 1025])
@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
def test_cuda_sampling_top_k_short_list_matches_cpu_kernel(_, top_k):
    """2 <= top_k <= 1024 takes the short-list path, whose radix select stops as soon as the elements at or above
    its bucket fit in shared memory; 1025 the full select, 1 the argmax. Logit scales from flat to peaked make that
    stop come after one to four histogram passes."""
    g = gen(1000 + top_k)
    vocab = 128256
    settings = [(scale, t, p, m) for scale in (0.3, 1.0, 3.0, 8.0)
                for t, p, m in ((0.5, 1.0, 0.0), (0.8, 0.8, 0.0), (1.0, 0.95, 0.05), (1.7, 1.0, 0.02))]
    rows = len(settings)

    def column(i, dtype=torch.float32):
        return torch.tensor([s[i] for s in settings], dtype=dtype)

    logits = torch.randn(rows, vocab, generator=g) * column(0)[:, None]
    batch = [logits, column(1), torch.full((rows,), top_k, dtype=torch.int32), column(2), column(3),
             torch.rand(rows, generator=g)]
    _assert_cuda_sampling_matches_cpu_kernel(batch, max_mismatches=1)


def _tied_sampling_rows(vocab: int, g: torch.Generator):
    """(logits row, top_k) pairs with exact ties where the short-list path decides: at the top-k boundary (fitting
    after the first or the second radix pass, or never: the fallback resolves the tie by index), at the top, the
    short list exactly full, every logit equal, and -inf logits (zero weights tied at the boundary)."""
    def levels(*counts_values):
        row = torch.randn(vocab, generator=g) - 20  # background far below the levels (weights ~e^-25, not denormal)
        perm = torch.randperm(vocab, generator=g)  # each level at random positions, across threads and chunks
        start = 0
        for count, value in counts_values:
            row[perm[start:start + count]] = value
            start += count
        return row

    def finite_among_inf(count):
        row = torch.full((vocab,), float("-inf"))
        row[torch.randperm(vocab, generator=g)[:count]] = torch.randn(count, generator=g) * 3
        return row

    # weights at temperature 1 (0.8): 5.0 -> 1.0, 4.0 -> 0x3ebc5ab1 (0x3e92b0c1), 3.9 -> 0x3eaa6e15 (0x3e817431):
    # 4.0 and 3.9 share the top byte and differ in the next one
    return [
        (levels((40, 5.0), (100, 4.0)), 50),  # 140 at or above the first bucket: fits at once, tie at the boundary
        (levels((40, 5.0), (500, 4.0), (1000, 3.9)), 300),  # 1540, then 540 after the second pass
        (levels((40, 5.0), (1500, 4.0)), 50),  # 1540 share the bucket down to the last byte: fallback, tie walk
        (levels((2000, 5.0)), 50),  # tied at the top, more than fit: fallback
        (levels((3, 5.0)), 2),  # two of three tied maxima, by index
        (levels((1023, 5.0), (5000, 4.0)), 1023),  # exactly the 1023 that fit
        (levels((1023, 5.0), (5000, 4.0)), 1024),  # one of the 5000 tied: fallback
        (levels((1024, 5.0)), 1024),  # the short list exactly full
        (levels((1025, 5.0)), 1024),  # one more than fit: fallback
        (levels((1025, 5.0)), 1025),  # top_k past the short list: the full select
        (torch.full((vocab,), 0.5), 2),  # every logit equal: every weight 1, every key tied
        (torch.full((vocab,), 0.5), 50),
        (torch.full((vocab,), 0.5), 1024),
        (torch.full((vocab,), 0.5), 1025),
        (finite_among_inf(30), 50),  # 20 of the zero weights complete the top-k, by index: fallback
        (finite_among_inf(100), 50),
        (finite_among_inf(1000), 1000),  # the boundary is the smallest nonzero weight
        (finite_among_inf(1000), 1024),  # 24 zero weights, by index: fallback
    ]


@pytest.mark.parametrize("temperature", [1.0, 0.8])
@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
def test_cuda_sampling_top_k_ties_match_cpu_kernel(_, temperature):
    """Exact ties at the top-k boundary are cut by index, as the CPU kernel's stable sort does, whether the short
    list holds every tied element or the select falls back to walking the tie."""
    g = gen(int(temperature * 10))
    vocab = 128256
    cases = _tied_sampling_rows(vocab, g)
    # each case under several filters: top-p and min-p cut the sorted short list, the draw lands anywhere in it
    filters = [(1.0, 0.0), (0.8, 0.0), (0.9, 0.1), (0.5, 0.0)]
    rows = [(row, k, p, m) for row, k in cases for p, m in filters]
    n = len(rows)
    batch = [torch.stack([r[0] for r in rows]), torch.full((n,), temperature),
             torch.tensor([r[1] for r in rows], dtype=torch.int32), torch.tensor([r[2] for r in rows]),
             torch.tensor([r[3] for r in rows]), torch.rand(n, generator=g)]
    _assert_cuda_sampling_matches_cpu_kernel(batch, max_mismatches=0)


@pytest.mark.parametrize("vocab,top_k", [(7, 5), (1000, 999), (1024, 1023), (1025, 1024), (1030, 1024), (3000, 2)])
@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
def test_cuda_sampling_top_k_small_vocab_matches_cpu_kernel(_, vocab, top_k):
    """A vocabulary of at most 1024 always fits the short list at once (its whole row is sorted); just above, the
    select may have to narrow first. Rows end inside a chunk of the passes."""
    g = gen(vocab + top_k)
    rows = 12
    logits = torch.randn(rows, vocab, generator=g) * 2
    logits[::3, : vocab // 2] = logits[::3, :1]  # half the row tied
    logits[1::3, ::2] = float("-inf")
    batch = [logits, torch.tensor([0.5, 0.8, 1.0, 1.7])[torch.arange(rows) % 4],
             torch.full((rows,), top_k, dtype=torch.int32), torch.tensor([1.0, 0.9, 0.8])[torch.arange(rows) % 3],
             torch.tensor([0.0, 0.0, 0.05, 0.0, 0.1, 0.0])[torch.arange(rows) % 6], torch.rand(rows, generator=g)]
    _assert_cuda_sampling_matches_cpu_kernel(batch, max_mismatches=0)


# ------------------------------------------------------------------------------------ linear (CUDA: decode GEMV)

# (out_features N, in_features K): small and odd ones, then Llama-3-8B's qkv, o_proj, gate_up, down and lm_head
LINEAR_SHAPES = [(8, 24), (1000, 520), (13, 40), (3, 8), (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                 (128256, 4096)]
LINEAR_ROWS = (1, 2, 5, 8)


def _linear_inputs(rows, out_features, in_features, dtype, seed):
    """x [rows, K], weight [N, K], bias [N] on the GPU; weight scaled so that outputs are ~N(0, 1)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g, device="cuda").to(dtype)
    weight = (torch.randn(out_features, in_features, generator=g, device="cuda") * in_features**-0.5).to(dtype)
    bias = torch.randn(out_features, generator=g, device="cuda").to(dtype)
    return x, weight, bias


def _linear_oracle(x, weight, bias=None):
    """fp32 math on the CPU (no TF32) over the rounded inputs."""
    out = x.cpu().float() @ weight.cpu().float().T
    return out + bias.cpu().float() if bias is not None else out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("out_features,in_features", LINEAR_SHAPES)
@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
def test_cuda_linear_matches_fp32_math(_, dtype, out_features, in_features):
    native = NATIVE["cuda"]
    x, weight, bias = _linear_inputs(max(LINEAR_ROWS), out_features, in_features, dtype, out_features + in_features)
    expected = _linear_oracle(x, weight)
    for rows in LINEAR_ROWS:
        for b in (None, bias):
            poison_next_alloc((rows, out_features), dtype, "cuda")
            out = native.linear(x[:rows], weight, b)
            assert out.dtype == dtype and out.shape == (rows, out_features) and out.is_contiguous()
            want = expected[:rows] + (bias.cpu().float() if b is not None else 0.0)
            assert_close(out, want, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
def test_cuda_linear_is_deterministic_and_batch_invariant(_, dtype):
    """The summation order depends on K only: row m's result is bitwise the same for any number of rows, any run."""
    native = NATIVE["cuda"]
    x, weight, bias = _linear_inputs(8, 4096, 14336, dtype, 3)
    full = native.linear(x, weight, bias)
    assert torch.equal(native.linear(x, weight, bias), full)
    for rows in (1, 2, 5):
        assert torch.equal(native.linear(x[:rows], weight, bias), full[:rows])
    assert torch.equal(native.linear(x[3:4], weight, bias), full[3:4])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
def test_cuda_linear_strided_misaligned_and_odd_k(_, dtype):
    """Layouts off the vectorized path: row strides, K not a multiple of 8, rows not on 16 bytes. All accepted."""
    native = NATIVE["cuda"]
    x, weight, bias = _linear_inputs(5, 33, 304, dtype, 9)  # views below keep the row stride 304
    cases = {
        "strided rows": (x[:, :296], weight[:, :296]),  # still 16-byte aligned rows: the vectorized path
        "odd K": (x[:, :37].contiguous(), weight[:, :37].contiguous()),
        "odd K, strided": (x[:, :37], weight[:, :37]),
        "rows off 16 bytes": (x[:, 1:297], weight[:, 1:297]),
        "x rows off 16 bytes": (x[:, 1:297], weight[:, :296]),
        "K = 1": (x[:, :1].contiguous(), weight[:, :1].contiguous()),
    }
    for name, (xs, ws) in cases.items():
        for b in (None, bias):
            err = rel_err(native.linear(xs, ws, b), _linear_oracle(xs, ws, b))
            assert err <= TOLERANCE[dtype], f"{name}, bias={b is not None}: rel err {err:.3g}"
    empty = native.linear(x[:0], weight, bias)
    assert empty.shape == (0, 33)
    zero_k = native.linear(x[:, :0], weight[:, :0], bias)
    assert torch.equal(zero_k, bias.expand(5, 33))


@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
def test_cuda_linear_rejects_unsupported_arguments(_):
    native = NATIVE["cuda"]
    x, weight, bias = _linear_inputs(9, 16, 64, torch.bfloat16, 4)
    with pytest.raises(ValueError, match="at most 8 rows"):
        native.linear(x, weight, bias)
    x = x[:2]
    with pytest.raises(TypeError, match="'weight'"):
        native.linear(x, weight.half(), bias)
    with pytest.raises(TypeError, match="'bias'"):
        native.linear(x, weight, bias.float())
    with pytest.raises(TypeError, match="'x'"):
        native.linear(x.int(), weight.int(), None)
    with pytest.raises(ValueError, match="'weight'"):
        native.linear(x, weight[:, :32], bias)
    with pytest.raises(ValueError, match="'bias'"):
        native.linear(x, weight, bias[:8])
    with pytest.raises(ValueError, match="'x'"):
        native.linear(x[0], weight, bias)
    with pytest.raises(ValueError, match="'x' must have a contiguous last dimension"):
        native.linear(x.repeat(1, 2)[:, ::2], weight, bias)
    with pytest.raises(ValueError, match="'weight' must have a contiguous last dimension"):
        native.linear(x, weight.t().contiguous().t(), bias)
    with pytest.raises(ValueError, match="'x'"):
        native.linear(x.cpu(), weight, bias)
    with pytest.raises(ValueError, match="'bias'"):
        native.linear(x, weight, bias.cpu())
    assert native.LINEAR_MAX_ROWS == ops.LINEAR_MAX_ROWS


@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
def test_cuda_linear_replays_in_a_cuda_graph(_):
    native = NATIVE["cuda"]
    x, weight, bias = _linear_inputs(4, 1000, 520, torch.bfloat16, 6)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        native.linear(x, weight, bias)  # warm up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = native.linear(x, weight, bias)
    for seed in range(3):
        x.copy_(_linear_inputs(4, 1, 520, torch.bfloat16, 100 + seed)[0])
        graph.replay()
        assert_close(out, _linear_oracle(x, weight, bias), torch.bfloat16)


def test_linear_supported_states_the_fast_path_conditions():
    """ops.linear_supported: CPU tensors never; on a GPU, only what the native kernel takes on its fast path."""
    x, weight = torch.randn(1, 64), torch.randn(32, 64)
    assert not ops.linear_supported(x, weight)
    torch.testing.assert_close(ops.OpSet().linear(x, weight), torch.nn.functional.linear(x, weight))  # reference
    if not torch.cuda.is_available():
        return
    x, weight, bias = _linear_inputs(8, 32, 64, torch.bfloat16, 5)
    assert ops.linear_supported(x, weight) and ops.linear_supported(x, weight, bias)
    assert ops.linear_supported(x[:1], weight, bias)
    nine = torch.cat([x, x[:1]])
    assert not ops.linear_supported(nine, weight, bias)  # prefill / larger batches: cuBLAS
    assert not ops.linear_supported(x[:, :60], weight[:, :60])  # K % 8
    assert not ops.linear_supported(x[:, 1:57], weight[:, :56])  # x rows off 16 bytes
    assert not ops.linear_supported(x.float(), weight)  # dtypes differ
    assert not ops.linear_supported(x, weight, bias[:16])
    assert ops.linear_supported(x.float(), weight.float(), bias.float())
    assert not ops.linear_supported(x.float()[:, :62], weight.float()[:, :62])  # fp32: K % 4
    if NATIVE["cuda"] is not None:
        assert ops.OpSet().linear_supported(x, weight, bias) and not ops.OpSet("reference").linear_supported(x, weight)
        assert_close(ops.OpSet().linear(x, weight, bias), _linear_oracle(x, weight, bias), torch.bfloat16)


# ------------------------------------------------------------------ linear's fusion: the MLP's SiLU gate


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_features,in_features", [(26, 40), (2000, 520), (28672, 4096), (8, 24)])
@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
def test_cuda_linear_silu_gate_is_bitwise_linear_then_silu_and_mul(_, dtype, out_features, in_features):
    """silu_gate: weight is [gate; up]; each block pairs gate rows with their up rows and gates in its epilogue."""
    native = NATIVE["cuda"]
    x, weight, bias = _linear_inputs(8, out_features, in_features, dtype, out_features - in_features)
    for rows in LINEAR_ROWS:
        for b in (None, bias):
            poison_next_alloc((rows, out_features // 2), dtype, "cuda")
            got = native.linear(x[:rows], weight, b, silu_gate=True)
            assert got.shape == (rows, out_features // 2) and got.is_contiguous()
            assert torch.equal(got, native.silu_and_mul(native.linear(x[:rows], weight, b)))
    # off the vectorized path too (K not a multiple of 8)
    odd_x, odd_w = x[:3, :37].contiguous(), weight[:, :37].contiguous()
    got = native.linear(odd_x, odd_w, None, silu_gate=True)
    assert torch.equal(got, native.silu_and_mul(native.linear(odd_x, odd_w)))


@pytest.mark.parametrize("_", [pytest.param(None, marks=CUDA, id="cuda")])
def test_cuda_linear_silu_gate_rejects_bad_arguments(_):
    native = NATIVE["cuda"]
    x, weight, bias = _linear_inputs(4, 16, 64, torch.bfloat16, 4)
    with pytest.raises(ValueError, match="even number of rows"):
        native.linear(x, weight[:15], bias[:15], silu_gate=True)
    with pytest.raises(ValueError, match="silu_gate takes float16 or bfloat16"):
        native.linear(x.float(), weight.float(), None, silu_gate=True)


def test_reference_linear_silu_gate_is_the_composition():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).bfloat16()
    weight, bias = torch.randn(32, 64, generator=g).bfloat16(), torch.randn(32, generator=g).bfloat16()
    product = torch.nn.functional.linear(x, weight, bias)
    op_set = ops.OpSet()  # CPU tensors: the reference, as the CPU module has no linear
    assert torch.equal(op_set.linear(x, weight, bias, silu_gate=True), ref.silu_and_mul(product))
    assert torch.equal(op_set.linear(x, weight, bias), product)
