"""How llguidance's mask fill for 64 rows scales over threads and over worker processes, on bench/constrained.py's
schemas over the Tekken vocabulary (131,072 ids). CPU only.

Each row walks random allowed tokens with a random generator of its own (row i: seed i; EOS only when nothing else
is allowed), so every layout below walks the same states and makes the same masks (checked: a digest of each
step's bitmask). Per step, ms: the mask fill of the 64 rows, and ("feed+masks") the feeding of each row's token
plus the fill, which is what a step waits for in a layout where the feed moves with the masks.

Layouts ("--layouts"):
- `1t`: one compiled template's copies, one `fill_next_token_bitmask_par` call on a 1-thread executor (what folio
  does for the rows of one grammar today).
- `Nt-shared`: one template's copies, one call on an N-thread executor.
- `Nt-own`: N threads, each owning a separately built LLTokenizer, its own compiled template, a 1-thread executor
  and 64/N rows (whether the threads contend when they share nothing that llguidance knows of).
- `Np`: N worker processes (spawned), each owning its own tokenizer, template and 64/N rows; a step sends each
  worker its rows' tokens through a pipe and the worker feeds them and writes its rows of the bitmask into shared
  memory.

    python bench/grammar_threads.py [--tokenizer bench/scratch/tekken_240911.json] [--steps 60]
                                    [--layouts 1t,4t-shared,4t-own,8t-own,4p,8p,12p] [--schemas bounded,free]
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import random
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory
from pathlib import Path

import llguidance
import llguidance.numpy as llnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import constrained  # noqa: E402  (bench/constrained.py: the schemas, the Tekken tokenizer)

from folio.constrain.base import bitmask_words  # noqa: E402
from folio.constrain.grammar import JsonSchemaFilter, _Vocabulary, vocabulary  # noqa: E402

ROWS = 64
EOS = 2
SCHEMAS = {"bounded": constrained.SCHEMA, "free": constrained.SCHEMA_FREE_STRINGS}


def pick(bitmask: np.ndarray, rngs: list[random.Random], vocab_size: int) -> list[int]:
    """Each row's next token: a random one its mask allows (its own generator), EOS only when nothing else is."""
    tokens = []
    for i, rng in enumerate(rngs):
        allowed = np.flatnonzero(np.unpackbits(bitmask[i].view(np.uint8), bitorder="little")[:vocab_size])
        if allowed.size > 1:
            allowed = allowed[allowed != EOS]
        tokens.append(int(allowed[rng.randrange(allowed.size)]))
    return tokens


def consume(rows: list, tokens: list[int]) -> None:
    for m, t in zip(rows, tokens):
        if m.try_consume_tokens([t]) != 1:
            raise RuntimeError(f"token {t}: its own mask allowed it, the matcher refused it")


def fill_ms(rows: list, threads: int, vocab_size: int, steps: int, warmup: int = 10) -> float:
    """Mean ms per step of one batched fill on a `threads` executor (rows walk their own random tokens)."""
    executor = llguidance.LLExecutor(num_threads=threads)
    bitmask = np.zeros((len(rows), bitmask_words(vocab_size)), dtype=np.int32)
    rngs = [random.Random(i) for i in range(len(rows))]
    total = 0.0
    for step in range(steps):
        start = time.perf_counter()
        llnp.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(rows)], bitmask)
        if step >= warmup:
            total += time.perf_counter() - start
        consume(rows, pick(bitmask, rngs, vocab_size))
    return 1e3 * total / (steps - warmup)


class InThreads:
    """`groups` lists of rows, each group's matchers filled by a 1-thread executor on a thread of its own."""

    def __init__(self, groups: list[list[tuple]]):
        self.groups = groups  # [(matcher, row)]
        self.executors = [llguidance.LLExecutor(num_threads=1) for _ in groups]
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(groups) - 1)) if len(groups) > 1 else None

    def reset(self) -> None:
        for group in self.groups:
            for m, _ in group:
                m.reset()

    def feed(self, tokens: list[int]) -> None:
        for group in self.groups:
            consume([m for m, _ in group], [tokens[i] for _, i in group])

    def fill(self, bitmask: np.ndarray) -> None:
        tasks = [self.pool.submit(llnp.fill_next_token_bitmask_par, ex, g, bitmask)
                 for ex, g in zip(self.executors[1:], self.groups[1:])]
        llnp.fill_next_token_bitmask_par(self.executors[0], self.groups[0], bitmask)
        for t in tasks:
            t.result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def _worker(conn, tokenizer_path: str, schema: dict, rows: list[int], shm_name: str, words: int) -> None:
    """(a worker process) Own matchers for `rows`; per message: feed the rows' tokens (None: the first step), fill
    their masks into the shared bitmask, answer with the seconds the fill took."""
    tokenizer = constrained.tekken_tokenizer(Path(tokenizer_path))
    lltok = _Vocabulary(tokenizer, tokenizer.vocab_size).lltok
    template = llguidance.LLMatcher(lltok, JsonSchemaFilter(schema).llguidance_grammar(), log_level=0)
    ms = [template.deep_copy() for _ in rows]
    shm = shared_memory.SharedMemory(name=shm_name)
    bitmask = np.ndarray((ROWS, words), dtype=np.int32, buffer=shm.buf)
    executor = llguidance.LLExecutor(num_threads=1)
    pairs = list(zip(ms, rows))
    conn.send("ready")
    while True:
        tokens = conn.recv()
        if tokens == "stop":
            break
        if tokens == "reset":
            for m in ms:
                m.reset()
            conn.send("reset")
            continue
        if tokens is not None:
            consume(ms, tokens)
        start = time.perf_counter()
        llnp.fill_next_token_bitmask_par(executor, pairs, bitmask)
        conn.send(time.perf_counter() - start)
    del bitmask
    shm.close()


class InProcesses:
    def __init__(self, n: int, tokenizer_path: str, schema: dict, words: int):
        self.shm = shared_memory.SharedMemory(create=True, size=ROWS * words * 4)
        self.bitmask = np.ndarray((ROWS, words), dtype=np.int32, buffer=self.shm.buf)
        self.rows = [list(range(k, ROWS, n)) for k in range(n)]
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rows in self.rows:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(child, tokenizer_path, schema, rows, self.shm.name, words),
                            daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            if c.recv() != "ready":
                raise RuntimeError("a worker did not start")
        self.tokens: list[int] | None = None

    def reset(self) -> None:
        self.tokens = None
        for c in self.conns:
            c.send("reset")
        for c in self.conns:
            c.recv()

    def feed(self, tokens: list[int]) -> None:
        self.tokens = tokens  # (sent with the next fill)

    def fill(self, bitmask: np.ndarray) -> None:
        for c, rows in zip(self.conns, self.rows):
            c.send(None if self.tokens is None else [self.tokens[i] for i in rows])
        for c in self.conns:
            c.recv()
        bitmask[:] = self.bitmask  # (the engine would copy from here to pinned memory too)

    def close(self) -> None:
        for c in self.conns:
            c.send("stop")
        for p in self.procs:
            p.join(timeout=10)
        del self.bitmask
        self.shm.close()
        self.shm.unlink()


def walk(layout, vocab_size: int, steps: int, warmup: int = 10) -> tuple[float, float, str]:
    """(mean masks ms/step, mean feed+masks ms/step, digest of every step's bitmask) over steps after warmup."""
    bitmask = np.zeros((ROWS, bitmask_words(vocab_size)), dtype=np.int32)
    rngs = [random.Random(i) for i in range(ROWS)]
    digest = hashlib.sha256()
    fill_s = both_s = 0.0
    tokens = None
    layout.reset()
    for step in range(steps):
        start = time.perf_counter()
        if tokens is not None:
            layout.feed(tokens)
        fed = time.perf_counter()
        layout.fill(bitmask)
        end = time.perf_counter()
        if step >= warmup:
            fill_s += end - fed
            both_s += end - start
        digest.update(bitmask.tobytes())
        tokens = pick(bitmask, rngs, vocab_size)
    if isinstance(layout, InProcesses):  # its feed is in the fill
        fill_s = float("nan")
    n = steps - warmup
    return 1e3 * fill_s / n, 1e3 * both_s / n, digest.hexdigest()[:12]


def make_layout(name: str, tokenizer, lltok, schema: dict, tokenizer_path: str, words: int):
    grammar = JsonSchemaFilter(schema).llguidance_grammar()
    if name == "1t":
        template = llguidance.LLMatcher(lltok, grammar, log_level=0)
        return InThreads([[(template.deep_copy(), i) for i in range(ROWS)]])
    n = int(re.match(r"\d+", name).group())
    if name.endswith("t-shared"):
        template = llguidance.LLMatcher(lltok, grammar, log_level=0)
        layout = InThreads([[(template.deep_copy(), i) for i in range(ROWS)]])
        layout.executors = [llguidance.LLExecutor(num_threads=n)]
        return layout
    if name.endswith("t-own"):
        groups = []
        for k in range(n):
            own = _Vocabulary(tokenizer, tokenizer.vocab_size).lltok  # a tokenizer of its own
            template = llguidance.LLMatcher(own, grammar, log_level=0)
            groups.append([(template.deep_copy(), i) for i in range(k, ROWS, n)])
        return InThreads(groups)
    if name.endswith("p"):
        return InProcesses(n, tokenizer_path, schema, words)
    raise ValueError(f"unknown layout {name!r}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", default=str(Path(__file__).resolve().parent / "scratch" / "tekken_240911.json"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layouts", default="1t,4t-shared,4t-own,8t-own,4p,8p,12p")
    parser.add_argument("--schemas", default="bounded,free")
    parser.add_argument("--reps", type=int, default=2, help="each layout's walk, this many times (alternating)")
    args = parser.parse_args()
    tokenizer = constrained.tekken_tokenizer(Path(args.tokenizer))
    vocab_size = tokenizer.vocab_size
    words = bitmask_words(vocab_size)
    lltok = vocabulary(tokenizer, vocab_size).lltok
    layouts = args.layouts.split(",")
    print(f"{os.cpu_count()} CPUs, {ROWS} rows, vocabulary {vocab_size}, {args.steps} steps (first 10 not timed)")
    print("| schema | layout | masks ms/step | feed+masks ms/step | reps (feed+masks) | digest |\n"
          "|---|---|---:|---:|---|---|", flush=True)
    for schema_name in args.schemas.split(","):
        schema = SCHEMAS[schema_name]
        built = {name: make_layout(name, tokenizer, lltok, schema, args.tokenizer, words) for name in layouts}
        results: dict[str, list] = {name: [] for name in layouts}
        for _ in range(args.reps):
            for name in layouts:
                results[name].append(walk(built[name], vocab_size, args.steps))
        digests = {r[2] for rs in results.values() for r in rs}
        for name in layouts:
            rs = results[name]
            fill = sorted(r[0] for r in rs)[len(rs) // 2]
            both = sorted(r[1] for r in rs)[len(rs) // 2]
            print(f"| {schema_name} | {name} | {fill:.2f} | {both:.2f} | " + ", ".join(f"{r[1]:.2f}" for r in rs)
                  + f" | {rs[0][2]} |", flush=True)
        print(f"masks {'identical' if len(digests) == 1 else 'DIFFER'} across layouts and reps", flush=True)
        for layout in built.values():
            layout.close()


if __name__ == "__main__":
    main()
