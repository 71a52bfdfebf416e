// RMSNorm (plain and fused with the residual add) and SiLU-and-mul.
#include <algorithm>
#include <cstdint>

#include "device_utils.cuh"
#include "kernels.cuh"
#include "launch.cuh"

namespace folio::cuda {
namespace {

constexpr int kNormThreads = 256;
constexpr int64_t kMaxGridY = 65535;  // CUDA's limit on gridDim.y

// One block per row. VEC = 8 uses 16-byte accesses (the launcher checks sizes and alignment), VEC = 1 scalars.
// The fused form adds x into the residual, stores it rounded to dtype, and normalizes the rounded values (the
// reference's order), reading each row twice: the second read hits L2.
template <typename T, typename W, int VEC>
__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(RmsNormParams p) {
  __shared__ float scratch[32];
  grid_dependency_wait();  // x and the residual come from the previous kernel (launch.cuh)
  allow_dependent_launch();
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(p.x) + row * p.x_row_stride;
  T* residual = p.residual ? static_cast<T*>(p.residual) + row * p.residual_row_stride : nullptr;
  const T* src = residual ? residual : x;
  T* out = static_cast<T*>(p.out) + row * p.out_row_stride;
  const W* weight = static_cast<const W*>(p.weight);
  const int64_t n = p.hidden_size;

  float sum_squares = 0.0f;
  for (int64_t i = threadIdx.x * VEC; i < n; i += kNormThreads * VEC) {
    float v[VEC];
    if constexpr (VEC == 8) {
      Vec8<T> xv;
      xv.load(x + i);
      xv.to_floats(v);
      if (residual) {
        Vec8<T> rv;
        rv.load(residual + i);
        float r[8];
        rv.to_floats(r);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = to_float(from_float<T>(r[e] + v[e]));  // the stored, rounded sum
        Vec8<T>::store(residual + i, v);
      }
    } else {
      v[0] = to_float(x[i]);
      if (residual) {
        const T r = from_float<T>(to_float(residual[i]) + v[0]);
        residual[i] = r;
        v[0] = to_float(r);
      }
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) sum_squares += v[e] * v[e];
  }
  const float total = block_sum(sum_squares, scratch);
  const float inv_rms = rsqrtf(total / static_cast<float>(n) + p.eps);
  // The second pass reads what this same thread wrote in the first (same indices), so no barrier is needed.
  for (int64_t i = threadIdx.x * VEC; i < n; i += kNormThreads * VEC) {
    if constexpr (VEC == 8) {
      Vec8<T> sv;
      sv.load(src + i);
      float v[8], w[8];
      sv.to_floats(v);
      Vec8<W> wv;
      wv.load(weight + i);
      wv.to_floats(w);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = v[e] * inv_rms * w[e];
      Vec8<T>::store(out + i, v);
    } else {
      out[i] = from_float<T>(to_float(src[i]) * inv_rms * to_float(weight[i]));
    }
  }
}

template <typename T, int VEC>
__global__ void silu_and_mul_kernel(SiluAndMulParams p) {
  grid_dependency_wait();
  allow_dependent_launch();
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (i >= p.half_width) return;
  // rows stride by gridDim.y: a prompt step can have more rows (tokens) than a grid's y dimension (65535)
  for (int64_t row = blockIdx.y; row < p.num_rows; row += gridDim.y) {
    const T* gate = static_cast<const T*>(p.x) + row * p.x_row_stride;
    const T* up = gate + p.half_width;
    T* out = static_cast<T*>(p.out) + row * p.out_row_stride;
    if constexpr (VEC == 8) {
      Vec8<T> gv, uv;
      gv.load(gate + i);
      uv.load(up + i);
      float g[8], u[8];
      gv.to_floats(g);
      uv.to_floats(u);
#pragma unroll
      for (int e = 0; e < 8; ++e) g[e] = g[e] / (1.0f + expf(-g[e])) * u[e];
      Vec8<T>::store(out + i, g);
    } else {
      const float g = to_float(gate[i]);
      out[i] = from_float<T>(g / (1.0f + expf(-g)) * to_float(up[i]));
    }
  }
}

bool rows_vectorizable(const void* base, int64_t row_stride, int64_t width) {
  return aligned16(base) && row_stride % 8 == 0 && width % 8 == 0;
}

}  // namespace

cudaError_t rms_norm(const RmsNormParams& p, const Launch& launch) {
  if (p.num_rows == 0) return cudaSuccess;
  const bool vec = rows_vectorizable(p.x, p.x_row_stride, p.hidden_size) &&
                   rows_vectorizable(p.out, p.out_row_stride, p.hidden_size) && aligned16(p.weight) &&
                   (p.residual == nullptr || rows_vectorizable(p.residual, p.residual_row_stride, p.hidden_size));
  dispatch_scalar(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    auto launch_with_weight = [&](auto weight_tag) {
      using W = decltype(weight_tag);
      if (vec) {
        launch_kernel(rms_norm_kernel<T, W, 8>, dim3(p.num_rows), dim3(kNormThreads), 0, launch, p);
      } else {
        launch_kernel(rms_norm_kernel<T, W, 1>, dim3(p.num_rows), dim3(kNormThreads), 0, launch, p);
      }
    };
    if (p.weight_dtype == p.dtype) {
      launch_with_weight(T{});
    } else {
      launch_with_weight(float{});
    }
  });
  return cudaGetLastError();
}

cudaError_t silu_and_mul(const SiluAndMulParams& p, const Launch& launch) {
  if (p.num_rows == 0 || p.half_width == 0) return cudaSuccess;
  const bool vec = rows_vectorizable(p.x, p.x_row_stride, p.half_width) &&
                   rows_vectorizable(p.out, p.out_row_stride, p.half_width);
  constexpr int threads = 256;
  dispatch_scalar(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int vec_width = vec ? 8 : 1;
    const dim3 grid(static_cast<unsigned>((p.half_width + threads * vec_width - 1) / (threads * vec_width)),
                    static_cast<unsigned>(std::min<int64_t>(p.num_rows, kMaxGridY)));
    if (vec) {
      launch_kernel(silu_and_mul_kernel<T, 8>, grid, dim3(threads), 0, launch, p);
    } else {
      launch_kernel(silu_and_mul_kernel<T, 1>, grid, dim3(threads), 0, launch, p);
    }
  });
  return cudaGetLastError();
}

}  // namespace folio::cuda
