// RMSNorm (plain and fused with the residual add) and SiLU-and-mul on the CPU.
#include <cmath>

#include "kernels.h"
#include "scalar.h"

namespace folio::cpu {
namespace {

template <typename T, typename W>
void rms_norm_rows(const RmsNormParams& p, int64_t begin, int64_t end) {
  const W* weight = static_cast<const W*>(p.weight);
  for (int64_t row = begin; row < end; ++row) {
    const T* x = static_cast<const T*>(p.x) + row * p.x_row_stride;
    T* out = static_cast<T*>(p.out) + row * p.out_row_stride;
    // The fused form normalizes the residual after it is rounded to its dtype (as the reference does), so
    // `src` is the stored residual row and x only feeds the add.
    const T* src = x;
    if (p.residual != nullptr) {
      T* residual = static_cast<T*>(p.residual) + row * p.residual_row_stride;
      for (int64_t i = 0; i < p.hidden_size; ++i) {
        residual[i] = from_float<T>(to_float(residual[i]) + to_float(x[i]));
      }
      src = residual;
    }
    double sum_squares = 0.0;
    for (int64_t i = 0; i < p.hidden_size; ++i) {
      const float v = to_float(src[i]);
      sum_squares += static_cast<double>(v) * v;
    }
    const float mean_square = static_cast<float>(sum_squares / static_cast<double>(p.hidden_size));
    const float inv_rms = 1.0f / std::sqrt(mean_square + p.eps);
    for (int64_t i = 0; i < p.hidden_size; ++i) {
      out[i] = from_float<T>(to_float(src[i]) * inv_rms * to_float(weight[i]));
    }
  }
}

template <typename T>
void silu_and_mul_rows(const SiluAndMulParams& p, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const T* gate = static_cast<const T*>(p.x) + row * p.x_row_stride;
    const T* up = gate + p.half_width;
    T* out = static_cast<T*>(p.out) + row * p.out_row_stride;
    for (int64_t i = 0; i < p.half_width; ++i) {
      const float g = to_float(gate[i]);
      out[i] = from_float<T>(g / (1.0f + std::exp(-g)) * to_float(up[i]));
    }
  }
}

}  // namespace

void rms_norm(const RmsNormParams& p, int64_t begin, int64_t end) {
  dispatch_scalar(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (p.weight_dtype == p.dtype) {
      rms_norm_rows<T, T>(p, begin, end);
    } else {
      rms_norm_rows<T, float>(p, begin, end);  // the binding admits only dtype or float32 weights
    }
  });
}

void silu_and_mul(const SiluAndMulParams& p, int64_t begin, int64_t end) {
  dispatch_scalar(p.dtype, [&](auto tag) { silu_and_mul_rows<decltype(tag)>(p, begin, end); });
}

}  // namespace folio::cpu
