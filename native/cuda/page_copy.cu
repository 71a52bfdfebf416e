// Partial-page copy: slots [0, n) of one page onto another in every layer, for K and V.
#include <cstdint>

#include "device_utils.cuh"
#include "kernels.cuh"

namespace folio::cuda {
namespace {

constexpr int kCopyThreads = 256;

// grid: (chunks of the copied span, layers, 2 caches). Word = uint4 (16 bytes) when the span and every page
// offset are 16-byte multiples, else bytes. (A 2-D memcpy would do, but its pitch, one layer of the cache, can
// exceed the driver's pitch limit for large caches.)
template <typename Word>
__global__ void copy_page_slots_kernel(PageCopyParams p, int64_t page_words, int64_t copy_words) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kCopyThreads + threadIdx.x;
  if (i >= copy_words) return;
  Word* base = static_cast<Word*>(blockIdx.z == 0 ? p.k_cache : p.v_cache);
  Word* layer = base + static_cast<int64_t>(blockIdx.y) * p.num_pages * page_words;
  layer[p.dst_page * page_words + i] = layer[p.src_page * page_words + i];
}

}  // namespace

cudaError_t copy_page_slots(const PageCopyParams& p, cudaStream_t stream) {
  if (p.num_slots == 0 || p.src_page == p.dst_page || p.num_layers == 0) return cudaSuccess;
  const int64_t page_bytes = p.page_size * p.slot_elems * p.elem_size;
  const int64_t copy_bytes = p.num_slots * p.slot_elems * p.elem_size;
  const bool wide = page_bytes % 16 == 0 && copy_bytes % 16 == 0 && aligned16(p.k_cache) && aligned16(p.v_cache);
  const int64_t word = wide ? 16 : 1;
  const dim3 grid(static_cast<unsigned>((copy_bytes / word + kCopyThreads - 1) / kCopyThreads),
                  static_cast<unsigned>(p.num_layers), 2);
  if (wide) {
    copy_page_slots_kernel<uint4><<<grid, kCopyThreads, 0, stream>>>(p, page_bytes / 16, copy_bytes / 16);
  } else {
    copy_page_slots_kernel<uint8_t><<<grid, kCopyThreads, 0, stream>>>(p, page_bytes, copy_bytes);
  }
  return cudaGetLastError();
}

}  // namespace folio::cuda
