// CUDA kernels of the RWKV-7 raw-decay op. Torch-free: raw pointers, int64 sizes and a stream.
#include "ropewkv/cuda_common.cuh"
#include "ropewkv/decay.h"
#include "ropewkv/decay_cuda.h"

namespace ropewkv::cuda {
namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return int(blocks < 65535 * 16 ? blocks : 65535 * 16);  // grid-stride loops cover the rest
}

template <typename io_t>
__global__ void log_decay_forward_kernel(const io_t* __restrict__ x, float* __restrict__ out, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = log_decay_from_raw(float(widen(x[i])));
  }
}

template <typename io_t>
__global__ void log_decay_backward_kernel(const float* __restrict__ grad, const io_t* __restrict__ x,
                                          io_t* __restrict__ grad_x, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    grad_x[i] = narrow<io_t>(grad[i] * log_decay_from_raw_grad(float(widen(x[i]))));
  }
}

}  // namespace

cudaError_t log_decay_forward(DType x_dtype, const void* x, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch_io(x_dtype, [&](auto tag) {
    using io_t = decltype(tag);
    log_decay_forward_kernel<<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const io_t*>(x), out, n);
  });
}

cudaError_t log_decay_backward(DType x_dtype, const float* grad, const void* x, void* grad_x, int64_t n,
                               cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch_io(x_dtype, [&](auto tag) {
    using io_t = decltype(tag);
    log_decay_backward_kernel<<<blocks_for(n), kThreads, 0, stream>>>(grad, static_cast<const io_t*>(x),
                                                                       static_cast<io_t*>(grad_x), n);
  });
}

}  // namespace ropewkv::cuda
