// CPU twin and schemas of the RWKV-7 raw-decay op: log d = -e^{-0.5} * sigmoid(x), in fp32 (fp64 for fp64 input).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ropewkv/decay.h"
#include "ropewkv/torch_glue.h"

namespace ropewkv {
namespace {

constexpr int64_t kGrain = 1 << 14;

at::Tensor log_decay_cpu(const at::Tensor& x_in) {
  check_io_dtype(x_in, "x", /*allow_fp64=*/true);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = new_output(x.sizes(), x.options().dtype(compute_dtype(x.scalar_type())));
  ROPEWKV_DISPATCH_IO(x.scalar_type(), "log_decay_cpu", [&] {
    using out_t = compute_t<io_t>;
    const io_t* src = storage_ptr<scalar_t>(x);
    out_t* dst = out.data_ptr<out_t>();
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
      _Pragma("omp simd")  // branch-free math (decay.h) vectorizes; _Pragma: inside a macro argument
      for (int64_t i = begin; i < end; ++i) dst[i] = log_decay_from_raw(out_t(widen(src[i])));
    });
  });
  return out;
}

at::Tensor log_decay_backward_cpu(const at::Tensor& grad_in, const at::Tensor& x_in) {
  check_io_dtype(x_in, "x", /*allow_fp64=*/true);
  TORCH_CHECK(grad_in.sizes() == x_in.sizes(), "grad has shape ", grad_in.sizes(), " but x has ", x_in.sizes());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor grad = grad_in.to(compute_dtype(x.scalar_type())).contiguous();
  at::Tensor grad_x = new_output_like(x);
  ROPEWKV_DISPATCH_IO(x.scalar_type(), "log_decay_backward_cpu", [&] {
    using out_t = compute_t<io_t>;
    const io_t* src = storage_ptr<scalar_t>(x);
    const out_t* g = grad.data_ptr<out_t>();
    io_t* dst = storage_ptr<scalar_t>(grad_x);
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
      _Pragma("omp simd")
      for (int64_t i = begin; i < end; ++i) dst[i] = narrow<io_t>(g[i] * log_decay_from_raw_grad(out_t(widen(src[i]))));
    });
  });
  return grad_x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ropewkv, m) {
  m.def("log_decay(Tensor x) -> Tensor");
  m.def("log_decay_backward(Tensor grad, Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(ropewkv, CPU, m) {
  m.impl("log_decay", &log_decay_cpu);
  m.impl("log_decay_backward", &log_decay_backward_cpu);
}

}  // namespace ropewkv
