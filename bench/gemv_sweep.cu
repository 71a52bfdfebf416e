// Stand-alone timing of folio's GEMV (native/cuda/gemv.cu, or with -DSWEEP_FP8 the FP8 one, native/cuda/gemv_fp8.cu)
// on the 8B decode shapes, no torch: bench/gemv_sweep.sh builds it once per tuning variant. Prints GB/s of weight
// read per shape and the time of one 8B decode step's projections (32 x (qkv, o, gate_up, down) + lm_head). Each
// shape rotates over enough weight copies to exceed L2; weights and x are random (zeros or constants can time
// differently from real data). x is bfloat16 unless SWEEP_DTYPE=f16. The FP8 build first checks the kernel against
// a float64 reference on fresh random inputs (every M, both dtypes, gated or not, with bias, aligned and unaligned
// K) and that a row's result does not depend on the other rows (batch invariance) or the run (determinism).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../native/cuda/kernels.cuh"

namespace {

#ifdef SWEEP_FP8
constexpr size_t kWeightElementBytes = 1;  // e4m3 (+ one fp32 scale per row, not counted)
#else
constexpr size_t kWeightElementBytes = 2;  // bfloat16
#endif

struct Shape {
  const char* name;
  int64_t n, k;
  int per_step;
};

#define CHECK(call)                                                                      \
  do {                                                                                   \
    cudaError_t e = (call);                                                              \
    if (e != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));     \
      return 1;                                                                          \
    }                                                                                    \
  } while (0)

// A hash of (seed, i): the fill pattern.
__host__ __device__ inline uint32_t mix(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + i * 0xBF58476D1CE4E5B9ull + 1;
  z = (z ^ (z >> 31)) * 0x94D049BB133111EBull;
  return static_cast<uint32_t>(z ^ (z >> 29));
}

// Random finite values: e4m3 bytes (no NaN: exponent-mantissa 0x7F excluded), or 16-bit values in about [-4, 4].
__global__ void fill_kernel(uint8_t* out, size_t n, uint64_t seed, int element_bytes, bool bf16) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint32_t r = mix(seed, i);
    if (element_bytes == 1) {
      uint8_t b = static_cast<uint8_t>(r);
      if ((b & 0x7F) == 0x7F) b ^= 1;
      out[i] = b;
    } else {
      const float v = (static_cast<float>(r & 0xFFFFFF) / 16777216.0f - 0.5f) * 8.0f;
      const uint16_t bits = bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v)) : __half_as_ushort(__float2half_rn(v));
      reinterpret_cast<uint16_t*>(out)[i] = bits;
    }
  }
}

int fill(void* p, size_t elements, uint64_t seed, int element_bytes, bool bf16) {
  fill_kernel<<<1024, 256>>>(static_cast<uint8_t*>(p), elements, seed, element_bytes, bf16);
  CHECK(cudaGetLastError());
  return 0;
}

#ifdef SWEEP_FP8
double e4m3_value(uint8_t b) {
  const int sign = b >> 7, e = (b >> 3) & 15, m = b & 7;
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return sign ? -mag : mag;
}
double half_value(uint16_t bits, bool bf16) {
  if (bf16) {
    uint32_t f = static_cast<uint32_t>(bits) << 16;
    float v;
    std::memcpy(&v, &f, 4);
    return v;
  }
  const int sign = bits >> 15, e = (bits >> 10) & 31, m = bits & 1023;
  const double mag = e == 0 ? std::ldexp(m / 1024.0, -14) : std::ldexp(1.0 + m / 1024.0, e - 15);
  return sign ? -mag : mag;
}
double round_to(double v, bool bf16) {  // to the 16-bit dtype (nearest even), as the kernel stores a factor
  const float f = static_cast<float>(v);
  return bf16 ? half_value(__bfloat16_as_ushort(__float2bfloat16_rn(f)), true)
              : half_value(__half_as_ushort(__float2half_rn(f)), false);
}

// One case: y = linear_fp8(x[rows, k], W[n, k]) (+ bias), optionally gated, against float64; then every row alone
// (batch invariance) and a second run (determinism) must give the same bits. Returns the relative error
// (max |got - want| / max |want|), or -1 on a mismatch of bits.
double check_case(int rows, int64_t n, int64_t k, bool bf16, bool gated, bool with_bias, uint64_t seed) {
  const int64_t out_n = gated ? n / 2 : n;
  std::vector<uint8_t> w(n * k);
  std::vector<uint16_t> x(rows * k), bias(n);
  std::vector<float> scale(n);
  for (size_t i = 0; i < w.size(); ++i) {
    w[i] = static_cast<uint8_t>(mix(seed, i));
    if ((w[i] & 0x7F) == 0x7F) w[i] ^= 1;
  }
  auto to16 = [&](float v) {
    return bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v)) : __half_as_ushort(__float2half_rn(v));
  };
  for (size_t i = 0; i < x.size(); ++i) x[i] = to16((mix(seed + 1, i) % 20001) / 5000.0f - 2.0f);
  for (int64_t i = 0; i < n; ++i) {
    bias[i] = to16((mix(seed + 2, i) % 2001) / 1000.0f - 1.0f);
    scale[i] = std::ldexp(1.0f + (mix(seed + 3, i) % 1000) / 1000.0f, -8 - static_cast<int>(mix(seed + 4, i) % 6));
  }
  uint8_t* d_w;
  uint16_t *d_x, *d_bias, *d_out;
  float* d_scale;
  if (cudaMalloc(&d_w, w.size()) || cudaMalloc(&d_x, x.size() * 2) || cudaMalloc(&d_bias, n * 2) ||
      cudaMalloc(&d_out, rows * out_n * 2) || cudaMalloc(&d_scale, n * 4)) return -2;
  cudaMemcpy(d_w, w.data(), w.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(d_x, x.data(), x.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(d_bias, bias.data(), n * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(d_scale, scale.data(), n * 4, cudaMemcpyHostToDevice);
  folio::cuda::LinearFp8Params p{};
  p.x = d_x;
  p.x_row_stride = k;
  p.weight = d_w;
  p.weight_row_stride = k;
  p.weight_scale = d_scale;
  p.bias = with_bias ? d_bias : nullptr;
  p.out_features = n;
  p.in_features = k;
  p.dtype = bf16 ? folio::ScalarType::kBFloat16 : folio::ScalarType::kFloat16;
  p.silu_gate = gated;
  const folio::cuda::Launch launch{nullptr, true};
  auto run = [&](int num_rows, int64_t x_offset, std::vector<uint16_t>& out) {
    cudaMemset(d_out, 0xFF, rows * out_n * 2);  // poison: NaN in both dtypes
    p.out = d_out;
    p.x = d_x + x_offset;
    p.num_rows = num_rows;
    if (folio::cuda::linear_fp8(p, launch) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) return false;
    out.resize(num_rows * out_n);
    cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost);
    return true;
  };
  std::vector<uint16_t> got, again, alone;
  double err = 0, ref_max = 0;
  if (!run(rows, 0, got) || !run(rows, 0, again)) return -2;
  bool bits_ok = got == again;
  for (int m = 0; m < rows; ++m) {
    if (!run(1, m * k, alone)) return -2;
    bits_ok = bits_ok && std::equal(alone.begin(), alone.end(), got.begin() + m * out_n);
  }
  double e4m3_table[256];
  for (int b = 0; b < 256; ++b) e4m3_table[b] = e4m3_value(static_cast<uint8_t>(b));
  std::vector<double> xd(x.size());
  for (size_t i = 0; i < x.size(); ++i) xd[i] = half_value(x[i], bf16);
  for (int m = 0; m < rows; ++m) {
    std::vector<double> y(n);
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0;
      for (int64_t c = 0; c < k; ++c) sum += xd[m * k + c] * e4m3_table[w[j * k + c]];
      y[j] = sum * scale[j] + (with_bias ? half_value(bias[j], bf16) : 0.0);
    }
    for (int64_t j = 0; j < out_n; ++j) {
      double want = y[j];
      if (gated) {
        const double gate = round_to(y[j], bf16), up = round_to(y[out_n + j], bf16);
        want = gate / (1 + std::exp(-gate)) * up;
      }
      const double v = half_value(got[m * out_n + j], bf16);
      err = std::max(err, std::isnan(v) ? INFINITY : std::fabs(v - want));
      ref_max = std::max(ref_max, std::fabs(want));
    }
  }
  cudaFree(d_w);
  cudaFree(d_x);
  cudaFree(d_bias);
  cudaFree(d_out);
  cudaFree(d_scale);
  return bits_ok ? err / ref_max : -1;
}

// Every M, both dtypes, gated or not, bias or not, over shapes that take the vector path (K % 16 == 0), the
// element-wise one (K = 1000, 37), several groups per block (N = 6144), and warps with no step (K = 48).
bool check_all() {
  struct Case {
    int64_t n, k;
  };
  const Case cases[] = {{6144, 1024}, {1000, 512}, {520, 1000}, {24, 48}, {34, 37}, {272, 2048}};
  double worst = 0;
  int failures = 0, count = 0;
  uint64_t seed = 1;
  for (const Case& c : cases) {
    for (int rows = 1; rows <= 8; ++rows) {
      for (int dt = 0; dt < 2; ++dt) {
        for (int gated = 0; gated < 2; ++gated) {
          const bool bias = (rows + gated) % 2 == 0;
          const double e = check_case(rows, c.n, c.k, dt == 0, gated, bias, seed++);
          ++count;
          const double tol = gated ? 2e-2 : 1e-2;
          if (e < 0 || !(e <= tol)) {
            if (++failures > 10) continue;
            std::printf("  CHECK FAIL n=%lld k=%lld rows=%d %s%s%s: %s %g\n", static_cast<long long>(c.n),
                        static_cast<long long>(c.k), rows, dt == 0 ? "bf16" : "f16", gated ? " gated" : "",
                        bias ? " bias" : "",
                        e == -2 ? "CUDA error" : e < 0 ? "bits differ (batch invariance / determinism)" : "rel err", e);
          } else {
            worst = std::max(worst, e);
          }
        }
      }
    }
  }
  std::printf("  check: %d cases, %d failures, worst rel err %.2e\n", count, failures, worst);
  return failures == 0;
}
#endif

}  // namespace

// One timing: plain, or gated (silu_gate: gate_up with the MLP's activation in its epilogue).
struct Mode {
  const char* name;
  bool gated;
};

int main() {
  const Shape shapes[] = {{"qkv", 6144, 4096, 32}, {"o_proj", 4096, 4096, 32}, {"gate_up", 28672, 4096, 32},
                          {"down", 4096, 14336, 32}, {"lm_head", 128256, 4096, 1}};
  const Mode modes[] = {{"plain", false}, {"gated", true}};
  const char* dtype_env = std::getenv("SWEEP_DTYPE");
  const bool bf16 = dtype_env == nullptr || std::string(dtype_env) != "f16";
  const char* only_shape = std::getenv("SWEEP_SHAPE");  // one shape only (profiling)
#ifdef SWEEP_FP8
  if (only_shape == nullptr && !check_all()) return 1;
#endif
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  const folio::cuda::Launch launch{stream, /*pdl=*/true};  // as the engine launches it by default
  void *x, *out;
  CHECK(cudaMalloc(&x, 8 * 14336 * 2));
  CHECK(cudaMalloc(&out, 8 * 128256 * 2));
  if (fill(x, 8 * 14336, 7, 2, bf16)) return 1;
  CHECK(cudaMemset(out, 0, 8 * 128256 * 2));
  float* scales;  // FP8: one per output row, all 1
  CHECK(cudaMalloc(&scales, 128256 * sizeof(float)));
  {
    std::vector<float> ones(128256, 1.0f / 256);
    CHECK(cudaMemcpy(scales, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  double step_us = 0, gated_step_us = 0;
  for (const Shape& s : shapes) {
    if (only_shape != nullptr && std::string(only_shape) != s.name) continue;
    const size_t bytes = static_cast<size_t>(s.n) * s.k * kWeightElementBytes;
    const int copies = static_cast<int>(std::max<size_t>(1, (256u << 20) / bytes + 1));
    std::vector<void*> weights(copies);
    for (auto& w : weights) {
      CHECK(cudaMalloc(&w, bytes));
      if (fill(w, bytes / kWeightElementBytes, reinterpret_cast<uintptr_t>(w), kWeightElementBytes, bf16)) return 1;
    }
    for (const Mode& mode : modes) {
      if (mode.gated && std::string(s.name) != "gate_up") continue;
#ifdef SWEEP_FP8
      folio::cuda::LinearFp8Params p{};
      p.weight_scale = scales;
      auto run = [](const folio::cuda::LinearFp8Params& q, const folio::cuda::Launch& l) {
        return folio::cuda::linear_fp8(q, l);
      };
#else
      folio::cuda::LinearParams p{};
      auto run = [](const folio::cuda::LinearParams& q, const folio::cuda::Launch& l) {
        return folio::cuda::linear(q, l);
      };
#endif
      p.out = out;
      p.x = x;
      p.x_row_stride = s.k;
      p.weight_row_stride = s.k;
      p.num_rows = 1;
      p.out_features = s.n;
      p.in_features = s.k;
      p.dtype = bf16 ? folio::ScalarType::kBFloat16 : folio::ScalarType::kFloat16;
      p.silu_gate = mode.gated;
      const int reps = 40 * copies;
      for (int r = 0; r < copies; ++r) {
        p.weight = static_cast<decltype(p.weight)>(weights[r]);
        CHECK(run(p, launch));
      }
      CHECK(cudaEventRecord(start, stream));
      for (int r = 0; r < reps; ++r) {
        p.weight = static_cast<decltype(p.weight)>(weights[r % copies]);
        CHECK(run(p, launch));
      }
      CHECK(cudaEventRecord(stop, stream));
      CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, start, stop));
      const double us = 1e3 * ms / reps;
      if (!mode.gated) step_us += us * s.per_step;
      if (mode.gated || std::string(s.name) != "gate_up") gated_step_us += us * s.per_step;
      std::printf("  %-8s %6lld x %5lld %-5s: %7.1f us  %6.0f GB/s\n", s.name, static_cast<long long>(s.n),
                  static_cast<long long>(s.k), mode.name, us, bytes / us / 1e3);
    }
    for (auto& w : weights) CHECK(cudaFree(w));
  }
  CHECK(cudaDeviceSynchronize());
  std::printf("  8B decode step, projections + lm_head: %.0f us, %.0f us with gate_up gated (x %s)\n", step_us,
              gated_step_us, bf16 ? "bf16" : "f16");
  return 0;
}
