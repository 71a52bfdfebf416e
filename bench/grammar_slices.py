"""llguidance's mask cost with its default token-set slices against folio's finer string slices
(folio.constrain.grammar.STRING_SLICES), on bench/constrained.py's schemas over the Tekken vocabulary (131,072 ids):
64 copies of one compiled template walking random allowed tokens, each step's masks filled in one call on one
thread (how folio fills one grammar's rows). The two alternate, `--reps` times each. CPU only.

    python bench/grammar_slices.py [--tokenizer bench/scratch/tekken_240911.json] [--steps 60] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import llguidance

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import constrained  # noqa: E402  (bench/constrained.py: the schemas, the Tekken tokenizer)
from grammar_threads import ROWS, fill_ms  # noqa: E402

from folio.constrain.grammar import STRING_SLICES, JsonSchemaFilter, vocabulary  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", default=str(Path(__file__).resolve().parent / "scratch" / "tekken_240911.json"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    tokenizer = constrained.tekken_tokenizer(Path(args.tokenizer))
    vocab_size = tokenizer.vocab_size
    ours = vocabulary(tokenizer, vocab_size).lltok
    variants = {"llguidance's defaults": ours.with_slices(llguidance.LLTokenizer.general_slices()),
                "folio's STRING_SLICES": ours.with_slices(STRING_SLICES)}
    print(f"{os.cpu_count()} CPUs, {ROWS} rows, vocabulary {vocab_size}, 1 thread")
    print("| schema | slices | ms/step, median of reps | reps |\n|---|---|---:|---|")
    for name, schema in (("bounded strings", constrained.SCHEMA), ("free strings", constrained.SCHEMA_FREE_STRINGS)):
        grammar = JsonSchemaFilter(schema).llguidance_grammar()
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.reps):
            for variant, lltok in variants.items():
                template = llguidance.LLMatcher(lltok, grammar, log_level=0)
                times[variant].append(fill_ms([template.deep_copy() for _ in range(ROWS)], 1, vocab_size,
                                              args.steps))
        for variant, ts in times.items():
            print(f"| {name} | {variant} | {statistics.median(ts):.2f} | " + ", ".join(f"{t:.2f}" for t in ts)
                  + " |", flush=True)


if __name__ == "__main__":
    main()
