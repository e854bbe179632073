#pragma once
// The lane map and per-lane math of the CUDA decode step (csrc/wkv7/wkv7_kernels.cuh, step_kernel), kept here,
// torch- and CUDA-free, so that a host program can replay it exactly (tests/test_wkv7_step_lanes.py).
//
// The step is bound by its state traffic (N*N fp32 read and written per (batch, head)), so the state moves in
// lane-contiguous 16-byte accesses: a block of N*N/32 threads per (batch, head); thread t owns the 4 consecutive
// columns 4 (t % L) .. +3 of kPasses rows, L = N/4 lanes per row (8, 16 or 32: part of one warp). In pass p the
// block reads rows [p R, (p + 1) R), R = N/8, as one contiguous run: thread t's float4 sits at p R N + 4 t. The row
// sums (sa_i = a . S_i, y_i = r . S_i) are a 4-term FMA chain per lane, then an xor-butterfly over the row's L lanes
// (__shfl_xor_sync with masks L/2, ..., 1), which leaves the same sum in each of them.
#include <cmath>

#include "ropewkv/macros.h"

namespace ropewkv::wkv7 {

template <int N>
struct StepLanes {
  static_assert(N % 8 == 0 && N >= 32 && N <= 128, "one row's lanes must fit a warp");
  static constexpr int kThreads = N * N / 32;
  static constexpr int kLanesPerRow = N / 4;
  static constexpr int kRowsPerPass = kThreads / kLanesPerRow;
  static constexpr int kPasses = N / kRowsPerPass;  // 8: each thread moves 8 float4 of state

  ROPEWKV_HD static int col(int t) { return 4 * (t % kLanesPerRow); }
  ROPEWKV_HD static int row(int t, int pass) { return pass * kRowsPerPass + t / kLanesPerRow; }
  // = row(t, pass) * N + col(t): consecutive threads, consecutive 16 bytes.
  ROPEWKV_HD static int offset(int t, int pass) { return pass * kRowsPerPass * N + 4 * t; }
};

// A lane's share of x . y over its 4 columns, as one FMA chain.
ROPEWKV_HD float lane_dot4(const float* x, const float* y) {
  return fmaf(x[3], y[3], fmaf(x[2], y[2], fmaf(x[1], y[1], x[0] * y[0])));
}

// A lane's 4 entries of S_t[i] = S_{t-1}[i] d + sa_i b + v_i k.
ROPEWKV_HD void lane_update4(float* s, const float* d, float sa, const float* b, float v, const float* k) {
  ROPEWKV_SIMD
  for (int q = 0; q < 4; ++q) s[q] = fmaf(v, k[q], fmaf(sa, b[q], s[q] * d[q]));
}

// The device butterfly's result, for the host: partials[l] is lane l's share (l < L); returns the sum every lane
// holds after `for (m = L/2; m > 0; m >>= 1) x += shfl_xor(x, m)`.
template <int L>
inline float butterfly_sum(const float* partials) {
  float x[L];
  for (int l = 0; l < L; ++l) x[l] = partials[l];
  for (int m = L / 2; m > 0; m >>= 1) {
    float next[L];
    for (int l = 0; l < L; ++l) next[l] = x[l] + x[l ^ m];
    for (int l = 0; l < L; ++l) x[l] = next[l];
  }
  return x[0];
}

}  // namespace ropewkv::wkv7
