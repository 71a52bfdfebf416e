"""Constrained decoding benchmark (issue 20): an 8B-shape model decoding under a JSON schema against the same model
decoding without one, at batch 1 and 64, in one process on one card.

    python bench/constrained.py [--batches 1,64] [--new-tokens 256] [--prompt-len 128] [--tokenizer tekken.json]
                                [--gate-off] [--allow-all] [--in-process] [--mask-processes N]
    python bench/constrained.py --device cpu --tiny      (a smoke test of the script itself, no GPU)

The vocabulary is a real 131,072-token one (the Tekken tokenizer file shipped in mistral_common's wheel, --tokenizer;
ids 0-999 its special tokens), so the grammar engine computes masks over the vocabulary size the issue names; the
model is the 8B shape of bench/engine.py with its vocabulary resized to match, random bf16 weights.

The schema (SCHEMA below: an object holding an array of at least 40 records of integers, bounded strings, enums
and numbers) cannot be completed within --new-tokens, so every constrained job runs the same number of steps as
an unconstrained one: the runs compare the same work. Sampling is folio's default (temperature 0.8, top-k 50,
top-p 0.8, repetition penalty 1.025).

Measured over the decode steps in which every job of the batch samples (no prompt tokens): tokens/s = sampled
tokens / summed step wall time. Runs alternate plain, constrained, plain, constrained; each ratio is constrained
over the mean of the plain runs. Mask time: the grammar engine's time per step (its batched calls), and the time
per step the step spent collecting masks (what the forward did not hide). Where the host has the CPUs for them,
grammar masks of 16 rows or more are made by worker processes (folio.constrain.procs; --mask-processes N: N of them,
0 for none); --in-process adds, in the same process, runs of the schema with every mask made in process (the
processes left unused). Targets: ratio >= 0.9 at batch 64,
>= 0.95 at batch 1. Prints one table last; writes $OUT/constrained.json.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine as bench_engine  # noqa: E402  (bench/engine.py: models, prompts, logging)

from folio import DynamicJob, SamplerSettings, Tokenizer  # noqa: E402
from folio.constrain import Filter, JsonSchemaFilter, grammar, procs  # noqa: E402

log = bench_engine.log

SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array", "minItems": 40,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0},
                    "name": {"type": "string", "maxLength": 24},
                    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                    "score": {"type": "number"},
                },
                "required": ["id", "name", "tags", "score"], "additionalProperties": False,
            },
        },
    },
    "required": ["records"], "additionalProperties": False,
}


def byte_level_alphabet() -> dict[int, str]:
    """The byte -> printable character map of byte-level BPE (GPT-2's): printable Latin-1 bytes stand for
    themselves, the others are shifted past 255."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tekken_tokenizer(path: Path) -> Tokenizer:
    """A folio Tokenizer over the Tekken vocabulary: its byte strings as byte-level BPE pieces (no merges: encoding
    yields single bytes, which is all a benchmark prompt needs; decoding and the token bytes the grammar engine
    reads are exact). Ids 0-999 are the special tokens, 1 BOS and 2 EOS."""
    data = json.loads(path.read_text())
    num_special = data["config"]["default_num_special_tokens"]
    vocab_size = data["config"]["default_vocab_size"]
    alphabet = byte_level_alphabet()
    vocab = {}
    for entry in data["vocab"][: vocab_size - num_special]:
        piece = "".join(alphabet[b] for b in base64.b64decode(entry["token_bytes"]))
        vocab[piece] = entry["rank"] + num_special
    specials = ["<unk>", "<s>", "</s>"] + [f"<SPECIAL_{i}>" for i in range(3, num_special)]
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, s in enumerate(specials)]
    vocab.update({s: i for i, s in enumerate(specials)})
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "vocab": vocab, "merges": [], "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": False},
    }
    return Tokenizer(json.dumps(spec), bos_token_id=1, eos_token_ids=[2], pad_token_id=None)


class AllowAll(Filter):
    """Allows every token: what applying a mask costs the engine, without a grammar."""

    def fill_bitmask(self, row) -> None:
        row[:] = -1


# the same schema with unbounded strings: llguidance masks a free string state faster than a length-bounded one
SCHEMA_FREE_STRINGS = json.loads(json.dumps(SCHEMA).replace(', "maxLength": 24', ""))


def make_filters(kind: str | None) -> list:
    if kind is None:
        return []
    return {"json": lambda: [JsonSchemaFilter(SCHEMA)], "json-free": lambda: [JsonSchemaFilter(SCHEMA_FREE_STRINGS)],
            "json-inproc": lambda: [JsonSchemaFilter(SCHEMA)], "all": lambda: [AllowAll()]}[kind]()


@contextlib.contextmanager
def py_spy(path: Path | None):
    """py-spy sampling this process's threads (waits included) while the block runs, to `path` (collapsed stacks:
    `--py-spy DIR`); nothing when path is None."""
    if path is None:
        yield
        return
    spy = subprocess.Popen([shutil.which("py-spy") or "py-spy", "record", "--pid", str(os.getpid()), "--rate", "1000",
                            "--format", "raw", "--output", str(path), "--idle", "--threads", "--nonblocking"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(2.0)  # (attached by then)
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        _, err = spy.communicate(timeout=60)
        if spy.returncode:
            log(f"py-spy failed ({spy.returncode}): {err.decode()[-300:]}")


@contextlib.contextmanager
def mask_processes(on: bool):
    """Grammar masks by worker processes (as configured) or, with on=False, all in process."""
    saved = procs.PROCESSES
    if not on:
        procs.PROCESSES = 0
    try:
        yield
    finally:
        procs.PROCESSES = saved


def run(gen, prompts, new_tokens: int, constrained: str | None, batch: int) -> dict:
    with mask_processes(constrained != "json-inproc"):
        return _run(gen, prompts, new_tokens, constrained, batch)


def _run(gen, prompts, new_tokens: int, constrained: str | None, batch: int) -> dict:
    settings = SamplerSettings()
    jobs = [DynamicJob(input_ids=p, max_new_tokens=new_tokens, stop_conditions=[], gen_settings=settings, seed=i,
                       filters=make_filters(constrained))
            for i, p in enumerate(prompts)]
    masks = gen.masks
    masks_before = (masks.num_masks, masks.mask_s, masks.wait_s)
    gen.enqueue(jobs)
    full_steps, full_tokens, full_s, steps = 0, 0, 0.0, 0
    phases: dict[str, float] = {}
    wait_before, fill_before = masks.wait_s, masks.fill_s
    while gen.num_remaining_jobs():
        t0 = time.perf_counter()
        results, stats = gen.step()
        dt = time.perf_counter() - t0
        steps += 1
        for r in results:
            if getattr(r, "error", None) is not None:
                raise r.error
            if getattr(r, "eos", False) and constrained in ("json", "json-free", "json-inproc") and \
                    r.eos_reason.value != "max_new_tokens":
                raise RuntimeError(f"a constrained job ended early ({r.eos_reason}): the schema must outlast "
                                   "--new-tokens so that both runs do the same work")
        if stats.num_prompt_tokens == 0 and stats.num_sampled == batch:
            full_steps += 1
            full_tokens += stats.num_sampled
            full_s += dt
            for phase, seconds in stats.host_s.items():
                phases[phase] = phases.get(phase, 0.0) + seconds
    wait_s = masks.wait_s - wait_before
    num_masks = masks.num_masks - masks_before[0]
    text = jobs[0].full_completion
    return {"tokens_per_s": full_tokens / full_s if full_s else 0.0, "full_steps": full_steps, "steps": steps,
            "step_ms": 1e3 * full_s / max(1, full_steps),
            "masks_made_per_step": num_masks / max(1, steps),
            "mask_wait_ms_per_step": 1e3 * wait_s / max(1, steps) if constrained else None,
            "grammar_fill_ms_per_step": 1e3 * (masks.fill_s - fill_before) / max(1, steps) if constrained else None,
            "host_ms_per_full_step": {k: round(1e3 * v / max(1, full_steps), 3) for k, v in phases.items()},
            "sample": text[:120]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape (a smoke test of the script)")
    parser.add_argument("--allow-all", action="store_true",
                        help="also run a filter that allows every token (the engine's masking cost alone)")
    parser.add_argument("--gate-off", action="store_true",
                        help="also run the schema with the sampler queued only once the masks are made (no "
                             "folio.constrain.gate): the gate's effect in the same process")
    parser.add_argument("--in-process", action="store_true",
                        help="also run the schema with every grammar mask made in process (no worker processes)")
    parser.add_argument("--mask-processes", type=int, default=None, metavar="N",
                        help=f"grammar mask worker processes (default here: {procs.PROCESSES}; 0: none)")
    parser.add_argument("--tokenizer", default=str(Path(__file__).resolve().parent / "scratch" / "tekken_240911.json"))
    parser.add_argument("--py-spy", type=Path, default=None, metavar="DIR",
                        help="profile the first plain and schema runs of batches above 1 with py-spy (collapsed "
                             "stacks of every thread, waits included) into DIR")
    args = parser.parse_args()
    if args.mask_processes is not None:
        procs.PROCESSES = args.mask_processes
    device = torch.device(args.device)
    tokenizer = tekken_tokenizer(Path(args.tokenizer))
    shape = "tiny" if args.tiny else "8B"
    bench_engine.SHAPES[shape]["vocab_size"] = tokenizer.vocab_size
    pair = bench_engine.build_pair(shape, device)
    pair.tokenizer = tokenizer
    table = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = bench_engine.random_prompts(batch, args.prompt_len, tokenizer.vocab_size - 1000, seed=batch)
        prompts = [[t + 1000 for t in p] for p in prompts]  # no special tokens in prompts
        max_seq_len = args.prompt_len + args.new_tokens + 16
        # on a GPU the cache takes the free memory; on the CPU (a smoke test) whole pages of 256 for every job
        cache_tokens = None if device.type == "cuda" else batch * 256 * -(-max_seq_len // 256)
        gen, cache = bench_engine.make_generator(pair, batch, max_seq_len, batch, cache_tokens=cache_tokens)
        run(gen, prompts, 8, constrained="json", batch=batch)  # warm-up: graphs, compile, the grammar cache
        run(gen, prompts, 8, constrained=None, batch=batch)
        pool = next((v.pool for v in grammar._vocabularies.get(tokenizer, {}).values() if v.pool), None)
        if pool is not None and not pool.ready.wait(300):  # (started by the warm-up's fills)
            raise RuntimeError(f"the grammar mask processes did not start: {pool.error}")
        if pool is not None and pool.error is None:
            run(gen, prompts, 8, constrained="json", batch=batch)  # (the workers' grammar cache)
        plain, constrained, free, allow_all, ungated, inproc = [], [], [], [], [], []
        gate = gen.masks.gate
        for k in range(2):
            spy_dir = args.py_spy if k == 0 and batch > 1 else None
            with py_spy(spy_dir and spy_dir / f"plain-{batch}.txt"):
                plain.append(run(gen, prompts, args.new_tokens, None, batch))
            with py_spy(spy_dir and spy_dir / f"json-{batch}.txt"):
                constrained.append(run(gen, prompts, args.new_tokens, "json", batch))
            free.append(run(gen, prompts, args.new_tokens, "json-free", batch))
            if args.allow_all:
                allow_all.append(run(gen, prompts, args.new_tokens, "all", batch))
            if args.in_process:
                inproc.append(run(gen, prompts, args.new_tokens, "json-inproc", batch))
            if args.gate_off and gate is not None:  # the sampler queued only once the masks are made
                gen.masks.gate = None
                ungated.append(run(gen, prompts, args.new_tokens, "json", batch))
                gen.masks.gate = gate
        plain_tps = sum(r["tokens_per_s"] for r in plain) / len(plain)
        for r in constrained + free + allow_all + ungated + inproc:
            r["ratio"] = r["tokens_per_s"] / plain_tps

        def mean_ratio(runs: list) -> float | None:
            return sum(r["ratio"] for r in runs) / len(runs) if runs else None

        row = {"batch": batch, "plain_tokens_per_s": plain_tps, "plain": plain, "constrained": constrained,
               "ratio": mean_ratio(constrained), "allow_all_ratio": mean_ratio(allow_all), "free": free,
               "free_ratio": mean_ratio(free), "gated": gate is not None, "ungated": ungated,
               "ungated_ratio": mean_ratio(ungated), "in_process": inproc, "in_process_ratio": mean_ratio(inproc),
               "mask_processes": procs.PROCESSES if pool is not None and pool.error is None else 0,
               "target": 0.9 if batch > 1 else 0.95}
        log(f"batch {batch}: {json.dumps(row)[:600]}")
        table.append(row)
        del gen, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", "."))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    (out / "constrained.json").write_text(json.dumps({"device": device_name, "rows": table}, indent=1))
    print(f"\nconstrained decoding, {shape} shape, vocabulary {tokenizer.vocab_size}, {device_name}, "
          f"{os.cpu_count()} CPUs")
    print("| batch | plain tok/s | JSON-schema tok/s | ratio | target | mask procs | grammar ms/step | "
          "mask wait ms/step | free-strings ratio | allow-all ratio | ratio, gate off | in process: ratio, grammar "
          "ms/step, wait ms/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in table:
        c = row["constrained"]
        tps = sum(r["tokens_per_s"] for r in c) / len(c)
        grammar_ms = sum(r["grammar_fill_ms_per_step"] or 0 for r in c) / len(c)
        wait = sum(r["mask_wait_ms_per_step"] or 0 for r in c) / len(c)
        allow_all = f"{row['allow_all_ratio']:.3f}" if row["allow_all_ratio"] else "-"
        ungated = f"{row['ungated_ratio']:.3f}" if row["ungated_ratio"] else "-"
        ip = row["in_process"]
        inproc = (f"{row['in_process_ratio']:.3f}, "
                  f"{sum(r['grammar_fill_ms_per_step'] for r in ip) / len(ip):.3f}, "
                  f"{sum(r['mask_wait_ms_per_step'] for r in ip) / len(ip):.3f}") if ip else "-"
        print(f"| {row['batch']} | {row['plain_tokens_per_s']:.1f} | {tps:.1f} | {row['ratio']:.3f} | "
              f">= {row['target']} | {row['mask_processes']} | {grammar_ms:.3f} | {wait:.3f} | "
              f"{row['free_ratio']:.3f} | {allow_all} | {ungated} | {inproc} |")


if __name__ == "__main__":
    main()
