"""llguidance vs xgrammar for folio's grammar filters: mask time, compile time, JSON-schema coverage (CPU only).

    python bench/grammar_libraries.py [--tekken PATH] [--batch 64] [--threads N]

Vocabulary: Mistral's tekken_240911.json (package data of mistral_common; 131,072 ids: 1000 special tokens, then
130,072 byte tokens given as base64), a realistic 128k vocabulary without a model download. Each library gets the
same token bytes (llguidance through its tiktoken-style constructor with tekken's pre-tokenizer pattern, xgrammar
as a RAW vocabulary), eos = id 2.

Documents: for each of the 20 schemas of tests/json_schemas.py, seeded random walks through llguidance's masks
(tests/json_schemas.random_walk) give valid token sequences; 64 of them (the schemas round-robin) are the batch.
Both libraries consume exactly those tokens (a walk is kept only if xgrammar accepts it too).

Mask time: 64 fresh matchers (compiled grammars reused, as a server's cache would) advance together; at each step
every unfinished matcher's mask is computed into a [64, 4096] int32 bitmask, then each consumes its next token.
"single": one call per matcher on this thread (per-call mean and p99). "batch": the library's parallel batch call
(llguidance LLExecutor, xgrammar BatchGrammarMatcher) with --threads threads; per-token = step time / rows filled,
p99 over steps of that quotient.

Compile: per schema, from the schema to the first mask of a new matcher (llguidance builds its lexer lazily, so its
first mask carries part of the compile), xgrammar's compiler cache off; median over the 20 schemas, and max.

Coverage: every schema of SCHEMAS and FEATURES compiled by each library, then 3 random walks validated with
jsonschema (FormatChecker): "ok" = compiles and all walks valid, "UNSOUND k/3" = documents that violate the
schema, "error" = refused (message shortened).
"""

from __future__ import annotations

import argparse
import base64
import glob
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.json_schemas import FEATURES, SCHEMAS, random_walk  # noqa: E402

NUM_SPECIAL = 1000
VOCAB = 131072
EOS = 2


def load_tekken(path: str | None) -> tuple[list[bytes], str]:
    if path is None:
        hits = glob.glob("/tmp/**/tekken_240911.json", recursive=True)
        if not hits:
            import mistral_common  # the package data, if mistral_common is installed

            hits = glob.glob(os.path.join(os.path.dirname(mistral_common.__file__), "**/tekken_240911.json"),
                             recursive=True)
        path = hits[0]
    data = json.loads(Path(path).read_text())
    tokens = [f"<SPECIAL_{i}>".encode() for i in range(NUM_SPECIAL)]
    tokens += [base64.b64decode(v["token_bytes"]) for v in data["vocab"][: VOCAB - NUM_SPECIAL]]
    return tokens, data["config"]["pattern"]


class Llg:
    name = "llguidance"

    def __init__(self, tokens: list[bytes], pattern: str, threads: int):
        import llguidance
        import llguidance.numpy as llnp

        self.llg, self.llnp = llguidance, llnp
        t0 = time.perf_counter()
        self.tok = llguidance.LLTokenizer.from_tiktoken(
            encoder={b: i for i, b in enumerate(tokens) if i >= NUM_SPECIAL},
            special_tokens={tokens[i].decode(): i for i in range(NUM_SPECIAL)},
            pattern=pattern, eos_token=EOS, n_vocab=VOCAB)
        self.setup_s = time.perf_counter() - t0
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.version = llguidance.__version__

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        err = self.llg.LLMatcher.validate_grammar(grammar, self.tok)
        if err and not err.startswith("WARNING"):
            raise ValueError(err)
        return grammar

    def matcher(self, compiled):
        m = self.llg.LLMatcher(self.tok, compiled, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, m, bitmask, i):
        m.unsafe_compute_mask_ptr(bitmask[i].ctypes.data, bitmask.shape[1] * 4)

    def fill_batch(self, ms, bitmask, rows):
        self.llnp.fill_next_token_bitmask_par(self.executor, list(zip(ms, rows)), bitmask)

    def feed(self, m, t):
        return m.consume_token(t)

    def finished(self, m):
        return m.is_stopped()


class Xgr:
    name = "xgrammar"

    def __init__(self, tokens: list[bytes], pattern: str, threads: int):
        import xgrammar

        self.xgr = xgrammar
        t0 = time.perf_counter()
        info = xgrammar.TokenizerInfo([b"" if i < NUM_SPECIAL else b for i, b in enumerate(tokens)],
                                      xgrammar.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[EOS])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.setup_s = time.perf_counter() - t0
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
        from importlib.metadata import version

        self.version = version("xgrammar")

    def compile(self, schema):
        try:
            return self.compiler.compile_json_schema(schema)
        except Exception as e:  # xgrammar raises RuntimeError / its own errors with the converter's message
            raise ValueError(str(e)) from e

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask, i):
        m.fill_next_token_bitmask(bitmask, i)

    def fill_batch(self, ms, bitmask, rows):
        self.batch.batch_fill_next_token_bitmask(ms, bitmask, rows)

    def feed(self, m, t):
        return m.accept_token(t)

    def finished(self, m):
        return m.is_terminated()


def walk(lib, compiled, tokens, rng, validate=None):
    m = lib.matcher(compiled)
    ids, done = random_walk(lambda row: lib.fill(m, row[None, :], 0), lambda t: lib.feed(m, t),
                            lambda: lib.finished(m), tokens, [EOS], rng)
    return ids, done


def mask_timing(lib, compiled: dict, docs: list[tuple[str, list[int]]], batch: bool) -> dict:
    ms = [lib.matcher(compiled[name]) for name, _ in docs]
    bitmask = np.zeros((len(docs), (VOCAB + 31) // 32), dtype=np.int32)
    per_call: list[float] = []
    steps = max(len(d) for _, d in docs)
    for step in range(steps):
        rows = [i for i, (_, d) in enumerate(docs) if step < len(d)]
        active = [ms[i] for i in rows]
        if batch:
            t0 = time.perf_counter_ns()
            lib.fill_batch(active, bitmask, rows)
            per_call.append((time.perf_counter_ns() - t0) / len(rows) / 1e3)
        else:
            for i in rows:
                t0 = time.perf_counter_ns()
                lib.fill(ms[i], bitmask, i)
                per_call.append((time.perf_counter_ns() - t0) / 1e3)
        for i in rows:
            token = docs[i][1][step]
            if not (bitmask[i, token // 32] >> (token % 32)) & 1:
                raise AssertionError(f"{lib.name}: token {token} of {docs[i][0]} not in its mask")
            if not lib.feed(ms[i], token):
                raise AssertionError(f"{lib.name}: rejected token {token} of {docs[i][0]}")
    tokens = sum(len(d) for _, d in docs)
    if batch:  # weight each step's per-row time by its rows for the mean
        mean = sum(len([1 for _, d in docs if s < len(d)]) * per_call[s] for s in range(steps)) / tokens
    else:
        mean = statistics.fmean(per_call)
    return {"mean_us": mean, "p99_us": float(np.percentile(per_call, 99)), "tokens": tokens}


def compile_times(lib) -> list[float]:
    times = []
    bitmask = np.zeros((1, (VOCAB + 31) // 32), dtype=np.int32)
    for schema in SCHEMAS.values():
        t0 = time.perf_counter()
        m = lib.matcher(lib.compile(schema))
        lib.fill(m, bitmask, 0)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def coverage(lib, tokens) -> dict[str, str]:
    import jsonschema

    out = {}
    for name, schema in {**{f"S:{k}": v for k, v in SCHEMAS.items()}, **FEATURES}.items():
        try:
            compiled = lib.compile(schema)
            lib.matcher(compiled)
        except Exception as e:
            out[name] = "error: " + str(e).splitlines()[0][:70]
            continue
        validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
        rng = random.Random(1)
        bad = 0
        unfinished = 0
        for _ in range(3):
            ids, done = walk(lib, compiled, tokens, rng)
            if not done:
                unfinished += 1
                continue
            text = b"".join(tokens[t] for t in ids if t != EOS)
            try:
                errors = list(validator.iter_errors(json.loads(text)))
            except ValueError:
                errors = ["not JSON"]
            bad += bool(errors)
        out[name] = "ok" if not bad and not unfinished else (
            f"UNSOUND {bad}/3" if bad else f"ok ({unfinished}/3 walks unfinished)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tekken")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    tokens, pattern = load_tekken(args.tekken)
    libs = [Llg(tokens, pattern, args.threads), Xgr(tokens, pattern, args.threads)]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "?")
    print(f"CPU: {cpu}, {os.cpu_count()} cores, {args.threads} threads for the batch calls; vocab {VOCAB}")

    # the batch's documents: walks through llguidance, kept where xgrammar accepts them too
    llg, xgr = libs
    rng = random.Random(0)
    names = list(SCHEMAS)
    compiled = {lib.name: {n: lib.compile(SCHEMAS[n]) for n in names} for lib in libs}
    docs: list[tuple[str, list[int]]] = []
    rejected: dict[str, int] = {}
    attempt = 0
    while len(docs) < args.batch:
        name = names[attempt % len(names)]
        attempt += 1
        if rejected.get(name, 0) >= 3:
            continue
        ids, done = walk(llg, compiled[llg.name][name], tokens, rng)
        m = xgr.matcher(compiled[xgr.name][name])
        if done and all(xgr.feed(m, t) for t in ids):
            docs.append((name, ids))
        else:
            rejected[name] = rejected.get(name, 0) + 1
            print(f"  xgrammar rejects llguidance's walk for {name}: {b''.join(tokens[t] for t in ids)[:80]!r}")
    print(f"batch: {len(docs)} documents, {sum(len(d) for _, d in docs)} tokens, "
          f"longest {max(len(d) for _, d in docs)}")

    rows = []
    for lib in libs:
        single = mask_timing(lib, compiled[lib.name], docs, batch=False)
        par = mask_timing(lib, compiled[lib.name], docs, batch=True)
        comp = compile_times(lib)
        cov = coverage(lib, tokens)
        rows.append((lib, single, par, comp, cov))

    print("\n| library | vocab setup | compile+first mask median / max | mask single mean / p99 | "
          "mask batch-64 mean / p99 (per token) | 20 schemas ok | features ok |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for lib, single, par, comp, cov in rows:
        s_ok = sum(v == "ok" for k, v in cov.items() if k.startswith("S:"))
        f_ok = sum(v == "ok" for k, v in cov.items() if not k.startswith("S:"))
        print(f"| {lib.name} {lib.version} | {lib.setup_s * 1e3:.0f} ms | {statistics.median(comp):.1f} / "
              f"{max(comp):.1f} ms | {single['mean_us']:.1f} / {single['p99_us']:.1f} us | "
              f"{par['mean_us']:.1f} / {par['p99_us']:.1f} us | {s_ok}/20 | {f_ok}/{len(FEATURES)} |")
    print("\ncoverage (what is not ok):")
    for name in [f"S:{k}" for k in SCHEMAS] + list(FEATURES):
        cells = [r[4][name] for r in rows]
        if any(c != "ok" for c in cells):
            print(f"  {name:32s} " + " | ".join(f"{r[0].name}: {c}" for r, c in zip(rows, cells)))


if __name__ == "__main__":
    main()
