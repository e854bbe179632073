// CUDA glue of the RWKV-7 raw-decay op: checks, allocation, stream; the kernels live in decay.cu.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ropewkv/decay_cuda.h"
#include "ropewkv/torch_glue.h"

namespace ropewkv {
namespace {

at::Tensor log_decay_cuda(const at::Tensor& x_in) {
  const DType dtype = dtype_tag(x_in, "x");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = new_output(x.sizes(), x.options().dtype(at::kFloat));
  C10_CUDA_CHECK(cuda::log_decay_forward(dtype, x.const_data_ptr(), out.data_ptr<float>(), x.numel(),
                                         c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor log_decay_backward_cuda(const at::Tensor& grad_in, const at::Tensor& x_in) {
  const DType dtype = dtype_tag(x_in, "x");
  TORCH_CHECK(grad_in.sizes() == x_in.sizes(), "grad has shape ", grad_in.sizes(), " but x has ", x_in.sizes());
  check_same_device(grad_in, x_in, "grad", "x");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor grad = grad_in.to(at::kFloat).contiguous();
  at::Tensor grad_x = new_output_like(x);
  C10_CUDA_CHECK(cuda::log_decay_backward(dtype, grad.const_data_ptr<float>(), x.const_data_ptr(),
                                          grad_x.data_ptr(), x.numel(), c10::cuda::getCurrentCUDAStream()));
  return grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(ropewkv, CUDA, m) {
  m.impl("log_decay", &log_decay_cuda);
  m.impl("log_decay_backward", &log_decay_backward_cuda);
}

}  // namespace ropewkv
