// Sampling hot path on the GPU: penalties, token masks, and top-k / top-p / min-p / inverse-CDF sampling per
// row, all without sorting the vocabulary and without host synchronization. native/cpu/kernels.h defines the
// semantics (folio.sampling's, with exact integer masses).
//
// A row's candidates are ordered by weight descending, ties by index ascending. Every filter keeps a prefix of
// that order, described by a Boundary (the last kept element). Finding the element at which a running count
// or running mass first reaches a target is a radix select over the weights' bit patterns ("keys", computed
// once per row into a scratch buffer): four passes of 8-bit histograms from the most significant byte down
// narrow the key; ties at the final key are resolved by index. When top-k leaves at most kCompactCap tokens,
// they are gathered into shared memory and sorted there, and top-p, min-p and the draw finish on that short
// list. Masses are integers (floor(w * 2^40)), so every sum is exact and independent of the order in which
// threads add it up: the result does not depend on the launch shape, and matches the CPU kernel.
//
// The passes are bound by memory latency (one block per row, a few blocks per SM), not bandwidth: each thread
// loads kUnroll elements of a chunk before it uses any. The common case, 2 <= top-k <= kCompactCap, usually
// takes three or four passes instead of eight: the argmax, the keys (which count the highest buckets of the first
// radix histogram on the way), a histogram pass or two only if needed, and the gather, as soon as the elements at
// or above the selected radix bucket fit the short list (sample_short_top_k).
#include <climits>
#include <cstdint>

#include "device_utils.cuh"
#include "kernels.cuh"

namespace folio::cuda {
namespace {

constexpr int kSampleThreads = 512;
constexpr int kSampleWarps = kSampleThreads / 32;
constexpr int kCompactCap = 1024;
// Elements per thread in flight in a pass over a row: a chunk is kUnroll slices of kSampleThreads contiguous
// elements, slice j of every thread loaded before any is used.
constexpr int kUnroll = 8;
constexpr int64_t kChunk = static_cast<int64_t>(kSampleThreads) * kUnroll;
constexpr double kTopPSlack = 1e-6;
// Weight keys are the bits of weights in [0, 1]: their top byte is at most that of 1.0f.
constexpr int kMaxKeyBucket = 0x3f;
// The keys pass counts this many of the highest top-byte buckets (weights down to 2^-15); a row whose top_k-th
// weight is smaller takes one more pass for the full histogram.
constexpr int kTopBuckets = 8;
constexpr unsigned kFull = 0xffffffffu;

// Last kept element of a prefix of the order: element (key, i) is kept iff key > this.key, or key == this.key
// and i <= this.index.
struct Boundary {
  uint32_t key;
  int64_t index;
  __device__ __forceinline__ bool keeps(uint32_t k, int64_t i) const { return k > key || (k == key && i <= index); }
  // true if this boundary keeps fewer elements than `other` (comes earlier in the order)
  __device__ __forceinline__ bool before(const Boundary& other) const {
    return key > other.key || (key == other.key && index < other.index);
  }
};

struct SampleShared {
  unsigned long long histogram[256];
  unsigned long long scratch_u64[kSampleWarps];
  float scratch_value[kSampleWarps];
  long long scratch_index[kSampleWarps];
  int bucket;                    // pick_bucket's choice, the amount in the buckets above it, and in it
  unsigned long long above;
  unsigned long long in_bucket;
  int count;
  // short list: ((0xffffffff - key) << 32) | index, so that ascending order is the candidates' order
  unsigned long long ranked[kCompactCap];
};

__device__ __forceinline__ unsigned long long mass_of_key(uint32_t key) {
  return static_cast<unsigned long long>(static_cast<double>(__uint_as_float(key)) * kSampleWeightScale);
}

// The same arithmetic as the CPU kernel: IEEE division, full-precision expf.
__device__ __forceinline__ uint32_t weight_key(float logit, float temperature, float max_z) {
  const float w = expf(logit / temperature - max_z);
  return __float_as_uint(isnan(w) ? 0.0f : w);
}

// The index of this thread's element in slice j of the chunk at `base`. A thread's elements come in increasing
// index order (base, then j), which the first-index tie-breaks below rely on.
__device__ __forceinline__ int64_t chunk_index(int64_t base, int j) {
  return base + static_cast<int64_t>(j) * kSampleThreads + threadIdx.x;
}

// This thread's kUnroll elements of the chunk at `base`, `fill` past the end of the row: all loads are issued
// before any value is used, so that each thread has kUnroll of them in flight.
template <typename T>
__device__ __forceinline__ void load_chunk(const T* row, int64_t vocab, int64_t base, T fill, T (&out)[kUnroll]) {
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    const int64_t i = chunk_index(base, j);
    out[j] = i < vocab ? row[i] : fill;
  }
}

// Calls fn(value, i) for each of this thread's slots of the row, chunk by chunk (load_chunk: kUnroll loads in
// flight), slots past the end included (i >= vocab, value `fill`): every thread of the block makes the same
// number of calls, which the passes whose bodies shuffle across a warp need.
template <typename T, typename Fn>
__device__ __forceinline__ void for_each_slot(const T* row, int64_t vocab, T fill, Fn&& fn) {
  for (int64_t base = 0; base < vocab; base += kChunk) {
    T v[kUnroll];
    load_chunk(row, vocab, base, fill, v);
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) fn(v[j], chunk_index(base, j));
  }
}

__device__ unsigned long long block_sum_u64(unsigned long long v, SampleShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFull, v, offset);
  __syncthreads();
  if (lane == 0) sh.scratch_u64[warp] = v;
  __syncthreads();
  unsigned long long total = 0;
  for (int w = 0; w < kSampleWarps; ++w) total += sh.scratch_u64[w];
  return total;
}

__device__ long long block_min_index(long long v, SampleShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = min(v, __shfl_xor_sync(kFull, v, offset));
  __syncthreads();
  if (lane == 0) sh.scratch_index[warp] = v;
  __syncthreads();
  long long best = sh.scratch_index[0];
  for (int w = 1; w < kSampleWarps; ++w) best = min(best, sh.scratch_index[w]);
  return best;
}

__device__ __forceinline__ void take_better(float& best, long long& best_index, float other, long long other_index) {
  if (other_index >= 0 && (best_index < 0 || other > best || (other == best && other_index < best_index))) {
    best = other;
    best_index = other_index;
  }
}

// The first index of the largest logit (NaN never wins); -1 when every logit is -inf or NaN.
__device__ long long block_argmax(const float* logits, int64_t vocab, SampleShared& sh) {
  float best = -INFINITY;
  long long best_index = -1;
  for_each_slot(logits, vocab, -INFINITY, [&](float v, int64_t i) {  // -inf (past the end too) never wins
    if (v > best) {  // a thread visits its indices in increasing order: strict keeps the first
      best = v;
      best_index = i;
    }
  });
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    take_better(best, best_index, __shfl_xor_sync(kFull, best, offset), __shfl_xor_sync(kFull, best_index, offset));
  }
  __syncthreads();
  if (lane == 0) {
    sh.scratch_value[warp] = best;
    sh.scratch_index[warp] = best_index;
  }
  __syncthreads();
  best = -INFINITY;
  best_index = -1;
  for (int w = 0; w < kSampleWarps; ++w) take_better(best, best_index, sh.scratch_value[w], sh.scratch_index[w]);
  return best_index;
}

__device__ unsigned long long kept_mass(const uint32_t* keys, int64_t vocab, const Boundary& kept, SampleShared& sh) {
  unsigned long long mass = 0;
  for_each_slot(keys, vocab, 0u, [&](uint32_t k, int64_t i) {
    if (i < vocab && kept.keeps(k, i)) mass += mass_of_key(k);
  });
  return block_sum_u64(mass, sh);
}

// keys[i] = the weight key of logits[i], for the whole row.
__device__ void write_keys(const float* logits, uint32_t* keys, int64_t vocab, float temperature, float max_z) {
  for_each_slot(logits, vocab, 0.0f, [&](float v, int64_t i) {
    if (i < vocab) keys[i] = weight_key(v, temperature, max_z);
  });
}

// The index of the n-th (1-based) kept element with key == key, in index order.
__device__ long long nth_with_key(const uint32_t* keys, int64_t vocab, const Boundary& kept, uint32_t key,
                                  unsigned long long n, SampleShared& sh) {
  if (n == 1) {  // the usual case (no ties): the smallest such index
    long long first = LLONG_MAX;
    for (int64_t i = threadIdx.x; i < vocab; i += kSampleThreads) {
      if (keys[i] == key && kept.keeps(key, i)) {
        first = i;
        break;
      }
    }
    return block_min_index(first, sh);
  }
  // Ties: walk the row in chunks, counting matches in index order with warp ballots.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long seen = 0;
  long long found = -1;
  for (int64_t chunk = 0; chunk < vocab; chunk += kSampleThreads) {
    const int64_t i = chunk + threadIdx.x;
    const bool match = i < vocab && keys[i] == key && kept.keeps(key, i);
    const unsigned ballot = __ballot_sync(kFull, match);
    __syncthreads();
    if (lane == 0) sh.scratch_u64[warp] = __popc(ballot);
    __syncthreads();
    unsigned long long before = 0, total = 0;
    for (int w = 0; w < kSampleWarps; ++w) {
      const unsigned long long c = sh.scratch_u64[w];
      before += w < warp ? c : 0;
      total += c;
    }
    const unsigned long long rank = seen + before + __popc(ballot & ((1u << lane) - 1u)) + 1;
    if (match && rank == n) sh.scratch_index[0] = i;
    seen += total;
    if (seen >= n) {  // uniform across the block
      __syncthreads();
      found = sh.scratch_index[0];
      break;
    }
  }
  return found;
}

// Adds `amount` to histogram[bucket] for every lane with bucket >= 0, one shared-memory atomic per distinct
// bucket in the warp (weights cluster in a few exponents, so per-lane atomics would serialize).
__device__ __forceinline__ void histogram_add(SampleShared& sh, int bucket, unsigned long long amount, bool by_mass) {
  // a radix pass past the first matches a few thousand elements of a 128k row: most warps have none to add
  if (!__any_sync(kFull, bucket >= 0)) return;
  const unsigned peers = __match_any_sync(kFull, bucket);
  if (bucket < 0) return;
  unsigned long long total;
  if (by_mass) {  // masses < 2^41: 26 + 15 bit halves, whose 32-lane sums fit in 32 bits
    const unsigned low = __reduce_add_sync(peers, static_cast<unsigned>(amount & 0x3ffffffull));
    const unsigned high = __reduce_add_sync(peers, static_cast<unsigned>(amount >> 26));
    total = (static_cast<unsigned long long>(high) << 26) + low;
  } else {
    total = __popc(peers);
  }
  if ((threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&sh.histogram[bucket], total);
}

// Adds to sh.histogram (zeroed by the caller, read after a barrier) the count (by_mass false) or mass of every
// element of `kept` whose key bits above byte `shift` equal `prefix`, in the bucket of that byte.
__device__ void histogram_pass(const uint32_t* keys, int64_t vocab, const Boundary& kept, bool by_mass, int shift,
                               uint32_t prefix, SampleShared& sh) {
  const uint32_t high_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
  for_each_slot(keys, vocab, 0u, [&](uint32_t k, int64_t i) {  // every slot: histogram_add shuffles a whole warp
    int bucket = -1;
    unsigned long long amount = 0;
    if (i < vocab && (k & high_mask) == prefix && kept.keeps(k, i)) {
      bucket = static_cast<int>((k >> shift) & 255u);
      amount = by_mass ? mass_of_key(k) : 1ull;
    }
    histogram_add(sh, bucket, amount, by_mass);
  });
}

// Warp 0, once sh.histogram is complete: the bucket in which the running amount (`above` before the highest
// bucket) first reaches `target`, into sh.bucket, with the amount above it (sh.above) and in it (sh.in_bucket).
// Every thread reads them after the next barrier.
__device__ void pick_bucket(unsigned long long above, unsigned long long target, SampleShared& sh) {
  const int lane = threadIdx.x & 31;
  // lane L owns buckets 255 - 8L .. 248 - 8L (descending)
  unsigned long long local[8], lane_total = 0;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    local[e] = sh.histogram[255 - (lane * 8 + e)];
    lane_total += local[e];
  }
  unsigned long long inclusive = lane_total;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const unsigned long long v = __shfl_up_sync(kFull, inclusive, offset);
    if (lane >= offset) inclusive += v;
  }
  const unsigned ballot = __ballot_sync(kFull, above + inclusive >= target);
  const int first = ballot ? __ffs(ballot) - 1 : 31;  // empty ballot: target past the total (defensive)
  if (lane == first) {
    // the first of the lane's buckets that reaches target (its last one, defensively), unrolled so that local[]
    // stays in registers
    unsigned long long running = above + inclusive - lane_total, in_bucket = local[7];
    int e = 7;
    bool found = false;
#pragma unroll
    for (int q = 0; q < 7; ++q) {
      if (!found) {
        if (running + local[q] >= target) {
          found = true;
          e = q;
          in_bucket = local[q];
        } else {
          running += local[q];
        }
      }
    }
    sh.bucket = 255 - (lane * 8 + e);
    sh.above = running;
    sh.in_bucket = in_bucket;
  }
}

// The end of a radix select whose four passes narrowed the key to `prefix`, with `above` kept before it: the
// element with that key at which the count or mass reaches `target`.
__device__ Boundary boundary_at_key(const uint32_t* keys, int64_t vocab, const Boundary& kept, bool by_mass,
                                    unsigned long long target, uint32_t prefix, unsigned long long above,
                                    SampleShared& sh) {
  const unsigned long long need = target - above;  // >= 1: still needed from elements with key == prefix
  const unsigned long long unit = by_mass ? mass_of_key(prefix) : 1ull;
  const unsigned long long n = unit > 0 ? (need + unit - 1) / unit : 1;
  return Boundary{prefix, nth_with_key(keys, vocab, kept, prefix, n, sh)};
}

// One step of a radix select: the histogram of key byte `shift` over the kept elements whose higher bytes match
// `prefix` (unless the caller has already built it in sh.histogram), then the bucket in which the running
// amount reaches `target`. Adds that bucket to `prefix` and sets `above` to the amount in the buckets above it.
__device__ void radix_step(const uint32_t* keys, int64_t vocab, const Boundary& kept, bool by_mass,
                           unsigned long long target, int shift, bool histogram_built, uint32_t& prefix,
                           unsigned long long& above, SampleShared& sh) {
  if (!histogram_built) {
    for (int b = threadIdx.x; b < 256; b += kSampleThreads) sh.histogram[b] = 0;
    __syncthreads();
    histogram_pass(keys, vocab, kept, by_mass, shift, prefix, sh);
    __syncthreads();
  }
  if (threadIdx.x < 32) pick_bucket(above, target, sh);
  __syncthreads();
  prefix |= static_cast<uint32_t>(sh.bucket) << shift;
  above = sh.above;
}

// The element of the order at which the kept count (by_mass false) or kept mass (true) first reaches
// `target` (1 <= target <= the kept total).
__device__ Boundary select_boundary(const uint32_t* keys, int64_t vocab, const Boundary& kept, bool by_mass,
                                    unsigned long long target, SampleShared& sh) {
  uint32_t prefix = 0;
  unsigned long long above = 0;  // kept amount in buckets above the current one
  for (int shift = 24; shift >= 0; shift -= 8) {
    radix_step(keys, vocab, kept, by_mass, target, shift, false, prefix, above, sh);
  }
  return boundary_at_key(keys, vocab, kept, by_mass, target, prefix, above, sh);
}

__device__ __forceinline__ unsigned long long ranked_mass(const SampleShared& sh, int r) {
  return mass_of_key(0xffffffffu - static_cast<uint32_t>(sh.ranked[r] >> 32));
}

// Warp 0 only: the number of leading ranks (of `count`) whose inclusive mass first reaches target; count if
// none does.
__device__ int ranks_to_reach(const SampleShared& sh, int count, unsigned long long target) {
  const int lane = threadIdx.x & 31;
  unsigned long long running = 0;
  for (int base = 0; base < count; base += 32) {
    const int r = base + lane;
    const unsigned long long mass = r < count ? ranked_mass(sh, r) : 0ull;
    unsigned long long inclusive = mass;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const unsigned long long v = __shfl_up_sync(kFull, inclusive, offset);
      if (lane >= offset) inclusive += v;
    }
    const unsigned ballot = __ballot_sync(kFull, r < count && running + inclusive >= target);
    if (ballot) return base + __ffs(ballot);
    running += __shfl_sync(kFull, inclusive, 31);
  }
  return count;
}

__device__ unsigned long long warp_ranked_sum(const SampleShared& sh, int count) {
  unsigned long long total = 0;
  for (int r = threadIdx.x & 31; r < count; r += 32) total += ranked_mass(sh, r);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) total += __shfl_xor_sync(kFull, total, offset);
  return total;
}

__device__ __forceinline__ unsigned long long ranked_entry(uint32_t key, int64_t i) {
  return (static_cast<unsigned long long>(0xffffffffu - key) << 32) | static_cast<unsigned long long>(i);
}

// Sorts the `count` (<= kCompactCap) entries that the block has just gathered into sh.ranked into the
// candidates' order (ascending entries; the entries are distinct, so the order is unique).
__device__ void sort_short_list(int count, SampleShared& sh) {
  int padded = 1;
  while (padded < count) padded <<= 1;
  __syncthreads();
  for (int i = count + threadIdx.x; i < padded; i += kSampleThreads) sh.ranked[i] = ~0ull;
  __syncthreads();
  for (int size = 2; size <= padded; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < padded; i += kSampleThreads) {
        const int partner = i ^ stride;
        if (partner > i) {
          const bool ascending = (i & size) == 0;
          const unsigned long long a = sh.ranked[i], b = sh.ranked[partner];
          if ((a > b) == ascending) {
            sh.ranked[i] = b;
            sh.ranked[partner] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

// Gathers the `count` kept elements of `kept` into sh.ranked and sorts them into the candidates' order.
__device__ void gather_short_list(const uint32_t* keys, int64_t vocab, const Boundary& kept, int count,
                                  SampleShared& sh) {
  if (threadIdx.x == 0) sh.count = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < vocab; i += kSampleThreads) {
    const uint32_t k = keys[i];
    if (kept.keeps(k, i)) {
      const int slot = atomicAdd(&sh.count, 1);
      if (slot < kCompactCap) sh.ranked[slot] = ranked_entry(k, i);
    }
  }
  sort_short_list(count, sh);
}

// Warp 0 finishes a row from its sorted short list of `count` candidates (the CPU kernel's steps, verbatim).
__device__ void finish_short_list(const SampleParams& p, int64_t r, int count, const SampleShared& sh) {
  const float top_p = p.top_p[r], min_p = p.min_p[r];
  int kept = count;
  if (top_p < 1.0f) {
    const unsigned long long total = warp_ranked_sum(sh, kept);
    const double target = ceil((static_cast<double>(top_p) - kTopPSlack) * static_cast<double>(total));
    kept = ranks_to_reach(sh, kept, target < 1.0 ? 1ull : static_cast<unsigned long long>(target));
  }
  if (min_p > 0.0f) {
    const uint32_t min_key = __float_as_uint(min_p);
    int above = 0;
    for (int base = 0; base < kept; base += 32) {  // keys are sorted descending: count the leading ones >= min_p
      const int i = base + (threadIdx.x & 31);
      const bool ok = i < kept && 0xffffffffu - static_cast<uint32_t>(sh.ranked[i] >> 32) >= min_key;
      const unsigned ballot = __ballot_sync(kFull, ok);
      above += __popc(ballot);
      if (ballot != kFull) break;
    }
    kept = max(above, 1);
  }
  const unsigned long long total = warp_ranked_sum(sh, kept);
  const double scaled = static_cast<double>(p.uniform[r]) * static_cast<double>(total);
  const unsigned long long target = min(total, static_cast<unsigned long long>(scaled) + 1ull);
  const int rank = ranks_to_reach(sh, kept, target) - 1;
  if ((threadIdx.x & 31) == 0) {
    p.out_token_ids[r] = static_cast<int64_t>(sh.ranked[rank] & 0xffffffffu);
    p.out_probs[r] = static_cast<float>(static_cast<double>(ranked_mass(sh, rank)) / static_cast<double>(total));
  }
}

// Gathers into sh.ranked every element whose key bits from `shift` up are at least those of `prefix` (the
// caller has counted them: at most kCompactCap), unsorted.
__device__ void gather_at_or_above(const uint32_t* keys, int64_t vocab, uint32_t prefix, int shift,
                                   SampleShared& sh) {
  const uint32_t lowest = prefix >> shift;
  if (threadIdx.x == 0) sh.count = 0;
  __syncthreads();
  for_each_slot(keys, vocab, 0u, [&](uint32_t k, int64_t i) {
    if (i < vocab && (k >> shift) >= lowest) {
      const int slot = atomicAdd(&sh.count, 1);
      if (slot < kCompactCap) sh.ranked[slot] = ranked_entry(k, i);
    }
  });
}

// A row with top-k, 2 <= top_k <= kCompactCap and top_k < vocab (the usual sampling settings): writes the keys,
// selects the top_k candidates into sh.ranked and finishes the row there.
//
// The keys pass also counts the first radix histogram's highest buckets (top byte, every element: no filter yet;
// the whole histogram in one more pass when those buckets hold fewer than top_k elements), and the count
// select stops as soon as the short list can hold every element at or above the selected bucket. After the pass
// at `shift` has selected bucket b, with A elements in higher buckets and c in b, the set S of elements whose key
// bits from `shift` up are >= those of the prefix (b included) has exactly A + c elements, and A < top_k <= A + c.
// Every element outside S has a key strictly smaller than every key in S (they differ in those high bits), so S
// is exactly the first A + c ranks of the order (weight descending, ties by index ascending): no tie crosses the
// edge of S. Sorting S by (key descending, index ascending), which is the order of its ranked entries, puts those
// ranks in sequence, and the first top_k of them are the ranks 0 .. top_k - 1: the same top_k elements, in the
// same sequence, as the full select's Boundary{key of rank top_k - 1, its index} keeps and gather_short_list
// sorts, ties at the boundary included (within S they are ordered by index, as the Boundary's index cut does).
// finish_short_list reads only ranks below top_k; the entries beyond it are unused.
//
// When the elements at or above the bucket never fit, i.e. more than kCompactCap - A elements share the top_k-th
// key, the four passes have computed exactly the histograms, buckets and amounts that select_boundary computes
// (integer counts, independent of the order of the atomic adds), and the row finishes as select_boundary +
// gather_short_list would: the tie at that key is resolved by index with nth_with_key.
__device__ void sample_short_top_k(const SampleParams& p, int64_t r, const float* logits, uint32_t* keys,
                                   int64_t vocab, float temperature, float max_z, int top_k, SampleShared& sh) {
  for (int b = threadIdx.x; b < 256; b += kSampleThreads) sh.histogram[b] = 0;
  __syncthreads();
  // The keys, and the counts of the kTopBuckets highest top-byte buckets on the way: lane j of each warp counts
  // bucket kMaxKeyBucket - j from warp ballots (a weight is at most 1, so no key has a higher top byte). Most of
  // a row's weights are far smaller; the per-element cost is a few ballots instead of a shared-memory histogram.
  const int lane = threadIdx.x & 31;
  unsigned top_count = 0;
  for_each_slot(logits, vocab, 0.0f, [&](float v, int64_t i) {  // every slot: the ballots need the whole warp
    int bucket = -1;
    if (i < vocab) {
      const uint32_t k = weight_key(v, temperature, max_z);
      keys[i] = k;
      bucket = static_cast<int>(k >> 24);
    }
    if (!__any_sync(kFull, bucket > kMaxKeyBucket - kTopBuckets)) return;
#pragma unroll
    for (int j = 0; j < kTopBuckets; ++j) {
      const unsigned ballot = __ballot_sync(kFull, bucket == kMaxKeyBucket - j);
      if (lane == j) top_count += __popc(ballot);
    }
  });
  if (lane < kTopBuckets && top_count > 0) atomicAdd(&sh.histogram[kMaxKeyBucket - lane], top_count);
  __syncthreads();  // the counts are complete, and the block reads back keys that other threads wrote
  unsigned long long counted = 0;
  for (int j = 0; j < kTopBuckets; ++j) counted += sh.histogram[kMaxKeyBucket - j];
  if (counted < static_cast<unsigned long long>(top_k)) {  // the top_k-th weight is below those buckets (rare)
    __syncthreads();  // every thread has read the partial counts
    for (int b = threadIdx.x; b < 256; b += kSampleThreads) sh.histogram[b] = 0;
    __syncthreads();
    histogram_pass(keys, vocab, Boundary{0u, LLONG_MAX}, false, 24, 0u, sh);
    __syncthreads();
  }
  // Either way sh.histogram now holds the exact counts of every bucket down to the one where the count reaches
  // top_k (the buckets below it are zero or exact), which is all that pick_bucket reads to choose that bucket.

  const Boundary everything{0u, LLONG_MAX};
  const unsigned long long target = static_cast<unsigned long long>(top_k);
  uint32_t prefix = 0;
  unsigned long long above = 0;  // elements in buckets above the current one
  for (int shift = 24; shift >= 0; shift -= 8) {
    // (the top byte's histogram came with the keys)
    radix_step(keys, vocab, everything, false, target, shift, shift == 24, prefix, above, sh);
    const unsigned long long at_or_above = above + sh.in_bucket;  // the same in every thread: uniform branch
    if (at_or_above <= kCompactCap) {
      gather_at_or_above(keys, vocab, prefix, shift, sh);
      sort_short_list(static_cast<int>(at_or_above), sh);
      if (threadIdx.x < 32) finish_short_list(p, r, top_k, sh);
      return;
    }
  }
  const Boundary kept = boundary_at_key(keys, vocab, everything, false, target, prefix, above, sh);
  gather_short_list(keys, vocab, kept, top_k, sh);
  if (threadIdx.x < 32) finish_short_list(p, r, top_k, sh);
}

__global__ void __launch_bounds__(kSampleThreads) sample_rows_kernel(SampleParams p) {
  __shared__ SampleShared sh;
  const int64_t r = blockIdx.x;
  const int64_t vocab = p.vocab_size;
  const float* logits = p.logits + r * p.logits_row_stride;
  const long long argmax = block_argmax(logits, vocab, sh);
  const float temperature = p.temperature[r];
  const int32_t top_k = p.top_k[r];
  const bool greedy = !(temperature >= kGreedyTemperature) || top_k == 1;
  if (argmax < 0 || greedy || isinf(logits[argmax])) {
    if (threadIdx.x == 0) {
      p.out_token_ids[r] = argmax;
      p.out_probs[r] = argmax < 0 ? 0.0f : 1.0f;
    }
    return;
  }
  uint32_t* keys = p.key_scratch + r * vocab;
  const float max_z = logits[argmax] / temperature;
  if (top_k > 0 && top_k <= kCompactCap && top_k < vocab) {
    sample_short_top_k(p, r, logits, keys, vocab, temperature, max_z, top_k, sh);
    return;
  }
  write_keys(logits, keys, vocab, temperature, max_z);
  __syncthreads();  // the block reads back what other threads wrote (global writes are visible after a barrier)

  Boundary kept{0u, LLONG_MAX};  // everything
  if (top_k > 0 && top_k < vocab) kept = select_boundary(keys, vocab, kept, false, top_k, sh);  // > kCompactCap
  const float top_p = p.top_p[r];
  if (top_p < 1.0f) {
    const unsigned long long total = kept_mass(keys, vocab, kept, sh);
    const double target = ceil((static_cast<double>(top_p) - kTopPSlack) * static_cast<double>(total));
    kept = select_boundary(keys, vocab, kept, true, target < 1.0 ? 1ull : static_cast<unsigned long long>(target), sh);
  }
  const float min_p = p.min_p[r];
  if (min_p > 0.0f) {
    const Boundary by_min_p{__float_as_uint(min_p), LLONG_MAX};  // every w >= min_p
    if (by_min_p.before(kept)) kept = by_min_p;
  }
  const unsigned long long total = kept_mass(keys, vocab, kept, sh);
  if (total == 0) {  // only with min_p > 1 (outside the settings' contract): fall back to the argmax
    if (threadIdx.x == 0) {
      p.out_token_ids[r] = argmax;
      p.out_probs[r] = 1.0f;
    }
    return;
  }
  const double scaled = static_cast<double>(p.uniform[r]) * static_cast<double>(total);
  const unsigned long long target = min(total, static_cast<unsigned long long>(scaled) + 1ull);
  const Boundary picked = select_boundary(keys, vocab, kept, true, target, sh);
  if (threadIdx.x == 0) {
    p.out_token_ids[r] = picked.index;
    p.out_probs[r] = static_cast<float>(static_cast<double>(mass_of_key(picked.key)) / static_cast<double>(total));
  }
}

constexpr int kPenaltyThreads = 512;

__device__ __forceinline__ float strength(int64_t distance, int64_t sustain, int64_t decay) {
  if (distance < sustain) return 1.0f;
  if (distance >= sustain + decay) return 0.0f;
  return 1.0f - static_cast<float>(distance - sustain) / static_cast<float>(decay > 1 ? decay : 1);
}

// One block per row: the row's (id, distance) pairs are bitonic-sorted in shared memory (`padded` = next
// power of two of the history length), then the first thread of each id's run applies its penalty. Runs are
// sorted by distance, so the run's first entry is the newest occurrence and strengths are summed in the same
// order as on the CPU.
__global__ void __launch_bounds__(kPenaltyThreads) apply_penalties_kernel(PenaltyParams p, int padded) {
  extern __shared__ unsigned long long entries[];  // (id << 32) | distance; invalid = all ones (sorts last)
  const int64_t r = blockIdx.x;
  const int64_t* history = p.history + r * p.history_row_stride;
  for (int i = threadIdx.x; i < padded; i += kPenaltyThreads) {
    unsigned long long entry = ~0ull;
    if (i < p.history_len) {
      const int64_t id = history[i];
      if (id >= 0 && id < p.vocab_size) {
        entry = (static_cast<unsigned long long>(id) << 32) | static_cast<unsigned long long>(p.history_len - 1 - i);
      }
    }
    entries[i] = entry;
  }
  __syncthreads();
  for (int size = 2; size <= padded; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < padded; i += kPenaltyThreads) {
        const int partner = i ^ stride;
        if (partner > i) {
          const bool ascending = (i & size) == 0;
          const unsigned long long a = entries[i], b = entries[partner];
          if ((a > b) == ascending) {
            entries[i] = b;
            entries[partner] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  float* logits = p.logits + r * p.logits_row_stride;
  const float rep = p.repetition[r], freq = p.frequency[r], pres = p.presence[r];
  const int64_t sustain = p.sustain[r], decay = p.decay[r];
  for (int i = threadIdx.x; i < padded; i += kPenaltyThreads) {
    const unsigned long long entry = entries[i];
    if (entry == ~0ull || (i > 0 && (entries[i - 1] >> 32) == (entry >> 32))) continue;
    const unsigned long long id = entry >> 32;
    const float newest = strength(static_cast<int64_t>(entry & 0xffffffffu), sustain, decay);
    float total = 0.0f;
    for (int j = i; j < padded && (entries[j] >> 32) == id && entries[j] != ~0ull; ++j) {
      total += strength(static_cast<int64_t>(entries[j] & 0xffffffffu), sustain, decay);
    }
    const float factor = 1.0f + (rep - 1.0f) * newest;
    float l = logits[id];
    l = l > 0.0f ? l / factor : l * factor;
    logits[id] = l - pres * newest - freq * total;
  }
}

__global__ void mask_tokens_kernel(MaskTokensParams p) {
  const int64_t r = blockIdx.x;
  const int64_t* ids = p.token_ids + r * p.token_ids_row_stride;
  float* logits = p.logits + r * p.logits_row_stride;
  for (int64_t j = threadIdx.x; j < p.num_ids; j += blockDim.x) {
    const int64_t id = ids[j];
    if (id >= 0 && id < p.vocab_size) logits[id] = -INFINITY;
  }
}

}  // namespace

cudaError_t sample_rows(const SampleParams& p, cudaStream_t stream) {
  if (p.num_rows == 0) return cudaSuccess;
  sample_rows_kernel<<<static_cast<unsigned>(p.num_rows), kSampleThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t apply_penalties(const PenaltyParams& p, cudaStream_t stream) {
  if (p.num_rows == 0 || p.history_len == 0) return cudaSuccess;
  if (p.history_len > kMaxPenaltyHistory) return cudaErrorInvalidValue;  // the binding refuses these first
  int padded = 1;
  while (padded < p.history_len) padded <<= 1;
  const size_t smem = static_cast<size_t>(padded) * sizeof(unsigned long long);
  if (smem > 48 * 1024) {
    // Not a stream operation, so it is allowed while a graph is being captured.
    const cudaError_t err = cudaFuncSetAttribute(apply_penalties_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  apply_penalties_kernel<<<static_cast<unsigned>(p.num_rows), kPenaltyThreads, smem, stream>>>(p, padded);
  return cudaGetLastError();
}

cudaError_t mask_tokens(const MaskTokensParams& p, cudaStream_t stream) {
  if (p.num_rows == 0 || p.num_ids == 0) return cudaSuccess;
  mask_tokens_kernel<<<static_cast<unsigned>(p.num_rows), 128, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace folio::cuda
