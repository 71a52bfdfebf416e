// peer_all_reduce: a one-shot all-reduce through the peers' memory.
//
// Each rank owns a region that every other rank has mapped (CUDA IPC): flag words [kPeerBlocks][kPeerMaxRanks],
// then two staging slots. A call, in each block b that has a part of the message:
//   1. copies its part of this rank's input into this rank's staging slot (its own memory);
//   2. signals every peer: a release store of the call's number into the peer's flag word [b][rank]; then waits
//      until its own flag words [b][peer] hold that number (acquire loads), so every peer's block b has copied;
//   3. sums its part over the ranks' slots, in rank order (every rank computes the same bits, as the residual
//      streams of the ranks must stay equal), and writes it over the input.
// A second kernel fuses the layer's residual add and RMSNorm into step 3 (peer_all_reduce_norm_kernel): one launch
// a sublayer instead of two under tensor parallelism, where decode's small kernels are a large part of a step. A
// third broadcasts rank 0's bytes (a decode graph's inputs) by the same protocol.
// A block reads only what the same block of each peer copied (the same partition on every rank: same grid, same
// size), so blocks never wait for each other.
//
// Why two slots: a rank may start call k+1 (step 1 writes its slot) while a peer still reads its slot of call k;
// call k+1 uses the other slot. The slot is picked by the block's own count of calls (no block waits for another to
// publish one), and every block counts every call (blocks past the message only count it), so the slot alternates
// with the calls. Could a peer still read the slot of call k-1? No: block 0 has work in every call, so this rank got
// past call k's step 2 there, so every peer had started call k, which runs after that peer's call k-1 finished (one
// stream). A block's vectors are the same in every call (grid stride over a fixed grid).
// tests/test_peer_all_reduce_protocol.py checks this on a model of the protocol under many interleavings.
//
// The numbers wrap at 2^32 and are compared by signed difference (a peer is at most one call ahead).
//
// A peer that never arrives (its process died) would hold this GPU for good: after kWaitTimeoutNs the kernel traps,
// which puts the context in an error state that the host's next synchronising call reports. Ranks run the same steps,
// so a healthy peer is behind by at most one step's host work.
#include "device_utils.cuh"
#include "peer_all_reduce.cuh"

namespace folio::cuda {
namespace {

constexpr int kThreads = 512;
constexpr uint64_t kWaitTimeoutNs = 60ull * 1000 * 1000 * 1000;
constexpr size_t kFlagBytes = 256 * ((kPeerBlocks * kPeerMaxRanks * sizeof(uint32_t) + 255) / 256);

__device__ __forceinline__ void store_release_system(uint32_t* address, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t load_acquire_system(const uint32_t* address) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

template <typename T>
__device__ __forceinline__ void add_into(float (&acc)[16 / sizeof(T)], const uint4& raw) {
  const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int j = 0; j < static_cast<int>(16 / sizeof(T)); ++j) acc[j] += to_float<T>(values[j]);
}

// This block's number for the call it starts (its own count + 1), the same in every thread.
__device__ __forceinline__ uint32_t block_call(const PeerAllReduceParams& p, uint32_t* call_shared) {
  if (threadIdx.x == 0) *call_shared = p.call_counts[blockIdx.x] + 1;
  __syncthreads();
  return *call_shared;
}

// Step 2, after this block's copy (the barriers order it before the signal, and every thread's reads after the wait).
__device__ __forceinline__ void signal_and_wait(const PeerAllReduceParams& p, uint32_t call) {
  __syncthreads();
  const int peer = threadIdx.x;
  const int block = blockIdx.x;
  if (peer < p.world_size && peer != p.rank) {
    uint32_t* peer_flags = reinterpret_cast<uint32_t*>(p.regions[peer]);
    const uint32_t* own_flags = reinterpret_cast<const uint32_t*>(p.regions[p.rank]);
    store_release_system(peer_flags + block * kPeerMaxRanks + p.rank, call);
    const uint64_t start = global_timer_ns();
    while (static_cast<int32_t>(load_acquire_system(own_flags + block * kPeerMaxRanks + peer) - call) < 0) {
      if (global_timer_ns() - start > kWaitTimeoutNs) __trap();
    }
  }
  __syncthreads();
}

// The sum over the ranks of vector i, in rank order, in fp32 (this rank's own from its input).
template <typename T>
__device__ __forceinline__ void sum_over_ranks(const PeerAllReduceParams& p, int64_t slot_offset, int64_t i,
                                               float (&acc)[16 / sizeof(T)]) {
#pragma unroll
  for (int j = 0; j < static_cast<int>(16 / sizeof(T)); ++j) acc[j] = 0.0f;
  for (int r = 0; r < p.world_size; ++r) {
    const uint4* slot = reinterpret_cast<const uint4*>(p.regions[r] + slot_offset);
    add_into<T>(acc, r == p.rank ? reinterpret_cast<const uint4*>(p.data)[i] : __ldcg(slot + i));
  }
}

// Where call `call`'s staging slot starts in a region (the two slots alternate with the calls).
__device__ __forceinline__ int64_t slot_start(const PeerAllReduceParams& p, uint32_t call) {
  return kFlagBytes + static_cast<int64_t>(call & 1u) * p.slot_bytes;
}

// The 16-byte vectors of a message that this thread takes (a grid stride over the fixed grid: the same ones in every
// call of the same size, on every rank), and where this call's slot starts in a region.
struct VectorShare {
  int64_t num_vectors, first, stride, slot_offset;
  bool block_has_work;
};

__device__ __forceinline__ VectorShare vector_share(const PeerAllReduceParams& p, uint32_t call) {
  VectorShare share;
  share.num_vectors = p.num_bytes / 16;
  share.first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  share.stride = static_cast<int64_t>(gridDim.x) * kThreads;
  share.slot_offset = slot_start(p, call);
  share.block_has_work = static_cast<int64_t>(blockIdx.x) * kThreads < share.num_vectors;
  return share;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) peer_all_reduce_kernel(PeerAllReduceParams p) {
  constexpr int kPerVector = 16 / sizeof(T);
  const int block = blockIdx.x;
  __shared__ uint32_t call_shared;
  const uint32_t call = block_call(p, &call_shared);
  const VectorShare v = vector_share(p, call);
  if (v.block_has_work) {
    uint4* data = reinterpret_cast<uint4*>(p.data);
    uint4* own_slot = reinterpret_cast<uint4*>(p.regions[p.rank] + v.slot_offset);
    for (int64_t i = v.first; i < v.num_vectors; i += v.stride) own_slot[i] = data[i];
    signal_and_wait(p, call);
    for (int64_t i = v.first; i < v.num_vectors; i += v.stride) {
      float acc[kPerVector];
      sum_over_ranks<T>(p, v.slot_offset, i, acc);
      uint4 out;
      T* values = reinterpret_cast<T*>(&out);
#pragma unroll
      for (int j = 0; j < kPerVector; ++j) values[j] = from_float<T>(acc[j]);
      data[i] = out;
    }
  }
  if (threadIdx.x == 0) p.call_counts[block] = call;
}

// A broadcast from rank 0 by the same protocol: rank 0 copies into its slot, the others read it (every rank still
// signals every other, so that the two slots' reasoning holds as for a sum). Bytes of any type.
__global__ void __launch_bounds__(kThreads) peer_broadcast_kernel(PeerAllReduceParams p) {
  const int block = blockIdx.x;
  __shared__ uint32_t call_shared;
  const uint32_t call = block_call(p, &call_shared);
  const VectorShare v = vector_share(p, call);
  if (v.block_has_work) {
    uint4* data = reinterpret_cast<uint4*>(p.data);
    uint4* root_slot = reinterpret_cast<uint4*>(p.regions[0] + v.slot_offset);
    if (p.rank == 0) {
      for (int64_t i = v.first; i < v.num_vectors; i += v.stride) root_slot[i] = data[i];
    }
    signal_and_wait(p, call);
    if (p.rank != 0) {
      for (int64_t i = v.first; i < v.num_vectors; i += v.stride) data[i] = __ldcg(root_slot + i);
    }
  }
  if (threadIdx.x == 0) p.call_counts[block] = call;
}

// The sum fused with the residual add and RMSNorm that follow it in a layer: block b takes whole rows (b, b + grid,
// ...), so that it can normalize them. Per element, the same roundings as the sum followed by rms_norm_kernel's
// fused form (the sum rounded to T, the residual's sum rounded to T and stored, the norm over the rounded values).
// Same protocol: block 0 has a row in every call, and every block counts every call.
template <typename T>
__global__ void __launch_bounds__(kThreads) peer_all_reduce_norm_kernel(PeerAllReduceParams p, PeerNormParams n) {
  constexpr int kPerVector = 16 / sizeof(T);
  const int block = blockIdx.x;
  __shared__ uint32_t call_shared;
  __shared__ float scratch[32];
  const uint32_t call = block_call(p, &call_shared);
  const int64_t row_vectors = n.hidden_size / kPerVector;
  if (block < n.num_rows) {
    const int64_t slot = slot_start(p, call);
    uint4* data = reinterpret_cast<uint4*>(p.data);
    uint4* own_slot = reinterpret_cast<uint4*>(p.regions[p.rank] + slot);
    uint4* residual = reinterpret_cast<uint4*>(n.residual);
    const uint4* weight = reinterpret_cast<const uint4*>(n.weight);
    for (int64_t row = block; row < n.num_rows; row += gridDim.x) {
      for (int64_t v = threadIdx.x; v < row_vectors; v += kThreads) {
        own_slot[row * row_vectors + v] = data[row * row_vectors + v];
      }
    }
    signal_and_wait(p, call);
    for (int64_t row = block; row < n.num_rows; row += gridDim.x) {
      float sum_squares = 0.0f;
      for (int64_t v = threadIdx.x; v < row_vectors; v += kThreads) {
        const int64_t i = row * row_vectors + v;
        float acc[kPerVector];
        sum_over_ranks<T>(p, slot, i, acc);
        uint4 raw = residual[i];
        T* values = reinterpret_cast<T*>(&raw);
#pragma unroll
        for (int j = 0; j < kPerVector; ++j) {
          const T sum = from_float<T>(acc[j]);
          values[j] = from_float<T>(to_float<T>(values[j]) + to_float<T>(sum));
          const float stored = to_float<T>(values[j]);
          sum_squares += stored * stored;
        }
        residual[i] = raw;
      }
      const float inv_rms = rsqrtf(block_sum(sum_squares, scratch) / static_cast<float>(n.hidden_size) + n.eps);
      // each thread reads back the residual vectors it stored above (same indices): no barrier needed
      for (int64_t v = threadIdx.x; v < row_vectors; v += kThreads) {
        const int64_t i = row * row_vectors + v;
        uint4 raw = residual[i];
        const uint4 w_raw = weight[v];
        T* values = reinterpret_cast<T*>(&raw);
        const T* w = reinterpret_cast<const T*>(&w_raw);
#pragma unroll
        for (int j = 0; j < kPerVector; ++j) {
          values[j] = from_float<T>(to_float<T>(values[j]) * inv_rms * to_float<T>(w[j]));
        }
        data[i] = raw;
      }
    }
  }
  if (threadIdx.x == 0) p.call_counts[block] = call;
}

}  // namespace

size_t peer_region_bytes(size_t slot_bytes) { return kFlagBytes + 2 * slot_bytes; }

cudaError_t peer_all_reduce(const PeerAllReduceParams& p, cudaStream_t stream) {
  dispatch_scalar(p.dtype, [&](auto tag) {
    peer_all_reduce_kernel<decltype(tag)><<<kPeerBlocks, kThreads, 0, stream>>>(p);
  });
  return cudaGetLastError();
}

cudaError_t peer_broadcast(const PeerAllReduceParams& p, cudaStream_t stream) {
  peer_broadcast_kernel<<<kPeerBlocks, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t peer_all_reduce_add_rms_norm(const PeerAllReduceParams& p, const PeerNormParams& n, cudaStream_t stream) {
  dispatch_scalar(p.dtype, [&](auto tag) {
    peer_all_reduce_norm_kernel<decltype(tag)><<<kPeerBlocks, kThreads, 0, stream>>>(p, n);
  });
  return cudaGetLastError();
}

cudaError_t peer_region_create(size_t slot_bytes, void** region, cudaIpcMemHandle_t* handle) {
  const size_t bytes = peer_region_bytes(slot_bytes);
  cudaError_t status = cudaMalloc(region, bytes);
  if (status != cudaSuccess) return status;
  // zero flags (and slots) before any peer can signal: cudaMemset is ordered before the handle is handed out
  status = cudaMemset(*region, 0, bytes);
  if (status == cudaSuccess) status = cudaDeviceSynchronize();
  if (status == cudaSuccess) status = cudaIpcGetMemHandle(handle, *region);
  if (status != cudaSuccess) {
    cudaFree(*region);
    *region = nullptr;
  }
  return status;
}

cudaError_t peer_region_open(const cudaIpcMemHandle_t& handle, void** region) {
  return cudaIpcOpenMemHandle(region, handle, cudaIpcMemLazyEnablePeerAccess);
}

}  // namespace folio::cuda
