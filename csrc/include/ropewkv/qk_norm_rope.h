#pragma once
// Fused per-head RMSNorm + RoPE of q and k (Qwen3, Gemma-3), shared by the CPU twin and the CUDA kernels (torch-free).
//
// Conventions (python/ropewkv/reference/qk_norm_rope.py is the oracle):
//  - Each head row x of D = head_dim elements: r = 1 / sqrt(sum(x^2) / D + eps) in fp32 (fp64 for fp64 I/O) whatever
//    the precision; n = x r; y = n (weight_offset + w) (Qwen3: offset 0, Gemma-3: offset 1). Without weights
//    (normalize == false) y = x: plain RoPE with this op's cos/sin sources (the vLLM cache among them).
//  - y is then rotated as ropewkv/rope.h defines (pairs, conjugate, tables); dims past rotary_dim keep y.
//  - Precision::kBF16 reproduces HF's eager roundings: Qwen3RMSNorm rounds n to the I/O type and multiplies by the
//    weight in it (offset 0); Gemma3RMSNorm computes n (1 + w) in fp32 and rounds once (offset != 0); then HF's
//    low-precision RoPE (rope.h). In fp32 mode y stays fp32 and the output is rounded once.
//  - The backward is computed in fp32 (fp64 for fp64 I/O) in both modes: dy = R^T g (the conjugate rotation),
//    dw += dy n, dx = r (dy w' - n sum(dy w' n) / D).
//  - cos/sin sources: rope.h's (inv_freq angle, HF table) or a vLLM/FlashInfer cos_sin_cache [max_position, R]
//    (cos half, then sin half) gathered at each token's position, clamped to [0, max_position - 1] so that no
//    position can read outside the cache (the Python layer rejects out-of-range positions on the CPU).
#include <cmath>
#include <cstdint>

#include "ropewkv/precision.h"
#include "ropewkv/rope.h"

namespace ropewkv::qk_norm_rope {

struct Params {
  // q, k ([B, S, H, D] views) and their outputs, rotary_dim, pairs, conjugate, and the angle or HF-table source.
  // In the backward, q/k are the saved inputs and q_out/k_out receive dq/dk.
  rope::Params rope;
  // vLLM cache source (when rope.inv_freq and rope.cos are null): row stride, rows, dtype; positions as in rope.
  const void* cache = nullptr;
  int64_t cache_stride = 0, max_position = 0;
  rope::TableType cache_type = rope::TableType::kFloat32;
  // Norm weights, compute type (fp32, fp64 for fp64 I/O), [head_dim]; both null: no norm.
  const void* q_weight = nullptr;
  const void* k_weight = nullptr;
  float eps = 1e-6f, weight_offset = 0.f;
  // Backward: the cotangents of the outputs ([B, S, H, D] views, stride 1 in the last dim), and the weight-gradient
  // partial sums [n_chunks, head_dim] (compute type), chunk c summing tokens [c, c + 1) * chunk_tokens.
  const void* grad_q = nullptr;
  const void* grad_k = nullptr;
  int64_t gq_stride[3] = {0, 0, 0}, gk_stride[3] = {0, 0, 0};
  void* dq_weight = nullptr;
  void* dk_weight = nullptr;
  int64_t chunk_tokens = 1;

  ROPEWKV_HD bool normalize() const { return q_weight != nullptr; }
};

// Tokens per weight-gradient partial: a function of nothing but this constant, so the reduction order (and the bits
// of dw) never depends on the thread count or the grid.
inline constexpr int64_t kChunkTokens = 16;

// The clamped cache row of a position (no read outside [0, max_position)).
ROPEWKV_HD int64_t cache_row(const Params& p, int64_t pos) {
  return pos < 0 ? 0 : (pos >= p.max_position ? p.max_position - 1 : pos);
}

// cos/sin entries of pair j of the token at (b, s) with position `pos` (rope::table_entry's contract), from any source.
template <typename acc_t, typename tab_t>
ROPEWKV_HD void pair_entry(const Params& p, int64_t b, int64_t s, int64_t pos, int64_t j, tab_t* ca, tab_t* sa,
                           tab_t* cb, tab_t* sb) {
  if (p.cache == nullptr) {
    rope::table_entry<acc_t>(p.rope, b, s, pos, j, ca, sa, cb, sb);
    return;
  }
  const int64_t row = cache_row(p, pos) * p.cache_stride;
  const tab_t c = rope::load_table<tab_t>(p.cache, p.cache_type, row + j);
  const tab_t sn = rope::load_table<tab_t>(p.cache, p.cache_type, row + p.rope.rot_half + j);
  rope::finish_entry<acc_t>(p.rope.conjugate, c, sn, c, sn, ca, sa, cb, sb);
}

// 1 / sqrt(mean square + eps), correctly rounded steps (no rsqrt approximation), in the compute type c_t.
template <typename c_t>
ROPEWKV_HD c_t inv_rms(c_t sum_squares, int64_t head_dim, float eps) {
  return c_t(1) / std::sqrt(sum_squares / c_t(head_dim) + c_t(eps));
}

// The normalised, weighted value y of one element, as a compute-type value (exact in io_t in the low mode): n = x r,
// then n w (rounded as acc_t rounds: HF's Qwen3RMSNorm) or n (offset + w) (one rounding: HF's Gemma3RMSNorm).
template <typename acc_t, typename c_t>
ROPEWKV_HD c_t normed(c_t x, c_t r, c_t w, float offset) {
  const c_t n = x * r;
  return offset == 0.f ? c_t(plain(acc_t(n) * acc_t(w))) : c_t(plain(acc_t(n * (c_t(offset) + w))));
}

// The rotation of one pair (ya, yb) in acc_t arithmetic with finished entries (rope.h's rotate_pair on values).
template <typename acc_t, typename c_t, typename tab_t>
ROPEWKV_HD void rotate_values(c_t ya, c_t yb, tab_t ca, tab_t sa, tab_t cb, tab_t sb, c_t* oa, c_t* ob) {
  const acc_t a = acc_t(ya), b = acc_t(yb);
  *oa = c_t(plain(a * acc_t(ca) - b * acc_t(sa)));
  *ob = c_t(plain(b * acc_t(cb) + a * acc_t(sb)));
}

// dx of one element from dy (the un-rotated cotangent), n = x r, w' = offset + w and dot = sum(dy w' n) over the row.
template <typename c_t>
ROPEWKV_HD c_t norm_input_grad(c_t dy, c_t n, c_t w_eff, c_t r, c_t dot, int64_t head_dim) {
  return r * (dy * w_eff - n * (dot / c_t(head_dim)));
}

}  // namespace ropewkv::qk_norm_rope
