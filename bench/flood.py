"""Overload: a flood of concurrent requests against `folio serve`'s demo deployment, against the throughput of a
closed loop of streams measured in the same run.

    .venv/bin/python bench/flood.py                   # 2 replicas of the demo model (folio serve's defaults)
    .venv/bin/python bench/flood.py --requests 2000 --streams 64 --tokens 16
    python bench/flood.py --device cuda --model /tmp/llama-8b --replicas 1 --requests 1000 --streams 256 \
        --max-batch-size 256 --max-queue-size 256 --cache-tokens 262144    (one GPU replica of a real model)

Phases: (1) `--streams` callers in a closed loop of unary requests for `--duration` seconds: their output tok/s is
the peer; (2) `--requests` unary requests sent at once from `--clients` processes. Reports every status code, the
admitted requests' latency p50/p99, admitted output tok/s over the flood (first send to last OK answer) as a share of
the closed loop's, the retry hints of the refused ones, and how long a generator replica sat idle while admitted
requests waited outside the engines (sampled from the replicas' routing stats every 0.25 s).
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from folio.serve.loadgen import CallRecord, closed_loop, flood, percentile, short_request, tokens_per_s  # noqa: E402


def sample_replicas(app: str, stop: threading.Event, samples: list, period_s: float = 0.25) -> None:
    from folio.serve.client import replica_stats

    while not stop.is_set():
        t = time.time()
        stats = replica_stats(app, timeout_s=5.0)
        samples.append((t, {r: (s["num_running"], s["num_queued"]) for r, s in stats.items()}))
        stop.wait(period_s)


def idle_while_waiting_s(samples: list, records: list[CallRecord], period_s: float = 0.25) -> float:
    """Seconds (in sample periods) during which some replica ran nothing while more admitted requests were in
    flight than all the replicas held: work waited outside the engines next to an idle one."""
    ok = [r for r in records if r.code == "OK"]
    idle = 0.0
    for t, stats in samples:
        if not stats:
            continue
        in_flight = sum(1 for r in ok if r.start_s <= t <= r.end_s)
        held = sum(running + queued for running, queued in stats.values())
        if any(running == 0 and queued == 0 for running, queued in stats.values()) and in_flight > held:
            idle += period_s
    return idle


def timeline(records: list[CallRecord], bin_s: float = 1.0) -> str:
    """OK completions' tokens per bin_s since the flood's first send, and when the first and last OK answers came:
    where the flood's span went (getting the calls in, the steady part, the drain)."""
    ok = [r for r in records if r.code == "OK"]
    if not ok:
        return "no OK answers"
    start = min(r.start_s for r in records)
    bins = [0] * (int((max(r.end_s for r in ok) - start) / bin_s) + 1)
    for r in ok:
        bins[int((r.end_s - start) / bin_s)] += r.completion_tokens
    last_send = max(r.start_s for r in records) - start
    first_ok = min(r.end_s for r in ok) - start
    return (f"last send at {last_send:.2f} s, first OK answer at {first_ok:.2f} s; tok/s per {bin_s:g} s: "
            + " ".join(f"{b / bin_s:.0f}" for b in bins))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16, help="max_new_tokens of every request")
    parser.add_argument("--duration", type=float, default=20.0, help="closed-loop seconds")
    parser.add_argument("--clients", type=int, default=2, help="client processes of the flood")
    parser.add_argument("--client-niceness", type=int, default=10, help="the client processes' nice value (they "
                        "share the machine with the server: the higher, the less of its CPU they take)")
    parser.add_argument("--peer-after", action=argparse.BooleanOptionalAction, default=True,
                        help="run the closed loop again after the flood and compare with the mean of the two: "
                             "a change of the machine's speed during the run then moves both sides alike")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--cpu-only-cluster", type=float, default=None, help="Ray's num_cpus (default: cores)")
    parser.add_argument("--max-queued-requests", type=int, default=None,
                        help="requests waiting at the ingress (default: folio serve's, one replica's worth)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: folio serve's demo deployment; cuda: one GPU a replica")
    parser.add_argument("--model", default=None, help="model directory (default: the demo model)")
    for name in ("max_batch_size", "max_queue_size", "cache_tokens", "page_size"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None, help="the replicas' (default: "
                            "folio serve's demo deployment's on a CPU, the config's on a GPU)")
    parser.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE",
                        help="any other ServeConfig option, e.g. ingress_mode=proxy (repeatable)")
    parser.add_argument("--profile-s", type=float, default=0.0,
                        help="py-spy the Serve processes this long in the closed loop (bench/serving_profile.py)")
    parser.add_argument("--profile-flood", action="store_true",
                        help="with --profile-s: profile the flood instead (from just before it is sent)")
    args = parser.parse_args()

    from fakes import free_port

    from folio.demo import write_demo_model
    from folio.serve import local
    from folio.serve.cli import DEMO_DEFAULTS
    from folio.serve.config import ServeConfig

    model_dir = args.model or write_demo_model(Path(tempfile.mkdtemp()) / "demo-model")
    values = {**DEMO_DEFAULTS, "model_path": str(model_dir), "num_replicas": args.replicas,
              "grpc_port": free_port(), "http_port": free_port(), "max_queued_requests": args.max_queued_requests}
    if args.device == "cuda":
        for name in ("cache_tokens", "page_size", "max_batch_size", "max_queue_size", "num_cpus"):
            values.pop(name)
        values.update(device="cuda", num_gpus=1.0)
    for name in ("max_batch_size", "max_queue_size", "cache_tokens", "page_size"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    values.update(option.split("=", 1) for option in args.set)  # (strings: ServeConfig converts them)
    config = ServeConfig.from_dict(values)
    target = f"127.0.0.1:{config.grpc_port}"
    make = functools.partial(short_request, max_new_tokens=args.tokens)
    local.start_cluster(config, num_cpus=args.cpu_only_cluster)
    try:
        local.deploy(config)
        closed_loop(target, config.app_name, make, num_streams=8, duration_s=3.0)  # warm every path
        profile = None
        if args.profile_s > 0:
            from serving_profile import RayProfile

            seconds = args.profile_s if args.profile_flood else min(args.profile_s, args.duration)
            profile = RayProfile(seconds, Path(tempfile.mkdtemp()) / "profile")
            if not args.profile_flood:
                threading.Timer(1.0, profile.__enter__).start()  # (once the loop runs: py-spy takes a while to start)
        loop_records = closed_loop(target, config.app_name, make, num_streams=args.streams,
                                   duration_s=args.duration, niceness=args.client_niceness)
        if profile is not None and not args.profile_flood:
            profile.__exit__(None, None, None)
        if profile is not None and args.profile_flood:
            profile.__enter__()
            time.sleep(1.0)  # (py-spy attaching)
        loop_start = min(r.start_s for r in loop_records)
        loop_tps = tokens_per_s(loop_records, loop_start, loop_start + args.duration)
        samples: list = []
        stop = threading.Event()
        sampler = threading.Thread(target=sample_replicas, args=(config.app_name, stop, samples), daemon=True)
        sampler.start()
        flood_records = flood(target, config.app_name, [make(i) for i in range(args.requests)],
                              num_processes=args.clients, niceness=args.client_niceness)
        stop.set()
        sampler.join(timeout=10)
        if profile is not None and args.profile_flood:
            profile.__exit__(None, None, None)
        after_tps = None
        if args.peer_after:
            after = closed_loop(target, config.app_name, make, num_streams=args.streams, duration_s=args.duration,
                                niceness=args.client_niceness)
            after_start = min(r.start_s for r in after)
            after_tps = tokens_per_s(after, after_start, after_start + args.duration)
    finally:
        local.shutdown()

    codes = Counter(r.code for r in flood_records)
    ok = [r for r in flood_records if r.code == "OK"]
    refused = [r for r in flood_records if r.code == "RESOURCE_EXHAUSTED"]
    flood_tps = tokens_per_s(flood_records)
    idle_s = idle_while_waiting_s(samples, flood_records)
    latencies = [r.latency_s for r in ok]
    hints = [r.retry_after_s for r in refused if r.retry_after_s is not None]
    loop_codes = dict(Counter(r.code for r in loop_records))
    print(f"closed loop: {args.streams} streams x {args.tokens} tokens: {loop_tps:.0f} tok/s "
          f"({len(loop_records)} requests, codes {loop_codes})")
    if after_tps is not None:
        print(f"closed loop after the flood: {after_tps:.0f} tok/s; the peer is their mean, "
              f"{(loop_tps + after_tps) / 2:.0f} tok/s")
        loop_tps = (loop_tps + after_tps) / 2
    print(f"flood: {args.requests} requests at once from {args.clients} processes: codes {dict(codes)}")
    print(f"  admitted: {len(ok)}, latency p50 {percentile(latencies, 50):.2f} s, "
          f"p99 {percentile(latencies, 99):.2f} s, max {max(latencies, default=float('nan')):.2f} s")
    if refused:
        print(f"  refused in p50 {percentile([r.latency_s for r in refused], 50) * 1000:.0f} ms; retry hints "
              f"{len(hints)}/{len(refused)}, median {percentile(hints, 50):.2f} s")
    print(f"  admitted throughput {flood_tps:.0f} tok/s = {flood_tps / max(loop_tps, 1e-9):.2f} x the closed loop")
    print(f"  timeline: {timeline(flood_records)}")
    print(f"  replica idle while admitted requests waited: {idle_s:.2f} s ({len(samples)} samples)")
    if profile is not None:
        print(f"profile of the {'flood' if args.profile_flood else 'closed loop'} ({profile.out_dir}):\n"
              f"{profile.report(top=25)}")
    others = sorted(set(codes) - {"OK", "RESOURCE_EXHAUSTED"})
    for code in others:
        example = next(r for r in flood_records if r.code == code)
        print(f"  {code}: e.g. {example.details!r} after {example.latency_s:.2f} s")
    return 0 if not others else 1


if __name__ == "__main__":
    raise SystemExit(main())
