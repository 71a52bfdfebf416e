"""Mixture-of-experts decode (issue 22): a Mixtral-shaped model, scaled down in depth to fit one card, decoding in
batches, each step measured against the bytes and FLOPs it must move.

    python bench/moe.py [--layers 8] [--batches 1,8,32,128,256] [--new-tokens 64]
    python bench/moe.py --device cpu --tiny          (a smoke test of the script itself, no GPU)

The model: Mixtral 8x7B's layer (hidden 4096, 32 query / 8 K/V heads, 8 experts of intermediate 14336, top-2
routing), `--layers` of them, random bf16 weights made on the GPU under the checkpoint's tensor names
(`block_sparse_moe.experts.N.w1/w2/w3`) and loaded with Model.from_state_dict.

What a decode step of B rows must move: every attention weight, the router, lm_head, the K/V of the context, and
the weights of each expert that at least one row routes to. With random weights the router spreads rows evenly,
so a layer touches E * (1 - (1 - k/E)^B) experts on average (B = 1: 2 of 8; B >= 16: nearly all). FLOPs: 2 x B x
(attention + k experts + lm_head) parameters. The step's floor is the larger of bytes / copy bandwidth and FLOPs /
matmul rate, both measured in the same run (bench/engine.py's measure_ceilings); the table gives the step's time
and that floor's share of it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from folio import Cache, DynamicGenerator, DynamicJob, Model, ModelConfig, SamplerSettings  # noqa: E402


def _engine_bench():
    """bench/engine.py's helpers (ceilings, the synthetic tokenizer, the step loop), loaded from its file."""
    spec = importlib.util.spec_from_file_location("engine_bench", ROOT / "bench" / "engine.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


MIXTRAL = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)
TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=4, num_experts_per_tok=2, vocab_size=1000)


def build_model(shape: dict, num_layers: int, device: torch.device, dtype: torch.dtype) -> tuple[Model, dict]:
    """Random weights under Mixtral's checkpoint names, made on `device`."""
    h, inter, experts = shape["hidden_size"], shape["intermediate_size"], shape["num_local_experts"]
    head_dim = h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    raw = dict(shape, architectures=["MixtralForCausalLM"], model_type="mixtral", num_hidden_layers=num_layers,
               head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=32768,
               sliding_window=None, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
               dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    config = ModelConfig.from_dict(raw)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*size: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*size, device=device, dtype=dtype, generator=gen) * scale)

    state = {"model.embed_tokens.weight": rand(shape["vocab_size"], h), "model.norm.weight": 1 + rand(h),
             "lm_head.weight": rand(shape["vocab_size"], h)}
    for layer in range(num_layers):
        p = f"model.layers.{layer}."
        state.update({p + "input_layernorm.weight": 1 + rand(h), p + "post_attention_layernorm.weight": 1 + rand(h),
                      p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
                      p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
                      p + "block_sparse_moe.gate.weight": rand(experts, h, scale=0.5)})
        for e in range(experts):
            e_p = f"{p}block_sparse_moe.experts.{e}."
            state.update({e_p + "w1.weight": rand(inter, h), e_p + "w3.weight": rand(inter, h),
                          e_p + "w2.weight": rand(h, inter)})
    model = Model.from_state_dict(config, state, device=device, dtype=dtype)
    del state
    element = torch.empty((), dtype=dtype).element_size()
    sizes = {"attention_params": num_layers * (h * (q + 2 * kv) + q * h + experts * h),
             "expert_params": 3 * h * inter, "head_params": shape["vocab_size"] * h, "element": element,
             "kv_bytes_per_token": 2 * num_layers * kv * element}
    return model, sizes


def step_floor_ms(sizes: dict, shape: dict, num_layers: int, batch: int, context: int, ceilings: dict) -> dict:
    experts, k = shape["num_local_experts"], shape["num_experts_per_tok"]
    touched = experts * (1 - (1 - k / experts) ** batch)  # expected experts one layer reads
    weight_bytes = (sizes["attention_params"] + sizes["head_params"]
                    + num_layers * touched * sizes["expert_params"]) * sizes["element"]
    kv_bytes = batch * context * sizes["kv_bytes_per_token"]
    flops = 2 * batch * (sizes["attention_params"] + num_layers * k * sizes["expert_params"] + sizes["head_params"])
    bytes_ms = (weight_bytes + kv_bytes) / (ceilings["copy_GBps"] * 1e9) * 1e3
    flops_ms = flops / (ceilings["matmul_TFLOPs"] * 1e12) * 1e3
    return {"experts_touched": round(touched, 2), "bytes_GB": round((weight_bytes + kv_bytes) / 1e9, 3),
            "GFLOP": round(flops / 1e9, 1), "bytes_floor_ms": bytes_ms, "flops_floor_ms": flops_ms}


def decode_step_ms(eb, model: Model, tokenizer, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Median wall time of the decode-only steps of `batch` jobs generating `new_tokens` each."""
    cache = Cache(model, num_tokens=-(-batch * (prompt_len + new_tokens + 256) // 256) * 256)
    gen = DynamicGenerator(model, cache, tokenizer, max_batch_size=batch, max_seq_len=prompt_len + new_tokens + 8,
                           max_queued_jobs=batch + 1)
    vocab = model.config.vocab_size
    jobs = [DynamicJob(input_ids=[(7 * i + 13 * j) % (vocab - 2) + 2 for j in range(prompt_len)],
                       max_new_tokens=new_tokens, stop_conditions=[], gen_settings=SamplerSettings(), seed=i)
            for i in range(batch)]
    gen.enqueue(jobs)
    step_ms = []
    last_end = None
    while gen.num_remaining_jobs():
        _, stats = gen.step()  # no sync: steps overlap as they do when serving; the steady spacing is the cost
        end = time.perf_counter()
        if last_end is not None and stats.num_prompt_tokens == 0 and stats.num_decode_rows == batch:
            step_ms.append((end - last_end) * 1e3)
        last_end = end
    del gen, cache
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    step_ms.sort()
    return step_ms[len(step_ms) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", default="1,8,32,128,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    eb = _engine_bench()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TINY if args.tiny else MIXTRAL
    ceilings = eb.measure_ceilings(device)
    model, sizes = build_model(shape, args.layers, device, dtype)
    tokenizer = eb.synthetic_tokenizer(shape["vocab_size"])
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        ms = decode_step_ms(eb, model, tokenizer, batch, args.prompt_len, args.new_tokens)
        floor = step_floor_ms(sizes, shape, args.layers, batch, args.prompt_len + args.new_tokens // 2, ceilings)
        bound_ms = max(floor["bytes_floor_ms"], floor["flops_floor_ms"])
        rows.append({"batch": batch, "step_ms": round(ms, 3), "tok_s": round(batch / ms * 1e3), **floor,
                     "floor_share": round(bound_ms / ms, 3)})
        eb.log(f"batch {batch}: {rows[-1]}")
    out = {"ceilings": ceilings, "layers": args.layers, "shape": shape, "rows": rows,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "moe.json").write_text(json.dumps(out, indent=1))
    print(f"\nMoE decode, {args.layers} Mixtral-shaped layers, {out['device']}: copy {ceilings['copy_GBps']:.0f} GB/s, "
          f"matmul {ceilings['matmul_TFLOPs']:.0f} TFLOP/s")
    print("| batch | step ms | tok/s | experts/layer | GB moved | GFLOP | bytes floor ms | FLOPs floor ms "
          "| floor / step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['step_ms']:.2f} | {r['tok_s']:,} | {r['experts_touched']} | {r['bytes_GB']} | "
              f"{r['GFLOP']} | {r['bytes_floor_ms']:.2f} | {r['flops_floor_ms']:.2f} | {r['floor_share']:.2f} |")


if __name__ == "__main__":
    main()
