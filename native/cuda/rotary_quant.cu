// rotary_cache_write into a quantized cache: rotary in place on q and k exactly as rotary_cache_write (the same
// per-element arithmetic, so q and k come out bit-identical), then the rotated k (rounded to its dtype, what an
// unquantized cache would hold) and v quantized into their slots: codes and float16 group scales (kv_quant.cuh).
//
// One warp per (token, unit), a unit being a q, k or v head: a quantization group (32 elements, or the whole head
// for fp8) needs a max over lanes, which a warp does with shuffles. Rotation pairs (i, i + D/2) go lane by lane;
// the rounded results go through a per-warp row of shared memory so that the quantizing lanes then hold pairs of
// neighbouring elements (2j, 2j + 1: one q4 byte), 16 lanes to a group of 32.
#include <type_traits>

#include "device_utils.cuh"
#include "kernels.cuh"
#include "kv_quant.cuh"
#include "launch.cuh"

namespace folio::cuda {
namespace {

constexpr int kQuantWarps = 4;            // units per block
constexpr int kMaxQuantHeadDim = 512;     // the per-warp row of shared memory

template <typename T, int FMT>
__global__ void __launch_bounds__(kQuantWarps * 32) rotary_cache_write_quant_kernel(RotaryCacheWriteParams p) {
  __shared__ float rows[kQuantWarps][kMaxQuantHeadDim];
  grid_dependency_wait();  // before the first return: see launch.cuh
  allow_dependent_launch();
  const int64_t t = blockIdx.x;
  const int lane = static_cast<int>(threadIdx.x), warp = static_cast<int>(threadIdx.y);
  const int num_q = static_cast<int>(p.num_q_heads), num_kv = static_cast<int>(p.num_kv_heads);
  const int unit = static_cast<int>(blockIdx.y) * kQuantWarps + warp;  // warp-uniform from here on
  if (unit >= num_q + 2 * num_kv) return;
  const int64_t slot = p.slot_mapping[t];
  const bool rotated = unit < num_q + num_kv;
  if (!rotated && slot < 0) return;  // a v head with nothing to write
  const int head_dim = static_cast<int>(p.head_dim), half = head_dim / 2;
  float* row = rows[warp];

  if (rotated) {
    const bool is_q = unit < num_q;
    T* x = is_q ? static_cast<T*>(p.q) + t * p.q_stride_token + unit * p.q_stride_head
                : static_cast<T*>(p.k) + t * p.k_stride_token + (unit - num_q) * p.k_stride_head;
    const float position = static_cast<float>(p.positions[t]);
    for (int i = lane; i < half; i += 32) {
      float s, c;
      sincosf(position * p.inv_freq[i], &s, &c);
      const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
      // as rotary_cache_write: the fma contraction spelled out
      const T y1 = from_float<T>(__fmaf_rn(x1, c, -__fmul_rn(x2, s)));
      const T y2 = from_float<T>(__fmaf_rn(x1, s, __fmul_rn(x2, c)));
      x[i] = y1;
      x[i + half] = y2;
      row[i] = to_float(y1);
      row[i + half] = to_float(y2);
    }
    if (is_q || slot < 0) return;
  } else {
    const T* x = static_cast<const T*>(p.v) + t * p.v_stride_token + (unit - num_q - num_kv) * p.v_stride_head;
    for (int i = lane; i < head_dim; i += 32) row[i] = to_float(x[i]);
  }
  __syncwarp();

  const int kv_head = rotated ? unit - num_q : unit - num_q - num_kv;
  const int64_t page = slot / p.page_size, offset = slot % p.page_size;
  unsigned char* codes = static_cast<unsigned char*>(rotated ? p.k_cache : p.v_cache) + page * p.cache_stride_page +
                         offset * p.cache_stride_slot + kv_head * p.cache_stride_head;
  __half* scales = static_cast<__half*>(rotated ? p.quant.k_scale : p.quant.v_scale) +
                   page * p.quant.scale_stride_page + offset * p.quant.scale_stride_slot +
                   kv_head * p.quant.scale_stride_head;
  if constexpr (FMT == kFmtFp8) {  // one group: the whole head
    float amax = 0.0f;
    for (int i = lane; i < head_dim; i += 32) amax = fmaxf(amax, fabsf(row[i]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    __half stored;
    const float scale = quant_scale(amax, kv_qmax<FMT>(), stored);
    if (lane == 0) scales[0] = stored;
    for (int i = lane; i < head_dim; i += 32) codes[i] = static_cast<unsigned char>(quant_code<FMT>(row[i], scale));
  } else {
    // Lane l holds elements e, e + 1 with e = base + 2l: lanes 0-15 group base / 32, lanes 16-31 the next. The
    // binding has checked head_dim % 32 == 0, so a half-warp is wholly inside or wholly past the head.
    for (int base = 0; base < head_dim; base += 64) {
      const int e = base + 2 * lane;
      const bool active = e < head_dim;
      const float x0 = active ? row[e] : 0.0f, x1 = active ? row[e + 1] : 0.0f;
      float amax = fmaxf(fabsf(x0), fabsf(x1));
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      __half stored;
      const float scale = quant_scale(amax, kv_qmax<FMT>(), stored);
      if (active) {
        if (lane % 16 == 0) scales[e / kQuantGroup] = stored;
        const uint32_t c0 = quant_code<FMT>(x0, scale), c1 = quant_code<FMT>(x1, scale);
        if constexpr (FMT == kFmtQ8) {
          codes[e] = static_cast<unsigned char>(c0);
          codes[e + 1] = static_cast<unsigned char>(c1);
        } else {
          codes[e / 2] = static_cast<unsigned char>(c0 | (c1 << 4));  // element 2i low, 2i + 1 high
        }
      }
    }
  }
}

template <typename T>
cudaError_t launch_format(const RotaryCacheWriteParams& p, dim3 grid, const Launch& launch) {
  const dim3 block(32, kQuantWarps);
  switch (p.quant.format) {
    case KvFormat::kFp8: return launch_kernel(rotary_cache_write_quant_kernel<T, kFmtFp8>, grid, block, 0, launch, p);
    case KvFormat::kQ8: return launch_kernel(rotary_cache_write_quant_kernel<T, kFmtQ8>, grid, block, 0, launch, p);
    case KvFormat::kQ4: return launch_kernel(rotary_cache_write_quant_kernel<T, kFmtQ4>, grid, block, 0, launch, p);
    case KvFormat::kNone: break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t rotary_cache_write_quant(const RotaryCacheWriteParams& p, const Launch& launch) {
  if (p.num_tokens == 0) return cudaSuccess;
  // the binding refuses these first
  if (p.head_dim > kMaxQuantHeadDim || p.head_dim % 2 != 0 || p.dtype == ScalarType::kFloat32) {
    return cudaErrorInvalidValue;
  }
  if (p.quant.format != KvFormat::kFp8 && p.head_dim % kQuantGroup != 0) return cudaErrorInvalidValue;
  const int64_t num_units = p.num_q_heads + 2 * p.num_kv_heads;
  if (num_units == 0 || p.head_dim == 0) return cudaSuccess;
  const int64_t grid_y = (num_units + kQuantWarps - 1) / kQuantWarps;
  if (p.num_tokens > INT32_MAX || grid_y > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(grid_y));
  cudaError_t status = cudaErrorInvalidValue;
  dispatch_scalar(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) status = launch_format<T>(p, grid, launch);
  });
  if (status != cudaSuccess) return status;
  return cudaGetLastError();
}

}  // namespace folio::cuda
