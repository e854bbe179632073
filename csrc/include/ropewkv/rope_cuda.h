#pragma once
// Framework-free CUDA entry points of RoPE (kernels in csrc/rope/rope_kernel.cuh, one .cu per I/O dtype).
#include <cuda_runtime_api.h>

#include "ropewkv/precision.h"
#include "ropewkv/rope.h"

namespace ropewkv::cuda {

// Rotates p.q (and p.k) into p.q_out (p.k_out), which may alias them (in place); see ropewkv/rope.h for the
// conventions. One launch for q and k together. Returns the launch status.
cudaError_t rope_forward_fp32(const rope::Params& p, Precision precision, cudaStream_t stream);
cudaError_t rope_forward_fp16(const rope::Params& p, Precision precision, cudaStream_t stream);
cudaError_t rope_forward_bf16(const rope::Params& p, Precision precision, cudaStream_t stream);

inline cudaError_t rope_forward(DType io_dtype, const rope::Params& p, Precision precision, cudaStream_t stream) {
  switch (io_dtype) {
    case DType::kFloat32:
      return rope_forward_fp32(p, precision, stream);
    case DType::kFloat16:
      return rope_forward_fp16(p, precision, stream);
    case DType::kBFloat16:
      return rope_forward_bf16(p, precision, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace ropewkv::cuda
