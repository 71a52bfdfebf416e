// Paged attention over [P, S, Hkv, D] caches, for decode (one query row per sequence) and prefill / chunked
// prefill (one row per new token, causal), with GQA.
//
// One thread block handles one query row, one kv head and up to G_TILE of the query heads that share it (so
// K/V are read once for the group), over one split of the row's keys. Inside the block, "workers" of
// LANES_PER_TOKEN lanes each own one key at a time: a worker's lanes hold 8 consecutive dims each, load the
// key's K and V rows with 16-byte loads (coalesced: a K row is contiguous), reduce the q.k dot products with
// xor-shuffles, and keep an online softmax (running max, sum, accumulator) of their own keys. Workers never
// talk inside the main loop; at the end they merge through shuffles and shared memory.
//
// Long contexts are split over several blocks (flash-decoding). Each split writes an unnormalized partial
// (accumulator, max, sum) to the workspace and `combine_kernel` merges them. The grid's number of splits is fixed
// on the host from the block-table width (an upper bound of the context); each row takes the splits that the
// plan gives its own length (AttentionPlan::by_length, read on the device with the row's context length, so no host
// synchronization is needed) and sizes them from that length.
//
// Decode over 16-bit caches with head_dim 64 or 128 (every Llama shape) runs on tensor cores instead
// (attention_mma.cu), writing the same partials; this kernel covers prefill rows, fp32 and other head dims.
//
// Sliding window (p.window > 0): a row's keys start at its window, not at 0, and the splits divide only those, so
// the pages before the window are never read (nor their block-table entries: the pages may be back in the pool).
// Soft-capping (p.softcap > 0) maps each score through softcap * tanh(score / softcap) before the softmax.
//
// Quantized caches (p.quant, the *_quant ops; FMT != kFmtNone): the same kernels copy each lane's 8 codes (8 or 4
// bytes) instead of 8 elements, load the scale of their group with plain loads one iteration ahead (cp.async
// moves at least 4 bytes, a scale is 2), and dequantize in fp32 where the unquantized kernel converts to fp32.
#include <algorithm>
#include <type_traits>

#include "attention_mma.cuh"
#include "device_utils.cuh"
#include "kernels.cuh"
#include "kv_quant.cuh"
#include "launch.cuh"

namespace folio::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxGroupTile = 8;
constexpr int kMinSplitKeys = 64;  // below this, a split's fixed costs outweigh the parallelism it adds
constexpr int kMaxSplits = 64;  // (AttentionPlan::by_length holds split counts in a byte)
constexpr int64_t kSplitFixedKeys = 128;  // a split block's fixed cost in keys' time (splits_in_whole_waves)
constexpr float kLog2e = 1.4426950408889634f;

struct KernelArgs {
  PagedAttentionParams p;
  int num_splits;    // the grid's
  SplitsByLength by_length;
  int group;         // Hq / Hkv
  int head_chunks;   // blocks along the query heads of one kv head: ceil(group / G_TILE)
  int page_shift;    // log2(page_size)
  float* partial_acc;  // [rows, Hq, num_splits, D] fp32
  float* partial_ml;   // [rows, Hq, num_splits, 2] fp32: max (log2 units), sum of exp2
};

// The sequence a query row belongs to and the number of keys it attends to (causal for prefill rows), counted
// from position 0 (the caller starts at its window).
__device__ __forceinline__ void row_extent(const PagedAttentionParams& p, int64_t row, int64_t& seq,
                                           int64_t& num_keys) {
  if (p.cu_seqlens_q == nullptr) {
    seq = row;
    num_keys = p.context_lens[row];
    return;
  }
  int64_t lo = 0, hi = p.num_seqs;  // invariant: cu[lo] <= row < cu[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (p.cu_seqlens_q[mid] <= row) lo = mid; else hi = mid;
  }
  seq = lo;
  const int64_t q_begin = p.cu_seqlens_q[lo], q_len = p.cu_seqlens_q[lo + 1] - q_begin;
  num_keys = p.context_lens[lo] - q_len + (row - q_begin) + 1;
}

// A row's keys, [first_key, num_keys) (from its window's start), clamped as decode_row_keys clamps them: malformed
// index tensors (which only the CPU binding can afford to check) cannot make a kernel read past the block-table row.
__device__ __forceinline__ void row_keys(const PagedAttentionParams& p, int64_t row, int page_shift, int64_t& seq,
                                         int64_t& first_key, int64_t& num_keys) {
  row_extent(p, row, seq, num_keys);
  num_keys = min(num_keys, min(static_cast<int64_t>(p.context_lens[seq]), p.max_blocks << page_shift));
  num_keys = max(num_keys, int64_t{0});
  first_key = first_visible_key(p, num_keys - 1);
}

// cp.async (sm_80+): BYTES (4, 8, 16 or 32) from global to shared, or zeros without reading when !valid.
template <int BYTES>
__device__ __forceinline__ void cp_async_zfill(void* dst, const void* src, bool valid) {
  const uint32_t dst_shared = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  if constexpr (BYTES < 16) {  // the codes of a quantized cache; .cg (L2 only) takes 16 bytes alone
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst_shared), "l"(src), "n"(BYTES),
                 "r"(valid ? BYTES : 0)
                 : "memory");
  } else {
    const int src_bytes = valid ? 16 : 0;
#pragma unroll
    for (int c = 0; c < BYTES / 16; ++c) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_shared + 16 * c),
                   "l"(static_cast<const char*>(src) + 16 * c), "r"(src_bytes)
                   : "memory");
    }
  }
}

// One lane's 8 elements of one K or V row as copied to shared memory: T elements, or codes of format FMT.
template <typename T, int FMT>
struct KvChunk {
  uint32_t w0, w1;  // fp8 / q8: 8 bytes; q4: 4 bytes in w0
  __device__ __forceinline__ void load(const unsigned char* src) {
    if constexpr (FMT == kFmtQ4) {
      w0 = *reinterpret_cast<const uint32_t*>(src);
      w1 = 0;
    } else {
      const uint2 v = *reinterpret_cast<const uint2*>(src);
      w0 = v.x;
      w1 = v.y;
    }
  }
  __device__ __forceinline__ void to_floats(float scale, float (&f)[8]) const { dequant8<FMT>(w0, w1, scale, f); }
};
template <typename T>
struct KvChunk<T, kFmtNone> {
  Vec8<T> v;
  __device__ __forceinline__ void load(const unsigned char* src) { v.load(reinterpret_cast<const T*>(src)); }
  __device__ __forceinline__ void to_floats(float, float (&f)[8]) const { v.to_floats(f); }
};

// Merges online-softmax state (m2, l2, acc2) into (m, l, acc); m in log2 units, -inf = empty.
template <int N>
__device__ __forceinline__ void merge_state(float& m, float& l, float (&acc)[N], float m2, float l2,
                                            const float (&acc2)[N]) {
  const float mx = fmaxf(m, m2);
  const float base = mx == -INFINITY ? 0.0f : mx;
  const float a1 = exp2f(m - base), a2 = exp2f(m2 - base);
  l = l * a1 + l2 * a2;
#pragma unroll
  for (int e = 0; e < N; ++e) acc[e] = acc[e] * a1 + acc2[e] * a2;
  m = mx;
}

// Four resident blocks per SM (16 warps) for up to 4 heads per block: 128 registers, no spills (ptxas -v);
// eight heads (four in fp32) need more registers and get two.
template <typename T, int LANES_PER_TOKEN, bool EXACT_D, int G_TILE, int UNROLL, int FMT = kFmtNone>
__global__ void __launch_bounds__(kThreads, G_TILE * sizeof(T) >= 16 ? 2 : 4) attention_kernel(KernelArgs a) {
  constexpr int kWorkersPerWarp = 32 / LANES_PER_TOKEN;
  constexpr int kWorkers = kWarps * kWorkersPerWarp;
  constexpr int kKeysPerIter = kWorkers * UNROLL;
  constexpr int kDimPad = LANES_PER_TOKEN * 8;
  constexpr bool kQuant = FMT != kFmtNone;
  // what the cache stores per element, and elements per stored unit (q4: two codes a byte)
  using Code = std::conditional_t<kQuant, unsigned char, T>;
  constexpr int kElemsPerCode = kQuant ? kv_elems_per_byte<FMT>() : 1;
  constexpr int kChunkBytes = 8 * static_cast<int>(sizeof(Code)) / kElemsPerCode;  // one lane's slice of a row
  constexpr int kPipeBytes = 2 * UNROLL * 2 * kThreads * kChunkBytes;
  constexpr int kMergeFloats = kWarps * G_TILE * (kDimPad + 2);
  constexpr int kSmemBytes = kPipeBytes > 4 * kMergeFloats ? kPipeBytes : 4 * kMergeFloats;
  // The main loop's double buffer and, after it, the merge buffers share this space.
  __shared__ __align__(16) unsigned char smem[kSmemBytes];
  auto chunk = [&](int buffer, int j, int kv) {  // this lane's slot: consecutive lanes, consecutive chunks
    return smem + (((buffer * UNROLL + j) * 2 + kv) * kThreads + threadIdx.x) * kChunkBytes;
  };
  float (*sm_acc)[G_TILE][kDimPad] = reinterpret_cast<float (*)[G_TILE][kDimPad]>(smem);
  float (*sm_m)[G_TILE] = reinterpret_cast<float (*)[G_TILE]>(smem + 4 * kWarps * G_TILE * kDimPad);
  float (*sm_l)[G_TILE] = sm_m + kWarps;

  grid_dependency_wait();  // q and the cache slots of the new tokens come from the previous kernel (launch.cuh)
  allow_dependent_launch();
  const PagedAttentionParams& p = a.p;
  const int64_t row = blockIdx.x;
  const int kv_head = blockIdx.y / a.head_chunks;
  const int head0 = kv_head * a.group + (blockIdx.y % a.head_chunks) * G_TILE;  // first query head here
  const int heads_here = min(G_TILE, a.group - static_cast<int>(blockIdx.y % a.head_chunks) * G_TILE);
  const int split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int worker = warp * kWorkersPerWarp + lane / LANES_PER_TOKEN;
  const int dim0 = (lane % LANES_PER_TOKEN) * 8;
  const bool lane_active = EXACT_D || dim0 < p.head_dim;

  int64_t seq, first_key, num_keys;  // from the window's start: earlier pages are not read
  row_keys(p, row, a.page_shift, seq, first_key, num_keys);
  const int splits = row_splits(a.by_length, num_keys - first_key);
  if (split >= splits) return;  // (this row's keys take fewer splits than the grid has)
  int64_t key_begin, key_end;
  split_keys(first_key, num_keys, splits, split, kKeysPerIter, key_begin, key_end);
  // Soft-capping in the scores' log2 units: c * tanh(s / c) with c = softcap * log2(e) (q carries scale * log2(e)).
  const float softcap2 = p.softcap * kLog2e;
  const float inv_softcap2 = p.softcap > 0.0f ? 1.0f / softcap2 : 0.0f;

  // q, pre-scaled so that scores come out in log2 units (exp2f below).
  float q[G_TILE][8];
  const T* q_row = static_cast<const T*>(p.q) + row * p.q_stride_token;
#pragma unroll
  for (int g = 0; g < G_TILE; ++g) {
    if (g < heads_here && lane_active) {
      Vec8<T> v;
      v.load(q_row + (head0 + g) * p.q_stride_head + dim0);
      v.to_floats(q[g]);
#pragma unroll
      for (int e = 0; e < 8; ++e) q[g][e] *= p.scale * kLog2e;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) q[g][e] = 0.0f;
    }
  }

  float m[G_TILE], l[G_TILE], acc[G_TILE][8];
#pragma unroll
  for (int g = 0; g < G_TILE; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.0f;
  }

  const int32_t* block_table = p.block_tables + seq * p.block_table_stride;
  const int64_t slot_mask = (int64_t{1} << a.page_shift) - 1;
  const Code* k_base = static_cast<const Code*>(p.k_cache) + kv_head * p.cache_stride_head + dim0 / kElemsPerCode;
  const Code* v_base = static_cast<const Code*>(p.v_cache) + kv_head * p.cache_stride_head + dim0 / kElemsPerCode;
  // Quantized caches: the scale of this lane's group for each key of the iteration in flight (raw float16 bits,
  // 0 for keys past the end, whose codes are zero-filled: their K and V stay 0 * 0 = 0).
  const uint16_t* k_scale_base = nullptr;
  const uint16_t* v_scale_base = nullptr;
  if constexpr (kQuant) {
    const int64_t head_offset = kv_head * p.quant.scale_stride_head + dim0 / p.quant.group_size;
    k_scale_base = static_cast<const uint16_t*>(p.quant.k_scale) + head_offset;
    v_scale_base = static_cast<const uint16_t*>(p.quant.v_scale) + head_offset;
  }
  uint16_t next_k_scale[UNROLL], next_v_scale[UNROLL];

  // Copies one iteration's K and V slices into `buffer` with cp.async: the next iteration's bytes are in
  // flight while this one computes, without holding them in registers. Each lane reads back only what it copied
  // itself, so waiting for its own copies (cp.async.wait_group) is all the synchronization the loop needs.
  auto prefetch = [&](int64_t iter_begin, int buffer) {
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
      const int64_t pos = iter_begin + j * kWorkers + worker;
      const bool valid = pos < key_end && lane_active;
      const Code* k_src = static_cast<const Code*>(p.k_cache);  // any readable address: zero bytes are read from it
      const Code* v_src = static_cast<const Code*>(p.v_cache);
      if constexpr (kQuant) next_k_scale[j] = next_v_scale[j] = 0;
      if (valid) {
        const int64_t page = block_table[pos >> a.page_shift];
        const int64_t offset = page * p.cache_stride_page + (pos & slot_mask) * p.cache_stride_slot;
        k_src = k_base + offset;
        v_src = v_base + offset;
        if constexpr (kQuant) {
          const int64_t scale_offset = page * p.quant.scale_stride_page + (pos & slot_mask) * p.quant.scale_stride_slot;
          next_k_scale[j] = k_scale_base[scale_offset];
          next_v_scale[j] = v_scale_base[scale_offset];
        }
      }
      cp_async_zfill<kChunkBytes>(chunk(buffer, j, 0), k_src, valid);
      cp_async_zfill<kChunkBytes>(chunk(buffer, j, 1), v_src, valid);
    }
    cp_async_commit();
  };

  int buffer = 0;
  if (key_begin < key_end) prefetch(key_begin, 0);
  for (int64_t iter_begin = key_begin; iter_begin < key_end; iter_begin += kKeysPerIter) {
    float k_scale[UNROLL] = {}, v_scale[UNROLL] = {};  // this iteration's, taken before the prefetch replaces them
    if constexpr (kQuant) {
#pragma unroll
      for (int j = 0; j < UNROLL; ++j) {
        k_scale[j] = half_bits_to_float(next_k_scale[j]);
        v_scale[j] = half_bits_to_float(next_v_scale[j]);
      }
    }
    if (iter_begin + kKeysPerIter < key_end) {
      prefetch(iter_begin + kKeysPerIter, buffer ^ 1);
    } else {
      cp_async_commit();  // an empty group keeps "all but the newest group" meaning "this iteration's group"
    }
    cp_async_wait<1>();
    KvChunk<T, FMT> k_vec[UNROLL], v_vec[UNROLL];
    bool valid[UNROLL];
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
      valid[j] = iter_begin + j * kWorkers + worker < key_end;
      k_vec[j].load(chunk(buffer, j, 0));
      v_vec[j].load(chunk(buffer, j, 1));
    }
    buffer ^= 1;
    float s[UNROLL][G_TILE];
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
      float k[8];
      k_vec[j].to_floats(k_scale[j], k);
#pragma unroll
      for (int g = 0; g < G_TILE; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) dot = fmaf(q[g][e], k[e], dot);
#pragma unroll
        for (int offset = LANES_PER_TOKEN / 2; offset > 0; offset >>= 1) {
          dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        }
        if (p.softcap > 0.0f) dot = softcap2 * tanhf(dot * inv_softcap2);
        s[j][g] = valid[j] ? dot : -INFINITY;
      }
    }
    // Online softmax: rescale each head's state to the new running max, turn scores into weights in place,
    // then accumulate V one key at a time (keeps only one converted V row live).
#pragma unroll
    for (int g = 0; g < G_TILE; ++g) {
      float mx = m[g];
#pragma unroll
      for (int j = 0; j < UNROLL; ++j) mx = fmaxf(mx, s[j][g]);
      const float base = mx == -INFINITY ? 0.0f : mx;
      const float alpha = exp2f(m[g] - base);
      m[g] = mx;
      l[g] *= alpha;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
#pragma unroll
      for (int j = 0; j < UNROLL; ++j) {
        s[j][g] = exp2f(s[j][g] - base);
        l[g] += s[j][g];
      }
    }
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
      float v[8];
      v_vec[j].to_floats(v_scale[j], v);
#pragma unroll
      for (int g = 0; g < G_TILE; ++g) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(s[j][g], v[e], acc[g][e]);
      }
    }
  }

  // Merge the workers of a warp (lanes holding the same dims are LANES_PER_TOKEN apart)...
#pragma unroll
  for (int offset = LANES_PER_TOKEN; offset < 32; offset <<= 1) {
#pragma unroll
    for (int g = 0; g < G_TILE; ++g) {
      float other[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) other[e] = __shfl_xor_sync(0xffffffffu, acc[g][e], offset);
      const float m2 = __shfl_xor_sync(0xffffffffu, m[g], offset);
      const float l2 = __shfl_xor_sync(0xffffffffu, l[g], offset);
      merge_state(m[g], l[g], acc[g], m2, l2, other);
    }
  }
  // ...then the warps, through shared memory (which the loop's buffers used until every warp is past it).
  cp_async_wait<0>();
  __syncthreads();
  if (lane < LANES_PER_TOKEN) {
#pragma unroll
    for (int g = 0; g < G_TILE; ++g) {
#pragma unroll
      for (int e = 0; e < 8; ++e) sm_acc[warp][g][dim0 + e] = acc[g][e];
      if (lane == 0) {
        sm_m[warp][g] = m[g];
        sm_l[warp][g] = l[g];
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G_TILE * kDimPad; idx += kThreads) {
    const int g = idx / kDimPad, d = idx % kDimPad;
    if (g >= heads_here || d >= p.head_dim) continue;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sm_m[w][g]);
    const float base = mx == -INFINITY ? 0.0f : mx;
    float sum = 0.0f, value = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float scale = exp2f(sm_m[w][g] - base);
      sum += sm_l[w][g] * scale;
      value += sm_acc[w][g][d] * scale;
    }
    const int64_t row_head = row * p.num_q_heads + head0 + g;
    if (splits == 1) {
      static_cast<T*>(p.out)[row_head * p.head_dim + d] = from_float<T>(sum > 0.0f ? value / sum : 0.0f);
    } else {
      const int64_t part = row_head * a.num_splits + split;
      a.partial_acc[part * p.head_dim + d] = value;
      if (d == 0) {
        a.partial_ml[2 * part] = mx;
        a.partial_ml[2 * part + 1] = sum;
      }
    }
  }
}

// grid (rows, Hq); merges the splits of one (row, head): those its row's length gave it (row_splits), each of which
// wrote its partial (empty ones: max -inf, sum 0, accumulator 0), so nothing uninitialized is read. A row of one
// split was written by its attention block. The partials' maxima and sums are read once, side by side, into shared
// memory: read in the loops below, their loads would come one after another for every split.
template <typename T>
__global__ void combine_kernel(KernelArgs a) {
  __shared__ float sm_ml[2 * kMaxSplits];
  grid_dependency_wait();
  allow_dependent_launch();
  const PagedAttentionParams& p = a.p;
  const int64_t row = blockIdx.x;
  int64_t seq, first_key, num_keys;
  row_keys(p, row, a.page_shift, seq, first_key, num_keys);
  const int splits = row_splits(a.by_length, num_keys - first_key);
  if (splits <= 1) return;
  const int64_t row_head = row * p.num_q_heads + blockIdx.y;
  const float* ml = a.partial_ml + 2 * row_head * a.num_splits;
  for (int i = threadIdx.x; i < 2 * splits; i += blockDim.x) sm_ml[i] = ml[i];
  __syncthreads();
  float mx = -INFINITY;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, sm_ml[2 * s]);
  const float base = mx == -INFINITY ? 0.0f : mx;
  float sum = 0.0f;
  for (int s = 0; s < splits; ++s) sum += sm_ml[2 * s + 1] * exp2f(sm_ml[2 * s] - base);
  const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
  const float* acc = a.partial_acc + row_head * a.num_splits * p.head_dim;
  for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
    float value = 0.0f;
#pragma unroll 4
    for (int s = 0; s < splits; ++s) value += acc[s * p.head_dim + d] * exp2f(sm_ml[2 * s] - base);
    static_cast<T*>(p.out)[row_head * p.head_dim + d] = from_float<T>(value * inv_sum);
  }
}

int group_tile(int group) {
  const int g = std::min(group, kMaxGroupTile);
  return g <= 1 ? 1 : g <= 2 ? 2 : g <= 4 ? 4 : 8;
}

// Keys per worker per iteration: 4, or 2 where registers (8 heads) or the 32 KB double buffer (fp32) are tight.
template <typename T, int LANES, bool EXACT, int FMT = kFmtNone>
void launch_with_dims(const KernelArgs& a, dim3 grid, int g_tile, const Launch& launch) {
  constexpr int kUnroll = sizeof(T) == 4 ? 2 : 4;
  switch (g_tile) {
    case 1:
      launch_kernel(attention_kernel<T, LANES, EXACT, 1, kUnroll, FMT>, grid, dim3(kThreads), 0, launch, a);
      break;
    case 2:
      launch_kernel(attention_kernel<T, LANES, EXACT, 2, kUnroll, FMT>, grid, dim3(kThreads), 0, launch, a);
      break;
    case 4:
      launch_kernel(attention_kernel<T, LANES, EXACT, 4, kUnroll, FMT>, grid, dim3(kThreads), 0, launch, a);
      break;
    default: launch_kernel(attention_kernel<T, LANES, EXACT, 8, 2, FMT>, grid, dim3(kThreads), 0, launch, a); break;
  }
}

// The CUDA-core kernel over a quantized cache (16-bit q only: the binding refuses float32).
template <typename T, int LANES, bool EXACT>
void launch_quant_with_dims(const KernelArgs& a, dim3 grid, int g_tile, const Launch& launch) {
  switch (a.p.quant.format) {
    case KvFormat::kFp8: launch_with_dims<T, LANES, EXACT, kFmtFp8>(a, grid, g_tile, launch); break;
    case KvFormat::kQ8: launch_with_dims<T, LANES, EXACT, kFmtQ8>(a, grid, g_tile, launch); break;
    case KvFormat::kQ4: launch_with_dims<T, LANES, EXACT, kFmtQ4>(a, grid, g_tile, launch); break;
    case KvFormat::kNone: break;
  }
}

}  // namespace

const char* attention_unsupported_reason(const PagedAttentionParams& p) {
  if (p.head_dim % 8 != 0 || p.head_dim > 256) return "CUDA paged attention needs head_dim a multiple of 8, <= 256";
  if (p.page_size & (p.page_size - 1)) return "CUDA paged attention needs a power-of-two page_size";
  const bool aligned = aligned16(p.q) && aligned16(p.k_cache) && aligned16(p.v_cache) && aligned16(p.out) &&
                       p.q_stride_token % 8 == 0 && p.q_stride_head % 8 == 0 && p.cache_stride_page % 8 == 0 &&
                       p.cache_stride_slot % 8 == 0 && p.cache_stride_head % 8 == 0;
  if (!aligned) return "CUDA paged attention needs 16-byte aligned q/k_cache/v_cache rows (strides multiples of 8)";
  if (p.quant.format != KvFormat::kNone) {
    if (p.dtype == ScalarType::kFloat32) return "CUDA quantized-cache attention takes float16 or bfloat16 q";
    const int64_t group = p.quant.format == KvFormat::kFp8 ? p.head_dim : kQuantGroup;
    if (p.quant.group_size != group || p.head_dim % group != 0) {
      return "CUDA quantized-cache attention needs head_dim a multiple of the group size (32 for q8 / q4)";
    }
  }
  return nullptr;
}

// The split count with the least time when time is counted in whole waves of `slots` resident blocks, a block's
// time as its keys (rounded up to a 16-key tile) plus a fixed cost the size of kSplitFixedKeys keys (q, the
// merge, the partials). A partial last wave costs a whole one while the kernel is bound by its instruction rate:
// 512 rows x kv heads of 4k keys on 396 slots take 3 waves in 2 splits (2.59 waves of work), 4 in 3 (3.88).
int64_t splits_in_whole_waves(int64_t base_blocks, int64_t slots, int64_t max_keys, int64_t max_splits) {
  auto cost = [&](int64_t s) {
    const int64_t waves = (base_blocks * s + slots - 1) / slots;
    const int64_t keys = ((max_keys + s - 1) / s + 15) / 16 * 16;
    return waves * (keys + kSplitFixedKeys);
  };
  int64_t best = 1;
  for (int64_t s = 2; s <= max_splits; ++s) {
    if (cost(s) < cost(best)) best = s;
  }
  return best;
}

AttentionPlan plan_paged_attention(const PagedAttentionParams& p, int64_t num_rows, int num_sms, bool decode_mma) {
  const int group = static_cast<int>(p.num_q_heads / p.num_kv_heads);
  const int64_t head_chunks = (group + group_tile(group) - 1) / group_tile(group);
  const int64_t base_blocks = std::max<int64_t>(1, num_rows * p.num_kv_heads * head_chunks);
  // keys one row attends to at most: the block-table width, or the window
  const int64_t max_keys = p.window > 0 ? std::min(p.max_blocks * p.page_size, p.window) : p.max_blocks * p.page_size;
  // The 16-bit tensor-core decode kernel (one block per row and kv head) is planned in whole waves of the blocks an
  // SM holds. The other kernels aim at about one full wave at 4 blocks an SM: the quantized-page kernel fills a
  // deeper copy ring at each block's start, and more splits made it slower (bench/RESULTS.md).
  const bool mma16 = decode_mma && p.quant.format == KvFormat::kNone && decode_attention_mma_applies(p);
  const int mma_per_sm = mma16 ? decode_attention_mma_blocks_per_sm(p) : 0;
  const int64_t mma_blocks = std::max<int64_t>(1, num_rows * p.num_kv_heads);
  const int64_t wanted = (4 * static_cast<int64_t>(num_sms) + base_blocks - 1) / base_blocks;  // ~one full wave
  // The splits for rows of `keys` keys, as if every row held that many.
  auto splits_for = [&](int64_t keys) {
    const int64_t by_length = (keys + kMinSplitKeys - 1) / kMinSplitKeys;
    const int64_t max_splits = std::max<int64_t>(1, std::min(by_length, int64_t{kMaxSplits}));
    if (mma_per_sm > 0) return splits_in_whole_waves(mma_blocks, int64_t{mma_per_sm} * num_sms, keys, max_splits);
    return std::max<int64_t>(1, std::min(wanted, max_splits));
  };
  const int64_t splits = splits_for(max_keys);
  AttentionPlan plan{static_cast<int>(splits), 0, {}};
  for (int k = 0; k < kSplitLengthBuckets; ++k) {  // (a bucket at or past max_keys gets `splits` itself)
    const int64_t keys = std::min(int64_t{64} << k, max_keys);
    plan.by_length.splits[k] = static_cast<uint8_t>(std::min(splits, splits_for(keys)));
  }
  if (splits > 1) plan.workspace_floats = num_rows * p.num_q_heads * splits * (p.head_dim + 2);
  return plan;
}

cudaError_t paged_attention(const PagedAttentionParams& p, int64_t num_rows, const AttentionPlan& plan,
                            float* workspace, bool decode_mma, const Launch& launch) {
  if (num_rows == 0) return cudaSuccess;
  if (attention_unsupported_reason(p) != nullptr) return cudaErrorInvalidValue;
  KernelArgs a{};
  a.p = p;
  a.num_splits = plan.num_splits;
  a.by_length = plan.by_length;
  a.group = static_cast<int>(p.num_q_heads / p.num_kv_heads);
  const int g_tile = group_tile(a.group);
  a.head_chunks = (a.group + g_tile - 1) / g_tile;
  a.page_shift = 0;
  while ((int64_t{1} << a.page_shift) < p.page_size) ++a.page_shift;
  if (plan.num_splits > 1) {
    a.partial_acc = workspace;
    a.partial_ml = workspace + num_rows * p.num_q_heads * plan.num_splits * p.head_dim;
  }
  const dim3 grid(static_cast<unsigned>(num_rows), static_cast<unsigned>(p.num_kv_heads * a.head_chunks),
                  static_cast<unsigned>(plan.num_splits));
  // Decode with 16-bit caches goes to the tensor-core kernel (attention_mma.cu); it writes the same partials.
  const bool mma = decode_mma && decode_attention_mma_applies(p);
  cudaError_t status = cudaSuccess;
  const bool quant = p.quant.format != KvFormat::kNone;
  dispatch_scalar(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (mma) {
      status = decode_attention_mma(p, num_rows, plan, a.page_shift, a.partial_acc, a.partial_ml, launch);
    } else if (quant) {
      if constexpr (std::is_same_v<T, float>) {
        status = cudaErrorInvalidValue;  // attention_unsupported_reason() refuses float32 q first
      } else if (p.head_dim == 64) {
        launch_quant_with_dims<T, 8, true>(a, grid, g_tile, launch);
      } else if (p.head_dim == 128) {
        launch_quant_with_dims<T, 16, true>(a, grid, g_tile, launch);
      } else {
        launch_quant_with_dims<T, 32, false>(a, grid, g_tile, launch);
      }
    } else if (p.head_dim == 64) {
      launch_with_dims<T, 8, true>(a, grid, g_tile, launch);
    } else if (p.head_dim == 128) {
      launch_with_dims<T, 16, true>(a, grid, g_tile, launch);
    } else {
      launch_with_dims<T, 32, false>(a, grid, g_tile, launch);
    }
    if (plan.num_splits > 1) {
      const dim3 combine_grid(static_cast<unsigned>(num_rows), static_cast<unsigned>(p.num_q_heads));
      const int threads = static_cast<int>(std::min<int64_t>(256, (p.head_dim + 31) / 32 * 32));
      launch_kernel(combine_kernel<T>, combine_grid, dim3(threads), 0, launch, a);
    }
  });
  if (status != cudaSuccess) return status;
  return cudaGetLastError();
}

}  // namespace folio::cuda
