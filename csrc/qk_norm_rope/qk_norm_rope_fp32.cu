// Fused QK-RMSNorm + RoPE CUDA kernels for fp32 I/O (one file per dtype so the builds run in parallel).
#include "qk_norm_rope_kernel.cuh"

namespace ropewkv::cuda {

cudaError_t qk_norm_rope_forward_fp32(const qk_norm_rope::Params& p, Precision precision, cudaStream_t stream) {
  return qk::forward_launch<float>(p, precision, stream);
}

cudaError_t qk_norm_rope_backward_fp32(const qk_norm_rope::Params& p, cudaStream_t stream) {
  return qk::backward_launch<float>(p, stream);
}

}  // namespace ropewkv::cuda
