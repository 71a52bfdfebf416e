"""Op dispatch: native CUDA / native CPU kernels, or the torch reference, chosen per OpSet.

This is the only module that imports the compiled extensions (`folio._native_cuda`, `folio._native_cpu`).

An `OpSet` is one backend choice with its CUDA launch options; each `Model` owns one (`model.ops`, built from its
EngineOptions). It has one method per op of folio.op_registry, generated from the registry, with the reference's
arguments. A call resolves the implementation for the device of its first (tensor) argument once per OpSet and
device type:
- backend "auto": the native module's kernel where the module exports it, else folio.reference_ops. On a CUDA
  device the native CUDA module must exist (`check_device`; a model checks it when built): the reference ops
  cannot be captured in CUDA graphs, and running them there by accident is the slow path nobody asked for.
- "native": the native kernel or NativeUnavailableError, never the reference.
- "reference": folio.reference_ops everywhere (explicitly chosen, e.g. for tests on CUDA).
Native CUDA kernels get the OpSet's launch options as keyword arguments (registry: `launch`): `pdl` and, for
paged_attention_decode, `use_mma`. Nothing here reads the environment or holds a process-wide switch.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from folio import reference_ops
from folio.op_registry import BY_NAME, NATIVE_MODULES, OPS, OpSpec
from folio.options import DECODE_ATTENTION_KERNELS, OPS_BACKENDS, EngineOptions

BUILD_HINT = ("build it with `pip install --no-build-isolation -e .` (or `python setup.py build_ext --inplace`) on a "
              "machine with nvcc and a CUDA build of torch")


class NativeUnavailableError(RuntimeError):
    """An op set needs a native kernel that is not there: backend "native" without one, or an op with no reference
    (the sampling kernels) without one."""


def load_native(device_type: str) -> ModuleType | None:
    """The compiled module for a device type, or None when it was not built.

    A module that exists but fails to import (ABI mismatch, missing symbol) raises: a broken build must not
    silently turn into the slow reference path. (Not cached here: Python caches imported modules, and an OpSet
    asks once per op and device type.)
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


def missing_native_error(backend: str, device_type: str, module_available: bool) -> str | None:
    """Why an op set with `backend` cannot run a model on `device_type` whose native module is (not) available, or
    None when it can. "auto" needs the module on CUDA only (the CPU falls back to the reference per op)."""
    if backend == "reference" or module_available or (backend == "auto" and device_type != "cuda"):
        return None
    module_name = NATIVE_MODULES.get(device_type)
    if module_name is None:
        return (f"ops_backend={backend!r}: there is no native module for device type {device_type!r}; "
                f"use EngineOptions(ops_backend='reference')")
    return (f"{module_name} is not built (not importable), and EngineOptions(ops_backend={backend!r}) runs the native "
            f"kernels on a {device_type} device: {BUILD_HINT}. To run the pure-torch reference ops instead (slow; "
            f"no CUDA graphs), pass EngineOptions(ops_backend='reference').")


class OpSet:
    """The ops under one backend ("auto", "native" or "reference") with the CUDA launch options: pdl (programmatic
    dependent launch) and decode_attention ("mma": tensor cores where the kernel applies, "simt": CUDA cores).
    One method per registry op (see the module docstring); resolved implementations are cached per instance."""

    def __init__(self, backend: str = "auto", pdl: bool = True, decode_attention: str = "mma") -> None:
        if backend not in OPS_BACKENDS:
            raise ValueError(f"unknown ops backend {backend!r}; expected one of {OPS_BACKENDS}")
        if decode_attention not in DECODE_ATTENTION_KERNELS:
            raise ValueError(f"unknown decode_attention {decode_attention!r}; expected one of "
                             f"{DECODE_ATTENTION_KERNELS}")
        if not isinstance(pdl, bool):
            raise TypeError(f"pdl must be a bool, got {pdl!r}")
        self.backend = backend
        self.pdl = pdl
        self.decode_attention = decode_attention
        self._launch_options = {"pdl": pdl, "use_mma": decode_attention == "mma"}
        self._impls: dict[tuple[str, str], Callable[..., Any]] = {}  # (op, device type) -> what calls run
        self._natives: dict[tuple[str, str], Callable[..., Any] | None] = {}  # (op, device type) -> native()

    @classmethod
    def from_options(cls, options: EngineOptions) -> OpSet:
        return cls(options.ops_backend, options.pdl, options.decode_attention)

    def __repr__(self) -> str:
        return f"OpSet(backend={self.backend!r}, pdl={self.pdl}, decode_attention={self.decode_attention!r})"

    def check_device(self, device_type: str) -> None:
        """Raise RuntimeError (saying how to build it) where a model on `device_type` would need a native module
        that is not there (see missing_native_error)."""
        if self.backend == "reference":
            return
        error = missing_native_error(self.backend, device_type, load_native(device_type) is not None)
        if error is not None:
            raise RuntimeError(error)

    def resolve(self, op_name: str, device_type: str) -> Callable[..., Any]:
        """The implementation a call of `op_name` on `device_type` tensors runs (launch options bound)."""
        key = (op_name, device_type)
        impl = self._impls.get(key)
        if impl is None:
            impl = self._impls[key] = self._resolve(_spec(op_name), device_type)
        return impl

    def native(self, op_name: str, device_type: str) -> Callable[..., Any] | None:
        """The native kernel of `op_name` for `device_type` (launch options bound), or None where this op set runs
        none: backend "reference", or no module exports it. For callers with their own fallback (the sampler)."""
        key = (op_name, device_type)
        if key not in self._natives:
            spec = _spec(op_name)
            self._natives[key] = None if self.backend == "reference" else self._native_kernel(spec, device_type)
        return self._natives[key]

    def implementation_name(self, op_name: str, device_type: str) -> str:
        """"native" or "reference": which one `resolve` picks (for tests, benchmarks and logs)."""
        return "reference" if self.resolve(op_name, device_type) is getattr(reference_ops, op_name, None) \
            else "native"

    def linear_supported(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
        """Whether `linear` runs the native CUDA GEMV's fast path on these arguments (see the module function
        `linear_supported`); False where this op set has no native CUDA linear."""
        return linear_supported(x, weight, bias) and self.native("linear", "cuda") is not None

    def _resolve(self, spec: OpSpec, device_type: str) -> Callable[..., Any]:
        if self.backend != "reference":
            kernel = self.native(spec.name, device_type)
            if kernel is not None:
                return kernel
            if self.backend == "native":
                raise NativeUnavailableError(f"backend 'native' but {_missing(spec, device_type)}")
        if not spec.has_reference_op:
            raise NativeUnavailableError(f"op {spec.name!r} has no folio.reference_ops fallback (its reference: "
                                         f"{spec.reference}) and {self!r} runs no native kernel for it on "
                                         f"{device_type}; ask OpSet.native() first")
        return getattr(reference_ops, spec.name)

    def _native_kernel(self, spec: OpSpec, device_type: str) -> Callable[..., Any] | None:
        module = load_native(device_type) if device_type in spec.native else None
        kernel = getattr(module, spec.name, None) if module is not None else None
        if kernel is None or device_type != "cuda" or not spec.launch:
            return kernel
        return functools.partial(kernel, **{name: self._launch_options[name] for name in spec.launch})


def _spec(op_name: str) -> OpSpec:
    spec = BY_NAME.get(op_name)
    if spec is None:
        raise ValueError(f"unknown op {op_name!r}; expected one of {tuple(BY_NAME)}")
    return spec


def _missing(spec: OpSpec, device_type: str) -> str:
    module_name = NATIVE_MODULES.get(device_type)
    if module_name is None:
        return f"there is no native module for device type {device_type!r}"
    if device_type not in spec.native:
        return f"{module_name} has no {spec.name!r} (the registry lists it for {sorted(spec.native)} only)"
    state = "not built" if load_native(device_type) is None else f"built without {spec.name!r}"
    return f"{module_name} is {state}"


def _dispatching_method(spec: OpSpec) -> Callable[..., Any]:
    """OpSet.<op>: resolve by the first argument's device type (cached), call with the caller's arguments."""
    name, first_arg = spec.name, spec.args[0]

    def method(self: OpSet, *args: Any, **kwargs: Any) -> Any:
        tensor = args[0] if args else kwargs[first_arg]
        impl = self._impls.get((name, tensor.device.type)) or self.resolve(name, tensor.device.type)
        return impl(*args, **kwargs)

    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(arg, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                 default=spec.defaults.get(arg, inspect.Parameter.empty)) for arg in spec.args]
    method.__name__ = name
    method.__qualname__ = f"OpSet.{name}"
    method.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    reference = getattr(reference_ops, name, None) if spec.has_reference_op else None
    method.__doc__ = reference.__doc__ if reference is not None else f"Native only; reference: {spec.reference}."
    return method


for _op_spec in OPS:
    setattr(OpSet, _op_spec.name, _dispatching_method(_op_spec))
del _op_spec

# The defaults (backend "auto", PDL on, tensor-core decode attention), for callers that hold no model (the sampler
# called directly): a constant, nothing switches it.
DEFAULT = OpSet()


# The native CUDA linear is a matrix-vector product for decode (native/cuda/gemv.cu): one kernel that streams the
# weight once, where cuBLAS runs split-K GEMMs for a few rows. It refuses more rows than this.
LINEAR_MAX_ROWS = 8
_LINEAR_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def linear_supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the native CUDA linear takes these arguments on its fast path. Host-side checks only (no device access,
    capture-safe), the cheapest first:

    x [M, K] with M <= LINEAR_MAX_ROWS and weight [N, K] on one CUDA device, of one dtype (bfloat16, float16 or
    float32); K a multiple of 16 bytes' worth of elements (8, float32: 4); last dims dense and rows starting on 16
    bytes; bias None or a contiguous [N] of that dtype on that device.

    The kernel also accepts other K, row strides and alignments (through an element-wise path, slower); this check
    leaves those to F.linear. (OpSet.linear_supported also asks whether the op set has the kernel.)
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


def native_key_index() -> type | None:
    """The router's native key index class (folio._native_cpu.KeyIndex, see folio.router.held_keys), or None when
    the CPU module was not built."""
    module = load_native("cpu")
    return getattr(module, "KeyIndex", None) if module is not None else None


def native_candidate_waits() -> Callable | None:
    """The router's native pass over its candidates (folio._native_cpu.CandidateWaits.least, see
    folio.router.cost.LoadTable.least_waiting), or None when the CPU module was not built."""
    module = load_native("cpu")
    holder = getattr(module, "CandidateWaits", None) if module is not None else None
    return holder.least if holder is not None else None


def peer_all_reduce_class() -> type | None:
    """The CUDA module's PeerAllReduce (native/bindings/peer_all_reduce.cpp; see folio.model.peer_all_reduce), or None
    when the CUDA module was not built."""
    module = load_native("cuda")
    return getattr(module, "PeerAllReduce", None) if module is not None else None
