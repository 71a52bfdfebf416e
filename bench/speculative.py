"""Speculative decoding benchmark (issue 19): an 8B-shape target with a 1B-shape draft model and with n-gram
drafting, at batch 1 and 32, against speculation off, in one process on one card.

    python bench/speculative.py [--batches 1,32] [--new-tokens 256] [--prompt-len 128]
    python bench/speculative.py --device cpu --tiny      (a smoke test of the script itself, no GPU)

Random bf16 weights (bench/engine.py's build_pair; --residual-scale scales the attention and MLP output projections
of both models, 1 by default: it changes no shape and no cost). A 1B draft of random weights agrees with the target
almost never, so two honest high-acceptance runs sit beside it: the target drafting for itself (acceptance 1, k = 4,
the pure overhead of drafting and verifying), and n-gram drafting on a repetitive workload: --repeat-new-tokens
of greedy output from prompts of a random span repeated four times, by the target with its attention and MLP output
projections scaled by --repeat-residual-scale (0 by default). At transformers' initial scale the random 8B model's
greedy output does not repeat a single token in 1,024 (n-gram drafting finds nothing); with the residual branches
off it is a bigram model (each token a fixed function of the one before), whose greedy output falls into a cycle,
at exactly the same cost per step (same shapes, same bytes read). Every run is greedy with forced output lengths, so
the runs compared generate the same number of tokens.

Each run enqueues --requests-per-slot requests per batch slot at once and is measured over its decode steps (steps
that computed no prompt token):
  acceptance: accepted / drafted tokens;
  tokens/step: tokens per sequence per target forward (a decode row yields 1, a verify row 1 + its accepted drafts);
  tok/s and speed-up over speculation off;
  efficiency: the measured speed-up over the speed-up that the run's own steps allow at their isolated device
    costs. Each step's cost is the captured graphs' replay time for its shape (measured here: the target's decode
    graph for its rows, the draft model's graphs for each drafting forward), so efficiency is what host work, syncs
    and scheduling leave of the gain that the acceptance and the step costs make possible.
  verify/plain: a target forward of 1 + 4 rows per sequence over a one-token step, both replayed graphs (issue
    target at batch 1: <= 1.25).
Prints one table last; writes $OUT/speculative.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine as bench_engine  # noqa: E402  (bench/engine.py: models, prompts, logging)

from folio import Cache, DynamicGenerator, DynamicJob, SamplerSettings  # noqa: E402
from folio.speculative.draft_model import DraftModelRunner  # noqa: E402

log = bench_engine.log
GREEDY = SamplerSettings.greedy()


# ------------------------------------------------------------------------------------------- step costs


class GraphCosts:
    """Replay time (ms, CUDA events, median) of every captured decode-graph bucket of a generator's model, measured
    when made (no reference to the graphs is kept: their memory goes with the generator)."""

    def __init__(self, graphs, label: str):
        self.label = label
        self.buckets = list(graphs.buckets)
        self._ms = {bucket: replay_ms(graphs, bucket) for bucket in self.buckets}

    def ms(self, rows: int) -> float:
        bucket = next((b for b in self.buckets if b >= rows), None)
        if bucket is None:
            raise ValueError(f"{self.label}: no graph for {rows} rows")
        return self._ms[bucket]


def replay_ms(graphs, bucket: int, iterations: int = 20) -> float:
    for _ in range(3):
        graphs.replay(bucket)
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.replay(bucket)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@dataclass
class StepShape:
    target_rows: int  # token rows of the target's forward
    seq_rows: int  # sequences in it (decode rows and verify rows)
    draft_rows: list[int] = field(default_factory=list)  # rows of each draft-model forward (catch-up first)


class DraftRecorder:
    """Records the shape of each draft pass (rows per forward) of a draft-model generator; changes nothing."""

    def __init__(self, runner: DraftModelRunner):
        self.passes: list[list[int]] = []
        original = runner.draft

        def draft(chunks, num_drafts):
            rows = [2 * len(chunks)] + [sum(1 for k in num_drafts if k > j) for j in range(1, max(num_drafts))]
            self.passes.append(rows)
            return original(chunks, num_drafts)

        runner.draft = draft


# ----------------------------------------------------------------------------------------------- runs


@dataclass
class Run:
    name: str
    batch: int
    decode_tokens: int = 0
    decode_s: float = 0.0
    steps: list[StepShape] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    note: str = ""

    @property
    def tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_step(self) -> float:
        """Tokens per sequence per target forward."""
        return self.decode_tokens / max(1, sum(s.seq_rows for s in self.steps))


def make_generator(target, batch: int, new_tokens: int, prompt_len: int, **spec) -> DynamicGenerator:
    page = 256 if target.model.device.type == "cuda" else 16
    tokens = batch * -(-(prompt_len * 4 + new_tokens + 16) // page) * page + 4 * page
    cache = Cache(target.model, num_tokens=tokens, page_size=page)
    gen = DynamicGenerator(target.model, cache, target.tokenizer, max_batch_size=batch,
                           max_seq_len=prompt_len * 4 + new_tokens + 16,
                           max_chunk_size=-(-batch * prompt_len // page) * page, **spec)
    gen.warmup()  # kernels loaded, graphs warm: the timed run measures steady work
    return gen


def run(name: str, gen: DynamicGenerator, prompts: list[list[int]], new_tokens: int, note: str = "") -> Run:
    """Every job enqueued at once (more jobs than batch slots keep the batch full as jobs end); measured over the
    decode steps (steps that computed no prompt token): their tokens, their wall time, their shapes."""
    recorder = None
    if gen.speculator is not None and gen.speculator.draft_runner is not None:
        recorder = DraftRecorder(gen.speculator.draft_runner)
    jobs = [DynamicJob(input_ids=p, max_new_tokens=new_tokens, stop_conditions=[], gen_settings=GREEDY, seed=i)
            for i, p in enumerate(prompts)]
    result = Run(name, gen.max_batch_size, note=note)
    drafted_before, accepted_before = _spec_counts(gen)
    gen.enqueue(jobs)
    bench_engine.sync(gen.model.device)
    while gen.num_remaining_jobs():
        passes_before = len(recorder.passes) if recorder else 0
        _, stats = gen.step()
        if stats.num_prompt_tokens or not stats.num_sampled:
            continue
        result.decode_s += stats.total_s
        result.decode_tokens += stats.num_sampled
        shape = StepShape(stats.num_decode_rows + stats.num_verify_rows + stats.num_drafted,
                          stats.num_decode_rows + stats.num_verify_rows)
        if recorder is not None and len(recorder.passes) > passes_before:
            shape.draft_rows = recorder.passes[-1]
        result.steps.append(shape)
    drafted, accepted = _spec_counts(gen)
    result.drafted, result.accepted = drafted - drafted_before, accepted - accepted_before
    return result


def _spec_counts(gen: DynamicGenerator) -> tuple[int, int]:
    spec = gen.speculator
    return (spec.num_drafted, spec.num_accepted) if spec is not None else (0, 0)


def ideal_ms(r: Run, target_costs: GraphCosts, draft_costs: GraphCosts | None) -> float:
    """The run's decode phase at the isolated device cost of each of its steps."""
    total = 0.0
    for s in r.steps:
        total += target_costs.ms(s.target_rows)
        for rows in s.draft_rows:
            total += draft_costs.ms(rows)
    return total


def release(*objects) -> None:
    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------- main


def bench_batch(batch: int, target, draft, args, rows: list) -> None:
    cuda = target.model.device.type == "cuda"
    vocab = target.model.config.vocab_size
    count = batch * args.requests_per_slot
    prompts = bench_engine.random_prompts(count, args.prompt_len, vocab, seed=batch)
    spans = bench_engine.random_prompts(count, args.prompt_len // 4, vocab, seed=1000 + batch)
    repetitive = [s * 4 for s in spans]
    configs = [
        ("off", prompts, {}),
        ("draft 1B", prompts, dict(draft_model=draft.model)),
        ("n-gram", prompts, dict(use_ngram_draft=True)),
        ("self-draft k=4", prompts, dict(draft_model=target.model, adaptive_draft=False, num_draft_tokens=4)),
        ("off (repetitive)", repetitive, {}),
        ("n-gram (repetitive)", repetitive, dict(use_ngram_draft=True)),
    ]
    new_tokens = {"off (repetitive)": args.repeat_new_tokens, "n-gram (repetitive)": args.repeat_new_tokens}
    runs: dict[str, Run] = {}
    target_costs = draft_costs = None
    saved = None
    for name, prompt_set, spec in configs:
        if "repetitive" in name and saved is None and args.repeat_residual_scale != 1.0:
            saved = [(layer.o_proj.clone(), layer.down.clone()) for layer in target.model.weights.layers]
            scale_residual_branches(target.model, args.repeat_residual_scale)
        log(f"batch {batch}: {name}")
        length = new_tokens.get(name, args.new_tokens)
        gen = make_generator(target, batch, length, args.prompt_len, **spec)
        r = run(name, gen, prompt_set, length)
        runs[name] = r
        if cuda:
            # costs from the largest graph sets (the self-draft generator's: target rows up to 5 per sequence)
            if spec.get("draft_model") is target.model:
                target_costs = GraphCosts(gen.runner.graphs, "target")
            if spec.get("draft_model") is draft.model:
                draft_costs = GraphCosts(gen.speculator.draft_runner.graphs, "draft")
        log(f"  {r.tok_s:,.0f} tok/s, {len(r.steps)} decode steps, drafted {r.drafted}, accepted {r.accepted}")
        release(gen)
    if saved is not None:
        with torch.no_grad():
            for layer, (o_proj, down) in zip(target.model.weights.layers, saved):
                layer.o_proj.copy_(o_proj)
                layer.down.copy_(down)
        saved = None
        release()
    self_costs = None
    if cuda:
        # the self-draft run's drafting forwards are the target's own graphs
        self_costs = target_costs
    for name, r in runs.items():
        base = runs["off (repetitive)" if "repetitive" in name else "off"]
        speedup = r.tok_s / base.tok_s if base.tok_s else None
        efficiency = None
        if cuda and name not in ("off", "off (repetitive)"):
            costs = self_costs if name.startswith("self") else draft_costs
            # tokens per ms at the isolated step costs, this run's over speculation off's
            ideal = (r.decode_tokens / ideal_ms(r, target_costs, costs)) / (
                base.decode_tokens / ideal_ms(base, target_costs, None))
            efficiency = speedup / ideal if ideal else None
        rows.append(dict(batch=batch, run=name, acceptance=r.acceptance, tokens_per_step=r.tokens_per_step,
                         tok_s=r.tok_s, speedup=speedup, efficiency=efficiency, drafted=r.drafted,
                         steps=len(r.steps)))
    if cuda:
        plain, verify = target_costs.ms(batch), target_costs.ms(5 * batch)
        rows.append(dict(batch=batch, run="verify k=4 / plain step (graphs)", ratio=verify / plain,
                         plain_ms=plain, verify_ms=verify,
                         draft_step_ms=draft_costs.ms(batch) if draft_costs else None))


def scale_residual_branches(model, scale: float) -> None:
    with torch.no_grad():
        for layer in model.weights.layers:
            layer.o_proj.mul_(scale)
            layer.down.mul_(scale)


def fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def print_table(rows: list, card: str) -> None:
    print(f"\ncard: {card}")
    print("| batch | run | acceptance | tokens/step | tok/s | speed-up | efficiency |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "ratio" in r:
            continue
        print(f"| {r['batch']} | {r['run']} | {fmt(r['acceptance'], '.2f')} | {fmt(r['tokens_per_step'], '.2f')} "
              f"| {fmt(r['tok_s'], ',.0f')} | {fmt(r['speedup'], '.2f')} | {fmt(r['efficiency'], '.2f')} |")
    for r in rows:
        if "ratio" in r:
            print(f"batch {r['batch']}: verify (1+4 rows/seq) {r['verify_ms']:.3f} ms / plain {r['plain_ms']:.3f} ms "
                  f"= {r['ratio']:.3f}; draft 1B step {fmt(r['draft_step_ms'], '.3f')} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--requests-per-slot", type=int, default=3, help="requests per batch slot: the batch stays "
                        "full while they last (continuous batching), so a run is not timed by its slowest job")
    parser.add_argument("--repeat-new-tokens", type=int, default=1024, help="output length of the repetitive runs")
    parser.add_argument("--repeat-residual-scale", type=float, default=0.0, help="the repetitive runs' scale of "
                        "the target's attention and MLP output projections")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (smoke test of the script)")
    parser.add_argument("--residual-scale", type=float, default=1.0, help="scale of the attention and MLP output "
                        "projections of both random models (1: transformers' initialisation)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.tiny:
        bench_engine.SHAPES["tiny-draft"] = dict(bench_engine.SHAPES["tiny"], num_hidden_layers=1)
    target = bench_engine.build_pair("tiny" if args.tiny else "8B", device)
    draft = bench_engine.build_pair("tiny-draft" if args.tiny else "1B", device)
    draft.hf = None  # transformers' copy of the draft is not needed
    rows: list = []
    if args.residual_scale != 1.0:
        for pair in (target, draft):
            scale_residual_branches(pair.model, args.residual_scale)
    for batch in (int(b) for b in args.batches.split(",")):
        bench_batch(batch, target, draft, args, rows)
    card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    out = Path(os.environ.get("OUT") or ".")
    (out / "speculative.json").write_text(json.dumps(dict(card=card, rows=rows), indent=1))
    print_table(rows, card)


if __name__ == "__main__":
    main()
