"""Prefill attention on tensor cores: torch's bundled FlashAttention-2 (varlen) over the paged cache.

Our own `paged_attention` kernel runs prefill on CUDA cores (~15 TFLOP/s on an H200); FlashAttention-2 runs it on
tensor cores. Two ways to feed it the paged K/V:
- "flash_paged": FA2 reads the pages itself through the block table (needs page_size % 256 == 0 and a torch whose
  `_flash_attention_forward` takes `block_table`; torch 2.11's does not);
- "flash_gather": the sequences with several new tokens get their contexts gathered into contiguous K/V (one
  index_select per layer) for FA2; one-token rows of the same step (decoding sequences) go to our decode kernel.
  Prompts with no cached prefix whose rows form one run (the usual prefill step) skip the gather and the
  scatter: FA2 reads the layer's new K/V and q in place, and the two outputs are concatenated.
Varlen FA2 aligns the causal mask bottom-right, which is what a chunk continuing a cached context needs.

Equal-length fresh prompts (a batch job's step: 32 prompts of 512 tokens) go to cuDNN's fused attention as one
dense [B, H, L, D] batch instead: on an H100 it ran 32 x 512 causal at 290 TFLOP/s against FA2's 136, and 2 x 8192 at
625 against 341 (bench/prefill_attention.py). cuDNN builds an execution plan for each new (B, L) on the host (35-56
ms measured), so a shape takes this path only from its second step on (`DENSE_MIN_SEEN`): one-off shapes never pay
for a plan. Small shapes (B * L^2 < `DENSE_MIN_WORK`) stay on FA2, which is faster there. Its varlen (ragged) entry
point is not used: it ran ~40 ms per call on torch 2.11 (a plan per call).

Which one runs ("auto"): the first that passes a small numerical probe against the reference on this device,
else our kernel ("paged"). EngineOptions.prefill_attention = "paged" | "flash_paged" | "flash_gather" forces one
(for benchmarks and tests); EngineOptions.prefill_cudnn = False keeps equal-length prompts on FA2 (A/B).
Decode-only steps never come here (paged_attention_decode, CUDA graphs).

Sliding windows go to FA2 as its left window. Where pages before the widest window may be back in the pool, the
gather starts at that window and flash_paged's block table has those entries clamped to page 0 (FA2 skips the blocks
before a window). cuDNN's dense path takes no window and FA2 no soft-capping: such layers run on another path.

What a model learns here (probes, shapes seen, counters) is in its FlashState, every function's first argument.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from folio import reference_ops
from folio.model.windows import first_visible_key

if TYPE_CHECKING:
    from folio.ops import OpSet

MODES = ("auto", "paged", "flash_paged", "flash_gather")
FA2_PAGE_MULTIPLE = 256
GATHER_MAX_TOKENS = 1 << 18  # flash_gather: most context tokens gathered a step (a layer's K, V: 2 * this * Hkv * D)
_PROBE_MAX_REL_ERR = 2e-2
DENSE_MIN_SEEN = 1  # earlier steps of the same (B, L) before cuDNN takes it
# Least B * L^2 (the causal work, in tokens squared) that cuDNN takes: on an H100 it lost below ~1M (a ~75 us floor)
# and won from 4M up (bench/prefill_attention.py)
DENSE_MIN_WORK = 1 << 22
_DENSE_SEEN_MAX_KEYS = 1 << 14  # forgotten all at once past this many shapes (a long-running server's lengths vary)
# The probe's shape: two sequences of 2048 tokens, a shape the dense path takes (B * L^2 >= DENSE_MIN_WORK). cuDNN
# compiles its kernel per configuration at the first plan that needs it (hundreds of ms), and small shapes get
# another configuration than large ones: probing a large shape pays that compile at warm-up, not in the first batch.
_PROBE_BATCH, _PROBE_LEN = 2, 2048
_PROBE_WINDOW = 40  # a window narrower than the probe's contexts, so that its mask shows


@dataclass(eq=False)
class FlashState:
    """One model's prefill-attention state: its op set (the decode kernel for one-token rows), whether cuDNN may
    take equal-length fresh prompts (EngineOptions.prefill_cudnn), and what it has learned on its device."""

    ops: OpSet
    dense_cudnn: bool = True
    windowed: bool = False  # the model has windowed layers: a mode must also pass a windowed probe
    # (device, dtype, heads, head_dim, page_size, requested mode) -> mode that runs
    probed: dict[tuple, str] = field(default_factory=dict)
    # (device, dtype, q heads, kv heads, head_dim) -> cuDNN's dense attention agrees with FA2 here
    dense_ok: dict[tuple, bool] = field(default_factory=dict)
    # (device, B, L) -> steps seen (-1: cuDNN refused it; stays on FA2)
    dense_seen: dict[tuple, int] = field(default_factory=dict)
    # (device, dtype, q heads, kv heads, head_dim) -> FA2 takes q/k/v strided in their token dim
    strided_ok: dict[tuple, bool] = field(default_factory=dict)
    dense_calls: int = 0  # attention calls (one per layer) that ran on cuDNN's dense path; for benchmarks' logs


@dataclass(frozen=True)
class PrefillPlan:
    """Per-forward inputs of the flash path, shared by every layer."""

    mode: str  # "flash_paged" or "flash_gather"
    cu_seqlens_q: torch.Tensor  # [N+1] int32 over the sequences FA2 computes
    cu_seqlens_k: torch.Tensor  # [N+1] int32
    max_q_len: int
    max_context_len: int
    kv_slots: torch.Tensor | None = None  # flash_gather: [sum of their contexts] int64 flat cache slots
    block_tables: torch.Tensor | None = None  # flash_paged: what FA2 reads (released entries clamped to page 0)
    # flash_gather with one-token rows beside: which rows go to FA2 and which to the decode kernel (long_rows
    # only when they are not one run, see long_span)
    long_rows: torch.Tensor | None = None  # [T_long] int64
    short_rows: torch.Tensor | None = None  # [B_short] int64
    short_block_tables: torch.Tensor | None = None  # [B_short, max_blocks] int32
    short_context_lens: torch.Tensor | None = None  # [B_short] int32
    # flash_gather: the multi-token rows are rows [start, end) of the batch (the scheduler puts running sequences
    # before newly admitted ones, so a step's prompt chunks usually are one run): q, the new K/V and the output
    # are then sliced instead of gathered and scattered
    long_span: tuple[int, int] | None = None
    # ...and every one of those sequences starts at position 0 (no cached prefix): its context is exactly its new
    # tokens, whose K/V the layer has in hand, so nothing is gathered from the cache
    fresh: bool = False
    # ...and all of them have the same length L: (B, L) when cuDNN's dense batched attention takes them
    dense: tuple[int, int] | None = None


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
           max_k: int, scale: float, block_table: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    kwargs = {"scale": scale}
    if block_table is not None:
        kwargs["block_table"] = block_table
    if window > 0:  # FA2's left window counts the keys before the query's own
        kwargs.update(window_size_left=window - 1, window_size_right=0)
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, **kwargs)[0]


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"prefill_attention={mode!r}; expected one of {MODES}")
    return mode


def choose_mode(state: FlashState, q: torch.Tensor, k_cache: torch.Tensor, scale: float,
                requested: str = "auto") -> str:
    """The prefill attention path for tensors shaped like these on this device (probed once per shape family);
    `requested` other than "auto" forces one (still falling back to "paged" if it fails its probe)."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return "paged"
    if check_mode(requested) == "paged":
        return "paged"
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    key = (q.device, q.dtype, q.shape[1], num_kv_heads, head_dim, page_size, requested, state.windowed)
    if key not in state.probed:
        candidates = ["flash_paged", "flash_gather"] if requested == "auto" else [requested]
        if page_size % FA2_PAGE_MULTIPLE:
            candidates = [c for c in candidates if c != "flash_paged"]
        state.probed[key] = next((c for c in candidates if _probe(state, c, q, k_cache, scale)), "paged")
        if state.probed[key] == "flash_gather" and state.dense_cudnn:
            dense_cudnn_ok(state, q.device, q.dtype, q.shape[1], num_kv_heads, head_dim, scale)
    return state.probed[key]


def _device_ints(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def plan(state: FlashState, mode: str, batch, page_size: int, released_window: int = 0) -> PrefillPlan | None:
    """Per-forward tensors for `mode`, or None when this batch should run on our kernel. released_window: every
    layer's window is at most this and the pages before it may have been released (0: none are)."""
    if mode == "paged":
        return None
    device = batch.context_lens.device
    if mode == "flash_paged":
        cu_k = torch.zeros(batch.num_seqs + 1, dtype=torch.int32, device=device)
        torch.cumsum(batch.context_lens, 0, dtype=torch.int32, out=cu_k[1:])
        tables = batch.block_tables.clamp(min=0) if released_window else batch.block_tables
        return PrefillPlan(mode, batch.cu_seqlens_q, cu_k, batch.max_q_len, batch.max_context_len,
                           block_tables=tables)
    q_lens = batch.seq_q_lens
    long = [i for i, n in enumerate(q_lens) if n > 1]
    # each long sequence's keys from its first query's widest window on (the whole context without release)
    k_begin = [first_visible_key(batch.seq_context_lens[i] - q_lens[i], released_window) for i in range(len(q_lens))]
    context_lens = [n - b for n, b in zip(batch.seq_context_lens, k_begin)]
    total_k = sum(context_lens[i] for i in long)
    if not long or total_k > GATHER_MAX_TOKENS:
        return None
    cu_q, cu_k, long_rows, short_rows, short = [0], [0], [], [], []
    row = 0
    for i, n in enumerate(q_lens):
        if n > 1:
            long_rows.extend(range(row, row + n))
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + context_lens[i])
        else:
            short_rows.append(row)
            short.append(i)
        row += n
    cu_q_t = _device_ints(cu_q, torch.int32, device)
    cu_k_t = _device_ints(cu_k, torch.int32, device)
    long_idx = _device_ints(long, torch.int64, device)
    long_tables = batch.block_tables.index_select(0, long_idx)
    seq_of_k = torch.repeat_interleave(torch.arange(len(long), device=device), cu_k_t.diff().long(),
                                       output_size=total_k)
    pos = torch.arange(total_k, device=device) - cu_k_t.long()[seq_of_k]
    if released_window:
        pos += _device_ints([k_begin[i] for i in long], torch.int64, device)[seq_of_k]
    kv_slots = long_tables[seq_of_k, pos // page_size].long() * page_size + pos % page_size
    max_q, max_k = max(q_lens[i] for i in long), max(context_lens[i] for i in long)
    span = (long_rows[0], long_rows[-1] + 1) if long_rows[-1] + 1 - long_rows[0] == len(long_rows) else None
    fresh = all(context_lens[i] == q_lens[i] for i in long)
    dense = _dense_shape(state, device, [q_lens[i] for i in long]) if fresh and span is not None else None
    if not short:
        return PrefillPlan(mode, cu_q_t, cu_k_t, max_q, max_k, kv_slots, long_span=span, fresh=fresh, dense=dense)
    short_idx = _device_ints(short, torch.int64, device)
    return PrefillPlan(mode, cu_q_t, cu_k_t, max_q, max_k, kv_slots,
                       # (with a span, attention() slices instead: no 16k-element index copied each step)
                       long_rows=_device_ints(long_rows, torch.int64, device) if span is None else None,
                       short_rows=_device_ints(short_rows, torch.int64, device),
                       short_block_tables=batch.block_tables.index_select(0, short_idx),
                       short_context_lens=batch.context_lens.index_select(0, short_idx),
                       long_span=span, fresh=fresh, dense=dense)


def _dense_shape(state: FlashState, device: torch.device, lengths: list[int]) -> tuple[int, int] | None:
    """(B, L) if these fresh prompts should run as one dense cuDNN batch: equal lengths, B * L^2 >= DENSE_MIN_WORK,
    and the shape seen in DENSE_MIN_SEEN earlier steps (counted here, once per forward)."""
    length = lengths[0]
    if (not _dense_runs_on(state, device) or len(lengths) * length * length < DENSE_MIN_WORK
            or any(n != length for n in lengths)):
        return None
    key = (device, len(lengths), length)
    seen = state.dense_seen.get(key, 0)
    if seen < 0:
        return None
    if len(state.dense_seen) >= _DENSE_SEEN_MAX_KEYS and key not in state.dense_seen:
        state.dense_seen.clear()
    state.dense_seen[key] = seen + 1
    return (len(lengths), length) if seen >= DENSE_MIN_SEEN else None


def _dense_runs_on(state: FlashState, device: torch.device) -> bool:
    return state.dense_cudnn and device.type == "cuda"


def _cudnn_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, length: int,
                 scale: float) -> torch.Tensor:
    """Causal attention of `batch` sequences of `length` tokens packed in q [B*L, Hq, D], k/v [B*L, Hkv, D] (token
    and head dims may be strided), on cuDNN; returns [B*L, Hq, D]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def bhld(x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(0, (batch, length)).transpose(1, 2)

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = torch.nn.functional.scaled_dot_product_attention(bhld(q), bhld(k), bhld(v), is_causal=True,
                                                                scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2).flatten(0, 1)


def dense_cudnn_ok(state: FlashState, device: torch.device, dtype: torch.dtype, num_q_heads: int,
                   num_kv_heads: int, head_dim: int, scale: float) -> bool:
    """Does cuDNN's dense attention run here on inputs laid out like the model's (strided slices of a fused QKV
    output) and agree with FA2? Checked once per device, dtype and head layout (the first check also pays for
    cuDNN's start, ~0.5 s: choose_mode makes it, at a model's first prefill, e.g. the generator's warm-up)."""
    key = (device, dtype, num_q_heads, num_kv_heads, head_dim)
    if key not in state.dense_ok:
        gen = torch.Generator(device=device).manual_seed(2)
        width = (num_q_heads + 2 * num_kv_heads) * head_dim
        fused = torch.randn(_PROBE_BATCH * _PROBE_LEN, width, device=device, dtype=dtype, generator=gen)
        qs, ks, vs = fused.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], 1)
        qs = qs.view(-1, num_q_heads, head_dim)
        ks, vs = ks.view(-1, num_kv_heads, head_dim), vs.view(-1, num_kv_heads, head_dim)
        cu = torch.arange(0, _PROBE_BATCH + 1, dtype=torch.int32, device=device) * _PROBE_LEN
        try:
            got = _cudnn_dense(qs, ks, vs, _PROBE_BATCH, _PROBE_LEN, scale).float()
            want = _flash(qs.contiguous(), ks.contiguous(), vs.contiguous(), cu, cu, _PROBE_LEN, _PROBE_LEN,
                          scale).float()
            state.dense_ok[key] = ((got - want).norm() / want.norm()).item() <= _PROBE_MAX_REL_ERR
        except (RuntimeError, TypeError, ValueError):
            state.dense_ok[key] = False
    return state.dense_ok[key]


def _dense_attention(state: FlashState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: tuple[int, int],
                     scale: float) -> torch.Tensor | None:
    """cuDNN's dense attention of the fresh prompts shaped `shape` = (B, L), or None where it does not run here."""
    key = (q.device, *shape)
    if state.dense_seen.get(key, 0) < 0 or not dense_cudnn_ok(state, q.device, q.dtype, q.shape[1], k.shape[1],
                                                               q.shape[2], scale):
        return None
    try:
        out = _cudnn_dense(q, k, v, *shape, scale)
        state.dense_calls += 1
        return out
    except RuntimeError:  # a shape cuDNN has no plan for (the probe passed on another): FA2 takes it from now on
        state.dense_seen[key] = -1
        return None


def attention(state: FlashState, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch,
              prefill: PrefillPlan, scale: float, k_new: torch.Tensor | None = None,
              v_new: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0,
              decode_rows: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of the batch's new tokens q [T, Hq, D] over their contexts (already written to the cache).

    q, k_new and v_new (the new tokens' K/V [T, Hkv, D] as written to the cache, e.g. slices of a fused QKV
    output) may be strided in their token and head dims. With k_new/v_new given, a plan whose prompt rows are
    one run of fresh sequences (PrefillPlan.long_span, .fresh) reads them instead of gathering the cache.
    window, softcap: as in folio.reference_ops.paged_attention; FA2 cannot soft-cap, so softcap > 0 runs our
    paged kernel. decode_rows(q, block_tables, context_lens): the one-token rows' attention (default: the decode
    kernel over k_cache / v_cache; a quantized cache passes its own)."""
    if decode_rows is None:
        def decode_rows(short_q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
            return state.ops.paged_attention_decode(short_q, k_cache, v_cache, tables, lens, scale, window, softcap)
    if softcap > 0:
        return state.ops.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens_q,
                                         batch.context_lens, scale, batch.max_q_len, window, softcap)
    strided = strided_inputs_ok(state, q, k_cache)
    if not strided:
        q = q.contiguous()
    if prefill.mode == "flash_paged":
        return _flash(q.contiguous(), k_cache, v_cache, prefill.cu_seqlens_q, prefill.cu_seqlens_k,
                      prefill.max_q_len, prefill.max_context_len, scale, block_table=prefill.block_tables,
                      window=window)
    span = prefill.long_span
    if prefill.short_rows is None:
        q_long = q
    elif span is not None:
        q_long = q[span[0]:span[1]]
    else:
        q_long = q.index_select(0, prefill.long_rows)
    new_kv = prefill.fresh and span is not None and k_new is not None and v_new is not None
    if new_kv:
        k, v = k_new[span[0]:span[1]], v_new[span[0]:span[1]]
        if not strided:
            k, v = k.contiguous(), v.contiguous()
    else:
        num_kv_heads, head_dim = k_cache.shape[2:]
        k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, prefill.kv_slots)
        v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, prefill.kv_slots)
    dense = new_kv and prefill.dense and window == 0  # (cuDNN's dense path is causal only)
    long_out = _dense_attention(state, q_long, k, v, prefill.dense, scale) if dense else None
    if long_out is None:
        long_out = _flash(q_long, k, v, prefill.cu_seqlens_q, prefill.cu_seqlens_k, prefill.max_q_len,
                          prefill.max_context_len, scale, window=window)
    if prefill.short_rows is None:
        return long_out.contiguous()  # (FA2 returns a dense output for strided inputs; the caller views it flat)
    if span is not None and (span[0] == 0 or span[1] == q.shape[0]):  # the one-token rows are one run too
        before = span[0] > 0
        short_q = q[:span[0]] if before else q[span[1]:]
        short_out = decode_rows(short_q, prefill.short_block_tables, prefill.short_context_lens)
        return torch.cat([short_out, long_out] if before else [long_out, short_out])
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    out.index_copy_(0, prefill.long_rows, long_out)
    short_out = decode_rows(q.index_select(0, prefill.short_rows), prefill.short_block_tables,
                            prefill.short_context_lens)
    out.index_copy_(0, prefill.short_rows, short_out)
    return out


def strided_inputs_ok(state: FlashState, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Does FA2 here give the same result for q/k/v strided in their token dim (slices of a fused QKV output) as
    for dense copies? Checked once per device, dtype and head layout; False means callers pass dense copies."""
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    key = (q.device, q.dtype, num_q_heads, num_kv_heads, head_dim)
    if key not in state.strided_ok:
        gen = torch.Generator(device=q.device).manual_seed(1)
        width = (num_q_heads + 2 * num_kv_heads) * head_dim
        fused = torch.randn(40, width, device=q.device, dtype=q.dtype, generator=gen)
        qs, ks, vs = fused.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], 1)
        qs = qs.view(40, num_q_heads, head_dim)
        ks, vs = ks.view(40, num_kv_heads, head_dim), vs.view(40, num_kv_heads, head_dim)
        cu = torch.tensor([0, 17, 40], dtype=torch.int32, device=q.device)
        try:
            got = _flash(qs, ks, vs, cu, cu, 23, 23, 0.125)
            want = _flash(qs.contiguous(), ks.contiguous(), vs.contiguous(), cu, cu, 23, 23, 0.125)
            state.strided_ok[key] = bool(torch.equal(got, want))
        except (RuntimeError, TypeError, ValueError):
            state.strided_ok[key] = False
    return state.strided_ok[key]


def _probe(state: FlashState, mode: str, q_like: torch.Tensor, k_like: torch.Tensor, scale: float) -> bool:
    """Does `mode` run here and agree with the reference on a small batch (a chunk continuing a cached context
    across pages, a whole prompt, a one-token row)? For a windowed model, with a window too."""
    from folio.model.batch import ForwardBatch, SeqChunk

    device, dtype = q_like.device, q_like.dtype
    num_q_heads = q_like.shape[1]
    page_size, num_kv_heads, head_dim = k_like.shape[1:]
    gen = torch.Generator(device=device).manual_seed(0)
    lens = [(300, 45), (37, 37), (70, 1)]  # (context, new tokens)
    pages_per_seq = [-(-ctx // page_size) for ctx, _ in lens]
    num_pages = sum(pages_per_seq) + 1
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
    pages = torch.randperm(num_pages, device="cpu").tolist()
    chunks, used = [], 0
    for (ctx, new), n in zip(lens, pages_per_seq):
        chunks.append(SeqChunk([0] * new, ctx - new, pages[used:used + n]))
        used += n
    batch = ForwardBatch.build(chunks, page_size, device)
    q = torch.randn(batch.num_tokens, num_q_heads, head_dim, device=device, dtype=dtype, generator=gen)
    for window in (0, _PROBE_WINDOW) if state.windowed else (0,):
        try:
            prefill = plan(state, mode, batch, page_size, released_window=window)
            got = attention(state, q, k_cache, v_cache, batch, prefill, scale, window=window).float()
        except (RuntimeError, TypeError, ValueError):
            return False
        want = reference_ops.paged_attention(q.float(), k_cache.float(), v_cache.float(), batch.block_tables,
                                             batch.cu_seqlens_q, batch.context_lens, scale, batch.max_q_len,
                                             window, 0.0)
        if ((got - want).norm() / want.norm()).item() > _PROBE_MAX_REL_ERR:
            return False
    return True
