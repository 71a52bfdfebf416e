"""Tensor-parallel engine benchmark: one model split over N processes (folio.tp_launch: NCCL, one GPU a rank), one
stream (W1: 128 prompt + 256 new tokens) and a batch of 64 decoding streams (128 + 128), greedy, with and without
CUDA graphs (captured on every rank in step: folio.model.decode_graphs), against the same model in one process
where it fits and against the N GPUs' copy bandwidth (W1's floor: each rank reads its share of the weights once a
token).

    python bench/tp_engine.py --shape 8B --tp 2
    python bench/tp_engine.py --shape 70B --tp 4 --no-single          (does not fit one GPU: no one-process run)
    python bench/tp_engine.py --shape tiny --tp 2 --device cpu        (gloo on the CPU: checks the script)
    python bench/tp_engine.py --tp-graphs on --tp-all-reduce nccl,peer   (the two all-reduce paths, same call)
    python bench/tp_engine.py --tp-graphs on --tp-headers host,device     (headers through gloo or through NCCL)
    python bench/tp_engine.py --tp-graphs on --kernel-report   (every rank's kernel times: which rank waits where)

--tp-all-reduce runs the tensor-parallel workloads once per mode (EngineOptions.tp_all_reduce); on CUDA the table
also gives one all-reduce's time by each path at decode's message sizes (calls replayed from a CUDA graph).

Random bf16 weights (fp32 on the CPU), made on each rank's device tensor by tensor from one seed, so every rank
holds the same model and keeps only its shard of each layer as it is made (no rank holds a whole 70B model).
Prints one table; writes $OUT/tp_engine.json when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import COMMON, SHAPES, random_prompts, synthetic_tokenizer  # noqa: E402

from folio import Cache, DynamicGenerator, DynamicJob, SamplerSettings  # noqa: E402
from folio.model import peer_all_reduce  # noqa: E402
from folio.model.config import ModelConfig  # noqa: E402
from folio.model.loader import LazyTensors, expected_shapes, fuse_weights  # noqa: E402
from folio.model.model import Model  # noqa: E402
from folio.model.tensor_parallel import TensorParallel, layer_shard, shard  # noqa: E402
from folio.options import EngineOptions  # noqa: E402

SHAPES_TP = {**SHAPES, "70B": dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
                                   num_key_value_heads=8, intermediate_size=28672, vocab_size=128256,
                                   tie_word_embeddings=False)}
WORKLOADS = {"W1": (1, 128, 256), "B64": (64, 128, 128)}  # streams, prompt tokens, new tokens
STACK_DUMP_S = 120.0


def model_config(shape: str, dtype: torch.dtype) -> ModelConfig:
    raw = {**SHAPES_TP[shape], **COMMON, "head_dim": SHAPES_TP[shape]["hidden_size"]
           // SHAPES_TP[shape]["num_attention_heads"], "dtype": "bfloat16" if dtype == torch.bfloat16 else "float32"}
    return ModelConfig.from_dict(raw)


def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel | None,
                 seed: int = 0, options: EngineOptions | None = None) -> Model:
    """Weights of Llama's init scale (std 0.02; norms 1), tensor i drawn from seed + i on `device`: the same on every
    rank. With tp, each layer is split as soon as it is made."""
    def make(shape: tuple[int, ...], index: int) -> torch.Tensor:
        if len(shape) == 1:  # norms
            return torch.ones(shape, device=device, dtype=dtype)
        gen = torch.Generator(device=device).manual_seed(seed + index)
        return (torch.randn(shape, device=device, dtype=torch.float32, generator=gen) * 0.02).to(dtype)

    tensors = LazyTensors()
    for index, (name, shape) in enumerate(expected_shapes(config).items()):
        tensors[name] = functools.partial(make, shape, index)
    split = tp is not None and tp.world_size > 1
    weights = fuse_weights(tensors, config, layer_shard(config, tp, device) if split else None)
    if split:
        weights, config = shard(weights, config, tp, device, layers_sharded=True)
    return Model(config, weights, device, dtype, options, tensor_parallel=tp)


def progress(message: str) -> None:
    """A line as each phase starts or ends (stderr, unbuffered): where a run that never ends stopped."""
    print(f"[{time.strftime('%H:%M:%S')} pid {os.getpid()}] {message}", file=sys.stderr, flush=True)


def run_workloads(model: Model, cache: Cache, names: list[str], graphs: bool, max_seq_len: int = 512) -> dict:
    """tok/s and ms per token of each workload, on a generator over `cache` (graphs captured for max_seq_len's
    pages: a server's default is the model's whole context)."""
    out = {}
    tokenizer = synthetic_tokenizer(model.config.vocab_size)
    progress(f"generator, graphs {'on' if graphs else 'off'}: warming up")
    gen = DynamicGenerator(model, cache, tokenizer, max_batch_size=64, max_seq_len=max_seq_len, cuda_graphs=graphs)
    gen.warmup()
    for name in names:
        streams, prompt, new = WORKLOADS[name]
        prompts = random_prompts(streams, prompt, model.config.vocab_size, 7)
        for _ in range(2):  # the first round warms up (its shapes, cuDNN plans): the second is measured
            jobs = [DynamicJob(input_ids=p, max_new_tokens=new, stop_conditions=[],
                               gen_settings=SamplerSettings.greedy()) for p in prompts]
            gen.enqueue(jobs)
            t0, first = time.perf_counter(), None
            host_s, num_decode_steps = {}, 0  # rank 0's host time per phase of the decode steps (StepStats)
            while gen.num_remaining_jobs():
                stats = gen.step().stats
                if first is not None:
                    num_decode_steps += 1
                    for phase, seconds in stats.host_s.items():
                        host_s[phase] = host_s.get(phase, 0.0) + seconds
                    host_s["step"] = host_s.get("step", 0.0) + stats.total_s
                if first is None and any(j.new_tokens for j in jobs):
                    first = time.perf_counter()
            wall = time.perf_counter() - t0
        decode_s = wall - (first - t0)
        out[name] = {"tok_s": streams * new / wall, "ms_per_token": 1e3 * decode_s / (new - 1),
                     "host_ms_per_step": {k: 1e3 * v / max(1, num_decode_steps) for k, v in host_s.items()},
                     "outputs": [list(j.generated_ids) for j in jobs]}
        progress(f"{name}: {out[name]['tok_s']:,.1f} tok/s")
    return out


def rank_main(tp: TensorParallel, shape: str, device_type: str, names: list[str], cache_tokens: int,
              graphs: bool, all_reduce: str = "auto", headers: str = "host", report_dir: str | None = None,
              max_seq_len: int = 512) -> dict | None:
    """folio.tp_launch.launch's main: every rank makes its shard; rank 0 runs the workloads, the others serve.
    report_dir: each rank records its kernels (tp_kernel_report) and writes their summary there."""
    from tp_kernel_report import recorded

    with recorded(tp.rank, device_type, report_dir):
        return _rank_run(tp, shape, device_type, names, cache_tokens, graphs, all_reduce, headers, max_seq_len)


def _rank_run(tp: TensorParallel, shape: str, device_type: str, names: list[str], cache_tokens: int,
              graphs: bool, all_reduce: str, headers: str, max_seq_len: int) -> dict | None:
    from folio.tp_worker import Driver, run_worker

    # A rank that hangs (a collective one rank never reaches, a capture that never ends) prints every thread's
    # Python stack every STACK_DUMP_S seconds: where it waits, without a debugger.
    faulthandler.dump_traceback_later(STACK_DUMP_S, repeat=True, file=sys.stderr)
    if headers == "device":  # rank 0's message headers through the model's process group (NCCL on GPUs)
        tp = dataclasses.replace(tp, header_group=None)
    device = torch.device("cuda", tp.rank) if device_type == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    model = random_model(model_config(shape, dtype), device, dtype, tp,
                         options=EngineOptions(tp_all_reduce=all_reduce))
    progress(f"rank {tp.rank}: shard made (all-reduce {all_reduce}: peer {model.tensor_parallel.peer is not None})")
    if tp.rank != 0:
        run_worker(model, tp)
        return None
    driver = Driver(tp, Cache(model, num_tokens=cache_tokens, page_size=256 if device_type == "cuda" else 16))
    try:
        return run_workloads(model, driver.cache, names, graphs=graphs, max_seq_len=max_seq_len)
    finally:
        driver.shutdown()


# Messages timed by all_reduce_times: a decode row, batches of 8 / 64 / 256 rows (hidden 4096, bf16), a 1,024-row chunk
ALL_REDUCE_ROWS = (1, 8, 64, 256, 1024)
CALLS_PER_GRAPH = 64


def all_reduce_times(tp: TensorParallel, hidden: int) -> dict | None:
    """launch's main: µs per all-reduce of [rows, hidden] bf16 through NCCL and through the peers' memory, each path's
    calls captured in a CUDA graph (as decode runs them) and the graph replayed."""
    torch.cuda.set_device(tp.rank)
    peer = peer_all_reduce.connect(tp, torch.device("cuda", tp.rank), "peer")
    paths = {"nccl": tp, "peer": TensorParallel(tp.rank, tp.world_size, tp.group, peer)}
    out = {}
    for rows in ALL_REDUCE_ROWS:
        x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
        for name, path in paths.items():
            if name == "peer" and not peer.takes(x):
                continue
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                path.all_reduce(x)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(CALLS_PER_GRAPH):
                    path.all_reduce(x)
            for _ in range(3):
                graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                graph.replay()
            end.record()
            end.synchronize()
            out[(name, rows)] = 1e3 * start.elapsed_time(end) / (10 * CALLS_PER_GRAPH)
            del graph
    torch.cuda.synchronize()
    return {f"{name} {rows}": us for (name, rows), us in out.items()} if tp.rank == 0 else None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8B", choices=sorted(SHAPES_TP))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--workloads", default="W1,B64")
    parser.add_argument("--no-single", action="store_true", help="skip the one-process runs")
    parser.add_argument("--tp-graphs", choices=("off", "on", "both"), default=None,
                        help="CUDA graphs in the tensor-parallel runs (default: both on CUDA, off on the CPU)")
    parser.add_argument("--tp-all-reduce", default="auto",
                        help="comma-separated EngineOptions.tp_all_reduce modes, one tensor-parallel run each")
    parser.add_argument("--tp-headers", default="host",
                        help="comma-separated: how rank 0's message headers travel, 'host' (a gloo group, the "
                             "default) or 'device' (the model's group); one run each, with each all-reduce mode")
    parser.add_argument("--max-seq-len", type=int, default=512,
                        help="the generators' max_seq_len: decode graphs are captured for its pages (a server's "
                             "default is the model's context, 131072 for the 8B shape)")
    parser.add_argument("--kernel-report", action="store_true",
                        help="one more tensor-parallel run (the first mode, graphs as the last run) with every "
                             "rank's kernels recorded: their times side by side (bench/tp_kernel_report.py)")
    args = parser.parse_args(argv)
    from folio.tp_launch import launch

    names = args.workloads.split(",")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    config = model_config(args.shape, dtype)
    cache_tokens = 64 * 512 if args.device == "cuda" else 64 * 272
    rows, result = [], {"shape": args.shape, "tp": args.tp, "device": args.device}
    if args.device == "cuda":
        from kernels import copy_bandwidth

        result["card"] = torch.cuda.get_device_name(0)
        result["copy_GBps"] = max(copy_bandwidth().values()) / 1e9
    if not args.no_single:
        model = random_model(config, torch.device(args.device), dtype, None)
        for graphs in ((True, False) if args.device == "cuda" else (False,)):
            cache = Cache(model, num_tokens=cache_tokens, page_size=256 if args.device == "cuda" else 16)
            result[f"single_graphs_{graphs}"] = run_workloads(model, cache, names, graphs, args.max_seq_len)
            rows.append((f"1 process, graphs {'on' if graphs else 'off'}", result[f"single_graphs_{graphs}"]))
            del cache
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    choice = args.tp_graphs or ("both" if args.device == "cuda" else "off")
    # (--tp 1: the one-process runs alone)
    modes = [(m, h) for m in args.tp_all_reduce.split(",") for h in args.tp_headers.split(",")] if args.tp > 1 else []
    run_ranks = functools.partial(launch, rank_main, args.tp, backend="nccl" if args.device == "cuda" else "gloo",
                                  timeout_s=1800, num_threads=1 if args.device == "cpu" else None)
    if args.device == "cuda" and args.tp > 1:
        progress("all-reduce per call: launching")
        result["all_reduce_us"] = launch(all_reduce_times, args.tp, (config.hidden_size,), backend="nccl",
                                         timeout_s=600)
    for mode, headers in modes:
        for graphs in {"off": (False,), "on": (True,), "both": (False, True)}[choice]:
            label = f"{args.tp} ranks, graphs {'on' if graphs else 'off'}" + (
                f", {mode}, headers {headers}" if len(modes) > 1 else "")
            key = ("tp_run" if not graphs else "tp_run_graphs") + (f"_{mode}_{headers}" if len(modes) > 1 else "")
            progress(f"{label}: launching")
            try:
                result[key] = run_ranks((args.shape, args.device, names, cache_tokens, graphs, mode, headers, None,
                                         args.max_seq_len))
            except RuntimeError as error:  # (reported, and the other runs still printed)
                result[key + "_error"] = str(error)[-2000:]
                print(f"{label}: FAILED\n{str(error)[-2000:]}")
                continue
            rows.append((label, result[key]))
    if args.kernel_report and modes:
        import tempfile

        from tp_kernel_report import print_report

        mode, headers = modes[0]
        graphs = {"off": False, "on": True, "both": True}[choice]
        progress(f"kernel report ({mode}, headers {headers}, graphs {graphs}): launching")
        with tempfile.TemporaryDirectory() as report_dir:
            try:
                run_ranks((args.shape, args.device, names, cache_tokens, graphs, mode, headers, report_dir,
                           args.max_seq_len))
                result["kernel_report"] = {"mode": mode, "headers": headers, "graphs": graphs,
                                           "ranks": print_report(report_dir, args.tp)}
            except RuntimeError as error:
                print(f"kernel report: FAILED\n{str(error)[-2000:]}")
    element = 2 if dtype == torch.bfloat16 else 4
    weight_bytes = element * (config.num_layers * ((config.q_size + 2 * config.kv_size) * config.hidden_size
                                                   + config.hidden_size * config.q_size
                                                   + 3 * config.hidden_size * config.intermediate_size)
                              + config.vocab_size * config.hidden_size)
    floor_ms = 1e3 * weight_bytes / (args.tp * result["copy_GBps"] * 1e9) if "copy_GBps" in result else None
    print(f"\n{result.get('card', 'cpu')}, {args.shape} ({weight_bytes / 1e9:.1f} GB of weights), tensor parallel "
          f"{args.tp}, max_seq_len {args.max_seq_len}"
          + (f"; W1 floor {floor_ms:.2f} ms/token at {args.tp} x {result['copy_GBps']:.0f} GB/s" if floor_ms else ""))
    print("| run | " + " | ".join(f"{n} tok/s | {n} ms/token" for n in names) + " |")
    print("|---|" + "---:|---:|" * len(names))
    for label, runs in rows:
        print(f"| {label} | " + " | ".join(f"{runs[n]['tok_s']:,.1f} | {runs[n]['ms_per_token']:.2f}" for n in names)
              + " |")
    print("\nrank 0's host ms per decode step, by phase (folio.stats.PHASES; wait_tokens: blocked on the device, "
          "then the sampled tokens staged)")
    for label, runs in rows:
        for n in names:
            phases = sorted(runs[n].get("host_ms_per_step", {}).items(), key=lambda kv: -kv[1])
            print(f"  {label}, {n}: " + ", ".join(f"{k} {v:.2f}" for k, v in phases if v >= 0.005))
    if "all_reduce_us" in result:
        times = result["all_reduce_us"]
        print("\n| all-reduce of [rows, hidden] bf16 | " + " | ".join(f"{r} rows" for r in ALL_REDUCE_ROWS) + " |")
        print("|---|" + "---:|" * len(ALL_REDUCE_ROWS))
        for name in ("nccl", "peer"):
            print(f"| {name}, us a call | " + " | ".join(f"{times[f'{name} {r}']:.1f}" if f"{name} {r}" in times
                                                     else "-" for r in ALL_REDUCE_ROWS) + " |")
    single = result.get("single_graphs_False")
    tp_runs = [key for key in result if key.startswith("tp_run") and not key.endswith("_error")]
    for key in tp_runs if single is not None else ():
        same = all(single[n]["outputs"] == result[key][n]["outputs"] for n in names)
        print(f"greedy outputs of {key} equal one process's (graphs off): {same}")
        result[f"outputs_equal_{key}"] = same
    eager = [key for key in tp_runs if not key.startswith("tp_run_graphs")]
    if single is not None and eager:  # (graphs pad the batch: their GEMMs may round otherwise, and greedy diverge)
        result["outputs_equal"] = all(result[f"outputs_equal_{key}"] for key in eager)
    for runs in [result.get("single_graphs_True"), single, *(result[key] for key in tp_runs)]:
        for n in names if runs else ():
            runs[n].pop("outputs")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "tp_engine.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
