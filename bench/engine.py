"""Engine benchmark (issue 8): folio against transformers on the workloads W1-W5, with the physical ceilings.

    python bench/engine.py [--workloads W4,W2,W3,W5,W1] [--no-peers] [--peer-requests 64] [--groups 16]
                           [--peer-reference W2:455,W3:218] [--chunk-size 8192] [--no-overlap] [--profile-host]
                           [--no-pdl] [--decode-attention simt] [--no-prefill-cudnn] [--no-residual-gemm]
                           [--loras 8 [--lora-rank 16] [--lora-prompt-update masked,in-place]]
    python bench/engine.py --device cpu --tiny        (a smoke test of the script itself, no GPU)
    ENGINE_BENCH=1 bash bench/gpu.sh                  (after the build, the GPU tests and the kernel benchmark)

Sizes: W2/W3 run 256 requests for folio, the peer gets the first --peer-requests of them (generate_batch is ~50x
slower; W3's peer runs its mixed output lengths in 4 length buckets, one generate_batch call each); W5 runs
--groups groups of 16 (the issue's 64 groups take minutes with the prefix cache off). The table says so.
About 4 minutes on an H200 with peers (transformers compiles the static-cache peer of W1: ~40 s).

Random bf16 weights of real shapes are made on the GPU by transformers (LlamaForCausalLM from a config) and folio
runs the SAME tensors (Model.from_state_dict; transformers' q/k/v and gate/up become views of folio's fused
ones). Output lengths are forced (stop_conditions=[]; the peer has no EOS). Ceilings measured in the same run:
device-to-device copy bandwidth (decode limit = weight bytes / bandwidth) and a large bf16 matmul (prefill limit =
FLOPs / matmul rate). Prints one table last; writes $OUT/engine.json.

Sampling: W1 and W4 greedy; W2, W3, W5 folio's default SamplerSettings (temperature 0.8, top-k 50, top-p 0.8,
repetition penalty 1.025 over the whole history) and, for the peer, do_sample with the same temperature/top-k/top-p.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from folio import (  # noqa: E402
    Cache,
    DynamicGenerator,
    DynamicJob,
    Model,
    ModelConfig,
    SamplerSettings,
    StepStats,
    Tokenizer,
    activation_reserve_bytes,
)
from folio.lora import apply as lora_apply  # noqa: E402
from folio.lora import random_adapter  # noqa: E402
from folio.model import flash  # noqa: E402
from folio.options import EngineOptions  # noqa: E402
from folio.runner import ModelRunner  # noqa: E402
from folio.stats import PHASES  # noqa: E402

SHAPES = {
    "8B": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    "1B": dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=1000, tie_word_embeddings=False),
}
COMMON = dict(rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0, bos_token_id=0,
              eos_token_id=None, architectures=["LlamaForCausalLM"])
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_MASKED_MAX_COLUMNS = lora_apply.MASKED_MAX_COLUMNS
SAMPLED = dict(temperature=0.8, top_k=50, top_p=0.8)
OPTIONS: dict = {}  # command-line switches that reach into helpers (no_overlap, engine_options)
FLASH_STATES: list[flash.FlashState] = []  # every model's prefill-attention probes, for engine.json


def log(*args) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


# ------------------------------------------------------------------------------------------------ ceilings


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_time(fn, device: torch.device, iterations: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iterations):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_ceilings(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"copy_GBps": 50.0, "matmul_TFLOPs": 1.0}
    n = 1 << 31  # 4 GiB of bf16... 2^31 elements x 2 bytes
    src = torch.randn(n // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    end = time.perf_counter() + 0.5
    while time.perf_counter() < end:  # clocks up from idle
        dst.copy_(src)
    t = median_time(lambda: dst.copy_(src), device)
    copy_gbps = 2 * src.numel() * 2 / t / 1e9
    del src, dst
    size = 8192
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    t = median_time(lambda: a @ b, device)
    matmul = 2 * size**3 / t / 1e12
    del a, b
    torch.cuda.empty_cache()
    return {"copy_GBps": copy_gbps, "matmul_TFLOPs": matmul}


# ------------------------------------------------------------------------------------------------- models


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    return Tokenizer.synthetic(vocab_size, bos_token_id=0, eos_token_ids=[1])


@dataclass
class Pair:
    name: str
    hf: object
    model: Model
    tokenizer: Tokenizer
    weight_bytes: int  # bytes a decode step must read: every weight but the embedding table (one row of it)
    linear_params: int  # parameters in the per-token matmuls (all layers), without lm_head


def build_pair(shape: str, device: torch.device) -> Pair:
    import transformers

    t0 = time.perf_counter()
    config = transformers.LlamaConfig(**SHAPES[shape], **COMMON)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    raw = config.to_dict()
    raw["dtype"] = "bfloat16" if dtype == torch.bfloat16 else "float32"
    folio_config = ModelConfig.from_dict(raw)
    state = hf.state_dict()
    fp8_weights = OPTIONS.get("weight_format") == "fp8"
    model = Model.from_state_dict(folio_config, state, options=OPTIONS.get("engine_options"),
                                  weight_format="fp8" if fp8_weights else None)
    FLASH_STATES.append(model.flash_state)
    del state
    if not fp8_weights:  # (FP8 projections cannot be shared: transformers keeps its own bf16 copy)
        share_fused_weights(hf, model)
    cfg = folio_config
    per_layer = (cfg.q_size + 2 * cfg.kv_size) * cfg.hidden_size + cfg.hidden_size * cfg.q_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    element = torch.empty((), dtype=dtype).element_size()
    # FP8: one byte per projection weight (+ fp32 scales, negligible); lm_head stays in the model dtype
    weight_bytes = per_layer * cfg.num_layers * (1 if fp8_weights else element) + cfg.vocab_size * cfg.hidden_size \
        * element
    if device.type == "cuda":
        torch.cuda.empty_cache()
    log(f"built {shape}: {sum(p.numel() for p in hf.parameters()) / 1e9:.2f} B params in "
        f"{time.perf_counter() - t0:.1f} s")
    return Pair(shape, hf, model, synthetic_tokenizer(cfg.vocab_size), weight_bytes, per_layer * cfg.num_layers)


def share_fused_weights(hf, model: Model) -> None:
    """Point transformers' q/k/v and gate/up at row slices of folio's fused tensors: one copy of the weights."""
    cfg = model.config
    with torch.no_grad():
        for layer, weights in zip(hf.model.layers, model.weights.layers):
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = weights.qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            gate, up = weights.gate_up.split([cfg.intermediate_size, cfg.intermediate_size])
            for module, tensor in ((attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v), (mlp.gate_proj, gate),
                                   (mlp.up_proj, up)):
                module.weight = torch.nn.Parameter(tensor, requires_grad=False)


# -------------------------------------------------------------------------------------------------- folio


@dataclass
class StepProfile:
    """Host time per phase of the generator's steps, from each step's StepStats (folio.stats.PHASES: plan,
    forward (host side: input buffers, graph replay or kernel launches), sample (launches), launch_ahead,
    wait_tokens (the step's one sync: waiting for the device, then staging), emit (tokens to jobs: text,
    results; with overlap_emit it runs while the device computes the step)) and rest (the remainder of the step:
    prefill results, bookkeeping)."""

    steps: int = 0
    seconds: dict = field(default_factory=lambda: {**{k: 0.0 for k in PHASES}, "rest": 0.0})
    launched_ahead: int = 0
    prompt_steps_ahead: int = 0

    def add(self, stats: StepStats) -> None:
        self.steps += 1
        for phase, seconds in stats.host_s.items():
            self.seconds[phase] += seconds
        self.seconds["rest"] += stats.total_s - sum(stats.host_s.values())
        self.launched_ahead += stats.launched_ahead
        self.prompt_steps_ahead += stats.launched_ahead and stats.num_prompt_tokens > 0

    def per_step_ms(self) -> dict:
        n = max(1, self.steps)
        return {k: round(v / n * 1e3, 3) for k, v in self.seconds.items()}


@dataclass
class RunResult:
    wall_s: float
    output_tokens: int
    ttft_s: list  # per job: first token time - run start
    tpot_s: list  # per job: (last - first token) / (n - 1)
    profile: dict | None = None
    steps: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def make_generator(pair: Pair, max_batch_size: int, max_seq_len: int, num_jobs: int, prefix_cache: bool = True,
                   cache_tokens: int | None = None, prefill_ahead: bool = True, loras: int = 0,
                   lora_rank: int = 16) -> tuple[DynamicGenerator, Cache]:
    """loras > 0: room for that many LoRA adapters of rank lora_rank (the generator's slots, the reserve)."""
    device = pair.model.device
    capacity = {"max_loras": loras, "max_lora_rank": lora_rank} if loras else {}
    kv = {"kv_format": OPTIONS["kv_format"]} if OPTIONS.get("kv_format") else {}  # (--kv-format, passed through)
    reserve = 0
    if cache_tokens is not None or device.type != "cuda":
        page = 256
        tokens = cache_tokens or max_batch_size * max_seq_len
        cache = Cache(pair.model, num_tokens=-(-tokens // page) * page, **kv)
    else:
        gc.collect()
        torch.cuda.empty_cache()
        reserve = activation_reserve_bytes(pair.model, max_batch_size, OPTIONS.get("chunk_size") or None, **capacity)
        cache = Cache(pair.model, max_memory_fraction=0.85, reserve_bytes=reserve, **kv)
    t0 = time.perf_counter()
    gen = DynamicGenerator(pair.model, cache, pair.tokenizer, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                           max_queued_jobs=num_jobs + 1, prefix_cache=prefix_cache,
                           max_chunk_size=OPTIONS.get("chunk_size") or None,
                           overlap_emit=False if OPTIONS.get("no_overlap") else None, prefill_ahead=prefill_ahead,
                           host_cache_bytes=0 if OPTIONS.get("host_tier") == "off" else None,
                           host_write_through=OPTIONS.get("host_tier") == "write-through", **capacity)
    log(f"  generator: cache {cache.num_tokens} tokens ({cache.bytes / 2**30:.1f} GiB"
        f"{f', {reserve / 2**30:.1f} GiB kept for activations' if reserve else ''}), batch {max_batch_size}, "
        f"chunk {gen.max_chunk_size} tokens, graphs {'on' if gen.runner.graphs else 'off'} "
        f"({time.perf_counter() - t0:.1f} s)")
    return gen, cache


def run_folio(gen: DynamicGenerator, prompts: list[list[int]], new_tokens: list[int], settings: SamplerSettings,
              device: torch.device, loras: int = 0) -> RunResult:
    """loras: job i runs with adapter f"lora{i % loras}" (registered beforehand; 0: none)."""
    jobs = [DynamicJob(input_ids=p, max_new_tokens=n, stop_conditions=[], gen_settings=settings, seed=i,
                       lora=f"lora{i % loras}" if loras else None)
            for i, (p, n) in enumerate(zip(prompts, new_tokens))]
    profile = StepProfile()
    sync(device)
    t0 = time.perf_counter()
    gen.enqueue(jobs)
    remaining = len(jobs)
    trace = StepTrace.from_options()
    step_ends = []
    while remaining:
        if trace is not None:
            trace.before_step(profile.steps)
        with torch.profiler.record_function("folio.step"):  # a named host span for --trace-steps
            results, stats = gen.step()
        profile.add(stats)
        step_ends.append(time.monotonic())
        remaining -= sum(1 for r in results if getattr(r, "eos", False))
        for r in results:
            if getattr(r, "error", None) is not None:
                raise r.error
    wall = time.perf_counter() - t0
    ttft = [j.time_first_token - (j.time_enqueue or 0) for j in jobs]
    tpot = [(j.time_last_token - j.time_first_token) / (j.new_tokens - 1) for j in jobs if j.new_tokens > 1]
    # the prompt phase lasts until the last job's first token; the steps after it only decode
    last_first = max(j.time_first_token for j in jobs)
    start = min(j.time_enqueue for j in jobs)
    prompt_steps = sum(1 for t in step_ends if t <= last_first + 1e-6)
    phases = {"prompt_phase_s": round(last_first - start, 3), "prompt_phase_steps": prompt_steps,
              "decode_phase_s": round(step_ends[-1] - last_first, 3),
              "decode_phase_steps": len(step_ends) - prompt_steps}
    return RunResult(wall, sum(j.new_tokens for j in jobs), ttft, tpot,
                     {"steps": profile.steps, "per_step_ms": profile.per_step_ms(), **phases,
                      "launched_ahead": profile.launched_ahead, "prompt_steps_ahead": profile.prompt_steps_ahead},
                     profile.steps)


class StepTrace:
    """--trace-steps A:B: torch.profiler over steps [A, B) of the next folio run, then a summary of the device's
    timeline: how busy it was, its idle gaps, and the kernels that took the time."""

    def __init__(self, first: int, end: int):
        self.first, self.end = first, end
        self._profiler = None
        self._t0 = 0.0

    @classmethod
    def from_options(cls) -> StepTrace | None:
        spec = OPTIONS.pop("trace_steps", None)  # one run per request
        if not spec or not torch.cuda.is_available():
            return None
        first, end = (int(x) for x in spec.split(":"))
        return cls(first, end)

    def before_step(self, step: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        if step == self.first:
            torch.cuda.synchronize()
            self._profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._profiler.__enter__()
            self._t0 = time.perf_counter()
        elif step == self.end and self._profiler is not None:
            torch.cuda.synchronize()
            wall_us = (time.perf_counter() - self._t0) * 1e6
            self._profiler.__exit__(None, None, None)
            self._summarise(self._profiler, wall_us, self.end - self.first)
            self._profiler = None

    @staticmethod
    def _summarise(prof, wall_us: float, steps: int) -> None:
        spans, totals, counts, host_events = [], {}, {}, []
        runtime: dict[str, list[float]] = {}  # host-side CUDA runtime/driver calls: where the host may block
        for e in prof.events():
            on_host = e.device_type != torch.autograd.DeviceType.CUDA
            if on_host:
                host_events.append((e.time_range.start, e.time_range.end, e.name))
            if e.name.startswith("folio."):
                continue  # the named host spans (run_folio); the profiler mirrors them on the device timeline
            if on_host:
                if e.name.startswith(("cuda", "cu")):
                    runtime.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
                continue
            spans.append((e.time_range.start, e.time_range.end, e.name))
            totals[e.name] = totals.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
            counts[e.name] = counts.get(e.name, 0) + 1
        if not spans:
            log("  trace: no device events")
            return
        spans.sort()
        busy, gaps, where = 0.0, [], []  # where: (gap us, its start from the window's start in ms, kernels around)
        cur_start, cur_end, cur_name = spans[0]
        for start, end, name in spans[1:]:
            if start > cur_end:
                busy += cur_end - cur_start
                gaps.append(start - cur_end)
                where.append((start - cur_end, (cur_end - spans[0][0]) / 1e3, cur_name[:40], name[:40], cur_end, start))
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
            if end >= cur_end:
                cur_name = name
        busy += cur_end - cur_start
        window = spans[-1][1] - spans[0][0]
        big = [g for g in gaps if g > 20]
        log(f"  trace of {steps} steps: wall {wall_us / steps / 1e3:.3f} ms/step, device timeline "
            f"{window / steps / 1e3:.3f} ms/step, busy {busy / steps / 1e3:.3f} ms/step ({100 * busy / window:.0f}%), "
            f"{len(big)} gaps > 20 us totalling {sum(big) / steps / 1e3:.3f} ms/step, largest "
            f"{sorted(big)[-5:] if big else []} us")
        for i, (gap, at_ms, before, after, g0, g1) in enumerate(sorted(where, reverse=True)[:4]):
            log(f"    gap {gap / 1e3:.1f} ms at {at_ms:.1f} ms, after {before} / before {after}")
            if i < 2:  # the host work inside the gap: the longest host events that overlap it
                inside = sorted(((min(e, g1) - max(b, g0), n, b, e) for b, e, n in host_events if b < g1 and e > g0),
                                reverse=True)
                log("      host during it (its part of the gap; whole span from the window's start): " + "; ".join(
                    f"{n[:50]} {d / 1e3:.1f} ms ({(b - spans[0][0]) / 1e3:.1f}-{(e - spans[0][0]) / 1e3:.1f})"
                    for d, n, b, e in inside[:6]))
        for name, total in sorted(totals.items(), key=lambda kv: -kv[1])[:14]:
            log(f"    {total / steps:9.1f} us/step  x{counts[name] / steps:5.1f}  {name[:100]}")
        # the named host spans of the first 40 ms (or the first 400 when the steps are longer), and where the device
        # was idle then: which host work the device waited for
        horizon = 400e3 if window / steps > 100e3 else 40e3
        marks = sorted((b, e, n) for b, e, n in host_events if n.startswith("folio.") and e - b > horizon / 400)
        log("  host spans (ms from the window's start): " + "; ".join(
            f"{n[6:]} {(b - spans[0][0]) / 1e3:.2f}-{(e - spans[0][0]) / 1e3:.2f}" for b, e, n in marks
            if b - spans[0][0] < horizon))
        long_ops = sorted((b, e, n) for b, e, n in host_events
                          if not n.startswith("folio.") and e - b > horizon / 80 and b - spans[0][0] < horizon)
        log("  host ops over " + f"{horizon / 80e3:.1f} ms then: " + "; ".join(
            f"{n[:40]} {(b - spans[0][0]) / 1e3:.1f}-{(e - spans[0][0]) / 1e3:.1f}" for b, e, n in long_ops[:30]))
        log("  device idle > 20 us then (ms): " + "; ".join(
            f"{(g0 - spans[0][0]) / 1e3:.2f}-{(g1 - spans[0][0]) / 1e3:.2f} after {before[:24]}"
            for gap, _, before, _, g0, g1 in sorted(where, key=lambda w: w[4])
            if gap > 20 and g0 - spans[0][0] < horizon))
        calls = [(e - b, b, e, n) for b, e, n in host_events if n.startswith(("cuda", "cu"))]
        if calls:  # the longest runtime call, and the host ops it ran inside (innermost first)
            d, b0, e0, n0 = max(calls)
            around = sorted((e - b, n) for b, e, n in host_events if b <= b0 and e >= e0 and n != n0)
            log(f"  longest runtime call: {n0} {d / 1e3:.1f} ms ({(b0 - spans[0][0]) / 1e3:.1f}-"
                f"{(e0 - spans[0][0]) / 1e3:.1f} ms), inside: " + " < ".join(n[:60] for _, n in around[:5]))
        log("  host runtime calls (us/step, calls/step, longest us):")
        for name, times in sorted(runtime.items(), key=lambda kv: -sum(kv[1]))[:8]:
            log(f"    {sum(times) / steps:9.1f}  x{len(times) / steps:5.1f}  max {max(times):8.1f}  {name}")


def decode_step_gpu_ms(gen: DynamicGenerator, batch: int) -> float | None:
    """GPU time of one captured decode step of `batch` rows (graph replay alone, no sampling or host work)."""
    graphs = gen.runner.graphs
    if graphs is None:
        return None
    b = graphs.bucket_for(batch)
    if b is None:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graphs.replay(b)
    start.record()
    for _ in range(10):
        graphs.replay(b)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 10


# ------------------------------------------------------------------------------------------------- peers


def hf_generation_config(pair: Pair, max_new_tokens: int, sampled: bool, **extra):
    import transformers

    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=sampled, eos_token_id=None, pad_token_id=0,
                  bos_token_id=0)
    if sampled:
        kwargs.update(SAMPLED)
    else:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    kwargs.update(extra)
    return transformers.GenerationConfig(**kwargs)


def run_generate_batch(pair: Pair, prompts: list[list[int]], new_tokens: list[int], sampled: bool) -> RunResult:
    """transformers' continuous batching. Per-request lengths: grouped by max_new_tokens when they differ (the API
    takes one max_new_tokens per call); each group is one call, timed together."""
    hf = pair.hf
    params = inspect.signature(hf.generate_batch).parameters
    groups: dict[int, list[list[int]]] = {}
    for p, n in zip(prompts, new_tokens):
        groups.setdefault(n, []).append(p)
    if len(groups) > 1:
        raise ValueError("one max_new_tokens per call: use run_generate_batch_mixed")
    (n, inputs), = groups.items()
    config = hf_generation_config(pair, n, sampled)
    kwargs = {k: v for k, v in (("progress_bar", False), ("record_timestamps", True)) if k in params}
    t0 = time.perf_counter()
    outputs = hf.generate_batch(inputs=inputs, generation_config=config, **kwargs)
    sync(pair.model.device)
    wall = time.perf_counter() - t0
    return _peer_result(outputs, wall, t0)


def _peer_result(outputs: dict, wall: float, t0: float) -> RunResult:
    """Wall time from the first request's creation (after the manager's set-up and warm-up) to the last token,
    when the outputs carry those times; else the whole call."""
    total, ttft, tpot, created, finished = 0, [], [], [], []
    for out in outputs.values():
        tokens = getattr(out, "generated_tokens", None) or []
        total += len(tokens)
        stamps = getattr(out, "timestamps", None)
        if getattr(out, "created_time", None) is not None:
            created.append(out.created_time)
        if stamps:
            finished.append(stamps[-1])
            ttft.append(stamps[0] - (getattr(out, "created_time", None) or t0))
            if len(stamps) > 1:
                tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    if created and finished and t0 <= min(created) < max(finished):
        wall = max(finished) - min(created)
    return RunResult(wall, total, ttft, tpot)


def run_generate_batch_mixed(pair: Pair, prompts, new_tokens, sampled: bool) -> RunResult:
    """Mixed output lengths with a single-length API: one call with every request at its own length is not
    possible, so requests go in 4 length buckets (each bucket's max), run one after another; only the tokens a
    request asked for are counted."""
    order = sorted(range(len(prompts)), key=lambda i: new_tokens[i])
    buckets = [order[k * len(order) // 4:(k + 1) * len(order) // 4] for k in range(4)]
    wall, total = 0.0, 0
    for bucket in buckets:
        if not bucket:
            continue
        n = max(new_tokens[i] for i in bucket)
        res = run_generate_batch(pair, [prompts[i] for i in bucket], [n] * len(bucket), sampled)
        wall += res.wall_s
        total += min(res.output_tokens, sum(new_tokens[i] for i in bucket))
    return RunResult(wall, total, [], [])


def run_static_compiled(pair: Pair, prompt: list[int], new_tokens: int) -> dict:
    """transformers generate with a static cache, which transformers compiles itself (torch.compile of the decode
    forward, its CompileConfig defaults: fullgraph, reduce-overhead). Warm-up calls compile; then TTFT (1 token)
    and the full run are timed."""
    hf = pair.hf
    ids = torch.tensor([prompt], device=pair.model.device)
    config = hf_generation_config(pair, new_tokens, False, min_new_tokens=new_tokens, cache_implementation="static")
    one = hf_generation_config(pair, 1, False, cache_implementation="static")
    return _time_static(hf, ids, prompt, config, one)


def _time_static(hf, ids, prompt, config, one) -> dict:
    t0 = time.perf_counter()
    hf.generate(ids, generation_config=config)
    hf.generate(ids, generation_config=config)
    compile_s = time.perf_counter() - t0
    times_one, times_all = [], []
    for _ in range(2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(ids, generation_config=one)
        torch.cuda.synchronize()
        times_one.append(time.perf_counter() - t)
        t = time.perf_counter()
        out = hf.generate(ids, generation_config=config)
        torch.cuda.synchronize()
        times_all.append(time.perf_counter() - t)
    produced = out.shape[1] - len(prompt)
    ttft, total = min(times_one), min(times_all)
    return {"ttft_s": ttft, "total_s": total, "tokens": produced, "tpot_s": (total - ttft) / (produced - 1),
            "warmup_compile_s": compile_s}


# ---------------------------------------------------------------------------------------------- workloads


@dataclass
class Row:
    workload: str
    engine: str
    note: str = ""
    tok_s: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    vs_peer: float | None = None
    vs_limit: float | None = None
    extra: dict = field(default_factory=dict)


class Rows(list):
    """The table's rows; each one is logged and the JSON rewritten as it comes, so a run cut short keeps them."""

    def __init__(self, save):
        super().__init__()
        self._save = save

    def append(self, row: Row) -> None:
        super().append(row)
        log(f"  ROW {row.workload} | {row.engine} | {row.note} | tok/s {fmt(row.tok_s, '.0f')} | "
            f"ttft {fmt(row.ttft_ms, '.1f')} ms | tpot {fmt(row.tpot_ms, '.2f')} ms | "
            f"vs limit {fmt(row.vs_limit, '.3f')}")
        self._save()


def random_prompts(count: int, lengths, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if isinstance(lengths, int):
        lengths = [lengths] * count
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]


def median_ms(values) -> float | None:
    return statistics.median(values) * 1e3 if values else None


def peer_call(rows: list, workload: str, engine: str, note: str, fn):
    log(f"  peer {engine} ...")
    t0 = time.perf_counter()
    try:
        res = fn()
    except Exception as error:  # noqa: BLE001 — a failing peer is recorded, not fatal
        traceback.print_exc()
        rows.append(Row(workload, engine, f"FAILED: {type(error).__name__}: {str(error)[:120]}"))
        return None
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    log(f"  peer {engine} done in {time.perf_counter() - t0:.1f} s")
    return res


def w1(pair: Pair, args, ceilings: dict, rows: list) -> None:
    prompt = random_prompts(1, 128 if not args.tiny else 16, pair.model.config.vocab_size, 1)[0]
    n = 256 if not args.tiny else 16
    limit_tok_s = ceilings["copy_GBps"] * 1e9 / pair.weight_bytes
    gen, cache = make_generator(pair, 1, 512, 2, cache_tokens=512)
    greedy = SamplerSettings.greedy()
    run_folio(gen, [prompt], [n], greedy, pair.model.device)  # warm-up
    res = min((run_folio(gen, [prompt], [n], greedy, pair.model.device) for _ in range(2)), key=lambda r: r.wall_s)
    gpu_ms = decode_step_gpu_ms(gen, 1) if pair.model.device.type == "cuda" else None
    del gen, cache
    folio_rate = 1 / statistics.median(res.tpot_s)
    row = Row("W1", "folio", "8B, 128+256, greedy", folio_rate, median_ms(res.ttft_s), median_ms(res.tpot_s),
              vs_limit=folio_rate / limit_tok_s,
              extra={"limit_tok_s": limit_tok_s, "end_to_end_tok_s": res.tokens_per_s, "profile": res.profile,
                     "decode_graph_gpu_ms": gpu_ms})
    rows.append(row)
    if args.peers:
        cb = peer_call(rows, "W1", "hf generate_batch", "",
                       lambda: run_generate_batch(pair, [prompt], [n], sampled=False))
        if cb:
            rows.append(Row("W1", "hf generate_batch", "", cb.tokens_per_s, median_ms(cb.ttft_s),
                            median_ms(cb.tpot_s), vs_limit=cb.tokens_per_s / limit_tok_s))
        peer = peer_call(rows, "W1", "hf static+compile", "", lambda: run_static_compiled(pair, prompt, n))
        if peer:
            rate = 1 / peer["tpot_s"]
            rows.append(Row("W1", "hf static+compile", f"compile+warm-up {peer['warmup_compile_s']:.0f} s", rate,
                            peer["ttft_s"] * 1e3, peer["tpot_s"] * 1e3, vs_limit=rate / limit_tok_s, extra=peer))
            row.vs_peer = folio_rate / rate


def throughput(workload: str, pair: Pair, args, rows: list, prompts, new_tokens, note: str, max_seq_len: int,
               ceilings: dict) -> None:
    # decode limit at batch 256: weights once per step (attention K/V reads come on top)
    limit = ceilings["copy_GBps"] * 1e9 / pair.weight_bytes * min(256, len(prompts))
    if OPTIONS.get("chunk_size"):
        note += f", max_chunk_size {OPTIONS['chunk_size']}"
    row = None
    # several prefill-ahead settings or sampler paths: an A/B in one process
    variants = [(p, 0, None, path) for path in args.sampler_paths.split(",")
                for p in OPTIONS.get("prefill_ahead") or [True]]
    if workload == "W2" and args.loras:  # the same workload again, its jobs spread over random LoRA adapters
        variants += [(True, args.loras, form, "plain") for form in args.lora_prompt_update.split(",")]
    for prefill_ahead, loras, form, path in variants:
        if form is not None:  # how prompt chunks of several adapters are updated (folio.lora.apply)
            lora_apply.MASKED_MAX_COLUMNS = {"masked": DEFAULT_MASKED_MAX_COLUMNS, "in-place": 0}[form]
        with sampler_path(path):
            res, gpu_ms = run_throughput(workload, pair, args, prompts, new_tokens, max_seq_len, prefill_ahead,
                                         loras)
        label = ("" if prefill_ahead else ", prefill ahead off") + (
            ", sampler's general path only" if path == "general" else "") + (
            f", {loras} LoRA adapters r{args.lora_rank} q/k/v/o/gate/up/down" if loras else "") + (
            f", prompt update {form}" if form is not None and "," in args.lora_prompt_update else "")
        variant = Row(workload, "folio", note + label, res.tokens_per_s,
                      median_ms(res.ttft_s), median_ms(res.tpot_s), vs_limit=res.tokens_per_s / limit,
                      extra={"wall_s": res.wall_s, "tokens": res.output_tokens, "profile": res.profile,
                             "decode_graph_gpu_ms_batch256": gpu_ms, "weights_only_limit_tok_s": limit})
        rows.append(variant)
        row = row or variant
        log(f"  folio {workload}{label}: {res.tokens_per_s:.0f} tok/s, "
            f"{res.output_tokens} tokens in {res.wall_s:.1f} s, profile {res.profile}, graph step {gpu_ms} ms")
    reference = dict(item.split(":") for item in args.peer_reference.split(",") if item)
    if workload in reference:
        peer_tok_s = float(reference[workload])
        rows.append(Row(workload, "hf generate_batch", "earlier run (--peer-reference)", peer_tok_s,
                        vs_limit=peer_tok_s / limit))
        row.vs_peer = row.tok_s / peer_tok_s
    elif args.peers and args.peer_requests:
        k = min(args.peer_requests, len(prompts))
        fn = run_generate_batch if len(set(new_tokens[:k])) == 1 else run_generate_batch_mixed
        peer = peer_call(rows, workload, "hf generate_batch",
                         "", lambda: fn(pair, prompts[:k], new_tokens[:k], sampled=True))
        if peer:
            rows.append(Row(workload, "hf generate_batch", f"{k} of {len(prompts)} requests", peer.tokens_per_s,
                            median_ms(peer.ttft_s), median_ms(peer.tpot_s), vs_limit=peer.tokens_per_s / limit,
                            extra={"wall_s": peer.wall_s, "tokens": peer.output_tokens}))
            row.vs_peer = row.tok_s / peer.tokens_per_s


@contextlib.contextmanager
def sampler_path(path: str):
    """path "general": every step samples through the sampler's general path (the runner's plain path refused),
    for an A/B of folio.sampling.plain in one process; "plain": as the engine runs."""
    if path not in ("plain", "general"):
        raise ValueError(f"--sampler-paths: plain or general, got {path!r}")
    if path == "plain":
        yield
        return
    original = ModelRunner._plain_rows
    ModelRunner._plain_rows = lambda self, *args: None
    try:
        yield
    finally:
        ModelRunner._plain_rows = original


def run_throughput(workload: str, pair: Pair, args, prompts, new_tokens, max_seq_len: int,
                   prefill_ahead: bool, loras: int = 0) -> tuple[RunResult, float | None]:
    """One folio run of a throughput workload on a fresh generator: its result and the graph decode step's GPU
    time at batch 256 (ms). loras: that many random adapters (folio.lora.random_adapter), jobs spread over them."""
    settings = SamplerSettings()
    gen, cache = make_generator(pair, 256 if not args.tiny else 16, max_seq_len, len(prompts),
                                prefill_ahead=prefill_ahead, loras=loras, lora_rank=args.lora_rank)
    model = pair.model
    for k in range(loras):
        gen.loras.add(random_adapter(f"lora{k}", model.config, args.lora_rank, LORA_TARGETS, model.device,
                                     model.dtype, seed=k))
    if loras:
        graphs = gen.runner.graphs
        log(f"  {loras} LoRA adapters of rank {args.lora_rank}; decode graphs with the LoRA update "
            f"{'on' if graphs is not None and graphs.lora_slots is not None else 'off'}")
    gen.warmup()
    dense_before = pair.model.flash_state.dense_calls
    res = run_folio(gen, prompts, new_tokens, settings, pair.model.device, loras)
    log(f"  {workload}: {gen.num_steps} steps, {res.profile['launched_ahead']} launched ahead "
        f"({res.profile['prompt_steps_ahead']} with prompt tokens); prompt attention on cuDNN's dense path in "
        f"{pair.model.flash_state.dense_calls - dense_before} layer calls")
    # (with adapters: the graph with the LoRA update, on the row slots of the last step that used the bucket)
    gpu_ms = decode_step_gpu_ms(gen, min(256, len(prompts))) if pair.model.device.type == "cuda" else None
    if args.profile_host:
        import cProfile
        import pstats

        gen.reset_page_table()
        profiler = cProfile.Profile()
        profiler.enable()
        run_folio(gen, prompts, new_tokens, settings, pair.model.device)
        profiler.disable()
        log(f"  {workload} host profile (cProfile; times inflated by it):")
        stats = pstats.Stats(profiler, stream=sys.stdout)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumtime").print_stats(r"folio/", 45)
    del gen, cache
    return res, gpu_ms


def w2(pair, args, ceilings, rows):
    count = args.requests or 256
    prompts = random_prompts(count, 512 if not args.tiny else 32, pair.model.config.vocab_size, 2)
    n = 256 if not args.tiny else 16
    throughput("W2", pair, args, rows, prompts, [n] * count, f"8B, {count} x (512+256)", 1024, ceilings)


def w3(pair, args, ceilings, rows):
    count = args.requests or 256
    rng = random.Random(3)
    hi = 1024 if not args.tiny else 64
    prompt_lens = [rng.randint(100 if not args.tiny else 4, hi) for _ in range(count)]
    new_tokens = [rng.randint(100 if not args.tiny else 4, hi) for _ in range(count)]
    prompts = random_prompts(count, prompt_lens, pair.model.config.vocab_size, 3)
    throughput("W3", pair, args, rows, prompts, new_tokens, f"1B, {count} x U[100,1024]+U[100,1024]", 2048, ceilings)


def prefill_flops(pair: Pair, tokens: int) -> tuple[float, float]:
    """(matmul FLOPs, attention FLOPs) of a causal prefill of `tokens` tokens (lm_head on the last row only)."""
    cfg = pair.model.config
    linear = 2 * tokens * pair.linear_params + 2 * cfg.hidden_size * cfg.vocab_size
    attention = 2 * 2 * cfg.num_layers * cfg.num_q_heads * cfg.head_dim * (tokens * (tokens + 1) / 2)
    return linear, attention


def w4(pair, args, ceilings, rows):
    lengths = (2048, 8192) if not args.tiny else (64, 128)
    rate = ceilings["matmul_TFLOPs"] * 1e12
    device = pair.model.device
    modes = ["auto", "paged"] if device.type == "cuda" else ["auto"]
    greedy = SamplerSettings.greedy()
    for mode in modes:
        # the same weights with EngineOptions.prefill_attention = mode (a model of its own: it probes afresh)
        model = pair.model.with_options(replace(pair.model.options, prefill_attention=mode))
        FLASH_STATES.append(model.flash_state)
        gen, cache = make_generator(replace(pair, model=model), 1, max(lengths) + 256, 2,
                                    cache_tokens=max(lengths) + 512)
        for length in lengths:
            prompt = random_prompts(1, length, pair.model.config.vocab_size, 4)[0]
            run_folio(gen, [prompt], [1], greedy, device)
            gen.reset_page_table()
            times = []
            for _ in range(3):
                res = run_folio(gen, [prompt], [1], greedy, device)
                gen.reset_page_table()
                times.append(res.wall_s)
            t = statistics.median(times)
            linear, attention = prefill_flops(pair, length)
            cfg = pair.model.config
            q_like = torch.empty(0, cfg.num_q_heads, cfg.head_dim, device=device, dtype=pair.model.dtype)
            used = flash.choose_mode(model.flash_state, q_like, cache.k[0], model.attention_scale, mode)
            rows.append(Row("W4", "folio", f"8B prefill {length} (attention: {used})",
                            length / t, t * 1e3, None, vs_limit=(linear + attention) / t / rate,
                            extra={"TFLOPs_total": (linear + attention) / t / 1e12,
                                   "TFLOPs_matmul_only": linear / t / 1e12, "seconds": t}))
            log(f"  folio W4 {mode} {length}: {t * 1e3:.1f} ms, {(linear + attention) / t / 1e12:.0f} TFLOP/s")
        del gen, cache, model
    if args.peers:
        for length in lengths:
            prompt = random_prompts(1, length, pair.model.config.vocab_size, 4)[0]
            ids = torch.tensor([prompt], device=device)

            def forward():
                with torch.no_grad():
                    pair.hf(input_ids=ids, logits_to_keep=1, use_cache=False)

            t = peer_call(rows, "W4", "hf forward (sdpa)", "", lambda: median_time(forward, device, 3, 1))
            if t:
                linear, attention = prefill_flops(pair, length)
                rows.append(Row("W4", "hf forward (sdpa)", f"8B prefill {length}", length / t, t * 1e3,
                                vs_limit=(linear + attention) / t / rate,
                                extra={"TFLOPs_total": (linear + attention) / t / 1e12}))


def w5(pair, args, ceilings, rows):
    groups = args.groups
    per_group = 16 if not args.tiny else 4
    prefix_len, question, n = (2048, 128, 256) if not args.tiny else (64, 8, 8)
    vocab = pair.model.config.vocab_size
    prompts = []
    for g in range(groups):
        prefix = random_prompts(1, prefix_len, vocab, 100 + g)[0]
        prompts += [prefix + q for q in random_prompts(per_group, question, vocab, 1000 + g)]
    results = {}
    for prefix_cache in (True, False):
        gen, cache = make_generator(pair, 256 if not args.tiny else 16, prefix_len + question + n, len(prompts),
                                    prefix_cache=prefix_cache)
        gen.warmup()
        res = run_folio(gen, prompts, [n] * len(prompts), SamplerSettings(), pair.model.device)
        del gen, cache
        results[prefix_cache] = res
        log(f"  folio W5 prefix_cache={prefix_cache}: {res.tokens_per_s:.0f} tok/s in {res.wall_s:.1f} s, "
            f"profile {res.profile}")
    on, off = results[True], results[False]
    note = f"8B, {groups} groups x {per_group}" + (" (scaled from 64 groups)" if groups != 64 else "")
    if OPTIONS.get("chunk_size"):
        note += f", max_chunk_size {OPTIONS['chunk_size']}"
    rows.append(Row("W5", "folio prefix on", note, on.tokens_per_s, median_ms(on.ttft_s), median_ms(on.tpot_s),
                    vs_peer=on.wall_s and off.wall_s / on.wall_s,
                    extra={"wall_s": on.wall_s, "profile": on.profile, "vs_peer_means": "speed-up over prefix off"}))
    rows.append(Row("W5", "folio prefix off", note, off.tokens_per_s, median_ms(off.ttft_s), median_ms(off.tpot_s),
                    extra={"wall_s": off.wall_s, "profile": off.profile}))


WORKLOADS = {"W1": ("8B", w1), "W2": ("8B", w2), "W3": ("1B", w3), "W4": ("8B", w4), "W5": ("8B", w5)}


def fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def print_table(rows: list, ceilings: dict) -> None:
    print(f"\nceilings: copy {ceilings['copy_GBps']:.0f} GB/s, bf16 matmul {ceilings['matmul_TFLOPs']:.0f} TFLOP/s")
    print("| workload | engine | setting | tok/s | TTFT ms (median) | ms/token (median) | vs peer | vs limit |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.workload} | {r.engine} | {r.note} | {fmt(r.tok_s, ',.0f')} | {fmt(r.ttft_ms, '.1f')} | "
              f"{fmt(r.tpot_ms, '.2f')} | {fmt(r.vs_peer, '.2f')}{'x' if r.vs_peer else ''} | "
              f"{fmt(r.vs_limit and 100 * r.vs_limit, '.0f')}{'%' if r.vs_limit else ''} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="W4,W2,W3,W5,W1")
    parser.add_argument("--no-peers", dest="peers", action="store_false")
    parser.add_argument("--peer-requests", type=int, default=64, help="W2/W3: requests given to the peer")
    parser.add_argument("--peer-reference", default="", help="W2:tok_s,W3:tok_s: peer numbers of an earlier run "
                        "of this script, instead of running the peer again")
    parser.add_argument("--requests", type=int, default=0, help="W2/W3 request count (0: 256)")
    parser.add_argument("--groups", type=int, default=16, help="W5 prefix groups of 16 requests (issue: 64)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--chunk-size", type=int, default=0, help="W2/W3/W5: the generator's max_chunk_size "
                        "(0: its default)")
    parser.add_argument("--no-overlap", action="store_true", help="DynamicGenerator(overlap_emit=False)")
    parser.add_argument("--host-tier", default="write-back", choices=["write-back", "write-through", "off"],
                        help="the generator's host tier: its default (pages copied as evicted), write-through, or none")
    parser.add_argument("--prefill-ahead", default="on", help="W2/W3: DynamicGenerator(prefill_ahead=...); a "
                        "comma list (e.g. on,off,on,off) runs the workload once per entry, an A/B in one process")
    parser.add_argument("--profile-host", action="store_true", help="W2/W3: one more run under cProfile")
    parser.add_argument("--sampler-paths", default="plain", help="W2/W3: plain (as the engine runs), general (the "
                        "sampler's plain path off), or both comma-separated: an A/B in one process")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (smoke test of the script)")
    parser.add_argument("--loras", type=int, default=0, help="W2: run it again with its jobs spread over this many "
                        "random LoRA adapters on q/k/v/o/gate/up/down (e.g. 8)")
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of the --loras adapters")
    parser.add_argument("--lora-prompt-update", default="masked", help="W2 with --loras: how prompt chunks of "
                        "several adapters are updated, 'masked' (the default rule: one masked GEMM pair over every "
                        "row) or 'in-place' (per run); a comma list runs W2 once per entry")
    parser.add_argument("--trace-steps", default="", help="A:B: profile steps [A, B) of each workload's first "
                        "folio run and print the device timeline (busy share, idle gaps, top kernels)")
    # EngineOptions for A/B timing (bench/ab.sh's variants pass these)
    parser.add_argument("--no-pdl", dest="pdl", action="store_false", help="launch kernels without programmatic "
                        "dependent launch (EngineOptions.pdl=False)")
    parser.add_argument("--decode-attention", default="mma", choices=("mma", "simt"),
                        help="decode attention kernel: tensor cores (mma) or CUDA cores (simt)")
    parser.add_argument("--no-prefill-cudnn", dest="prefill_cudnn", action="store_false",
                        help="keep equal-length fresh prompts on FA2 (EngineOptions.prefill_cudnn=False)")
    parser.add_argument("--no-residual-gemm", dest="residual_in_gemm", action="store_false",
                        help="o_proj/down GEMMs do not add into the residual (EngineOptions.residual_in_gemm=False)")
    parser.add_argument("--weight-format", default="bf16", choices=("bf16", "fp8"),
                        help="folio's projection weights: bf16, or FP8 quantized on load (Model weight_format='fp8')")
    parser.add_argument("--kv-format", default="none", choices=("none", "fp8", "q8", "q4"),
                        help="the K/V cache's format (Cache(kv_format=...)); none: the model dtype")
    parser.add_argument("--compare-formats", action="store_true", help="run each workload twice in this process: "
                        "bf16 weights and cache, then FP8 weights with --kv-format (peers in the first run only), "
                        "and print the ratio table last")
    args = parser.parse_args()
    device = torch.device(args.device)
    OPTIONS["no_overlap"] = args.no_overlap
    OPTIONS["host_tier"] = args.host_tier
    OPTIONS["engine_options"] = EngineOptions(pdl=args.pdl, decode_attention=args.decode_attention,
                                              prefill_cudnn=args.prefill_cudnn, residual_in_gemm=args.residual_in_gemm)
    log(f"engine options: {OPTIONS['engine_options']}")
    OPTIONS["chunk_size"] = args.chunk_size
    switches = [v.strip() for v in args.prefill_ahead.split(",")]
    if not set(switches) <= {"on", "off"}:
        parser.error(f"--prefill-ahead takes a comma list of on/off, got {args.prefill_ahead!r}")
    OPTIONS["prefill_ahead"] = [v == "on" for v in switches]
    trace_spec = args.trace_steps
    out_dir = Path(os.environ.get("OUT") or tempfile.gettempdir())
    selected = [w.strip() for w in args.workloads.split(",") if w.strip()]
    torch.manual_seed(0)
    ceilings = measure_ceilings(device)
    log(f"ceilings {ceilings}")

    def save() -> None:
        probes = {str(k): v for state in FLASH_STATES for k, v in state.probed.items()}
        (out_dir / "engine.json").write_text(json.dumps(
            {"ceilings": ceilings, "engine_options": OPTIONS["engine_options"].__dict__,
             "rows": [r.__dict__ for r in rows], "prefill_attention_probes": probes}, indent=1, default=str))

    rows = Rows(save)
    pairs: dict[tuple[str, str], Pair] = {}
    kv_format = None if args.kv_format == "none" else args.kv_format
    formats = [("bf16", None), ("fp8", kv_format)] if args.compare_formats else [(args.weight_format, kv_format)]
    runs: dict[tuple[str, int], list[Row]] = {}  # (workload, format index) -> its rows (--compare-formats)
    for name in selected:
        shape, fn = WORKLOADS[name]
        shape = "tiny" if args.tiny else shape
        for run_idx, (weight_format, kv) in enumerate(formats):
            OPTIONS["weight_format"], OPTIONS["kv_format"] = weight_format, kv
            if (shape, weight_format) not in pairs:
                for other in list(pairs):
                    del pairs[other]
                gc.collect()  # (a generator's reference cycles would keep its cache alive past this point)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                pairs[(shape, weight_format)] = build_pair(shape, device)
            tag = f"[{weight_format} weights, kv {kv or 'model dtype'}] " if args.compare_formats else ""
            run_args = argparse.Namespace(**{**vars(args), "peers": args.peers and run_idx == 0})
            log(f"{name} {tag}...")
            OPTIONS["trace_steps"] = trace_spec
            t0 = time.perf_counter()
            first_row = len(rows)
            try:
                fn(pairs[(shape, weight_format)], run_args, ceilings, rows)
            except Exception as error:  # noqa: BLE001 — report and go on with the next workload
                traceback.print_exc()
                rows.append(Row(name, "folio", f"FAILED: {type(error).__name__}: {str(error)[:160]}"))
            for row in rows[first_row:]:
                row.note = tag + row.note
                row.extra.update(weight_format=weight_format, kv_format=kv)
            runs[(name, run_idx)] = [r for r in rows[first_row:] if r.engine.startswith("folio")]
            log(f"{name} {tag}done in {time.perf_counter() - t0:.1f} s")
            save()
    print_table(rows, ceilings)
    if args.compare_formats:
        print_format_ratios(selected, runs, formats)


def print_format_ratios(selected: list, runs: dict, formats: list) -> None:
    """fp8 / bf16 of each folio row of each workload, matched in the order the workload appends them."""
    label = f"fp8 weights + kv {formats[1][1] or 'model dtype'}"
    print(f"\n{label} vs bf16 (one process, same device)")
    print("| workload | row | tok/s bf16 | tok/s fp8 | tok/s ratio | ms/token bf16 | ms/token fp8 | ms/token ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in selected:
        for base, fp8_row in zip(runs.get((name, 0), []), runs.get((name, 1), [])):
            tok_ratio = fp8_row.tok_s / base.tok_s if base.tok_s and fp8_row.tok_s else None
            ms_ratio = fp8_row.tpot_ms / base.tpot_ms if base.tpot_ms and fp8_row.tpot_ms else None
            setting = base.note.split("] ", 1)[-1]
            print(f"| {name} | {base.engine} {setting} | {fmt(base.tok_s, ',.0f')} | {fmt(fp8_row.tok_s, ',.0f')} | "
                  f"{fmt(tok_ratio, '.2f')} | {fmt(base.tpot_ms, '.2f')} | {fmt(fp8_row.tpot_ms, '.2f')} | "
                  f"{fmt(ms_ratio, '.2f')} |")


if __name__ == "__main__":
    main()
