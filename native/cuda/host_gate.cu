// wait_host_value: the device stream waits until the host writes a value, so that work depending on data the host
// has not produced yet (a step's grammar masks) can be queued before it exists. One thread polls a pinned host
// word through unified addressing; everything queued after the kernel on the stream runs once it returns.
//
// Memory order: the host writes its data (e.g. into a pinned buffer that a copy queued after this kernel reads),
// then the flag. The system-scope acquire load makes those earlier host writes visible to work after the kernel.
//
// A host that never writes the value would stall the device for good: after timeout_ns the kernel traps, which
// puts the context in an error state that the next synchronising call on the host reports, instead of letting the
// queued work run on data the host never wrote.
#include <cuda/atomic>

#include "kernels.cuh"

namespace folio::cuda {
namespace {

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void wait_host_value_kernel(int64_t* flag, int64_t value, int64_t timeout_ns) {
  const ::cuda::atomic_ref<int64_t, ::cuda::thread_scope_system> word(*flag);
  const uint64_t start = global_timer_ns();
  while (word.load(::cuda::memory_order_acquire) < value) {
    if (timeout_ns > 0 && global_timer_ns() - start > static_cast<uint64_t>(timeout_ns)) __trap();
    __nanosleep(500);
  }
}

}  // namespace

cudaError_t wait_host_value(int64_t* flag, int64_t value, int64_t timeout_ns, cudaStream_t stream) {
  wait_host_value_kernel<<<1, 1, 0, stream>>>(flag, value, timeout_ns);
  return cudaGetLastError();
}

}  // namespace folio::cuda
