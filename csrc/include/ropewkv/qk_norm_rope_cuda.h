#pragma once
// Framework-free CUDA entry points of the fused QK-RMSNorm + RoPE (kernels in csrc/qk_norm_rope/, one .cu per dtype).
#include <cuda_runtime_api.h>

#include "ropewkv/precision.h"
#include "ropewkv/qk_norm_rope.h"

namespace ropewkv::cuda {

// Largest head_dim of the CUDA twin: a row lives in the registers of at most 32 lanes (auto uses Triton beyond).
inline constexpr int64_t kQkMaxHeadDim = 256;

// Forward: p.rope.q/k (and the weights) -> p.rope.q_out/k_out, which may alias them (in place). Backward
// (p.rope.conjugate set by the caller): p.grad_q/k and the saved inputs p.rope.q/k -> dq/dk in p.rope.q_out/k_out and
// the weight-gradient partials [chunks, head_dim] (fp32) in p.dq_weight/dk_weight. Return the launch status.
cudaError_t qk_norm_rope_forward_fp32(const qk_norm_rope::Params& p, Precision precision, cudaStream_t stream);
cudaError_t qk_norm_rope_forward_fp16(const qk_norm_rope::Params& p, Precision precision, cudaStream_t stream);
cudaError_t qk_norm_rope_forward_bf16(const qk_norm_rope::Params& p, Precision precision, cudaStream_t stream);
cudaError_t qk_norm_rope_backward_fp32(const qk_norm_rope::Params& p, cudaStream_t stream);
cudaError_t qk_norm_rope_backward_fp16(const qk_norm_rope::Params& p, cudaStream_t stream);
cudaError_t qk_norm_rope_backward_bf16(const qk_norm_rope::Params& p, cudaStream_t stream);

inline cudaError_t qk_norm_rope_forward(DType io, const qk_norm_rope::Params& p, Precision precision,
                                        cudaStream_t stream) {
  switch (io) {
    case DType::kFloat32:
      return qk_norm_rope_forward_fp32(p, precision, stream);
    case DType::kFloat16:
      return qk_norm_rope_forward_fp16(p, precision, stream);
    case DType::kBFloat16:
      return qk_norm_rope_forward_bf16(p, precision, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

inline cudaError_t qk_norm_rope_backward(DType io, const qk_norm_rope::Params& p, cudaStream_t stream) {
  switch (io) {
    case DType::kFloat32:
      return qk_norm_rope_backward_fp32(p, stream);
    case DType::kFloat16:
      return qk_norm_rope_backward_fp16(p, stream);
    case DType::kBFloat16:
      return qk_norm_rope_backward_bf16(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace ropewkv::cuda
