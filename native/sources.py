"""The one list of native sources, read by setup.py (paths relative to the repository root).

Kernels live in native/cpu (C++) and native/cuda (CUDA) and include no torch or pybind11 header; the binding
layer in native/bindings checks tensors and defines one pybind11 module per backend.
"""

CPU_MODULE = "folio._native_cpu"
CPU_SOURCES = [
    "native/bindings/cpu_module.cpp",
    "native/cpu/norm.cpp",
    "native/cpu/rotary.cpp",
    "native/cpu/attention.cpp",
    "native/cpu/page_copy.cpp",
    "native/cpu/sampling.cpp",
    "native/cpu/key_index.cpp",
    "native/cpu/route_waits.cpp",
]

CUDA_MODULE = "folio._native_cuda"
CUDA_SOURCES = [
    "native/bindings/cuda_module.cpp",
    "native/bindings/peer_all_reduce.cpp",
    "native/cuda/norm.cu",
    "native/cuda/rotary.cu",
    "native/cuda/rotary_quant.cu",
    "native/cuda/attention.cu",
    "native/cuda/attention_mma.cu",
    "native/cuda/attention_mma_quant.cu",
    "native/cuda/page_copy.cu",
    "native/cuda/sampling.cu",
    "native/cuda/gemv.cu",
    "native/cuda/gemv_fp8.cu",
    "native/cuda/quantize_fp8.cu",
    "native/cuda/host_gate.cu",
    "native/cuda/peer_all_reduce.cu",
]

# Compute capabilities built by default: Hopper plus the common Ampere/Ada parts. FOLIO_CUDA_ARCHS="9.0"
# restricts a build to Hopper (much faster to compile).
DEFAULT_CUDA_ARCHS = "8.0;8.6;8.9;9.0"
