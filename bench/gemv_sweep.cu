// Stand-alone timing of folio's GEMV (native/cuda/gemv.cu, or with -DSWEEP_FP8 the FP8 one, native/cuda/gemv_fp8.cu)
// on the 8B decode shapes, no torch: bench/gemv_sweep.sh builds it once per tuning variant. Prints GB/s of weight read per shape and the time of one 8B decode step's
// projections (32 x (qkv, o, gate_up, down) + lm_head). Each shape rotates over enough weight copies to exceed L2.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
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
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  const folio::cuda::Launch launch{stream, /*pdl=*/true};  // as the engine launches it by default
  void *x, *out;
  CHECK(cudaMalloc(&x, 8 * 14336 * 2));
  CHECK(cudaMalloc(&out, 8 * 128256 * 2));
  CHECK(cudaMemset(x, 0, 8 * 14336 * 2));
  CHECK(cudaMemset(out, 0, 8 * 128256 * 2));
  float* scales;  // FP8: one per output row, all 1
  CHECK(cudaMalloc(&scales, 128256 * sizeof(float)));
  {
    std::vector<float> ones(128256, 1.0f);
    CHECK(cudaMemcpy(scales, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  double step_us = 0, gated_step_us = 0;
  for (const Shape& s : shapes) {
    const size_t bytes = static_cast<size_t>(s.n) * s.k * kWeightElementBytes;
    const int copies = static_cast<int>(std::max<size_t>(1, (256u << 20) / bytes + 1));
    std::vector<void*> weights(copies);
    for (auto& w : weights) {
      CHECK(cudaMalloc(&w, bytes));
      CHECK(cudaMemset(w, 0x11, bytes));
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
      p.dtype = folio::ScalarType::kBFloat16;
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
  std::printf("  8B decode step, projections + lm_head: %.0f us, %.0f us with gate_up gated\n", step_us,
              gated_step_us);
  return 0;
}
