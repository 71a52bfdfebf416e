// Paged decode attention on tensor cores (mma.sync m16n8k16), for 16-bit caches.
//
// The CUDA-core kernel (attention.cu) spends most of its issue slots on the dot products' shuffle trees: with
// 4 query heads per kv head it reaches about 70% of copy bandwidth at batch 256. Here the arithmetic goes to
// the tensor cores and the kernel is left with loads:
//
//  * A block owns one sequence, one kv head and all of its query heads (up to 16: the mma's M rows; rows past
//    the group are zero and never stored), over one split of the keys. Its 4 warps take 16-key tiles in turn
//    and keep their own online softmax, merged at the end through shared memory.
//  * Each warp copies its next tile's K and V rows (paged: one block-table look-up per key) into its own
//    double buffer with cp.async while it computes the current one: no block-wide barrier in the main loop.
//    Rows are stored with their 16-byte chunks XOR-swizzled by key, so that ldmatrix's 8 row reads of one
//    chunk column hit 8 different bank groups.
//  * S = Q K^T: Q is the A operand, loaded once into registers; ldmatrix gives K's B fragments (a K row is a
//    column of B). P = exp2(S - max) is rounded to the cache dtype and reused from S's accumulator registers
//    as the A operand of O += P V (the C layout of m16n8 is the A layout of m16k16); ldmatrix.trans gives V's
//    B fragments. Scores and the softmax state stay in fp32.
//  * Same partial format as the CUDA-core kernel, so its combine kernel merges the splits.
//  * Sliding window: the keys (and their splits) start at the window, so the pages before it are never read;
//    soft-capping maps each fp32 score through softcap * tanh(score / softcap) before the softmax.
//  * Quantized caches go to attention_mma_quant.cu's kernel (same blocks, splits and partials).
#include <type_traits>

#include "attention_mma.cuh"
#include "device_utils.cuh"
#include "launch.cuh"

namespace folio::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileKeys = 16;   // keys per warp iteration: the k of the P V mma
constexpr int kMaxGroup = 16;   // query heads per block: the m of the mmas
constexpr float kLog2e = 1.4426950408889634f;

struct MmaArgs {
  PagedAttentionParams p;
  int num_splits;  // the grid's
  SplitsByLength by_length;
  int group;        // Hq / Hkv
  int page_shift;   // log2(page_size)
  float* partial_acc;
  float* partial_ml;
};

template <int HEAD_DIM>
struct Layout {
  static constexpr int kChunks = HEAD_DIM / 8;                          // 16-byte chunks per K or V row
  static constexpr int kTileBytes = kTileKeys * HEAD_DIM * 2;           // one tile of K (or V)
  static constexpr int kStageBytes = 2 * kTileBytes;                    // K and V
  static constexpr int kWarpBytes = 2 * kStageBytes;                    // double buffer
  static constexpr int kPipeBytes = kWarps * kWarpBytes;
  static constexpr int kMergeBytes = kWarps * kMaxGroup * (HEAD_DIM + 2) * 4;  // per warp: O rows, max, sum
  static constexpr int kSmemBytes = kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes;
  static_assert(kChunks >= 8, "the swizzle spreads 8 chunk columns");
  static_assert(kChunks % 2 == 0, "ldmatrix.x4 takes two chunks of a row");
};

// Byte offset of chunk c of key row `key` inside a tile.
template <int HEAD_DIM>
__device__ __forceinline__ uint32_t swizzled(int key, int c) {
  return static_cast<uint32_t>(key * HEAD_DIM * 2 + ((c ^ (key & 7)) * 16));
}

__device__ __forceinline__ void cp_async16(uint32_t dst_shared, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_shared), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// d += A B for m16n8k16 with fp32 accumulators; a: A's four registers, b: B's two.
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats as one register of the 16-bit type, the first in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t word;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&word, &v, 4);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&word, &v, 4);
  }
  return word;
}

// Lane (g = lane / 4, t = lane % 4) holds, in mma fragment terms: S and P rows g (r = 0) and g + 8 (r = 1) = query
// heads head0 + g and head0 + g + 8; for the keys, columns 2t, 2t + 1 of each 8-key half; O columns 8n + 2t, +1.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads, 3) decode_attention_mma_kernel(MmaArgs a) {
  using L = Layout<HEAD_DIM>;
  constexpr int kSteps = HEAD_DIM / 16;  // k16 steps of Q K^T
  constexpr int kDimTiles = HEAD_DIM / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  grid_dependency_wait();  // q and the newest cache slots come from the previous kernel (launch.cuh)
  allow_dependent_launch();

  const PagedAttentionParams& p = a.p;
  const int64_t row = blockIdx.x;  // = sequence (decode)
  const int kv_head = blockIdx.y;
  const int split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int head0 = kv_head * a.group;

  int64_t key_begin = 0, key_end = 0;
  const int splits = decode_split(p, a.by_length, row, split, a.page_shift, kTileKeys, key_begin, key_end);
  if (splits == 0) return;
  const int num_tiles = key_end > key_begin ? static_cast<int>((key_end - key_begin + kTileKeys - 1) / kTileKeys) : 0;

  // Q as the A operand of S = Q K^T, loaded once: qa[s] covers dims 16s .. 16s + 15.
  uint32_t qa[kSteps][4];
  {
    const uint32_t* q_row = reinterpret_cast<const uint32_t*>(static_cast<const T*>(p.q) + row * p.q_stride_token);
    const int64_t head_words = p.q_stride_head / 2;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int h = g + 8 * r;
        const bool present = h < a.group;
        const uint32_t* q_head = q_row + (head0 + (present ? h : 0)) * head_words;
        qa[s][r] = present ? q_head[8 * s + t] : 0u;         // dims 16s + 2t, +1
        qa[s][r + 2] = present ? q_head[8 * s + 4 + t] : 0u;  // dims 16s + 8 + 2t, +1
      }
    }
  }
  const float score_scale = p.scale * kLog2e;  // scores in log2 units: exp2 below
  // Soft-capping in log2 units: c * tanh(s / c) with c = softcap * log2(e).
  const float softcap2 = p.softcap * kLog2e;
  const float inv_softcap2 = p.softcap > 0.0f ? 1.0f / softcap2 : 0.0f;

  float o[kDimTiles][4];
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // l: this lane's part of the row sums

  const uint32_t warp_smem = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + warp * L::kWarpBytes;
  const int32_t* block_table = p.block_tables + row * p.block_table_stride;
  const int64_t slot_mask = (int64_t{1} << a.page_shift) - 1;
  const T* k_base = static_cast<const T*>(p.k_cache) + kv_head * p.cache_stride_head;
  const T* v_base = static_cast<const T*>(p.v_cache) + kv_head * p.cache_stride_head;

  // Tile i's K and V rows into stage `stage`: lane l copies chunk l % kChunks of keys l / kChunks + j * (32 /
  // kChunks): a key's row is 16 (or 8) consecutive lanes, one coalesced 256 (128) byte read.
  auto prefetch = [&](int tile, int stage) {
    const int64_t tile_begin = key_begin + static_cast<int64_t>(tile) * kTileKeys;
    const uint32_t k_dst = warp_smem + stage * L::kStageBytes, v_dst = k_dst + L::kTileBytes;
    constexpr int kKeysPerPass = 32 / L::kChunks;
    const int c = lane % L::kChunks;
#pragma unroll
    for (int j = 0; j < kTileKeys / kKeysPerPass; ++j) {
      const int key = lane / L::kChunks + j * kKeysPerPass;
      const int64_t pos = tile_begin + key;
      const bool valid = pos < key_end;
      int64_t offset = 0;  // invalid: any readable address, zero bytes are read from it
      if (valid) {
        offset = block_table[pos >> a.page_shift] * p.cache_stride_page + (pos & slot_mask) * p.cache_stride_slot +
                 c * 8;
      }
      const uint32_t at = swizzled<HEAD_DIM>(key, c);
      cp_async16(k_dst + at, k_base + offset, valid);
      cp_async16(v_dst + at, v_base + offset, valid);
    }
  };

  if (warp < num_tiles) prefetch(warp, 0);
  cp_async_commit();
  int stage = 0;
  for (int tile = warp; tile < num_tiles; tile += kWarps, stage ^= 1) {
    if (tile + kWarps < num_tiles) prefetch(tile + kWarps, stage ^ 1);
    cp_async_commit();  // possibly empty: "one pending" then always means "this tile has landed"
    cp_async_wait<1>();
    __syncwarp();  // every lane's copies of this tile are visible to the whole warp

    const uint32_t k_tile = warp_smem + stage * L::kStageBytes;
    const uint32_t v_tile = k_tile + L::kTileBytes;
    // S = Q K^T for keys 8h .. 8h + 7 (h = 0, 1). ldmatrix lane l addresses row l % 8 of matrix l / 8; matrices
    // = chunks 2s .. 2s + 3 of those keys, i.e. b0, b1 of k-steps s and s + 1.
    float sc[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sc[h][0] = sc[h][1] = sc[h][2] = sc[h][3] = 0.0f;
#pragma unroll
      for (int s = 0; s < kSteps; s += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, k_tile + swizzled<HEAD_DIM>(8 * h + lane % 8, 2 * s + lane / 8));
        mma<T>(sc[h], qa[s], b[0], b[1]);
        mma<T>(sc[h], qa[s + 1], b[2], b[3]);
      }
    }
    // Online softmax over this tile, rows g and g + 8.
    const int64_t tile_begin = key_begin + static_cast<int64_t>(tile) * kTileKeys;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool valid = tile_begin + 8 * h + 2 * t + (e & 1) < key_end;
        float score = sc[h][e] * score_scale;
        if (p.softcap > 0.0f) score = softcap2 * tanhf(score * inv_softcap2);
        sc[h][e] = valid ? score : -INFINITY;
      }
    }
    uint32_t pa[4];  // P as the A operand of O += P V: keys 0..15 of the tile
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = fmaxf(fmaxf(sc[0][2 * r], sc[0][2 * r + 1]), fmaxf(sc[1][2 * r], sc[1][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[r], mx);
      const float base = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = exp2f(m[r] - base);
      m[r] = m_new;
      float p_vals[2][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        p_vals[h][0] = exp2f(sc[h][2 * r] - base);
        p_vals[h][1] = exp2f(sc[h][2 * r + 1] - base);
      }
      l[r] = l[r] * alpha + (p_vals[0][0] + p_vals[0][1]) + (p_vals[1][0] + p_vals[1][1]);
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        o[n][2 * r] *= alpha;
        o[n][2 * r + 1] *= alpha;
      }
      pa[r] = pack2<T>(p_vals[0][0], p_vals[0][1]);      // row g + 8r, keys 2t, 2t + 1
      pa[r + 2] = pack2<T>(p_vals[1][0], p_vals[1][1]);  // row g + 8r, keys 8 + 2t, 8 + 2t + 1
    }
    // O += P V. ldmatrix.trans matrices: keys 0..7 and 8..15 of chunks n and n + 1 = b0, b1 of dim tiles n, n + 1.
#pragma unroll
    for (int n = 0; n < kDimTiles; n += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, v_tile + swizzled<HEAD_DIM>((lane / 8 & 1) * 8 + lane % 8, n + lane / 16));
      mma<T>(o[n], pa, b[0], b[1]);
      mma<T>(o[n + 1], pa, b[2], b[3]);
    }
    __syncwarp();  // all lanes are done reading this stage before the next iteration's prefetch refills it
  }
  cp_async_wait<0>();

  // Row sums over the 4 lanes of a row, then the warps merge through shared memory (the pipeline's space).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  __syncthreads();
  float* sm_o = reinterpret_cast<float*>(smem);                    // [kWarps][kMaxGroup][HEAD_DIM]
  float* sm_m = sm_o + kWarps * kMaxGroup * HEAD_DIM;              // [kWarps][kMaxGroup]
  float* sm_l = sm_m + kWarps * kMaxGroup;                         // [kWarps][kMaxGroup]
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = g + 8 * r;
    if (h >= a.group) continue;
    float* o_row = sm_o + (warp * kMaxGroup + h) * HEAD_DIM;
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
      *reinterpret_cast<float2*>(o_row + 8 * n + 2 * t) = make_float2(o[n][2 * r], o[n][2 * r + 1]);
    }
    if (t == 0) {
      sm_m[warp * kMaxGroup + h] = m[r];
      sm_l[warp * kMaxGroup + h] = l[r];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < a.group * HEAD_DIM; idx += kThreads) {
    const int h = idx / HEAD_DIM, d = idx % HEAD_DIM;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sm_m[w * kMaxGroup + h]);
    const float base = mx == -INFINITY ? 0.0f : mx;
    float sum = 0.0f, value = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = exp2f(sm_m[w * kMaxGroup + h] - base);
      sum += sm_l[w * kMaxGroup + h] * weight;
      value += sm_o[(w * kMaxGroup + h) * HEAD_DIM + d] * weight;
    }
    const int64_t row_head = row * p.num_q_heads + head0 + h;
    if (splits == 1) {
      static_cast<T*>(p.out)[row_head * HEAD_DIM + d] = from_float<T>(sum > 0.0f ? value / sum : 0.0f);
    } else {
      const int64_t part = row_head * a.num_splits + split;
      a.partial_acc[part * HEAD_DIM + d] = value;
      if (d == 0) {
        a.partial_ml[2 * part] = mx;
        a.partial_ml[2 * part + 1] = sum;
      }
    }
  }
}

template <typename T, int HEAD_DIM>
cudaError_t launch_mma(const MmaArgs& a, int64_t num_rows, const Launch& launch) {
  constexpr int kBytes = Layout<HEAD_DIM>::kSmemBytes;
  // More than 48 KB of dynamic shared memory must be allowed per kernel and device, once (benign race: every
  // writer sets the same value).
  constexpr int kMaxDevices = 64;
  static bool allowed[kMaxDevices] = {};
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  if (device < 0 || device >= kMaxDevices || !allowed[device]) {
    status = cudaFuncSetAttribute(decode_attention_mma_kernel<T, HEAD_DIM>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
    if (status != cudaSuccess) return status;
    if (device >= 0 && device < kMaxDevices) allowed[device] = true;
  }
  const dim3 grid(static_cast<unsigned>(num_rows), static_cast<unsigned>(a.p.num_kv_heads),
                  static_cast<unsigned>(a.num_splits));
  return launch_kernel(decode_attention_mma_kernel<T, HEAD_DIM>, grid, dim3(kThreads), kBytes, launch, a);
}

template <typename T, int HEAD_DIM>
int mma_blocks_per_sm() {
  static const int blocks =
      resident_blocks_per_sm(decode_attention_mma_kernel<T, HEAD_DIM>, kThreads, Layout<HEAD_DIM>::kSmemBytes);
  return blocks;
}

}  // namespace

bool decode_attention_mma_applies(const PagedAttentionParams& p) {
  if (p.cu_seqlens_q != nullptr || p.dtype == ScalarType::kFloat32) return false;
  if (p.head_dim != 64 && p.head_dim != 128) return false;
  if (p.quant.format != KvFormat::kNone && !decode_attention_mma_quant_applies(p)) return false;
  return p.num_kv_heads > 0 && p.num_q_heads % p.num_kv_heads == 0 && p.num_q_heads / p.num_kv_heads <= kMaxGroup;
}

cudaError_t decode_attention_mma(const PagedAttentionParams& p, int64_t num_rows, const AttentionPlan& plan,
                                 int page_shift, float* partial_acc, float* partial_ml, const Launch& launch) {
  if (p.quant.format != KvFormat::kNone) {
    return decode_attention_mma_quant(p, num_rows, plan, page_shift, partial_acc, partial_ml, launch);
  }
  if (p.num_kv_heads > 65535 || plan.num_splits > 65535) return cudaErrorInvalidValue;
  MmaArgs a{};
  a.p = p;
  a.num_splits = plan.num_splits;
  a.by_length = plan.by_length;
  a.group = static_cast<int>(p.num_q_heads / p.num_kv_heads);
  a.page_shift = page_shift;
  a.partial_acc = partial_acc;
  a.partial_ml = partial_ml;
  cudaError_t status = cudaSuccess;
  dispatch_scalar(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>) {
      status = cudaErrorInvalidValue;  // decode_attention_mma_applies() refuses float32
    } else if (p.head_dim == 64) {
      status = launch_mma<T, 64>(a, num_rows, launch);
    } else {
      status = launch_mma<T, 128>(a, num_rows, launch);
    }
  });
  return status;
}

int decode_attention_mma_blocks_per_sm(const PagedAttentionParams& p) {
  if (p.quant.format != KvFormat::kNone) return 0;  // planned as the CUDA-core kernel (plan_paged_attention)
  int blocks = 0;
  dispatch_scalar(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) {
      blocks = p.head_dim == 64 ? mma_blocks_per_sm<T, 64>() : mma_blocks_per_sm<T, 128>();
    }
  });
  return blocks;
}

}  // namespace folio::cuda
