#pragma once
// Torch-facing glue shared by the CPU twin (qk_norm_rope_cpu.cpp) and the CUDA glue (qk_norm_rope_cuda.cpp): checks
// (the second guard behind the Python layer's), tensors -> qk_norm_rope::Params, outputs, and the op bodies. The
// q/k views and the angle / HF-table sources go through RoPE's glue (rope_glue.h).
#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "../rope/rope_glue.h"
#include "ropewkv/qk_norm_rope.h"
#include "ropewkv/torch_glue.h"

namespace ropewkv::qk_norm_rope {

using OptTensor = std::optional<at::Tensor>;

inline void set_weights(Params& p, const at::Tensor& q, const OptTensor& k, const OptTensor& q_weight,
                        const OptTensor& k_weight, double eps, double weight_offset) {
  TORCH_CHECK_VALUE(k.has_value() ? q_weight.has_value() == k_weight.has_value() : !k_weight.has_value(),
                    "q_weight and k_weight must be given together (or both omitted: no norm); no k_weight without k");
  p.eps = float(eps);
  p.weight_offset = float(weight_offset);
  if (!q_weight.has_value()) return;
  const at::ScalarType compute = compute_dtype(q.scalar_type());
  for (const auto& [w, name] : {std::pair{q_weight, "q_weight"}, std::pair{k_weight, "k_weight"}}) {
    if (!w.has_value()) continue;
    TORCH_CHECK_TYPE(w->scalar_type() == compute, name, " must be ", compute, " (the compute dtype), got ",
                     w->scalar_type());
    TORCH_CHECK_VALUE(w->dim() == 1 && w->is_contiguous() && w->size(0) == q.size(3), name,
                      " must be contiguous [head_dim = ", q.size(3), "], got ", w->sizes());
    check_same_device(*w, q, name, "q");
  }
  p.q_weight = q_weight->const_data_ptr();
  p.k_weight = k_weight.has_value() ? k_weight->const_data_ptr() : nullptr;
}

inline void set_cache_source(Params& p, const at::Tensor& q, const at::Tensor& cache, const OptTensor& positions,
                             bool allow_fp64) {
  TORCH_CHECK_VALUE(cache.dim() == 2 && cache.size(1) == 2 * p.rope.rot_half && cache.stride(1) == 1,
                    "cos_sin_cache must be [max_position, rotary_dim = ", 2 * p.rope.rot_half,
                    "] with stride 1 in its last dim, got ", cache.sizes());
  TORCH_CHECK_VALUE(cache.size(0) > 0, "cos_sin_cache has no rows");
  TORCH_CHECK_VALUE(positions.has_value(), "a cos_sin_cache needs positions");
  TORCH_CHECK_TYPE(rope::is_index_dtype(*positions), "positions must be int32 or int64, got ",
                   positions->scalar_type());
  TORCH_CHECK_VALUE(positions->dim() == 2 && positions->size(0) == p.rope.batch &&
                        positions->size(1) == p.rope.seqlen,
                    "positions must be a [batch, seq] view, got ", positions->sizes());
  check_same_device(cache, q, "cos_sin_cache", "q");
  check_same_device(*positions, q, "positions", "q");
  p.cache_type = rope::table_type(cache);
  TORCH_CHECK_TYPE(allow_fp64 || p.cache_type != rope::TableType::kFloat64,
                   "cos_sin_cache must not be float64 on this device");
  p.cache = cache.const_data_ptr();
  p.cache_stride = cache.stride(0);
  p.max_position = cache.size(0);
  p.rope.positions = positions->const_data_ptr();
  p.rope.positions_int64 = positions->scalar_type() == at::kLong;
  p.rope.pos_stride[0] = positions->stride(0);
  p.rope.pos_stride[1] = positions->stride(1);
}

// Everything but the backward's tensors: q/k (inputs) -> q_out/k_out, the weights and exactly one cos/sin source.
inline Params make_params(const at::Tensor& q, const OptTensor& k, const at::Tensor& q_out, const OptTensor& k_out,
                          const OptTensor& q_weight, const OptTensor& k_weight, double eps, double weight_offset,
                          const OptTensor& inv_freq, const OptTensor& cos, const OptTensor& sin,
                          const OptTensor& cache, const OptTensor& positions, const OptTensor& offsets,
                          const OptTensor& cu_seqlens, int64_t rotary_dim, bool interleaved, double scaling,
                          bool allow_fp64) {
  Params p;
  rope::set_io(p.rope, q, k, q_out, k_out, rotary_dim, "rotary_dim", allow_fp64);
  TORCH_CHECK_VALUE(int(inv_freq.has_value()) + int(cos.has_value()) + int(cache.has_value()) == 1,
                    "exactly one cos/sin source: inv_freq, cos and sin, or cos_sin_cache");
  // What a table source does not read is refused, not ignored (the Triton twin applies seqlen_offsets and cu_seqlens
  // to a cache's positions): the Python layer's rules, for direct op calls.
  TORCH_CHECK_VALUE(inv_freq.has_value() || (!offsets.has_value() && !cu_seqlens.has_value() && scaling == 1.0),
                    "seqlen_offsets, cu_seqlens and attention_scaling apply to the inv_freq source only");
  TORCH_CHECK_VALUE(!cos.has_value() || !positions.has_value(),
                    "cos/sin tables are read per token as given: positions apply to the inv_freq and cos_sin_cache "
                    "sources");
  if (inv_freq.has_value()) {
    TORCH_CHECK_VALUE(inv_freq->numel() == rotary_dim / 2, "inv_freq must have rotary_dim / 2 = ", rotary_dim / 2,
                      " entries, got ", inv_freq->numel());
    rope::set_angle_source(p.rope, q, *inv_freq, positions, offsets, cu_seqlens, scaling, std::nullopt, false);
  } else if (cos.has_value()) {
    TORCH_CHECK_VALUE(sin.has_value(), "cos needs sin");
    rope::set_table_source(p.rope, q, *cos, *sin, allow_fp64);
  } else {
    set_cache_source(p, q, *cache, positions, allow_fp64);
  }
  p.rope.interleaved = interleaved;
  set_weights(p, q, k, q_weight, k_weight, eps, weight_offset);
  return p;
}

inline void set_grads(Params& p, const at::Tensor& grad_q, const OptTensor& grad_k, const at::Tensor& q,
                      const OptTensor& k) {
  TORCH_CHECK_VALUE(grad_q.sizes() == q.sizes(), "grad_q has shape ", grad_q.sizes(), " but q has ", q.sizes());
  TORCH_CHECK_VALUE(grad_k.has_value() == k.has_value(), "grad_k must be given exactly when k is");
  rope::check_bshd(grad_q, "grad_q");
  check_same_device(grad_q, q, "grad_q", "q");
  p.grad_q = grad_q.const_data_ptr();
  for (int i = 0; i < 3; ++i) p.gq_stride[i] = grad_q.stride(i);
  if (grad_k.has_value()) {
    TORCH_CHECK_VALUE(grad_k->sizes() == k->sizes(), "grad_k has shape ", grad_k->sizes(), " but k has ",
                      k->sizes());
    rope::check_bshd(*grad_k, "grad_k");
    check_same_device(*grad_k, q, "grad_k", "q");
    p.grad_k = grad_k->const_data_ptr();
    for (int i = 0; i < 3; ++i) p.gk_stride[i] = grad_k->stride(i);
  }
  TORCH_CHECK_TYPE(grad_q.scalar_type() == q.scalar_type() &&
                       (!grad_k.has_value() || grad_k->scalar_type() == q.scalar_type()),
                   "the gradients must have q's dtype ", q.scalar_type());
}

inline int64_t weight_chunks(const Params& p) {
  return (p.rope.batch * p.rope.seqlen + kChunkTokens - 1) / kChunkTokens;
}

// The op bodies, parameterised by the device's forward/backward launchers and whether fp64 is allowed. The backward
// returns [dq, dk, dq_weight, dk_weight] (empty tensors for what does not exist); the device's `reduce` turns the
// weight-gradient partials into sums.
#define ROPEWKV_QK_SOURCE_PARAMS                                                                                  \
  const OptTensor &q_weight, const OptTensor &k_weight, double eps, double weight_offset,                        \
      const OptTensor &inv_freq, const OptTensor &cos, const OptTensor &sin, const OptTensor &cache,              \
      const OptTensor &positions, const OptTensor &offsets, const OptTensor &cu_seqlens, int64_t rotary_dim,      \
      bool interleaved, double scaling, int64_t precision
#define ROPEWKV_QK_SOURCE_VALUES                                                                                  \
  q_weight, k_weight, eps, weight_offset, inv_freq, cos, sin, cache, positions, offsets, cu_seqlens, rotary_dim, \
      interleaved, scaling

template <typename Launch>
std::vector<at::Tensor> forward(Launch&& launch, bool allow_fp64, const at::Tensor& q, const OptTensor& k,
                                ROPEWKV_QK_SOURCE_PARAMS) {
  std::vector<at::Tensor> out = rope::outputs(q, k);
  const Params p = make_params(q, k, out[0], rope::second(out), ROPEWKV_QK_SOURCE_VALUES, allow_fp64);
  launch(p, q.scalar_type(), precision_from(precision));
  return out;
}

template <typename Launch>
void forward_inplace(Launch&& launch, bool allow_fp64, const at::Tensor& q, const OptTensor& k,
                     ROPEWKV_QK_SOURCE_PARAMS) {
  const Params p = make_params(q, k, q, k, ROPEWKV_QK_SOURCE_VALUES, allow_fp64);
  rope::check_inplace(q, k);
  launch(p, q.scalar_type(), precision_from(precision));
}

template <typename Launch, typename Reduce>
std::vector<at::Tensor> backward(Launch&& launch, Reduce&& reduce, bool allow_fp64, const at::Tensor& grad_q,
                                 const OptTensor& grad_k, const at::Tensor& q, const OptTensor& k,
                                 ROPEWKV_QK_SOURCE_PARAMS) {
  std::vector<at::Tensor> grads = rope::outputs(q, k);
  Params p = make_params(q, k, grads[0], rope::second(grads), ROPEWKV_QK_SOURCE_VALUES, allow_fp64);
  (void)precision_from(precision);  // the backward computes in fp32 (fp64) in both modes
  p.rope.conjugate = true;
  set_grads(p, grad_q, grad_k, q, k);
  p.chunk_tokens = kChunkTokens;
  const at::TensorOptions weights = q.options().dtype(compute_dtype(q.scalar_type()));
  at::Tensor dq_partial = at::empty({0}, weights), dk_partial = at::empty({0}, weights);
  if (p.normalize()) {
    dq_partial = at::empty({weight_chunks(p), q.size(3)}, weights);
    dk_partial = k.has_value() ? at::empty({weight_chunks(p), q.size(3)}, weights) : at::empty({0}, weights);
    p.dq_weight = dq_partial.data_ptr();
    p.dk_weight = k.has_value() ? dk_partial.data_ptr() : nullptr;
  }
  launch(p, q.scalar_type());
  if (grads.size() < 2) grads.push_back(at::empty({0}, q.options()));
  grads.push_back(p.normalize() ? reduce(dq_partial) : dq_partial);
  grads.push_back(p.normalize() && k.has_value() ? reduce(dk_partial) : dk_partial);
  return grads;
}

}  // namespace ropewkv::qk_norm_rope

// The schemas' shared arguments (after q and k), defined in qk_norm_rope_cpu.cpp and implemented by both devices.
#define ROPEWKV_QK_NORM_ROPE_ARGS                                                                                 \
  "Tensor? q_weight, Tensor? k_weight, float eps, float weight_offset, Tensor? inv_freq, Tensor? cos, "          \
  "Tensor? sin, Tensor? cos_sin_cache, Tensor? positions, Tensor? seqlen_offsets, Tensor? cu_seqlens, "          \
  "int rotary_dim, bool interleaved, float attention_scaling, int precision"
