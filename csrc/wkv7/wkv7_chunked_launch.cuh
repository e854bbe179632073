#pragma once
// The host launch of the chunked WKV7 forward kernel (wkv7_chunked_kernels.cuh, kept free of launch syntax for the
// host emulator), instantiated per head size by wkv7_chunked_n*.cu.
#include "wkv7_chunked_kernels.cuh"
#include "wkv7_launch.cuh"  // dispatch_wkv7

namespace ropewkv::cuda {

template <int N, DecayStorage W>
cudaError_t wkv7_chunked_forward(DType dtype, Precision precision, const Wkv7ForwardParams& p, cudaStream_t stream) {
  const int64_t tasks = p.size.n_seqs * p.size.heads;  // grid axis 0 (axis 1, capped at 65,535, holds the slices)
  if (tasks == 0) return cudaSuccess;
  if (tasks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return dispatch_wkv7<W>(dtype, precision, [&](auto io_tag, auto w_tag, auto mode) {
    constexpr Precision P = decltype(mode)::value;
    constexpr int kVS = wkv7_chunked_detail::kValueSlice<N, P>;
    wkv7_chunked_detail::chunked_forward_kernel<N, decltype(io_tag), decltype(w_tag), P>
        <<<dim3(unsigned(tasks), N / kVS), wkv7_chunked_detail::kThreads, 0, stream>>>(p);
  });
}

#define ROPEWKV_WKV7_CHUNKED_INSTANTIATE(N)                                                                      \
  template cudaError_t wkv7_chunked_forward<N, DecayStorage::kIO>(DType, Precision, const Wkv7ForwardParams&,      \
                                                                   cudaStream_t);                                 \
  template cudaError_t wkv7_chunked_forward<N, DecayStorage::kFloat32>(DType, Precision, const Wkv7ForwardParams&, \
                                                                        cudaStream_t);

}  // namespace ropewkv::cuda
