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
// Decays inside a chunk are running products of the per-token decays, as in the CPU twin (E[x][y] = d_{y+1} ... d_x,
// one multiply per step over exactly that range): never a division, never an exp of a cumulative sum. The decays
// themselves go through expf (wkv7::decay_of), not __expf.
#include <cstdint>

#include "ropewkv/precision.h"
#include "ropewkv/wkv7.h"
#include "ropewkv/wkv7_cuda.h"

namespace ropewkv::cuda {
namespace wkv7_chunked_detail {

using wkv7::Decay;

inline constexpr int kL = wkv7::kCheckpointEvery;  // the chunk (wkv7::chunked::kChunk): one checkpoint per chunk
inline constexpr int kThreads = 128;

// The value rows per block (the state slice a block keeps, N / (kThreads / VS) floats a thread). Every block
// recomputes the chunk's v-independent part (loads, decays, masked products), so the widest slice whose state fits
// the registers costs least in all: the whole head at N = 32 and 64 (one block per (sequence, head); at N = 64, 49K
// SASS instructions per token-head against 78K for two slices of 32), 32 rows at N = 128, whose 32 state floats a
// thread already take 182-188 registers (benchmarks/NOTES.md, "Chunked WKV7", for the counts).
template <int N>
inline constexpr int kValueSlice = N == 64 ? 64 : 32;

// The threads' two roles. (1) The v-dependent products: thread t owns value row v of the slice (kSegs threads per
// row, in one warp, kVPerWarp rows per warp) and k columns j = 4 (kSegs g + seg) + e, g < kGroups, e < 4: 16-byte
// shared loads, consecutive segments on consecutive lanes (no bank conflict), the row sums reduced by shuffles.
// (2) The masked products Ab, Ak, Qb, Qk: 16 lanes per pair of chunk rows {x, L + 1 - x} (17 decayed dots between
// them: every lane the same trip count), lane c taking columns j = c + 16 i, i < kCols, reduced by shuffles.
template <int N, int VS>
struct Layout {
  static_assert(kThreads % VS == 0 && N % VS == 0, "the value slice must divide N and the block");
  static constexpr int kSegs = kThreads / VS;
  static constexpr int kVPerWarp = 32 / kSegs;
  static_assert(kVPerWarp * kSegs == 32, "a value row's threads must lie in one warp");
  static constexpr int kGroups = N / (4 * kSegs);
  static_assert(kGroups * 4 * kSegs == N, "N must be a multiple of 4 x the threads per value row");
  static constexpr int kPairLanes = 16;
  static_assert(kThreads == kL / 2 * kPairLanes, "one 16-lane group per pair of chunk rows");
  static constexpr int kCols = N / kPairLanes;
  static_assert(N <= kThreads, "a thread per k column scales the rows");
  static_assert(kL * N % kThreads == 0, "the threads load a chunk's rows in whole passes");
};

// The chunk's v-independent quantities, fp32, [row][k]. r, a, b, k become R~, A~, B^, K^ in place once the masked
// products are formed.
template <int N>
struct Shared {
  alignas(16) float r[kL][N], k[kL][N], a[kL][N], b[kL][N], d[kL][N];
  alignas(16) float decay_all[N];  // E[L][0]: the chunk's whole decay per k
  alignas(16) float Ab[kL][kL], Ak[kL][kL], Qb[kL][kL], Qk[kL][kL];  // written and read inside their masks only
};

struct alignas(16) Float4 {
  float x[4];
};

__device__ __forceinline__ Float4 load4(const float* p) { return *reinterpret_cast<const Float4*>(p); }

// The sum of x over the lanes whose index differs in the bits of [from, to) (masks from, 2 from, ... < to).
template <int kFrom, int kTo>
__device__ __forceinline__ float lane_sum(float x) {
#pragma unroll
  for (int m = kFrom; m < kTo; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

template <int N, int VS, typename io_t, typename w_t, Precision P>
__global__ void __launch_bounds__(kThreads) chunked_forward_kernel(const Wkv7ForwardParams p) {
  using Lay = Layout<N, VS>;
  constexpr int kSegs = Lay::kSegs, kGroups = Lay::kGroups, kCols = Lay::kCols;
  __shared__ Shared<N> sm;
  const int t = threadIdx.x, lane = t % 32;
  const int64_t task = blockIdx.x;  // = s * heads + h: the index into [n_seqs, H] states
  const int64_t h = task % p.size.heads;
  int64_t batch, start, stop;
  wkv7::sequence_range(p.size.cu_seqlens, task / p.size.heads, p.size.seqlen, batch, start, stop);
  const Decay decay = static_cast<Decay>(p.size.decay);
  const io_t* r = static_cast<const io_t*>(p.r);
  const w_t* w = static_cast<const w_t*>(p.w);
  const io_t *k = static_cast<const io_t*>(p.k), *v = static_cast<const io_t*>(p.v);
  const io_t *a = static_cast<const io_t*>(p.a), *b = static_cast<const io_t*>(p.b);
  io_t* y = static_cast<io_t*>(p.y);
  const auto token_index = [&](int64_t q) { return ((batch * p.size.seqlen + q) * p.size.heads + h) * N; };

  // Role (1): value row vi of the state, columns col(g, e).
  const int seg = lane / Lay::kVPerWarp;
  const int vi = int(blockIdx.y) * VS + t / 32 * Lay::kVPerWarp + lane % Lay::kVPerWarp;
  const auto col = [&](int g, int e) { return 4 * (kSegs * g + seg) + e; };
  // Role (2): chunk rows x_first = pair + 1 and x_second = L - pair (1-based token positions), columns c + 16 i.
  const int pair = t / Lay::kPairLanes, c = t % Lay::kPairLanes;
  const int x_first = pair + 1, x_second = kL - pair;

  float st[kGroups][4];  // S[vi][col(g, e)]
  const float* s0 = p.initial_state ? p.initial_state + (task * N + vi) * int64_t(N) : nullptr;
#pragma unroll
  for (int g = 0; g < kGroups; ++g)
#pragma unroll
    for (int e = 0; e < 4; ++e) st[g][e] = s0 ? s0[col(g, e)] : 0.f;

  for (int64_t q = start; q < stop;) {
    const int64_t chunk_end = q - q % kL + kL < stop ? q - q % kL + kL : stop;
    const int len = int(chunk_end - q);
    if (p.checkpoints != nullptr && q % kL == 0) {  // the state before the chunk, k-major (as the sequential ops)
      float* slot = p.checkpoints + ((batch * p.size.chunks + q / kL) * p.size.heads + h) * int64_t(N) * N;
#pragma unroll
      for (int g = 0; g < kGroups; ++g)
#pragma unroll
        for (int e = 0; e < 4; ++e) slot[int64_t(col(g, e)) * N + vi] = st[g][e];
    }
    __syncthreads();  // the previous chunk's readers of sm are done

    // The chunk's inputs, widened (bf16-rounded first in the bf16 mode); rows past the chunk zero, decay 1. They read
    // the chunk's last row and drop it, so that the loads need no branch.
#pragma unroll
    for (int i = 0; i < kL * N / kThreads; ++i) {
      const int l = (t + kThreads * i) / N, j = (t + kThreads * i) % N;
      const bool in_chunk = l < len;
      const int64_t idx = token_index(q + (in_chunk ? l : len - 1)) + j;
      const float rv = wkv7::load<P>(r[idx]), kv = wkv7::load<P>(k[idx]);
      const float av = wkv7::load<P>(a[idx]), bv = wkv7::load<P>(b[idx]);
      const float dv = wkv7::decay_of(wkv7::load<wkv7::kDecayMode<P, io_t>>(w[idx]), decay);
      sm.r[l][j] = in_chunk ? rv : 0.f;
      sm.k[l][j] = in_chunk ? kv : 0.f;
      sm.a[l][j] = in_chunk ? av : 0.f;
      sm.b[l][j] = in_chunk ? bv : 0.f;
      sm.d[l][j] = in_chunk ? dv : 1.f;
    }
    float vv[kL];  // V[:, vi]
#pragma unroll
    for (int l = 0; l < kL; ++l) {
      const float x = wkv7::load<P>(v[token_index(q + (l < len ? l : len - 1)) + vi]);
      vv[l] = l < len ? x : 0.f;
    }
    __syncthreads();

    // The masked products. With 1-based positions 1 <= y <= x <= L and E(x, y) = d_{y+1} ... d_x:
    //   Ab[x][y-1] = sum_j a_x b_{y-1} E(x, y)  (x < L)     Qb[x-1][y-1] = sum_j r_{x-1} b_{y-1} E(x, y),
    // Ak, Qk the same with k (rows 0-based; a_x is chunk row x, the token after position x). For each x, y runs down
    // from x with E(x, x) = 1 and E(x, y - 1) = E(x, y) d_y (d_y: chunk row y - 1).
    {
      float ax[kCols], rx[kCols], ex[kCols];
#pragma unroll 1
      for (int step = 0; step < kL + 1; ++step) {
        const bool first = step < x_first;
        const int x = first ? x_first : x_second;
        const int yy = first ? x_first - step : x_second - (step - x_first);
        if (step == 0 || step == x_first) {
#pragma unroll
          for (int i = 0; i < kCols; ++i) {
            const int j = c + Lay::kPairLanes * i;
            ax[i] = x < kL ? sm.a[x][j] : 0.f;
            rx[i] = sm.r[x - 1][j];
            ex[i] = 1.f;
          }
        }
        float sab = 0.f, sak = 0.f, sqb = 0.f, sqk = 0.f;
#pragma unroll
        for (int i = 0; i < kCols; ++i) {
          const int j = c + Lay::kPairLanes * i;
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
    __syncthreads();

    // The scaled rows, in place, by running products down each k column: A~_l = a_l E(l, 0), R~_l = r_l E(l+1, 0),
    // B^_l = b_l E(L, l+1), K^_l = k_l E(L, l+1); and E(L, 0).
    if (t < N) {
      const int j = t;
      float before = 1.f;
#pragma unroll
      for (int l = 0; l < kL; ++l) {
        sm.a[l][j] *= before;
        before *= sm.d[l][j];
        sm.r[l][j] *= before;
      }
      sm.decay_all[j] = before;
      float rest = 1.f;
#pragma unroll
      for (int l = kL - 1; l >= 0; --l) {
        sm.b[l][j] *= rest;
        sm.k[l][j] *= rest;
        rest *= sm.d[l][j];
      }
    }
    __syncthreads();

    // U0 = A~ S0^T and Y0 = R~ S0^T for row vi: partial sums over this thread's columns, then over the row's lanes.
    float u[kL], yv[kL];
#pragma unroll
    for (int l = 0; l < kL; ++l) u[l] = yv[l] = 0.f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
#pragma unroll
      for (int l = 0; l < kL; ++l) {
        const Float4 at = load4(&sm.a[l][col(g, 0)]), rt = load4(&sm.r[l][col(g, 0)]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          u[l] = fmaf(at.x[e], st[g][e], u[l]);
          yv[l] = fmaf(rt.x[e], st[g][e], yv[l]);
        }
      }
    }
#pragma unroll
    for (int l = 0; l < kL; ++l) {
      u[l] = lane_sum<Lay::kVPerWarp, 32>(u[l]);
      yv[l] = lane_sum<Lay::kVPerWarp, 32>(yv[l]);
    }
    // U = U0 + Ab U + Ak V: forward substitution (I - Ab is unit lower triangular: no division).
    // (Rows of Ab, Ak, Qb, Qk are read 4 entries at a time; the entries past the mask are never used.)
#pragma unroll
    for (int l = 1; l < kL; ++l) {
#pragma unroll
      for (int m4 = 0; m4 < l; m4 += 4) {
        const Float4 ab = load4(&sm.Ab[l][m4]), ak = load4(&sm.Ak[l][m4]);
#pragma unroll
        for (int e = 0; e < 4 && m4 + e < l; ++e) u[l] = fmaf(ab.x[e], u[m4 + e], fmaf(ak.x[e], vv[m4 + e], u[l]));
      }
    }
    // Y = Y0 + Qb U + Qk V; each of the row's kSegs lanes stores every kSegs-th token.
#pragma unroll
    for (int l = 0; l < kL; ++l) {
#pragma unroll
      for (int m4 = 0; m4 <= l; m4 += 4) {
        const Float4 qb = load4(&sm.Qb[l][m4]), qk = load4(&sm.Qk[l][m4]);
#pragma unroll
        for (int e = 0; e < 4 && m4 + e <= l; ++e)
          yv[l] = fmaf(qb.x[e], u[m4 + e], fmaf(qk.x[e], vv[m4 + e], yv[l]));
      }
      if (l < len && l % kSegs == seg) y[token_index(q + l) + vi] = wkv7::store<io_t, P>(yv[l]);
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
    q = chunk_end;
  }
  float* final_row = p.final_state + (task * N + vi) * int64_t(N);
#pragma unroll
  for (int g = 0; g < kGroups; ++g)
#pragma unroll
    for (int e = 0; e < 4; ++e) final_row[col(g, e)] = st[g][e];
}

}  // namespace wkv7_chunked_detail
}  // namespace ropewkv::cuda
