// Kernel launches with Programmatic Dependent Launch (PDL, sm_90+).
//
// A decode step is ~300 short kernels in a row, each one reading what the one before it wrote. Launched plainly,
// kernel N+1 starts only once kernel N has drained: every boundary pays the launch, the ramp-up of the new grid
// and a first round trip to memory with the SMs mostly idle. With PDL the next grid is launched while the previous
// one is finishing; its blocks do the work that needs nothing from it (the GEMV issues its first weight loads)
// and then wait in grid_dependency_wait() until the previous grid has completed and its writes are visible.
//
// The contract for every kernel launched through launch_kernel():
//  * it calls grid_dependency_wait() in every thread before it reads anything an earlier kernel wrote and before
//    it writes anything at all (that also keeps the chain transitive: a grid cannot complete before the one
//    before it has, so "the previous grid completed" implies "every earlier grid completed");
//  * no thread returns before that call;
//  * it reads earlier kernels' outputs with coherent loads, never ld.global.nc / __ldg (that path requires data
//    that stays read-only for the kernel's whole lifetime, and this kernel starts before its producer is done);
//  * it calls allow_dependent_launch() right after the wait: the next grid is launched once every block of this
//    one has made that call. Then all of this grid's blocks are resident (the waiting blocks cannot starve it),
//    and at most two grids overlap: this one and the next, whose producer (this one) is the only grid running.
// Before sm_90 both calls compile to nothing and the launch attribute is not set: plain stream order.
//
// Whether a launch gets the attribute is the caller's choice, per call (Launch::pdl, from EngineOptions.pdl through
// the binding): false launches plainly, for A/B timing. Nothing here reads the environment.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "kernels.cuh"

namespace folio::cuda {

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether the current device takes the PDL attribute: compute capability 9.0+. (A per-device cache of a hardware
// property, not a switch.)
inline bool programmatic_launch_supported() {
  constexpr int kMaxDevices = 64;
  static int major_by_device[kMaxDevices] = {};  // 0: not asked yet (benign race: every writer stores the same)
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return false;
  if (major_by_device[device] == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
    major_by_device[device] = major;
  }
  return major_by_device[device] >= 9;
}

// Blocks of `kernel` one multiprocessor of the current device holds at once with `threads` threads and
// `shared_bytes` of dynamic shared memory each (allowing more than 48 KB first), or 0 when the runtime cannot say.
template <typename... Params>
int resident_blocks_per_sm(void (*kernel)(Params...), int threads, int shared_bytes) {
  if (shared_bytes > 48 * 1024 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes) != cudaSuccess) {
    return 0;
  }
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, shared_bytes) != cudaSuccess) return 0;
  return blocks;
}

// kernel<<<grid, block, shared_bytes, launch.stream>>>(args...), with the PDL attribute where launch.pdl asks for it
// and the device supports it. Returns the launch status.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                          const Launch& launch, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = launch.stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  if (launch.pdl && programmatic_launch_supported()) {
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace folio::cuda
