// CUDA glue of the fused QK-RMSNorm + RoPE: checks, allocation, device guard and stream; the kernels live in
// qk_norm_rope_{fp32,fp16,bf16}.cu.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "qk_norm_rope_glue.h"
#include "ropewkv/qk_norm_rope_cuda.h"

namespace ropewkv::qk_norm_rope {
namespace {

void check_head_dim(const Params& p) {
  TORCH_CHECK_VALUE(p.rope.head_dim <= cuda::kQkMaxHeadDim, "qk_norm_rope on CUDA takes head_dim <= ",
                    cuda::kQkMaxHeadDim, ", got ", p.rope.head_dim, " (backend='auto' uses Triton there)");
}

void launch_forward(const Params& p, at::ScalarType dtype, Precision precision) {
  check_head_dim(p);
  C10_CUDA_CHECK(cuda::qk_norm_rope_forward(dtype_tag(dtype, "q"), p, precision, c10::cuda::getCurrentCUDAStream()));
}

void launch_backward(const Params& p, at::ScalarType dtype) {
  check_head_dim(p);
  C10_CUDA_CHECK(cuda::qk_norm_rope_backward(dtype_tag(dtype, "q"), p, c10::cuda::getCurrentCUDAStream()));
}

at::Tensor reduce_chunks(const at::Tensor& partial) { return partial.sum(0); }  // deterministic: no atomics

std::vector<at::Tensor> forward_cuda(const at::Tensor& q, const OptTensor& k, ROPEWKV_QK_SOURCE_PARAMS) {
  const c10::cuda::CUDAGuard guard(q.device());
  return forward(launch_forward, false, q, k, ROPEWKV_QK_SOURCE_VALUES, precision);
}

void forward_inplace_cuda(const at::Tensor& q, const OptTensor& k, ROPEWKV_QK_SOURCE_PARAMS) {
  const c10::cuda::CUDAGuard guard(q.device());
  forward_inplace(launch_forward, false, q, k, ROPEWKV_QK_SOURCE_VALUES, precision);
}

std::vector<at::Tensor> backward_cuda(const at::Tensor& grad_q, const OptTensor& grad_k, const at::Tensor& q,
                                      const OptTensor& k, ROPEWKV_QK_SOURCE_PARAMS) {
  const c10::cuda::CUDAGuard guard(q.device());
  return backward(launch_backward, reduce_chunks, false, grad_q, grad_k, q, k, ROPEWKV_QK_SOURCE_VALUES, precision);
}

}  // namespace
}  // namespace ropewkv::qk_norm_rope

TORCH_LIBRARY_IMPL(ropewkv, CUDA, m) {
  m.impl("qk_norm_rope", &ropewkv::qk_norm_rope::forward_cuda);
  m.impl("qk_norm_rope_", &ropewkv::qk_norm_rope::forward_inplace_cuda);
  m.impl("qk_norm_rope_backward", &ropewkv::qk_norm_rope::backward_cuda);
}
