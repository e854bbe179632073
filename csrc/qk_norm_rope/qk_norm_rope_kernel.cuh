#pragma once
// The fused QK-RMSNorm + RoPE CUDA kernels, instantiated per I/O dtype by qk_norm_rope_{fp32,fp16,bf16}.cu.
// Torch-free; the math is ropewkv/qk_norm_rope.h.
//
// Thread map: a block owns a token (forward, grid-stride) or a chunk of kChunkTokens tokens (backward). It first puts
// the token's cos/sin entries in shared memory, one thread per frequency (the angle once per (token, frequency)), then
// `lanes` consecutive lanes of a warp own one head row: lane l holds items l, l + lanes, ... (at most kItems), where an
// item is two kVec-element chunks of the rotated dims (the two halves of kVec pairs: NeoX (j, j + R/2); GPT-J the
// chunks [2iV, 2iV + 2V)) or one chunk of the pass-through dims. With kVec = 16 bytes / sizeof(io_t) every global
// access is a 16-byte vector and no index needs a division per element. The row's sum of squares is reduced with
// warp shuffles; the whole row stays in registers between load and store (so in place is safe).
// Backward: each lane group adds dy n into fp32 registers for the dims it owns; at the end of the chunk the groups'
// sums go through shared memory and are added in group order into the chunk's partial row (deterministic).
#include "ropewkv/cuda_common.cuh"
#include "ropewkv/qk_norm_rope.h"
#include "ropewkv/qk_norm_rope_cuda.h"

namespace ropewkv::cuda::qk {

using qk_norm_rope::Params;

inline constexpr int kThreads = 128;

template <typename T, int N>
struct alignas(sizeof(T) * N) Chunk {
  T v[N];
};

// N elements from src (16-byte accesses where N allows) widened to fp32.
template <typename T, int N>
__device__ __forceinline__ void load_chunk(const T* src, float (&dst)[N]) {
  constexpr int kPiece = int(16 / sizeof(T)) < N ? int(16 / sizeof(T)) : N;
#pragma unroll
  for (int i = 0; i < N; i += kPiece) {
    const Chunk<T, kPiece> c = *reinterpret_cast<const Chunk<T, kPiece>*>(src + i);
#pragma unroll
    for (int e = 0; e < kPiece; ++e) dst[i + e] = float(widen(c.v[e]));
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_chunk(T* dst, const float (&src)[N]) {
  constexpr int kPiece = int(16 / sizeof(T)) < N ? int(16 / sizeof(T)) : N;
#pragma unroll
  for (int i = 0; i < N; i += kPiece) {
    Chunk<T, kPiece> c;
#pragma unroll
    for (int e = 0; e < kPiece; ++e) c.v[e] = narrow<T>(src[i + e]);
    *reinterpret_cast<Chunk<T, kPiece>*>(dst + i) = c;
  }
}

// The row layout: items [0, pair_items) are rotated pairs of chunks, the rest pass-through chunks.
struct Items {
  int64_t rh, pair_items, count;
  __device__ Items(const Params& p, int vec)
      : rh(p.rope.rot_half), pair_items(p.rope.rot_half / vec), count(pair_items + (p.rope.head_dim - 2 * rh) / vec) {}
};

// First dims of item i's chunks (hi < 0: a pass-through item).
template <int kVec, bool kInterleaved>
__device__ __forceinline__ void item_dims(const Items& items, int64_t i, int64_t& lo, int64_t& hi) {
  if (i < items.pair_items) {
    lo = kInterleaved ? 2 * i * kVec : i * kVec;
    hi = kInterleaved ? lo + kVec : items.rh + i * kVec;
  } else {
    lo = 2 * items.rh + (i - items.pair_items) * kVec;
    hi = -1;
  }
}

// Rotate the pairs of item i in place with the shared table [4, rh] (ca, sa, cb, sb): NeoX (and GPT-J with kVec = 1)
// pairs (lo[k], hi[k]) of frequency i kVec + k (i for GPT-J); GPT-J pairs (c[2m], c[2m + 1]) within each chunk.
template <typename acc_t, int kVec, bool kInterleaved>
__device__ __forceinline__ void rotate_item(float (&lo)[kVec], float (&hi)[kVec], int64_t i, const float* table,
                                            int64_t rh) {
  const float *ca = table, *sa = ca + rh, *cb = sa + rh, *sb = cb + rh;
  if constexpr (!kInterleaved || kVec == 1) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const int64_t j = i * kVec + k;
      qk_norm_rope::rotate_values<acc_t>(lo[k], hi[k], ca[j], sa[j], cb[j], sb[j], &lo[k], &hi[k]);
    }
  } else {
#pragma unroll
    for (int m = 0; m < kVec / 2; ++m) {
      const int64_t j = i * kVec + m, j2 = j + kVec / 2;
      qk_norm_rope::rotate_values<acc_t>(lo[2 * m], lo[2 * m + 1], ca[j], sa[j], cb[j], sb[j], &lo[2 * m],
                                         &lo[2 * m + 1]);
      qk_norm_rope::rotate_values<acc_t>(hi[2 * m], hi[2 * m + 1], ca[j2], sa[j2], cb[j2], sb[j2], &hi[2 * m],
                                         &hi[2 * m + 1]);
    }
  }
}

// Pointers of head row `row` (q rows first, then k) of token (b, s): input, output, cotangent, weight.
struct Row {
  const void* x;
  void* out;
  const void* grad;
  const float* weight;
};

template <typename io_t>
__device__ __forceinline__ Row row_of(const Params& p, int64_t b, int64_t s, int64_t row) {
  const bool is_q = row < p.rope.hq;
  const int64_t h = is_q ? row : row - p.rope.hq;
  const int64_t* in = is_q ? p.rope.q_stride : p.rope.k_stride;
  const int64_t* out = is_q ? p.rope.qo_stride : p.rope.ko_stride;
  const int64_t* g = is_q ? p.gq_stride : p.gk_stride;
  const io_t* grad = static_cast<const io_t*>(is_q ? p.grad_q : p.grad_k);
  return Row{static_cast<const io_t*>(is_q ? p.rope.q : p.rope.k) + b * in[0] + s * in[1] + h * in[2],
             static_cast<io_t*>(is_q ? p.rope.q_out : p.rope.k_out) + b * out[0] + s * out[1] + h * out[2],
             grad == nullptr ? nullptr : grad + b * g[0] + s * g[1] + h * g[2],
             static_cast<const float*>(is_q ? p.q_weight : p.k_weight)};
}

// Sum over the `lanes` lanes of a row group (lanes: a power of two <= 32; every lane of the warp takes part).
__device__ __forceinline__ float group_sum(float v, int lanes) {
  for (int offset = lanes / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The token's table [4, rh] in shared memory, one thread per frequency.
template <typename acc_t>
__device__ __forceinline__ void fill_table(const Params& p, int64_t b, int64_t s, float* table) {
  const int64_t rh = p.rope.rot_half;
  const int64_t pos = p.rope.cos == nullptr ? rope::token_position(p.rope, b, s) : 0;
  __syncthreads();  // the previous token's table is no longer read
  for (int64_t j = threadIdx.x; j < rh; j += blockDim.x) {
    qk_norm_rope::pair_entry<acc_t, float>(p, b, s, pos, j, &table[j], &table[rh + j], &table[2 * rh + j],
                                           &table[3 * rh + j]);
  }
  __syncthreads();
}

template <int kVec, int kItems, bool kInterleaved, typename io_t>
__device__ __forceinline__ void load_row(const Items& items, const io_t* base, bool valid, int lane, int lanes,
                                         float (&lo)[kItems][kVec], float (&hi)[kItems][kVec]) {
#pragma unroll
  for (int s = 0; s < kItems; ++s) {
    const int64_t i = lane + int64_t(s) * lanes;
#pragma unroll
    for (int k = 0; k < kVec; ++k) lo[s][k] = hi[s][k] = 0.f;
    if (!valid || i >= items.count) continue;
    int64_t dlo, dhi;
    item_dims<kVec, kInterleaved>(items, i, dlo, dhi);
    load_chunk(base + dlo, lo[s]);
    if (dhi >= 0) load_chunk(base + dhi, hi[s]);
  }
}

template <int kVec, int kItems>
__device__ __forceinline__ float sum_squares(const float (&lo)[kItems][kVec], const float (&hi)[kItems][kVec]) {
  float sum = 0.f;
#pragma unroll
  for (int s = 0; s < kItems; ++s) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) sum += lo[s][k] * lo[s][k] + hi[s][k] * hi[s][k];
  }
  return sum;
}

template <typename io_t, Precision P, int kVec, int kItems, bool kInterleaved>
__global__ void __launch_bounds__(kThreads) forward_kernel(const Params p, int lanes) {
  using acc_t = accum_t<io_t, P>;
  extern __shared__ float table[];
  const Items items(p, kVec);
  const int lane = int(threadIdx.x) % lanes, group = int(threadIdx.x) / lanes, groups = kThreads / lanes;
  const int64_t tokens = p.rope.batch * p.rope.seqlen;
  const int64_t rows = p.rope.hq + (p.rope.k != nullptr ? p.rope.hk : 0);
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t b = t / p.rope.seqlen, s = t - b * p.rope.seqlen;
    fill_table<acc_t>(p, b, s, table);
    for (int64_t row0 = 0; row0 < rows; row0 += groups) {  // uniform trip count: every lane reaches the shuffles
      const bool valid = row0 + group < rows;
      const Row row = row_of<io_t>(p, b, s, valid ? row0 + group : 0);
      float lo[kItems][kVec], hi[kItems][kVec];
      load_row<kVec, kItems, kInterleaved>(items, static_cast<const io_t*>(row.x), valid, lane, lanes, lo, hi);
      const float r = p.normalize() ? qk_norm_rope::inv_rms(group_sum(sum_squares(lo, hi), lanes),
                                                             p.rope.head_dim, p.eps)
                                    : 1.f;
#pragma unroll
      for (int si = 0; si < kItems; ++si) {
        const int64_t i = lane + int64_t(si) * lanes;
        if (!valid || i >= items.count) continue;
        int64_t dlo, dhi;
        item_dims<kVec, kInterleaved>(items, i, dlo, dhi);
        if (p.normalize()) {
          float w[kVec];
          load_chunk(row.weight + dlo, w);
#pragma unroll
          for (int k = 0; k < kVec; ++k) lo[si][k] = qk_norm_rope::normed<acc_t>(lo[si][k], r, w[k], p.weight_offset);
          if (dhi >= 0) {
            load_chunk(row.weight + dhi, w);
#pragma unroll
            for (int k = 0; k < kVec; ++k) {
              hi[si][k] = qk_norm_rope::normed<acc_t>(hi[si][k], r, w[k], p.weight_offset);
            }
          }
        }
        io_t* out = static_cast<io_t*>(row.out);
        if (dhi >= 0) {
          rotate_item<acc_t, kVec, kInterleaved>(lo[si], hi[si], i, table, items.rh);
          store_chunk(out + dhi, hi[si]);
        }
        store_chunk(out + dlo, lo[si]);
      }
    }
  }
}

template <typename io_t, int kVec, int kItems, bool kInterleaved>
__global__ void __launch_bounds__(kThreads) backward_kernel(const Params p, int lanes) {
  extern __shared__ float smem[];
  float* table = smem;                               // [4, rh]
  float* sums = smem + 4 * p.rope.rot_half;          // [groups, head_dim]
  const Items items(p, kVec);
  const int lane = int(threadIdx.x) % lanes, group = int(threadIdx.x) / lanes, groups = kThreads / lanes;
  const int64_t tokens = p.rope.batch * p.rope.seqlen, dim = p.rope.head_dim;
  const int64_t chunk = blockIdx.x, first = chunk * p.chunk_tokens;
  const int64_t last = first + p.chunk_tokens < tokens ? first + p.chunk_tokens : tokens;
  // q rows of every token of the chunk, then k rows: one weight-gradient accumulator per lane at a time.
  for (int part = 0; part < (p.rope.k != nullptr ? 2 : 1); ++part) {
    const int64_t heads = part == 0 ? p.rope.hq : p.rope.hk, row_base = part == 0 ? 0 : p.rope.hq;
    float dw_lo[kItems][kVec] = {}, dw_hi[kItems][kVec] = {};
    for (int64_t t = first; t < last; ++t) {
      const int64_t b = t / p.rope.seqlen, s = t - b * p.rope.seqlen;
      fill_table<float>(p, b, s, table);  // conjugated entries (p.rope.conjugate), fp32
      for (int64_t h0 = 0; h0 < heads; h0 += groups) {
        const bool valid = h0 + group < heads;
        const Row row = row_of<io_t>(p, b, s, row_base + (valid ? h0 + group : 0));
        float g_lo[kItems][kVec], g_hi[kItems][kVec], x_lo[kItems][kVec], x_hi[kItems][kVec];
        load_row<kVec, kItems, kInterleaved>(items, static_cast<const io_t*>(row.grad), valid, lane, lanes, g_lo,
                                             g_hi);
#pragma unroll
        for (int si = 0; si < kItems; ++si) {  // dy = R^T g
          const int64_t i = lane + int64_t(si) * lanes;
          if (i < items.pair_items) rotate_item<float, kVec, kInterleaved>(g_lo[si], g_hi[si], i, table, items.rh);
        }
        float r = 1.f, dot = 0.f;
        if (p.normalize()) {
          load_row<kVec, kItems, kInterleaved>(items, static_cast<const io_t*>(row.x), valid, lane, lanes, x_lo,
                                               x_hi);
          r = qk_norm_rope::inv_rms(group_sum(sum_squares(x_lo, x_hi), lanes), dim, p.eps);
#pragma unroll
          for (int si = 0; si < kItems; ++si) {
            const int64_t i = lane + int64_t(si) * lanes;
            if (!valid || i >= items.count) continue;
            int64_t dlo, dhi;
            item_dims<kVec, kInterleaved>(items, i, dlo, dhi);
            float w_lo[kVec], w_hi[kVec] = {};
            load_chunk(row.weight + dlo, w_lo);
            if (dhi >= 0) load_chunk(row.weight + dhi, w_hi);
#pragma unroll
            for (int k = 0; k < kVec; ++k) {
              x_lo[si][k] *= r;  // n
              x_hi[si][k] *= r;
              dw_lo[si][k] += g_lo[si][k] * x_lo[si][k];
              dw_hi[si][k] += g_hi[si][k] * x_hi[si][k];
              g_lo[si][k] *= p.weight_offset + w_lo[k];  // dy w'
              g_hi[si][k] *= p.weight_offset + w_hi[k];
              dot += g_lo[si][k] * x_lo[si][k] + g_hi[si][k] * x_hi[si][k];
            }
          }
          dot = group_sum(dot, lanes);
        }
#pragma unroll
        for (int si = 0; si < kItems; ++si) {
          const int64_t i = lane + int64_t(si) * lanes;
          if (!valid || i >= items.count) continue;
          int64_t dlo, dhi;
          item_dims<kVec, kInterleaved>(items, i, dlo, dhi);
          if (p.normalize()) {
#pragma unroll
            for (int k = 0; k < kVec; ++k) {  // g holds dy w'; norm_input_grad with w' = 1 gives r (dy w' - n dot/D)
              g_lo[si][k] = qk_norm_rope::norm_input_grad(g_lo[si][k], x_lo[si][k], 1.f, r, dot, dim);
              g_hi[si][k] = qk_norm_rope::norm_input_grad(g_hi[si][k], x_hi[si][k], 1.f, r, dot, dim);
            }
          }
          io_t* dx = static_cast<io_t*>(row.out);
          store_chunk(dx + dlo, g_lo[si]);
          if (dhi >= 0) store_chunk(dx + dhi, g_hi[si]);
        }
      }
    }
    if (!p.normalize()) continue;
    // The groups' sums, added in group order into this chunk's partial row.
    __syncthreads();
#pragma unroll
    for (int si = 0; si < kItems; ++si) {
      const int64_t i = lane + int64_t(si) * lanes;
      if (i >= items.count) continue;
      int64_t dlo, dhi;
      item_dims<kVec, kInterleaved>(items, i, dlo, dhi);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        sums[group * dim + dlo + k] = dw_lo[si][k];
        if (dhi >= 0) sums[group * dim + dhi + k] = dw_hi[si][k];
      }
    }
    __syncthreads();
    float* partial = static_cast<float*>(part == 0 ? p.dq_weight : p.dk_weight) + chunk * dim;
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
      float total = 0.f;
      for (int g = 0; g < groups; ++g) total += sums[g * dim + d];
      partial[d] = total;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------------
// Launch plans: the vector width (16-byte accesses when every row start and the dims allow it, else scalar), the items
// per lane and the lanes per row.

inline bool strides_multiple(const int64_t* strides, int64_t vec) {
  return strides[0] % vec == 0 && strides[1] % vec == 0 && strides[2] % vec == 0;
}

template <typename io_t>
bool vector_path(const Params& p, bool backward) {
  constexpr int64_t vec = 16 / sizeof(io_t);
  const rope::Params& r = p.rope;
  const bool has_k = r.k != nullptr;
  bool ok = r.head_dim % vec == 0 && r.rot_half % vec == 0 && aligned_16(r.q) && aligned_16(r.q_out) &&
            aligned_16(p.q_weight) && strides_multiple(r.q_stride, vec) && strides_multiple(r.qo_stride, vec);
  if (has_k) {
    ok = ok && aligned_16(r.k) && aligned_16(r.k_out) && aligned_16(p.k_weight) && strides_multiple(r.k_stride, vec) &&
         strides_multiple(r.ko_stride, vec);
  }
  if (backward) {
    ok = ok && aligned_16(p.grad_q) && strides_multiple(p.gq_stride, vec);
    if (has_k) ok = ok && aligned_16(p.grad_k) && strides_multiple(p.gk_stride, vec);
  }
  return ok;
}

struct Plan {
  int lanes, items_per_lane;
  size_t smem;
};

// Items per lane from `choices` (ascending), the first that fits the row in 32 lanes; lanes the next power of two.
inline Plan plan_for(const Params& p, int64_t vec, const int* choices, int n_choices, bool backward) {
  const int64_t rh = p.rope.rot_half;
  const int64_t items = rh / vec + (p.rope.head_dim - 2 * rh) / vec;
  for (int c = 0; c < n_choices; ++c) {
    if (items <= 32 * int64_t(choices[c])) {
      int lanes = 1;
      while (lanes * int64_t(choices[c]) < items) lanes *= 2;
      const size_t sums = backward ? size_t(kThreads / lanes) * size_t(p.rope.head_dim) : 0;
      return Plan{lanes, choices[c], (size_t(4 * rh) + sums) * sizeof(float)};
    }
  }
  return Plan{0, 0, 0};
}

inline constexpr int kVectorItems[] = {1, 2};     // vector path: items <= 64 (head_dim <= 512 in bf16/fp16)
inline constexpr int kScalarItems[] = {2, 8};     // scalar path: items <= 256 (any head_dim <= 256)

// Calls launch(vec, items, interleaved tags) with the plan chosen for p; returns the launch status.
template <typename io_t, typename Launch>
cudaError_t dispatch(const Params& p, bool backward, Launch&& launch) {
  if (p.rope.batch * p.rope.seqlen == 0 || p.rope.head_dim == 0) return cudaSuccess;
  if (p.rope.head_dim > kQkMaxHeadDim) return cudaErrorInvalidValue;
  constexpr int kVec = int(16 / sizeof(io_t));
  const bool vector = vector_path<io_t>(p, backward);
  const Plan plan = vector ? plan_for(p, kVec, kVectorItems, 2, backward) : plan_for(p, 1, kScalarItems, 2, backward);
  if (plan.lanes == 0) return cudaErrorInvalidValue;
  const auto with_items = [&](auto vec) {
    const auto with_style = [&](auto items) {
      if (p.rope.interleaved) {
        launch(vec, items, std::true_type{}, plan);
      } else {
        launch(vec, items, std::false_type{}, plan);
      }
    };
    constexpr bool kScalar = decltype(vec)::value == 1;
    if (plan.items_per_lane == (kScalar ? kScalarItems[0] : kVectorItems[0])) {
      with_style(std::integral_constant<int, (kScalar ? kScalarItems[0] : kVectorItems[0])>{});
    } else {
      with_style(std::integral_constant<int, (kScalar ? kScalarItems[1] : kVectorItems[1])>{});
    }
  };
  if (vector) {
    with_items(std::integral_constant<int, kVec>{});
  } else {
    with_items(std::integral_constant<int, 1>{});
  }
  return cudaGetLastError();
}

inline unsigned grid_for(int64_t blocks) { return unsigned(blocks < (int64_t(1) << 30) ? blocks : int64_t(1) << 30); }

template <typename io_t>
cudaError_t forward_launch(const Params& p, Precision precision, cudaStream_t stream) {
  const unsigned grid = grid_for(p.rope.batch * p.rope.seqlen);
  return dispatch<io_t>(p, false, [&](auto vec, auto items, auto interleaved, const Plan& plan) {
    constexpr int kVec = decltype(vec)::value, kItems = decltype(items)::value;
    constexpr bool kInterleaved = decltype(interleaved)::value;
    if (precision == Precision::kBF16 && !std::is_same_v<io_t, float>) {
      forward_kernel<io_t, Precision::kBF16, kVec, kItems, kInterleaved>
          <<<grid, kThreads, plan.smem, stream>>>(p, plan.lanes);
    } else {
      forward_kernel<io_t, Precision::kFP32, kVec, kItems, kInterleaved>
          <<<grid, kThreads, plan.smem, stream>>>(p, plan.lanes);
    }
  });
}

template <typename io_t>
cudaError_t backward_launch(const Params& p, cudaStream_t stream) {
  const int64_t tokens = p.rope.batch * p.rope.seqlen;
  const unsigned grid = grid_for((tokens + p.chunk_tokens - 1) / p.chunk_tokens);  // one block per chunk
  return dispatch<io_t>(p, true, [&](auto vec, auto items, auto interleaved, const Plan& plan) {
    backward_kernel<io_t, decltype(vec)::value, decltype(items)::value, decltype(interleaved)::value>
        <<<grid, kThreads, plan.smem, stream>>>(p, plan.lanes);
  });
}

}  // namespace ropewkv::cuda::qk
