"""Prefill attention backends side by side: torch's FlashAttention-2 (varlen, what folio.model.flash runs) against
cuDNN's fused attention (varlen, and dense batched for equal lengths), on the shapes of folio's prompt steps.

    python bench/prefill_attention.py        (needs a CUDA device; writes $OUT/prefill_attention.json)

Why: W2's prompt steps (32 fresh 512-token prompts per 16384-token step) spend about 5% of their time in FA2,
which runs those short causal sequences at ~115 TFLOP/s; a faster backend is worth up to ~1.5% of W2.
Layout: Llama-3-8B heads (32 query, 8 kv, head_dim 128, bf16, causal). q/k/v are slices of one fused
[T, (32 + 2 * 8) * 128] buffer, as the model's QKV projection leaves them; each backend gets them as it needs
(dense copies timed separately where it needs them). Each result is checked against FA2's before it is timed.
FLOPs counted: 4 * D * Hq * sum over sequences of L * (L + 1) / 2 (causal QK^T and PV).
Also: the first call of each new shape (cuDNN builds an execution plan per shape; a serving system sees many).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels import time_events  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5


def timed(fn) -> float:
    """Median seconds per call after three warm-up calls (CUDA events, bench/kernels.py's timer)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return time_events(fn, iterations=20)


def fused_qkv(lengths: list[int], gen: torch.Generator):
    total = sum(lengths)
    width = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    fused = torch.randn(total, width, device="cuda", dtype=DTYPE, generator=gen)
    q, k, v = fused.split([Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=1)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device="cuda")
    cu[1:] = torch.tensor(lengths, device="cuda").cumsum(0)
    return (q.view(total, Q_HEADS, HEAD_DIM), k.view(total, KV_HEADS, HEAD_DIM), v.view(total, KV_HEADS, HEAD_DIM),
            cu)


def fa2(q, k, v, cu, max_len):
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False,
                                                   scale=SCALE)[0]


def cudnn_varlen(q, k, v, cu, max_len):
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, False, 0.0, True, False,
                                                   scale=SCALE)[0]


def cudnn_dense(q, k, v, batch, length):
    """Equal lengths only: what folio.model.flash runs (its output flattened back to [T, H, D], copied only where
    cuDNN's layout needs it)."""
    from folio.model.flash import _cudnn_dense

    return _cudnn_dense(q, k, v, batch, length, SCALE)


def plan_build_overlap(gen: torch.Generator) -> dict:
    """Does cuDNN's plan build for a new shape (host work) overlap the GPU's queued work? Queue ~0.2 s of matmuls,
    then call a never-seen shape: if the build does not block the device, the total stays at the matmuls' time."""
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE, generator=gen)
    q, k, v, _ = fused_qkv([384] * 19, gen)

    def matmuls():
        for _ in range(150):
            a @ a

    matmuls()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    matmuls()
    torch.cuda.synchronize()
    alone = time.perf_counter() - t0
    t0 = time.perf_counter()
    matmuls()
    t1 = time.perf_counter()
    cudnn_dense(q, k, v, 19, 384)
    t2 = time.perf_counter()
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    return {"matmuls_alone_ms": alone * 1e3, "new_shape_host_ms": (t2 - t1) * 1e3, "together_ms": total * 1e3}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def run_case(name: str, lengths: list[int], gen: torch.Generator, with_varlen: bool = False) -> dict:
    q, k, v, cu = fused_qkv(lengths, gen)
    max_len = max(lengths)
    flops = 4 * HEAD_DIM * Q_HEADS * sum(n * (n + 1) // 2 for n in lengths)
    want = fa2(q, k, v, cu, max_len)
    dense = q.contiguous(), k.contiguous(), v.contiguous()
    variants = {"fa2 strided": lambda: fa2(q, k, v, cu, max_len)}
    if len(set(lengths)) == 1:
        variants["cudnn dense strided"] = lambda: cudnn_dense(q, k, v, len(lengths), lengths[0])
        variants["cudnn dense copies"] = lambda: cudnn_dense(*dense, len(lengths), lengths[0])
    if with_varlen:
        variants["cudnn varlen"] = lambda: cudnn_varlen(*dense, cu, max_len)
    result = {"case": name, "tokens": sum(lengths), "sequences": len(lengths), "variants": {}}
    for label, fn in variants.items():
        entry: dict = {}
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = fn()
            torch.cuda.synchronize()
            entry["first_call_ms"] = (time.perf_counter() - t0) * 1e3
            entry["rel_err_vs_fa2"] = rel_err(got, want)
            if entry["rel_err_vs_fa2"] > 2e-2:
                entry["error"] = "wrong result"
            else:
                seconds = timed(fn)
                entry["ms"] = seconds * 1e3
                entry["tflops"] = flops / seconds / 1e12
        except Exception as exc:  # a backend that refuses these inputs is a result too
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        result["variants"][label] = entry
    return result


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cudnn {torch.backends.cudnn.version()}")
    cases = [
        ("W2 step: 32 x 512", [512] * 32),
        ("mixed: 16 x U[100,1024]", [int(x) for x in torch.randint(100, 1025, (16,), generator=torch.Generator()
                                                                    .manual_seed(1))]),
        ("8 x 128", [128] * 8),
        ("4 x 256", [256] * 4),
        ("2 x 512", [512] * 2),
        ("1 x 1024", [1024]),
        ("W4: 1 x 2048", [2048]),
        ("W4: 1 x 8192", [8192]),
    ]
    results = [run_case(name, lengths, gen, with_varlen=i == 0) for i, (name, lengths) in enumerate(cases)]
    overlap = plan_build_overlap(gen)
    print(f"\n{'case':34} {'variant':26} {'ms':>8} {'TFLOP/s':>8} {'first ms':>9} {'err':>8}")
    for res in results:
        for label, e in res["variants"].items():
            if "error" in e and "ms" not in e:
                print(f"{res['case']:34} {label:26} {e['error']}")
                continue
            print(f"{res['case']:34} {label:26} {e['ms']:8.3f} {e['tflops']:8.1f} {e['first_call_ms']:9.1f} "
                  f"{e['rel_err_vs_fa2']:8.1e}")
    print("plan build under queued GPU work: " + ", ".join(f"{k} {v:.1f}" for k, v in overlap.items()))
    out = Path(os.environ.get("OUT", "."))
    (out / "prefill_attention.json").write_text(json.dumps({"cases": results, "plan_build": overlap}, indent=1))


if __name__ == "__main__":
    main()
