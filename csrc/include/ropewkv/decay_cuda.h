#pragma once
// Framework-free CUDA entry points of the decay op (defined in csrc/decay/decay.cu).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ropewkv/precision.h"

namespace ropewkv::cuda {

// out[i] = log_decay_from_raw(x[i]) in fp32; x has dtype `x_dtype`. Returns the launch status.
cudaError_t log_decay_forward(DType x_dtype, const void* x, float* out, int64_t n, cudaStream_t stream);

// grad_x[i] = grad[i] * log_decay_from_raw_grad(x[i]), stored in x's dtype.
cudaError_t log_decay_backward(DType x_dtype, const float* grad, const void* x, void* grad_x, int64_t n,
                               cudaStream_t stream);

}  // namespace ropewkv::cuda
