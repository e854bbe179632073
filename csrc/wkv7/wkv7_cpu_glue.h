#pragma once
// The CPU glue shared by the sequential (wkv7_cpu.cpp) and chunked (wkv7_chunked_cpu.cpp) WKV7 ops: argument checks,
// output allocation and the dtype dispatch around an algorithm's forward and backward.
#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <tuple>

#include "wkv7_glue.h"

namespace ropewkv::wkv7 {

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls body(TypeTag<w's c10 type>{}): r's (scalar_t), or float.
template <typename scalar_t, typename Body>
void dispatch_w(const Inputs& in, Body&& body) {
  if (in.w.scalar_type() == in.r.scalar_type()) return body(TypeTag<scalar_t>{});
  TORCH_CHECK_TYPE(in.w.scalar_type() == at::kFloat, "w must have r's dtype (", in.r.scalar_type(),
                   ") or float32, got ", in.w.scalar_type());
  body(TypeTag<float>{});
}

// The first values of cu_seqlens as "[0, 4, 12, ...]", as the Python checks print them (not a tensor dump).
inline std::string leading_values(const int64_t* values, int64_t count) {
  std::string text = "[";
  for (int64_t i = 0; i < std::min<int64_t>(count, 8); ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  return text + (count > 8 ? ", ...]" : "]");
}

inline void check_cu_seqlens_values(const Inputs& in) {
  if (!in.cu_seqlens.defined()) return;
  const int64_t* cu = in.cu_seqlens.const_data_ptr<int64_t>();
  TORCH_CHECK_VALUE(cu[0] == 0 && cu[in.n_seqs] == in.seqlen, "cu_seqlens must start at 0 and end at T = ",
                    in.seqlen, ", got ", leading_values(cu, in.n_seqs + 1));
  for (int64_t s = 0; s < in.n_seqs; ++s) {
    TORCH_CHECK_VALUE(cu[s] <= cu[s + 1], "cu_seqlens must be non-decreasing, got ",
                      leading_values(cu, in.n_seqs + 1));
  }
}

// Algo names the algorithm: static constexpr kForwardName and kBackwardName (the dispatch names dtype errors quote),
// and static member templates forward<io_t, P, scalar_t, w_scalar_t>, its function (in, decay, save, y, final_state,
// ckpt), and backward<io_t, P, scalar_t, w_scalar_t>, its function (in, decay, grad_y, grad_state, ckpt, grads,
// grad_s0).
template <typename Algo>
std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_forward(
    const at::Tensor& r, const at::Tensor& w, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
    const at::Tensor& b, const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens,
    int64_t decay_code, int64_t precision, bool save_checkpoints) {
  const Inputs in = check_inputs(r, w, k, v, a, b, initial_state, cu_seqlens, /*allow_fp64=*/true);
  const Decay decay = decay_from(decay_code);
  check_cu_seqlens_values(in);
  at::Tensor y = new_output_like(in.r);
  at::Tensor final_state = new_state(in, in.n_seqs);
  at::Tensor ckpt = new_checkpoints(in, save_checkpoints);
  ROPEWKV_DISPATCH_IO(in.r.scalar_type(), Algo::kForwardName, [&] {
    ROPEWKV_DISPATCH_PRECISION(precision_from(precision), [&] {
      dispatch_w<scalar_t>(in, [&](auto w_tag) {
        using w_scalar_t = typename decltype(w_tag)::type;
        Algo::template forward<io_t, kPrecision, scalar_t, w_scalar_t>(in, decay, save_checkpoints, y, final_state,
                                                                        ckpt);
      });
    });
  });
  return {y, final_state, ckpt};
}

template <typename Algo>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> cpu_backward(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_final_state, const at::Tensor& r,
    const at::Tensor& w, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a, const at::Tensor& b,
    const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& checkpoints, int64_t decay_code, int64_t precision) {
  const Inputs in = check_inputs(r, w, k, v, a, b, initial_state, cu_seqlens, /*allow_fp64=*/true);
  const Decay decay = decay_from(decay_code);
  check_cu_seqlens_values(in);
  check_checkpoints(checkpoints, in);
  TORCH_CHECK_VALUE(grad_y.sizes() == r.sizes(), "grad_y has shape ", grad_y.sizes(), " but r has ", r.sizes());
  const at::Tensor gy = grad_y.to(r.scalar_type()).contiguous();
  const at::Tensor gs = check_grad_state(grad_final_state, in);
  const at::Tensor ckpt = checkpoints.contiguous();
  std::array<at::Tensor, 6> grads;
  for (int i = 0; i < 6; ++i) grads[i] = new_output_like(i == 1 ? in.w : in.r);
  at::Tensor grad_s0 = new_state(in, in.n_seqs);
  ROPEWKV_DISPATCH_IO(in.r.scalar_type(), Algo::kBackwardName, [&] {
    ROPEWKV_DISPATCH_PRECISION(precision_from(precision), [&] {
      dispatch_w<scalar_t>(in, [&](auto w_tag) {
        using w_scalar_t = typename decltype(w_tag)::type;
        Algo::template backward<io_t, kPrecision, scalar_t, w_scalar_t>(in, decay, gy, gs, ckpt, grads, grad_s0);
      });
    });
  });
  return {grads[0], grads[1], grads[2], grads[3], grads[4], grads[5], grad_s0};
}

}  // namespace ropewkv::wkv7
