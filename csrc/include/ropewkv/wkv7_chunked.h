#pragma once
// RWKV-7 WKV in chunked form: the math of one chunk of L <= kChunk tokens, forward and backward, shared by the CPU
// twin (csrc/wkv7/wkv7_chunked_cpu.cpp). The derivation, with where each fp32 quantity lives in every twin, is
// python/ropewkv/ops/rwkv7/chunked.md; the symbols below are its symbols.
//
// The state is kept transposed here, ST[k][v] = S[v][k] (k-major), so that every product with the state is a sum of
// rows of ST scaled by scalars (an axpy over the contiguous v index, which vectorises without horizontal sums).
//
// Inside a chunk, c[x] = sum_{t <= x} log d_t (c[0] = 0, x = 0..L) and every decay between two positions is
// E[x][y] = exp(c[x] - c[y]) = d_{y+1} ... d_x with x >= y, in (0, 1]: formed here as a running product over exactly
// that index range. No cumulative decay is ever divided by.
#include <vector>

#include "ropewkv/wkv7.h"

namespace ropewkv::wkv7::chunked {

inline constexpr int kChunk = kCheckpointEvery;  // the chunk is the checkpoint interval: one saved state per chunk

// C[m][:] += sum_k A(m, k) B[k][:] for m < rows, over n_cols (a multiple of kCols) contiguous columns: A(m, k) =
// A[m * lda + k], or A[k * lda + m] when a_transposed. Register-blocked (4 rows x kCols columns of C held in locals
// across the k loop, one fma per entry and step) so that the compiler keeps the block in vector registers: the chunk's
// products with the state, whose sequential counterparts are load-bound row loops.
template <int kCols = 16, typename acc_t>
void gemm_acc(acc_t* C, int64_t ldc, const acc_t* A, int64_t lda, bool a_transposed, const acc_t* B, int64_t ldb,
              int64_t rows, int64_t depth, int64_t n_cols) {
  constexpr int kRows = 4;
  const int64_t row_step = a_transposed ? 1 : lda, depth_step = a_transposed ? lda : 1;
  // Column panels outermost: a panel of B (depth x kCols) is read once per row block, from L1 after the first.
  for (int64_t c0 = 0; c0 < n_cols; c0 += kCols) {
    for (int64_t m0 = 0; m0 < rows; m0 += kRows) {
      const int mr = int(rows - m0 < kRows ? rows - m0 : kRows);
      const acc_t* a0 = A + m0 * row_step;
      acc_t acc[kRows][kCols] = {};
      if (mr == kRows) {  // the full block: every trip count a constant, so acc stays in registers
        for (int64_t kk = 0; kk < depth; ++kk) {
          const acc_t* brow = B + kk * ldb + c0;
          const acc_t* ak = a0 + kk * depth_step;
          for (int mm = 0; mm < kRows; ++mm) {
            const acc_t x = ak[mm * row_step];
            ROPEWKV_SIMD
            for (int cc = 0; cc < kCols; ++cc) acc[mm][cc] = std::fma(x, brow[cc], acc[mm][cc]);
          }
        }
      } else {
        for (int64_t kk = 0; kk < depth; ++kk) {
          const acc_t* brow = B + kk * ldb + c0;
          const acc_t* ak = a0 + kk * depth_step;
          for (int mm = 0; mm < mr; ++mm) {
            const acc_t x = ak[mm * row_step];
            ROPEWKV_SIMD
            for (int cc = 0; cc < kCols; ++cc) acc[mm][cc] = std::fma(x, brow[cc], acc[mm][cc]);
          }
        }
      }
      for (int mm = 0; mm < mr; ++mm) {
        acc_t* crow = C + (m0 + mm) * ldc + c0;
        ROPEWKV_SIMD
        for (int cc = 0; cc < kCols; ++cc) crow[cc] += acc[mm][cc];
      }
    }
  }
}

// The masked decay products split the chunk into blocks of kBlock rows: pairs inside a block are decayed dots, pairs
// across blocks go through the later block's first row q as blocked products (Chunk::prepare).
inline constexpr int kBlock = 4;

template <typename acc_t>
struct Chunk {
  int64_t n;
  int len = 0;
  // Per token (row l of an L x n block): the inputs (loaded, bf16-rounded in the bf16 mode) and dlog = dlog(d)/dw.
  std::vector<acc_t> r, k, v, a, b, logd, dlog;
  std::vector<acc_t> d;        // L x n decays
  std::vector<acc_t> E;        // the lower triangle x >= y of E[x][y] = exp(c[x] - c[y]), (L+1)(L+2)/2 rows of n
  std::vector<acc_t> At, Rt;   // A~[l] = a_l e^{c[l]},  R~[l] = r_l e^{c[l+1]}
  std::vector<acc_t> Bh, Kh;   // B^[l] = b_l e^{c[L] - c[l+1]},  K^[l] = k_l e^{c[L] - c[l+1]}
  std::vector<acc_t> Ab, Ak;   // L x L, m < l:  sum_j a_l[j] {b,k}_m[j] E[l][m+1][j]
  std::vector<acc_t> Qb, Qk;   // L x L, m <= l: sum_j r_l[j] {b,k}_m[j] E[l+1][m+1][j]
  std::vector<acc_t> U;        // L x n: u_l = S_{l-1} a_l (the sequential form's sa)
  std::vector<acc_t> tmp;
  std::vector<acc_t> tmp_rows;  // L x n scratch
  // One block's rows against the earlier rows (prepare, masked_backward): X = the block's a and r rows scaled to its
  // first row q (2 kBlock x n; XT its transpose), Y = the earlier b and k rows scaled from q (2q x n), C = Y X^T, and
  // the cotangents dX, dY.
  std::vector<acc_t> X, XT, Y, C, dX, dY;

  explicit Chunk(int64_t n_)
      : n(n_), r(kChunk * n_), k(kChunk * n_), v(kChunk * n_), a(kChunk * n_), b(kChunk * n_), logd(kChunk * n_),
        dlog(kChunk * n_), d(kChunk * n_), E((kChunk + 1) * (kChunk + 2) / 2 * n_), At(kChunk * n_),
        Rt(kChunk * n_), Bh(kChunk * n_), Kh(kChunk * n_), Ab(kChunk * kChunk), Ak(kChunk * kChunk),
        Qb(kChunk * kChunk), Qk(kChunk * kChunk), U(kChunk * n_), tmp(n_), tmp_rows(kChunk * n_),
        X(2 * kBlock * n_), XT(2 * kBlock * n_), Y(2 * kChunk * n_), C(2 * kChunk * 2 * kBlock), dX(2 * kBlock * n_),
        dY(2 * kChunk * n_) {}

  acc_t* e(int x, int y) { return &E[(int64_t(x) * (x + 1) / 2 + y) * n]; }

  // Everything that does not depend on the state: decays, scaled rows and the four masked decay products.
  // (sum_j x_j e_j b_j, sum_j x_j e_j k_j): a row x times the pair decay e against b and k, in one pass.
  void decayed_dots(const acc_t* x, const acc_t* e_row, const acc_t* bm, const acc_t* km, acc_t* sb_out,
                    acc_t* sk_out) const {
    acc_t sb = 0, sk = 0;
    ROPEWKV_PRAGMA(omp simd reduction(+ : sb, sk))
    for (int64_t j = 0; j < n; ++j) {
      const acc_t xe = x[j] * e_row[j];
      sb += xe * bm[j];
      sk += xe * km[j];
    }
    *sb_out = sb;
    *sk_out = sk;
  }

  void prepare() {
    // E[x][y] = d_{y+1} ... d_x as a running product over exactly that range (E[x][x] = 1): one multiply per entry
    // instead of an exp, each factor the decay the sequential form multiplies by.
    for (int l = 0; l < len; ++l) {
      ROPEWKV_SIMD
      for (int64_t j = 0; j < n; ++j) d[l * n + j] = exp_(logd[l * n + j]);
    }
    for (int x = 0; x <= len; ++x) {
      acc_t* exx = e(x, x);
      for (int64_t j = 0; j < n; ++j) exx[j] = acc_t(1);
      for (int y = x - 1; y >= 0; --y) {
        acc_t *exy = e(x, y), *prev = e(x, y + 1);
        const acc_t* dy = &d[y * n];  // d_{y+1}: token row y
        ROPEWKV_SIMD
        for (int64_t j = 0; j < n; ++j) exy[j] = prev[j] * dy[j];
      }
    }
    for (int l = 0; l < len; ++l) {
      const acc_t *e_before = e(l, 0), *e_after = e(l + 1, 0), *e_rest = e(len, l + 1);
      ROPEWKV_SIMD
      for (int64_t j = 0; j < n; ++j) {
        At[l * n + j] = a[l * n + j] * e_before[j];
        Rt[l * n + j] = r[l * n + j] * e_after[j];
        Bh[l * n + j] = b[l * n + j] * e_rest[j];
        Kh[l * n + j] = k[l * n + j] * e_rest[j];
      }
    }
    for (int q = 0; q < len; q += kBlock) {
      const int rows = std::min(kBlock, len - q);
      for (int l = q; l < q + rows; ++l) {
        for (int m = q; m <= l; ++m) {
          const acc_t *bm = &b[m * n], *km = &k[m * n];
          if (m < l) decayed_dots(&a[l * n], e(l, m + 1), bm, km, &Ab[l * kChunk + m], &Ak[l * kChunk + m]);
          decayed_dots(&r[l * n], e(l + 1, m + 1), bm, km, &Qb[l * kChunk + m], &Qk[l * kChunk + m]);
        }
      }
      if (q > 0) cross_block_products(q, rows);
    }
  }

  // X and Y for the block of `rows` rows from q (q > 0): rows c < rows of X are a_{q+c} E[q+c][q], rows kBlock + c
  // are r_{q+c} E[q+c+1][q]; rows m < q of Y are b_m E[q][m+1], rows q + m are k_m E[q][m+1]. For m < q <= x,
  // E[x][m+1] = E[x][q] E[q][m+1] (two running products over adjacent ranges), so X Y^T holds the block's Ab, Ak,
  // Qb, Qk entries against every earlier row. Rows of X past `rows` are zero.
  void scale_to_block(int q, int rows) {
    std::fill(X.begin(), X.end(), acc_t(0));
    for (int c = 0; c < rows; ++c) {
      const int l = q + c;
      const acc_t *ea = e(l, q), *er = e(l + 1, q);
      acc_t *xa = &X[c * n], *xr = &X[(kBlock + c) * n];
      ROPEWKV_SIMD
      for (int64_t j = 0; j < n; ++j) {
        xa[j] = a[l * n + j] * ea[j];
        xr[j] = r[l * n + j] * er[j];
      }
    }
    for (int m = 0; m < q; ++m) {
      const acc_t* eq = e(q, m + 1);
      acc_t *yb = &Y[m * n], *yk = &Y[(q + m) * n];
      ROPEWKV_SIMD
      for (int64_t j = 0; j < n; ++j) {
        yb[j] = b[m * n + j] * eq[j];
        yk[j] = k[m * n + j] * eq[j];
      }
    }
  }

  // The block's masked-product entries against the earlier rows: C = Y X^T (2q x 2 kBlock), a blocked product
  // over n with X^T as the column operand.
  void cross_block_products(int q, int rows) {
    constexpr int kCols = 2 * kBlock;
    scale_to_block(q, rows);
    for (int c = 0; c < kCols; ++c)
      for (int64_t j = 0; j < n; ++j) XT[j * kCols + c] = X[c * n + j];
    std::fill(C.begin(), C.begin() + 2 * q * kCols, acc_t(0));
    gemm_acc<kCols>(C.data(), kCols, Y.data(), n, false, XT.data(), kCols, 2 * q, n, kCols);
    for (int c = 0; c < rows; ++c) {
      const int l = q + c;
      for (int m = 0; m < q; ++m) {
        Ab[l * kChunk + m] = C[m * kCols + c];
        Ak[l * kChunk + m] = C[(q + m) * kCols + c];
        Qb[l * kChunk + m] = C[m * kCols + kBlock + c];
        Qk[l * kChunk + m] = C[(q + m) * kCols + kBlock + c];
      }
    }
  }

  // dst[l][:] (+)= sum_j coef[l][j] ST[j][:] for the chunk's rows: an L x n times n x n product, axpy form.
  void rows_times_state(acc_t* dst, const acc_t* coef, const acc_t* ST) const {
    gemm_acc(dst, n, coef, n, false, ST, n, len, n, n);
  }

  // Forward. ST: the state before the chunk (k-major), becomes the state after it. y: L x n outputs (fp32).
  void forward(acc_t* ST, acc_t* y) {
    solve_u(ST);
    forward_outputs(ST, y);
  }

  // U = (I - Ab)^{-1} (A~ S0^T + Ak V): forward substitution, row by row. ST: the state before the chunk.
  void solve_u(const acc_t* ST) {
    std::fill(U.begin(), U.begin() + len * n, acc_t(0));
    rows_times_state(U.data(), At.data(), ST);
    for (int l = 0; l < len; ++l) {
      acc_t* ul = &U[l * n];
      for (int m = 0; m < l; ++m) {
        const acc_t ab = Ab[l * kChunk + m], ak = Ak[l * kChunk + m];
        const acc_t *um = &U[m * n], *vm = &v[m * n];
        ROPEWKV_SIMD
        for (int64_t i = 0; i < n; ++i) ul[i] += ab * um[i] + ak * vm[i];
      }
    }
  }

  // Y and the state after the chunk, from U (solve_u already run on ST).
  void forward_outputs(acc_t* ST, acc_t* y) {
    // Y = R~ S0^T + Qb U + Qk V.
    std::fill(y, y + len * n, acc_t(0));
    rows_times_state(y, Rt.data(), ST);
    for (int l = 0; l < len; ++l) {
      acc_t* yl = y + l * n;
      for (int m = 0; m <= l; ++m) {
        const acc_t qb = Qb[l * kChunk + m], qk = Qk[l * kChunk + m];
        const acc_t *um = &U[m * n], *vm = &v[m * n];
        ROPEWKV_SIMD
        for (int64_t i = 0; i < n; ++i) yl[i] += qb * um[i] + qk * vm[i];
      }
    }
    // S_L^T = diag(e^{c[L]}) S0^T + B^T U + K^T V.
    const acc_t* decay_all = e(len, 0);
    for (int64_t j = 0; j < n; ++j) {
      acc_t* row = ST + j * n;
      const acc_t dj = decay_all[j];
      ROPEWKV_SIMD
      for (int64_t i = 0; i < n; ++i) row[i] *= dj;
    }
    gemm_acc(ST, n, Bh.data(), n, true, U.data(), n, n, len, n);
    gemm_acc(ST, n, Kh.data(), n, true, v.data(), n, n, len, n);
  }

  // The backward of one masked decay product M[l][m] = sum_j x_l[j] y_m[j] E[p(l)][m+1][j] (p(l) = l + shift,
  // pairs m + 1 <= p(l)), for its pairs inside a block (those prepare forms as decayed dots): dx += dM y E,
  // dy += dM^T x E, and the log-decay cotangent dc[p(l)] += x (dM y E), dc[m+1] -= y (dM^T x E).
  void masked_backward(const acc_t* dM, int shift, const acc_t* x, const acc_t* y, acc_t* dx, acc_t* dy,
                       acc_t* dc) {
    for (int l = 0; l < len; ++l) {
      const int p = l + shift;
      const acc_t* xl = x + l * n;
      std::fill(tmp.begin(), tmp.end(), acc_t(0));
      for (int m = l - l % kBlock; m + 1 <= p && m < len; ++m) {
        const acc_t g = dM[l * kChunk + m];
        const acc_t *ym = y + m * n, *epm = e(p, m + 1);
        acc_t* dym = dy + m * n;
        acc_t* dcm = dc + (m + 1) * n;
        ROPEWKV_SIMD
        for (int64_t j = 0; j < n; ++j) {
          const acc_t ge = g * epm[j];
          tmp[j] += ge * ym[j];
          const acc_t to_y = ge * xl[j];
          dym[j] += to_y;
          dcm[j] -= to_y * ym[j];
        }
      }
      acc_t *dxl = dx + l * n, *dcp = dc + p * n;
      ROPEWKV_SIMD
      for (int64_t j = 0; j < n; ++j) {
        dxl[j] += tmp[j];
        dcp[j] += tmp[j] * xl[j];
      }
    }
  }

  // The backward of the four masked products' pairs across blocks (cross_block_products): through C = Y X^T,
  // dX = dC^T Y and dY = dC X (as products with the cotangent blocks of Ab, Ak, Qb, Qk), then through the scalings
  // X = x E[x][q], Y = y E[q][m+1]: dx += dX E, dy += dY E, and dc[x] += X dX, dc[q] -= X dX, dc[q] += Y dY,
  // dc[m+1] -= Y dY.
  void cross_block_backward(const acc_t* dAb, const acc_t* dAk, const acc_t* dQb, const acc_t* dQk, acc_t* da,
                            acc_t* dr, acc_t* db, acc_t* dk, acc_t* dc) {
    for (int q = kBlock; q < len; q += kBlock) {
      const int rows = std::min(kBlock, len - q);
      scale_to_block(q, rows);
      std::fill(dX.begin(), dX.end(), acc_t(0));
      std::fill(dY.begin(), dY.begin() + 2 * q * n, acc_t(0));
      const acc_t *xa = X.data(), *xr = &X[kBlock * n], *yb = Y.data(), *yk = &Y[q * n];
      acc_t *dxa = dX.data(), *dxr = &dX[kBlock * n], *dyb = dY.data(), *dyk = &dY[q * n];
      const int64_t o = int64_t(q) * kChunk;  // the block's first row of each L x L cotangent
      gemm_acc(dxa, n, dAb + o, kChunk, false, yb, n, rows, q, n);
      gemm_acc(dxa, n, dAk + o, kChunk, false, yk, n, rows, q, n);
      gemm_acc(dxr, n, dQb + o, kChunk, false, yb, n, rows, q, n);
      gemm_acc(dxr, n, dQk + o, kChunk, false, yk, n, rows, q, n);
      gemm_acc(dyb, n, dAb + o, kChunk, true, xa, n, q, rows, n);
      gemm_acc(dyb, n, dQb + o, kChunk, true, xr, n, q, rows, n);
      gemm_acc(dyk, n, dAk + o, kChunk, true, xa, n, q, rows, n);
      gemm_acc(dyk, n, dQk + o, kChunk, true, xr, n, q, rows, n);
      acc_t* dcq = dc + q * n;
      for (int c = 0; c < rows; ++c) {
        const int l = q + c;
        const acc_t *ea = e(l, q), *er = e(l + 1, q);
        const int64_t xo = int64_t(c) * n, ro = int64_t(kBlock + c) * n;
        acc_t *dal = da + l * n, *drl = dr + l * n, *dcl = dc + l * n, *dcl1 = dc + (l + 1) * n;
        ROPEWKV_SIMD
        for (int64_t j = 0; j < n; ++j) {
          dal[j] += dX[xo + j] * ea[j];
          drl[j] += dX[ro + j] * er[j];
          const acc_t to_a = X[xo + j] * dX[xo + j], to_r = X[ro + j] * dX[ro + j];
          dcl[j] += to_a;
          dcl1[j] += to_r;
          dcq[j] -= to_a + to_r;
        }
      }
      for (int m = 0; m < q; ++m) {
        const acc_t* eq = e(q, m + 1);
        const int64_t bo = int64_t(m) * n, ko = int64_t(q + m) * n;
        acc_t *dbm = db + m * n, *dkm = dk + m * n, *dcm = dc + (m + 1) * n;
        ROPEWKV_SIMD
        for (int64_t j = 0; j < n; ++j) {
          dbm[j] += dY[bo + j] * eq[j];
          dkm[j] += dY[ko + j] * eq[j];
          const acc_t to_c = Y[bo + j] * dY[bo + j] + Y[ko + j] * dY[ko + j];
          dcq[j] += to_c;
          dcm[j] -= to_c;
        }
      }
    }
  }
};

// The gradient buffers of one chunk (L x n each, fp32) and the state cotangent carried across chunks.
template <typename acc_t>
struct ChunkGrads {
  int64_t n;
  std::vector<acc_t> dr, dk, dv, da, db, dlogd, dc, dU, dX, dAt, dRt, dBh, dKh, S, G, UT, VT, dAb, dAk, dQb, dQk;
  explicit ChunkGrads(int64_t n_)
      : n(n_), dr(kChunk * n_), dk(kChunk * n_), dv(kChunk * n_), da(kChunk * n_), db(kChunk * n_),
        dlogd(kChunk * n_), dc((kChunk + 1) * n_), dU(kChunk * n_), dX(kChunk * n_), dAt(kChunk * n_),
        dRt(kChunk * n_), dBh(kChunk * n_), dKh(kChunk * n_), S(n_ * n_), G(n_ * n_), UT(kChunk * n_), VT(kChunk * n_), dAb(kChunk * kChunk),
        dAk(kChunk * kChunk), dQb(kChunk * kChunk), dQk(kChunk * kChunk) {}
};

// dst[i][j] = src[j][i] for n x n matrices (n a multiple of 8), in 8 x 8 tiles: a row-by-row transpose writes a
// different cache line with every store.
template <typename acc_t>
void transpose(acc_t* dst, const acc_t* src, int64_t n) {
  constexpr int64_t kTile = 8;
  for (int64_t i0 = 0; i0 < n; i0 += kTile)
    for (int64_t j0 = 0; j0 < n; j0 += kTile)
      for (int64_t i = i0; i < i0 + kTile; ++i)
        for (int64_t j = j0; j < j0 + kTile; ++j) dst[i * n + j] = src[j * n + i];
}

template <typename acc_t>
ROPEWKV_HD acc_t dot_rows(const acc_t* x, const acc_t* y, int64_t n) {
  acc_t s = acc_t(0);
  ROPEWKV_SIMD_SUM(s)
  for (int64_t j = 0; j < n; ++j) s += x[j] * y[j];
  return s;
}

// Backward of one chunk. ch: prepared, with ch.solve_u already run on ST0 (so ch.U holds u). ST0: the state before
// the chunk (k-major). GT: dL/dS after the chunk, transposed (GT[k][v]); becomes dL/dS before it. dy: L x n.
// Fills g.dr, dk, dv, da, db and g.dlogd (the cotangent of log d per token).
template <typename acc_t>
void chunk_backward(Chunk<acc_t>& ch, const acc_t* ST0, acc_t* GT, const acc_t* dy, ChunkGrads<acc_t>& g) {
  const int64_t n = ch.n;
  const int len = ch.len;
  const int64_t ln = int64_t(len) * n;
  for (auto* buf : {&g.dr, &g.dk, &g.dv, &g.da, &g.db, &g.dU, &g.dAt, &g.dRt, &g.dBh, &g.dKh})
    std::fill(buf->begin(), buf->begin() + ln, acc_t(0));
  std::fill(g.dc.begin(), g.dc.begin() + (len + 1) * n, acc_t(0));
  // S0 in [v][k] layout, for the products with the state on the other side.
  transpose(g.S.data(), ST0, n);
  const acc_t* S0 = g.S.data();
  const acc_t* decay_all = ch.e(len, 0);

  // From S_L = S0 diag(e^{c[L]}) + U^T B^ + V^T K^:  dU = B^ G^T, dV = K^ G^T (rows of GT), dB^ = U G, dK^ = V G,
  // dc[L] += sum_v S0 G e^{c[L]}.
  ch.rows_times_state(g.dU.data(), ch.Bh.data(), GT);
  ch.rows_times_state(g.dv.data(), ch.Kh.data(), GT);
  for (int64_t j = 0; j < n; ++j) g.dc[len * n + j] = decay_all[j] * dot_rows(ST0 + j * n, GT + j * n, n);
  transpose(g.G.data(), GT, n);
  gemm_acc(g.dBh.data(), n, ch.U.data(), n, false, g.G.data(), n, len, n, n);
  gemm_acc(g.dKh.data(), n, ch.v.data(), n, false, g.G.data(), n, len, n, n);
  // From Y = R~ S0^T + Qb U + Qk V.
  // U^T, V^T (n x L) for the L x L products dY U^T, dY V^T, dX U^T, dX V^T as blocked products (entries outside
  // the masks are computed and never read).
  for (int l = 0; l < kChunk; ++l) {
    for (int64_t i = 0; i < n; ++i) {
      g.UT[i * kChunk + l] = l < len ? ch.U[l * n + i] : acc_t(0);
      g.VT[i * kChunk + l] = l < len ? ch.v[l * n + i] : acc_t(0);
    }
  }
  for (auto* buf : {&g.dQb, &g.dQk, &g.dAb, &g.dAk}) std::fill(buf->begin(), buf->end(), acc_t(0));
  gemm_acc(g.dQb.data(), kChunk, dy, n, false, g.UT.data(), kChunk, len, n, kChunk);
  gemm_acc(g.dQk.data(), kChunk, dy, n, false, g.VT.data(), kChunk, len, n, kChunk);
  for (int l = 0; l < len; ++l) {
    const acc_t* dyl = dy + l * n;
    for (int m = 0; m <= l; ++m) {
      const acc_t qb = ch.Qb[l * kChunk + m], qk = ch.Qk[l * kChunk + m];
      acc_t *dum = &g.dU[m * n], *dvm = &g.dv[m * n];
      ROPEWKV_SIMD
      for (int64_t i = 0; i < n; ++i) {
        dum[i] += qb * dyl[i];
        dvm[i] += qk * dyl[i];
      }
    }
  }
  ch.rows_times_state(g.dRt.data(), dy, S0);
  // Through U = X + Ab U: dX = (I - Ab)^{-T} dU (back substitution), dAb = dX U^T, dAk = dX V^T, dV += Ak^T dX,
  // dA~ = dX S0.
  for (int l = len - 1; l >= 0; --l) {
    acc_t* dxl = &g.dX[l * n];
    std::copy(&g.dU[l * n], &g.dU[l * n] + n, dxl);
    for (int m = l + 1; m < len; ++m) {
      const acc_t ab = ch.Ab[m * kChunk + l];
      const acc_t* dxm = &g.dX[m * n];
      ROPEWKV_SIMD
      for (int64_t i = 0; i < n; ++i) dxl[i] += ab * dxm[i];
    }
  }
  gemm_acc(g.dAb.data(), kChunk, g.dX.data(), n, false, g.UT.data(), kChunk, len, n, kChunk);
  gemm_acc(g.dAk.data(), kChunk, g.dX.data(), n, false, g.VT.data(), kChunk, len, n, kChunk);
  for (int l = 0; l < len; ++l) {
    const acc_t* dxl = &g.dX[l * n];
    for (int m = 0; m < l; ++m) {
      const acc_t ak = ch.Ak[l * kChunk + m];
      acc_t* dvm = &g.dv[m * n];
      ROPEWKV_SIMD
      for (int64_t i = 0; i < n; ++i) dvm[i] += ak * dxl[i];
    }
  }
  ch.rows_times_state(g.dAt.data(), g.dX.data(), S0);
  // The state cotangent before the chunk: G0^T = diag(e^{c[L]}) G^T + R~^T dY + A~^T dX.
  for (int64_t j = 0; j < n; ++j) {
    acc_t* row = GT + j * n;
    const acc_t dj = decay_all[j];
    ROPEWKV_SIMD
    for (int64_t i = 0; i < n; ++i) row[i] *= dj;
  }
  gemm_acc(GT, n, ch.Rt.data(), n, true, dy, n, n, len, n);
  gemm_acc(GT, n, ch.At.data(), n, true, g.dX.data(), n, n, len, n);
  // The masked products: Ab, Ak (x = a, p(l) = l), Qb, Qk (x = r, p(l) = l + 1).
  ch.masked_backward(g.dAb.data(), 0, ch.a.data(), ch.b.data(), g.da.data(), g.db.data(), g.dc.data());
  ch.masked_backward(g.dAk.data(), 0, ch.a.data(), ch.k.data(), g.da.data(), g.dk.data(), g.dc.data());
  ch.masked_backward(g.dQb.data(), 1, ch.r.data(), ch.b.data(), g.dr.data(), g.db.data(), g.dc.data());
  ch.masked_backward(g.dQk.data(), 1, ch.r.data(), ch.k.data(), g.dr.data(), g.dk.data(), g.dc.data());
  ch.cross_block_backward(g.dAb.data(), g.dAk.data(), g.dQb.data(), g.dQk.data(), g.da.data(), g.dr.data(),
                          g.db.data(), g.dk.data(), g.dc.data());
  // The scaled rows: A~ = a e^{c[l]}, R~ = r e^{c[l+1]}, B^ = b e^{c[L] - c[l+1]}, K^ likewise.
  for (int l = 0; l < len; ++l) {
    const acc_t *e_before = ch.e(l, 0), *e_after = ch.e(l + 1, 0), *e_rest = ch.e(len, l + 1);
    acc_t *dcb = &g.dc[l * n], *dca = &g.dc[(l + 1) * n], *dcl = &g.dc[len * n];
    const int64_t o = l * n;
    ROPEWKV_SIMD
    for (int64_t j = 0; j < n; ++j) {
      g.da[o + j] += g.dAt[o + j] * e_before[j];
      dcb[j] += g.dAt[o + j] * ch.At[o + j];
      g.dr[o + j] += g.dRt[o + j] * e_after[j];
      dca[j] += g.dRt[o + j] * ch.Rt[o + j];
      g.db[o + j] += g.dBh[o + j] * e_rest[j];
      g.dk[o + j] += g.dKh[o + j] * e_rest[j];
      const acc_t to_c = g.dBh[o + j] * ch.Bh[o + j] + g.dKh[o + j] * ch.Kh[o + j];
      dcl[j] += to_c;
      dca[j] -= to_c;
    }
  }
  // c[x] = sum_{t <= x} log d_t, so the cotangent of log d_l is the suffix sum of dc over x >= l + 1.
  for (int64_t j = 0; j < n; ++j) {
    acc_t sum = acc_t(0);
    for (int l = len - 1; l >= 0; --l) {
      sum += g.dc[(l + 1) * n + j];
      g.dlogd[l * n + j] = sum;
    }
  }
}

}  // namespace ropewkv::wkv7::chunked
