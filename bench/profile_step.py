"""Where a decode step's GPU time goes: per-kernel times of one folio forward (eager, same kernels as the graph)
and of the sampler, from torch.profiler, on the GPU machine.

    python bench/profile_step.py [--shape 8B] [--batches 1,256] [--context 640]

Prints, per batch size, the kernels sorted by total GPU time (with the share of the step and, for the matmuls,
the bandwidth their weight reads reach), then the sampler's GPU and host time with and without penalties.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import SHAPES, build_pair, log, make_generator  # noqa: E402

from folio.model.batch import ForwardBatch, SeqChunk  # noqa: E402
from folio.sampling import RowParams, SamplerSettings, sample  # noqa: E402
from folio.sampling.device_history import DeviceHistories  # noqa: E402


def kernel_table(fn, iterations: int) -> tuple[list[tuple[str, float, int]], float]:
    """[(kernel name, GPU us per iteration, launches per iteration)], and the GPU us per iteration of them all."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time
            counts[event.name] += 1
    rows = sorted(((n, t / iterations, counts[n] // iterations) for n, t in totals.items()), key=lambda r: -r[1])
    return rows, sum(r[1] for r in rows)


def print_kernels(title: str, rows, total_us: float, top: int = 18) -> None:
    print(f"\n{title}: {total_us:.0f} us of kernels per step, {sum(r[2] for r in rows)} launches")
    print("| kernel | us/step | launches | share |")
    print("|---|---:|---:|---:|")
    for name, us, count in rows[:top]:
        print(f"| {name[:90]} | {us:.1f} | {count} | {100 * us / total_us:.1f}% |")


def decode_batch(gen, batch: int, context: int, vocab: int) -> ForwardBatch:
    page = gen.page_size
    pages_per_seq = -(-(context + 1) // page)
    chunks = []
    for b in range(batch):
        table = list(range(1 + b * pages_per_seq, 1 + (b + 1) * pages_per_seq))
        chunks.append(SeqChunk(token_ids=[(7 * b) % vocab], start_pos=context, block_table=table))
    return ForwardBatch.build(chunks, page, gen.model.device)


def sampler_times(batch: int, history_len: int, vocab: int, device) -> None:
    logits = torch.randn(batch, vocab, device=device)
    cases = {"greedy": SamplerSettings.greedy(), "top-k/p, no penalty": SamplerSettings(token_repetition_penalty=1.0),
             "top-k/p + repetition penalty, host histories": SamplerSettings(),
             "top-k/p + repetition penalty, device histories (the generator's)": SamplerSettings()}
    histories = [torch.randint(0, vocab, (history_len,)) for _ in range(batch)]
    on_device = DeviceHistories(device)
    for i, h in enumerate(histories):
        on_device.add(i, h.tolist(), history_len)
    print(f"\nsampler, batch {batch}, vocab {vocab}, history {history_len}")
    print("| settings | host ms (launch) | GPU ms |")
    print("|---|---:|---:|")
    for label, settings in cases.items():
        device_windows = "device" in label

        def call():
            rows = [RowParams.unchecked(settings, 0.5, () if device_windows else h, (), None, 0, False)
                    for h in histories]
            windows = on_device.windows(range(batch), [history_len] * batch, [history_len] * batch, vocab) \
                if device_windows else None
            return sample(logits, rows, windows)
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        host = []
        for _ in range(10):
            t0 = time.perf_counter()
            call()
            host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        _, gpu_us = kernel_table(call, 5)
        print(f"| {label} | {1e3 * sorted(host)[5]:.2f} | {gpu_us / 1e3:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="8B", choices=list(SHAPES))
    parser.add_argument("--batches", default="1,256")
    parser.add_argument("--context", type=int, default=640)
    args = parser.parse_args()
    device = torch.device("cuda")
    pair = build_pair(args.shape, device)
    batches = [int(b) for b in args.batches.split(",")]
    gen, cache = make_generator(pair, max(batches), args.context + 64, 1,
                                cache_tokens=max(batches) * (args.context + 512))
    cfg = pair.model.config
    log(f"weights read per step: {pair.weight_bytes / 1e9:.2f} GB")
    for batch in batches:
        fb = decode_batch(gen, batch, min(args.context, 400) if batch == 1 else args.context, cfg.vocab_size)
        rows, total = kernel_table(lambda: pair.model.forward(fb, cache), 5)
        print_kernels(f"{args.shape} decode step, batch {batch}", rows, total)
    del gen, cache
    for batch in batches:
        sampler_times(batch, 1024, cfg.vocab_size, device)


if __name__ == "__main__":
    main()
