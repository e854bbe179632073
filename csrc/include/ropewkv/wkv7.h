#pragma once
// RWKV-7 WKV math shared by the CPU twin (csrc/wkv7/wkv7_cpu.cpp) and the CUDA kernels (csrc/wkv7/*.cu).
//
// Per (sequence, head), the state S is N_v x N_k (row i = value index, the RWKV-LM layout):
//   d_t = decay(w_t),  sa_i = sum_j a_j S_{t-1}[i][j],
//   S_t[i][j] = S_{t-1}[i][j] d_j + sa_i b_j + v_i k_j,   y_i = sum_j S_t[i][j] r_j.
// The adjoint step, with G = dL/dS_t (the final-state cotangent carried back, plus y_t's part dy r^T):
//   dr_j = sum_i S_t[i][j] dy_i       dv_i = sum_j G[i][j] k_j      dk_j = sum_i G[i][j] v_i
//   dsa_i = sum_j G[i][j] b_j         db_j = sum_i G[i][j] sa_i     dd_j = sum_i G[i][j] S_{t-1}[i][j]
//   da_j = sum_i S_{t-1}[i][j] dsa_i  dL/dS_{t-1}[i][j] = G[i][j] d_j + dsa_i a_j
//   dw_j = dd_j * d_j * d(log d_j)/dw_j   (the chain rule through the decay convention, in fp32).
// The backward needs S_{t-1} at every step: the forward stores an fp32 checkpoint of S every kCheckpointEvery tokens
// and the backward recomputes the states inside each chunk from its checkpoint (no backstepping, so no division by
// the decay and no error growth when d is small).
//
// Precision. The state, the decay, sa and every sum are fp32 in every mode (fp64 for fp64 I/O): d is often within
// 1e-3 of 1 and S accumulates over thousands of steps, so a bf16 state or decay (8 significand bits) would forget or
// blow up (RWKV-LM: "everything must be in fp32 because w can be very close to 1"). Precision::kBF16 is RWKV-LM's
// bf16 mode: only I/O values pass through bf16 rounding (inputs on load, y and input gradients on store). For bf16
// tensors the two modes therefore coincide; for fp32/fp16 tensors kBF16 reproduces the bf16 kernel's numerics.
// w, the decay input, may come in its own type (fp32 beside bf16 r..b under autocast): it is read at that type, so
// the decay keeps fp32 precision; the bf16 mode rounds it too (RWKV-LM's bf16 kernels take a bf16 w): kDecayMode.
#include <type_traits>

#include "ropewkv/decay.h"
#include "ropewkv/macros.h"
#include "ropewkv/precision.h"

namespace ropewkv::wkv7 {

// The w conventions, numbered as ropewkv.reference.rwkv7.DECAYS.
enum class Decay : int { kLogLog = 0, kRaw = 1, kLog = 2 };

// Tokens between state checkpoints (python/ropewkv/ops/rwkv7/recurrent.py sizes the checkpoint tensor with the same number).
inline constexpr int kCheckpointEvery = 16;

// How the CUDA twin stores w beside r..b: at their type, or fp32 beside fp16/bf16 r..b (autocast keeps the decay
// input fp32). Each is its own kernel instantiation, since a kernel reads w at one compile-time type.
enum class DecayStorage : int { kIO = 0, kFloat32 = 1 };

// The storage of w for (r's dtype, w's dtype), or false for a pair no CUDA kernel reads (e.g. bf16 w beside fp16 r).
inline bool decay_storage_of(DType io, DType w, DecayStorage& storage) {
  if (w == io) {
    storage = DecayStorage::kIO;
    return true;
  }
  if (w == DType::kFloat32) {  // io is fp16 or bf16 here
    storage = DecayStorage::kFloat32;
    return true;
  }
  return false;
}

// Whether the bf16 mode rounds io_t values through bf16: not fp64 (which ignores the mode), not bf16 (exact already).
template <Precision P, typename io_t>
inline constexpr bool kRoundsThroughBF16 =
    P == Precision::kBF16 && !std::is_same_v<io_t, double> && !std::is_same_v<io_t, bf16_t>;

// An I/O value as the kernel sees it: widened, and in the bf16 mode rounded through bf16 first.
template <Precision P, typename io_t>
ROPEWKV_HD compute_t<io_t> load(io_t x) {
  const compute_t<io_t> v = widen(x);
  if constexpr (kRoundsThroughBF16<P, io_t>) return widen(narrow<bf16_t>(v));
  return v;
}

// 4 consecutive I/O values as load() sees them, by one 16-, 8- or 16-byte access (fp32, fp16/bf16): p aligned to 4
// values.
template <Precision P, typename io_t>
ROPEWKV_HD void load4(const io_t* p, compute_t<io_t>* out) {
  struct alignas(4 * sizeof(io_t)) Pack {
    io_t x[4];
  };
  const Pack pack = *reinterpret_cast<const Pack*>(p);
  for (int i = 0; i < 4; ++i) out[i] = load<P>(pack.x[i]);
}

// The mode w (and its gradient) go through when w has its own type: the I/O's, except that fp64 I/O ignores the
// mode (as load and store do for fp64 values).
template <Precision P, typename io_t>
inline constexpr Precision kDecayMode = std::is_same_v<io_t, double> ? Precision::kFP32 : P;

// A computed value stored as an I/O value (through bf16 first in the bf16 mode).
template <typename io_t, Precision P>
ROPEWKV_HD io_t store(compute_t<io_t> x) {
  if constexpr (kRoundsThroughBF16<P, io_t>) return narrow<io_t>(widen(narrow<bf16_t>(x)));
  return narrow<io_t>(x);
}

// log d for each convention.
template <typename acc_t>
ROPEWKV_HD acc_t log_decay(acc_t w, Decay decay) {
  if (decay == Decay::kLogLog) return -exp_(w);
  if (decay == Decay::kRaw) return log_decay_from_raw(w);
  return w;
}

// d(log d)/dw for each convention.
template <typename acc_t>
ROPEWKV_HD acc_t log_decay_grad(acc_t w, Decay decay) {
  if (decay == Decay::kLogLog) return -exp_(w);
  if (decay == Decay::kRaw) return log_decay_from_raw_grad(w);
  return acc_t(1);
}

template <typename acc_t>
ROPEWKV_HD acc_t decay_of(acc_t w, Decay decay) {
  return exp_(log_decay(w, decay));
}

// dL/dw from g = dL/d(log d) as the chunked forms build it (a sum of cumulative-decay cotangents, exact only to ~1e-7
// of their size) and dlog = d(log d)/dw. Only loglog's dlog can fall below -87: it is log d there, so d is under fp32's
// smallest normal and the true gradient, d dL/dd dlog, negligible, while g's rounding times dlog = -e^w (-1e13 at
// w = 30) would reach ~1e7. 0 there, as the sequential forms give (to within 1e-36 of dL/dd).
template <typename acc_t>
ROPEWKV_HD acc_t chunked_w_grad(acc_t g, acc_t dlog) {
  return dlog < acc_t(-87) ? acc_t(0) : g * dlog;
}

template <typename acc_t>
ROPEWKV_HD acc_t dot(const acc_t* x, const acc_t* y, int n) {
  acc_t sum = acc_t(0);
  ROPEWKV_SIMD_SUM(sum)
  for (int j = 0; j < n; ++j) sum += x[j] * y[j];
  return sum;
}

// One token for one state row (row i, value v_i): S[i][:] becomes S_t[i][:]; returns y_i, and sa_i through `sa`.
template <typename acc_t>
ROPEWKV_HD acc_t step_row(acc_t* row, int n, const acc_t* r, const acc_t* d, const acc_t* k, const acc_t* a,
                          const acc_t* b, acc_t v_i, acc_t& sa) {
  sa = dot(a, row, n);
  acc_t y = acc_t(0);
  ROPEWKV_SIMD_SUM(y)
  for (int j = 0; j < n; ++j) {
    const acc_t s = row[j] * d[j] + sa * b[j] + v_i * k[j];
    row[j] = s;
    y += s * r[j];
  }
  return y;
}

// Adjoint, row i of G = dL/dS_t: adds y_t's part dy_i r, then gives dv_i and dsa_i.
template <typename acc_t>
ROPEWKV_HD void adjoint_row_output(acc_t* g_row, int n, acc_t dy_i, const acc_t* r, const acc_t* k, const acc_t* b,
                                   acc_t& dv_i, acc_t& dsa_i) {
  ROPEWKV_SIMD
  for (int j = 0; j < n; ++j) g_row[j] += dy_i * r[j];
  dv_i = dot(g_row, k, n);
  dsa_i = dot(g_row, b, n);
}

// Adjoint, row i: G[i][:] becomes dL/dS_{t-1}[i][:] = G[i][:] d + dsa_i a.
template <typename acc_t>
ROPEWKV_HD void adjoint_row_propagate(acc_t* g_row, int n, const acc_t* d, acc_t dsa_i, const acc_t* a) {
  ROPEWKV_SIMD
  for (int j = 0; j < n; ++j) g_row[j] = g_row[j] * d[j] + dsa_i * a[j];
}

// The token range [start, end) and batch row of sequence s: with cu_seqlens (B == 1) the packed sequence s, else
// batch row s. Clamped into [0, T] so that bad offsets can never index out of bounds (Python validates them).
template <typename int_t>
ROPEWKV_HD void sequence_range(const int_t* cu_seqlens, int64_t s, int64_t seqlen, int64_t& batch, int64_t& start,
                               int64_t& end) {
  if (cu_seqlens == nullptr) {
    batch = s;
    start = 0;
    end = seqlen;
    return;
  }
  batch = 0;
  start = int64_t(cu_seqlens[s]);
  end = int64_t(cu_seqlens[s + 1]);
  start = start < 0 ? int64_t(0) : (start > seqlen ? seqlen : start);
  end = end < start ? start : (end > seqlen ? seqlen : end);
}

// The first token of the chunk that holds token p of a sequence starting at `start`: chunks are aligned to
// multiples of kCheckpointEvery in the (packed) time axis, and the checkpoint of chunk start q > start is slot
// q / kCheckpointEvery.
ROPEWKV_HD int64_t chunk_start(int64_t p, int64_t start) {
  const int64_t aligned = p - p % kCheckpointEvery;
  return aligned > start ? aligned : start;
}

}  // namespace ropewkv::wkv7
