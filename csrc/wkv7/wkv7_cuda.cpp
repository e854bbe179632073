// CUDA glue of the WKV7 ops: checks, allocation, head-size dispatch, stream; the kernels live in wkv7_n*.cu.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <type_traits>

#include "ropewkv/wkv7_cuda.h"
#include "wkv7_glue.h"

namespace ropewkv {
namespace {

// Calls f(std::integral_constant<int, N>{}) for the supported head sizes.
template <typename F>
cudaError_t by_head_size(int64_t n, F&& f) {
  switch (n) {
    case 32:
      return f(std::integral_constant<int, 32>{});
    case 64:
      return f(std::integral_constant<int, 64>{});
    case 128:
      return f(std::integral_constant<int, 128>{});
    default:  // 256 runs on the triton and cpu twins (ops/rwkv7/api.py routes it there)
      TORCH_CHECK_VALUE(false, "head size ", n, " is not supported by the CUDA twin (32, 64, 128)");
  }
}

template <typename T>
const T* optional_ptr(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

cuda::Wkv7Sizes sizes_of(const wkv7::Inputs& in, int64_t decay) {
  (void)wkv7::decay_from(decay);
  return {in.batch, in.seqlen, in.heads, in.n_seqs, in.chunks, int(decay), optional_ptr<int64_t>(in.cu_seqlens)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> wkv7_forward_cuda(
    const at::Tensor& r, const at::Tensor& w, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
    const at::Tensor& b, const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens,
    int64_t decay, int64_t precision, bool save_checkpoints) {
  const c10::cuda::CUDAGuard guard(r.device());
  const wkv7::Inputs in = wkv7::check_inputs(r, w, k, v, a, b, initial_state, cu_seqlens, /*allow_fp64=*/false);
  const DType dtype = dtype_tag(in.r, "r");
  at::Tensor y = new_output_like(in.r);
  at::Tensor final_state = wkv7::new_state(in, in.n_seqs);
  at::Tensor ckpt = wkv7::new_checkpoints(in, save_checkpoints);
  const cuda::Wkv7ForwardParams params{sizes_of(in, decay),
                                       in.r.const_data_ptr(),
                                       in.w.const_data_ptr(),
                                       in.k.const_data_ptr(),
                                       in.v.const_data_ptr(),
                                       in.a.const_data_ptr(),
                                       in.b.const_data_ptr(),
                                       optional_ptr<float>(in.initial_state),
                                       y.data_ptr(),
                                       final_state.data_ptr<float>(),
                                       save_checkpoints ? ckpt.data_ptr<float>() : nullptr};
  C10_CUDA_CHECK(by_head_size(in.head_size, [&](auto n) {
    return cuda::wkv7_forward<decltype(n)::value>(dtype, precision_from(precision), params,
                                                  c10::cuda::getCurrentCUDAStream());
  }));
  return {y, final_state, ckpt};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> wkv7_backward_cuda(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_final_state, const at::Tensor& r,
    const at::Tensor& w, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a, const at::Tensor& b,
    const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& checkpoints, int64_t decay, int64_t precision) {
  const c10::cuda::CUDAGuard guard(r.device());
  const wkv7::Inputs in = wkv7::check_inputs(r, w, k, v, a, b, initial_state, cu_seqlens, /*allow_fp64=*/false);
  const DType dtype = dtype_tag(in.r, "r");
  wkv7::check_checkpoints(checkpoints, in);
  check_same_device(checkpoints, r, "checkpoints", "r");
  TORCH_CHECK_VALUE(grad_y.sizes() == r.sizes(), "grad_y has shape ", grad_y.sizes(), " but r has ", r.sizes());
  check_same_device(grad_y, r, "grad_y", "r");
  const at::Tensor gy = grad_y.to(r.scalar_type()).contiguous();
  const at::Tensor gs = wkv7::check_grad_state(grad_final_state, in);
  const at::Tensor ckpt = checkpoints.contiguous();
  at::Tensor scratch =
      at::empty({cuda::wkv7_backward_scratch_elems(in.n_seqs, in.heads, in.head_size)}, ckpt.options());
  std::array<at::Tensor, 6> grads;
  for (auto& g : grads) g = new_output_like(in.r);
  at::Tensor grad_s0 = wkv7::new_state(in, in.n_seqs);
  const cuda::Wkv7BackwardParams params{sizes_of(in, decay),
                                        in.r.const_data_ptr(),
                                        in.w.const_data_ptr(),
                                        in.k.const_data_ptr(),
                                        in.v.const_data_ptr(),
                                        in.a.const_data_ptr(),
                                        in.b.const_data_ptr(),
                                        optional_ptr<float>(in.initial_state),
                                        gy.const_data_ptr(),
                                        optional_ptr<float>(gs),
                                        ckpt.const_data_ptr<float>(),
                                        scratch.data_ptr<float>(),
                                        grads[0].data_ptr(),
                                        grads[1].data_ptr(),
                                        grads[2].data_ptr(),
                                        grads[3].data_ptr(),
                                        grads[4].data_ptr(),
                                        grads[5].data_ptr(),
                                        grad_s0.data_ptr<float>()};
  C10_CUDA_CHECK(by_head_size(in.head_size, [&](auto n) {
    return cuda::wkv7_backward<decltype(n)::value>(dtype, precision_from(precision), params,
                                                   c10::cuda::getCurrentCUDAStream());
  }));
  return {grads[0], grads[1], grads[2], grads[3], grads[4], grads[5], grad_s0};
}

at::Tensor wkv7_step_cuda(const at::Tensor& r, const at::Tensor& w, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& a, const at::Tensor& b, at::Tensor& state, int64_t decay,
                          int64_t precision) {
  const c10::cuda::CUDAGuard guard(r.device());
  const at::Tensor xs[] = {r, w, k, v, a, b};
  const wkv7::Inputs in = wkv7::check_step_inputs(xs, state, /*allow_fp64=*/false);
  const DType dtype = dtype_tag(r, "r");
  (void)wkv7::decay_from(decay);
  at::Tensor y = new_output_like(in.r);
  const cuda::Wkv7StepParams params{in.batch,
                                    in.heads,
                                    int(decay),
                                    in.r.const_data_ptr(),
                                    in.w.const_data_ptr(),
                                    in.k.const_data_ptr(),
                                    in.v.const_data_ptr(),
                                    in.a.const_data_ptr(),
                                    in.b.const_data_ptr(),
                                    state.data_ptr<float>(),
                                    y.data_ptr()};
  C10_CUDA_CHECK(by_head_size(in.head_size, [&](auto size) {
    return cuda::wkv7_step<decltype(size)::value>(dtype, precision_from(precision), params,
                                                  c10::cuda::getCurrentCUDAStream());
  }));
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(ropewkv, CUDA, m) {
  m.impl("wkv7_forward", &wkv7_forward_cuda);
  m.impl("wkv7_backward", &wkv7_backward_cuda);
  m.impl("wkv7_step", &wkv7_step_cuda);
}

}  // namespace ropewkv
