// CUDA kernels of the RWKV-7 raw-decay op. Torch-free: raw pointers, int64 sizes and a stream.
//
// Streaming kernels: each thread moves 16-byte vectors (8 bf16/fp16 or 4 fp32 inputs per iteration, their fp32
// values as 16-byte stores) in a grid-stride loop, and the first threads take the n % 8 (or % 4) elements past the
// last vector one by one. Pointers that are not all 16-byte aligned take the element-wise instantiation (VECTOR =
// false), chosen on the host.
#include <algorithm>
#include <cstdint>

#include "ropewkv/cuda_common.cuh"
#include "ropewkv/decay.h"
#include "ropewkv/decay_cuda.h"

namespace ropewkv::cuda {
namespace {

constexpr int kThreads = 256;

// Elements per thread and iteration: one 16-byte access of the input dtype, or one element.
template <typename io_t, bool VECTOR>
constexpr int kElements = VECTOR ? int(16 / sizeof(io_t)) : 1;

int blocks_for(int64_t threads) {
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  return int(blocks < 65535 * 16 ? blocks : 65535 * 16);  // grid-stride loops cover the rest
}

// N consecutive elements of T as fp32, through 16-byte runs when VECTOR (ptr 16-byte aligned), else one by one.
template <typename T, int N, bool VECTOR>
__device__ __forceinline__ void load_widened(const T* ptr, float (&v)[N]) {
  constexpr int kRun = VECTOR ? int(16 / sizeof(T)) : N;
#pragma unroll
  for (int r = 0; r < N / kRun; ++r) {
    const auto run = Run<T, kRun, VECTOR>::load(ptr + r * kRun);
#pragma unroll
    for (int i = 0; i < kRun; ++i) v[r * kRun + i] = float(widen(run.v[i]));
  }
}

// N fp32 values rounded to T and stored as load_widened reads them.
template <typename T, int N, bool VECTOR>
__device__ __forceinline__ void store_narrowed(T* ptr, const float (&v)[N]) {
  constexpr int kRun = VECTOR ? int(16 / sizeof(T)) : N;
#pragma unroll
  for (int r = 0; r < N / kRun; ++r) {
    Run<T, kRun, VECTOR> run;
#pragma unroll
    for (int i = 0; i < kRun; ++i) run.v[i] = narrow<T>(v[r * kRun + i]);
    run.store(ptr + r * kRun);
  }
}

template <typename io_t, bool VECTOR>
__global__ void log_decay_forward_kernel(const io_t* __restrict__ x, float* __restrict__ out, int64_t n) {
  constexpr int N = kElements<io_t, VECTOR>;
  const int64_t vectors = n / N;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t c = first; c < vectors; c += int64_t(gridDim.x) * blockDim.x) {
    float v[N];
    load_widened<io_t, N, VECTOR>(x + c * N, v);
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = log_decay_from_raw(v[i]);
    store_narrowed<float, N, VECTOR>(out + c * N, v);
  }
  const int64_t tail = vectors * N + first;  // past the last vector: fewer than N elements
  if (tail < n) out[tail] = log_decay_from_raw(float(widen(x[tail])));
}

template <typename io_t, bool VECTOR>
__global__ void log_decay_backward_kernel(const float* __restrict__ grad, const io_t* __restrict__ x,
                                          io_t* __restrict__ grad_x, int64_t n) {
  constexpr int N = kElements<io_t, VECTOR>;
  const int64_t vectors = n / N;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t c = first; c < vectors; c += int64_t(gridDim.x) * blockDim.x) {
    float g[N], v[N];
    load_widened<float, N, VECTOR>(grad + c * N, g);
    load_widened<io_t, N, VECTOR>(x + c * N, v);
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = g[i] * log_decay_from_raw_grad(v[i]);
    store_narrowed<io_t, N, VECTOR>(grad_x + c * N, v);
  }
  const int64_t tail = vectors * N + first;
  if (tail < n) grad_x[tail] = narrow<io_t>(grad[tail] * log_decay_from_raw_grad(float(widen(x[tail]))));
}

// The threads a launch needs: one per vector, and at least as many as the elements past the last vector.
template <typename io_t, bool VECTOR>
int64_t threads_for(int64_t n) {
  constexpr int N = kElements<io_t, VECTOR>;
  return std::max(n / N, n % N);
}

}  // namespace

cudaError_t log_decay_forward(DType x_dtype, const void* x, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const bool vector = aligned_16(x) && aligned_16(out);
  return dispatch_io(x_dtype, [&](auto tag) {
    using io_t = decltype(tag);
    const auto* in = static_cast<const io_t*>(x);
    if (vector) {
      log_decay_forward_kernel<io_t, true><<<blocks_for(threads_for<io_t, true>(n)), kThreads, 0, stream>>>(in, out, n);
    } else {
      log_decay_forward_kernel<io_t, false><<<blocks_for(n), kThreads, 0, stream>>>(in, out, n);
    }
  });
}

cudaError_t log_decay_backward(DType x_dtype, const float* grad, const void* x, void* grad_x, int64_t n,
                               cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const bool vector = aligned_16(grad) && aligned_16(x) && aligned_16(grad_x);
  return dispatch_io(x_dtype, [&](auto tag) {
    using io_t = decltype(tag);
    const auto* in = static_cast<const io_t*>(x);
    auto* gx = static_cast<io_t*>(grad_x);
    if (vector) {
      log_decay_backward_kernel<io_t, true>
          <<<blocks_for(threads_for<io_t, true>(n)), kThreads, 0, stream>>>(grad, in, gx, n);
    } else {
      log_decay_backward_kernel<io_t, false><<<blocks_for(n), kThreads, 0, stream>>>(grad, in, gx, n);
    }
  });
}

}  // namespace ropewkv::cuda
