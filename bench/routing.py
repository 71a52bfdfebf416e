"""Routing on a real (CPU) Serve deployment: our prefix-aware router against Ray's PrefixCacheAffinityRouter and
Ray Serve's default power-of-two-choices router, in one run, on the same workload.

    python bench/routing.py                 # ~4 minutes on 2 cores
    python bench/routing.py --json out.json --routers prefix,pow2

A local Ray cluster (loopback) serves the demo model from `--replicas` generator replicas with small KV caches
(`--pages` pages of `--page-size` tokens each: about a quarter of the workload's prefixes fit in one), behind the
ingress. The application is deployed afresh for each router (empty caches, a new router). The workload:
`--groups` prefix groups x `--per-group` requests, each prompt a `--prefix-pages`-page prefix shared by its group
plus a unique suffix of 8-32 tokens, groups interleaved (request i belongs to group i mod groups), sent as token ids
through the application's handle by `--concurrency` closed-loop clients, `--max-new-tokens` tokens each.

Printed per router: prefix-cache hit rate (cached prompt tokens / prompt tokens, from each request's usage) and its
ratio to the workload's ideal (every prompt page an earlier request computed is hit: one infinite cache), prompt
tokens actually prefilled, requests per replica (max / mean, from each completion's replica id), and time to first
token (p50 / p99, measured at the ingress).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# folio must be installed (`make setup`, or pip install -e .): replicas/ is importable only as folio.serve.
from folio.hashing import page_hashes

ROUTER_NAMES = {"prefix": "ours (prefix-aware)", "ray_prefix": "PrefixCacheAffinity", "pow2": "power of two"}
FIRST_TOKEN_ID = 8  # clear of the demo tokenizer's special tokens (0-2)


@dataclass(frozen=True)
class Request:
    group: int
    token_ids: tuple[int, ...]


def workload(args: argparse.Namespace) -> list[Request]:
    rng = random.Random(args.seed)
    vocab = range(FIRST_TOKEN_ID, args.vocab_size)
    prefixes = [[rng.choice(vocab) for _ in range(args.prefix_pages * args.page_size)] for _ in range(args.groups)]
    requests = []
    for idx in range(args.groups * args.per_group):
        group = idx % args.groups
        suffix = [rng.choice(vocab) for _ in range(rng.randint(8, 32))]
        requests.append(Request(group, tuple(prefixes[group] + suffix)))
    return requests


def ideal_cached_tokens(requests: list[Request], page_size: int) -> int:
    """Prompt tokens hit if every prompt page an earlier request computed were still cached where needed (only pages
    before a prompt's last token can be reused: the engine computes that token's logits)."""
    seen: set[bytes] = set()
    cached = 0
    for request in requests:
        hashes = page_hashes(list(request.token_ids), page_size)
        reusable = (len(request.token_ids) - 1) // page_size
        depth = 0
        while depth < reusable and hashes[depth] in seen:
            depth += 1
        cached += depth * page_size
        seen.update(hashes)
    return cached


async def run_workload(app_name: str, requests: list[Request], args: argparse.Namespace) -> list:
    from folio.serve.client import Client

    client = Client(app_name)
    results: list = [None] * len(requests)
    next_idx = 0
    done = 0
    start_s = time.monotonic()

    async def worker() -> None:
        nonlocal next_idx, done
        while next_idx < len(requests):
            idx = next_idx
            next_idx += 1
            results[idx] = await client.complete(list(requests[idx].token_ids), max_new_tokens=args.max_new_tokens,
                                                 stop_on_eos=False, temperature=0.0)
            done += 1
            if done % 64 == 0:
                progress(f"  {done}/{len(requests)} requests, {time.monotonic() - start_s:.0f} s")

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return results


def wait_for_reports(app_name: str, num_replicas: int, timeout_s: float = 60) -> None:
    """Until every replica answered a routing-stats poll (the controller's first comes a period after start)."""
    from folio.serve.client import replica_stats

    deadline = time.monotonic() + timeout_s
    while len(replica_stats(app_name)) < num_replicas and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.5)  # one more period: the routers have had a broadcast


def bench_router(router: str, base, requests: list[Request], args: argparse.Namespace) -> dict:
    from ray import serve

    from folio.serve import local

    app_name = f"routing-{router.replace('_', '-')}"
    config = base.replace(router=router, app_name=app_name,
                          router_options=json.loads(args.our_options) if router == "prefix" else None)
    start_s = time.monotonic()
    local.deploy(config)
    wait_for_reports(app_name, args.replicas)
    progress(f"{ROUTER_NAMES[router]}: deployed in {time.monotonic() - start_s:.0f} s")
    run_start_s = time.monotonic()
    completions = asyncio.run(run_workload(app_name, requests, args))
    run_s = time.monotonic() - run_start_s
    serve.delete(app_name)
    usages = [c.finish.usage for c in completions]
    prompt = sum(u.prompt_tokens for u in usages)
    cached = sum(u.cached_tokens for u in usages)
    per_replica = Counter(c.finish.replica_id for c in completions)
    counts = list(per_replica.values()) + [0] * (args.replicas - len(per_replica))
    ttft = sorted(c.finish.timings.time_to_first_token_s for c in completions)
    return {"router": router, "hit_rate": cached / prompt, "prompt_tokens": prompt, "cached_tokens": cached,
            "prefilled_tokens": prompt - cached, "requests_max": max(counts),
            "requests_mean": len(completions) / args.replicas, "requests_per_replica": sorted(counts, reverse=True),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99), "run_s": run_s,
            "per_request": [{"group": q.group, "replica": c.finish.replica_id, "prompt_tokens": u.prompt_tokens,
                             "cached_tokens": u.cached_tokens} for q, c, u in zip(requests, completions, usages)]}


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[q - 1] if len(sorted_values) > 1 \
        else sorted_values[0]


def print_table(results: list[dict], ideal: float, args: argparse.Namespace) -> None:
    print(f"\n{args.replicas} replicas x {args.pages} pages of {args.page_size} tokens; {args.groups} groups x "
          f"{args.per_group} requests ({args.prefix_pages}-page prefix + 8-32 token suffix), concurrency "
          f"{args.concurrency}, {args.max_new_tokens} new tokens each")
    header = (f"{'router':<20} {'hit rate':>8} {'/ideal':>7} {'prefilled':>10} {'req/replica max/mean':>21} "
              f"{'TTFT p50/p99 (ms)':>18} {'run (s)':>8}")
    print(header)
    print("-" * len(header))
    for r in results:
        balance = f"{r['requests_max']}/{r['requests_mean']:.0f} = {r['requests_max'] / r['requests_mean']:.2f}"
        ttft = f"{1000 * r['ttft_p50_s']:.0f}/{1000 * r['ttft_p99_s']:.0f}"
        print(f"{ROUTER_NAMES[r['router']]:<20} {r['hit_rate']:>8.1%} {r['hit_rate'] / ideal:>7.1%} "
              f"{r['prefilled_tokens']:>10,} {balance:>21} {ttft:>18} {r['run_s']:>8.1f}")
    print(f"{'ideal':<20} {ideal:>8.1%} {1:>7.0%}")
    by_name = {r["router"]: r for r in results}
    if "prefix" in by_name:
        ours = by_name["prefix"]["hit_rate"]
        checks = [f"ours / ideal = {ours / ideal:.2f} (target >= 0.90)"]
        if "pow2" in by_name:
            checks.append(f"ours / power of two = {ours / max(by_name['pow2']['hit_rate'], 1e-9):.2f} (>= 2)")
        if "ray_prefix" in by_name:
            checks.append(f"ours - PrefixCacheAffinity = {ours - by_name['ray_prefix']['hit_rate']:+.1%} (>= 0)")
        print("; ".join(checks))


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--routers", default="prefix,ray_prefix,pow2", help="comma-separated: prefix, ray_prefix, pow2")
    add("--replicas", type=int, default=4)
    add("--pages", type=int, default=32, help="KV-cache pages per replica")
    add("--page-size", type=int, default=16)
    add("--groups", type=int, default=16)
    add("--per-group", type=int, default=16)
    add("--prefix-pages", type=int, default=4)
    add("--concurrency", type=int, default=8)
    add("--max-new-tokens", type=int, default=8)
    add("--max-batch-size", type=int, default=4, help="jobs one replica runs at once")
    add("--our-options", default='{}',
        help="router_options (JSON) for our router: folio.router.policy.PolicyConfig fields")
    add("--seed", type=int, default=0)
    add("--json", help="also write the results here")
    args = parser.parse_args(argv)
    args.routers = args.routers.split(",")
    unknown = set(args.routers) - set(ROUTER_NAMES)
    if unknown:
        parser.error(f"unknown router(s) {', '.join(sorted(unknown))}; known: {', '.join(ROUTER_NAMES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from folio.demo import write_demo_model
    from folio.serve import local
    from folio.serve.config import ServeConfig

    started_s = time.monotonic()
    model_dir = write_demo_model(Path(tempfile.gettempdir()) / "folio-bench-demo-model")
    args.vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    requests = workload(args)
    ideal = ideal_cached_tokens(requests, args.page_size) / sum(len(r.token_ids) for r in requests)
    base = ServeConfig(model_path=str(model_dir), num_gpus=0, num_cpus=0.25, ingress_num_cpus=0.25,
                       num_replicas=args.replicas, cache_tokens=args.pages * args.page_size, page_size=args.page_size,
                       max_batch_size=args.max_batch_size, max_queue_size=64, routing_stats_period_s=0.5,
                       health_check_period_s=30, stall_timeout_s=120)
    local.start_cluster(base, num_cpus=8)
    results = []
    try:
        for router in args.routers:
            results.append(bench_router(router, base, requests, args))
            r = results[-1]
            progress(f"{ROUTER_NAMES[router]}: hit rate {r['hit_rate']:.1%}, requests per replica "
                     f"{r['requests_per_replica']}, {r['run_s']:.0f} s")
        print_table(results, ideal, args)
    finally:
        local.shutdown()
    progress(f"total {time.monotonic() - started_s:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ideal_hit_rate": ideal, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
