"""Routing at a scale no machine here holds: a discrete-event simulation of N replicas, each with a REAL
folio.cache.PagePool, fed a synthetic trace, routed by the real folio.router.policy code and by models of two
baselines.

    python bench/routing_sim.py                                # 64 replicas, 20,000 requests (~1-2 min on 2 cores)
    python bench/routing_sim.py --replicas 4 --requests 256    # the CPU bench's workload: 16 groups x 16 requests

Trace (full scale): conversations whose first prompt is one of `--prefixes` shared prefixes (system prompts,
documents; Zipf-popular) plus a user message; each later turn resends the whole context (previous prompt + the
response + a new user message). Arrivals are a Poisson stream of conversations; turn k+1 arrives a think time after
turn k could have finished. The small mode is 16 prefix groups x 16 requests: a 4-page shared prefix plus a
unique suffix, groups interleaved.

Replica model: `--batch` job slots taken FIFO; then the replica's one prefill engine, FIFO, `--prefill-rate`
tokens/s. At its prefill start a job takes its pages from the pool: cached prefix pages acquired (so a job right
behind another with the same new prefix reuses what that one just computed, as the engine's in-flight sharing
would), the rest allocated up front (evicting LRU leaves; a job short of pages waits). After prefill it decodes its
response at `--decode-step` seconds per token. Its full pages (prompt after prefill, response at the end) are
registered with their real folio.hashing hashes; all are released at completion and stay cached until evicted.

Routers:
  ours         folio.router.policy.PrefixRouterPolicy, fed folio.router.digest digests built from each replica's pool
               every `--report-period` simulated seconds (as Ray's request_routing_stats_period_s) plus its own
               routed record: it routes on information up to a period old.
  ray-prefix   a model of the policy of Ray's PrefixCacheAffinityRouter (ray.llm ... prefix_aware): a tree of the
               prompts it routed per replica (here at page granularity over token ids; Ray's is over characters),
               never told about evictions (its do_eviction defaults to off, and even on it only trims by size);
               if the queue-length spread exceeds imbalanced_threshold (10) -> power of two; else the replicas at
               the longest match if the match rate >= 0.1, else the replicas with the fewest routed characters;
               shortest queue among those. Queue lengths are exact and current (generous to it).
  pow2         power of two choices on current queue length (Ray Serve's default router).
  ideal        the trace's bound: every prompt page that any earlier request computed is hit (one infinite
               cache, routing irrelevant).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

# folio must be installed (`make setup`, or pip install -e .): router/ is importable only as folio.router.
from folio.cache import OutOfPages, PagePool
from folio.hashing import page_hashes
from folio.router.digest import build_digest, page_keys
from folio.router.policy import PolicyConfig, PrefixRouterPolicy

# ---- the trace --------------------------------------------------------------------------------------------------


@dataclass
class Conversation:
    token_ids: np.ndarray  # the final context: prefix, then (user message, response) per turn
    hashes: list[bytes]  # page hashes of every full page of token_ids
    keys: list[int]  # their router keys


@dataclass
class Request:
    arrival_s: float
    conv: Conversation
    num_prompt_tokens: int
    num_response_tokens: int


def zipf_weights(n: int, s: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** s
    return weights / weights.sum()


def make_conversation(prefix: np.ndarray, segments: list[np.ndarray], page_size: int) -> Conversation:
    token_ids = np.concatenate([prefix, *segments])
    hashes = page_hashes(token_ids.tolist(), page_size)
    return Conversation(token_ids, hashes, page_keys(hashes))


def full_trace(args: argparse.Namespace) -> list[Request]:
    """Conversations start as a Poisson stream and run their turns; the first args.requests requests to arrive
    are kept (so the trace is a window of a steady stream, not a burst followed by conversations' tails)."""
    rng = np.random.default_rng(args.seed)
    prefixes = [rng.integers(0, 32000, rng.integers(args.min_prefix, args.max_prefix + 1)) for _ in
                range(args.prefixes)]
    popularity = zipf_weights(args.prefixes, args.zipf)
    requests: list[Request] = []
    start_s = 0.0
    num_conversations = 0
    while num_conversations % 256 or sum(r.arrival_s <= start_s for r in requests) < args.requests:
        start_s += rng.exponential(1.0 / args.conversation_rate)
        num_conversations += 1
        num_turns = min(int(rng.geometric(1.0 / args.mean_turns)), args.max_turns)
        segments, turns = [], []
        context_len = 0
        arrival_s = start_s
        for _ in range(num_turns):
            user = rng.integers(0, 32000, rng.integers(32, 257))
            response = rng.integers(0, 32000, rng.integers(64, 385))
            segments += [user, response]
            context_len += len(user)
            turns.append((arrival_s, context_len, len(response)))
            context_len += len(response)
            arrival_s += len(response) * args.decode_step + 1.0 + rng.exponential(args.think_time)
        prefix = prefixes[rng.choice(args.prefixes, p=popularity)]
        conv = make_conversation(prefix, segments, args.page_size)
        requests += [Request(a, conv, len(prefix) + n, d) for a, n, d in turns]
        if num_conversations % 1024 == 0:
            progress(f"trace: {num_conversations} conversations")
    requests.sort(key=lambda r: r.arrival_s)
    return requests[:args.requests]


def small_trace(args: argparse.Namespace, num_groups: int = 16, prefix_pages: int = 4) -> list[Request]:
    """The CPU bench's workload: num_groups groups of requests sharing a prefix_pages-page prefix, each with a
    unique suffix; requests interleaved across groups."""
    rng = np.random.default_rng(args.seed)
    per_group = math.ceil(args.requests / num_groups)
    prefixes = [rng.integers(0, 32000, prefix_pages * args.page_size) for _ in range(num_groups)]
    requests = []
    arrival_s = 0.0
    for idx in range(args.requests):
        group = idx % num_groups if idx < num_groups * per_group else rng.integers(num_groups)
        suffix = rng.integers(0, 32000, rng.integers(8, 33))
        response = rng.integers(0, 32000, 32)
        conv = make_conversation(prefixes[group], [suffix, response], args.page_size)
        requests.append(Request(arrival_s, conv, len(prefixes[group]) + len(suffix), len(response)))
        arrival_s += rng.exponential(1.0 / args.conversation_rate)
    return requests


def ideal_cached_tokens(requests: list[Request], page_size: int) -> int:
    """Prompt tokens hit if every page any earlier request computed were still cached where needed."""
    seen: set[int] = set()
    cached = 0
    for req in requests:
        keys = req.conv.keys
        reusable = (req.num_prompt_tokens - 1) // page_size
        depth = 0
        while depth < reusable and keys[depth] in seen:
            depth += 1
        cached += depth * page_size
        seen.update(keys[:(req.num_prompt_tokens + req.num_response_tokens - 1) // page_size])
    return cached


# ---- replicas ---------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Job:
    req: Request
    replica: int
    page_ids: list[int] = field(default_factory=list)
    num_cached_pages: int = 0
    start_s: float = 0.0
    prefill_start_s: float = 0.0
    prefill_end_s: float = 0.0


class SimReplica:
    """One replica: a job takes a slot (FIFO, `max_running` slots), then the prefill engine (FIFO, one prompt at a
    time). At its prefill start it takes its pages: the cached prefix is acquired (including pages the jobs ahead of
    it just computed, as the engine's in-flight sharing would give it), the rest allocated, evicting LRU leaves."""

    def __init__(self, replica_id: int, args: argparse.Namespace) -> None:
        self.replica_id = replica_id
        self.pool = PagePool(args.pages, args.page_size, record_events=False)
        self.page_size = args.page_size
        self.max_running = args.batch
        self.prefill_rate = args.prefill_rate
        self.waiting: deque[Job] = deque()  # no slot yet
        self.admitted: deque[Job] = deque()  # slot held, waiting for the prefill engine
        self.prefilling: Job | None = None
        self.num_running = 0  # slots held: admitted, prefilling or decoding
        self.num_requests = 0
        self.prefill_busy_s = 0.0

    @property
    def num_jobs(self) -> int:
        return self.num_running + len(self.waiting)

    def num_prefill_tokens(self, now: float) -> int:
        """Prompt tokens not prefilled yet (of jobs not started: all of them, cache hits unknown)."""
        current = 0 if self.prefilling is None else (self.prefilling.prefill_end_s - now) * self.prefill_rate
        return int(max(0.0, current)) + sum(job.req.num_prompt_tokens for q in (self.admitted, self.waiting)
                                            for job in q)

    def step(self, now: float) -> Job | None:
        """Give free slots to waiting jobs, and the prefill engine, if idle, to the next admitted job that gets
        its pages. Returns the job whose prefill started, if any."""
        while self.waiting and self.num_running < self.max_running:
            job = self.waiting.popleft()
            job.start_s = now
            self.admitted.append(job)
            self.num_running += 1
        if self.prefilling is not None or not self.admitted or not self._take_pages(self.admitted[0]):
            return None  # a job short of pages retries when another finishes
        job = self.prefilling = self.admitted.popleft()
        uncached = job.req.num_prompt_tokens - job.num_cached_pages * self.page_size
        job.prefill_start_s = now
        job.prefill_end_s = now + 0.005 + uncached / self.prefill_rate
        self.prefill_busy_s += job.prefill_end_s - now
        return job

    def prefilled(self, job: Job) -> None:
        self.register(job, job.req.num_prompt_tokens)
        self.prefilling = None

    def _take_pages(self, job: Job) -> bool:
        req, size = job.req, self.page_size
        reusable = req.conv.hashes[:(req.num_prompt_tokens - 1) // size]
        found = self.pool.lookup(reusable).num_ready
        page_ids = self.pool.acquire(reusable[:found])
        try:
            page_ids += self.pool.allocate(math.ceil((req.num_prompt_tokens + req.num_response_tokens) / size) - found)
        except OutOfPages:
            self.pool.release(page_ids)
            return False
        job.page_ids, job.num_cached_pages = page_ids, found
        return True

    def register(self, job: Job, num_tokens: int) -> None:
        """The K/V of the job's first num_tokens tokens are written: register its full pages not yet ready."""
        conv, size = job.req.conv, self.page_size
        for page_idx in range(job.num_cached_pages, num_tokens // size):
            parent = conv.hashes[page_idx - 1] if page_idx else None
            tokens = conv.token_ids[page_idx * size:(page_idx + 1) * size].tolist()
            self.pool.set_ready(job.page_ids[page_idx], conv.hashes[page_idx], parent, tokens)
        job.num_cached_pages = max(job.num_cached_pages, num_tokens // size)

    def finish(self, job: Job) -> None:
        self.register(job, job.req.num_prompt_tokens + job.req.num_response_tokens - 1)
        self.pool.release(job.page_ids)
        self.num_running -= 1


# ---- routers ----------------------------------------------------------------------------------------------------


class Pow2Router:
    name = "pow2"

    def __init__(self, replicas: list[SimReplica], args: argparse.Namespace) -> None:
        self.replicas = replicas
        self.rng = random.Random(args.seed)

    def route(self, req: Request, now: float) -> int:
        a, b = self.rng.sample(range(len(self.replicas)), 2)
        return pick_shortest([a, b], self.replicas, self.rng)

    def tick(self, now: float) -> None:
        pass


def pick_shortest(candidates: list[int], replicas: list[SimReplica], rng: random.Random) -> int:
    shortest = min(replicas[r].num_jobs for r in candidates)
    return rng.choice([r for r in candidates if replicas[r].num_jobs == shortest])


class RayPrefixRouter(Pow2Router):
    """Model of PrefixCacheAffinityRouter's policy (see the module docstring). Its tree is one dict: a page key
    names the page's whole prefix, so it is a tree node; the value is the replicas routed a prompt through it."""

    name = "ray-prefix"

    def __init__(self, replicas: list[SimReplica], args: argparse.Namespace) -> None:
        super().__init__(replicas, args)
        self.page_size = args.page_size
        self.imbalanced_threshold = 10
        self.match_rate_threshold = 0.1
        self.tenants: dict[int, set[int]] = {}
        self.num_routed_tokens = [0] * len(replicas)

    def route(self, req: Request, now: float) -> int:
        fallback = super().route(req, now)
        jobs = [r.num_jobs for r in self.replicas]
        if max(jobs) - min(jobs) > self.imbalanced_threshold:
            return fallback
        keys = req.conv.keys[:req.num_prompt_tokens // self.page_size]
        depth = 0
        while depth < len(keys) and self.tenants.get(keys[depth]):
            depth += 1
        if depth * self.page_size / req.num_prompt_tokens < self.match_rate_threshold:
            fewest = min(self.num_routed_tokens)
            chosen = [r for r, n in enumerate(self.num_routed_tokens) if n == fewest]
        else:
            chosen = sorted(self.tenants[keys[depth - 1]])
        replica = pick_shortest(chosen, self.replicas, self.rng)
        for key in keys:  # on_request_routed: insert the prompt
            holders = self.tenants.setdefault(key, set())
            if replica not in holders:
                holders.add(replica)
                self.num_routed_tokens[replica] += self.page_size
        return replica


class OurRouter:
    name = "ours"

    def __init__(self, replicas: list[SimReplica], args: argparse.Namespace, clock) -> None:
        self.replicas = replicas
        config = PolicyConfig(backlog_token_weight=args.backlog_token_weight,
                              running_job_tokens=args.running_job_tokens, queued_job_tokens=args.queued_job_tokens,
                              imbalance_threshold=args.imbalance_threshold,
                              routed_ttl_s=args.routed_ttl, default_page_size=args.page_size, seed=args.seed)
        self.policy = PrefixRouterPolicy(config, clock=clock)
        self.policy.sync_replicas(range(len(replicas)))
        self.max_hashes = args.max_hashes
        self.epoch = 0
        self.ids = list(range(len(replicas)))
        self.digest_bytes = 0

    def route(self, req: Request, now: float) -> int:
        prompt = req.conv.token_ids[:req.num_prompt_tokens].tolist()
        decision = self.policy.choose(self.ids, prompt)
        self.policy.on_routed(decision.best, decision)
        return decision.best

    def tick(self, now: float) -> None:
        self.epoch += 1
        for replica in self.replicas:
            digest = build_digest(replica.pool, replica.num_running, len(replica.waiting), self.epoch,
                                  self.max_hashes, max_running=replica.max_running,
                                  num_prefill_tokens=replica.num_prefill_tokens(now))
            if self.epoch % 16 == 1:  # sampled: encoding JSON costs more than the digest itself
                self.digest_bytes = max(self.digest_bytes, len(json.dumps(digest)))
            self.policy.report(replica.replica_id, digest)


# ---- the simulation ---------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(kind: str, requests: list[Request], args: argparse.Namespace) -> dict:
    clock = Clock()
    replicas = [SimReplica(r, args) for r in range(args.replicas)]
    router = {"ours": lambda: OurRouter(replicas, args, clock), "ray-prefix": lambda: RayPrefixRouter(replicas, args),
              "pow2": lambda: Pow2Router(replicas, args)}[kind]()
    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def push(at: float, what: str, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, what, payload))

    for req in requests:
        push(req.arrival_s, "arrive", req)
    push(0.0, "tick", None)
    cached = prompt = 0
    ttft, queue_delay = [], []
    done = 0
    wall_start = time.perf_counter()
    while events:
        now, _, what, payload = heapq.heappop(events)
        clock.now = now
        if what == "tick":
            router.tick(now)
            if done < len(requests):
                if not events:
                    raise RuntimeError(f"{kind}: {len(requests) - done} requests can never run (too few pages?)")
                push(now + args.report_period, "tick", None)
            continue
        if what == "arrive":
            replica = replicas[router.route(payload, now)]
            replica.num_requests += 1
            replica.waiting.append(Job(payload, replica.replica_id))
        elif what == "prefilled":
            replica = replicas[payload.replica]
            replica.prefilled(payload)
            push(now + payload.req.num_response_tokens * args.decode_step, "finished", payload)
        else:  # "finished"
            replica = replicas[payload.replica]
            replica.finish(payload)
            done += 1
            if done % 5000 == 0:
                progress(f"{kind}: {done}/{len(requests)} requests done, {time.perf_counter() - wall_start:.0f} s")
        job = replica.step(now)
        if job is not None:
            cached += job.num_cached_pages * args.page_size
            prompt += job.req.num_prompt_tokens
            ttft.append(job.prefill_end_s - job.req.arrival_s)
            queue_delay.append(job.prefill_start_s - job.req.arrival_s)
            push(job.prefill_end_s, "prefilled", job)
    counts = [r.num_requests for r in replicas]
    span_s = requests[-1].arrival_s
    busy = [r.prefill_busy_s / span_s for r in replicas]
    result = {"router": kind, "hit_rate": cached / prompt, "prompt_tokens": prompt, "prefilled_tokens": prompt - cached,
              "requests_max": max(counts), "requests_mean": sum(counts) / len(counts),
              "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
              "queue_p50_s": percentile(queue_delay, 50), "queue_p99_s": percentile(queue_delay, 99),
              "prefill_util_max": max(busy), "prefill_util_mean": sum(busy) / len(busy), "sim_s": now,
              "wall_s": time.perf_counter() - wall_start}
    if isinstance(router, OurRouter):
        result["digest_bytes_max"] = router.digest_bytes
    return result


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def print_table(results: list[dict], ideal: float, args: argparse.Namespace) -> None:
    print(f"\n{args.replicas} replicas x {args.pages} pages of {args.page_size} tokens, {args.requests} requests, "
          f"digests every {args.report_period:g} s (<= {args.max_hashes} hashes)")
    header = (f"{'router':<11} {'hit rate':>8} {'/ideal':>7} {'prefilled':>11} {'req/replica':>13} "
              f"{'prefill busy':>12} {'TTFT p50/p99 (s)':>17} {'queue p50/p99 (s)':>18}")
    print(header)
    print("-" * len(header))
    for r in results:
        balance = f"{r['requests_max']}/{r['requests_mean']:.1f}"
        busy = f"{r['prefill_util_max']:.0%}/{r['prefill_util_mean']:.0%}"
        print(f"{r['router']:<11} {r['hit_rate']:>8.1%} {r['hit_rate'] / ideal:>7.1%} {r['prefilled_tokens']:>11,} "
              f"{balance:>13} {busy:>12} {r['ttft_p50_s']:>8.3f}/{r['ttft_p99_s']:<8.3f} "
              f"{r['queue_p50_s']:>8.3f}/{r['queue_p99_s']:<8.3f}")
    print(f"{'ideal':<11} {ideal:>8.1%} {1:>7.0%}")
    ours = next((r for r in results if r["router"] == "ours"), None)
    if ours is not None:
        print(f"largest digest: {ours['digest_bytes_max']:,} bytes of JSON")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--replicas", type=int, default=64)
    add("--requests", type=int, default=20_000)
    add("--routers", default="ours,ray-prefix,pow2", help="comma-separated: ours, ray-prefix, pow2")
    add("--small", action="store_true", help="the CPU bench's 16 groups x 16 requests workload "
        "(implied by --requests <= 256)")
    add("--seed", type=int, default=0)
    add("--page-size", type=int, default=64)
    add("--pages", type=int, default=None, help="pages per replica (default: 2048; 64 in the small mode)")
    add("--batch", type=int, default=32, help="job slots per replica")
    add("--prefill-rate", type=float, default=8_000.0, help="prompt tokens a replica prefills per second")
    add("--decode-step", type=float, default=0.03, help="seconds per generated token")
    add("--conversation-rate", type=float, default=None,
        help="conversations (small mode: requests) starting per second (default: scaled to the replicas)")
    add("--prefixes", type=int, default=512, help="shared prefixes (system prompts, documents)")
    add("--zipf", type=float, default=1.1, help="Zipf exponent of prefix popularity")
    add("--min-prefix", type=int, default=256)
    add("--max-prefix", type=int, default=4096)
    add("--mean-turns", type=float, default=4.0)
    add("--max-turns", type=int, default=16)
    add("--think-time", type=float, default=5.0, help="mean seconds between a response and the next turn")
    add("--report-period", type=float, default=1.0, help="seconds between a replica's digests")
    add("--max-hashes", type=int, default=1024, help="bound on the hashes in a digest")
    add("--backlog-token-weight", type=float, default=PolicyConfig.backlog_token_weight)
    add("--running-job-tokens", type=float, default=PolicyConfig.running_job_tokens)
    add("--queued-job-tokens", type=float, default=PolicyConfig.queued_job_tokens)
    add("--imbalance-threshold", type=int, default=PolicyConfig.imbalance_threshold)
    add("--routed-ttl", type=float, default=PolicyConfig.routed_ttl_s)
    add("--json", help="also write the results here")
    args = parser.parse_args(argv)
    args.small = args.small or args.requests <= 256
    if args.pages is None:
        args.pages = 64 if args.small else 2048
    if args.conversation_rate is None:
        args.conversation_rate = (2.0 if args.small else 0.6) * args.replicas
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    requests = small_trace(args) if args.small else full_trace(args)
    ideal = ideal_cached_tokens(requests, args.page_size) / sum(r.num_prompt_tokens for r in requests)
    results = []
    for kind in args.routers.split(","):
        results.append(simulate(kind, requests, args))
        progress(f"{kind}: {results[-1]['wall_s']:.1f} s")
    print_table(results, ideal, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ideal_hit_rate": ideal, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
