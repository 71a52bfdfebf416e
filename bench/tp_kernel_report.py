"""Per-rank kernel times of a tensor-parallel run (bench/tp_engine.py --kernel-report): each rank records its device
kernels with torch.profiler over its whole run and writes a summary; the table puts the ranks side by side.

What it is for: an all-reduce kernel lasts as long as its rank waits for the slowest peer to arrive, so the ranks'
all-reduce durations show which rank is late at each layer and by how much, and the other kernels' totals show what
the late rank spends its time on (on a GPU; on the CPU the profiler sees CPU ops, and the table only checks the
plumbing).
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ALL_REDUCE_KERNELS = ("peer_all_reduce", "ncclDevKernel_AllReduce", "ncclKernel_AllReduce", "gloo:all_reduce")
TOP_KERNELS = 10


@contextlib.contextmanager
def recorded(rank: int, device_type: str, directory: str | None) -> Iterator[None]:
    """Record this rank's kernels (CPU ops on the CPU) while the block runs; write directory/rank{rank}.json.
    directory None: record nothing."""
    if directory is None:
        yield
        return
    activity = ProfilerActivity.CUDA if device_type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        yield
    if device_type == "cuda":
        torch.cuda.synchronize()
    Path(directory, f"rank{rank}.json").write_text(json.dumps(summarize(prof, device_type)))


def summarize(prof: profile, device_type: str) -> dict:
    """Per kernel name: calls, total ms, median us; and the all-reduce kernels' duration percentiles."""
    durations: dict[str, list[float]] = {}
    for event in prof.events():
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if on_device != (device_type == "cuda"):
            continue
        durations.setdefault(event.name, []).append(event.time_range.elapsed_us())
    kernels = {name: {"calls": len(us), "total_ms": sum(us) / 1e3, "median_us": statistics.median(us)}
               for name, us in durations.items()}
    reduce_us = sorted(us for name, values in durations.items() if any(k in name for k in ALL_REDUCE_KERNELS)
                       for us in values)
    summary = {"kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["total_ms"])[:TOP_KERNELS])}
    if reduce_us:
        summary["all_reduce_us"] = {f"p{q}": reduce_us[min(len(reduce_us) - 1, len(reduce_us) * q // 100)]
                                    for q in (10, 50, 90)}
        summary["all_reduce_us"]["calls"] = len(reduce_us)
        summary["all_reduce_us"]["total_ms"] = sum(reduce_us) / 1e3
    return summary


def print_report(directory: str, world_size: int) -> dict:
    """The ranks' summaries side by side (and returned, by rank)."""
    ranks = {}
    for rank in range(world_size):
        path = Path(directory, f"rank{rank}.json")
        ranks[rank] = json.loads(path.read_text()) if path.exists() else None
    print("\nkernels by rank (torch.profiler over the whole run; an all-reduce lasts as long as its rank waits)")
    for rank, summary in ranks.items():
        if summary is None:
            print(f"  rank {rank}: no report")
            continue
        ar = summary.get("all_reduce_us")
        print(f"  rank {rank}: " + (f"all-reduce {ar['calls']} calls, {ar['total_ms']:.1f} ms; p10 {ar['p10']:.1f} "
                                    f"us, p50 {ar['p50']:.1f}, p90 {ar['p90']:.1f}" if ar else "no all-reduce seen"))
        for name, k in summary["kernels"].items():
            print(f"    {k['total_ms']:9.1f} ms {k['calls']:7d} x {k['median_us']:8.1f} us  {name[:90]}")
    return ranks
