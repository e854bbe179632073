#pragma once
// CUDA kernels of the WKV7 ops, RWKV-LM style: one block per (sequence, head), the state in registers, row i owned
// by one thread or split over a few lanes (RowLanes). Torch-free and free of launch syntax, so that the host emulator
// runs them (tests/test_wkv7_cuda_on_host.py); launched by wkv7_launch.cuh, instantiated by one small .cu per head
// size.
#include <type_traits>

#include "ropewkv/cuda_common.cuh"
#include "ropewkv/wkv7.h"
#include "ropewkv/wkv7_cuda.h"
#include "ropewkv/wkv7_step_lanes.h"

namespace ropewkv::cuda {
namespace wkv7_detail {

using wkv7::Decay;
using wkv7::kCheckpointEvery;

struct Task {
  int64_t task, h, batch, start, end;
};

__device__ __forceinline__ Task task_of(const Wkv7Sizes& size) {
  Task t;
  t.task = blockIdx.x;  // = s * heads + h: the index into [n_seqs, H] states
  const int64_t s = t.task / size.heads;
  t.h = t.task % size.heads;
  wkv7::sequence_range(size.cu_seqlens, s, size.seqlen, t.batch, t.start, t.end);
  return t;
}

__device__ __forceinline__ int64_t token_index(const Wkv7Sizes& size, const Task& t, int64_t p, int n) {
  return ((t.batch * size.seqlen + p) * size.heads + t.h) * n;
}

template <int N>
__device__ __forceinline__ float* checkpoint_slot(float* ckpt, const Wkv7Sizes& size, const Task& t, int64_t p) {
  return ckpt + ((t.batch * size.chunks + p / kCheckpointEvery) * size.heads + t.h) * int64_t(N) * N;
}

// w as the kernel sees it (read at its own storage type w_t: fp32 beside bf16 r..b keeps the decay's precision).
template <Precision P, typename io_t, typename w_t>
__device__ __forceinline__ float load_w(const w_t* w, int64_t idx) {
  return wkv7::load<wkv7::kDecayMode<P, io_t>>(w[idx]);
}

// The sum of x over the row's L lanes, left in each of them (wkv7::butterfly_sum is its host replay).
template <int L>
__device__ __forceinline__ float lane_sum(float x) {
#pragma unroll
  for (int m = L / 2; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// A thread map with L threads per state row: thread (i, p) = threadIdx.x = i * L + p. Lane p owns kCols of the N
// columns of row i, the quads p, p + L, p + 2L, ... (4 adjacent columns each), so that a row's lanes store adjacent
// 16-byte quads; every sum over columns is L partial sums added by shuffles.
template <int N, int L, int MinBlocks>
struct RowLanes {
  static constexpr int kN = N;
  static constexpr int kLanes = L;
  static constexpr int kThreads = N * L;
  static constexpr int kCols = N / L;
  // The blocks per SM __launch_bounds__ asks for where the occupancy needs a register budget (0: left to ptxas, which
  // took 80 to 163 registers across the instantiations of one kernel at N = 64, spilling at some and halving the
  // blocks per SM at others).
  static constexpr int kMinBlocks = MinBlocks;
  static_assert(kCols % 4 == 0 && kThreads % 32 == 0);
  // Lane p's m-th column.
  __device__ __forceinline__ static int col(int p, int m) { return 4 * ((m / 4) * L + p) + m % 4; }
};

// The forward's: 2 lanes per row at N = 64, 4 blocks per SM (128 registers): twice the warps per scheduler of a
// thread per row (4 instead of 2 at B8 H64 N64) and half the dependent chain per token, for 2 shuffles per token.
// N = 32 and 128 keep a thread per row: at N = 128 its 176 registers give 2 blocks per SM (one wave for B8 H32), and
// 2 lanes of 64 columns spill at 128 registers.
template <int N>
using ForwardLanes = std::conditional_t<N == 64, RowLanes<N, 2, 4>, RowLanes<N, 1, 0>>;

// The backward's: 2 lanes per row at N = 32, 4 at N = 64 and 128 (16, 16 and 32 columns per thread), of row i of S
// and G and, as rows of the transposed copy, of column i of G. Each thread keeps its two copies of G in registers,
// and more warps sit on a scheduler to overlap one warp's scratch loads with another's dependent sums (with a thread
// per row, the N = 64 backward sat at 255 registers with 2 warps per scheduler, and N = 128 spilled ~1.8 KB). The
// blocks per SM are named so that ptxas gets 128 registers: left to itself it took 80 and spilled at N = 32. At
// N = 128, 8 lanes (1,024 threads of 64 registers) spilled 104-132 B; 4 lanes hold twice the columns per thread at
// twice the registers, and the per-thread addresses and loop state are paid for by half as many threads.
template <int N>
using BackwardLanes = RowLanes<N, N == 32 ? 2 : 4, N == 32 ? 8 : (N == 64 ? 2 : 1)>;

// Lane p's columns of row i of S, as 16-byte stores into a row-major N x N slot.
template <class Lanes>
__device__ __forceinline__ void store_row(float* state, int i, int p, const float* row) {
#pragma unroll
  for (int m = 0; m < Lanes::kCols; m += 4) {
    *reinterpret_cast<float4*>(state + i * Lanes::kN + Lanes::col(p, m)) =
        float4{row[m], row[m + 1], row[m + 2], row[m + 3]};
  }
}

// Lane p's columns of row i of the state at the start of the task's sequence (zeros without an initial state).
template <class Lanes>
__device__ __forceinline__ void load_initial_row(const float* initial_state, const Task& t, int i, int p, float* row) {
  constexpr int N = Lanes::kN;
#pragma unroll
  for (int m = 0; m < Lanes::kCols; ++m) {
    row[m] = initial_state ? initial_state[(t.task * N + i) * int64_t(N) + Lanes::col(p, m)] : 0.f;
  }
}

// sum_j x_j y_j over all N columns j, where lane p holds x at its columns (x[m] = x_{col(p, m)}) and y is a full
// vector in shared memory.
template <class Lanes>
__device__ __forceinline__ float row_dot(const float* x, const float* y, int p) {
  float sum = 0.f;
#pragma unroll
  for (int m = 0; m < Lanes::kCols; ++m) sum = fmaf(x[m], y[Lanes::col(p, m)], sum);
  return lane_sum<Lanes::kLanes>(sum);
}

// column_dot's unroll: 16 loads in flight (fully unrolled, N = 128 spilled 88-180 B).
inline constexpr int kColumnUnroll = 16;

// sum_j S[j][i] y_j for column i of a row-major state (column = state + i: the lanes of a warp read consecutive
// floats) and a full vector y in shared memory.
template <class Lanes>
__device__ __forceinline__ float column_dot(const float* column, const float* y, int p) {
  float sum = 0.f;
#pragma unroll kColumnUnroll
  for (int m = 0; m < Lanes::kCols; ++m) sum = fmaf(column[Lanes::col(p, m) * Lanes::kN], y[Lanes::col(p, m)], sum);
  return lane_sum<Lanes::kLanes>(sum);
}

// column_dot's sums of one column with x (held at the lane's columns, as in row_dot) and with y, in one pass; fully
// unrolled, as x lives in registers (column_dot unrolls by kColumnUnroll).
template <class Lanes>
__device__ __forceinline__ float2 column_dot2(const float* column, const float* x, const float* y, int p) {
  float sum_x = 0.f, sum_y = 0.f;
#pragma unroll
  for (int m = 0; m < Lanes::kCols; ++m) {
    const float c = column[Lanes::col(p, m) * Lanes::kN];
    sum_x = fmaf(x[m], c, sum_x);
    sum_y = fmaf(c, y[Lanes::col(p, m)], sum_y);
  }
  return {lane_sum<Lanes::kLanes>(sum_x), lane_sum<Lanes::kLanes>(sum_y)};
}

// Lane p's columns of row i become S_t's: S_{t-1}[i][j] d_j + sa_i b_j + v_i k_j.
template <class Lanes>
__device__ __forceinline__ void lane_update(float* row, const float* d, const float* k, const float* b, float sa,
                                            float v_i, int p) {
#pragma unroll
  for (int m = 0; m < Lanes::kCols; ++m) {
    const int j = Lanes::col(p, m);
    row[m] = fmaf(v_i, k[j], fmaf(sa, b[j], row[m] * d[j]));
  }
}

// One token for lane p's columns of row i (wkv7::step_row): its two sums (sa_i = a . S_i and y_i = r . S_i) run as 4
// independent FMA chains per lane, added pairwise, then across the row's lanes. Returns y_i.
template <class Lanes>
__device__ __forceinline__ float lane_step(float* row, const float* r, const float* d, const float* k, const float* a,
                                           const float* b, float v_i, int p) {
  constexpr int kParts = 4;
  float part[kParts] = {};
#pragma unroll
  for (int m = 0; m < Lanes::kCols; ++m) part[m % kParts] = fmaf(a[Lanes::col(p, m)], row[m], part[m % kParts]);
  const float sa = lane_sum<Lanes::kLanes>((part[0] + part[1]) + (part[2] + part[3]));
  lane_update<Lanes>(row, d, k, b, sa, v_i, p);
  float out[kParts] = {};
#pragma unroll
  for (int m = 0; m < Lanes::kCols; ++m) out[m % kParts] = fmaf(row[m], r[Lanes::col(p, m)], out[m % kParts]);
  return lane_sum<Lanes::kLanes>((out[0] + out[1]) + (out[2] + out[3]));
}

// Element i of the inputs of one step of the recurrence, widened (w through the decay mode, not yet a decay).
struct StepInputs {
  float w, k, v, a, b;
};

template <Precision P, typename io_t, typename w_t>
__device__ __forceinline__ StepInputs load_step(int64_t idx, const w_t* w, const io_t* k, const io_t* v,
                                                const io_t* a, const io_t* b) {
  return {load_w<P, io_t>(w, idx), wkv7::load<P>(k[idx]), wkv7::load<P>(v[idx]), wkv7::load<P>(a[idx]),
          wkv7::load<P>(b[idx])};
}

// A step's inputs and r: what the forward stages for one token.
struct TokenInputs {
  float r;
  StepInputs step;
};

template <Precision P, typename io_t, typename w_t>
__device__ __forceinline__ TokenInputs load_token(int64_t idx, const io_t* r, const w_t* w, const io_t* k,
                                                  const io_t* v, const io_t* a, const io_t* b) {
  return {wkv7::load<P>(r[idx]), load_step<P>(idx, w, k, v, a, b)};
}

// The forward (ForwardLanes; thread e < N loads and stages element e of the inputs, lane 0 of row i stores y_i).
// Token q's inputs are loaded while token q-1 is computed (their DRAM latency leaves the per-token chain), staged
// into one of two shared buffers (one barrier per token), and the row sums run as independent partial chains
// (lane_step).
template <int N, typename io_t, typename w_t, Precision P>
__global__ void __launch_bounds__(ForwardLanes<N>::kThreads, ForwardLanes<N>::kMinBlocks)
    forward_kernel(const Wkv7ForwardParams p) {
  using Lanes = ForwardLanes<N>;
  const Task t = task_of(p.size);
  const Decay decay = static_cast<Decay>(p.size.decay);
  const int i = threadIdx.x / Lanes::kLanes, lane = threadIdx.x % Lanes::kLanes;
  // The stagers are the first N / 32 warps, whole, so that the other warps skip their branches.
  const int e = threadIdx.x;
  const bool stager = e < N;
  const io_t* r = static_cast<const io_t*>(p.r);
  const w_t* w = static_cast<const w_t*>(p.w);
  const io_t *k = static_cast<const io_t*>(p.k), *v = static_cast<const io_t*>(p.v);
  const io_t *a = static_cast<const io_t*>(p.a), *b = static_cast<const io_t*>(p.b);
  io_t* y = static_cast<io_t*>(p.y);
  // Two buffers of the staged vectors, one base each: a buffer's arrays at immediate offsets from it (six arrays of
  // two buffers each took ~30 address instructions per token).
  enum Staged { kR, kD, kK, kV, kA, kB, kStaged };
  __shared__ __align__(16) float stage[2][kStaged][N];
  float row[Lanes::kCols];
  load_initial_row<Lanes>(p.initial_state, t, i, lane, row);
  TokenInputs next{};
  const int64_t stride = p.size.heads * N;  // between one token's rows and the next's
  int64_t token = token_index(p.size, t, t.start, N);
  if (stager && t.start < t.end) next = load_token<P>(token + e, r, w, k, v, a, b);
  for (int64_t q = t.start; q < t.end; ++q, token += stride) {
    if (p.checkpoints != nullptr && q % kCheckpointEvery == 0) {
      float* slot = checkpoint_slot<N>(p.checkpoints, p.size, t, q);
#pragma unroll
      for (int m = 0; m < Lanes::kCols; ++m) slot[Lanes::col(lane, m) * N + i] = row[m];  // transposed: coalesced
    }
    float(&cur)[kStaged][N] = stage[(q - t.start) & 1];
    if (stager) {
      cur[kR][e] = next.r;
      cur[kD][e] = wkv7::decay_of(next.step.w, decay);
      cur[kK][e] = next.step.k;
      cur[kV][e] = next.step.v;
      cur[kA][e] = next.step.a;
      cur[kB][e] = next.step.b;
    }
    __syncthreads();  // token q is staged, and every thread is past token q - 2, this buffer's last reader
    if (stager && q + 1 < t.end) next = load_token<P>(token + stride + e, r, w, k, v, a, b);
    const float yi = lane_step<Lanes>(row, cur[kR], cur[kD], cur[kK], cur[kA], cur[kB], cur[kV][i], lane);
    if (lane == 0) y[token + i] = wkv7::store<io_t, P>(yi);
  }
  store_row<Lanes>(p.final_state + t.task * int64_t(N) * N, i, lane, row);
}

// The backward's staged vectors, N floats each in shared memory. At N <= 64 one array, each vector at an immediate
// offset from its base: with an array each, every token rebuilt each array's address in a chain of uniform ops
// (~40 of the 701 instructions per thread-token at N = 64). N = 128 keeps an array each: with one base ptxas held
// more in registers there, and G spilled 40-68 B per token at the 128-register cap.
enum BackwardVector { kVecR, kVecW, kVecD, kVecK, kVecV, kVecA, kVecB, kVecDy, kVecDsa, kBackwardVectors };

template <int N>
__device__ __forceinline__ float (&backward_vectors())[kBackwardVectors][N] {
  __shared__ __align__(16) float vectors[kBackwardVectors][N];
  return vectors;
}

template <int N, BackwardVector V>
__device__ __forceinline__ float* backward_vector() {
  if constexpr (N <= 64) {
    return backward_vectors<N>()[V];
  } else {
    __shared__ __align__(16) float vector[N];
    return vector;
  }
}

// The backward: per chunk of kCheckpointEvery tokens (latest first), per sub-chunk of kSubChunk tokens in it (latest
// first: wkv7_backward_sub_chunk), recompute the chunk from its checkpoint up to the sub-chunk's end, keeping the
// sub-chunk's states in the block's scratch, then run the sub-chunk's adjoint steps (1.5 recompute steps per token
// at kSubChunk = 8, against 1 with whole chunks: the price of a scratch that stays in L2). Thread (i, p) keeps its
// columns (BackwardLanes) of row i of G (for dv, dsa) and of column i of G (for dk, db, dd), as RWKV-LM keeps whole
// ones, so that every sum is a per-thread loop plus log2(kLanes) shuffles. The scratch is row-major: the recompute
// stores rows (each row's lanes adjacent 16-byte quads), the adjoint reads two columns per token (S_t's, S_{t-1}'s),
// coalesced. (Transposed, as before the H100 run of 2026-11-26, each column read had the lanes 4 N bytes apart, one
// 32-byte L2 sector per 4-byte load: ~0.8 TB of L2 traffic at B8 T4096 H64 N64, 124 ms measured.) Thread e < N
// stages element e of each token's inputs in shared memory; lane 0 of row i stores element i of the gradients.
template <int N, typename io_t, typename w_t, Precision P>
__global__ void __launch_bounds__(BackwardLanes<N>::kThreads, BackwardLanes<N>::kMinBlocks)
    backward_kernel(const Wkv7BackwardParams p) {
  using Lanes = BackwardLanes<N>;
  constexpr int kCols = Lanes::kCols;
  const Task t = task_of(p.size);
  const Decay decay = static_cast<Decay>(p.size.decay);
  const int i = threadIdx.x / Lanes::kLanes, lane = threadIdx.x % Lanes::kLanes;
  // The stagers are the first N / 32 warps, whole, so that the other warps skip their branches.
  const int e = threadIdx.x;
  const bool stager = e < N;
  constexpr int64_t kNN = int64_t(N) * N;
  const io_t* r = static_cast<const io_t*>(p.r);
  const w_t* w = static_cast<const w_t*>(p.w);
  const io_t *k = static_cast<const io_t*>(p.k), *v = static_cast<const io_t*>(p.v);
  const io_t *a = static_cast<const io_t*>(p.a), *b = static_cast<const io_t*>(p.b);
  const io_t* gy = static_cast<const io_t*>(p.grad_y);
  io_t* gr = static_cast<io_t*>(p.grad_r);
  w_t* gw = static_cast<w_t*>(p.grad_w);
  io_t *gk = static_cast<io_t*>(p.grad_k), *gv = static_cast<io_t*>(p.grad_v);
  io_t *ga = static_cast<io_t*>(p.grad_a), *gb = static_cast<io_t*>(p.grad_b);
  float *const r_ = backward_vector<N, kVecR>(), *const w_ = backward_vector<N, kVecW>();
  float *const d_ = backward_vector<N, kVecD>(), *const k_ = backward_vector<N, kVecK>();
  float *const v_ = backward_vector<N, kVecV>(), *const a_ = backward_vector<N, kVecA>();
  float *const b_ = backward_vector<N, kVecB>(), *const dy_ = backward_vector<N, kVecDy>();
  float *const dsa_ = backward_vector<N, kVecDsa>();
  constexpr int kSubChunk = wkv7_backward_sub_chunk(N);
  __shared__ __align__(16) float sa_[kSubChunk][N];
  float* states = p.scratch + t.task * (kSubChunk + 1) * kNN;  // states[l][i][j] = S_{q+sub+l-1}[i][j]
  float g_row[kCols], g_col[kCols];  // G[i][col(lane, m)] and G[col(lane, m)][i]
  const float* gs = p.grad_final_state ? p.grad_final_state + t.task * kNN : nullptr;
#pragma unroll
  for (int m = 0; m < kCols; ++m) {
    const int j = Lanes::col(lane, m);
    g_row[m] = gs ? gs[i * N + j] : 0.f;
    g_col[m] = gs ? gs[j * N + i] : 0.f;
  }
  for (int64_t chunk_end = t.end; chunk_end > t.start;) {
    const int64_t q = wkv7::chunk_start(chunk_end - 1, t.start);
    const int len = int(chunk_end - q);
    const int64_t chunk_token = token_index(p.size, t, q, N), stride = p.size.heads * N;  // token q + l: + l stride
    for (int sub_end = len; sub_end > 0;) {
      const int sub = (sub_end - 1) / kSubChunk * kSubChunk;  // the sub-chunk: tokens [q + sub, q + sub_end)
      {
        float row[kCols];
        if (q > t.start) {  // the chunk's checkpoint (stored transposed), else the initial state
          const float* slot = checkpoint_slot<N>(const_cast<float*>(p.checkpoints), p.size, t, q);
#pragma unroll
          for (int m = 0; m < kCols; ++m) row[m] = slot[Lanes::col(lane, m) * N + i];
        } else {
          load_initial_row<Lanes>(p.initial_state, t, i, lane, row);
        }
        __syncthreads();  // the previous sub-chunk's readers of states and sa_ are done
        if (sub == 0) store_row<Lanes>(states, i, lane, row);
        // Step l + 1's inputs are loaded while step l is computed, as in the forward: their latency leaves the
        // steps' chain, which is short here (no y, no adjoint).
        StepInputs next{};
        if (stager) next = load_step<P>(chunk_token + e, w, k, v, a, b);
        for (int l = 0; l < sub_end; ++l) {
          __syncthreads();  // the previous token's readers are done
          if (stager) {
            a_[e] = next.a;
            b_[e] = next.b;
            k_[e] = next.k;
            v_[e] = next.v;
            d_[e] = wkv7::decay_of(next.w, decay);
          }
          __syncthreads();
          if (stager && l + 1 < sub_end) next = load_step<P>(chunk_token + (l + 1) * stride + e, w, k, v, a, b);
          const float sa = row_dot<Lanes>(row, a_, lane);
          lane_update<Lanes>(row, d_, k_, b_, sa, v_[i], lane);
          if (lane == 0 && l >= sub) sa_[l - sub][i] = sa;
          if (l + 1 >= sub) store_row<Lanes>(states + (l + 1 - sub) * kNN, i, lane, row);
        }
      }
      for (int l = sub_end - 1; l >= sub; --l) {
        const int64_t token = chunk_token + l * stride;
        __syncthreads();  // the recompute's (or the previous step's) readers are done; its writes are visible
        if (stager) {
          const int64_t idx = token + e;
          w_[e] = load_w<P, io_t>(w, idx);
          d_[e] = wkv7::decay_of(w_[e], decay);
          r_[e] = wkv7::load<P>(r[idx]);
          k_[e] = wkv7::load<P>(k[idx]);
          v_[e] = wkv7::load<P>(v[idx]);
          a_[e] = wkv7::load<P>(a[idx]);
          b_[e] = wkv7::load<P>(b[idx]);
          dy_[e] = wkv7::load<P>(gy[idx]);
        }
        __syncthreads();
        // S_{t-1}[j][i] = prev_col[j * N]: `states` recomputed from blockIdx.x (= t.task), since held across the token
        // loops it was what ptxas spilled at N = 128 (12 B at the 128-register cap, reloaded every token).
        const float* prev_col = p.scratch + (int64_t(blockIdx.x) * (kSubChunk + 1) + (l - sub)) * kNN + i;
        const float* cur_col = prev_col + kNN;                 // S_t[j][i]
        const float dy_i = dy_[i], r_i = r_[i], d_i = d_[i], a_i = a_[i];
#pragma unroll
        for (int m = 0; m < kCols; ++m) {
          const int j = Lanes::col(lane, m);
          g_row[m] = fmaf(dy_i, r_[j], g_row[m]);  // G += dy r^T: y_t's part of dL/dS_t
          g_col[m] = fmaf(dy_[j], r_i, g_col[m]);
        }
        const float dv_i = row_dot<Lanes>(g_row, k_, lane);
        const float dsa_i = row_dot<Lanes>(g_row, b_, lane);
        const float dk_i = row_dot<Lanes>(g_col, v_, lane);
        const float db_i = row_dot<Lanes>(g_col, sa_[l - sub], lane);
        const float dr_i = column_dot<Lanes>(cur_col, dy_, lane);
        if (lane == 0) {
          const int64_t idx = token + i;
          dsa_[i] = dsa_i;
          gr[idx] = wkv7::store<io_t, P>(dr_i);
          gk[idx] = wkv7::store<io_t, P>(dk_i);
          gv[idx] = wkv7::store<io_t, P>(dv_i);
          gb[idx] = wkv7::store<io_t, P>(db_i);
        }
        __syncthreads();
        const float2 dd_da = column_dot2<Lanes>(prev_col, g_col, dsa_, lane);  // one pass over column i of S_{t-1}
#pragma unroll
        for (int m = 0; m < kCols; ++m) {  // G becomes dL/dS_{t-1} = G diag(d) + dsa a^T
          const int j = Lanes::col(lane, m);
          g_row[m] = fmaf(dsa_i, a_[j], g_row[m] * d_[j]);
          g_col[m] = fmaf(dsa_[j], a_i, g_col[m] * d_i);
        }
        if (lane == 0) {
          const int64_t idx = token + i;
          gw[idx] = wkv7::store<w_t, wkv7::kDecayMode<P, io_t>>(dd_da.x * d_i * wkv7::log_decay_grad(w_[i], decay));
          ga[idx] = wkv7::store<io_t, P>(dd_da.y);
        }
      }
      sub_end = sub;
    }
    chunk_end = q;
  }
#pragma unroll
  for (int m = 0; m < kCols; ++m) p.grad_initial_state[t.task * kNN + int64_t(i) * N + Lanes::col(lane, m)] = g_row[m];
}

// The decode step: one token, the state read and written in place with the lane map of wkv7::StepLanes (16-byte,
// lane-contiguous accesses; each thread loads its 8 float4 before any math, so that they are all in flight).
template <int N, typename io_t, typename w_t, Precision P>
__global__ void __launch_bounds__(wkv7::StepLanes<N>::kThreads) step_kernel(const Wkv7StepParams p) {
  using Lanes = wkv7::StepLanes<N>;
  constexpr int L = Lanes::kLanesPerRow;
  const int64_t task = blockIdx.x;  // b * heads + h
  const Decay decay = static_cast<Decay>(p.decay);
  const int t = threadIdx.x;
  const int64_t vec = task * N + Lanes::col(t);
  float r4[4], d4[4], k4[4], a4[4], b4[4];
  wkv7::load4<P>(static_cast<const io_t*>(p.r) + vec, r4);
  wkv7::load4<wkv7::kDecayMode<P, io_t>>(static_cast<const w_t*>(p.w) + vec, d4);
  wkv7::load4<P>(static_cast<const io_t*>(p.k) + vec, k4);
  wkv7::load4<P>(static_cast<const io_t*>(p.a) + vec, a4);
  wkv7::load4<P>(static_cast<const io_t*>(p.b) + vec, b4);
#pragma unroll
  for (int q = 0; q < 4; ++q) d4[q] = wkv7::decay_of(d4[q], decay);
  float4* state = reinterpret_cast<float4*>(p.state + task * N * N);
  float4 seg[Lanes::kPasses];
#pragma unroll
  for (int pass = 0; pass < Lanes::kPasses; ++pass) seg[pass] = state[Lanes::offset(t, pass) / 4];
  const io_t* v = static_cast<const io_t*>(p.v) + task * N;
  io_t* y = static_cast<io_t*>(p.y) + task * N;
#pragma unroll
  for (int pass = 0; pass < Lanes::kPasses; ++pass) {
    const int i = Lanes::row(t, pass);
    float s[4] = {seg[pass].x, seg[pass].y, seg[pass].z, seg[pass].w};
    const float sa = lane_sum<L>(wkv7::lane_dot4(a4, s));
    wkv7::lane_update4(s, d4, sa, b4, wkv7::load<P>(v[i]), k4);
    const float yi = lane_sum<L>(wkv7::lane_dot4(r4, s));
    state[Lanes::offset(t, pass) / 4] = make_float4(s[0], s[1], s[2], s[3]);
    if (t % L == 0) y[i] = wkv7::store<io_t, P>(yi);
  }
}

}  // namespace wkv7_detail

}  // namespace ropewkv::cuda
