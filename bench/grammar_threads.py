"""How llguidance's batched mask fill scales with threads, on bench/constrained.py's schemas over the Tekken
vocabulary (131,072 ids): 64 rows walking random allowed tokens, the masks of each step filled in one
`fill_next_token_bitmask_par` call, for rows that are copies of one compiled template ("shared", what folio's
grammar cache hands out), separately compiled grammars ("separate") and four templates' copies ("four"), at 1, 4
and 12 executor threads. CPU only.

    python bench/grammar_threads.py [--tokenizer bench/scratch/tekken_240911.json] [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import llguidance
import llguidance.numpy as llnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import constrained  # noqa: E402  (bench/constrained.py: the schemas, the Tekken tokenizer)

from folio.constrain.base import bitmask_words  # noqa: E402
from folio.constrain.grammar import JsonSchemaFilter, vocabulary  # noqa: E402

ROWS = 64
EOS = 2


def matchers(kind: str, lltok, grammar: str) -> list:
    if kind == "shared":
        template = llguidance.LLMatcher(lltok, grammar, log_level=0)
        return [template.deep_copy() for _ in range(ROWS)]
    if kind == "separate":
        return [llguidance.LLMatcher(lltok, grammar, log_level=0) for _ in range(ROWS)]
    templates = [llguidance.LLMatcher(lltok, grammar, log_level=0) for _ in range(4)]
    return [templates[i % 4].deep_copy() for i in range(ROWS)]


def fill_ms(rows: list, threads: int, vocab_size: int, steps: int, warmup: int = 10) -> float:
    """Mean ms per step of the batched fill over steps after `warmup`; each row then takes a random allowed token
    (EOS only when nothing else is allowed)."""
    executor = llguidance.LLExecutor(num_threads=threads)
    bitmask = np.zeros((ROWS, bitmask_words(vocab_size)), dtype=np.int32)
    rng = random.Random(0)
    total = 0.0
    for step in range(steps):
        start = time.perf_counter()
        llnp.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(rows)], bitmask)
        if step >= warmup:
            total += time.perf_counter() - start
        for i, m in enumerate(rows):
            allowed = np.flatnonzero(np.unpackbits(bitmask[i].view(np.uint8), bitorder="little")[:vocab_size])
            if allowed.size > 1:
                allowed = allowed[allowed != EOS]
            if m.try_consume_tokens([int(allowed[rng.randrange(allowed.size)])]) != 1:
                raise RuntimeError(f"row {i}: a token its own mask allowed was refused")
    return 1e3 * total / (steps - warmup)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", default=str(Path(__file__).resolve().parent / "scratch" / "tekken_240911.json"))
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    tokenizer = constrained.tekken_tokenizer(Path(args.tokenizer))
    vocab_size = tokenizer.vocab_size
    lltok = vocabulary(tokenizer, vocab_size).lltok
    print(f"{os.cpu_count()} CPUs, {ROWS} rows, vocabulary {vocab_size}")
    print("| schema | rows are | 1 thread ms/step | 4 threads | 12 threads |\n|---|---|---:|---:|---:|")
    for name, schema in (("bounded strings", constrained.SCHEMA), ("free strings", constrained.SCHEMA_FREE_STRINGS)):
        grammar = JsonSchemaFilter(schema).llguidance_grammar()
        for kind in ("shared", "separate", "four"):
            times = [fill_ms(matchers(kind, lltok, grammar), threads, vocab_size, args.steps) for threads in (1, 4, 12)]
            print(f"| {name} | {kind} | " + " | ".join(f"{t:.2f}" for t in times) + " |", flush=True)


if __name__ == "__main__":
    main()
