// RoPE CUDA kernels for fp16 I/O (one file per dtype so the builds run in parallel).
#include "rope_launch.cuh"

namespace ropewkv::cuda {

cudaError_t rope_forward_fp16(const rope::Params& p, Precision precision, cudaStream_t stream) {
  return rope_launch<fp16_t>(p, precision, stream);
}

}  // namespace ropewkv::cuda
