#pragma once
// Helpers for the torch-facing .cpp glue only (never included by a .cu): dtype mapping, argument checks, outputs.
#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "ropewkv/precision.h"

namespace ropewkv {

// c10 scalar type -> our bit-compatible storage type.
template <typename T>
struct storage_of {
  using type = T;
};
template <>
struct storage_of<c10::BFloat16> {
  using type = bf16_t;
};
template <>
struct storage_of<c10::Half> {
  using type = fp16_t;
};
template <typename T>
using storage_t = typename storage_of<T>::type;

template <typename T>
inline storage_t<T>* storage_ptr(const at::Tensor& t) {
  return reinterpret_cast<storage_t<T>*>(t.data_ptr<T>());
}

inline DType dtype_tag(at::ScalarType type, const char* name) {
  switch (type) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, name, " must be float32, float16 or bfloat16, got ", type);
  }
}

inline DType dtype_tag(const at::Tensor& t, const char* name) { return dtype_tag(t.scalar_type(), name); }

// The dtype a twin computes in: fp64 for fp64 I/O (CPU twin, gradcheck), else fp32 (compute_t's torch name).
inline at::ScalarType compute_dtype(at::ScalarType io) { return io == at::kDouble ? at::kDouble : at::kFloat; }

inline Precision precision_from(int64_t p) {
  TORCH_CHECK_VALUE(p == 0 || p == 1, "precision must be 0 (fp32) or 1 (bf16), got ", p);
  return static_cast<Precision>(p);
}

// The CPU twin also takes fp64 (for gradcheck); the CUDA and Triton twins do not.
inline void check_io_dtype(const at::Tensor& t, const char* name, bool allow_fp64) {
  if (allow_fp64 && t.scalar_type() == at::kDouble) return;
  (void)dtype_tag(t, name);
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), name, " is on ", t.device(), " but ", ref_name, " is on ", ref.device());
}

// Tests set ROPEWKV_POISON_OUTPUTS=1 so that an element a kernel forgot to write shows up as NaN.
inline bool poison_outputs() {
  const char* v = std::getenv("ROPEWKV_POISON_OUTPUTS");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

inline at::Tensor poisoned(at::Tensor out) {
  if (poison_outputs() && at::isFloatingType(out.scalar_type())) out.fill_(std::numeric_limits<float>::quiet_NaN());
  return out;
}

inline at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return poisoned(at::empty(sizes, options));
}

// An output like t, with t's strides when t is dense (so transposed layouts stay views).
inline at::Tensor new_output_like(const at::Tensor& t) { return poisoned(at::empty_like(t)); }

}  // namespace ropewkv

// Dtype dispatch over the three I/O types, exposing `io_t` (our storage type) and `scalar_t` (c10's) to the body.
#define ROPEWKV_DISPATCH_IO(TYPE, NAME, ...)                                              \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, [&] {            \
    using io_t = ::ropewkv::storage_t<scalar_t>;                                          \
    return __VA_ARGS__();                                                                 \
  })

// Precision dispatch: exposes `constexpr Precision kPrecision` to the body.
#define ROPEWKV_DISPATCH_PRECISION(PRECISION, ...)                                       \
  [&] {                                                                                   \
    if ((PRECISION) == ::ropewkv::Precision::kBF16) {                                     \
      constexpr ::ropewkv::Precision kPrecision = ::ropewkv::Precision::kBF16;            \
      return __VA_ARGS__();                                                               \
    }                                                                                     \
    constexpr ::ropewkv::Precision kPrecision = ::ropewkv::Precision::kFP32;              \
    return __VA_ARGS__();                                                                 \
  }()
