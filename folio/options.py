"""EngineOptions: every switch of the engine and the native library, frozen and validated in one place.

The engine reads no environment variable: A/B switches that benchmarks flip (programmatic dependent launch, the
decode attention kernel, cuDNN for dense prefill, GEMMs that add into the residual) are options here, passed to
`Model` (which hands the kernel ones to its op set) and to `DynamicGenerator`. Command-line entry points may map
flags or variables onto them; nothing below them looks anything up.
"""

from __future__ import annotations

from dataclasses import dataclass

OPS_BACKENDS = ("auto", "native", "reference")
DECODE_ATTENTION_KERNELS = ("mma", "simt")
PREFILL_ATTENTION_MODES = ("auto", "flash_paged", "flash_gather", "paged")
TP_ALL_REDUCE_MODES = ("auto", "peer", "nccl")


@dataclass(frozen=True)
class EngineOptions:
    """ops_backend: "auto" runs the native kernels (CUDA or CPU module) and needs them on a CUDA device (a clear
        error says how to build them); "native" refuses any fallback; "reference" runs the pure-torch reference
        ops everywhere (slow; on CUDA it also turns off decode graphs, which the reference ops cannot be captured
        in).
    pdl: launch native CUDA kernels with programmatic dependent launch (sm_90+): each kernel's start overlaps the
        previous one's tail.
    decode_attention: "mma" (tensor cores, where the head layout allows) or "simt" (CUDA cores) for decode rows.
    prefill_attention: "auto" picks FlashAttention over the paged cache where it passes a numerical probe, else
        our paged kernel; another mode forces that path (still probed).
    prefill_cudnn: a recurring batch of equal-length fresh prompts runs on cuDNN's fused attention.
    residual_in_gemm: the o_proj and down GEMMs add into the residual stream (cuBLAS beta = 1).
    tp_all_reduce: how a tensor-parallel replica sums its ranks' partial outputs. "auto": through the peers' memory
        (folio.model.peer_all_reduce) where the GPUs have peer access, NCCL for what that does not take; "peer": the
        same, or an error saying why not; "nccl": always the process group. Every rank must be given the same.
    """

    ops_backend: str = "auto"
    pdl: bool = True
    decode_attention: str = "mma"
    prefill_attention: str = "auto"
    prefill_cudnn: bool = True
    residual_in_gemm: bool = True
    tp_all_reduce: str = "auto"

    def __post_init__(self) -> None:
        _check_choice("ops_backend", self.ops_backend, OPS_BACKENDS)
        _check_choice("decode_attention", self.decode_attention, DECODE_ATTENTION_KERNELS)
        _check_choice("prefill_attention", self.prefill_attention, PREFILL_ATTENTION_MODES)
        _check_choice("tp_all_reduce", self.tp_all_reduce, TP_ALL_REDUCE_MODES)
        for name in ("pdl", "prefill_cudnn", "residual_in_gemm"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"EngineOptions.{name} must be a bool, got {getattr(self, name)!r}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"EngineOptions.{name}={value!r}; expected one of {choices}")
