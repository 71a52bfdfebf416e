"""Decode attention over quantized K/V caches against the device's copy bandwidth, and what each format holds.

    python3 bench/kv_attention.py [--batch 64] [--context 4096] [--page-size 256] [--kv-budget-gib 60]
                                  [--formats bf16,fp8,q8,q4] [--table-pages N]
                                  (needs a CUDA device and folio._native_cuda; writes $OUT/kv_attention.json)

--table-pages N makes the block tables N pages wide (the rows' own pages first, then other valid pages), as a decode
graph's are: captured for max_seq_len's pages whatever the rows hold. The kernels are planned from the width.

Llama-3-8B attention shape (32 query heads, 8 kv heads, head_dim 128, bf16 queries), shuffled block tables. For each
cache format (bf16: today's paged_attention_decode; fp8 / q8 / q4: paged_attention_decode_quant) the op is checked
against the torch reference on the first sequences, then timed: median of CUDA-graph replays (many calls per replay)
measured with CUDA events. Bytes read per call = the compressed K and V bytes of every context (codes + float16
scales; bf16: the elements) + q and out; GB/s over the call time, compared with a device-to-device copy measured in
the same run (bench/kernels.py's copy_bandwidth: bytes read + written per second, the best of three ways).

Capacity: 4k-token sequences (whole pages) that fit a KV budget of --kv-budget-gib in each format, from
folio.kv_cache.page_bytes at the model's 32 layers. A markdown table comes last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kernels import copy_bandwidth, time_graph  # noqa: E402  (bench/kernels.py: the same copy ceiling)

from folio import kv_formats  # noqa: E402
from folio import reference_ops as ref  # noqa: E402
from folio.kv_cache import page_bytes  # noqa: E402
from folio.ops import OpSet  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, NUM_LAYERS = 32, 8, 128, 32
DTYPE = torch.bfloat16
FORMATS = ("bf16", "fp8", "q8", "q4")


def make_cache(name: str, num_pages: int, page_size: int, generator: torch.Generator) -> tuple:
    """(k, v, k_scale, v_scale) of random values: bf16 caches [P, S, Hkv, D], or codes and scales."""
    tensors = []
    for _ in range(2):
        x = torch.randn(num_pages, page_size, KV_HEADS, HEAD_DIM, generator=generator, device="cuda", dtype=DTYPE)
        if name == "bf16":
            tensors.append((x, None))
            continue
        # page by page: the fp32 intermediates of the whole cache would take several GB
        codes = torch.empty(num_pages, page_size, KV_HEADS, kv_formats.code_dim(name, HEAD_DIM), dtype=torch.uint8,
                            device="cuda")
        scales = torch.empty(num_pages, page_size, KV_HEADS, kv_formats.scale_dim(name, HEAD_DIM),
                             dtype=torch.float16, device="cuda")
        for begin in range(0, num_pages, 64):
            codes[begin : begin + 64], scales[begin : begin + 64] = kv_formats.quantize(x[begin : begin + 64], name)
        del x
        tensors.append((codes, scales))
    (k, k_scale), (v, v_scale) = tensors
    return k, v, k_scale, v_scale


def bytes_read(name: str, batch: int, context: int) -> int:
    per_head_token = kv_formats.bytes_per_head_token(None if name == "bf16" else name, HEAD_DIM, DTYPE)
    kv = 2 * batch * context * KV_HEADS * per_head_token
    return kv + 2 * batch * Q_HEADS * HEAD_DIM * DTYPE.itemsize  # + q and out


def decode_call(ops: OpSet, name: str, cache: tuple, q, tables, lens, scale: float):
    k, v, k_scale, v_scale = cache
    if name == "bf16":
        return lambda: ops.paged_attention_decode(q, k, v, tables, lens, scale, 0, 0.0)
    code = kv_formats.KV_FORMAT_CODES[name]
    return lambda: ops.paged_attention_decode_quant(q, k, v, k_scale, v_scale, tables, lens, scale, 0, 0.0, code)


def check(name: str, cache: tuple, q, tables, lens, scale: float) -> float:
    """Relative error against the torch reference on the first two sequences (max |diff| / max |reference|)."""
    n = 2
    out = decode_call(OpSet("native"), name, cache, q[:n], tables[:n], lens[:n], scale)()
    k, v, k_scale, v_scale = cache
    if name == "bf16":
        expected = ref.paged_attention_decode(q[:n], k, v, tables[:n], lens[:n], scale, 0, 0.0)
    else:
        expected = ref.paged_attention_decode_quant(q[:n], k, v, k_scale, v_scale, tables[:n], lens[:n], scale, 0,
                                                    0.0, kv_formats.KV_FORMAT_CODES[name])
    return float((out.float() - expected.float()).abs().max() / expected.float().abs().max())


def capacity(name: str, page_size: int, context: int, budget_bytes: int) -> int:
    model = SimpleNamespace(config=SimpleNamespace(head_dim=HEAD_DIM, num_layers=NUM_LAYERS, num_kv_heads=KV_HEADS),
                            dtype=DTYPE)
    per_page = page_bytes(model, page_size, None if name == "bf16" else name)  # duck-typed Model: config, dtype
    return budget_bytes // (-(-context // page_size) * per_page)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--kv-budget-gib", type=float, default=60.0)
    parser.add_argument("--calls", type=int, default=20, help="calls per CUDA-graph replay")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, of " + ",".join(FORMATS))
    parser.add_argument("--table-pages", type=int, default=0,
                        help="block tables this many pages wide (0: the context's pages)")
    args = parser.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    if not formats or set(formats) - set(FORMATS):
        parser.error(f"--formats takes a comma-separated subset of {','.join(FORMATS)}")
    if not torch.cuda.is_available():
        raise SystemExit("kv_attention.py needs a CUDA device")
    device = torch.cuda.get_device_name()
    copy = copy_bandwidth()
    copy_method, copy_bps = max(copy.items(), key=lambda item: item[1])
    print(f"{device}: device-to-device copy {copy_bps / 1e9:.0f} GB/s (read + write, best: {copy_method})")

    g = torch.Generator(device="cuda").manual_seed(0)
    blocks = -(-args.context // args.page_size)
    num_pages = args.batch * blocks + 8
    tables = torch.randperm(num_pages, generator=g, device="cuda")[: args.batch * blocks]
    tables = tables.view(args.batch, blocks).to(torch.int32)
    if args.table_pages > blocks:  # padding: valid pages of the pool, never read for these lengths
        padding = torch.randint(0, num_pages, (args.batch, args.table_pages - blocks), generator=g, device="cuda")
        tables = torch.cat([tables, padding.to(torch.int32)], dim=1)
    lens = torch.full((args.batch,), args.context, dtype=torch.int32, device="cuda")
    q = torch.randn(args.batch, Q_HEADS, HEAD_DIM, generator=g, device="cuda", dtype=DTYPE)
    scale = HEAD_DIM**-0.5
    ops = OpSet("native")
    budget = int(args.kv_budget_gib * (1 << 30))
    rows = []
    for name in formats:
        cache = make_cache(name, num_pages, args.page_size, g)
        err = check(name, cache, q, tables, lens, scale)
        if not err <= 2e-2:
            raise SystemExit(f"{name} decode attention wrong: rel err {err:.3g} against the reference")
        seconds = time_graph(decode_call(ops, name, cache, q, tables, lens, scale), calls_per_replay=args.calls)
        read = bytes_read(name, args.batch, args.context)
        rows.append(dict(format=name, us=seconds * 1e6, bytes_read=read, gbps=read / seconds / 1e9,
                         of_copy=read / seconds / copy_bps, rel_err=err,
                         sequences=capacity(name, args.page_size, args.context, budget)))
        del cache
        torch.cuda.empty_cache()

    first_us = rows[0]["us"]
    print(f"\ndecode attention, batch {args.batch} x context {args.context}, page {args.page_size}, "
          f"tables {tables.shape[1]} pages wide, "
          f"{Q_HEADS}/{KV_HEADS} heads x {HEAD_DIM}, {device}; copy {copy_bps / 1e9:.0f} GB/s; "
          f"{args.context}-token sequences in {args.kv_budget_gib:g} GiB of KV cache ({NUM_LAYERS} layers)\n")
    print(f"| format | us / call | MB read | GB/s | of copy | vs {rows[0]['format']} time | rel err | sequences |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['format']} | {r['us']:.1f} | {r['bytes_read'] / 1e6:.1f} | {r['gbps']:.0f} | {r['of_copy']:.0%} | "
              f"{r['us'] / first_us:.2f}x | {r['rel_err']:.1e} | {r['sequences']} |")
    out_dir = os.environ.get("OUT")
    if out_dir:
        report = dict(device=device, torch=torch.__version__, copy_gbps=copy_bps / 1e9, copy_method=copy_method,
                      batch=args.batch, context=args.context, page_size=args.page_size,
                      table_pages=int(tables.shape[1]),
                      kv_budget_gib=args.kv_budget_gib, rows=rows)
        Path(out_dir, "kv_attention.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
