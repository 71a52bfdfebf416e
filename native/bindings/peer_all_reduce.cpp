// folio._native_cuda.PeerAllReduce: one rank's side of the peer all-reduce (native/cuda/peer_all_reduce.cu). The
// ranks exchange handles between construction and `connect` (folio.model.peer_all_reduce does it over the process
// group); after that, `all_reduce` enqueues the sum on the current stream, capturable in a CUDA graph.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstring>
#include <string>
#include <vector>

#include "../cuda/peer_all_reduce.cuh"
#include "tensor_checks.h"

namespace folio::bind {
namespace {

namespace py = pybind11;

class PeerAllReduce {
 public:
  PeerAllReduce(int64_t device_index, int64_t slot_bytes) : device_(device_index) {
    FOLIO_CHECK_VALUE(slot_bytes >= 16 && slot_bytes % 16 == 0,
                      "argument 'slot_bytes' must be a positive multiple of 16, got ", slot_bytes);
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    slot_bytes_ = slot_bytes;
    void* region = nullptr;
    C10_CUDA_CHECK(cuda::peer_region_create(static_cast<size_t>(slot_bytes), &region, &handle_));
    own_region_ = static_cast<char*>(region);
    void* counts = nullptr;
    C10_CUDA_CHECK(cudaMalloc(&counts, cuda::kPeerBlocks * sizeof(uint32_t)));
    call_counts_ = static_cast<uint32_t*>(counts);
    C10_CUDA_CHECK(cudaMemset(call_counts_, 0, cuda::kPeerBlocks * sizeof(uint32_t)));
    C10_CUDA_CHECK(cudaDeviceSynchronize());
  }

  ~PeerAllReduce() {
    // Errors are ignored: at interpreter exit the context may be gone already.
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    for (char* region : opened_) cudaIpcCloseMemHandle(region);
    cudaFree(call_counts_);
    cudaFree(own_region_);
  }

  PeerAllReduce(const PeerAllReduce&) = delete;
  PeerAllReduce& operator=(const PeerAllReduce&) = delete;

  py::bytes handle() const { return py::bytes(reinterpret_cast<const char*>(&handle_), sizeof(handle_)); }

  // handles[r]: rank r's `handle()` (this rank's own is ignored).
  void connect(int64_t rank, const std::vector<std::string>& handles) {
    const auto world_size = static_cast<int64_t>(handles.size());
    FOLIO_CHECK_VALUE(opened_.empty() && world_size_ == 0, "PeerAllReduce.connect: connected already");
    FOLIO_CHECK_VALUE(world_size >= 2 && world_size <= cuda::kPeerMaxRanks, "PeerAllReduce.connect: 2 to ",
                      cuda::kPeerMaxRanks, " ranks, got ", world_size);
    FOLIO_CHECK_VALUE(rank >= 0 && rank < world_size, "PeerAllReduce.connect: rank ", rank, " outside [0, ",
                      world_size, ")");
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    for (int64_t r = 0; r < world_size; ++r) {
      if (r == rank) {
        regions_[r] = own_region_;
        continue;
      }
      FOLIO_CHECK_VALUE(handles[r].size() == sizeof(cudaIpcMemHandle_t), "PeerAllReduce.connect: handle of rank ",
                        r, " has ", handles[r].size(), " bytes, expected ", sizeof(cudaIpcMemHandle_t));
      cudaIpcMemHandle_t peer_handle;
      std::memcpy(&peer_handle, handles[r].data(), sizeof(peer_handle));
      void* region = nullptr;
      C10_CUDA_CHECK(cuda::peer_region_open(peer_handle, &region));
      regions_[r] = static_cast<char*>(region);
      opened_.push_back(regions_[r]);
    }
    rank_ = static_cast<int>(rank);
    world_size_ = static_cast<int>(world_size);
  }

  // x summed over the ranks, in place. Every rank makes the same calls with tensors of the same size.
  void all_reduce(const at::Tensor& x) {
    const cuda::PeerAllReduceParams p = params(x);
    const c10::cuda::CUDAGuard guard(x.device());
    C10_CUDA_CHECK(cuda::peer_all_reduce(p, c10::cuda::getCurrentCUDAStream(x.get_device()).stream()));
  }

  // rank 0's x into every rank's x, in place (any dtype). Every rank makes the same calls with the same sizes.
  void broadcast(const at::Tensor& x) {
    const cuda::PeerAllReduceParams p = params(x, /*summed=*/false);
    const c10::cuda::CUDAGuard guard(x.device());
    C10_CUDA_CHECK(cuda::peer_broadcast(p, c10::cuda::getCurrentCUDAStream(x.get_device()).stream()));
  }

  // x ([rows, hidden], a partial sum) summed over the ranks, then residual += x and x = RMSNorm(residual) * weight.
  void all_reduce_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                               double eps) {
    const cuda::PeerAllReduceParams p = params(x);
    FOLIO_CHECK_VALUE(x.dim() == 2, "argument 'x' must be [rows, hidden], got ", x.sizes());
    check_contiguous(residual, "residual");
    check_contiguous(weight, "weight");
    FOLIO_CHECK_VALUE(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                          residual.device() == x.device(),
                      "argument 'residual' must match x (", x.sizes(), ", ", x.scalar_type(), "), got ",
                      residual.sizes(), ", ", residual.scalar_type(), " on ", residual.device());
    FOLIO_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type() &&
                          weight.device() == x.device(),
                      "argument 'weight' must be [", x.size(1), "] of ", x.scalar_type(), " on x's device, got ",
                      weight.sizes(), ", ", weight.scalar_type(), " on ", weight.device());
    FOLIO_CHECK_VALUE(reinterpret_cast<uintptr_t>(residual.data_ptr()) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0 &&
                          (x.size(1) * static_cast<int64_t>(x.element_size())) % 16 == 0,
                      "arguments 'residual' and 'weight' must be 16-byte aligned, rows whole 16-byte vectors");
    cuda::PeerNormParams n{};
    n.residual = residual.data_ptr();
    n.weight = weight.data_ptr();
    n.num_rows = x.size(0);
    n.hidden_size = x.size(1);
    n.eps = static_cast<float>(eps);
    const c10::cuda::CUDAGuard guard(x.device());
    C10_CUDA_CHECK(
        cuda::peer_all_reduce_add_rms_norm(p, n, c10::cuda::getCurrentCUDAStream(x.get_device()).stream()));
  }

  int64_t slot_bytes() const { return slot_bytes_; }

 private:
  // summed: x's dtype is read (a float type); a broadcast copies bytes of any type.
  cuda::PeerAllReduceParams params(const at::Tensor& x, bool summed = true) const {
    FOLIO_CHECK_VALUE(world_size_ > 0, "PeerAllReduce: connect first");
    check_device_type(x, "x", c10::DeviceType::CUDA);
    FOLIO_CHECK_VALUE(x.get_device() == device_, "argument 'x' is on ", x.device(), ", this PeerAllReduce on cuda:",
                      device_);
    check_contiguous(x, "x");
    const int64_t num_bytes = x.numel() * static_cast<int64_t>(x.element_size());
    FOLIO_CHECK_VALUE(num_bytes % 16 == 0 && num_bytes <= slot_bytes_ && x.data_ptr() != nullptr &&
                          reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
                      "argument 'x' must be 16-byte aligned with a size a multiple of 16 bytes and at most ",
                      slot_bytes_, ", got ", num_bytes, " bytes (folio.model.peer_all_reduce.fits says which qualify)");
    cuda::PeerAllReduceParams p{};
    p.data = x.data_ptr();
    p.num_bytes = num_bytes;
    if (summed) p.dtype = float_type(x, "x");
    p.rank = rank_;
    p.world_size = world_size_;
    for (int r = 0; r < world_size_; ++r) p.regions[r] = regions_[r];
    p.slot_bytes = slot_bytes_;
    p.call_counts = call_counts_;
    return p;
  }

  int64_t device_;
  int64_t slot_bytes_ = 0;
  cudaIpcMemHandle_t handle_{};
  char* own_region_ = nullptr;
  uint32_t* call_counts_ = nullptr;
  char* regions_[cuda::kPeerMaxRanks] = {};
  std::vector<char*> opened_;
  int rank_ = 0;
  int world_size_ = 0;
};

}  // namespace

void define_peer_all_reduce(py::module_& m) {
  py::class_<PeerAllReduce> peer_class(m, "PeerAllReduce",
                            "One rank's side of the all-reduce through the peers' memory (CUDA IPC): "
                            "PeerAllReduce(device_index, slot_bytes); exchange handle() with the other ranks; "
                            "connect(rank, handles); then all_reduce(x) sums x in place on the current stream; "
                            "all_reduce_add_rms_norm(x, residual, weight, eps) also adds the sum into the residual "
                            "and writes RMSNorm(residual) * weight over x; broadcast(x) copies rank 0's x into every "
                            "rank's.");
  peer_class.def(py::init<int64_t, int64_t>(), py::arg("device_index"), py::arg("slot_bytes"))
      .def("handle", &PeerAllReduce::handle)
      .def("connect", &PeerAllReduce::connect, py::arg("rank"), py::arg("handles"))
      .def("all_reduce", &PeerAllReduce::all_reduce, py::arg("x"))
      .def("broadcast", &PeerAllReduce::broadcast, py::arg("x"))
      .def("all_reduce_add_rms_norm", &PeerAllReduce::all_reduce_add_rms_norm, py::arg("x"), py::arg("residual"),
           py::arg("weight"), py::arg("eps"))
      .def_property_readonly("slot_bytes", &PeerAllReduce::slot_bytes);
  peer_class.attr("max_ranks") = cuda::kPeerMaxRanks;
}

}  // namespace folio::bind
