// RoPE CUDA kernels for bf16 I/O (one file per dtype so the builds run in parallel).
#include "rope_launch.cuh"

namespace ropewkv::cuda {

cudaError_t rope_forward_bf16(const rope::Params& p, Precision precision, cudaStream_t stream) {
  return rope_launch<bf16_t>(p, precision, stream);
}

}  // namespace ropewkv::cuda
