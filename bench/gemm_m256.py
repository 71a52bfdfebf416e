"""The decode-phase GEMMs of W2 (Llama-3-8B shapes at batch 256) under torch's BLAS settings.

    python bench/gemm_m256.py        (CUDA only; about a minute; writes $OUT/gemm_m256.json when OUT is set)

In a W2 decode step the projections run as cuBLAS GEMMs with M = 256 rows, and the narrow ones (qkv: N 6144,
o_proj: N 4096) reach well under half of the matmul peak: too few output tiles for 132 SMs, so cuBLAS's heuristic
splits K. This script times each projection shape, as F.linear does it, under:
  default                  torch's defaults;
  cublaslt                 torch.backends.cuda.preferred_blas_library("cublaslt");
  no_reduced_reduction     allow_bf16_reduced_precision_reduction = False;
  tunable                  torch.cuda.tunable (TunableOp), tuned on each shape first, where this torch has it.
Times are medians of CUDA-graph replays of 20 calls, on weights bigger than the L2 cache (a fresh weight per
call), against FLOPs = 2 M N K.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels import time_graph  # noqa: E402  (bench/kernels.py: CUDA-graph replay timing)

M = 256
SHAPES = {  # name: (N, K)
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
CALLS = 20


def time_linear(x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Median seconds per F.linear call from graph replays that cycle through `weights`."""
    cycle = itertools.cycle(weights)
    return time_graph(lambda: F.linear(x, next(cycle)), calls_per_replay=CALLS, replays=10)


def sweep(label: str, inputs: dict) -> dict:
    out = {}
    for name, (x, weights) in inputs.items():
        n, k = SHAPES[name]
        seconds = time_linear(x, weights)
        out[name] = {"us": seconds * 1e6, "tflops": 2 * M * n * k / seconds / 1e12}
    total = sum(r["us"] for r in out.values())
    print(f"{label:>22}: " + "  ".join(f"{n} {r['us']:7.1f} us {r['tflops']:4.0f} TF/s" for n, r in out.items())
          + f"  | sum {total:7.1f} us")
    return out


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench/gemm_m256.py needs a CUDA device")
    torch.manual_seed(0)
    inputs = {}
    for name, (n, k) in SHAPES.items():
        copies = max(1, min(4, (200 << 20) // (n * k * 2) + 1))  # >= 200 MB of weights per shape: out of L2
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        inputs[name] = (torch.randn(M, k, device="cuda", dtype=torch.bfloat16), weights)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: F.linear at M = {M}, bf16")
    results = {"default": sweep("default", inputs)}

    previous = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        results["cublaslt"] = sweep("cublaslt", inputs)
    except Exception as e:  # noqa: BLE001 — a setting this torch lacks is reported, not fatal
        print(f"cublaslt: {e!r}")
    finally:
        torch.backends.cuda.preferred_blas_library(previous)

    flag = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    results["no_reduced_reduction"] = sweep("no_reduced_reduction", inputs)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = flag

    tunable = getattr(torch.cuda, "tunable", None)
    if tunable is None:
        print("tunable: torch.cuda.tunable is missing")
    else:
        try:
            tunable.enable(True)
            tunable.tuning_enable(True)
            tunable.set_max_tuning_duration(200)  # ms per shape
            tunable.set_filename(str(Path(os.environ.get("OUT", "/tmp"), "tunableop_results%d.csv")))
            for x, weights in inputs.values():
                F.linear(x, weights[0])  # tunes this shape (outside any graph capture)
            torch.cuda.synchronize()
            tunable.tuning_enable(False)
            results["tunable"] = sweep("tunable (tuned)", inputs)
            results["tunable_results"] = [str(r) for r in tunable.get_results()]
        except Exception as e:  # noqa: BLE001
            print(f"tunable: {e!r}")
        finally:
            tunable.enable(False)

    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "gemm_m256.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
