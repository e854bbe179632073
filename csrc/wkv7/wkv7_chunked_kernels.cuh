#pragma once
// CUDA kernel of the chunked WKV7 forward (ropewkv::wkv7_chunked_forward), from the chunk math of
// python/ropewkv/ops/rwkv7/chunked.md (its symbols below). Torch-free, and free of launch syntax so that the host
// emulator of CUDA blocks compiles it with g++ (tests/test_wkv7_chunked_cuda_on_host.py); the launcher is
// wkv7_chunked_launch.cuh.
//
// One block per (sequence, head, slice of VS value rows): the chunk recurrence splits exactly over v, since
//   U[:, vs] = (I - Ab)^{-1} (A~ S0[vs, :]^T + Ak V[:, vs]),  Y[:, vs] = R~ S0[vs, :]^T + Qb U[:, vs] + Qk V[:, vs],
//   S_L[vs, :] = S0[vs, :] diag(E[L][0]) + U[:, vs]^T B^ + V[:, vs]^T K^,
// while Ab, Ak, Qb, Qk, A~, R~, B^, K^ depend only on r, w, k, a, b. Each block recomputes those (redundantly across
// the N / VS slices of a head: a separate pre-pass kernel writing them per chunk is the next step) and keeps its
// slice of the state in registers. Chunks are the CPU twin's: 16 tokens aligned to multiples of 16 in the packed time
// axis, a sequence's first and last chunk shorter (its rows past the chunk are zero, with decay 1, so every product
// runs over the full 16 rows and the padding adds nothing). Math in fp32 whatever the I/O type; outputs rounded once.
//
// The v-dependent products run in one of two forms, by precision mode:
// - precision="fp32": fp32 FMAs (SimtSlice), a thread per (value row, segment of k), the substitution in place.
// - precision="bf16": bf16 tensor cores (MmaSlice, ropewkv/mma_bf16.cuh), a warp per 16 value rows, the state slice
//   held in mma accumulator fragments, every product with an fp32 operand split into hi/lo bf16 halves (three
//   products; two where v, exact in bf16 in this mode, is the other operand), as the Triton twin's bf16 mode. The
//   substitution becomes a product with T = (I - Ab)^{-1}, formed per chunk in fp32 by forward substitution.
//
// Decays inside a chunk are running products of the per-token decays, as in the CPU twin (E[x][y] = d_{y+1} ... d_x,
// one multiply per step over exactly that range): never a division, never an exp of a cumulative sum. The decays
// themselves go through expf (wkv7::decay_of), not __expf.
#include <cstdint>
#include <type_traits>

#include "ropewkv/mma_bf16.cuh"
#include "ropewkv/precision.h"
#include "ropewkv/wkv7.h"
#include "ropewkv/wkv7_cuda.h"

namespace ropewkv::cuda {
namespace wkv7_chunked_detail {

using wkv7::Decay;

inline constexpr int kL = wkv7::kCheckpointEvery;  // the chunk (wkv7::chunked::kChunk): one checkpoint per chunk
inline constexpr int kThreads = 128;

// The value rows per block (the state slice a block keeps). Every block recomputes the chunk's v-independent part
// (loads, decays, masked products), so the widest slice whose state fits the registers costs least in all.
// fp32 (a thread per value row and segment of k): the whole head at N = 32 and 64 (at N = 64, 49K SASS instructions
// per token-head against 78K for two slices of 32), 32 rows at N = 128, whose 32 state floats a thread already take
// 182-188 registers (benchmarks/NOTES.md, "Chunked WKV7", for the counts). bf16 (a warp per 16 value rows, N / 8
// fragments of 4 floats a lane): the whole head at N = 32 (2 of the 4 warps idle in the products) and 64, and 64 rows
// at N = 128 (64 state floats a lane).
template <int N, Precision P>
inline constexpr int kValueSlice = P == Precision::kBF16 ? (N < 64 ? N : 64) : (N == 64 ? 64 : 32);

// The masked products Ab, Ak, Qb, Qk: 16 lanes per pair of chunk rows {x, L + 1 - x} (17 decayed dots between them:
// every lane the same trip count), lane c taking columns j = c + 16 i, i < kCols, reduced by shuffles.
template <int N>
struct Pairs {
  static constexpr int kLanes = 16;
  static_assert(kThreads == kL / 2 * kLanes, "one 16-lane group per pair of chunk rows");
  static constexpr int kCols = N / kLanes;
  static_assert(N <= kThreads, "a thread per k column scales the rows");
  static_assert(kL * N % kThreads == 0, "the threads load a chunk's rows in whole passes");
};

// The chunk's v-independent quantities, fp32, [row][k]. r, a, b, k become R~, A~, B^, K^ in place once the masked
// products are formed. Rows are kRow = N + 4 floats apart (16-byte aligned), so that the mma form's fragment loads
// hit distinct banks: B^, K^ (rows 2t, 2t + 8: banks 8t + g) conflict-free, A~, R~ (8-byte, rows g: banks 4g + 2t)
// 2-way, where rows N apart put 4 lanes on each bank (4-way). N + 8 would swap the two and pass 48 KB at N = 128.
template <int N>
struct Shared {
  static constexpr int kRow = N + 4;
  alignas(16) float r[kL][kRow], k[kL][kRow], a[kL][kRow], b[kL][kRow], d[kL][kRow];
  alignas(16) float decay_all[N];  // E[L][0]: the chunk's whole decay per k
  alignas(16) float Ab[kL][kL], Ak[kL][kL], Qb[kL][kL], Qk[kL][kL];  // written and read inside their masks only
  alignas(16) float T[kL][kL];                                       // (I - Ab)^{-1}: the bf16 mode's only
};

struct alignas(16) Float4 {
  float x[4];
};

__device__ __forceinline__ Float4 load4(const float* p) { return *reinterpret_cast<const Float4*>(p); }

// Two adjacent fp32 values (8-byte aligned) as one bf16x2 split (mma fragments' register pairs).
__device__ __forceinline__ mma::Split split2(const float* p) {
  const float2 x = *reinterpret_cast<const float2*>(p);
  return mma::split_bf16x2(x.x, x.y);
}

// The sum of x over the lanes whose index differs in the bits of [from, to) (masks from, 2 from, ... < to).
template <int kFrom, int kTo>
__device__ __forceinline__ float lane_sum(float x) {
#pragma unroll
  for (int m = kFrom; m < kTo; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// Where token q of the block's (sequence, head) starts in [B, T, H, N] inputs and outputs.
struct TokenIndex {
  int64_t batch, seqlen, heads, h, n;
  __device__ __forceinline__ int64_t operator()(int64_t q) const { return ((batch * seqlen + q) * heads + h) * n; }
  // Row l of the chunk that starts at token q, or its last row (len - 1) past the chunk, so that loads need no branch.
  __device__ __forceinline__ int64_t clamped(int64_t q, int l, int len) const {
    return (*this)(q + (l < len ? l : len - 1));
  }
};

// The checkpoint slot [B, chunks, H] of the chunk that starts at token q (q a multiple of 16).
__device__ __forceinline__ int64_t chunk_slot(const Wkv7Sizes& size, const TokenIndex& at, int64_t q) {
  return (at.batch * size.chunks + q / kL) * size.heads + at.h;
}

// The chunk's inputs r, k, a, b and the decays into sm, widened (bf16-rounded first in the bf16 mode); rows past the
// chunk zero, decay 1 (loaded from the chunk's last row and dropped). 4 consecutive values of a row per thread and
// pass (r..b aligned to 4 elements: the glue copies them where not): one address and one 8- or 16-byte load per
// input and one 16-byte store per row of sm. Params: the forward's or the backward's. kDecays false: r, k, a, b only
// (sm.d kept from an earlier load: each decay costs an exp and a division).
template <int N, typename io_t, typename w_t, Precision P, typename Params, bool kDecays = true>
__device__ __forceinline__ void load_chunk(Shared<N>& sm, const Params& p, TokenIndex at, int64_t q, int len, int t) {
  static_assert(kL * N % (kThreads * 4) == 0, "the threads load a chunk's rows in whole passes");
  const io_t *r = static_cast<const io_t*>(p.r), *k = static_cast<const io_t*>(p.k);
  const io_t *a = static_cast<const io_t*>(p.a), *b = static_cast<const io_t*>(p.b);
  const w_t* w = static_cast<const w_t*>(p.w);
  const Decay decay = static_cast<Decay>(p.size.decay);
  constexpr Precision kW = wkv7::kDecayMode<P, io_t>;
#pragma unroll
  for (int i = 0; i < kL * N / (kThreads * 4); ++i) {
    const int e = t + kThreads * i;
    const int l = e / (N / 4), j = 4 * (e % (N / 4));
    const bool in_chunk = l < len;
    const int64_t idx = at.clamped(q, l, len) + j;
    Float4 rv, kv, av, bv, dv;
    wkv7::load4<P>(r + idx, rv.x);
    wkv7::load4<P>(k + idx, kv.x);
    wkv7::load4<P>(a + idx, av.x);
    wkv7::load4<P>(b + idx, bv.x);
    if constexpr (kDecays) wkv7::load4<kW>(w + idx, dv.x);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if constexpr (kDecays) dv.x[c] = in_chunk ? wkv7::decay_of(dv.x[c], decay) : 1.f;
      if (!in_chunk) rv.x[c] = kv.x[c] = av.x[c] = bv.x[c] = 0.f;
    }
    *reinterpret_cast<Float4*>(&sm.r[l][j]) = rv;
    *reinterpret_cast<Float4*>(&sm.k[l][j]) = kv;
    *reinterpret_cast<Float4*>(&sm.a[l][j]) = av;
    *reinterpret_cast<Float4*>(&sm.b[l][j]) = bv;
    if constexpr (kDecays) *reinterpret_cast<Float4*>(&sm.d[l][j]) = dv;
  }
}

// The masked products. With 1-based positions 1 <= y <= x <= L and E(x, y) = d_{y+1} ... d_x:
//   Ab[x][y-1] = sum_j a_x b_{y-1} E(x, y)  (x < L)     Qb[x-1][y-1] = sum_j r_{x-1} b_{y-1} E(x, y),
// Ak, Qk the same with k (rows 0-based; a_x is chunk row x, the token after position x). Here the pairs with x and
// y in the same block of kBlock positions (the whole chunk in precision="fp32"; cross_block_products takes the
// others). For each x, y runs down from x with E(x, x) = 1 and E(x, y - 1) = E(x, y) d_y (d_y: chunk row y - 1).
// 16 lanes per pair of positions {x, x'} of a block, x - base + x' - base = kBlock + 1 (every lane the same trip
// count, kBlock + 1), lane c taking columns c + 16 i.
template <int N, int kBlock>
__device__ __forceinline__ void masked_products(Shared<N>& sm, int t) {
  using Pr = Pairs<N>;
  constexpr int kCols = Pr::kCols;
  const int group = t / Pr::kLanes, c = t % Pr::kLanes;
  const int base = kBlock == kL ? 0 : kBlock * (group / (kBlock / 2)), pair = group % (kBlock / 2);
  const int x_first = base + pair + 1, x_second = base + kBlock - pair;
  float ax[kCols], rx[kCols], ex[kCols];
#pragma unroll 1
  for (int step = 0; step < kBlock + 1; ++step) {
    const bool first = step <= pair;
    const int x = first ? x_first : x_second;
    const int yy = first ? x_first - step : x_second - (step - pair - 1);
    if (step == 0 || step == pair + 1) {
#pragma unroll
      for (int i = 0; i < kCols; ++i) {
        const int j = c + Pr::kLanes * i;
        ax[i] = x < kL ? sm.a[x][j] : 0.f;
        rx[i] = sm.r[x - 1][j];
        ex[i] = 1.f;
      }
    }
    float sab = 0.f, sak = 0.f, sqb = 0.f, sqk = 0.f;
#pragma unroll
    for (int i = 0; i < kCols; ++i) {
      const int j = c + Pr::kLanes * i;
      const float bm = sm.b[yy - 1][j], km = sm.k[yy - 1][j];
      const float ae = ax[i] * ex[i], re = rx[i] * ex[i];
      sab = fmaf(ae, bm, sab);
      sak = fmaf(ae, km, sak);
      sqb = fmaf(re, bm, sqb);
      sqk = fmaf(re, km, sqk);
      ex[i] *= sm.d[yy - 1][j];
    }
    // The four sums over the 16 lanes, reduce-scatter: lanes swap halves of what they hold (xor 8: two of the
    // four partials, xor 4: one of two), then add up the one left (xor 2, 1). Lane c ends with output c / 4
    // (Ab, Ak, Qb, Qk) in full, in 4 shuffles instead of 16.
    const bool upper = c & 8, odd = c & 4;
    float keep0 = upper ? sqb : sab, keep1 = upper ? sqk : sak;
    keep0 += __shfl_xor_sync(0xffffffffu, upper ? sab : sqb, 8);
    keep1 += __shfl_xor_sync(0xffffffffu, upper ? sak : sqk, 8);
    float sum = odd ? keep1 : keep0;
    sum += __shfl_xor_sync(0xffffffffu, odd ? keep0 : keep1, 4);
    sum = lane_sum<1, 4>(sum);
    if (c % 4 == 0 && (upper || x < kL)) {
      float(*out)[kL] = upper ? (odd ? sm.Qk : sm.Qb) : (odd ? sm.Ak : sm.Ab);
      const int row = upper ? x - 1 : x;
      out[row][yy - 1] = sum;
    }
  }
}

// Running decays down column j over chunk rows [from, to): a_l *= the decay of rows from .. l - 1, r_l *= that of
// rows from .. l (returns the decay of the whole range); backwards, b_l and k_l *= the decay of rows l + 1 .. to - 1
// (returns the same range's decay, multiplied in the other order).
template <int N>
__device__ __forceinline__ float scale_from(Shared<N>& sm, int j, int from, int to) {
  float before = 1.f;
#pragma unroll
  for (int l = from; l < to; ++l) {
    sm.a[l][j] *= before;
    before *= sm.d[l][j];
    sm.r[l][j] *= before;
  }
  return before;
}
template <int N>
__device__ __forceinline__ float scale_to(Shared<N>& sm, int j, int from, int to) {
  float rest = 1.f;
#pragma unroll
  for (int l = to - 1; l >= from; --l) {
    sm.b[l][j] *= rest;
    sm.k[l][j] *= rest;
    rest *= sm.d[l][j];
  }
  return rest;
}

// The pairs across the two blocks of 8 positions (x > 8 >= y) in precision="bf16", as one [16][16] product on tensor
// cores: E(x, y) = E(x, 8) E(8, y), so with rows scaled to the blocks' boundary (chunk rows 8.. of a, r from row 8,
// rows ..7 of b, k to row 7: scale_from/scale_to over one block, column t < N), C = X Y^T over k with X rows a_x
// (x = 9 + g, none at x = 16) and r_{x-1} (rows g + 8), Y rows b_m, k_m (m < 8: n tiles 0, 1). Both operands split
// into hi/lo as every product of the bf16 mode. Warps 0 and 1 take an n tile each, every k step: the sum over k in
// one accumulator, so the result does not depend on a reduction order.
template <int N>
__device__ __forceinline__ void cross_block_products(Shared<N>& sm, int t) {
  const int warp = t / 32, g = t % 32 / 4, tq = t % 4;
  if (warp >= 2) return;
  const auto& Y = warp == 0 ? sm.b : sm.k;
  float c[4] = {};
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
    uint32_t x_hi[4], x_lo[4], y_hi[2], y_lo[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // A register i: row g + 8 (i % 2), columns k, k + 1
      const int k = 16 * kk + 2 * tq + 8 * (i / 2);
      const mma::Split x = i % 2 == 1 ? split2(&sm.r[8 + g][k]) : g < 7 ? split2(&sm.a[9 + g][k]) : mma::Split{0, 0};
      x_hi[i] = x.hi, x_lo[i] = x.lo;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // B register h: Y[g][k, k + 1]
      const mma::Split y = split2(&Y[g][16 * kk + 2 * tq + 8 * h]);
      y_hi[h] = y.hi, y_lo[h] = y.lo;
    }
    mma::mma_split(c, x_hi, x_lo, y_hi, y_lo);
  }
  // C element i: row g + 8 (i / 2), column m = 2 tq + i % 2.
  float(*ab)[kL] = warp == 0 ? sm.Ab : sm.Ak;
  float(*qb)[kL] = warp == 0 ? sm.Qb : sm.Qk;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = 2 * tq + i % 2;
    if (i >= 2) {
      qb[8 + g][m] = c[i];
    } else if (g < 7) {
      ab[9 + g][m] = c[i];
    }
  }
}

// The same in precision="fp32", on the FMA pipes: thread t forms C[xr][m] and C[xr][m + 8] (X row xr = t / 8 against
// b_m, then against k_m, m = t % 8), each sum over k in one accumulator. One product at a time: both in one loop took
// the forward at N = 64 to 184 registers (2 blocks per SM; 146 without these products, 153 with).
template <int N>
__device__ __forceinline__ void cross_block_products_fma(Shared<N>& sm, int t) {
  const int xr = t / 8, m = t % 8;
  if (xr == 7) return;  // (x = 16: no a row)
  const float* x = xr < 8 ? sm.a[9 + xr] : sm.r[xr];
  float sb = 0.f, sk = 0.f;
#pragma unroll
  for (int k = 0; k < N; k += 4) {
    const Float4 xv = load4(x + k), bv = load4(&sm.b[m][k]);
#pragma unroll
    for (int e = 0; e < 4; ++e) sb = fmaf(xv.x[e], bv.x[e], sb);
  }
#pragma unroll
  for (int k = 0; k < N; k += 4) {
    const Float4 xv = load4(x + k), kv = load4(&sm.k[m][k]);
#pragma unroll
    for (int e = 0; e < 4; ++e) sk = fmaf(xv.x[e], kv.x[e], sk);
  }
  float(*ab)[kL] = xr < 8 ? sm.Ab : sm.Qb;
  float(*ak)[kL] = xr < 8 ? sm.Ak : sm.Qk;
  const int row = xr < 8 ? 9 + xr : xr;  // Ab[x][m] (x = 9 + xr), Qb[x - 1][m] (x - 1 = xr)
  ab[row][m] = sb;
  ak[row][m] = sk;
}

// The scaled rows, in place, by running products down each k column (thread t < N: column t): A~_l = a_l E(l, 0),
// R~_l = r_l E(l+1, 0), B^_l = b_l E(L, l+1), K^_l = k_l E(L, l+1); and E(L, 0). With kBlock < L the rows were
// scaled within their blocks (cross_block_products): rows kBlock.. of a, r then take the first block's decay, rows
// ..kBlock-1 of b, k the second's.
template <int N, int kBlock>
__device__ __forceinline__ void scale_rows(Shared<N>& sm, int t) {
  static_assert(kBlock == kL || 2 * kBlock == kL, "the whole chunk or its two halves");
  if (t >= N) return;
  const int j = t;
  const float before = scale_from(sm, j, 0, kBlock);
  const float rest = scale_to(sm, j, kL - kBlock, kL);
#pragma unroll
  for (int l = kBlock; l < kL; ++l) {
    sm.a[l][j] *= before;
    sm.r[l][j] *= before;
    sm.b[l - kBlock][j] *= rest;
    sm.k[l - kBlock][j] *= rest;
  }
  sm.decay_all[j] = kBlock == kL ? before : before * rest;
}

// The positions per block of the masked products' decayed dots: the chunk's two halves, the pairs across them formed
// apart (cross_block_products on tensor cores in precision="bf16", cross_block_products_fma in "fp32"), so that the
// per-pair loop takes 9 steps instead of 17. The whole chunk at N = 128 in precision="fp32": there ptxas kept the
// state pass's loop invariants at 168 registers only by spilling them (32 B) once the apart pairs were added.
template <int N, Precision P>
inline constexpr int kMaskedBlock = P == Precision::kBF16 || N < 128 ? kL / 2 : kL;

// A chunk's v-independent part into sm, each step behind a barrier (the first: the previous chunk's readers of sm
// are done): its inputs, with load_more() beside them (a slice's per-row values), the masked products, the scaled
// rows. No barrier after scale_rows: a thread may go on with the column it scaled.
template <int N, typename io_t, typename w_t, Precision P, typename Params, typename LoadMore>
__device__ __forceinline__ void prepare_chunk(Shared<N>& sm, const Params& p, TokenIndex at, int64_t q, int len,
                                              int t, LoadMore&& load_more) {
  constexpr int kBlock = kMaskedBlock<N, P>;
  __syncthreads();
  load_chunk<N, io_t, w_t, P>(sm, p, at, q, len, t);
  load_more();
  __syncthreads();
  masked_products<N, kBlock>(sm, t);
  __syncthreads();
  if constexpr (kBlock < kL) {
    if (t < N) {  // the rows on either side of the halves' boundary, scaled to it for cross_block_products
      scale_from(sm, t, kBlock, kL);
      scale_to(sm, t, 0, kBlock);
    }
    __syncthreads();
    if constexpr (P == Precision::kBF16) {
      cross_block_products(sm, t);
    } else {
      cross_block_products_fma(sm, t);
    }
    __syncthreads();
  }
  scale_rows<N, kBlock>(sm, t);
}

// Column j of T = (I - Ab)^{-1} (Ab strictly lower triangular, so T is unit lower triangular): T = I + Ab T, row by
// row, T[l][j] = [l == j] + sum_{j <= m < l} Ab[l][m] T[m][j]. No division.
template <int N>
__device__ __forceinline__ void invert_unit_lower(Shared<N>& sm, int j) {
  float col[kL];
#pragma unroll
  for (int l = 0; l < kL; ++l) {
    float sum = l == j ? 1.f : 0.f;
#pragma unroll
    for (int m4 = 0; m4 < l; m4 += 4) {
      // Row l's entries m4 .. m4 + 3 in one load (those past the mask never used), then selected: a shared load
      // predicated per entry costs sm_90 a setup of the shared window each (~7 instructions per term).
      const Float4 row = load4(&sm.Ab[l][m4]);
#pragma unroll
      for (int m = m4; m < l && m < m4 + 4; ++m) sum = fmaf(m >= j ? row.x[m - m4] : 0.f, col[m], sum);
    }
    col[l] = sum;
    sm.T[l][j] = sum;
  }
}

// U = U0 + Ab U + Ak V for one value row (u: U0 in, U out; vv: V), by forward substitution: I - Ab is unit lower
// triangular, so no division. Rows of Ab, Ak are read 4 entries at a time; the entries past the mask are never used.
template <int N>
__device__ __forceinline__ void substitute_u(float (&u)[kL], const float (&vv)[kL], const Shared<N>& sm) {
#pragma unroll
  for (int l = 1; l < kL; ++l) {
#pragma unroll
    for (int m4 = 0; m4 < l; m4 += 4) {
      const Float4 ab = load4(&sm.Ab[l][m4]), ak = load4(&sm.Ak[l][m4]);
#pragma unroll
      for (int e = 0; e < 4 && m4 + e < l; ++e) u[l] = fmaf(ab.x[e], u[m4 + e], fmaf(ak.x[e], vv[m4 + e], u[l]));
    }
  }
}

// precision="fp32": the block's VS value rows of the state as fp32 FMAs. Thread t owns value row v of the slice
// (kSegs threads per row, in one warp, kVPerWarp rows per warp) and k columns j = 4 (kSegs g + seg) + e, g < kGroups,
// e < 4: 16-byte shared loads, consecutive segments on consecutive lanes (no bank conflict), the row sums reduced by
// shuffles.
template <int N, int VS, typename io_t, Precision P>
struct SimtSlice {
  static_assert(kThreads % VS == 0 && N % VS == 0, "the value slice must divide N and the block");
  static constexpr int kSegs = kThreads / VS;
  static constexpr int kVPerWarp = 32 / kSegs;
  static_assert(kVPerWarp * kSegs == 32, "a value row's threads must lie in one warp");
  static constexpr int kGroups = N / (4 * kSegs);
  static_assert(kGroups * 4 * kSegs == N, "N must be a multiple of 4 x the threads per value row");
  static constexpr bool kUsesInverse = false;

  int seg, vi;
  float st[kGroups][4];  // S[vi][col(g, e)]
  float vv[kL];          // V[:, vi]

  __device__ __forceinline__ SimtSlice(int t, int first_row)
      : seg(t % 32 / kVPerWarp), vi(first_row + t / 32 * kVPerWarp + t % 32 % kVPerWarp) {}
  __device__ __forceinline__ int col(int g, int e) const { return 4 * (kSegs * g + seg) + e; }

  __device__ __forceinline__ void load_initial(const float* s0) {  // the head's N x N state, or none
#pragma unroll
    for (int g = 0; g < kGroups; ++g)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[g][e] = s0 ? s0[int64_t(vi) * N + col(g, e)] : 0.f;
  }
  __device__ __forceinline__ void store_checkpoint(float* slot) const {  // k-major, as the sequential ops
#pragma unroll
    for (int g = 0; g < kGroups; ++g)
#pragma unroll
      for (int e = 0; e < 4; ++e) slot[int64_t(col(g, e)) * N + vi] = st[g][e];
  }
  __device__ __forceinline__ void store_final(float* state) const {
#pragma unroll
    for (int g = 0; g < kGroups; ++g)
#pragma unroll
      for (int e = 0; e < 4; ++e) state[int64_t(vi) * N + col(g, e)] = st[g][e];
  }
  __device__ __forceinline__ void load_values(const io_t* v, TokenIndex at, int64_t q, int len) {
#pragma unroll
    for (int l = 0; l < kL; ++l) {
      const float x = wkv7::load<P>(v[at.clamped(q, l, len) + vi]);
      vv[l] = l < len ? x : 0.f;
    }
  }

  __device__ __forceinline__ void step(const Shared<N>& sm, io_t* y, TokenIndex at, int64_t q, int len) {
    // U0 = A~ S0^T and Y0 = R~ S0^T for row vi: partial sums over this thread's columns, then over the row's lanes.
    float u[kL], yv[kL];
#pragma unroll
    for (int l = 0; l < kL; ++l) u[l] = yv[l] = 0.f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
#pragma unroll
      for (int l = 0; l < kL; ++l) {
        const Float4 at4 = load4(&sm.a[l][col(g, 0)]), rt4 = load4(&sm.r[l][col(g, 0)]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          u[l] = fmaf(at4.x[e], st[g][e], u[l]);
          yv[l] = fmaf(rt4.x[e], st[g][e], yv[l]);
        }
      }
    }
#pragma unroll
    for (int l = 0; l < kL; ++l) {
      u[l] = lane_sum<kVPerWarp, 32>(u[l]);
      yv[l] = lane_sum<kVPerWarp, 32>(yv[l]);
    }
    substitute_u(u, vv, sm);
    // Y = Y0 + Qb U + Qk V (rows of Qb, Qk read as substitute_u reads Ab, Ak); each of the row's kSegs lanes stores
    // every kSegs-th token.
#pragma unroll
    for (int l = 0; l < kL; ++l) {
#pragma unroll
      for (int m4 = 0; m4 <= l; m4 += 4) {
        const Float4 qb = load4(&sm.Qb[l][m4]), qk = load4(&sm.Qk[l][m4]);
#pragma unroll
        for (int e = 0; e < 4 && m4 + e <= l; ++e)
          yv[l] = fmaf(qb.x[e], u[m4 + e], fmaf(qk.x[e], vv[m4 + e], yv[l]));
      }
      if (l < len && l % kSegs == seg) y[at(q + l) + vi] = wkv7::store<io_t, P>(yv[l]);
    }
    // S_L = S0 diag(E(L, 0)) + U^T B^ + V^T K^ for row vi.
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const Float4 decay_all = load4(&sm.decay_all[col(g, 0)]);
#pragma unroll
      for (int e = 0; e < 4; ++e) st[g][e] *= decay_all.x[e];
#pragma unroll
      for (int l = 0; l < kL; ++l) {
        const Float4 bh = load4(&sm.b[l][col(g, 0)]), kh = load4(&sm.k[l][col(g, 0)]);
#pragma unroll
        for (int e = 0; e < 4; ++e) st[g][e] = fmaf(u[l], bh.x[e], fmaf(vv[l], kh.x[e], st[g][e]));
      }
    }
  }
};

// The tensor-core forms' fragments (mma.sync m16n8k16, ropewkv/mma_bf16.cuh: lane 4 g + t) of [16][16] blocks.
// The A fragment (hi, lo) of a block held as two C tiles (columns 0-7 and 8-15; element i: row g + 8 (i / 2), column
// 2 t + i % 2).
__device__ __forceinline__ void a_fragment(const float (&left)[4], const float (&right)[4], uint32_t (&hi)[4],
                                           uint32_t (&lo)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float* tile = i < 2 ? left : right;
    const mma::Split s = mma::split_bf16x2(tile[2 * (i % 2)], tile[2 * (i % 2) + 1]);
    hi[i] = s.hi;
    lo[i] = s.lo;
  }
}

// B fragments (hi, lo) of a masked [L][L] block (its entries outside the mask are never written: read as zero) for
// the output columns 8 nt .. 8 nt + 7, register h: of M^T (kTransposed; B[k][n] = M[8 nt + n][k], kept where k < or
// <= 8 nt + n) or of M itself (B[k][n] = M[k][8 nt + n], kept where 8 nt + n < or <= k), k = 2 t + 8 h and k + 1.
template <bool kTransposed, bool kStrict>
__device__ __forceinline__ void masked_fragment(const float (&M)[kL][kL], int nt, int g, int t, uint32_t (&hi)[2],
                                                uint32_t (&lo)[2]) {
  const int n = 8 * nt + g;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int k = 2 * t + 8 * h;
    const bool in0 = kTransposed ? (kStrict ? k < n : k <= n) : (kStrict ? n < k : n <= k);
    const bool in1 = kTransposed ? (kStrict ? k + 1 < n : k + 1 <= n) : (kStrict ? n < k + 1 : n <= k + 1);
    const float x0 = kTransposed ? M[n][k] : M[k][n], x1 = kTransposed ? M[n][k + 1] : M[k + 1][n];
    const mma::Split split = mma::split_bf16x2(in0 ? x0 : 0.f, in1 ? x1 : 0.f);
    hi[h] = split.hi;
    lo[h] = split.lo;
  }
}

// d += A B (both C tiles of d) with B a masked [L][L] block's fragments (masked_fragment): A split (a_lo given) or
// exact in bf16 (V^T, dY^T: a_lo null).
template <bool kTransposed, bool kStrict>
__device__ __forceinline__ void add_times_masked(float (&d)[2][4], const uint32_t (&a)[4], const uint32_t (*a_lo)[4],
                                                 const float (&M)[kL][kL], int g, int t) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    uint32_t hi[2], lo[2];
    masked_fragment<kTransposed, kStrict>(M, nt, g, t, hi, lo);
    if (a_lo != nullptr) {
      mma::mma_split(d[nt], a, *a_lo, hi, lo);
    } else {
      mma::mma_exact_a(d[nt], a, hi, lo);
    }
  }
}

// U^T = (X^T + V^T Ak^T) T^T for 16 value rows (X^T = S A~^T in the forward, U0^T in the backward: two C tiles, added
// to in place; vt: V^T, exact in bf16), T = (I - Ab)^{-1}: the forward substitution as two products.
template <int N>
__device__ __forceinline__ void substitute_u_mma(float (&x)[2][4], const uint32_t (&vt)[4], const Shared<N>& sm, int g,
                                                 int t, float (&u)[2][4]) {
  add_times_masked<true, true>(x, vt, nullptr, sm.Ak, g, t);
  uint32_t x_hi[4], x_lo[4];
  a_fragment(x[0], x[1], x_hi, x_lo);
  add_times_masked<true, false>(u, x_hi, &x_lo, sm.T, g, t);
}

// precision="bf16": the block's VS value rows on bf16 tensor cores. Warp w < VS / 16 owns value rows v0 .. v0 + 15
// and computes, as 16-row transposed products (M = value rows, ropewkv/mma_bf16.cuh's fragments; lane = 4 g + t):
//   X^T = S A~^T + V^T Ak^T,  U^T = X^T T^T,  Y^T = S R~^T + U^T Qb^T + V^T Qk^T,
//   S <- S diag(E(L, 0)) + U^T B^ + V^T K^.
// The state is st[n] = the C tile of columns 8n .. 8n + 7: S[v0 + g (+8)][8n + 2t (+1)]; X^T, U^T, Y^T two C tiles
// each (chunk rows 0-7, 8-15), which are the A fragments of the next product. V^T is loaded straight into A
// fragments (exact in bf16: rounded on load in this mode); S, X, U and every shared operand are split into hi/lo.
// The masked blocks are zeroed outside their masks as their fragments are built (their shared entries there are
// never written). Unlike the fp32 form and the CPU twin, a non-finite v reaches earlier rows of its chunk through
// 0 x inf in those products (as in the Triton twin's tl.dot).
template <int N, int VS, typename io_t, Precision P>
struct MmaSlice {
  static_assert(VS % 16 == 0 && VS / 16 <= kThreads / 32 && N % VS == 0, "a warp per 16 value rows");
  static constexpr int kTiles = N / 8;  // C tiles of the state slice, 8 k columns each
  static constexpr bool kUsesInverse = true;

  bool active;  // the warp has value rows (at N = 32, warps 2 and 3 have none)
  int g, t, v0;
  float st[kTiles][4];
  uint32_t vt[4];  // V^T as an A fragment

  __device__ __forceinline__ MmaSlice(int thread, int first_row)
      : active(thread / 32 * 16 < VS), g(thread % 32 / 4), t(thread % 4), v0(first_row + thread / 32 * 16) {}

  // Element i of a C tile: row (value) g + 8 (i / 2), column 2 t + i % 2 (+ the tile's first column).
  __device__ __forceinline__ int row(int i) const { return v0 + g + 8 * (i / 2); }
  __device__ __forceinline__ int column(int i) const { return 2 * t + i % 2; }

  __device__ __forceinline__ void load_initial(const float* s0) {
    if (!active) return;
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) st[n][i] = s0 ? s0[int64_t(row(i)) * N + 8 * n + column(i)] : 0.f;
  }
  __device__ __forceinline__ void store_checkpoint(float* slot) const {  // k-major: 8 lanes store 32 bytes
    if (!active) return;
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) slot[int64_t(8 * n + column(i)) * N + row(i)] = st[n][i];
  }
  __device__ __forceinline__ void store_final(float* state) const {
    if (!active) return;
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) state[int64_t(row(i)) * N + 8 * n + column(i)] = st[n][i];
  }
  // vt[i] = V^T[v0 + g + 8 (i % 2)][chunk rows 2t + 8 (i / 2), + 1]: A fragment register i.
  __device__ __forceinline__ void load_values(const io_t* v, TokenIndex at, int64_t q, int len) {
    if (!active) return;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float pair[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int l = 2 * t + 8 * (i / 2) + e;
        const float x = wkv7::load<P>(v[at.clamped(q, l, len) + v0 + g + 8 * (i % 2)]);
        pair[e] = l < len ? x : 0.f;
      }
      vt[i] = mma::pack_bf16x2(pair[0], pair[1]);
    }
  }

  // d[p] = S M_p^T ([v][l], both C tiles) for kProducts [L][N] blocks M_p, over k in steps of 16: the state's tiles
  // 2kk, 2kk + 1 as one split A fragment serve every product; B register h: M_p[8 nt + g][16 kk + 2t + 8h, + 1].
  template <int kProducts>
  __device__ __forceinline__ void state_times_transposed(
      float (&d)[kProducts][2][4], const float (*const (&M)[kProducts])[Shared<N>::kRow]) const {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
      uint32_t s_hi[4], s_lo[4];
      a_fragment(st[2 * kk], st[2 * kk + 1], s_hi, s_lo);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int p = 0; p < kProducts; ++p) {
          uint32_t m_hi[2], m_lo[2];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const mma::Split m = split2(&M[p][8 * nt + g][16 * kk + 2 * t + 8 * h]);
            m_hi[h] = m.hi, m_lo[h] = m.lo;
          }
          mma::mma_split(d[p][nt], s_hi, s_lo, m_hi, m_lo);
        }
    }
  }

  __device__ __forceinline__ void step(const Shared<N>& sm, io_t* y, TokenIndex at, int64_t q, int len) {
    if (!active) return;
    // X^T = S A~^T, Y^T = S R~^T.
    float xy[2][2][4] = {};
    state_times_transposed<2>(xy, {sm.a, sm.r});
    float(&x)[2][4] = xy[0];
    float(&yv)[2][4] = xy[1];
    // U^T = (X^T + V^T Ak^T) T^T.
    float u[2][4] = {};
    substitute_u_mma(x, vt, sm, g, t, u);
    // Y^T += U^T Qb^T + V^T Qk^T, stored where the chunk has the token.
    uint32_t u_hi[4], u_lo[4];
    a_fragment(u[0], u[1], u_hi, u_lo);
    add_times_masked<true, false>(yv, u_hi, &u_lo, sm.Qb, g, t);
    add_times_masked<true, false>(yv, vt, nullptr, sm.Qk, g, t);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int l = 8 * nt + column(i);
        if (l < len) y[at(q + l) + row(i)] = wkv7::store<io_t, P>(yv[nt][i]);
      }
    update_state(sm, u_hi, u_lo, sm.b, sm.k);
  }

  // S <- S diag(E(L, 0)) + X^T M + V^T M' for the [v][l] block X^T (its A fragment, split) and [L][N] blocks M, M'
  // (the step: U^T, B^, K^; the backward's state pass: Z^T, W, R'), per tile of 8 k columns: B fragments
  // M[2t (+1) (+8)][8n + g].
  __device__ __forceinline__ void update_state(const Shared<N>& sm, const uint32_t (&x_hi)[4],
                                               const uint32_t (&x_lo)[4], const float (&M)[kL][Shared<N>::kRow],
                                               const float (&M_v)[kL][Shared<N>::kRow]) {
#pragma unroll
    for (int n = 0; n < kTiles; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) st[n][i] *= sm.decay_all[8 * n + column(i)];
      uint32_t m_hi[2], m_lo[2], mv_hi[2], mv_lo[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int l = 2 * t + 8 * h, k = 8 * n + g;
        const mma::Split m = mma::split_bf16x2(M[l][k], M[l + 1][k]);
        const mma::Split mv = mma::split_bf16x2(M_v[l][k], M_v[l + 1][k]);
        m_hi[h] = m.hi, m_lo[h] = m.lo, mv_hi[h] = mv.hi, mv_lo[h] = mv.lo;
      }
      mma::mma_split(st[n], x_hi, x_lo, m_hi, m_lo);
      mma::mma_exact_a(st[n], vt, mv_hi, mv_lo);
    }
  }
};

// The blocks per SM that the forward's __launch_bounds__ asks for (0: left to ptxas). At N = 64 the bf16 mode fits
// 128 registers without spilling (left to itself it took 128-134: 3 blocks per SM, B8 H64's 512 blocks in 2 waves);
// 4 blocks per SM run them in one wave, which halves the chain's upper bound. At 128 registers the fp32 mode spilled
// 52-76 B (N = 64; 40-96 B with its 16 values of V staged in shared memory or Y0 summed a token at a time) and
// N = 128's bf16 mode 236-248 B.
template <int N, Precision P>
inline constexpr int kForwardMinBlocks = N == 64 && P == Precision::kBF16 ? 4 : 0;

template <int N, typename io_t, typename w_t, Precision P>
__global__ void __launch_bounds__(kThreads, kForwardMinBlocks<N, P>) chunked_forward_kernel(const Wkv7ForwardParams p) {
  constexpr int VS = kValueSlice<N, P>;  // the launch's grid axis 1 holds N / VS slices
  using Slice = std::conditional_t<P == Precision::kBF16, MmaSlice<N, VS, io_t, P>, SimtSlice<N, VS, io_t, P>>;
  __shared__ Shared<N> sm;
  const int t = threadIdx.x;
  const int64_t task = blockIdx.x;  // = s * heads + h: the index into [n_seqs, H] states
  TokenIndex at{0, p.size.seqlen, p.size.heads, task % p.size.heads, N};
  int64_t start, stop;
  wkv7::sequence_range(p.size.cu_seqlens, task / p.size.heads, p.size.seqlen, at.batch, start, stop);
  io_t* y = static_cast<io_t*>(p.y);

  Slice slice(t, int(blockIdx.y) * VS);
  slice.load_initial(p.initial_state ? p.initial_state + task * N * int64_t(N) : nullptr);
  for (int64_t q = start; q < stop;) {
    const int64_t chunk_end = q - q % kL + kL < stop ? q - q % kL + kL : stop;
    const int len = int(chunk_end - q);
    if (p.checkpoints != nullptr && q % kL == 0) {  // the state before the chunk
      slice.store_checkpoint(p.checkpoints + chunk_slot(p.size, at, q) * N * int64_t(N));
    }
    prepare_chunk<N, io_t, w_t, P>(sm, p, at, q, len, t,
                                   [&] { slice.load_values(static_cast<const io_t*>(p.v), at, q, len); });
    if constexpr (Slice::kUsesInverse) {  // on the last 16 threads, idle in scale_rows below N = 128
      if (t >= kThreads - kL) invert_unit_lower(sm, t - (kThreads - kL));
    }
    __syncthreads();
    slice.step(sm, y, at, q, len);
    q = chunk_end;
  }
  slice.store_final(p.final_state + task * N * int64_t(N));
}

}  // namespace wkv7_chunked_detail
}  // namespace ropewkv::cuda
