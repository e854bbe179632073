#pragma once
// The host launches of the sequential WKV7 kernels (wkv7_kernels.cuh), instantiated per head size and storage of w by
// wkv7_n*.cu.
#include "wkv7_kernels.cuh"

namespace ropewkv::cuda {

// Calls launch(io_t{}, w_t{}, mode) for the storage types of r..b (named by `dtype`) and of w (named by W) and the
// precision mode (decltype(mode)::value), then returns the launch status. fp32 I/O has no separate fp32-w
// instantiation (that pair is DecayStorage::kIO).
template <DecayStorage W, typename F>
cudaError_t dispatch_wkv7(DType dtype, Precision precision, F&& launch) {
  const auto with_mode = [&](auto io_tag, auto w_tag) {
    if (precision == Precision::kBF16) {
      launch(io_tag, w_tag, std::integral_constant<Precision, Precision::kBF16>{});
    } else {
      launch(io_tag, w_tag, std::integral_constant<Precision, Precision::kFP32>{});
    }
  };
  if constexpr (W == DecayStorage::kIO) {
    return dispatch_io(dtype, [&](auto tag) { with_mode(tag, tag); });
  } else {
    if (dtype == DType::kFloat32) return cudaErrorInvalidValue;
    return dispatch_io(dtype, [&](auto tag) {
      if constexpr (!std::is_same_v<decltype(tag), float>) with_mode(tag, float{});
    });
  }
}

// One launcher per kernel: dtype x w storage x precision dispatch over a 1-D grid of (sequence or batch) x heads
// blocks of THREADS threads.
#define ROPEWKV_WKV7_LAUNCHER(NAME, KERNEL, PARAMS, BLOCKS, THREADS)                                                   \
  template <int N, DecayStorage W>                                                                           \
  cudaError_t NAME(DType dtype, Precision precision, const PARAMS& p, cudaStream_t stream) {                 \
    const int64_t blocks = (BLOCKS);                                                                         \
    if (blocks == 0) return cudaSuccess;                                                                     \
    if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;                                           \
    return dispatch_wkv7<W>(dtype, precision, [&](auto io_tag, auto w_tag, auto mode) {                      \
      wkv7_detail::KERNEL<N, decltype(io_tag), decltype(w_tag), decltype(mode)::value>                        \
          <<<unsigned(blocks), THREADS, 0, stream>>>(p);                                                     \
    });                                                                                                      \
  }

ROPEWKV_WKV7_LAUNCHER(wkv7_forward, forward_kernel, Wkv7ForwardParams, p.size.n_seqs* p.size.heads,
                      wkv7_detail::ForwardLanes<N>::kThreads)
ROPEWKV_WKV7_LAUNCHER(wkv7_backward, backward_kernel, Wkv7BackwardParams, p.size.n_seqs* p.size.heads,
                      wkv7_detail::BackwardLanes<N>::kThreads)
ROPEWKV_WKV7_LAUNCHER(wkv7_step, step_kernel, Wkv7StepParams, p.batch* p.heads, wkv7::StepLanes<N>::kThreads)
#undef ROPEWKV_WKV7_LAUNCHER

#define ROPEWKV_WKV7_INSTANTIATE(N, W)                                                                          \
  template cudaError_t wkv7_forward<N, W>(DType, Precision, const Wkv7ForwardParams&, cudaStream_t);         \
  template cudaError_t wkv7_backward<N, W>(DType, Precision, const Wkv7BackwardParams&, cudaStream_t);       \
  template cudaError_t wkv7_step<N, W>(DType, Precision, const Wkv7StepParams&, cudaStream_t);

}  // namespace ropewkv::cuda
