#pragma once
// The host launches of the chunked WKV7 backward's two kernels (wkv7_chunked_backward_kernels.cuh, kept free of
// launch syntax for the host emulator), instantiated per head size by wkv7_chunked_backward_n*.cu.
#include "wkv7_chunked_backward_kernels.cuh"
#include "wkv7_launch.cuh"  // dispatch_wkv7

namespace ropewkv::cuda {

template <int N>
int wkv7_chunked_backward_shared_bytes() {
  return int(sizeof(wkv7_chunked_detail::GradientShared<N>));
}

template <int N, DecayStorage W>
cudaError_t wkv7_chunked_backward(DType dtype, Precision precision, const Wkv7BackwardParams& p, cudaStream_t stream) {
  using namespace wkv7_chunked_detail;
  // Pass 1: (sequence x head) on grid axis 0, the value slices on axis 1 (capped at 65,535). Pass 2: (window x head).
  const int64_t tasks = p.size.n_seqs * p.size.heads, windows = p.size.batch * p.size.chunks * p.size.heads;
  if (tasks == 0) return cudaSuccess;
  if (tasks > 0x7fffffff || windows > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const int shared = wkv7_chunked_backward_shared_bytes<N>();  // the glue checks it against the device first
  cudaError_t status = cudaSuccess;
  const cudaError_t dispatched = dispatch_wkv7<W>(dtype, precision, [&](auto io_tag, auto w_tag, auto mode) {
    using io_t = decltype(io_tag);
    using w_t = decltype(w_tag);
    constexpr Precision P = decltype(mode)::value;
    constexpr int kVS = kValueSlice<N, P>;
    chunked_state_cotangent_kernel<N, io_t, w_t, P><<<dim3(unsigned(tasks), N / kVS), kThreads, 0, stream>>>(p);
    if (windows == 0) return;
    // Set on every call, as the attribute belongs to the current device's context (a once-only flag would miss the
    // second GPU of a process); it is host work of about a microsecond.
    status = cudaFuncSetAttribute(chunked_gradients_kernel<N, io_t, w_t, P>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
    if (status != cudaSuccess) return;
    chunked_gradients_kernel<N, io_t, w_t, P><<<unsigned(windows), kThreads, shared, stream>>>(p);
  });
  return dispatched != cudaSuccess ? dispatched : status;
}

#define ROPEWKV_WKV7_CHUNKED_BACKWARD_INSTANTIATE(N)                                                                \
  template cudaError_t wkv7_chunked_backward<N, DecayStorage::kIO>(DType, Precision, const Wkv7BackwardParams&,      \
                                                                    cudaStream_t);                                   \
  template cudaError_t wkv7_chunked_backward<N, DecayStorage::kFloat32>(DType, Precision, const Wkv7BackwardParams&, \
                                                                         cudaStream_t);                              \
  template int wkv7_chunked_backward_shared_bytes<N>();

}  // namespace ropewkv::cuda
