#pragma once
// RWKV-7 decay math shared by the CPU twin and the CUDA kernels.
//
// The "raw" (RWKV-LM clampw) decay: log d = -e^{-0.5} * sigmoid(x). Both branches of sigmoid below keep full
// relative precision for any |x| (1/(1+e^{-x}) alone loses it for large negative x, where e^{-x} overflows), and
// sigmoid'(x) = sigmoid(x) * sigmoid(-x) is formed from the same e^{-|x|} as e / (1 + e)^2, never as s * (1 - s).
#include <cmath>

#include "ropewkv/precision.h"

namespace ropewkv {

inline constexpr double kExpMinusHalf = 0.60653065971263342360379953499118;  // e^{-1/2}

template <typename acc_t>
ROPEWKV_HD acc_t exp_(acc_t x) {
  using std::exp;
  return exp(x);
}

// e^x in fp32 on the host: x = n ln2 + r (Cody-Waite, |r| <= ln2/2), Cephes' expf polynomial in fma Horner form,
// times 2^n as two exact powers of two (one rounding, gradual underflow). Branch-free so CPU loops vectorize; NaN
// stays NaN, e^{>88.8} = inf, e^{<-103.9} = 0. The device keeps expf.
inline float exp_poly(float x) {
  x = x < -104.f ? -104.f : (x > 89.f ? 89.f : x);  // the comparisons are false for NaN, which passes through
  const float n = rintf(x * 0x1.715476p+0f);       // x / ln2
  float r = fmaf(-n, 0.693359375f, x);               // Cephes ln2 = C1 + C2, C1 of 9 bits (n * C1 is exact)
  r = fmaf(-n, -2.12194440e-4f, r);
  float p = fmaf(1.9875691500e-4f, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  p = fmaf(p * r, r, r) + 1.f;
  const int32_t ni = int32_t(n == n ? n : 0.f);  // in [-150, 128]
  const int32_t n1 = ni >> 1, n2 = ni - n1;
  return p * bits_as_float(uint32_t(n1 + 127) << 23) * bits_as_float(uint32_t(n2 + 127) << 23);
}

template <>
ROPEWKV_HD float exp_<float>(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return exp_poly(x);
#endif
}

// e^{-|x|} in (0, 1] (NaN stays NaN): sigmoid and its derivative below are formed from it.
template <typename acc_t>
ROPEWKV_HD acc_t exp_minus_abs(acc_t x) {
  return exp_(-(x < acc_t(0) ? -x : x));
}

template <typename acc_t>
ROPEWKV_HD acc_t log_decay_from_raw(acc_t x) {
  const acc_t e = exp_minus_abs(x);
  // sigmoid(x) = 1/(1+e) for x >= 0, e/(1+e) below: relative-precise for any x.
  return -acc_t(kExpMinusHalf) * ((x >= acc_t(0) ? acc_t(1) : e) / (acc_t(1) + e));
}

// d/dx of log_decay_from_raw: -e^{-1/2} sigmoid(x) sigmoid(-x) = -e^{-1/2} e / (1+e)^2 for either sign of x (one
// division; the two sigmoids, each divided, cost two).
template <typename acc_t>
ROPEWKV_HD acc_t log_decay_from_raw_grad(acc_t x) {
  const acc_t e = exp_minus_abs(x), one_plus_e = acc_t(1) + e;
  return -(acc_t(kExpMinusHalf) * e) / (one_plus_e * one_plus_e);
}

}  // namespace ropewkv
