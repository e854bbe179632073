#pragma once
// Argument checks and output allocation shared by the CPU twin and the CUDA glue of the WKV7 ops (the second guard
// behind python/ropewkv/ops/rwkv7/api.py, which raises the user-facing errors first).
#include <ATen/ATen.h>

#include <optional>

#include "ropewkv/torch_glue.h"
#include "ropewkv/wkv7.h"

namespace ropewkv::wkv7 {

// Contiguous inputs and the sizes every kernel needs.
struct Inputs {
  at::Tensor r, w, k, v, a, b;
  at::Tensor initial_state;  // undefined if absent, else contiguous [n_seqs, H, N, N] in the state dtype
  at::Tensor cu_seqlens;     // undefined if absent, else contiguous int64 [n_seqs + 1]
  int64_t batch, seqlen, heads, head_size, n_seqs, chunks;
  at::ScalarType state_dtype;  // fp32, or fp64 for fp64 I/O
};

inline Decay decay_from(int64_t code) {
  TORCH_CHECK_VALUE(code >= 0 && code <= 2, "decay must be 0 (loglog), 1 (raw) or 2 (log), got ", code);
  return static_cast<Decay>(code);
}

// r..b share shape and device, and r, k, v, a, b a dtype; w (the decay input) may have its own float dtype, e.g.
// fp32 beside bf16 r..b under autocast. `dims` is 4 for the sequence op ([B, T, H, N]) and 3 for the step ([B, H, N]).
inline void check_same(const at::Tensor* xs, int64_t dims, bool allow_fp64) {
  static const char* names[] = {"r", "w", "k", "v", "a", "b"};
  TORCH_CHECK_VALUE(xs[0].dim() == dims, "r must have ", dims, " dimensions, got shape ", xs[0].sizes());
  check_io_dtype(xs[0], "r", allow_fp64);
  check_io_dtype(xs[1], "w", allow_fp64);
  for (int i = 1; i < 6; ++i) {
    TORCH_CHECK_VALUE(xs[i].sizes() == xs[0].sizes(), names[i], " has shape ", xs[i].sizes(), " but r has ",
                      xs[0].sizes());
    TORCH_CHECK_TYPE(i == 1 || xs[i].scalar_type() == xs[0].scalar_type(), names[i], " has dtype ",
                     xs[i].scalar_type(), " but r has ", xs[0].scalar_type());
    check_same_device(xs[i], xs[0], names[i], "r");
  }
}

// r..b (xs, in that order) copied to contiguous tensors where they are not.
inline void take_contiguous(Inputs& in, const at::Tensor* xs) {
  at::Tensor* dst[] = {&in.r, &in.w, &in.k, &in.v, &in.a, &in.b};
  for (int i = 0; i < 6; ++i) *dst[i] = xs[i].contiguous();
}

// The decode step: r..b [B, H, N] and the state [B, H, N, N] it updates in place (contiguous, the state dtype).
inline Inputs check_step_inputs(const at::Tensor* xs, const at::Tensor& state, bool allow_fp64) {
  check_same(xs, 3, allow_fp64);
  const at::Tensor& r = xs[0];
  Inputs in;
  take_contiguous(in, xs);
  in.batch = in.n_seqs = r.size(0);
  in.seqlen = in.chunks = 1;
  in.heads = r.size(1);
  in.head_size = r.size(2);
  in.state_dtype = compute_dtype(r.scalar_type());
  const int64_t n = in.head_size;
  TORCH_CHECK_VALUE(state.dim() == 4 && state.size(0) == in.batch && state.size(1) == in.heads &&
                        state.size(2) == n && state.size(3) == n,
                    "state must have shape [", in.batch, ", ", in.heads, ", ", n, ", ", n, "], got ", state.sizes());
  TORCH_CHECK_TYPE(state.scalar_type() == in.state_dtype, "state must be ", in.state_dtype, ", got ",
                   state.scalar_type());
  TORCH_CHECK_VALUE(state.is_contiguous(), "state must be contiguous (it is updated in place)");
  check_same_device(state, r, "state", "r");
  return in;
}

inline Inputs check_inputs(const at::Tensor& r, const at::Tensor& w, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& initial_state,
                           const std::optional<at::Tensor>& cu_seqlens, bool allow_fp64) {
  const at::Tensor xs[] = {r, w, k, v, a, b};
  check_same(xs, 4, allow_fp64);
  Inputs in;
  take_contiguous(in, xs);
  in.batch = r.size(0);
  in.seqlen = r.size(1);
  in.heads = r.size(2);
  in.head_size = r.size(3);
  in.chunks = (in.seqlen + kCheckpointEvery - 1) / kCheckpointEvery;
  in.state_dtype = compute_dtype(r.scalar_type());
  in.n_seqs = in.batch;
  if (cu_seqlens.has_value()) {
    const at::Tensor& cu = *cu_seqlens;
    TORCH_CHECK_VALUE(cu.dim() == 1 && cu.size(0) >= 2, "cu_seqlens must be 1-D with at least 2 entries, got ",
                      cu.sizes());
    TORCH_CHECK_TYPE(cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong,
                     "cu_seqlens must be int32 or int64, got ", cu.scalar_type());
    TORCH_CHECK_VALUE(in.batch == 1, "cu_seqlens needs batch size 1 (packed sequences), got ", in.batch);
    check_same_device(cu, r, "cu_seqlens", "r");
    in.cu_seqlens = cu.to(at::kLong).contiguous();
    in.n_seqs = cu.size(0) - 1;
  }
  if (initial_state.has_value()) {
    const at::Tensor& s0 = *initial_state;
    TORCH_CHECK_VALUE(s0.dim() == 4 && s0.size(0) == in.n_seqs && s0.size(1) == in.heads &&
                          s0.size(2) == in.head_size && s0.size(3) == in.head_size,
                      "initial_state must have shape [", in.n_seqs, ", ", in.heads, ", ", in.head_size, ", ",
                      in.head_size, "], got ", s0.sizes());
    TORCH_CHECK_TYPE(s0.scalar_type() == in.state_dtype, "initial_state must be ", in.state_dtype, ", got ",
                     s0.scalar_type());
    check_same_device(s0, r, "initial_state", "r");
    in.initial_state = s0.contiguous();
  }
  return in;
}

inline at::Tensor new_state(const Inputs& in, int64_t n) {
  return new_output({n, in.heads, in.head_size, in.head_size}, in.r.options().dtype(in.state_dtype));
}

// The checkpoints: [B, chunks, H, N, N], slot c = the state before token c * kCheckpointEvery, stored transposed
// (ckpt[j][i] = S[i][j]) so that CUDA thread i writes and reads it coalesced. Empty when no backward will run.
inline at::Tensor new_checkpoints(const Inputs& in, bool save) {
  const auto options = in.r.options().dtype(in.state_dtype);
  if (!save) return at::empty({0}, options);
  return new_output({in.batch, in.chunks, in.heads, in.head_size, in.head_size}, options);
}

// The cotangent of the final state, contiguous in the state dtype, or undefined.
inline at::Tensor check_grad_state(const std::optional<at::Tensor>& grad, const Inputs& in) {
  if (!grad.has_value()) return at::Tensor();
  TORCH_CHECK_VALUE(grad->dim() == 4 && grad->size(0) == in.n_seqs && grad->size(1) == in.heads &&
                        grad->size(2) == in.head_size && grad->size(3) == in.head_size,
                    "grad_final_state must have shape [", in.n_seqs, ", ", in.heads, ", ", in.head_size, ", ",
                    in.head_size, "] (final_state's), got ", grad->sizes());
  check_same_device(*grad, in.r, "grad_final_state", "r");
  return grad->to(in.state_dtype).contiguous();
}

inline void check_checkpoints(const at::Tensor& ckpt, const Inputs& in) {
  TORCH_CHECK_VALUE(ckpt.dim() == 5 && ckpt.size(0) == in.batch && ckpt.size(1) == in.chunks &&
                        ckpt.size(2) == in.heads && ckpt.size(3) == in.head_size && ckpt.size(4) == in.head_size,
                    "checkpoints have shape ", ckpt.sizes(), "; the forward must run with save_checkpoints=True");
  TORCH_CHECK_TYPE(ckpt.scalar_type() == in.state_dtype, "checkpoints must be ", in.state_dtype);
}

}  // namespace ropewkv::wkv7
