// peer_all_reduce: a one-shot all-reduce through the peers' memory.
//
// Each rank owns a region that every other rank has mapped (CUDA IPC): flag words [kPeerBlocks][kPeerMaxRanks],
// then two staging slots. A call, in each block b that has a part of the message:
//   1. copies its part of this rank's input into this rank's staging slot (its own memory);
//   2. signals every peer: a release store of the call's number into the peer's flag word [b][rank]; then waits
//      until its own flag words [b][peer] hold that number (acquire loads), so every peer's block b has copied;
//   3. sums its part over the ranks' slots, in rank order (every rank computes the same bits, as the residual
//      streams of the ranks must stay equal), and writes it over the input.
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

template <typename T>
__global__ void __launch_bounds__(kThreads) peer_all_reduce_kernel(PeerAllReduceParams p) {
  constexpr int kPerVector = 16 / sizeof(T);
  const int block = blockIdx.x;
  __shared__ uint32_t call_shared;
  if (threadIdx.x == 0) call_shared = p.call_counts[block] + 1;
  __syncthreads();
  const uint32_t call = call_shared;
  const int64_t num_vectors = p.num_bytes / 16;
  if (static_cast<int64_t>(block) * kThreads < num_vectors) {
    const int64_t slot_offset = kFlagBytes + static_cast<int64_t>(call & 1u) * p.slot_bytes;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
    const int64_t first = static_cast<int64_t>(block) * kThreads + threadIdx.x;
    uint4* data = reinterpret_cast<uint4*>(p.data);
    uint4* own_slot = reinterpret_cast<uint4*>(p.regions[p.rank] + slot_offset);
    for (int64_t i = first; i < num_vectors; i += stride) own_slot[i] = data[i];
    __syncthreads();
    const int peer = threadIdx.x;
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
    for (int64_t i = first; i < num_vectors; i += stride) {
      float acc[kPerVector] = {};
      for (int r = 0; r < p.world_size; ++r) {
        const uint4* slot = reinterpret_cast<const uint4*>(p.regions[r] + slot_offset);
        add_into<T>(acc, r == p.rank ? data[i] : __ldcg(slot + i));
      }
      uint4 out;
      T* values = reinterpret_cast<T*>(&out);
#pragma unroll
      for (int j = 0; j < kPerVector; ++j) values[j] = from_float<T>(acc[j]);
      data[i] = out;
    }
  }
  if (threadIdx.x == 0) p.call_counts[block] = call;
}

}  // namespace

size_t peer_region_bytes(size_t slot_bytes) { return kFlagBytes + 2 * slot_bytes; }

cudaError_t peer_all_reduce(const PeerAllReduceParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case ScalarType::kFloat32:
      peer_all_reduce_kernel<float><<<kPeerBlocks, kThreads, 0, stream>>>(p);
      break;
    case ScalarType::kFloat16:
      peer_all_reduce_kernel<__half><<<kPeerBlocks, kThreads, 0, stream>>>(p);
      break;
    case ScalarType::kBFloat16:
      peer_all_reduce_kernel<__nv_bfloat16><<<kPeerBlocks, kThreads, 0, stream>>>(p);
      break;
    default:
      return cudaErrorInvalidValue;
  }
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
