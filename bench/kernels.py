"""Native CUDA kernel benchmark: paged decode attention bandwidth against the device's own copy bandwidth.

    python bench/kernels.py [--quick] [--no-pdl]   (needs a CUDA device and folio._native_cuda; writes
                                                    $OUT/kernels.json)

Decode attention is memory-bound: it must read every cached K and V byte of the batch once. Achieved bandwidth
= (K + V bytes of all contexts + q + out bytes) / kernel time, compared with a device-to-device copy of a large
buffer measured in the same run (bytes read + bytes written / time). Layout: Llama-3-8B (32 query heads, 8 kv
heads, head_dim 128, bf16), shuffled block tables. Each configuration is checked against the torch reference
(first sequences) before it is timed; times are medians of CUDA-graph replays (many launches per replay, so
launch gaps stay out) after warm-up. Also reported: prefill attention throughput and the sampling kernel.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from folio import reference_ops as ref  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16


@functools.cache
def native(decode_attention: str = "mma", pdl: bool = True):
    """The native CUDA kernels through an op set: backend "native" (an error instead of a fallback to the reference),
    with these launch options (EngineOptions.decode_attention, EngineOptions.pdl)."""
    from folio.ops import OpSet

    return OpSet("native", pdl=pdl, decode_attention=decode_attention)


def time_graph(fn, calls_per_replay: int, replays: int = 15, warmup: int = 3) -> float:
    """Median seconds per call of fn, from CUDA-graph replays of `calls_per_replay` calls each."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_replay):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls_per_replay)
    return statistics.median(times)


def time_events(fn, iterations: int = 10) -> float:
    """Median seconds per call of fn timed with CUDA events, one call per measurement (for long calls)."""
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(warmup_s: float = 0.5) -> dict:
    """Device-to-device copy of 4 GiB three ways, bytes read + written per second:
    memcpy captured in a graph, memcpy launched plainly, and an elementwise kernel (bf16 -> fp16 convert: the
    same bytes, moved by SMs rather than a copy engine). The best is the ceiling the kernels are compared with.

    Copies for `warmup_s` first: an idle H200 sits at a low SM clock (345 MHz seen) and takes a moment to ramp."""
    num_bytes = 4 << 30
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    deadline = time.perf_counter() + warmup_s
    while time.perf_counter() < deadline:
        dst.copy_(src)
        torch.cuda.synchronize()
    src_bf16, dst_fp16 = src.view(torch.bfloat16), dst.view(torch.float16)
    src_bf16.clamp_(-1e4, 1e4).nan_to_num_(0.0)  # finite values, so the convert kernel's path is the plain one
    results = {
        "memcpy_graph": 2 * num_bytes / time_graph(lambda: dst.copy_(src), calls_per_replay=5, replays=10),
        "memcpy": 2 * num_bytes / time_events(lambda: dst.copy_(src)),
        "elementwise_kernel": 2 * num_bytes / time_events(lambda: dst_fp16.copy_(src_bf16)),
    }
    del src, dst, src_bf16, dst_fp16
    torch.cuda.empty_cache()
    return results


class KVPool:
    """One random K/V cache per page size, big enough for the largest configuration; tables draw random pages."""

    def __init__(self, page_size: int, max_tokens: int):
        self.page_size = page_size
        self.num_pages = max_tokens // page_size + 8
        shape = (self.num_pages, page_size, KV_HEADS, HEAD_DIM)
        self.k = torch.randn(shape, dtype=DTYPE, device="cuda")
        self.v = torch.randn(shape, dtype=DTYPE, device="cuda")

    def tables(self, batch: int, context: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = -(-context // self.page_size)
        pages = torch.randperm(self.num_pages, generator=generator)[: batch * blocks]
        block_tables = pages.view(batch, blocks).to(torch.int32).cuda()
        context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        return block_tables, context_lens


def check_decode(q, pool: KVPool, block_tables, context_lens, scale, kernel: str, pdl: bool) -> float:
    """Relative error of the kernel against the torch reference on the first (up to) two sequences."""
    n = min(2, q.shape[0])
    args = (q[:n], pool.k, pool.v, block_tables[:n], context_lens[:n], scale)
    out = native(kernel, pdl).paged_attention_decode(*args)
    expected = ref.paged_attention_decode(*args)
    return float((out.float() - expected.float()).abs().max() / expected.float().abs().max())


def bench_decode(batches, contexts, page_sizes, pdl: bool) -> list[dict]:
    rows = []
    generator = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    for page_size in page_sizes:
        pool = KVPool(page_size, max(batches) * max(contexts))
        for context in contexts:
            for batch in batches:
                kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * DTYPE.itemsize
                io_bytes = 2 * batch * Q_HEADS * HEAD_DIM * DTYPE.itemsize
                calls = max(2, min(50, int(2e9 // kv_bytes)))  # about 2 GB of traffic per replay
                # Small problems rotate over several input sets (other pages, other q) so that the replays
                # read device memory, not the 50 MB L2 that one set would stay in.
                num_sets = max(1, min(calls, -(-(256 << 20) // kv_bytes)))
                sets = []
                for _ in range(num_sets):
                    block_tables, context_lens = pool.tables(batch, context, generator)
                    q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
                    sets.append((q, block_tables, context_lens))
                row = dict(batch=batch, context=context, page_size=page_size, input_sets=num_sets)
                # both decode kernels: tensor-core (the default) and CUDA-core (decode_attention="simt"), each
                # through an op set of its own, so the graph captured with one holds that kernel
                for kernel, prefix in (("simt", "simt_"), ("mma", "")):
                    err = check_decode(sets[0][0], pool, sets[0][1], sets[0][2], scale, kernel, pdl)
                    if not err <= 1e-2:
                        raise SystemExit(f"{kernel} decode kernel wrong at batch {batch} context {context} page "
                                         f"{page_size}: rel err {err:.3g}")
                    counter = iter(range(1 << 30))

                    def call(kernels=native(kernel, pdl)):  # noqa: B008 - bound once per kernel variant
                        q, block_tables, context_lens = sets[next(counter) % num_sets]
                        kernels.paged_attention_decode(q, pool.k, pool.v, block_tables, context_lens, scale)

                    seconds = time_graph(call, calls_per_replay=calls)
                    row.update({f"{prefix}us": seconds * 1e6, f"{prefix}gbps": (kv_bytes + io_bytes) / seconds / 1e9,
                                f"{prefix}rel_err": err})
                rows.append(row)
                del sets
        del pool
        torch.cuda.empty_cache()
    return rows


def bench_prefill(pdl: bool, prompt_len: int = 4096) -> dict:
    """One prompt of `prompt_len` tokens, causal, page size 256: attention FLOPs / time."""
    page_size = 256
    pool = KVPool(page_size, prompt_len)
    block_tables, context_lens = pool.tables(1, prompt_len, torch.Generator().manual_seed(1))
    q = torch.randn(prompt_len, Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    cu = torch.tensor([0, prompt_len], dtype=torch.int32, device="cuda")
    args = (q, pool.k, pool.v, block_tables, cu, context_lens, HEAD_DIM**-0.5, prompt_len)
    out = native(pdl=pdl).paged_attention(*args)
    sample_rows = torch.arange(0, prompt_len, 97, device="cuda")
    expected = ref.paged_attention(*args)  # one sequence: a single dense softmax in the reference
    err = float((out[sample_rows].float() - expected[sample_rows].float()).abs().max()
                / expected[sample_rows].float().abs().max())
    seconds = time_graph(lambda: native(pdl=pdl).paged_attention(*args), calls_per_replay=3, replays=5)
    flops = 4 * Q_HEADS * HEAD_DIM * prompt_len * (prompt_len + 1) / 2  # QK and PV over the causal triangle
    return dict(prompt_len=prompt_len, ms=seconds * 1e3, tflops=flops / seconds / 1e12, rel_err=err)


def bench_sampling(batch: int = 256, vocab: int = 128256) -> dict:
    logits = torch.randn(batch, vocab, device="cuda") * 3
    temperature = torch.full((batch,), 0.8, device="cuda")
    top_k = torch.full((batch,), 50, dtype=torch.int32, device="cuda")
    top_p = torch.full((batch,), 0.9, device="cuda")
    min_p = torch.full((batch,), 0.02, device="cuda")
    u = torch.rand(batch, device="cuda")
    args = (logits, temperature, top_k, top_p, min_p, u)
    native_s = time_graph(lambda: native().sample_rows(*args), calls_per_replay=5, replays=5)
    result = dict(batch=batch, vocab=vocab, native_ms=native_s * 1e3)
    try:  # the torch sampler of folio.sampling, same settings, for comparison (plain timing: it is not graphed)
        from folio.sampling import RowParams, SamplerSettings, sample

        settings = SamplerSettings(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, token_repetition_penalty=1.0)
        params = [RowParams(settings=settings, u=0.5) for _ in range(batch)]
        sample(logits, params)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            sample(logits, params)
        torch.cuda.synchronize()
        result["torch_sampler_ms"] = (time.perf_counter() - start) / 5 * 1e3
    except Exception as e:  # reported, not fatal: the kernel numbers stand on their own
        result["torch_sampler_error"] = repr(e)
    return result


def read_bandwidth() -> dict:
    """Bytes read per second by reductions over 4 GiB (nothing written back): a decode attention kernel only reads
    its K/V, and HBM may stream reads alone faster than the copies' mix of reads and writes. Sum in fp32 of bf16,
    and max of int32 (no conversion work per byte)."""
    num_bytes = 4 << 30
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_()
    src_bf16 = src.view(torch.bfloat16).clamp_(-1e4, 1e4).nan_to_num_(0.0)
    results = {
        "sum_bf16": num_bytes / time_events(lambda: src_bf16.sum(dtype=torch.float32)),
        "amax_int32": num_bytes / time_events(lambda: src.view(torch.int32).amax()),
    }
    del src, src_bf16
    torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer configurations (smoke test)")
    parser.add_argument("--no-pdl", dest="pdl", action="store_false",
                        help="launch without programmatic dependent launch (EngineOptions.pdl=False)")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py needs a CUDA device")
    torch.manual_seed(0)
    batches, contexts, page_sizes = ([1, 64], [512, 4096], [16, 256]) if opts.quick else (
        [1, 16, 64, 256], [512, 4096, 16384], [16, 256])

    copy_first = copy_bandwidth()
    decode = bench_decode(batches, contexts, page_sizes, opts.pdl)
    prefill = bench_prefill(opts.pdl)
    sampling = bench_sampling()
    copy_last = copy_bandwidth(warmup_s=0.1)
    reads = read_bandwidth()
    read_method, read_bps = max(reads.items(), key=lambda item: item[1])
    # the ceiling: the best copy, before or after the kernels
    copy_method, copy_bps = max([*copy_first.items(), *copy_last.items()], key=lambda item: item[1])

    device = torch.cuda.get_device_name()
    copies = ", ".join(f"{k} {v / 1e9:.0f}/{copy_last[k] / 1e9:.0f}" for k, v in copy_first.items())
    print(f"\n{device}: device-to-device copy {copy_bps / 1e9:.0f} GB/s (read + write, best: {copy_method}; "
          f"GB/s before/after the kernels: {copies})")
    print(f"read-only reduction {read_bps / 1e9:.0f} GB/s (best: {read_method}; "
          + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in reads.items()) + "): the decode kernels' 'of read' column")
    print("paged_attention_decode, Llama-3-8B heads (32 q / 8 kv, d 128, bf16): tensor-core kernel (default), "
          f"then the CUDA-core one (decode_attention='simt'); PDL {'on' if opts.pdl else 'off'}")
    print(f"{'page':>5} {'context':>8} {'batch':>6} {'us':>9} {'GB/s':>7} {'of copy':>8} {'rel err':>8} "
          f"{'simt us':>9} {'of copy':>8} {'speedup':>8} {'of read':>8}")
    for r in decode:
        print(f"{r['page_size']:>5} {r['context']:>8} {r['batch']:>6} {r['us']:>9.1f} {r['gbps']:>7.0f} "
              f"{r['gbps'] * 1e9 / copy_bps:>8.0%} {r['rel_err']:>8.1e} {r['simt_us']:>9.1f} "
              f"{r['simt_gbps'] * 1e9 / copy_bps:>8.0%} {r['simt_us'] / r['us']:>7.2f}x "
              f"{r['gbps'] * 1e9 / read_bps:>8.0%}")
    print(f"paged_attention prefill, {prefill['prompt_len']} tokens: {prefill['ms']:.2f} ms, "
          f"{prefill['tflops']:.1f} TFLOP/s (rel err {prefill['rel_err']:.1e})")
    line = f"sample_rows {sampling['batch']} x {sampling['vocab']}: {sampling['native_ms']:.3f} ms"
    if "torch_sampler_ms" in sampling:
        line += f" (folio.sampling torch path: {sampling['torch_sampler_ms']:.2f} ms)"
    print(line)
    target = [r for r in decode if r["batch"] == 64 and r["context"] == 4096 and r["page_size"] == 256]
    if target:
        print(f"TARGET batch 64 x context 4096 x page 256: {target[0]['gbps'] * 1e9 / copy_bps:.0%} of copy "
              f"bandwidth (goal >= 70%)")

    out_dir = os.environ.get("OUT")
    if out_dir:
        report = dict(device=device, torch=torch.__version__, copy_gbps=copy_bps / 1e9, copy_method=copy_method,
                      copy_gbps_before={k: v / 1e9 for k, v in copy_first.items()},
                      copy_gbps_after={k: v / 1e9 for k, v in copy_last.items()},
                      read_gbps={k: v / 1e9 for k, v in reads.items()}, decode=decode,
                      prefill=prefill, sampling=sampling, pdl=opts.pdl)
        Path(out_dir, "kernels.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
