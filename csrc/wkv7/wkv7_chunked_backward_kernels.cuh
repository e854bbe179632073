#pragma once
// CUDA kernels of the chunked WKV7 backward (ropewkv::wkv7_chunked_backward), from python/ropewkv/ops/rwkv7/
// chunked.md, "Backward, one chunk" (its symbols below), in two launches as the Triton twin's:
// 1. chunked_state_cotangent_kernel, a block per (sequence, head, slice of VS value rows), walks each sequence's
//    chunks in reverse carrying the slice's rows of G = dL/dS in registers (as the forward's SimtSlice, or MmaSlice
//    in precision="bf16"):
//      G <- G diag(E(L, 0)) + (G B^^T) W + dY^T R',   W = (I - Ab)^{-1} A~,  R' = R~ + Qb W
//    (the forward's state step with other matrices), and stores the G before every chunk that starts past its
//    sequence's start (slot q / 16, shaped as the checkpoints) and before the first (the initial state's gradient).
// 2. chunked_gradients_kernel, a block per (16-token window of the packed time axis, head), forms the input gradients
//    of the chunk (or, with cu_seqlens, of each sequence's piece) in that window from its S_0 (the forward's
//    checkpoint, or the initial state) and the G after it (pass 1's next slot, or the final state's cotangent):
//    every chunk at once.
// Chunks, rows past a chunk and the v-independent part (loads, decays, masked products, scaled rows) are the
// forward's (wkv7_chunked_kernels.cuh). Math in fp32 FMAs, except that in precision="bf16" (which rounds the I/O as
// everywhere) pass 1's state step and the gradients kernel's row products, substitutions (through T = (I - Ab)^{-1},
// as the forward's step) and contractions over v run on bf16 tensor cores with the forward's hi/lo split; nothing is
// divided, and every decay between two positions is a running product over that range.
#include "wkv7_chunked_kernels.cuh"

// The block's dynamic shared memory (16-byte aligned, sized at launch): the gradients kernel's passes need more than
// the 48 KB of static shared memory. The host emulator of CUDA blocks defines its own (tests/data/host_cuda).
#ifndef ROPEWKV_DYNAMIC_SHARED
#define ROPEWKV_DYNAMIC_SHARED(name) extern __shared__ float4 name[]
#endif

namespace ropewkv::cuda {
namespace wkv7_chunked_detail {

// W = (I - Ab)^{-1} A~ and R' = R~ + Qb W in place of A~ and R~, column j: forward substitution, no division.
template <int N>
__device__ __forceinline__ void substitute_rows(Shared<N>& sm, int j) {
  float w[kL];
#pragma unroll
  for (int l = 0; l < kL; ++l) {
    float sum = sm.a[l][j];
#pragma unroll
    for (int m = 0; m < l; ++m) sum = fmaf(sm.Ab[l][m], w[m], sum);
    w[l] = sum;
    sm.a[l][j] = sum;
  }
#pragma unroll
  for (int l = 0; l < kL; ++l) {
    float sum = sm.r[l][j];
#pragma unroll
    for (int m = 0; m <= l; ++m) sum = fmaf(sm.Qb[l][m], w[m], sum);
    sm.r[l][j] = sum;
  }
}

// precision="fp32": the slice's rows of dY over a chunk, [row][chunk row], rows kL + 1 apart (the lanes of a warp
// read one chunk row of 16 value rows on distinct banks). Staged in shared memory while the chunk is prepared, not
// held in each thread's registers through it (as the forward's SimtSlice::vv holds V): those 16 registers took
// pass 1 past the 128 that 4 blocks per SM allow.
template <int VS>
using RowsOfChunk = float[VS][kL + 1];

// Where that fits the 48 KB of static shared memory a block may declare beside the chunk's Shared: N <= 64 (at
// N = 128 Shared alone takes 47 KB, and pass 1 keeps dY in registers, as the forward keeps V: SimtSlice::vv).
template <int N, int VS>
inline constexpr bool kStagesDy = sizeof(Shared<N>) + sizeof(RowsOfChunk<VS>) <= 48 * 1024;

// The thread's value row of x (token rows [q, q + len), zeros past len) into its row of rows (g.vi % VS: the
// slice's first row is a multiple of VS), each of the row's kSegs threads taking every kSegs-th chunk row.
template <int N, int VS, typename io_t, Precision P>
__device__ __forceinline__ void stage_rows(RowsOfChunk<VS>& rows, const SimtSlice<N, VS, io_t, P>& g, const io_t* x,
                                           TokenIndex at, int64_t q, int len) {
  constexpr int kSegs = SimtSlice<N, VS, io_t, P>::kSegs;
#pragma unroll
  for (int i = 0; i < kL / kSegs; ++i) {
    const int l = i * kSegs + g.seg;
    const float value = wkv7::load<P>(x[at.clamped(q, l, len) + g.vi]);
    rows[g.vi % VS][l] = l < len ? value : 0.f;
  }
}

// One chunk of pass 1 for the thread's row of G (g.st; dY[:, g.vi] in dy[g.vi % VS], or in g.vv where dY is not
// staged): Z^T = G B^^T, then
// G <- G diag(E(L, 0)) + Z^T W + dY^T R' (sm.a = W, sm.r = R').
template <int N, int VS, typename io_t, Precision P>
__device__ __forceinline__ void cotangent_step(SimtSlice<N, VS, io_t, P>& g, const Shared<N>& sm,
                                               const RowsOfChunk<VS>& dy) {
  using Slice = SimtSlice<N, VS, io_t, P>;
  float z[kL];
#pragma unroll
  for (int l = 0; l < kL; ++l) z[l] = 0.f;
#pragma unroll
  for (int c = 0; c < Slice::kGroups; ++c) {
#pragma unroll
    for (int l = 0; l < kL; ++l) {
      const Float4 bh = load4(&sm.b[l][g.col(c, 0)]);
#pragma unroll
      for (int e = 0; e < 4; ++e) z[l] = fmaf(bh.x[e], g.st[c][e], z[l]);
    }
  }
#pragma unroll
  for (int l = 0; l < kL; ++l) z[l] = lane_sum<Slice::kVPerWarp, 32>(z[l]);
#pragma unroll
  for (int c = 0; c < Slice::kGroups; ++c) {
    const Float4 decay_all = load4(&sm.decay_all[g.col(c, 0)]);
#pragma unroll
    for (int e = 0; e < 4; ++e) g.st[c][e] *= decay_all.x[e];
  }
#pragma unroll
  for (int l = 0; l < kL; ++l) {
    const float dy_l = kStagesDy<N, VS> ? dy[g.vi % VS][l] : g.vv[l];
#pragma unroll
    for (int c = 0; c < Slice::kGroups; ++c) {
      const Float4 w = load4(&sm.a[l][g.col(c, 0)]), rp = load4(&sm.r[l][g.col(c, 0)]);
#pragma unroll
      for (int e = 0; e < 4; ++e) g.st[c][e] = fmaf(z[l], w.x[e], fmaf(dy_l, rp.x[e], g.st[c][e]));
    }
  }
}

// The same in precision="bf16", on tensor cores: the forward's MmaSlice step with (U, B^, V, K^) -> (Z, W, dY, R')
// (slice.vt holds dY^T, exact in bf16 in this mode; G, Z and the shared operands split into hi/lo).
template <int N, int VS, typename io_t, Precision P>
__device__ __forceinline__ void cotangent_step(MmaSlice<N, VS, io_t, P>& slice, const Shared<N>& sm) {
  using Slice = MmaSlice<N, VS, io_t, P>;
  if (!slice.active) return;
  // Z^T = G B^^T.
  float z[1][2][4] = {};
  slice.template state_times_transposed<1>(z, {sm.b});
  // G <- G diag(E(L, 0)) + Z^T W + dY^T R'.
  uint32_t z_hi[4], z_lo[4];
  a_fragment(z[0][0], z[0][1], z_hi, z_lo);
  slice.update_state(sm, z_hi, z_lo, sm.a, sm.r);
}

// The blocks per SM that pass 1's __launch_bounds__ asks for (0: left to ptxas): 4 at N = 64 with bf16 I/O, which
// then fits 128 registers without spilling (dY staged in shared memory; the fp32 mode took 168 left to itself: 3
// blocks per SM, B8 H64's 512 blocks in 2 waves; 4 run them in one, which halves the chain's upper bound). At 128
// registers fp16 and fp32 I/O spilled 40-92 B (the fp32 mode), N = 128 80-184 B; N = 32 fits 4 blocks unasked.
template <int N, typename io_t>
inline constexpr int kStatePassMinBlocks = N == 64 && std::is_same_v<io_t, bf16_t> ? 4 : 0;

template <int N, typename io_t, typename w_t, Precision P>
__global__ void __launch_bounds__(kThreads, kStatePassMinBlocks<N, io_t>)
    chunked_state_cotangent_kernel(const Wkv7BackwardParams p) {
  constexpr int VS = kValueSlice<N, P>;  // the launch's grid axis 1 holds N / VS slices
  using Slice = std::conditional_t<P == Precision::kBF16, MmaSlice<N, VS, io_t, P>, SimtSlice<N, VS, io_t, P>>;
  __shared__ Shared<N> sm;
  const int t = threadIdx.x;
  const int64_t task = blockIdx.x;  // = s * heads + h
  TokenIndex at{0, p.size.seqlen, p.size.heads, task % p.size.heads, N};
  int64_t start, stop;
  wkv7::sequence_range(p.size.cu_seqlens, task / p.size.heads, p.size.seqlen, at.batch, start, stop);
  constexpr int64_t kNN = int64_t(N) * N;

  Slice g(t, int(blockIdx.y) * VS);  // the slice's rows of G (st) and, in precision="bf16", of dY (vt)
  __shared__ RowsOfChunk<VS> dy;  // precision="fp32" where kStagesDy: the slice's rows of dY
  const io_t* gy = static_cast<const io_t*>(p.grad_y);
  g.load_initial(p.grad_final_state ? p.grad_final_state + task * kNN : nullptr);
  for (int64_t chunk_end = stop; chunk_end > start;) {
    const int64_t q = wkv7::chunk_start(chunk_end - 1, start);
    const int len = int(chunk_end - q);
    prepare_chunk<N, io_t, w_t, P>(sm, p, at, q, len, t, [&] {
      if constexpr (P == Precision::kFP32 && kStagesDy<N, VS>) {
        stage_rows(dy, g, gy, at, q, len);
      } else {
        g.load_values(gy, at, q, len);
      }
    });
    if (t < N) substitute_rows(sm, t);  // the column scale_rows gave this thread
    __syncthreads();
    if constexpr (P == Precision::kBF16) {
      cotangent_step(g, sm);
    } else {
      cotangent_step(g, sm, dy);
    }
    if (q > start) g.store_checkpoint(p.scratch + chunk_slot(p.size, at, q) * kNN);  // G before the chunk, k-major
    chunk_end = q;
  }
  g.store_final(p.grad_initial_state + task * kNN);
}

// Pass 2 takes a chunk's value rows kRows at a time (its S_0 and G rows in shared memory): 32, or 16 at N = 128.
// Row-wise work: a thread per value row and segment of k, the row's kSegs threads adjacent lanes.
template <int N>
struct GradientRows {
  static constexpr int kRows = N == 128 ? 16 : 32;
  static constexpr int kSegs = kThreads / kRows;
  static constexpr int kGroups = N / (4 * kSegs);  // 4-column groups of k per thread
  // row_products' unroll over them: by 2 at N = 128, where in full the fp32-mode gradients kernel spilled 8 B.
  static constexpr int kGroupUnroll = N == 128 ? 2 : kGroups;
  static_assert(kGroups * 4 * kSegs == N && kSegs <= 32, "a row's threads take whole 4-column groups in one warp");
  // Rows kRow floats apart: N + 16 where a quarter warp (8 lanes, 16-byte loads) spans two rows (kSegs = 4), so that
  // their 4-column groups fall on distinct banks.
  static constexpr int kRow = kSegs == 4 ? N + 16 : N + 4;
  // Contractions over v into [L][N] (thread per 4-column group of k and kLq chunk rows) and into [L][L] (thread per
  // chunk row and pair of columns).
  static constexpr int kQuads = N / 4;
  static constexpr int kLq = kL * kQuads / kThreads;
  static_assert(kLq * kThreads == kL * kQuads && kL * kL == 2 * kThreads, "whole contraction tiles per thread");
};

template <int N>
struct GradientShared {
  using Rows = GradientRows<N>;
  static constexpr int kRows = Rows::kRows;
  Shared<N> chunk;
  alignas(16) float s0[kRows][Rows::kRow], g[kRows][Rows::kRow];  // the pass's rows of S_0 and G, [v][k]
  // [value row][chunk row]: U, dX, dY, V of the pass's rows (U and dX before their substitutions, first), and K^ G^T
  // for the substitutions. Rows kL + 1 floats apart: a lane per row walks them without bank conflicts.
  static constexpr int kRowL = kL + 1;
  float u[kRows][kRowL], dx[kRows][kRowL], dy[kRows][kRowL], v[kRows][kRowL], dv[kRows][kRowL];
  // Summed over the passes: dA~, dR~, dB^, dK^, the masked products' cotangents, sum_v S_0 G per k. Rows N + 8
  // apart: the tensor-core contraction's 8-byte accesses to rows g = 0..7 then fall on distinct banks.
  static constexpr int kSumRow = N + 8;
  alignas(16) float dA[kL][kSumRow], dR[kL][kSumRow], dB[kL][kSumRow], dK[kL][kSumRow];
  alignas(16) float dAb[kL][kL], dAk[kL][kL], dQb[kL][kL], dQk[kL][kL];
  alignas(16) float de[N];
};

// kCount values of a state's value row into dst[vi][k0 + kStep i] from src[i kStep kKStep]: compile-time strides, so
// that each load is one instruction at an immediate offset (a runtime stride took ~8 per value to form addresses).
template <int kKStep, int kStep, int kCount, int kRows, int kStride>
__device__ __forceinline__ void copy_state_row(float (&dst)[kRows][kStride], const float* src, int vi, int k0) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) dst[vi][k0 + kStep * i] = src[i * kStep * kKStep];
}

// Rows v_first .. v_first + kRows of an N x N state into dst[v][k]: from a k-major slot (checkpoints, pass 1's G;
// adjacent threads read adjacent floats), a row-major state (the initial state, the final state's cotangent: a
// sequence's first and last chunk) or zeros (src null). A thread keeps one value row and steps along k (no division
// per element: with one, forming each address took ~20 instructions).
template <int N, int kRows, int kStride>
__device__ __forceinline__ void load_state_rows(float (&dst)[kRows][kStride], const float* src, bool k_major,
                                                int v_first, int t) {
  static_assert(kThreads % kRows == 0, "a thread's loads stay in its value row");
  constexpr int kStep = kThreads / kRows;  // k columns between a thread's loads
  const int vi = t % kRows, k0 = t / kRows;
  if (src == nullptr) {
#pragma unroll
    for (int i = 0; i < N / kStep; ++i) dst[vi][k0 + kStep * i] = 0.f;
  } else if (k_major) {
    copy_state_row<N, kStep, N / kStep>(dst, src + (v_first + vi) + k0 * N, vi, k0);
  } else {
    copy_state_row<1, kStep, N / kStep>(dst, src + (v_first + vi) * N + k0, vi, k0);
  }
}

// f(vi, l) for each of the pass's value rows vi and chunk rows l, adjacent threads on adjacent rows (coalesced [B, T,
// H, N] accesses).
template <int N, typename F>
__device__ __forceinline__ void for_rows_and_tokens(int t, F&& f) {
  constexpr int kRows = GradientRows<N>::kRows;
#pragma unroll
  for (int i = 0; i < kRows * kL / kThreads; ++i) f((t + kThreads * i) % kRows, (t + kThreads * i) / kRows);
}

// out[l] = sum_k M[l][k] row[k] for a value row: the row's kSegs lanes (seg) take 4-column groups of k, then sum.
// One product at a time: three at once held 48 sums and spilled.
template <int N>
__device__ __forceinline__ void row_products(const float* row, const float (&M)[kL][Shared<N>::kRow], float* out,
                                             int seg) {
  using Rows = GradientRows<N>;
  float sum[kL] = {};
#pragma unroll Rows::kGroupUnroll
  for (int grp = 0; grp < Rows::kGroups; ++grp) {
    const int k0 = 4 * (Rows::kSegs * grp + seg);
    const Float4 x = load4(row + k0);
#pragma unroll
    for (int l = 0; l < kL; ++l) {
      const Float4 m = load4(&M[l][k0]);
#pragma unroll
      for (int e = 0; e < 4; ++e) sum[l] = fmaf(m.x[e], x.x[e], sum[l]);
    }
  }
#pragma unroll
  for (int l = 0; l < kL; ++l) {
    sum[l] = lane_sum<1, Rows::kSegs>(sum[l]);
    if (l % Rows::kSegs == seg) out[l] = sum[l];
  }
}

// precision="bf16": the row products and the contractions over v on tensor cores (mma.sync m16n8k16, bf16 operands,
// fp32 accumulate; ropewkv/mma_bf16.cuh, lane = 4 g + tq), every fp32 operand split into hi/lo bf16 (three
// products), V and dY exact in bf16 in this mode (one part).

// The [v][l] block rows v0 .. v0 + 15 of X ([value row][chunk row] in shared memory) as two C tiles (element i: row
// v0 + g + 8 (i / 2), column 8 nt + 2 tq + i % 2), and back.
template <int kRowL>
__device__ __forceinline__ void load_tiles(const float (*X)[kRowL], int v0, int g, int tq, float (&d)[2][4]) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) d[nt][i] = X[v0 + g + 8 * (i / 2)][8 * nt + 2 * tq + i % 2];
}
template <int kRowL>
__device__ __forceinline__ void store_tiles(float (*X)[kRowL], int v0, int g, int tq, const float (&d)[2][4]) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) X[v0 + g + 8 * (i / 2)][8 * nt + 2 * tq + i % 2] = d[nt][i];
}

// The A fragment of rows v0 .. v0 + 15 of X, exact in bf16 (dY, V in this mode): register i = X[v0 + g + 8 (i % 2)]
// [2 tq + 8 (i / 2), + 1].
template <int kRowL>
__device__ __forceinline__ void exact_fragment(const float (*X)[kRowL], int v0, int g, int tq, uint32_t (&a)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float* x = &X[v0 + g + 8 * (i % 2)][2 * tq + 8 * (i / 2)];
    a[i] = mma::pack_bf16x2(x[0], x[1]);
  }
}

// U0 = S_0 A~^T, B^ G^T and K^ G^T for the pass's value rows, as [v][l] products (M = 16 value rows, N = 8 chunk
// rows, K = 16 columns of k) into sm.u, sm.dx and sm.dv: a job per 16 value rows and product, the warps in turn.
template <int N>
__device__ __forceinline__ void row_products_mma(GradientShared<N>& sm, int t) {
  constexpr int kMTiles = GradientRows<N>::kRows / 16;
  const int g = t % 32 / 4, tq = t % 4;
  const Shared<N>& c = sm.chunk;
#pragma unroll 1
  for (int job = t / 32; job < 3 * kMTiles; job += kThreads / 32) {
    const int v0 = 16 * (job % kMTiles), product = job / kMTiles;
    const auto& rows = product == 0 ? sm.s0 : sm.g;
    const auto& M = product == 0 ? c.a : product == 1 ? c.b : c.k;
    auto& out = product == 0 ? sm.u : product == 1 ? sm.dx : sm.dv;
    float d[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
      uint32_t a_hi[4], a_lo[4];  // A register i: rows[v0 + g + 8 (i % 2)][16 kk + 2 tq + 8 (i / 2), + 1]
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const mma::Split x = split2(&rows[v0 + g + 8 * (i % 2)][16 * kk + 2 * tq + 8 * (i / 2)]);
        a_hi[i] = x.hi, a_lo[i] = x.lo;
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        uint32_t b_hi[2], b_lo[2];  // B register h: M[8 nt + g][16 kk + 2 tq + 8 h, + 1]
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const mma::Split m = split2(&M[8 * nt + g][16 * kk + 2 * tq + 8 * h]);
          b_hi[h] = m.hi, b_lo[h] = m.lo;
        }
        mma::mma_split(d[nt], a_hi, a_lo, b_hi, b_lo);
      }
    }
    store_tiles(out, v0, g, tq, d);
  }
}

// The contractions over the pass's value rows (K = 16 value rows a step), added to the sums in shared memory (set on
// the first pass): dA~ += dX^T S_0, dR~ += dY^T S_0, dB^ += U^T G, dK^ += V^T G ([L][N], warp w the 8-column tiles
// w, w + 4, ...), and warp w's one of dQb = dY^T U, dQk = dY^T V, dAb = dX^T U, dAk = dX^T V ([L][L]). The A
// fragments of every step first, then a tile at a time (at N = 128, all tiles' sums at once spilled). sum_v S_0 G per
// k stays on the FMA pipes (threads t < N).
template <int N>
__device__ __forceinline__ void contract_rows_mma(GradientShared<N>& sm, bool first, int t) {
  constexpr int kWarps = kThreads / 32, kTiles = N / 8 / kWarps, kSteps = GradientRows<N>::kRows / 16;
  static_assert(kWarps == 4 && kTiles * kWarps * 8 == N, "four warps: one [L][L] product each, whole column tiles");
  const int warp = t / 32, g = t % 32 / 4, tq = t % 4;
  // A fragments of dX^T, U^T (split) and dY^T, V^T (exact), register i: [l = g + 8 (i % 2)][v, v + 1], v =
  // 16 step + 2 tq + 8 (i / 2).
  uint32_t dx_hi[kSteps][4], dx_lo[kSteps][4], u_hi[kSteps][4], u_lo[kSteps][4], dy[kSteps][4], vv[kSteps][4];
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int l = g + 8 * (i % 2), v = 16 * ks + 2 * tq + 8 * (i / 2);
      const mma::Split x = mma::split_bf16x2(sm.dx[v][l], sm.dx[v + 1][l]);
      const mma::Split u = mma::split_bf16x2(sm.u[v][l], sm.u[v + 1][l]);
      dx_hi[ks][i] = x.hi, dx_lo[ks][i] = x.lo, u_hi[ks][i] = u.hi, u_lo[ks][i] = u.lo;
      dy[ks][i] = mma::pack_bf16x2(sm.dy[v][l], sm.dy[v + 1][l]);
      vv[ks][i] = mma::pack_bf16x2(sm.v[v][l], sm.v[v + 1][l]);
    }
  // C tile element i: row g + 8 (i / 2), the tile's column 2 tq + i % 2.
  float(*sums[4])[GradientShared<N>::kSumRow] = {sm.dA, sm.dR, sm.dB, sm.dK};
#pragma unroll
  for (int n = 0; n < kTiles; ++n) {
    const int k0 = 8 * (warp + kWarps * n);
    float acc[4][4];
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[s][i] = first ? 0.f : sums[s][g + 8 * (i / 2)][k0 + 2 * tq + i % 2];
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
      uint32_t s_hi[2], s_lo[2], g_hi[2], g_lo[2];  // B fragments of S_0, G, register h: [v, v + 1][k0 + g]
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int v = 16 * ks + 2 * tq + 8 * h;
        const mma::Split s0 = mma::split_bf16x2(sm.s0[v][k0 + g], sm.s0[v + 1][k0 + g]);
        const mma::Split gv = mma::split_bf16x2(sm.g[v][k0 + g], sm.g[v + 1][k0 + g]);
        s_hi[h] = s0.hi, s_lo[h] = s0.lo, g_hi[h] = gv.hi, g_lo[h] = gv.lo;
      }
      mma::mma_split(acc[0], dx_hi[ks], dx_lo[ks], s_hi, s_lo);
      mma::mma_exact_a(acc[1], dy[ks], s_hi, s_lo);
      mma::mma_split(acc[2], u_hi[ks], u_lo[ks], g_hi, g_lo);
      mma::mma_exact_a(acc[3], vv[ks], g_hi, g_lo);
    }
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) sums[s][g + 8 * (i / 2)][k0 + 2 * tq + i % 2] = acc[s][i];
  }
  // The warp's [L][L] product, B = U (split: warps 0, 2) or V (exact: warps 1, 3), register h: [v, v + 1][m].
  float(*masked)[kL] = warp == 0 ? sm.dQb : warp == 1 ? sm.dQk : warp == 2 ? sm.dAb : sm.dAk;
  const auto& B = warp % 2 == 0 ? sm.u : sm.v;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int m = 8 * nt + g;
    float mm[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) mm[i] = first ? 0.f : masked[g + 8 * (i / 2)][8 * nt + 2 * tq + i % 2];
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
      uint32_t b_hi[2], b_lo[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int v = 16 * ks + 2 * tq + 8 * h;
        const mma::Split b = mma::split_bf16x2(B[v][m], B[v + 1][m]);
        b_hi[h] = b.hi, b_lo[h] = b.lo;
      }
      if (warp == 0) {
        mma::mma_exact_a(mm, dy[ks], b_hi, b_lo);
      } else if (warp == 1) {
        mma::mma_bf16(mm, dy[ks], b_hi);
      } else if (warp == 2) {
        mma::mma_split(mm, dx_hi[ks], dx_lo[ks], b_hi, b_lo);
      } else {
        mma::mma_bf16(mm, dx_lo[ks], b_hi);
        mma::mma_bf16(mm, dx_hi[ks], b_hi);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) masked[g + 8 * (i / 2)][8 * nt + 2 * tq + i % 2] = mm[i];
  }
  if (t < N) {
    float de = first ? 0.f : sm.de[t];
#pragma unroll
    for (int v = 0; v < GradientRows<N>::kRows; ++v) de = fmaf(sm.s0[v][t], sm.g[v][t], de);
    sm.de[t] = de;
  }
}

// precision="bf16": the substitutions as [16][16] products on tensor cores with T = (I - Ab)^{-1} (sm.chunk.T), per
// 16 value rows: U^T = (U0^T + V^T Ak^T) T^T (the forward's step), dU^T = dU0^T + dY^T Qb, dX^T = dU^T T and
// dV^T = dV0^T + dY^T Qk + dX^T Ak; U0, dU0, dV0 (row_products_mma) in, U and dX out in place, dV stored. A warp per
// job (16 value rows, U or dX and dV), the warps in turn.
template <int N, typename io_t, Precision P>
__device__ __forceinline__ void substitutions_mma(GradientShared<N>& sm, io_t* gv, TokenIndex at, int64_t q, int len,
                                                  int v_first, int t) {
  constexpr int kMTiles = GradientRows<N>::kRows / 16;
  const int g = t % 32 / 4, tq = t % 4;
  const Shared<N>& c = sm.chunk;
#pragma unroll 1
  for (int job = t / 32; job < 2 * kMTiles; job += kThreads / 32) {
    const int v0 = 16 * (job % kMTiles);
    if (job < kMTiles) {
      float x[2][4], u[2][4] = {};
      uint32_t vt[4];
      load_tiles(sm.u, v0, g, tq, x);
      exact_fragment(sm.v, v0, g, tq, vt);
      substitute_u_mma(x, vt, c, g, tq, u);
      store_tiles(sm.u, v0, g, tq, u);
    } else {
      float du[2][4], dx[2][4] = {}, dv[2][4];
      uint32_t dy[4], hi[4], lo[4];
      load_tiles(sm.dx, v0, g, tq, du);
      load_tiles(sm.dv, v0, g, tq, dv);
      exact_fragment(sm.dy, v0, g, tq, dy);
      add_times_masked<false, false>(du, dy, nullptr, c.Qb, g, tq);
      add_times_masked<false, false>(dv, dy, nullptr, c.Qk, g, tq);
      a_fragment(du[0], du[1], hi, lo);
      add_times_masked<false, false>(dx, hi, &lo, c.T, g, tq);
      store_tiles(sm.dx, v0, g, tq, dx);
      a_fragment(dx[0], dx[1], hi, lo);
      add_times_masked<false, true>(dv, hi, &lo, c.Ak, g, tq);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int l = 8 * nt + 2 * tq + i % 2;
          if (l < len) gv[at(q + l) + v_first + v0 + g + 8 * (i / 2)] = wkv7::store<io_t, P>(dv[nt][i]);
        }
    }
  }
}

// x[l] += sum_{m >= l} M[m][l] dy[m] for one value row (Qb^T dY, Qk^T dY), rows of M read 4 entries at a time.
__device__ __forceinline__ void add_transposed_times(float (&x)[kL], const float (&M)[kL][kL], const float* dy) {
#pragma unroll
  for (int m = kL - 1; m >= 0; --m) {
    const float y = dy[m];
#pragma unroll
    for (int l4 = 0; l4 <= m; l4 += 4) {
      const Float4 row = load4(&M[m][l4]);
#pragma unroll
      for (int e = 0; e < 4 && l4 + e <= m; ++e) x[l4 + e] = fmaf(row.x[e], y, x[l4 + e]);
    }
  }
}

// The row-wise part: U = (I - Ab)^{-1} (A~ S_0^T + Ak V), dU = B^ G^T + Qb^T dY, dX = (I - Ab)^{-T} dU (back
// substitution), dV = K^ G^T + Qk^T dY + Ak^T dX; dv stored, U and dX into shared memory for the contractions.
// First the products with S_0 and G (thread: value row vi, segment seg of k), then the substitutions with a lane per
// value row: U in warp 0, dU, dX and dV's Ak^T dX in warp 1, dV's K^ G^T + Qk^T dY in warp 2 beside it (on every
// row's lanes instead, each warp issued all for its rows, at 4 x the cost). precision="bf16": both on tensor cores
// (row_products_mma, substitutions_mma).
template <int N, typename io_t, Precision P>
__device__ __forceinline__ void row_gradients(GradientShared<N>& sm, io_t* gv, TokenIndex at, int64_t q, int len,
                                              int v_first, int t) {
  using Rows = GradientRows<N>;
  constexpr int kSegs = Rows::kSegs;
  static_assert(Rows::kRows <= 32 && kThreads >= 96, "a lane per value row in each of three warps");
  const Shared<N>& c = sm.chunk;
  if constexpr (P == Precision::kBF16) {
    row_products_mma(sm, t);
    __syncthreads();
    substitutions_mma<N, io_t, P>(sm, gv, at, q, len, v_first, t);
    return;
  } else {
    const int vi = t / kSegs, seg = t % kSegs;
    row_products<N>(sm.s0[vi], c.a, sm.u[vi], seg);  // A~ S_0^T
    row_products<N>(sm.g[vi], c.b, sm.dx[vi], seg);  // B^ G^T
    row_products<N>(sm.g[vi], c.k, sm.dv[vi], seg);  // K^ G^T
  }
  __syncthreads();
  const int vi = t % 32, warp = t / 32;
  const bool has_row = vi < Rows::kRows;
  float dv[kL] = {};  // warp 1: the Ak^T dX part of dV
  if (has_row && warp == 0) {
    float u[kL], vv[kL];
#pragma unroll
    for (int l = 0; l < kL; ++l) {
      u[l] = sm.u[vi][l];
      vv[l] = sm.v[vi][l];
    }
    substitute_u(u, vv, c);  // the forward's
#pragma unroll
    for (int l = 0; l < kL; ++l) sm.u[vi][l] = u[l];
  } else if (has_row && warp == 1) {
    // dU = B^ G^T + Qb^T dY, then back substitution, rows m of Ab, Ak descending: dX[m] is complete once the later
    // rows' terms are in.
    float dx[kL];
#pragma unroll
    for (int l = 0; l < kL; ++l) dx[l] = sm.dx[vi][l];
    add_transposed_times(dx, c.Qb, sm.dy[vi]);
#pragma unroll
    for (int m = kL - 1; m >= 0; --m) {
#pragma unroll
      for (int l4 = 0; l4 < m; l4 += 4) {
        const Float4 ab = load4(&c.Ab[m][l4]), ak = load4(&c.Ak[m][l4]);
#pragma unroll
        for (int e = 0; e < 4 && l4 + e < m; ++e) {
          dx[l4 + e] = fmaf(ab.x[e], dx[m], dx[l4 + e]);
          dv[l4 + e] = fmaf(ak.x[e], dx[m], dv[l4 + e]);
        }
      }
      sm.dx[vi][m] = dx[m];
    }
  } else if (has_row && warp == 2) {
    // dV's other part, K^ G^T + Qk^T dY, in place, beside warp 1.
    float w[kL];
#pragma unroll
    for (int l = 0; l < kL; ++l) w[l] = sm.dv[vi][l];
    add_transposed_times(w, c.Qk, sm.dy[vi]);
#pragma unroll
    for (int l = 0; l < kL; ++l) sm.dv[vi][l] = w[l];
  }
  __syncthreads();
  if (has_row && warp == 1) {
#pragma unroll
    for (int l = 0; l < kL; ++l) {
      if (l < len) gv[at(q + l) + v_first + vi] = wkv7::store<io_t, P>(dv[l] + sm.dv[vi][l]);
    }
  }
}

// The contractions over the pass's value rows, added to the sums in shared memory (set on the first pass):
// dA~ = dX S_0, dR~ = dY S_0, dB^ = U G, dK^ = V G and sum_v S_0 G ([L][N], thread: a 4-column group of k, kLq rows),
// dQb = dY U^T, dQk = dY V^T, dAb = dX U^T, dAk = dX V^T ([L][L], thread: a row and a pair of columns; the entries
// outside the masks are formed and never read).
template <int N>
__device__ __forceinline__ void contract_rows(GradientShared<N>& sm, bool first, int t) {
  using Rows = GradientRows<N>;
  constexpr int kLq = Rows::kLq;
  const int k0 = 4 * (t % Rows::kQuads), l0 = kLq * (t / Rows::kQuads);
  const int lm = t / 8, m0 = 2 * (t % 8);
  float acc[4][kLq][4] = {}, de[4] = {};
  float mm[4][2] = {};  // dQb, dQk, dAb, dAk at (lm, m0), (lm, m0 + 1)
  float(*sums[4])[GradientShared<N>::kSumRow] = {sm.dA, sm.dR, sm.dB, sm.dK};
  float(*masked[4])[kL] = {sm.dQb, sm.dQk, sm.dAb, sm.dAk};
  if (!first) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
#pragma unroll
      for (int i = 0; i < kLq; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[s][i][e] = sums[s][l0 + i][k0 + e];
#pragma unroll
      for (int e = 0; e < 2; ++e) mm[s][e] = masked[s][lm][m0 + e];
    }
    if (l0 == 0) {  // the threads that store it (the others' sums are not kept)
#pragma unroll
      for (int e = 0; e < 4; ++e) de[e] = sm.de[k0 + e];
    }
  }
#pragma unroll 1  // (unrolled by 2, its loads in flight cost ~60 registers over the rest of the kernel)
  for (int v = 0; v < Rows::kRows; ++v) {
    const Float4 s = load4(&sm.s0[v][k0]), g = load4(&sm.g[v][k0]);
#pragma unroll
    for (int i = 0; i < kLq; ++i) {
      const float dx = sm.dx[v][l0 + i], dy = sm.dy[v][l0 + i], u = sm.u[v][l0 + i], vv = sm.v[v][l0 + i];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        acc[0][i][e] = fmaf(dx, s.x[e], acc[0][i][e]);
        acc[1][i][e] = fmaf(dy, s.x[e], acc[1][i][e]);
        acc[2][i][e] = fmaf(u, g.x[e], acc[2][i][e]);
        acc[3][i][e] = fmaf(vv, g.x[e], acc[3][i][e]);
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) de[e] = fmaf(s.x[e], g.x[e], de[e]);
    const float dy = sm.dy[v][lm], dx = sm.dx[v][lm];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float u = sm.u[v][m0 + e], vv = sm.v[v][m0 + e];
      mm[0][e] = fmaf(dy, u, mm[0][e]);
      mm[1][e] = fmaf(dy, vv, mm[1][e]);
      mm[2][e] = fmaf(dx, u, mm[2][e]);
      mm[3][e] = fmaf(dx, vv, mm[3][e]);
    }
  }
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int i = 0; i < kLq; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) sums[s][l0 + i][k0 + e] = acc[s][i][e];
  if (l0 == 0) {
#pragma unroll
    for (int e = 0; e < 4; ++e) sm.de[k0 + e] = de[e];
  }
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int e = 0; e < 2; ++e) masked[s][lm][m0 + e] = mm[s][e];
}

// Column j of the v-independent part's backward: the scaled rows' (A~_l = a_l E(l, 0), R~_l = r_l E(l+1, 0),
// B^_l = b_l E(L, l+1), K^_l = k_l E(L, l+1), E(L, 0)) and the masked products' (decayed dots, as the forward's
// masked_products walks them: x from 1 to L, y from x down to 1, E(x, y) a running product), with dc_x the cotangent
// of c[x] = sum of log d over rows < x; the cotangent of row l's log d is sum_{x > l} dc_x. A pair's decay cotangent
// a_x ta + r_{x-1} tr (ta, tr: its terms of da_x, dr_{x-1}) equals b_{y-1} tb + k_{y-1} tk (tb, tk: its terms of
// db_{y-1}, dk_{y-1}), so the pairs' +c[x] parts are summed once per x (a_x da_x + r_{x-1} dr_{x-1}) and their -c[y]
// parts once per y (b_{y-1} db_{y-1} + k_{y-1} dk_{y-1}), not per pair. sm.chunk holds the raw inputs (loaded again:
// read from shared memory, they need no registers across the pairs). Gradients stored for rows < len.
// At N <= 64 two threads take a column (one per column left half the block idle): ColumnSplit.
template <int N>
struct ColumnSplit {
  static constexpr int kGroups = 2 * N <= kThreads ? 2 : 1;
  // The first thread's pairs: x <= kFirstLast; the second's the others, so that both finish together: in SASS at N = 64
  // (bf16 mode) ~1,190 and ~1,310 instructions (at 11: ~1,370 and ~1,150; a pair across the halves costs about half
  // one within). The rest of the column splits by rows (column_gradients).
  static constexpr int kFirstLast = kGroups == 2 ? 10 : kL;
  static_assert(kGroups == 1 || GradientRows<N>::kRows >= 2 * kL, "the second thread's db and dk fit sm.s0's rows");
};

struct ColumnSums {
  float db[kL], dk[kL], dc[kL + 1];
};

// The pairs with x in [kFirst, kLast] into s; da_x and dr_{x-1} are complete after position x and stored then.
// Pairs within a half of the chunk (x, y both <= 8 or both > 8) one at a time, E(x, y) a running product; the 8 pairs
// (x, y <= 8) of an x > 8 at once through the boundary, E(x, y) = E(x, 8) E(8, y): with b_m, k_m scaled to it
// (E(8, m + 1), no division), da_x and dr_{x-1} take E(x, 8) sum_m (..) and db_m, dk_m E(8, m + 1) sum_x (..) at the
// end, 8 fmas per pair instead of 4 products, 8 fmas and the running product.
template <int kFirst, int kLast, int N, typename io_t, Precision P, typename Params>
__device__ __forceinline__ void column_pairs(const GradientShared<N>& sm, const Params& p, TokenIndex at, int64_t q,
                                             int len, int j, ColumnSums& s) {
  constexpr int kHalf = kL / 2;
  constexpr bool kAcross = kLast > kHalf;
  const Shared<N>& c = sm.chunk;
  io_t *gr = static_cast<io_t*>(p.grad_r), *ga = static_cast<io_t*>(p.grad_a);
  if (kFirst == 1 && len > 0) ga[at(q) + j] = wkv7::store<io_t, P>(sm.dA[0][j]);  // A~_0 = a_0: no decay, no pair
  // The lower half's rows scaled to the boundary, and the sums across it (before their E(8, m + 1)).
  float to_half[kHalf], b_half[kHalf], k_half[kHalf], db_across[kHalf] = {}, dk_across[kHalf] = {};
  if constexpr (kAcross) {
    float rest = 1.f;  // E(8, m + 1)
#pragma unroll
    for (int m = kHalf - 1; m >= 0; --m) {
      to_half[m] = rest;
      b_half[m] = c.b[m][j] * rest;
      k_half[m] = c.k[m][j] * rest;
      rest *= c.d[m][j];
    }
  }
  float before = 1.f;  // E(x, 0)
  // Pairs (x, y), 1 <= y <= x: Ab[x][y-1], Ak (rows a_x, x < L) and Qb[x-1][y-1], Qk (rows r_{x-1}) against b_{y-1},
  // k_{y-1}, decayed by E(x, y) = exp(c[x] - c[y]).
#pragma unroll
  for (int x = 1; x <= kLast; ++x) {
    before *= c.d[x - 1][j];
    if (x < kFirst) continue;
    const float ax = x < kL ? c.a[x][j] : 0.f, rx = c.r[x - 1][j];
    float e = 1.f, da = x < kL ? sm.dA[x][j] * before : 0.f, dr = sm.dR[x - 1][j] * before;
#pragma unroll
    for (int y = x; y > (x > kHalf ? kHalf : 0); --y) {
      const int m = y - 1;
      const float bm = c.b[m][j], km = c.k[m][j];
      // The pair's four cotangents decayed first: 4 products and 8 fmas (decaying each of the four sums: 15 ops).
      const float ab = x < kL ? sm.dAb[x][m] * e : 0.f, ak = x < kL ? sm.dAk[x][m] * e : 0.f;
      const float qb = sm.dQb[x - 1][m] * e, qk = sm.dQk[x - 1][m] * e;
      da = fmaf(ab, bm, fmaf(ak, km, da));
      dr = fmaf(qb, bm, fmaf(qk, km, dr));
      s.db[m] = fmaf(ab, ax, fmaf(qb, rx, s.db[m]));
      s.dk[m] = fmaf(ak, ax, fmaf(qk, rx, s.dk[m]));
      e *= c.d[m][j];
    }
    if (x > kHalf) {  // e = E(x, 8)
      const float a_half = ax * e, r_half = rx * e;
      float sa = 0.f, sr = 0.f;
#pragma unroll
      for (int m = 0; m < kHalf; ++m) {
        const float ab = x < kL ? sm.dAb[x][m] : 0.f, ak = x < kL ? sm.dAk[x][m] : 0.f;
        const float qb = sm.dQb[x - 1][m], qk = sm.dQk[x - 1][m];
        sa = fmaf(ab, b_half[m], fmaf(ak, k_half[m], sa));
        sr = fmaf(qb, b_half[m], fmaf(qk, k_half[m], sr));
        db_across[m] = fmaf(ab, a_half, fmaf(qb, r_half, db_across[m]));
        dk_across[m] = fmaf(ak, a_half, fmaf(qk, r_half, dk_across[m]));
      }
      da = fmaf(e, sa, da);
      dr = fmaf(e, sr, dr);
    }
    s.dc[x] += fmaf(ax, da, rx * dr);  // A~_x dA~_x + R~_{x-1} dR~_{x-1} and the pairs (x, .): c[x]
    if (x < len) ga[at(q + x) + j] = wkv7::store<io_t, P>(da);
    if (x - 1 < len) gr[at(q + x - 1) + j] = wkv7::store<io_t, P>(dr);
  }
  if constexpr (kAcross) {
#pragma unroll
    for (int m = 0; m < kHalf; ++m) {
      s.db[m] = fmaf(to_half[m], db_across[m], s.db[m]);
      s.dk[m] = fmaf(to_half[m], dk_across[m], s.dk[m]);
    }
  }
  if (kLast == kL) s.dc[kL] += sm.de[j] * before;  // E(L, 0)
}

// Column j once s holds every pair's sums: the scaled rows B^, K^ into s (its db, dk, dc then final).
template <int N>
__device__ __forceinline__ void column_scaled_rows(const GradientShared<N>& sm, int j, ColumnSums& s) {
  const Shared<N>& c = sm.chunk;
  float rest = 1.f;  // E(L, l + 1)
#pragma unroll
  for (int l = kL - 1; l >= 0; --l) {
    const float dbh = sm.dB[l][j] * rest, dkh = sm.dK[l][j] * rest, bl = c.b[l][j], kl = c.k[l][j];
    s.dc[kL] = fmaf(bl, dbh, fmaf(kl, dkh, s.dc[kL]));  // B^_l dB^_l + K^_l dK^_l: +c[L]
    s.db[l] += dbh;
    s.dk[l] += dkh;
    s.dc[l + 1] -= fmaf(bl, s.db[l], kl * s.dk[l]);  // the same, and the pairs (., l + 1): -c[l + 1]
    rest *= c.d[l][j];
  }
}

// dk, db and dw of column j's rows [kLo, kHi) from the final sums. dlog: sum_{x > kHi} dc_x on entry (0 for kHi = L);
// row l's log d has the cotangent sum_{x > l} dc_x.
template <int kLo, int kHi, typename io_t, typename w_t, Precision P, typename Params>
__device__ __forceinline__ void column_stores(const Params& p, TokenIndex at, int64_t q, int len, int j,
                                              const ColumnSums& s, float dlog) {
  io_t *gk = static_cast<io_t*>(p.grad_k), *gb = static_cast<io_t*>(p.grad_b);
  const w_t* w = static_cast<const w_t*>(p.w);
  w_t* gw = static_cast<w_t*>(p.grad_w);
  const Decay decay = static_cast<Decay>(p.size.decay);
  constexpr Precision kW = wkv7::kDecayMode<P, io_t>;
#pragma unroll
  for (int l = kHi - 1; l >= kLo; --l) {
    dlog += s.dc[l + 1];
    if (l >= len) continue;
    const int64_t idx = at(q + l) + j;
    gk[idx] = wkv7::store<io_t, P>(s.dk[l]);
    gb[idx] = wkv7::store<io_t, P>(s.db[l]);
    gw[idx] = wkv7::store<w_t, kW>(wkv7::chunked_w_grad(dlog, wkv7::log_decay_grad(wkv7::load<kW>(w[idx]), decay)));
  }
}

// The column phase (after the passes, sm.chunk holding the raw inputs again): threads [0, N) and, with two threads per
// column, [N, 2N). The second writes its pairs' sums into sm.s0 (db, dk) and sm.g (dc), free after the passes; the
// first adds them, finishes the sums (column_scaled_rows), and hands the second the final sums of rows < L / 2 (sm.s0
// again: db, dk, dc and the sum of dc over the rows above) for their stores while it stores the rows above.
template <int N, typename io_t, typename w_t, Precision P, typename Params>
__device__ __forceinline__ void column_gradients(GradientShared<N>& sm, const Params& p, TokenIndex at, int64_t q,
                                                 int len, int t) {
  using Split = ColumnSplit<N>;
  constexpr int kHalf = kL / 2;
  ColumnSums s = {};
  const int j = t % N;
  if (t < N) {
    column_pairs<1, Split::kFirstLast, N, io_t, P>(sm, p, at, q, len, j, s);
  } else if (Split::kGroups == 2 && t < 2 * N) {
    column_pairs<Split::kFirstLast + 1, kL, N, io_t, P>(sm, p, at, q, len, j, s);
#pragma unroll
    for (int l = 0; l < kL; ++l) {
      sm.s0[l][j] = s.db[l];
      sm.s0[kL + l][j] = s.dk[l];
      sm.g[l][j] = s.dc[l + 1];
    }
  }
  if constexpr (Split::kGroups == 1) {
    if (t < N) {
      column_scaled_rows(sm, j, s);
      column_stores<0, kL, io_t, w_t, P>(p, at, q, len, j, s, 0.f);
    }
  } else {
    __syncthreads();
    float above = 0.f;  // sum_{x > L/2} dc_x
    if (t < N) {
#pragma unroll
      for (int l = 0; l < kL; ++l) {
        s.db[l] += sm.s0[l][j];
        s.dk[l] += sm.s0[kL + l][j];
        s.dc[l + 1] += sm.g[l][j];
      }
      column_scaled_rows(sm, j, s);
#pragma unroll
      for (int x = kL; x > kHalf; --x) above += s.dc[x];
#pragma unroll
      for (int l = 0; l < kHalf; ++l) {
        sm.s0[l][j] = s.db[l];
        sm.s0[kHalf + l][j] = s.dk[l];
        sm.s0[2 * kHalf + l][j] = s.dc[l + 1];
      }
      sm.s0[3 * kHalf][j] = above;
    }
    __syncthreads();
    if (t < N) {
      column_stores<kHalf, kL, io_t, w_t, P>(p, at, q, len, j, s, 0.f);
    } else if (t < 2 * N) {
#pragma unroll
      for (int l = 0; l < kHalf; ++l) {
        s.db[l] = sm.s0[l][j];
        s.dk[l] = sm.s0[kHalf + l][j];
        s.dc[l + 1] = sm.s0[2 * kHalf + l][j];
      }
      column_stores<0, kHalf, io_t, w_t, P>(p, at, q, len, j, s, sm.s0[3 * kHalf][j]);
    }
  }
}

// The gradients of one chunk [q, q + len) of a sequence starting at `start` and ending at `stop`.
template <int N, typename io_t, typename w_t, Precision P>
__device__ __forceinline__ void chunk_gradients(GradientShared<N>& sm, const Wkv7BackwardParams& p, TokenIndex at,
                                                int64_t task, int64_t start, int64_t stop, int64_t q, int len,
                                                int t) {
  using Rows = GradientRows<N>;
  constexpr int kRows = Rows::kRows;
  constexpr int64_t kNN = int64_t(N) * N;
  const int64_t end = q + len;
  // S_0: the forward's checkpoint, or the initial state; G after the chunk: pass 1's slot of the next chunk, or the
  // final state's cotangent.
  const bool s0_k_major = q > start, g_k_major = end < stop;
  const float* s0 = s0_k_major                   ? p.checkpoints + chunk_slot(p.size, at, q) * kNN
                    : p.initial_state != nullptr ? p.initial_state + task * kNN
                                                 : nullptr;
  const float* g = g_k_major                      ? p.scratch + chunk_slot(p.size, at, end) * kNN
                   : p.grad_final_state != nullptr ? p.grad_final_state + task * kNN
                                                   : nullptr;
  const io_t *v = static_cast<const io_t*>(p.v), *gy = static_cast<const io_t*>(p.grad_y);
  io_t* gv = static_cast<io_t*>(p.grad_v);

  prepare_chunk<N, io_t, w_t, P>(sm.chunk, p, at, q, len, t, [] {});
  // T for substitutions_mma, on the last 16 threads (idle in scale_rows below N = 128).
  if constexpr (P == Precision::kBF16) {
    if (t >= kThreads - kL) invert_unit_lower(sm.chunk, t - (kThreads - kL));
  }
  for (int v_first = 0; v_first < N; v_first += kRows) {
    __syncthreads();  // the chunk's scaled rows are in; the previous pass's readers are done
    load_state_rows<N>(sm.s0, s0, s0_k_major, v_first, t);
    load_state_rows<N>(sm.g, g, g_k_major, v_first, t);
    for_rows_and_tokens<N>(t, [&](int vi, int l) {
      const int64_t at_l = at.clamped(q, l, len) + v_first + vi;
      sm.v[vi][l] = l < len ? wkv7::load<P>(v[at_l]) : 0.f;
      sm.dy[vi][l] = l < len ? wkv7::load<P>(gy[at_l]) : 0.f;
    });
    __syncthreads();
    row_gradients<N, io_t, P>(sm, gv, at, q, len, v_first, t);
    __syncthreads();
    if constexpr (P == Precision::kBF16) {
      contract_rows_mma(sm, v_first == 0, t);
    } else {
      contract_rows(sm, v_first == 0, t);
    }
  }
  __syncthreads();  // the contractions are in; the scaled rows are read no more
  // r, k, a, b raw again; the decays are the first load's.
  load_chunk<N, io_t, w_t, P, Wkv7BackwardParams, false>(sm.chunk, p, at, q, len, t);
  __syncthreads();
  column_gradients<N, io_t, w_t, P>(sm, p, at, q, len, t);
}

template <int N, typename io_t, typename w_t, Precision P>
__global__ void __launch_bounds__(kThreads) chunked_gradients_kernel(const Wkv7BackwardParams p) {
  ROPEWKV_DYNAMIC_SHARED(dynamic_shared);
  GradientShared<N>& sm = *reinterpret_cast<GradientShared<N>*>(dynamic_shared);
  const int t = threadIdx.x;
  const int64_t heads = p.size.heads;
  const int64_t window = blockIdx.x / heads;  // the 16-token window [c * 16, c * 16 + 16) of batch row `batch`
  const int64_t batch = window / p.size.chunks, first = window % p.size.chunks * kL;
  const int64_t last = first + kL < p.size.seqlen ? first + kL : p.size.seqlen;
  TokenIndex at{batch, p.size.seqlen, heads, int64_t(blockIdx.x) % heads, N};
  // The sequences that overlap the window: batch row `batch`, or with cu_seqlens (batch 0) the packed sequences
  // from the first that ends past the window's first token (offsets nondecreasing: Python checks them). Counted in
  // 32 bits (sequences x heads < 2^31: the launch checks): live across the whole chunk, a 64-bit count was spilled.
  int s = int(batch), s_end = int(batch) + 1;
  if (const int64_t* cu = p.size.cu_seqlens; cu != nullptr) {
    int lo = 0, hi = int(p.size.n_seqs);
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (cu[mid + 1] <= first) lo = mid + 1; else hi = mid;
    }
    s = lo;
    s_end = int(p.size.n_seqs);
  }
  for (; s < s_end; ++s) {
    int64_t seq_batch, start, stop;
    wkv7::sequence_range(p.size.cu_seqlens, s, p.size.seqlen, seq_batch, start, stop);
    if (start >= last) break;
    const int64_t q = start > first ? start : first, end = stop < last ? stop : last;
    if (q >= end) continue;
    chunk_gradients<N, io_t, w_t, P>(sm, p, at, int64_t(s) * heads + at.h, start, stop, q, int(end - q), t);
  }
}

}  // namespace wkv7_chunked_detail
}  // namespace ropewkv::cuda
