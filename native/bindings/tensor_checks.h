// Argument checks shared by the CPU and CUDA bindings. Every message names the argument and says what was
// expected and what came in, so a caller can fix the call without reading this code.
#pragma once

#include <torch/extension.h>

#include <cstdio>
#include <string>
#include <type_traits>

#include "../common/params.h"

namespace folio::bind {

// Error messages are assembled from strings only and handed to torch's checks as one C string. Streaming a
// number through c10::str (iostream locale facets) crashed on the GPU image, where the extension's compiler and
// torch carry different libstdc++ builds; std::to_string and snprintf touch no locale.
inline std::string to_str(const char* s) { return s; }
inline std::string to_str(const std::string& s) { return s; }
inline std::string to_str(at::ScalarType t) { return c10::toString(t); }
inline std::string to_str(const c10::Device& d) { return d.str(); }
inline std::string to_str(double v) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%g", v);
  return buffer;
}
template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
inline std::string to_str(T v) { return std::to_string(static_cast<long long>(v)); }
inline std::string to_str(at::IntArrayRef values) {
  std::string s = "[";
  for (size_t i = 0; i < values.size(); ++i) s += (i ? ", " : "") + std::to_string(static_cast<long long>(values[i]));
  return s + "]";
}

template <typename... Args>
std::string message(Args... args) {
  std::string s;
  (s.append(to_str(args)), ...);
  return s;
}

}  // namespace folio::bind

// TORCH_CHECK_VALUE / TORCH_CHECK_TYPE (Python ValueError / TypeError) with a message from folio::bind::message.
#define FOLIO_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::folio::bind::message(__VA_ARGS__).c_str())
#define FOLIO_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, ::folio::bind::message(__VA_ARGS__).c_str())

namespace folio::bind {

inline std::string shape_str(const at::Tensor& t) { return to_str(t.sizes()); }

// dtype of a floating-point activation / cache tensor (float32, float16 or bfloat16).
inline ScalarType float_type(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return ScalarType::kFloat32;
    case at::kHalf: return ScalarType::kFloat16;
    case at::kBFloat16: return ScalarType::kBFloat16;
    default:
      FOLIO_CHECK_TYPE(false, "argument '", name, "' must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

inline void check_dtype(const at::Tensor& t, const char* name, at::ScalarType expected) {
  FOLIO_CHECK_TYPE(t.scalar_type() == expected, "argument '", name, "' must be ", expected, ", got ",
                   t.scalar_type());
}

inline void check_same_dtype(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name) {
  FOLIO_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), "argument '", name, "' must have the dtype of '", ref_name,
                   "' (", ref.scalar_type(), "), got ", t.scalar_type());
}

inline void check_dim(const at::Tensor& t, const char* name, int64_t ndim, const char* layout) {
  FOLIO_CHECK_VALUE(t.dim() == ndim, "argument '", name, "' must be ", layout, " (", ndim, " dims), got shape ",
                    shape_str(t));
}

inline void check_size(const at::Tensor& t, const char* name, int64_t dim, int64_t expected, const char* what) {
  FOLIO_CHECK_VALUE(t.size(dim) == expected, "argument '", name, "' has shape ", shape_str(t), ": dim ", dim,
                    " must be ", what, " = ", expected);
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  FOLIO_CHECK_VALUE(t.is_contiguous(), "argument '", name, "' must be contiguous (shape ", shape_str(t),
                    ", strides ", t.strides(), ")");
}

// The innermost dimension must be dense; outer strides are passed on to the kernels (views of a fused QKV
// projection, for example, have a token stride larger than their row width).
inline void check_inner_contiguous(const at::Tensor& t, const char* name) {
  FOLIO_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, "argument '", name,
                    "' must have a contiguous last dimension (strides ", t.strides(), ")");
}

inline void check_device(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name) {
  FOLIO_CHECK_VALUE(t.device() == ref.device(), "argument '", name, "' is on ", t.device(), " but '", ref_name,
                    "' is on ", ref.device());
}

inline void check_device_type(const at::Tensor& t, const char* name, c10::DeviceType type) {
  FOLIO_CHECK_VALUE(t.device().type() == type, "argument '", name, "' must be a ", c10::DeviceTypeName(type, true),
                    " tensor, got one on ", t.device());
}

}  // namespace folio::bind
