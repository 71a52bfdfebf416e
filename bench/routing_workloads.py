"""bench/routing_sim.py's traces: lists of Requests, arrival order, whose token ids do not depend on the page size
(`set_page_size` hashes them for one page size, in place, before a run).

    chat       multi-turn conversations over Zipf-popular shared prefixes (system prompts, documents); each turn
               resends the whole context (previous prompt + response + a new user message).
    templates  single-turn requests: one of `--prefixes` Zipf-popular templates + a unique user part + a response.
    hotspot    templates traffic, plus a burst window (the middle third of the trace by default) in which a share
               of the arrivals (half by default, at an elevated total rate) use ONE hot prefix (Request.hot).
    unshared   every prompt unique: no shared prefix at all.
    small      the CPU bench's 16 groups x 16 requests (a 4-page shared prefix + a unique suffix, interleaved).

Arrivals are Poisson. Rates (when not given) scale with the replicas: per replica, chat starts
`CHAT_CONVERSATIONS_PER_REPLICA` conversations a second, the others send `REQUESTS_PER_REPLICA[workload]`
requests a second, chosen so that a cache-blind router keeps the replicas' prefill engines roughly 40-70% busy.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field

import numpy as np

from folio.hashing import page_hashes
from folio.router.digest import page_keys

WORKLOADS = ("chat", "templates", "hotspot", "unshared")
VOCAB = 32_000
USER_TOKENS = (32, 256)  # a user message / unique request part, inclusive
RESPONSE_TOKENS = (64, 384)
CHAT_CONVERSATIONS_PER_REPLICA = 0.75  # conversations starting per second per replica (about 4 turns each)
REQUESTS_PER_REPLICA = {"templates": 3.0, "hotspot": 2.5, "unshared": 1.8}  # requests per second per replica
SMALL_REQUESTS_PER_REPLICA = 2.0


@dataclass(eq=False)
class Conversation:
    token_ids: np.ndarray  # the final context: prefix, then (user message, response) per turn
    hashes: list[bytes] = field(default_factory=list)  # page hashes of every full page, for the current page size
    keys: list[int] = field(default_factory=list)  # their router keys


@dataclass(eq=False)
class Request:
    arrival_s: float
    conv: Conversation
    num_prompt_tokens: int
    num_response_tokens: int
    hot: bool = False  # hotspot: uses the hot prefix


def zipf_weights(n: int, s: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** s
    return weights / weights.sum()


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, n).astype(np.int32)


def length(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def set_page_size(requests: list[Request], page_size: int) -> None:
    """Hash every conversation's full pages for `page_size` (replacing any other page size's hashes)."""
    for conv in {id(r.conv): r.conv for r in requests}.values():
        conv.hashes = page_hashes(conv.token_ids.tolist(), page_size)
        conv.keys = page_keys(conv.hashes)


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


def make_trace(workload: str, args: argparse.Namespace) -> list[Request]:
    if workload == "small":
        return small_trace(args)
    return {"chat": chat_trace, "templates": templates_trace, "hotspot": hotspot_trace,
            "unshared": unshared_trace}[workload](args)


def shared_prefixes(rng: np.random.Generator, args: argparse.Namespace) -> list[np.ndarray]:
    return [tokens(rng, length(rng, (args.min_prefix, args.max_prefix))) for _ in range(args.prefixes)]


def chat_trace(args: argparse.Namespace) -> list[Request]:
    """Conversations start as a Poisson stream and run their turns; turn k+1 arrives a think time after turn k
    could have finished. The first args.requests requests to arrive are kept (so the trace is a window of a
    steady stream, not a burst followed by conversations' tails)."""
    rng = np.random.default_rng(args.seed)
    rate = args.conversation_rate or CHAT_CONVERSATIONS_PER_REPLICA * args.replicas
    prefixes = shared_prefixes(rng, args)
    popularity = zipf_weights(args.prefixes, args.zipf)
    requests: list[Request] = []
    start_s = 0.0
    num_conversations = 0
    while num_conversations % 256 or sum(r.arrival_s <= start_s for r in requests) < args.requests:
        start_s += rng.exponential(1.0 / rate)
        num_conversations += 1
        num_turns = min(int(rng.geometric(1.0 / args.mean_turns)), args.max_turns)
        segments, turns = [], []
        context_len = 0
        arrival_s = start_s
        for _ in range(num_turns):
            user = tokens(rng, length(rng, USER_TOKENS))
            response = tokens(rng, length(rng, RESPONSE_TOKENS))
            segments += [user, response]
            context_len += len(user)
            turns.append((arrival_s, context_len, len(response)))
            context_len += len(response)
            arrival_s += len(response) * args.decode_step + 1.0 + rng.exponential(args.think_time)
        prefix = prefixes[rng.choice(args.prefixes, p=popularity)]
        conv = Conversation(np.concatenate([prefix, *segments]))
        requests += [Request(a, conv, len(prefix) + n, d) for a, n, d in turns]
        if num_conversations % 4096 == 0:
            progress(f"trace: {num_conversations} conversations")
    requests.sort(key=lambda r: r.arrival_s)
    return requests[:args.requests]


def single_turn(rng: np.random.Generator, arrival_s: float, prefix: np.ndarray, hot: bool = False) -> Request:
    user = tokens(rng, length(rng, USER_TOKENS))
    response = tokens(rng, length(rng, RESPONSE_TOKENS))
    conv = Conversation(np.concatenate([prefix, user, response]))
    return Request(arrival_s, conv, len(prefix) + len(user), len(response), hot)


def request_rate(workload: str, args: argparse.Namespace) -> float:
    return args.request_rate or REQUESTS_PER_REPLICA[workload] * args.replicas


def templates_trace(args: argparse.Namespace) -> list[Request]:
    """Single-turn requests: a Zipf-popular template, a unique user part, a response; Poisson arrivals."""
    rng = np.random.default_rng(args.seed)
    rate = request_rate("templates", args)
    prefixes = shared_prefixes(rng, args)
    choices = rng.choice(args.prefixes, size=args.requests, p=zipf_weights(args.prefixes, args.zipf))
    arrivals = np.cumsum(rng.exponential(1.0 / rate, args.requests))
    return [single_turn(rng, float(a), prefixes[c]) for a, c in zip(arrivals, choices)]


def burst_window(requests: list[Request], args: argparse.Namespace) -> tuple[float, float]:
    """The hotspot trace's burst window, in simulated seconds (from its hot requests)."""
    hot = [r.arrival_s for r in requests if r.hot]
    return (min(hot), max(hot)) if hot else (0.0, 0.0)


def hotspot_trace(args: argparse.Namespace) -> list[Request]:
    """Templates traffic at the base rate; during the burst window (the middle `args.burst_fraction` of the
    requests), the total rate is `args.burst_rate` x the base rate and `args.burst_share` of the arrivals use ONE
    hot prefix (a fresh one of max_prefix tokens, not among the templates)."""
    rng = np.random.default_rng(args.seed)
    base = request_rate("hotspot", args)
    prefixes = shared_prefixes(rng, args)
    popularity = zipf_weights(args.prefixes, args.zipf)
    hot_prefix = tokens(rng, args.max_prefix)
    num_burst = int(args.requests * args.burst_fraction)
    burst_start = (args.requests - num_burst) // 2
    requests = []
    arrival_s = 0.0
    for idx in range(args.requests):
        in_burst = burst_start <= idx < burst_start + num_burst
        arrival_s += rng.exponential(1.0 / (base * (args.burst_rate if in_burst else 1.0)))
        if in_burst and rng.random() < args.burst_share:
            requests.append(single_turn(rng, arrival_s, hot_prefix, hot=True))
        else:
            requests.append(single_turn(rng, arrival_s, prefixes[rng.choice(args.prefixes, p=popularity)]))
    return requests


def unshared_trace(args: argparse.Namespace) -> list[Request]:
    """Every prompt unique (as long as a template request: min_prefix..max_prefix random tokens + a user part);
    Poisson arrivals."""
    rng = np.random.default_rng(args.seed)
    rate = request_rate("unshared", args)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, args.requests))
    return [single_turn(rng, float(a), tokens(rng, length(rng, (args.min_prefix, args.max_prefix))))
            for a in arrivals]


def small_trace(args: argparse.Namespace, num_groups: int = 16, prefix_pages: int = 4) -> list[Request]:
    """The CPU bench's workload: num_groups groups of requests sharing a prefix_pages-page prefix (of
    args.page_size tokens: this trace alone depends on the page size), each with a unique suffix; requests
    interleaved across groups."""
    rng = np.random.default_rng(args.seed)
    rate = args.conversation_rate or SMALL_REQUESTS_PER_REPLICA * args.replicas
    per_group = math.ceil(args.requests / num_groups)
    prefixes = [rng.integers(0, VOCAB, prefix_pages * args.page_size) for _ in range(num_groups)]
    requests = []
    arrival_s = 0.0
    for idx in range(args.requests):
        group = idx % num_groups if idx < num_groups * per_group else rng.integers(num_groups)
        suffix = rng.integers(0, VOCAB, rng.integers(8, 33))
        response = rng.integers(0, VOCAB, 32)
        conv = Conversation(np.concatenate([prefixes[group], suffix, response]))
        requests.append(Request(arrival_s, conv, len(prefixes[group]) + len(suffix), len(response)))
        arrival_s += rng.exponential(1.0 / rate)
    return requests
