// The sum of one tensor over the GPUs of a tensor-parallel replica by loads from the peers' memory (CUDA IPC over
// NVLink or PCIe peer access): one kernel per call, for the small messages of decode, where NCCL's fixed cost per
// collective is most of the time. Host functions over raw pointers (no torch, no pybind11); see
// native/cuda/peer_all_reduce.cu for the protocol.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "../common/params.h"

namespace folio::cuda {

constexpr int kPeerMaxRanks = 8;
// Every call launches this many blocks (those past the message only count the call): each block keeps its own
// count of calls, which picks the staging slot (see the .cu).
constexpr int kPeerBlocks = 64;

// One rank's shared region: flag words, then two staging slots of slot_bytes each (calls alternate between them).
size_t peer_region_bytes(size_t slot_bytes);

struct PeerAllReduceParams {
  void* data;                           // this rank's input, summed in place: num_bytes, 16-byte aligned
  int64_t num_bytes;                    // a multiple of 16, <= slot_bytes
  ScalarType dtype;
  int rank;
  int world_size;                       // 2..kPeerMaxRanks
  char* regions[kPeerMaxRanks];         // every rank's region (peer_region_bytes), mapped into this process
  int64_t slot_bytes;
  uint32_t* call_counts;                // this rank's own [kPeerBlocks] counters, zero before the first call
};

// The fused form's other operands: data is [num_rows, hidden_size], and so is the residual.
struct PeerNormParams {
  void* residual;      // [num_rows, hidden_size] of the dtype, 16-byte aligned: residual += the sum (rounded)
  const void* weight;  // [hidden_size] of the dtype, 16-byte aligned
  int64_t num_rows;
  int64_t hidden_size;  // hidden_size * element size a multiple of 16
  float eps;
};

// Enqueues the sum on `stream`; every rank of the group must make the same calls, in the same order, with the same
// num_bytes. Capturable in a CUDA graph (the call counts live in device memory).
cudaError_t peer_all_reduce(const PeerAllReduceParams& p, cudaStream_t stream);
// The sum, then residual += sum and data = RMSNorm(residual) * weight, in one kernel (same calls rule; it counts as
// a call of the same sequence as peer_all_reduce's).
cudaError_t peer_all_reduce_add_rms_norm(const PeerAllReduceParams& p, const PeerNormParams& n, cudaStream_t stream);

// data (bytes of any type: dtype is not read) copied from rank 0 into every other rank's, counted as a call likewise.
cudaError_t peer_broadcast(const PeerAllReduceParams& p, cudaStream_t stream);

// This process's region on the current device: allocated, zeroed (synchronously: setup only), and its IPC handle.
cudaError_t peer_region_create(size_t slot_bytes, void** region, cudaIpcMemHandle_t* handle);
// A peer's region, mapped into this process (peer access enabled as needed).
cudaError_t peer_region_open(const cudaIpcMemHandle_t& handle, void** region);

}  // namespace folio::cuda
