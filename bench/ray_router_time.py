"""Per-request cost of the Ray Serve router (folio.router.ray_router) at many replicas, against the policy alone.

    python bench/ray_router_time.py                    # 64 and 512 replicas
    python bench/ray_router_time.py --replicas 512 --requests 2000

No cluster: PrefixAwareRequestRouter is driven as Serve drives it (update_replicas with every replica's routing
report, then choose_replicas per request), over replica stand-ins that carry what a router reads of Serve's
RunningReplica (replica_id, routing_stats, max_ongoing_requests). Each replica reports a real digest
(folio.router.digest, its cache events through folio.router.events); Serve's queue-length cache holds a count for
every replica, as under load. Prompts of --prompt-pages pages of 16 tokens extend one of --prefixes prefixes held
by one replica each.

Printed per fleet size, p50 / p99 in microseconds:
  choose_replicas   the router's whole call: the prompt's page hashes, the policy's decision, the ranking of every
                    candidate that Serve takes (one replica per rank) and the bookkeeping of the request
  prompt_keys       the page hashes alone (the ingress hashes a prompt once)
  policy.choose     the decision alone, keys given (what bench/routing_sim.py --decision-time times)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from types import SimpleNamespace

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from folio.cache import PageEvent, PageEventKind
from folio.hashing import page_hashes
from folio.router.digest import build_digest
from folio.router.events import CacheEvents
from folio.router.ray_router import PrefixAwareRequestRouter

PAGE_SIZE = 16
DEPLOYMENT = DeploymentID(name="Generator", app_name="bench")


class Replica:
    """What the router reads of a RunningReplica."""

    def __init__(self, index: int) -> None:
        self.replica_id = ReplicaID(f"r{index}", DEPLOYMENT)
        self.max_ongoing_requests = 64
        self.routing_stats: dict = {}
        self.events = CacheEvents(PAGE_SIZE)
        self.pool = SimpleNamespace(page_size=PAGE_SIZE, num_pages=8192, num_free=1024, num_allocatable=4096)

    def report(self, running: int, epoch: int) -> None:
        self.routing_stats = build_digest(self.pool, self.events, running, 0, epoch, instance_id="i", max_running=32)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


class Request:
    def __init__(self, input_ids: list[int]) -> None:
        self.input_ids = tuple(input_ids)


def pending(token_ids: list[int], number: int) -> PendingRequest:
    request_id = f"req-{number}"
    return PendingRequest(args=[Request(token_ids)], kwargs={},
                          metadata=RequestMetadata(request_id=request_id, internal_request_id=request_id))


def percentiles(seconds: list[float]) -> tuple[float, float]:
    ordered = sorted(seconds)
    return statistics.median(ordered) * 1e6, ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6


async def measure(num_replicas: int, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    replicas = [Replica(i) for i in range(num_replicas)]
    prefixes = [[rng.randrange(50, 950) for _ in range(args.prompt_pages * PAGE_SIZE)] for _ in range(args.prefixes)]
    for prefix in prefixes:
        holder = rng.choice(replicas)
        holder.events.add([PageEvent(PageEventKind.STORED, h, depth)
                           for depth, h in enumerate(page_hashes(prefix, PAGE_SIZE))])
    for replica in replicas:
        replica.report(rng.randrange(16), 1)
    router = PrefixAwareRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
                                      use_replica_queue_len_cache=True)
    router.initialize_state(default_page_size=PAGE_SIZE)
    router.update_replicas(replicas)
    for replica in replicas:
        router.replica_queue_len_cache.update(replica.replica_id, rng.randrange(16))
    policy = router.policy
    ids = [r.replica_id for r in replicas]
    prompts = [rng.choice(prefixes) + [rng.randrange(50, 950) for _ in range(rng.randrange(1, 64))]
               for _ in range(args.requests)]
    keys = [policy.prompt_keys(p) for p in prompts]
    times: dict[str, list[float]] = {"choose_replicas": [], "prompt_keys": [], "policy.choose": []}
    for number, (prompt, prompt_keys) in enumerate(zip(prompts, keys)):
        start = time.perf_counter()
        await router.choose_replicas(replicas, pending(prompt, number))
        times["choose_replicas"].append(time.perf_counter() - start)
        start = time.perf_counter()
        policy.prompt_keys(prompt)
        times["prompt_keys"].append(time.perf_counter() - start)
        start = time.perf_counter()
        policy.choose(ids, keys=prompt_keys, num_prompt_tokens=len(prompt))
        times["policy.choose"].append(time.perf_counter() - start)
    return {name: dict(zip(("p50_us", "p99_us"), percentiles(values))) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", default="64,512", help="fleet sizes, comma-separated")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--prefixes", type=int, default=200)
    parser.add_argument("--prompt-pages", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    results = {}
    for num_replicas in (int(n) for n in args.replicas.split(",")):
        results[num_replicas] = row = asyncio.run(measure(num_replicas, args))
        print(f"{num_replicas} replicas, {args.requests} requests: " + "; ".join(
            f"{name} p50 {r['p50_us']:.0f} / p99 {r['p99_us']:.0f} us" for name, r in row.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
