// CUDA glue of RoPE: checks, allocation, device guard and stream; the kernels live in rope_{fp32,fp16,bf16}.cu.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ropewkv/rope_cuda.h"
#include "rope_glue.h"

namespace ropewkv::rope {
namespace {

void launch_cuda(const Params& p, at::ScalarType dtype, Precision precision) {
  C10_CUDA_CHECK(cuda::rope_forward(dtype_tag(dtype, "q"), p, precision, c10::cuda::getCurrentCUDAStream()));
}

std::vector<at::Tensor> rope_cuda(const at::Tensor& q, const std::optional<at::Tensor>& k,
                                  const at::Tensor& inv_freq, const std::optional<at::Tensor>& positions,
                                  const std::optional<at::Tensor>& offsets,
                                  const std::optional<at::Tensor>& cu_seqlens, bool interleaved, bool conjugate,
                                  double attention_scaling, int64_t precision, at::OptionalIntArrayRef mrope_section,
                                  bool mrope_interleaved) {
  const c10::cuda::CUDAGuard guard(q.device());
  return rope_functional(launch_cuda, false, q, k, inv_freq, positions, offsets, cu_seqlens, interleaved, conjugate,
                         attention_scaling, precision, mrope_section, mrope_interleaved);
}

void rope_inplace_cuda(const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& inv_freq,
                       const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& offsets,
                       const std::optional<at::Tensor>& cu_seqlens, bool interleaved, bool conjugate,
                       double attention_scaling, int64_t precision, at::OptionalIntArrayRef mrope_section,
                       bool mrope_interleaved) {
  const c10::cuda::CUDAGuard guard(q.device());
  rope_inplace(launch_cuda, false, q, k, inv_freq, positions, offsets, cu_seqlens, interleaved, conjugate,
               attention_scaling, precision, mrope_section, mrope_interleaved);
}

std::vector<at::Tensor> rope_cos_sin_cuda(const at::Tensor& q, const std::optional<at::Tensor>& k,
                                          const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                                          bool conjugate, int64_t precision) {
  const c10::cuda::CUDAGuard guard(q.device());
  return rope_cos_sin_functional(launch_cuda, false, q, k, cos, sin, interleaved, conjugate, precision);
}

}  // namespace
}  // namespace ropewkv::rope

TORCH_LIBRARY_IMPL(ropewkv, CUDA, m) {
  m.impl("rope", &ropewkv::rope::rope_cuda);
  m.impl("rope_", &ropewkv::rope::rope_inplace_cuda);
  m.impl("rope_cos_sin", &ropewkv::rope::rope_cos_sin_cuda);
}
