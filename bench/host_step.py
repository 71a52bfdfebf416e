"""Host time of a decode step per phase, on the CPU: the Python that bounds a large batch on a GPU, measured where
the device's share is small (a one-layer cut of the demo model) with the GPU's pipeline modes on (decode_ahead,
overlap_emit), so the step runs the same host code as there apart from the forward's and the sampler's kernels.

    .venv/bin/python bench/host_step.py [--batch 256] [--steps 80] [--runs 3] [--profile]

Prints each run's milliseconds per step by phase (folio.stats.PHASES): emit (tokens to jobs: text, results) and
wait_tokens (staging, on the CPU the sync is free) are host work alone; sample and launch_ahead include the CPU's
kernels. --profile: one more run under cProfile, the folio functions by their own time.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import pstats
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import folio  # noqa: E402
from folio.demo import write_demo_model  # noqa: E402


def one_layer_demo(directory: Path) -> Path:
    """The demo model with its first layer only (a checkpoint folio loads like any other)."""
    from safetensors.torch import load_file, save_file

    full = write_demo_model(directory / "full")
    cut = directory / "one-layer"
    cut.mkdir()
    for item in full.iterdir():
        if item.name not in ("config.json", "model.safetensors"):
            (cut / item.name).write_bytes(item.read_bytes())
    config = json.loads((full / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (cut / "config.json").write_text(json.dumps(config))
    tensors = {k: v for k, v in load_file(full / "model.safetensors").items()
               if not k.startswith("model.layers.") or k.split(".")[2] == "0"}
    save_file(tensors, cut / "model.safetensors", metadata={"format": "pt"})
    return cut


def stub_device_work(gen: folio.DynamicGenerator, batch: int, vocab_size: int) -> None:
    """--host-only: the forward returns a fixed logits buffer and the native sampling kernels return ids from a fixed
    random list, so that what a step costs is its host code alone (the CPU's kernels otherwise take most of it); the
    rows sample through the plain path (folio.sampling.plain), as a GPU's default requests do, and decode steps go
    through the decode graphs' host side (capture off: the replay is a plain call). The text pipeline sees random
    ids, as from a random-weight model. Only this generator's objects are changed (its model takes an op set of its
    own)."""
    from folio.model.decode_graphs import DecodeGraphs
    from folio.sampling.plain import plain_rows

    runner = gen.runner
    model = runner.model
    logits = torch.zeros(max(batch, 2048), vocab_size)
    model.forward = lambda forward_batch, cache: logits[: forward_batch.logits_idx.shape[0]]
    ids = torch.randint(5, vocab_size, (batch * 64,), generator=torch.Generator().manual_seed(0))
    probs = torch.full((batch * 64,), 0.5)
    calls = [0]

    def sample_rows(work, temperature, top_k, top_p, min_p, u):
        start = (calls[0] * work.shape[0]) % (ids.shape[0] - work.shape[0])
        calls[0] += 1
        return ids[start:start + work.shape[0]].clone(), probs[start:start + work.shape[0]].clone()

    model.ops = copy.copy(model.ops)
    model.ops.sample_rows = sample_rows
    model.ops.apply_penalties = lambda *args: None
    runner._plain_rows = lambda seqs, logits, masks_later: None if masks_later else plain_rows(seqs, runner._histories)
    runner.graphs = DecodeGraphs(model, gen.cache, gen.max_batch_size, gen.max_seq_len, capture=False)


def run(model, tokenizer, batch: int, steps: int, profiler: cProfile.Profile | None = None,
        host_only: bool = False) -> dict[str, float]:
    """ms per step by phase over `steps` steps in which all `batch` rows decode."""
    cache = folio.Cache(model, num_tokens=batch * 512, page_size=16)
    gen = folio.DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer, max_batch_size=batch,
                                 decode_ahead=True, overlap_emit=True)
    if host_only:
        stub_device_work(gen, batch, tokenizer.vocab_size)
    rng = random.Random(0)
    for _ in range(batch):
        prompt = [rng.randrange(5, tokenizer.vocab_size) for _ in range(64)]
        gen.enqueue(folio.DynamicJob(input_ids=prompt, max_new_tokens=steps + 64, stop_conditions=[]))
    stats = gen.step().stats
    while stats.num_decode_rows != batch:  # (the prompts' steps, until every row decodes)
        stats = gen.step().stats
    for _ in range(5):
        gen.step()
    totals: dict[str, float] = {}
    if profiler is not None:
        profiler.enable()
    for _ in range(steps):
        stats = gen.step().stats
        for phase, seconds in stats.host_s.items():
            totals[phase] = totals.get(phase, 0.0) + seconds
        totals["step"] = totals.get("step", 0.0) + stats.total_s
    if profiler is not None:
        profiler.disable()
    return {phase: round(1e3 * seconds / steps, 3) for phase, seconds in totals.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--host-only", action="store_true", help="stub the forward and the sampling kernels: the "
                        "step's host code alone, the sampler on its plain path (stub_device_work)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = one_layer_demo(Path(tmp))
        model = folio.Model.from_pretrained(path, progress=False)
        tokenizer = folio.Tokenizer.from_pretrained(path)
    print(f"{args.batch} decoding rows, one-layer demo model, CPU; ms per step by phase")
    for k in range(args.runs):
        print(f"run {k}: {run(model, tokenizer, args.batch, args.steps, host_only=args.host_only)}")
    if args.profile:
        profiler = cProfile.Profile()
        run(model, tokenizer, args.batch, args.steps, profiler, host_only=args.host_only)
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(r"/folio/", 30)
        print(out.getvalue())


if __name__ == "__main__":
    main()
