"""Routing at a scale no machine here holds: a discrete-event simulation of N replicas, each with a REAL
folio.cache.PagePool, fed synthetic traces (bench/routing_workloads.py), routed by the real folio.router code and
by models of the baselines.

    python bench/routing_sim.py                        # 4 workloads x page sizes 16, 256 x 5 routers, 64 replicas
    python bench/routing_sim.py --workloads chat,templates --page-sizes 256 --routers ours,ray-prefix
    python bench/routing_sim.py --replicas 4 --requests 256    # the CPU bench's workload: 16 groups x 16 requests
    python bench/routing_sim.py --decision-time --replicas 512 # our router's decision time, no simulation

Each (workload, page size) gets one table: hit rate, its share of the ideal (one infinite cache), the difference in
points of hit rate against ray-prefix (and, for ours-xN, against ours), requests per replica max/mean, TTFT
p50/p99; for hotspot also the load during the burst (per replica the time-averaged jobs, running + waiting, over the
burst window: max/mean) and how many replicas served the hot prefix. A summary of the issue's targets follows.
The trace's token ids are the same at every page size; only the hashes differ. The default cache is the same in
tokens at every page size (`--cache-tokens`, 131,072 per replica: 8,192 pages of 16, 512 of 256): it holds ~60
of the 512 shared prefixes, so a router that spreads a prefix everywhere keeps evicting.

Replica model: `--batch` job slots taken FIFO; then the replica's one prefill engine, FIFO, `--prefill-rate`
tokens/s. At its prefill start a job takes its pages from the pool: cached prefix pages acquired (so a job right
behind another with the same new prefix reuses what that one just computed, as the engine's in-flight sharing
would), the rest allocated up front (evicting LRU leaves; a job short of pages waits). After prefill it decodes its
response at `--decode-step` seconds per token. Its full pages (prompt after prefill, response at the end) are
registered with their real folio.hashing hashes; all are released at completion and stay cached until evicted.

Routers:
  ours            routing_sim_ours.OurRouter (the real folio.router code, fed reports built from each replica's
                  pool every `--report-period` simulated seconds, as Ray's request_routing_stats_period_s; the
                  pools log their stored/evicted events in these runs only, for it to drain). If it fails to
                  import or raises, its rows say so and the other routers run.
  ours-xN         N ingress routers: N independent OurRouters (seeds seed..seed+N-1) that all get every report;
                  request i is routed by router i mod N (each knows only what it routed itself).
  ray-prefix      a model of Ray's PrefixCacheAffinityRouter with its defaults: a tree of the prompts it routed
                  per replica (here at page granularity over token ids; Ray's is over characters, counted here as
                  `--chars-per-token` per token), told nothing of the engines' evictions; if the queue-length spread
                  exceeds imbalanced_threshold -> power of two; else the replicas at the longest match if the match
                  rate >= match_rate_threshold, else the replicas with the fewest routed characters; shortest
                  queue among those. With do_eviction, every eviction_interval_secs each replica whose tree holds
                  more than eviction_threshold_chars loses its least recently routed entries down to
                  eviction_target_chars (prefix_tree.py's evict_tenant_by_lru). Queue lengths are exact and
                  current (generous to it).
  ray-prefix-rec  the same model with the settings Ray's documentation shows (RAY_RECOMMENDED below).
  pow2            power of two choices on current queue length (Ray Serve's default router).
  ideal           the trace's bound: every prompt page that any earlier request computed is hit (one infinite
                  cache, routing irrelevant); always reported.

Ray's settings (ray-project/ray):
  defaults   imbalanced_threshold=inf, match_rate_threshold=0.1, do_eviction=False,
             eviction_threshold_chars=400_000, eviction_target_chars=360_000, eviction_interval_secs=10:
             initialize_state() in python/ray/llm/_internal/serve/routing_policies/prefix_aware/
             prefix_aware_router.py (commit 06c16f2f) and docs.ray.io/en/latest/serve/llm/user-guides/
             prefix-aware-routing.html ("default: infinity"). Before that, the same file under
             request_router/prefix_aware/ (commit ff32243d) had imbalanced_threshold=10 (also in
             doc/source/serve/llm/user-guides/prefix-aware-routing.md at 00c950af); `--ray-imbalanced-threshold
             10` models those releases.
  recommended  the docs recommend no values of their own ("Start conservative: Begin with default settings and
             tune incrementally"), so ray-prefix-rec takes the one example configuration they show:
             imbalanced_threshold=5, match_rate_threshold=0.15, do_eviction=True, eviction_threshold_chars=500_000,
             eviction_target_chars=400_000, eviction_interval_secs=30 (the deployment example of the Prefix-aware
             routing guide, docs.ray.io .../user-guides/prefix-aware-routing.html, and of
             doc/source/llm/doc_code/serve/prefix_aware_router/prefix_aware_example.py).

Decision time (`--decision-time`): no simulation; routing_sim_ours.build_decision_state(replicas, prefixes,
page_size, rng) builds our router's state for `--replicas` replicas holding `--decision-prefixes` cached prefixes,
time_decisions(state, prompts or a count) times `--decision-samples` decisions, time_event_apply(state, seconds or
events per replica) the applying of one report period of cache events (`--decision-events` per replica: by default
a busy replica's, 2 x prefill rate x period / page size); p50/p99 in microseconds, apply time in ms. With
`--decision-shared-holders N`, one more prefix (a common system prompt) is held by N replicas, and as many decisions
for prompts extending it are timed too.
"""

from __future__ import annotations

import argparse
import copy
import heapq
import json
import math
import random
import statistics
import time
import traceback
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field

import numpy as np

# bench/ is on sys.path when run as a script.
from routing_workloads import (
    WORKLOADS,
    Request,
    burst_window,
    ideal_cached_tokens,
    make_trace,
    progress,
    set_page_size,
)

# folio must be installed (`make setup`, or pip install -e .): router/ is importable only as folio.router.
from folio.cache import OutOfPages, PagePool

try:
    import routing_sim_ours
except Exception as exc:  # noqa: BLE001 - another engineer's file, rewritten concurrently: report, run the rest
    routing_sim_ours = None
    OURS_IMPORT_ERROR: Exception | None = exc
else:
    OURS_IMPORT_ERROR = None

DEFAULT_ROUTERS = "ours,ours-x4,ray-prefix,ray-prefix-rec,pow2"
DEFAULT_REQUESTS = {"chat": 20_000, "templates": 16_000, "hotspot": 16_000, "unshared": 10_000}
DEFAULT_CACHE_TOKENS = 131_072  # per replica: 2048 pages x 64 tokens, the original bench's cache

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
    it just computed, as the engine's in-flight sharing would give it), the rest allocated, evicting LRU leaves.
    `window` (start, end): integrate the job count over it (job_area). record_events: the pool logs its stored and
    evicted hashes (for a router fed with them; whoever reads them must drain them)."""

    def __init__(self, replica_id: int, args: argparse.Namespace, window: tuple[float, float] | None = None,
                 record_events: bool = False) -> None:
        self.replica_id = replica_id
        self.pool = PagePool(args.pages, args.page_size, record_events=record_events)
        self.page_size = args.page_size
        self.max_running = args.batch
        self.prefill_rate = args.prefill_rate
        self.waiting: deque[Job] = deque()  # no slot yet
        self.admitted: deque[Job] = deque()  # slot held, waiting for the prefill engine
        self.prefilling: Job | None = None
        self.num_running = 0  # slots held: admitted, prefilling or decoding
        self.num_requests = 0
        self.num_hot_requests = 0
        self.prefill_busy_s = 0.0
        self.window = window
        self.job_area = 0.0  # integral of num_jobs over the window
        self._changed_s = 0.0

    @property
    def num_jobs(self) -> int:
        return self.num_running + len(self.waiting)

    def account(self, now: float) -> None:
        """Call before num_jobs changes: adds the time since the last change, clipped to the window."""
        if self.window is not None:
            start, end = max(self._changed_s, self.window[0]), min(now, self.window[1])
            if end > start:
                self.job_area += self.num_jobs * (end - start)
        self._changed_s = now

    def num_prefill_tokens(self, now: float) -> int:
        """Prompt tokens not prefilled yet; a job not started counts less the leading pages its pool holds now or
        a job ahead of it will compute (as the engine's scheduler reports it:
        folio.scheduler.Scheduler.num_prefill_tokens)."""
        current = 0 if self.prefilling is None else (self.prefilling.prefill_end_s - now) * self.prefill_rate
        waiting = 0
        queued_ahead: set[bytes] = set()
        for queue in (self.admitted, self.waiting):
            for job in queue:
                req = job.req
                reusable = req.conv.hashes[:(req.num_prompt_tokens - 1) // self.page_size]
                found = self.pool.lookup(reusable)
                num_reused = found.num_ready + found.num_pending
                while num_reused < len(reusable) and reusable[num_reused] in queued_ahead:
                    num_reused += 1
                queued_ahead.update(req.conv.hashes[num_reused:req.num_prompt_tokens // self.page_size])
                waiting += req.num_prompt_tokens - num_reused * self.page_size
        return int(max(0.0, current)) + waiting

    def arrive(self, job: Job, now: float) -> None:
        self.account(now)
        self.num_requests += 1
        self.num_hot_requests += job.req.hot
        self.waiting.append(job)

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
        first, end = job.num_cached_pages, num_tokens // size
        if end <= first:
            return
        token_ids = conv.token_ids[first * size:end * size].tolist()  # one conversion, not one per page
        hashes, page_ids, set_ready = conv.hashes, job.page_ids, self.pool.set_ready
        for page_idx in range(first, end):
            offset = (page_idx - first) * size
            set_ready(page_ids[page_idx], hashes[page_idx], hashes[page_idx - 1] if page_idx else None,
                      token_ids[offset:offset + size])
        job.num_cached_pages = end

    def finish(self, job: Job) -> None:
        """The job's last token is out (call account(now) first: the job count drops)."""
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


@dataclass(frozen=True)
class RaySettings:
    """PrefixCacheAffinityRouter's request_router_kwargs (see the module docstring for the sources)."""

    imbalanced_threshold: float = float("inf")
    match_rate_threshold: float = 0.1
    do_eviction: bool = False
    eviction_threshold_chars: int = 400_000
    eviction_target_chars: int = 360_000
    eviction_interval_secs: float = 10.0


RAY_DEFAULTS = RaySettings()
RAY_RECOMMENDED = RaySettings(imbalanced_threshold=5, match_rate_threshold=0.15, do_eviction=True,
                              eviction_threshold_chars=500_000, eviction_target_chars=400_000,
                              eviction_interval_secs=30.0)


class RayPrefixRouter(Pow2Router):
    """Model of PrefixCacheAffinityRouter's policy (see the module docstring). Its tree is one dict: a page key
    names the page's whole prefix, so it is a tree node; the value is the replicas routed a prompt through it.
    With eviction, each replica's nodes also sit in an LRU (key -> last routed time), as the tree's per-tenant
    LRU list."""

    name = "ray-prefix"

    def __init__(self, replicas: list[SimReplica], args: argparse.Namespace, settings: RaySettings) -> None:
        super().__init__(replicas, args)
        self.page_size = args.page_size
        self.settings = settings
        self.chars_per_token = args.chars_per_token
        self.tenants: dict[int, set[int]] = {}
        self.num_routed_tokens = [0] * len(replicas)
        self.lru: list[OrderedDict[int, float]] = [OrderedDict() for _ in replicas]
        self.next_eviction_s = settings.eviction_interval_secs
        self.modes = {"imbalanced": 0, "match": 0, "smallest": 0}  # decisions by branch taken

    def route(self, req: Request, now: float) -> int:
        fallback = super().route(req, now)
        if self.settings.imbalanced_threshold != float("inf"):
            jobs = [r.num_jobs for r in self.replicas]
            if max(jobs) - min(jobs) > self.settings.imbalanced_threshold:
                self.modes["imbalanced"] += 1
                return fallback
        keys = req.conv.keys[:req.num_prompt_tokens // self.page_size]
        depth = 0
        while depth < len(keys) and self.tenants.get(keys[depth]):
            depth += 1
        if depth * self.page_size / req.num_prompt_tokens < self.settings.match_rate_threshold:
            self.modes["smallest"] += 1
            fewest = min(self.num_routed_tokens)
            chosen = [r for r, n in enumerate(self.num_routed_tokens) if n == fewest]
        else:
            self.modes["match"] += 1
            chosen = sorted(self.tenants[keys[depth - 1]])
        replica = pick_shortest(chosen, self.replicas, self.rng)
        lru = self.lru[replica] if self.settings.do_eviction else None
        for key in keys:  # on_request_routed: insert the prompt
            holders = self.tenants.setdefault(key, set())
            if replica not in holders:
                holders.add(replica)
                self.num_routed_tokens[replica] += self.page_size
            if lru is not None:
                lru[key] = now
                lru.move_to_end(key)
        return replica

    def tick(self, now: float) -> None:
        if not self.settings.do_eviction or now < self.next_eviction_s:
            return
        self.next_eviction_s += self.settings.eviction_interval_secs
        threshold = self.settings.eviction_threshold_chars / self.chars_per_token
        target = self.settings.eviction_target_chars / self.chars_per_token
        for replica, lru in enumerate(self.lru):
            if self.num_routed_tokens[replica] <= threshold:
                continue
            excess = self.num_routed_tokens[replica] - target
            removed = 0
            while lru and removed < excess:  # whole groups of one timestamp, oldest first (evict_tenant_by_lru)
                oldest = next(iter(lru.values()))
                while lru and next(iter(lru.values())) == oldest:
                    key, _ = lru.popitem(last=False)
                    holders = self.tenants[key]
                    holders.discard(replica)
                    if not holders:
                        del self.tenants[key]
                    removed += self.page_size
            self.num_routed_tokens[replica] -= removed


class MultiIngress:
    """N ingress routers: N OurRouter instances (seeds seed..seed+N-1); every report reaches all of them, request
    i is routed by instance i mod N."""

    def __init__(self, replicas: list[SimReplica], args: argparse.Namespace, clock, num_routers: int) -> None:
        self.routers = []
        for idx in range(num_routers):
            router_args = copy.copy(args)
            router_args.seed = args.seed + idx
            self.routers.append(routing_sim_ours.OurRouter(replicas, router_args, clock))
        self.num_routed = 0

    @property
    def digest_bytes(self) -> int:
        return max(getattr(r, "digest_bytes", 0) for r in self.routers)

    def key_events_per_replica_s(self) -> float:
        return self.routers[0].key_events_per_replica_s()

    def route(self, req: Request, now: float) -> int:
        router = self.routers[self.num_routed % len(self.routers)]
        self.num_routed += 1
        return router.route(req, now)

    def tick(self, now: float) -> None:
        for router in self.routers:
            router.tick(now)


def make_router(kind: str, replicas: list[SimReplica], args: argparse.Namespace, clock):
    if kind == "pow2":
        return Pow2Router(replicas, args)
    if kind == "ray-prefix":
        threshold = args.ray_imbalanced_threshold
        settings = RAY_DEFAULTS if threshold is None else RaySettings(imbalanced_threshold=threshold)
        return RayPrefixRouter(replicas, args, settings)
    if kind == "ray-prefix-rec":
        return RayPrefixRouter(replicas, args, RAY_RECOMMENDED)
    if kind == "ours" or kind.startswith("ours-x"):
        if routing_sim_ours is None:
            raise RuntimeError(f"routing_sim_ours does not import: {OURS_IMPORT_ERROR!r}")
        if kind == "ours":
            return routing_sim_ours.OurRouter(replicas, args, clock)
        return MultiIngress(replicas, args, clock, int(kind[len("ours-x"):]))
    raise ValueError(f"unknown router {kind!r}")


# ---- the simulation ---------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(kind: str, requests: list[Request], args: argparse.Namespace,
             window: tuple[float, float] | None = None) -> dict:
    clock = Clock()
    record_events = kind.startswith("ours")  # our router is fed the pools' events; the others read none
    replicas = [SimReplica(r, args, window, record_events) for r in range(args.replicas)]
    router = make_router(kind, replicas, args, clock)
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
            replica.arrive(Job(payload, replica.replica_id), now)
        elif what == "prefilled":
            replica = replicas[payload.replica]
            replica.prefilled(payload)
            push(now + payload.req.num_response_tokens * args.decode_step, "finished", payload)
        else:  # "finished"
            replica = replicas[payload.replica]
            replica.account(now)
            replica.finish(payload)
            done += 1
            if done % 4000 == 0:
                progress(f"  {kind}: {done}/{len(requests)} requests done, {time.perf_counter() - wall_start:.0f} s")
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
    if window is not None and window[1] > window[0]:
        for replica in replicas:
            replica.account(window[1])
        load = [r.job_area / (window[1] - window[0]) for r in replicas]
        result.update(burst_load_max=max(load), burst_load_mean=sum(load) / len(load),
                      burst_load_ratio=max(load) / max(sum(load) / len(load), 1e-9),
                      hot_replicas=sum(r.num_hot_requests > 0 for r in replicas),
                      hot_requests_max=max(r.num_hot_requests for r in replicas))
    if getattr(router, "digest_bytes", None) is not None:
        result["digest_bytes_max"] = router.digest_bytes
    if hasattr(router, "key_events_per_replica_s"):
        result["key_events_per_replica_s"] = router.key_events_per_replica_s()
    if isinstance(router, RayPrefixRouter):
        result["ray_decisions"] = dict(router.modes)
    ours = getattr(router, "routers", [router])
    if all(hasattr(r, "num_past_holder") for r in ours):
        result["past_holder"] = sum(r.num_past_holder for r in ours)
        result["past_holder_tokens"] = sum(r.tokens_past_holder for r in ours)
    return result


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# ---- the matrix, the report -------------------------------------------------------------------------------------


def run_args_for(args: argparse.Namespace, workload: str, page_size: int) -> argparse.Namespace:
    run_args = copy.copy(args)
    run_args.workload, run_args.page_size = workload, page_size
    run_args.requests = args.requests or DEFAULT_REQUESTS.get(workload, 256)
    run_args.pages = args.pages or (64 if workload == "small" else args.cache_tokens // page_size)
    return run_args


def run_matrix(args: argparse.Namespace) -> list[dict]:
    tables = []
    for workload in args.workload_list:
        requests = None
        for page_size in args.page_size_list:
            run_args = run_args_for(args, workload, page_size)
            if requests is None or workload == "small":  # one trace for every page size (small's depends on it)
                started = time.perf_counter()
                requests = make_trace(workload, run_args)
                progress(f"{workload}: {len(requests)} requests over {requests[-1].arrival_s:.0f} s "
                         f"({time.perf_counter() - started:.1f} s to generate)")
            started = time.perf_counter()
            set_page_size(requests, page_size)
            prompt_tokens = sum(r.num_prompt_tokens for r in requests)
            ideal = ideal_cached_tokens(requests, page_size) / prompt_tokens
            window = burst_window(requests, run_args) if workload == "hotspot" else None
            progress(f"{workload} @ page {page_size}: hashed in {time.perf_counter() - started:.1f} s, "
                     f"ideal hit rate {ideal:.1%}")
            results = []
            for kind in args.router_list:
                if kind == "ideal":
                    continue
                progress(f"{workload} @ page {page_size}: {kind} ...")
                try:
                    results.append(simulate(kind, requests, run_args, window))
                    progress(f"{workload} @ page {page_size}: {kind} {results[-1]['wall_s']:.1f} s")
                except Exception as exc:  # noqa: BLE001 - report it, run the other routers
                    message = f"{type(exc).__name__}: {exc}"
                    progress(f"{workload} @ page {page_size}: {kind} FAILED: {message}\n{traceback.format_exc()}")
                    results.append({"router": kind, "error": message})
            table = {"workload": workload, "page_size": page_size, "pages": run_args.pages,
                     "replicas": args.replicas, "requests": len(requests), "span_s": requests[-1].arrival_s,
                     "ideal_hit_rate": ideal, "burst_window_s": window, "results": results}
            print_table(table, run_args)
            tables.append(table)
        del requests
    return tables


def by_router(table: dict) -> dict[str, dict]:
    return {r["router"]: r for r in table["results"] if "error" not in r}


def print_table(table: dict, args: argparse.Namespace) -> None:
    ideal, rows = table["ideal_hit_rate"], by_router(table)
    hot = table["workload"] == "hotspot"
    print(f"\n{table['workload']} @ page size {table['page_size']}: {table['replicas']} replicas x {table['pages']} "
          f"pages, {table['requests']} requests over {table['span_s']:.0f} s, reports every "
          f"{args.report_period:g} s"
          + (f", burst {table['burst_window_s'][0]:.0f}-{table['burst_window_s'][1]:.0f} s" if hot else ""))
    header = (f"{'router':<15}{'hit':>7}{'/ideal':>8}{'vs ray':>8}{'vs ours':>8}{'req/replica':>14}"
              f"{'TTFT p50/p99 (s)':>18}{'prefill busy':>13}" + (f"{'burst load':>12}{'hot on':>7}" if hot else ""))
    print(header)
    print("-" * len(header))
    ray, ours = rows.get("ray-prefix"), rows.get("ours")
    for r in table["results"]:
        if "error" in r:
            print(f"{r['router']:<15}FAILED: {r['error'][:len(header) - 23]}")
            continue
        vs_ray = f"{(r['hit_rate'] - ray['hit_rate']) * 100:+.1f}" if ray and r is not ray else ""
        multi = ours and r["router"].startswith("ours-x")
        vs_ours = f"{(r['hit_rate'] - ours['hit_rate']) * 100:+.1f}" if multi else ""
        share = f"{r['hit_rate'] / ideal:.1%}" if ideal else "-"
        line = (f"{r['router']:<15}{r['hit_rate']:>7.1%}{share:>8}{vs_ray:>8}{vs_ours:>8}"
                f"{r['requests_max']:>7}/{r['requests_mean']:<6.1f}{r['ttft_p50_s']:>9.3f}/{r['ttft_p99_s']:<8.3f}"
                f"{r['prefill_util_max']:>6.0%}/{r['prefill_util_mean']:<6.0%}")
        if hot:
            line += f"{r['burst_load_max']:>6.1f}/{r['burst_load_ratio']:<5.2f}{r['hot_replicas']:>7}"
        print(line)
    print(f"{'ideal':<15}{ideal:>7.1%}{'100%' if ideal else '-':>8}")
    if hot:
        print("burst load: max over replicas of the time-averaged jobs (running + waiting) in the burst / max:mean; "
              "hot on: replicas that served the hot prefix")
    for kind, r in rows.items():
        if "ray_decisions" in r:
            modes, total = r["ray_decisions"], max(1, sum(r["ray_decisions"].values()))
            print(f"{kind}: decisions by queue spread > imbalanced_threshold (power of two) "
                  f"{modes['imbalanced'] / total:.0%}, by longest match {modes['match'] / total:.0%}, "
                  f"to the fewest routed characters {modes['smallest'] / total:.0%}")
        if "past_holder" in r:
            print(f"{kind}: {r['past_holder']:,} requests sent past a replica holding more of their prompt "
                  f"({r['past_holder_tokens']:,} tokens computed again by choice, of {r['prefilled_tokens']:,} "
                  "prefilled)")
    digest = max((r.get("digest_bytes_max", 0) for r in rows.values()), default=0)
    if digest:
        rate = max((r.get("key_events_per_replica_s", 0) for r in rows.values()), default=0)
        print(f"largest digest: {digest:,} bytes of JSON; routing-key events: {rate:.1f} per replica-second")


def targets(tables: list[dict]) -> list[dict]:
    """The issue's targets, for the rows available: (target, workload, page size, value, PASS/MISS)."""
    checks = []

    def check(name: str, table: dict, value: str, ok: bool) -> None:
        checks.append({"target": name, "workload": table["workload"], "page_size": table["page_size"],
                       "value": value, "result": "PASS" if ok else "MISS"})

    for table in tables:
        rows, workload = by_router(table), table["workload"]
        ours = rows.get("ours")
        if ours is None:
            continue
        ideal = table["ideal_hit_rate"]
        if workload in ("chat", "templates"):
            share = ours["hit_rate"] / max(ideal, 1e-9)
            check(">= 95% of the infinite-cache bound", table, f"{share:.1%}", share >= 0.95)
        for ray_kind in ("ray-prefix", "ray-prefix-rec"):
            if ray_kind in rows:
                gap = (ours["hit_rate"] - rows[ray_kind]["hit_rate"]) * 100
                check(f"hit rate >= {ray_kind} - 1 point", table, f"{gap:+.1f} points", gap >= -1.0)
        if workload == "hotspot" and "burst_load_ratio" in ours:
            ratio = ours["burst_load_ratio"]
            check("hot-spot burst load max/mean <= 1.3", table, f"{ratio:.2f}", ratio <= 1.3)
        if workload == "unshared" and "pow2" in rows:
            mine, theirs = ours["ttft_p99_s"], rows["pow2"]["ttft_p99_s"]
            check("unshared TTFT p99 <= pow2's", table, f"{mine:.3f} vs {theirs:.3f} s", mine <= theirs)
        for kind, row in rows.items():
            if kind.startswith("ours-x"):
                gap = (row["hit_rate"] - ours["hit_rate"]) * 100
                check(f"{kind} hit rate within 2 points of ours", table, f"{gap:+.1f} points", gap >= -2.0)
    return checks


def print_targets(checks: list[dict], tables: list[dict]) -> None:
    print("\nTargets (ours at its default settings):")
    for c in checks:
        print(f"  {c['result']:<5}{c['target']:<45}{c['workload']:>10} @ {c['page_size']:<4} {c['value']}")
    failed = [(t["workload"], t["page_size"], r["router"]) for t in tables for r in t["results"] if "error" in r]
    for workload, page_size, kind in failed:
        print(f"  ----  {kind} failed on {workload} @ {page_size}: its targets are not checked")
    if not checks and not failed:
        print("  (none available: run ours)")


# ---- decision time ----------------------------------------------------------------------------------------------


def decision_time(args: argparse.Namespace) -> dict:
    """Our router's per-request decision time at `--replicas` replicas holding `--decision-prefixes` cached
    prefixes, and the time to apply one report period's cache events (routing_sim_ours's functions: the state is
    theirs, so are the prompts' contents when time_decisions takes a count; see `_second_argument`)."""
    needed = ("build_decision_state", "time_decisions", "time_event_apply")
    missing = [name for name in needed if routing_sim_ours is None or not hasattr(routing_sim_ours, name)]
    if missing:
        why = f"does not import: {OURS_IMPORT_ERROR!r}" if routing_sim_ours is None else f"lacks {', '.join(missing)}"
        print(f"decision time: not implemented (routing_sim_ours {why})")
        return {"error": "not implemented", "missing": missing}
    results = {}
    for page_size in args.page_size_list:
        rng = random.Random(args.seed)
        # A busy replica's routing-key events in one period: its prefill engine flat out on prompts sharing nothing,
        # each prompt's keys stored and as many evicted.
        events = args.decision_events or routing_sim_ours.busy_replica_key_events(
            page_size, args.prefill_rate * args.report_period, (args.min_prefix + args.max_prefix) // 2)
        started = time.perf_counter()
        try:
            state = routing_sim_ours.build_decision_state(args.replicas, args.decision_prefixes, page_size, rng,
                                                          args.decision_shared_holders)
            built_s = time.perf_counter() - started
            seconds = [s * 1e6 for s in routing_sim_ours.time_decisions(state, args.decision_samples)]
            shared = [s * 1e6 for s in routing_sim_ours.time_decisions(state, args.decision_samples, shared=True)] \
                if args.decision_shared_holders else []
            # Reports carry a replica's last batches: time the rounds once that history is full.
            rounds = [routing_sim_ours.time_event_apply(state, events) for _ in range(20)]
            apply_ms = statistics.median(rounds[-4:]) * 1e3
        except Exception as exc:  # noqa: BLE001
            print(f"decision time @ page {page_size}: FAILED: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            results[page_size] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        results[page_size] = {"decision_p50_us": percentile(seconds, 50), "decision_p99_us": percentile(seconds, 99),
                              "event_apply_ms": apply_ms, "events_per_replica": events, "build_s": built_s,
                              "samples": len(seconds)}
        row = results[page_size]
        print(f"decision time @ page {page_size}: {args.replicas} replicas, {args.decision_prefixes:,} cached "
              f"prefixes: p50 {row['decision_p50_us']:.0f} us, p99 {row['decision_p99_us']:.0f} us "
              f"({len(seconds)} decisions); applying one report period of events ({events} per replica): "
              f"{apply_ms:.1f} ms (state built in {built_s:.1f} s)")
        if shared:
            row["shared_p50_us"], row["shared_p99_us"] = percentile(shared, 50), percentile(shared, 99)
            print(f"decision time @ page {page_size}, prompts extending one prefix held by "
                  f"{args.decision_shared_holders} replicas: p50 {row['shared_p50_us']:.0f} us, "
                  f"p99 {row['shared_p99_us']:.0f} us ({len(shared)} decisions)")
    return results


# ---- command line -----------------------------------------------------------------------------------------------


def csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--replicas", type=int, default=64)
    add("--requests", type=int, default=None,
        help=f"requests per trace (default per workload: {DEFAULT_REQUESTS}; <= 256 with no workload named "
        "implies --small)")
    add("--workload", default=None, choices=WORKLOADS, help="one workload (same as --workloads NAME)")
    add("--workloads", default=None, help="comma-separated, of: " + ", ".join(WORKLOADS) + " (default: all)")
    add("--routers", default=DEFAULT_ROUTERS,
        help="comma-separated: ours, ours-xN (N ingress routers), ray-prefix, ray-prefix-rec, pow2, ideal")
    add("--small", action="store_true", help="the CPU bench's 16 groups x 16 requests workload "
        "(implied by --requests <= 256; page size 64, 64 pages unless given)")
    add("--seed", type=int, default=0)
    add("--page-sizes", default=None, help="comma-separated page sizes (default: 16,256; 64 in the small mode)")
    add("--page-size", type=int, default=None, help="one page size (same as --page-sizes N)")
    add("--cache-tokens", type=int, default=DEFAULT_CACHE_TOKENS,
        help="KV cache per replica, in tokens (pages = cache_tokens // page size)")
    add("--pages", type=int, default=None, help="pages per replica at every page size (overrides --cache-tokens; "
        "default 64 in the small mode)")
    add("--batch", type=int, default=32, help="job slots per replica")
    add("--prefill-rate", type=float, default=8_000.0, help="prompt tokens a replica prefills per second")
    add("--decode-step", type=float, default=0.03, help="seconds per generated token")
    add("--conversation-rate", type=float, default=None,
        help="chat: conversations (small mode: requests) starting per second (default: scaled to the replicas)")
    add("--request-rate", type=float, default=None,
        help="templates, hotspot (base), unshared: requests per second (default: scaled to the replicas)")
    add("--prefixes", type=int, default=512, help="shared prefixes (system prompts, documents, templates)")
    add("--zipf", type=float, default=1.1, help="Zipf exponent of prefix popularity")
    add("--min-prefix", type=int, default=256)
    add("--max-prefix", type=int, default=4096)
    add("--mean-turns", type=float, default=4.0)
    add("--max-turns", type=int, default=16)
    add("--think-time", type=float, default=5.0, help="mean seconds between a response and the next turn")
    add("--burst-fraction", type=float, default=1 / 3, help="hotspot: share of the trace's requests in the burst")
    add("--burst-share", type=float, default=0.5, help="hotspot: share of the burst's arrivals on the hot prefix")
    add("--burst-rate", type=float, default=1.5, help="hotspot: total arrival rate in the burst / the base rate")
    add("--report-period", type=float, default=1.0, help="seconds between a replica's reports")
    add("--ray-imbalanced-threshold", type=float, default=None,
        help="ray-prefix's imbalanced_threshold (default: Ray's, inf; 10 in releases before the change)")
    add("--chars-per-token", type=float, default=4.0, help="ray models: characters per token of text")
    add("--decision-time", action="store_true", help="measure our router's decision time instead of simulating")
    add("--decision-prefixes", type=int, default=100_000, help="--decision-time: cached prefixes in all")
    add("--decision-shared-holders", type=int, default=0,
        help="--decision-time: also time prompts extending one prefix held by this many replicas (a system prompt)")
    add("--decision-samples", type=int, default=2_000, help="--decision-time: decisions timed")
    add("--decision-events", type=int, default=None, help="--decision-time: cache events per replica in one "
        "report period (default: a busy replica's, 2 x prefill rate x period / page size)")
    add("--json", help="also write the results here")
    args = parser.parse_args(argv)
    chosen = [args.workload] if args.workload else csv(args.workloads or "")
    args.small = args.small or (not chosen and args.requests is not None and args.requests <= 256)
    args.workload_list = ["small"] if args.small else (chosen or list(WORKLOADS))
    for workload in args.workload_list:
        if workload not in WORKLOADS + ("small",):
            parser.error(f"unknown workload {workload!r}")
    if args.page_size is not None:
        args.page_size_list = [args.page_size]
    else:
        args.page_size_list = [int(p) for p in csv(args.page_sizes or ("64" if args.small else "16,256"))]
    args.router_list = csv(args.routers)
    for kind in args.router_list:
        if kind not in ("ours", "ray-prefix", "ray-prefix-rec", "pow2", "ideal") and not (
                kind.startswith("ours-x") and kind[len("ours-x"):].isdigit()):
            parser.error(f"unknown router {kind!r}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if OURS_IMPORT_ERROR is not None:
        progress(f"WARNING: routing_sim_ours does not import ({OURS_IMPORT_ERROR!r}): ours rows will fail")
    output: dict = {"args": {k: v for k, v in vars(args).items()}, "ray_defaults": asdict(RAY_DEFAULTS),
                    "ray_recommended": asdict(RAY_RECOMMENDED)}
    started = time.perf_counter()
    if args.decision_time:
        output["decision_time"] = decision_time(args)
    else:
        output["tables"] = run_matrix(args)
        output["targets"] = targets(output["tables"])
        print_targets(output["targets"], output["tables"])
    output["wall_s"] = time.perf_counter() - started
    progress(f"total {output['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(output, f, indent=2, default=str)


if __name__ == "__main__":
    main()
