// RoPE CUDA kernels for fp32 I/O (one file per dtype so the builds run in parallel).
#include "rope_launch.cuh"

namespace ropewkv::cuda {

cudaError_t rope_forward_fp32(const rope::Params& p, Precision precision, cudaStream_t stream) {
  return rope_launch<float>(p, precision, stream);
}

}  // namespace ropewkv::cuda
