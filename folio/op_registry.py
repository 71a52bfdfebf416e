"""The op registry: every native op's signature, written once. Torch-free.

Each entry names an op, its arguments in order (the names of folio/reference_ops.py and of both pybind modules),
the defaults of its trailing arguments, which native modules implement it, the CUDA launch options the CUDA module
takes after its arguments (keyword-only), and where its pure-torch reference lives.

What follows from it:
- folio.ops.OpSet has one method per entry, generated from it (no hand-written wrapper re-lists the arguments);
- tests/test_op_registry.py checks against it the signatures of folio.reference_ops, of the built CPU module
  (pybind's docstrings), of native/bindings/op_signatures.h (the one def list of both binding files), and of the
  built CUDA module on a GPU machine; an op in a binding but not here fails that test.

References: the model ops' are folio.reference_ops (same signature, swapped in per op by folio.ops). The sampling
kernels (sample_rows, apply_penalties, mask_tokens) have none there: their semantics are folio.sampling's torch
code, which the sampler runs itself where the kernels are missing, and their per-row oracles live in
tests/native_reference.py. An OpSet raises for such an op where it has no native kernel; callers ask
`OpSet.native(...)` first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# Device types that have a native module, and the module's import name.
NATIVE_MODULES = MappingProxyType({"cuda": "folio._native_cuda", "cpu": "folio._native_cpu"})

# CUDA launch options: each is a keyword-only argument of the CUDA ops that list it, with this default (the default
# of the EngineOptions field it comes from; folio.ops passes it explicitly, see OpSet).
#   pdl:     programmatic dependent launch (EngineOptions.pdl)
#   use_mma: decode attention on tensor cores where the kernel applies (EngineOptions.decode_attention == "mma")
LAUNCH_OPTION_DEFAULTS = MappingProxyType({"pdl": True, "use_mma": True})

REFERENCE_OPS = "folio.reference_ops"
SAMPLING_REFERENCE = "tests/native_reference.py (folio.sampling runs its own torch code without the kernels)"
# Ops that order the device's stream after the host rather than compute: no reference; where the kernel is missing,
# their callers take a path that does not need them.
SYNC_REFERENCE = "none: a stream wait on the host (tests/test_host_gate_gpu.py)"


@dataclass(frozen=True)
class OpSpec:
    """One native op. The first argument is always a tensor on the device the op runs on (dispatch reads it)."""

    name: str
    args: tuple[str, ...]
    defaults: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # trailing args -> default
    native: frozenset[str] = frozenset({"cpu", "cuda"})  # device types whose native module implements the op
    launch: tuple[str, ...] = ()  # CUDA launch options (LAUNCH_OPTION_DEFAULTS), keyword-only after `args`
    reference: str = REFERENCE_OPS  # where its pure-torch reference is; only REFERENCE_OPS is dispatched to

    @property
    def has_reference_op(self) -> bool:
        """Whether folio.reference_ops holds a function of this name with this signature (the fallback)."""
        return self.reference == REFERENCE_OPS


def _op(name: str, *args: str, native: tuple[str, ...] = ("cpu", "cuda"), launch: tuple[str, ...] = (),
        reference: str = REFERENCE_OPS, **defaults: Any) -> OpSpec:
    unknown = set(defaults) - set(args)
    if unknown or any(a not in LAUNCH_OPTION_DEFAULTS for a in launch):
        raise ValueError(f"op {name}: defaults {sorted(unknown)} / launch options {launch} do not fit its arguments")
    return OpSpec(name, args, MappingProxyType(defaults), frozenset(native), launch, reference)


_PDL = ("pdl",)

OPS: tuple[OpSpec, ...] = (
    _op("rms_norm", "x", "weight", "eps", launch=_PDL),
    _op("fused_add_rms_norm", "x", "residual", "weight", "eps", launch=_PDL),
    _op("silu_and_mul", "x", launch=_PDL),
    _op("rotary_cache_write", "q", "k", "v", "positions", "inv_freq", "k_cache", "v_cache", "slot_mapping",
        launch=_PDL),
    # window: int tokens, 0 = the whole context; softcap: float, 0.0 = none (see folio.reference_ops)
    _op("paged_attention", "q", "k_cache", "v_cache", "block_tables", "cu_seqlens_q", "context_lens", "scale",
        "max_q_len", "window", "softcap", launch=_PDL),
    _op("paged_attention_decode", "q", "k_cache", "v_cache", "block_tables", "context_lens", "scale", "window",
        "softcap", launch=("pdl", "use_mma")),
    _op("copy_page_slots", "k_cache", "v_cache", "src_page", "dst_page", "num_slots"),
    # Quantized K/V caches (folio.kv_formats): uint8 codes and float16 scales; kv_format the int code of
    # KV_FORMAT_CODES. Reference: the ops above over the dequantized cache (folio.reference_kv_quant).
    _op("rotary_cache_write_quant", "q", "k", "v", "positions", "inv_freq", "k_cache", "v_cache", "k_scale",
        "v_scale", "slot_mapping", "kv_format", native=("cuda",), launch=_PDL),
    _op("paged_attention_quant", "q", "k_cache", "v_cache", "k_scale", "v_scale", "block_tables", "cu_seqlens_q",
        "context_lens", "scale", "max_q_len", "window", "softcap", "kv_format", native=("cuda",), launch=_PDL),
    _op("paged_attention_decode_quant", "q", "k_cache", "v_cache", "k_scale", "v_scale", "block_tables",
        "context_lens", "scale", "window", "softcap", "kv_format", native=("cuda",), launch=_PDL),
    # The CUDA module's decode GEMV (at most LINEAR_MAX_ROWS rows); the reference is F.linear itself.
    _op("linear", "x", "weight", "bias", "silu_gate", native=("cuda",), launch=_PDL, bias=None, silu_gate=False),
    # The FP8-weight decode GEMV (folio.model.fp8: float8_e4m3fn weight, fp32 per-output-channel scales).
    _op("linear_fp8", "x", "weight", "weight_scale", "bias", "silu_gate", native=("cuda",), launch=_PDL, bias=None,
        silu_gate=False),
    _op("quantize_rows_fp8", "x", native=("cuda",), launch=_PDL),
    _op("sample_rows", "logits", "temperature", "top_k", "top_p", "min_p", "u", reference=SAMPLING_REFERENCE),
    _op("apply_penalties", "logits", "history", "rep", "freq", "pres", "sustain", "decay",
        reference=SAMPLING_REFERENCE),
    _op("mask_tokens", "logits", "token_ids", reference=SAMPLING_REFERENCE),
    # device: any tensor on the device whose current stream waits; flag: a pinned int64 host tensor [1]
    _op("wait_host_value", "device", "flag", "value", "timeout_ns", native=("cuda",), reference=SYNC_REFERENCE),
)

BY_NAME: MappingProxyType = MappingProxyType({spec.name: spec for spec in OPS})
