#pragma once
// RWKV-7 decay math shared by the CPU twin and the CUDA kernels.
//
// The "raw" (RWKV-LM clampw) decay: log d = -e^{-0.5} * sigmoid(x). Both branches of sigmoid below keep full
// relative precision for any |x| (1/(1+e^{-x}) alone loses it for large negative x, where e^{-x} overflows), and
// sigmoid'(x) = sigmoid(x) * sigmoid(-x) is formed the same way, never as s * (1 - s).
#include <cmath>

#include "ropewkv/macros.h"

namespace ropewkv {

inline constexpr double kExpMinusHalf = 0.60653065971263342360379953499118;  // e^{-1/2}

template <typename acc_t>
ROPEWKV_HD acc_t exp_(acc_t x) {
  using std::exp;
  return exp(x);
}

// sigmoid(x) and sigmoid(-x), each relative-precise.
template <typename acc_t>
ROPEWKV_HD void sigmoid_pair(acc_t x, acc_t& pos, acc_t& neg) {
  const acc_t e = exp_(-(x < acc_t(0) ? -x : x));  // e^{-|x|} in (0, 1]; NaN stays NaN
  const acc_t big = acc_t(1) / (acc_t(1) + e);
  const acc_t small = e / (acc_t(1) + e);
  pos = x >= acc_t(0) ? big : small;
  neg = x >= acc_t(0) ? small : big;
}

template <typename acc_t>
ROPEWKV_HD acc_t log_decay_from_raw(acc_t x) {
  acc_t pos, neg;
  sigmoid_pair(x, pos, neg);
  return -acc_t(kExpMinusHalf) * pos;
}

// d/dx of log_decay_from_raw.
template <typename acc_t>
ROPEWKV_HD acc_t log_decay_from_raw_grad(acc_t x) {
  acc_t pos, neg;
  sigmoid_pair(x, pos, neg);
  return -acc_t(kExpMinusHalf) * pos * neg;
}

}  // namespace ropewkv
