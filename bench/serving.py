"""End-to-end serving benchmark: `folio serve`'s application (Ray Serve, N generator replicas) driven over gRPC by
client processes, against the engine alone (DynamicGenerator, no Ray) on the same prompts in the same invocation.

    .venv/bin/python bench/serving.py --scale 8 --concurrency 8 --duration 10 --rate 4 --requests 32   (CPU, demo)
    python bench/serving.py --device cuda --model /models/llama-8b --replicas 1 --workload w2 --scale 1 \\
        --concurrency 64 --duration 60 --rate 8 --requests 512 --clients 4
    ... --replicas 1 --tensor-parallel-size 2      (one replica over two GPUs: ServeConfig.tensor_parallel_size)
    ... --concurrency 1,256 --profile-s 10         (two closed loops; py-spy of the Serve processes in the largest)

Arrivals: a closed loop of --concurrency streams for --duration seconds (each sends its next request when the last ends;
a list runs one loop per count), and an open loop of --requests Poisson arrivals at --rate requests/s (0: skip either).
Workloads (token-id prompts, EOS ignored so every request makes max_new_tokens): w2, (512 + 256 new) / --scale random
tokens; chat, conversations of --turns turns over a few shared system prompts, each turn the previous prompt + the
previous answer + a new user part. The previous answer is a seeded stand-in of the answer's length, not the tokens the
server sampled, so that the server and the engine see identical prompts (the prefix cache reuses the system prompt and
earlier turns, not the last answer).

Reported (a markdown table, printed last; $OUT/serving[-LABEL].json): output tok/s (a closed loop's: tokens that arrived
within its --duration, over it, so that the drain of the last requests does not count), TTFT p50/p99 (send to the first
message carrying tokens), inter-token latency p50/p99 (a message of k tokens after a gap g counts k gaps of g/k),
goodput (requests/s with TTFT <= --slo-ttft-ms and mean ITL <= --slo-itl-ms), prefix hit rate (cached / prompt tokens
from each finish's usage), status codes, and the client processes' CPU time per request and as a share of their wall
time (near 100%: the client limits the measurement; add --clients), and with several replicas each one's share of the
requests (the busiest one's over the mean; each streamed call's replica comes in its trailing metadata).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_profile import RayProfile  # noqa: E402

from folio.serve.loadgen import CallRecord, closed_loop, open_loop, percentile, poisson_arrivals_s  # noqa: E402

FIRST_TOKEN_ID = 3  # the demo's BOS / EOS / PAD are 0-2: prompts stay clear of special tokens
OPEN_LOOP_BASE = 1 << 40  # open-loop conversations / prompts never coincide with the closed loop's
STREAM_STRIDE = 1_000_003  # closed_loop's request index: stream_id * this + n


@dataclass(frozen=True)
class Workload:
    name: str  # w2 | chat
    vocab_size: int
    prompt_tokens: int  # w2: the prompt; chat: the system prompt
    new_tokens: int
    user_tokens: int = 0  # chat: each turn's new user part
    turns: int = 1
    num_systems: int = 2


def _tokens(vocab_size: int, count: int, *seed) -> list[int]:
    rng = random.Random("/".join(map(str, seed)))  # a str seed: the same on every run and process
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(count)]


def prompt_ids(work: Workload, conversation: int, turn: int) -> list[int]:
    if work.name == "w2":
        return _tokens(work.vocab_size, work.prompt_tokens, "w2", conversation)
    ids = _tokens(work.vocab_size, work.prompt_tokens, "system", conversation % work.num_systems)
    for k in range(turn + 1):
        ids += _tokens(work.vocab_size, work.user_tokens, "user", conversation, k)
        if k < turn:
            ids += _tokens(work.vocab_size, work.new_tokens, "answer", conversation, k)
    return ids


def request(work: Workload, conversation: int, turn: int):
    from folio.proto.folio.v1 import generation_pb2 as pb

    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids(work, conversation, turn)),
                              max_new_tokens=work.new_tokens, stop_on_eos=False,
                              seed=(conversation * 64 + turn) & 0xFFFFFFFF)


def closed_request(work: Workload, n: int):
    """closed_loop's n-th request: a stream runs its conversations' turns one after the other."""
    return request(work, n // work.turns, n % work.turns)


def open_requests(work: Workload, count: int, num_conversations: int) -> list:
    """Open-loop requests: `num_conversations` conversations at a time, their turns interleaved (a conversation's
    next turn comes num_conversations arrivals later)."""
    out = []
    for i in range(count):
        group, rest = divmod(i, num_conversations * work.turns)
        conversation = OPEN_LOOP_BASE + group * num_conversations + rest % num_conversations
        out.append(request(work, conversation, rest // num_conversations))
    return out


# ------------------------------------------------------------------------------------------------ statistics


def itl_gaps_s(record: CallRecord) -> list[float]:
    times, counts = record.message_s or [], record.message_tokens or []
    gaps = []
    for i in range(1, len(times)):
        gaps += [(times[i] - times[i - 1]) / counts[i]] * counts[i]
    return gaps


def ttft_s(record: CallRecord) -> float | None:
    if record.message_s:
        return record.message_s[0] - record.start_s
    return None if record.first_message_s is None else record.first_message_s - record.start_s


def tokens_within(records: list[CallRecord], start_s: float, end_s: float) -> int:
    """Streamed tokens whose messages arrived in [start_s, end_s)."""
    return sum(n for r in records if r.code == "OK" for t, n in zip(r.message_s or (), r.message_tokens or ())
               if start_s <= t < end_s)


def summarize(label: str, records: list[CallRecord], slo_ttft_ms: float, slo_itl_ms: float,
              client_cpu_s: list[float] | None = None, steady_s: float | None = None, warmup_s: float = 0.0) -> dict:
    """steady_s (a closed loop's duration): output tok/s counts the tokens that arrived within it from the first
    send (plus warmup_s), not the drain of the requests still running at its end. warmup_s: the loop's first
    seconds count for nothing (every stream starts at once: a wave of prompts, then a wave of decoding, before
    arrivals spread out); latencies are those of the requests sent after them."""
    if warmup_s and records:
        start = min(r.start_s for r in records)
        steady = [r for r in records if r.start_s >= start + warmup_s]
        row = summarize(label, steady or records, slo_ttft_ms, slo_itl_ms, client_cpu_s)
        row["output_tok_s"] = tokens_within(records, start + warmup_s, start + warmup_s + steady_s) / steady_s
        row["warmup_s"] = warmup_s
        return row
    ok = [r for r in records if r.code == "OK"]
    window_s = (max(r.end_s for r in records) - min(r.start_s for r in records)) if records else 0.0
    tokens = sum(r.completion_tokens for r in ok)
    out_tok_s = tokens / window_s if window_s > 0 else 0.0
    if steady_s and records:
        start = min(r.start_s for r in records)
        out_tok_s = tokens_within(records, start, start + steady_s) / steady_s
    ttfts = [t for t in map(ttft_s, ok) if t is not None]
    gaps = [g for r in ok for g in itl_gaps_s(r)]
    good = 0
    for r in ok:
        t, g = ttft_s(r), itl_gaps_s(r)
        mean_itl = sum(g) / len(g) if g else 0.0
        good += t is not None and t * 1e3 <= slo_ttft_ms and mean_itl * 1e3 <= slo_itl_ms
    prompt = sum(r.prompt_tokens for r in ok)
    per_replica = Counter(r.replica for r in ok if r.replica)
    # where a request's time to its first token went: the client and the proxy (client's - ingress's), the ingress,
    # routing and the hop to the replica (ingress's - engine's), the engine (queued + prefill)
    staged = [(ttft_s(r), r.server_ttft_s, r.engine_ttft_s) for r in ok if r.server_ttft_s and ttft_s(r)]
    row = {"run": label, "requests": len(records), "ok": len(ok), "codes": dict(Counter(r.code for r in records)),
           "window_s": window_s, "output_tokens": tokens,
           "streamed_tokens": sum(sum(r.message_tokens or ()) for r in ok),
           "output_tok_s": out_tok_s,
           "ttft_p50_ms": percentile(ttfts, 50) * 1e3, "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
           "itl_p50_ms": percentile(gaps, 50) * 1e3, "itl_p99_ms": percentile(gaps, 99) * 1e3,
           "goodput_req_s": good / window_s if window_s > 0 else 0.0, "good_requests": good,
           "prefix_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
           "client_cpu_ms_per_request": None, "client_cpu_share": None,
           "replica_share_max": (max(per_replica.values()) / (len(ok) / len(per_replica))) if per_replica else None,
           "replicas_seen": len(per_replica),
           "messages": sum(len(r.message_s or ()) for r in ok),
           "ttft_p50_client_proxy_ms": percentile([c - s for c, s, _ in staged], 50) * 1e3,
           "ttft_p50_ingress_to_engine_ms": percentile([s - e for _, s, e in staged], 50) * 1e3,
           "ttft_p50_engine_ms": percentile([e for _, _, e in staged], 50) * 1e3}
    if client_cpu_s and records:
        row["client_cpu_ms_per_request"] = sum(client_cpu_s) / len(records) * 1e3
        row["client_cpu_share"] = max(client_cpu_s) / window_s if window_s > 0 else None
    return row


# ------------------------------------------------------------------------------------------------ engine alone


class EngineAlone:
    """DynamicGenerator built as a replica builds it (folio.serve.engine.Engine.build's model, cache and generator
    settings), driven by a step loop in this process with the same arrivals as the server's clients."""

    def __init__(self, config) -> None:
        from folio.serve.build import build_generator

        if config.resolved_device == "cpu":
            import torch

            # Ray gives a replica's process OMP_NUM_THREADS = its num_cpus (at least 1): the same threads here
            torch.set_num_threads(max(1, int(config.num_cpus)))
        # (no queue bound: the step loop here admits what the clients' arrivals bring)
        _, _, _, self.cache, self.generator = build_generator(config, max_queued_jobs=None)
        self.generator.warmup()

    def _job(self, message, slot: int):
        from folio import DynamicJob, SamplerSettings

        job = DynamicJob(input_ids=list(message.token_ids.ids), max_new_tokens=message.max_new_tokens,
                         stop_conditions=[], gen_settings=SamplerSettings(), seed=message.seed)
        job.bench_slot = slot
        job.bench_record = CallRecord(time.time(), 0.0, "OK", message_s=[], message_tokens=[])
        self.generator.enqueue(job)
        return job

    def _step(self) -> list:
        """One step; the records of the jobs it finished."""
        results, _ = self.generator.step()
        now, done = time.time(), []
        for result in results:
            record = getattr(result.job, "bench_record", None)
            if record is None:
                continue
            if getattr(result, "token_ids", None):
                record.message_s.append(now)
                record.message_tokens.append(len(result.token_ids))
            if getattr(result, "error", None) is not None:
                record.code = "INTERNAL"
            if result.eos:
                record.end_s = now
                record.completion_tokens = result.new_tokens or 0
                record.prompt_tokens, record.cached_tokens = result.prompt_tokens or 0, result.cached_tokens or 0
                record.first_message_s = record.message_s[0] if record.message_s else None
                done.append(result.job)
        return done

    def closed(self, make_request, num_streams: int, duration_s: float) -> list[CallRecord]:
        end_at, records = time.time() + duration_s, []
        in_flight = {self._job(make_request(s * STREAM_STRIDE), s) for s in range(num_streams)}
        sent = [1] * num_streams
        while in_flight:
            for job in self._step():
                in_flight.discard(job)
                records.append(job.bench_record)
                s = job.bench_slot
                if time.time() < end_at:
                    in_flight.add(self._job(make_request(s * STREAM_STRIDE + sent[s]), s))
                    sent[s] += 1
        return records

    def open(self, messages: list, rate_per_s: float, seed: int) -> list[CallRecord]:
        send_at = poisson_arrivals_s(len(messages), rate_per_s, seed)
        start, next_idx, in_flight, records = time.time(), 0, set(), []
        while next_idx < len(messages) or in_flight:
            now = time.time()
            while next_idx < len(messages) and start + send_at[next_idx] <= now:
                job = self._job(messages[next_idx], next_idx)
                job.bench_record.start_s = start + send_at[next_idx]  # its arrival, as a client would send it
                in_flight.add(job)
                next_idx += 1
            if not in_flight:
                time.sleep(max(0.0, start + send_at[next_idx] - time.time()))
                continue
            for job in self._step():
                in_flight.discard(job)
                records.append(job.bench_record)
        return records


# ------------------------------------------------------------------------------------------------ report


def fmt(value, spec: str) -> str:
    return "-" if value is None or value != value else format(value, spec)


def table(rows: list[dict]) -> str:
    head = ("| run | requests | codes | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | "
            "goodput req/s | prefix hit | client CPU ms/req | client CPU share | busiest replica / mean |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        codes = " ".join(f"{k}:{v}" for k, v in sorted(r["codes"].items()))
        lines.append(f"| {r['run']} | {r['requests']} | {codes} | {fmt(r['output_tok_s'], '.1f')} | "
                     f"{fmt(r['ttft_p50_ms'], '.1f')} | {fmt(r['ttft_p99_ms'], '.1f')} | "
                     f"{fmt(r['itl_p50_ms'], '.2f')} | {fmt(r['itl_p99_ms'], '.2f')} | "
                     f"{fmt(r['goodput_req_s'], '.2f')} | {fmt(r['prefix_hit_rate'], '.3f')} | "
                     f"{fmt(r['client_cpu_ms_per_request'], '.2f')} | {fmt(r['client_cpu_share'], '.1%')} | "
                     f"{fmt(r.get('replica_share_max'), '.2f')} |")
    return "\n".join(lines)


def comparisons(rows: list[dict]) -> list[dict]:
    by_run = {r["run"]: r for r in rows}
    out = []
    modes = [r["run"].removeprefix("server ") for r in rows if r["run"].startswith("server ")]
    for mode in modes:
        server, engine = by_run.get(f"server {mode}"), by_run.get(f"engine {mode}")
        if server and engine:
            out.append({"arrivals": mode,
                        "tok_s_ratio": server["output_tok_s"] / engine["output_tok_s"]
                        if engine["output_tok_s"] else None,
                        "ttft_p50_diff_ms": server["ttft_p50_ms"] - engine["ttft_p50_ms"],
                        "ttft_p99_diff_ms": server["ttft_p99_ms"] - engine["ttft_p99_ms"],
                        "itl_p50_diff_ms": server["itl_p50_ms"] - engine["itl_p50_ms"]})
    return out


# ------------------------------------------------------------------------------------------------ main


def _counts(text: str) -> list[int]:
    return [n for n in map(int, text.split(",")) if n > 0]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="processes (GPUs) each replica is split over (the engine-alone run too)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", default=None, help="model directory (default: the demo model, in a temp dir)")
    parser.add_argument("--router", choices=("prefix", "pow2", "ray_prefix"), default="prefix")
    parser.add_argument("--workload", choices=("w2", "chat"), default="w2")
    parser.add_argument("--scale", type=int, default=1, help="divide the workload's token counts (8: 64+32 w2)")
    parser.add_argument("--turns", type=int, default=4, help="chat: turns per conversation")
    parser.add_argument("--conversations", type=int, default=4, help="chat, open loop: conversations interleaved")
    parser.add_argument("--concurrency", type=_counts, default=[8],
                        help="closed-loop streams, or a list (1,256: one loop each; 0: no closed loop)")
    parser.add_argument("--duration", type=float, default=10.0, help="closed-loop seconds")
    parser.add_argument("--warmup-s", type=float, default=0.0,
                        help="closed loops run this much longer, their first seconds not counted (steady state)")
    parser.add_argument("--rate", type=float, default=0.0, help="open-loop Poisson requests/s (0: no open loop)")
    parser.add_argument("--requests", type=int, default=32, help="open-loop requests")
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=100.0)
    parser.add_argument("--no-engine", action="store_true", help="skip the engine-alone runs")
    parser.add_argument("--max-batch-size", type=int, default=None)
    parser.add_argument("--page-size", type=int, default=None)
    parser.add_argument("--cache-tokens", type=int, default=None)
    parser.add_argument("--max-chunk-size", type=int, default=None)
    parser.add_argument("--cpus", type=float, default=None, help="Ray's num_cpus (default: cores)")
    parser.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto",
                        help="the replicas' (and the engine's) cuda_graphs; auto: the config's default")
    parser.add_argument("--profile-s", type=float, default=0.0,
                        help="py-spy the Serve processes for this long in the largest closed loop")
    parser.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE",
                        help="any other ServeConfig option, e.g. max_stream_messages_per_s=0 (repeatable)")
    parser.add_argument("--label", default="", help="names the JSON file: $OUT/serving-LABEL.json")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def serve_config(args, model_dir: str):
    from fakes import free_port

    from folio.serve.config import ServeConfig

    tp = args.tensor_parallel_size
    values = {"model_path": model_dir, "num_replicas": args.replicas, "router": args.router,
              "grpc_port": free_port(), "http_port": free_port(), "tensor_parallel_size": tp,
              "cuda_graphs": {"auto": None, "on": True, "off": False}[args.cuda_graphs]}
    if args.device == "cpu":  # folio serve's demo deployment
        values.update(device="cpu", num_gpus=0.0, num_cpus=0.5, cache_tokens=8192, page_size=16, max_batch_size=16,
                      max_queue_size=32)
    else:
        values.update(device="cuda", num_gpus=float(tp))
    for name in ("max_batch_size", "page_size", "cache_tokens", "max_chunk_size"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    values.update(option.split("=", 1) for option in args.set)  # (strings: ServeConfig converts them)
    return ServeConfig.from_dict(values)


def workload_of(args, vocab_size: int) -> Workload:
    if args.workload == "w2":
        return Workload("w2", vocab_size, 512 // args.scale, 256 // args.scale)
    return Workload("chat", vocab_size, 512 // args.scale, 128 // args.scale, user_tokens=64 // args.scale,
                    turns=args.turns)


def run_server(config, args, work: Workload, reports: list[str]) -> list[dict]:
    """The server's rows; what the profiler found goes to `reports`."""
    from folio.serve import local
    from folio.serve.loadgen import flood

    target, rows = f"127.0.0.1:{config.grpc_port}", []
    local.start_cluster(config, num_cpus=args.cpus)
    try:
        local.deploy(config)
        # warm the gRPC path and every replica (conversations nobody else uses)
        flood(target, config.app_name, [request(work, -1 - i, 0) for i in range(2 * args.replicas)], stream=True)
        for streams in args.concurrency:
            cpu: list[float] = []
            warmup_s = args.warmup_s if streams > 1 else 0.0  # (one stream has no wave to wait out)
            profile = None
            if args.profile_s and streams == max(args.concurrency):
                profile = RayProfile(args.profile_s, Path(os.environ.get("OUT") or tempfile.mkdtemp(), "profile"))
                # from the end of the warm-up (py-spy takes a moment to attach)
                threading.Timer(warmup_s + 1.0, profile.__enter__).start()
            records = closed_loop(target, config.app_name, functools.partial(closed_request, work),
                                  num_streams=streams, duration_s=warmup_s + args.duration,
                                  num_processes=args.clients, stream=True, client_cpu_s=cpu)
            if profile is not None:
                profile.__exit__(None, None, None)
                reports.append(f"py-spy, closed loop of {streams} streams ({args.profile_s:g} s after "
                               f"{warmup_s + 1.0:g} s):\n" + profile.report(top=20))
            rows.append(summarize(f"server closed {streams}", records, args.slo_ttft_ms, args.slo_itl_ms, cpu,
                                  steady_s=args.duration, warmup_s=warmup_s))
        if args.rate:
            cpu = []
            records = open_loop(target, config.app_name, open_requests(work, args.requests, args.conversations),
                                args.rate, num_processes=args.clients, stream=True, seed=args.seed,
                                client_cpu_s=cpu)
            rows.append(summarize("server open", records, args.slo_ttft_ms, args.slo_itl_ms, cpu))
    finally:
        local.shutdown()
    return rows


def run_engine(config, args, work: Workload) -> list[dict]:
    from folio.serve.build import close_tensor_parallel

    engine, rows = EngineAlone(config), []
    try:
        for streams in args.concurrency:
            warmup_s = args.warmup_s if streams > 1 else 0.0
            records = engine.closed(functools.partial(closed_request, work), streams, warmup_s + args.duration)
            rows.append(summarize(f"engine closed {streams}", records, args.slo_ttft_ms, args.slo_itl_ms,
                                  steady_s=args.duration, warmup_s=warmup_s))
        if args.rate:
            records = engine.open(open_requests(work, args.requests, args.conversations), args.rate, args.seed)
            rows.append(summarize("engine open", records, args.slo_ttft_ms, args.slo_itl_ms))
    finally:
        close_tensor_parallel(engine.cache)  # (a tensor-parallel engine's other ranks)
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        from folio.demo import write_demo_model

        model_dir = str(write_demo_model(Path(tempfile.mkdtemp()) / "demo-model"))
    config = serve_config(args, model_dir)
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    work = workload_of(args, vocab_size)
    reports: list[str] = []
    rows = run_server(config, args, work, reports)
    if not args.no_engine:
        rows += run_engine(config, args, work)
    result = {"args": vars(args), "workload": asdict(work), "rows": rows, "server_vs_engine": comparisons(rows),
              "profile": reports}
    if os.environ.get("OUT"):
        name = f"serving{'-' + args.label if args.label else ''}.json"
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], name).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"\n{args.workload} ({work.prompt_tokens}+{work.new_tokens}"
          f"{f', user {work.user_tokens}, {work.turns} turns' if work.name == 'chat' else ''}), {args.replicas} "
          f"replica(s) on {args.device}, router {args.router}, {args.clients} client processes; "
          f"SLO TTFT {args.slo_ttft_ms:g} ms, ITL {args.slo_itl_ms:g} ms\n")
    for report in reports:
        print(report + "\n")
    for r in rows:
        if r["run"].startswith("server") and r["messages"]:
            print(f"{r['run']}: {r['streamed_tokens'] / r['messages']:.2f} tokens a message; TTFT p50 by stage: "
                  f"client + proxy {fmt(r['ttft_p50_client_proxy_ms'], '.1f')} ms, ingress + routing + hop "
                  f"{fmt(r['ttft_p50_ingress_to_engine_ms'], '.1f')} ms, engine (queued + prefill) "
                  f"{fmt(r['ttft_p50_engine_ms'], '.1f')} ms")
    print(table(rows))
    for c in result["server_vs_engine"]:
        print(f"\n{c['arrivals']}: server/engine tok/s {fmt(c['tok_s_ratio'], '.2f')}, TTFT p50 "
              f"{fmt(c['ttft_p50_diff_ms'], '+.1f')} ms, p99 {fmt(c['ttft_p99_diff_ms'], '+.1f')} ms, ITL p50 "
              f"{fmt(c['itl_p50_diff_ms'], '+.2f')} ms")
    return result


if __name__ == "__main__":
    main()
