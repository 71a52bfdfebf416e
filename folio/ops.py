"""Op dispatch: native CUDA / native CPU kernels when built, the torch reference otherwise.

This is the only module that imports the compiled extensions (`folio._native_cuda`, `folio._native_cpu`).
Each op is looked up per call, per device: a native module that exports a function with the op's name replaces the
reference for tensors on its device; ops it does not (yet) export fall back to `folio.reference_ops`.
Native functions take exactly the reference's arguments.

`use_backend("reference" | "native" | "auto")` forces a choice: "reference" never touches native code, "native"
raises `NativeUnavailableError` instead of falling back, "auto" (the default) prefers native.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from functools import lru_cache
from types import ModuleType
from typing import Any

import torch

from folio import reference_ops

OP_NAMES = (
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "rotary_cache_write",
    "paged_attention",
    "paged_attention_decode",
    "copy_page_slots",
    "linear",
)
BACKENDS = ("auto", "native", "reference")
NATIVE_MODULES = {"cuda": "folio._native_cuda", "cpu": "folio._native_cpu"}


class NativeUnavailableError(RuntimeError):
    """Backend "native" was forced but no native kernel exists for an op on a device."""


class _BackendChoice:
    """The process-wide backend choice.

    Process-wide on purpose (like torch's default dtype): the engine loop runs in its own thread, and a choice
    made by the caller must reach it, which a thread-local or context variable would not.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.name = "auto"

    def swap(self, name: str) -> str:
        with self._lock:
            previous, self.name = self.name, name
        return previous


_choice = _BackendChoice()


class use_backend:  # noqa: N801 - reads as a function: use_backend("reference") or `with use_backend(...):`
    """Select the op backend. Takes effect at once; as a context manager, restores the previous one on exit."""

    def __init__(self, name: str) -> None:
        if name not in BACKENDS:
            raise ValueError(f"unknown ops backend {name!r}; expected one of {BACKENDS}")
        self.name = name
        self._previous = _choice.swap(name)

    def __enter__(self) -> use_backend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        _choice.swap(self._previous)


def current_backend() -> str:
    return _choice.name


@lru_cache(maxsize=None)
def _load_native(device_type: str) -> ModuleType | None:
    """The compiled module for a device type, or None when it was not built.

    A module that exists but fails to import (ABI mismatch, missing symbol) raises: a broken build must not
    silently turn into the slow reference path.
    """
    module_name = NATIVE_MODULES.get(device_type)
    if module_name is None:
        return None
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            return None
        raise


def _first_device_type(args: tuple[Any, ...]) -> str:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.type
    raise TypeError("op called without any tensor argument")


def resolve(op_name: str, device_type: str) -> Callable[..., Any]:
    """The implementation that a call of `op_name` on `device_type` tensors uses under the current backend."""
    if op_name not in OP_NAMES:
        raise ValueError(f"unknown op {op_name!r}; expected one of {OP_NAMES}")
    backend = _choice.name
    if backend != "reference":
        module = _load_native(device_type)
        native_fn = getattr(module, op_name, None) if module is not None else None
        if native_fn is not None:
            return native_fn
        if backend == "native":
            where = NATIVE_MODULES.get(device_type, f"(no native module for device type {device_type!r})")
            state = "not built" if module is None else f"built without {op_name!r}"
            raise NativeUnavailableError(f"backend 'native' forced but {where} is {state}")
    return getattr(reference_ops, op_name)


# Sampling kernels: their reference is folio.sampling's torch code (same definition; the native sampler may decide
# differently only where a cut-off falls within rounding of a boundary), so they have no entry in reference_ops and
# callers ask for them explicitly.
SAMPLING_OP_NAMES = ("sample_rows", "apply_penalties")


def native_sampling_op(op_name: str, device_type: str) -> Callable[..., Any] | None:
    """The native kernel of a sampling op for `device_type` tensors, or None when backend "reference" is chosen or
    no native module exports it (the caller then runs folio.sampling's torch code)."""
    if op_name not in SAMPLING_OP_NAMES:
        raise ValueError(f"unknown sampling op {op_name!r}; expected one of {SAMPLING_OP_NAMES}")
    if _choice.name == "reference":
        return None
    module = _load_native(device_type)
    return getattr(module, op_name, None) if module is not None else None


def implementation_name(op_name: str, device_type: str) -> str:
    """"native" or "reference": which one `resolve` picks (for tests, benchmarks and logs)."""
    return "reference" if resolve(op_name, device_type) is getattr(reference_ops, op_name) else "native"


def _call(op_name: str, args: tuple[Any, ...]) -> Any:
    return resolve(op_name, _first_device_type(args))(*args)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _call("rms_norm", (x, weight, eps))


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _call("fused_add_rms_norm", (x, residual, weight, eps))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _call("silu_and_mul", (x,))


def rotary_cache_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Rotary on q [T, Hq, D] and k [T, Hkv, D] in place, then k and v [T, Hkv, D] into the paged caches.

    q, k and v need a dense last dim only: the column slices of one fused [T, (Hq + 2*Hkv) * D] QKV output, each
    `.unflatten(-1, (H, D))`, go in as they are and q, k are rotated inside that buffer. The native ops refuse
    layouts where q or k share an element with themselves or with each other or v (ValueError).
    """
    _call("rotary_cache_write", (q, k, v, positions, inv_freq, k_cache, v_cache, slot_mapping))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_q_len: int,
) -> torch.Tensor:
    return _call(
        "paged_attention", (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_q_len)
    )


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return _call("paged_attention_decode", (q, k_cache, v_cache, block_tables, context_lens, scale))


def copy_page_slots(
    k_cache: torch.Tensor, v_cache: torch.Tensor, src_page: int, dst_page: int, num_slots: int
) -> None:
    _call("copy_page_slots", (k_cache, v_cache, src_page, dst_page, num_slots))


# The native CUDA linear is a matrix-vector product for decode (native/cuda/gemv.cu): one kernel that streams the
# weight once, where cuBLAS runs split-K GEMMs for a few rows. It refuses more rows than this.
LINEAR_MAX_ROWS = 8
_LINEAR_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_gate: bool = False
) -> torch.Tensor:
    """F.linear: x [M, K], weight [N, K], bias [N] or None -> [M, N] in x.dtype.

    silu_gate: weight is a fused gate_up ([gate; up] halves) and the result is silu_and_mul of the product,
    [M, N / 2] (the native kernel gates in its epilogue, bit-identical to the two ops; 16-bit dtypes there).

    The native CUDA kernel takes at most LINEAR_MAX_ROWS rows (it raises otherwise); callers use it where
    `linear_supported` holds and F.linear elsewhere."""
    return _call("linear", (x, weight, bias, silu_gate))


def linear_supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the native CUDA linear takes these arguments on its fast path. Host-side checks only (no device access,
    capture-safe), the cheapest first:

    x [M, K] with M <= LINEAR_MAX_ROWS and weight [N, K] on one CUDA device, of one dtype (bfloat16, float16 or
    float32); K a multiple of 16 bytes' worth of elements (8, float32: 4); last dims dense and rows starting on 16
    bytes; bias None or a contiguous [N] of that dtype on that device.

    The kernel also accepts other K, row strides and alignments (through an element-wise path, slower); this check
    leaves those to F.linear.
    """
    if x.dim() != 2 or x.shape[0] > LINEAR_MAX_ROWS or x.device.type != "cuda":
        return False
    if x.dtype not in _LINEAR_DTYPES or weight.dtype != x.dtype or weight.dim() != 2 or weight.device != x.device:
        return False
    per_16_bytes = 16 // x.element_size()
    if weight.shape[1] != x.shape[1] or x.shape[1] % per_16_bytes != 0:
        return False
    if not (_aligned_dense_rows(x, per_16_bytes) and _aligned_dense_rows(weight, per_16_bytes)):
        return False
    return bias is None or (
        bias.dtype == x.dtype and bias.shape == (weight.shape[0],) and bias.device == x.device
        and bias.is_contiguous()
    )


def _aligned_dense_rows(t: torch.Tensor, per_16_bytes: int) -> bool:
    """A 2-D tensor whose last dim is dense and whose every row starts on a 16-byte boundary."""
    dense = t.stride(1) == 1 or t.shape[1] <= 1
    row_stride_ok = t.shape[0] <= 1 or t.stride(0) % per_16_bytes == 0
    return dense and row_stride_ok and t.data_ptr() % 16 == 0
