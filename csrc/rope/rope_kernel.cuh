#pragma once
// The RoPE CUDA kernel, instantiated per I/O dtype by rope_{fp32,fp16,bf16}.cu. Torch-free.
//
// The thread map (ropewkv/rope.h, tested on the host): a thread owns one (token, head group, unit of `width` dims),
// computes the cos/sin of its unit's frequencies once, then walks its heads of q and of k, kRunsInFlight runs at a
// time: all their loads issued before the first rotation, one 16-byte access per run of dims on the vector path. No
// per-element index math: a head advances a pointer by one stride. Inputs that are not 16-byte aligned (pointers,
// strides, the rotary split) take the element-wise instantiation (VECTOR = false), chosen on the host.
#include "ropewkv/cuda_common.cuh"
#include "ropewkv/rope.h"
#include "ropewkv/rope_cuda.h"

namespace ropewkv::cuda {

inline constexpr int kRopeThreads = 128;
inline constexpr int kRunsInFlight = 8;  // 16-byte loads per thread in flight: 128 B

// Rotates one run pair (NeoX) or run (GPT-J) of each of HEADS heads, `x_step` / `o_step` elements apart: every load
// issued before the first rotation.
template <int HEADS, typename acc_t, typename io_t, int W, bool VECTOR, bool INTERLEAVED>
__device__ __forceinline__ void rotate_heads(const io_t* x, io_t* o, int64_t x_step, int64_t o_step, int64_t second,
                                             const float* ca, const float* sa, const float* cb, const float* sb) {
  using R = Run<io_t, W, VECTOR>;
  constexpr int kRuns = INTERLEAVED ? 1 : 2;  // NeoX: a run in each half, `second` elements apart
  R in[HEADS][kRuns];
#pragma unroll
  for (int k = 0; k < HEADS; ++k) {
#pragma unroll
    for (int r = 0; r < kRuns; ++r) in[k][r] = R::load(x + k * x_step + r * second);
  }
#pragma unroll
  for (int k = 0; k < HEADS; ++k) {
    R out[kRuns];
    if constexpr (INTERLEAVED) {
#pragma unroll
      for (int i = 0; i < W / 2; ++i) {
        rope::rotate_values<acc_t>(in[k][0].v[2 * i], in[k][0].v[2 * i + 1], ca[i], sa[i], cb[i], sb[i],
                                   &out[0].v[2 * i], &out[0].v[2 * i + 1]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < W; ++i) {
        rope::rotate_values<acc_t>(in[k][0].v[i], in[k][1].v[i], ca[i], sa[i], cb[i], sb[i], &out[0].v[i],
                                   &out[1].v[i]);
      }
    }
#pragma unroll
    for (int r = 0; r < kRuns; ++r) out[r].store(o + k * o_step + r * second);
  }
}

// Rotates the unit's runs of `count` heads of one tensor (q or k): kRunsInFlight runs at a time (4 NeoX heads, 8
// GPT-J heads), then the rest head by head.
template <typename acc_t, typename io_t, int W, bool VECTOR, bool INTERLEAVED>
__device__ __forceinline__ void rotate_unit_heads(const io_t* x, io_t* o, int64_t x_step, int64_t o_step,
                                                  int64_t count, int64_t second, const float* ca, const float* sa,
                                                  const float* cb, const float* sb) {
  constexpr int kHeadsInFlight = INTERLEAVED ? kRunsInFlight : kRunsInFlight / 2;
  int64_t h = 0;
#pragma unroll 1
  for (; h + kHeadsInFlight <= count; h += kHeadsInFlight) {
    rotate_heads<kHeadsInFlight, acc_t, io_t, W, VECTOR, INTERLEAVED>(x, o, x_step, o_step, second, ca, sa, cb, sb);
    x += kHeadsInFlight * x_step;
    o += kHeadsInFlight * o_step;
  }
#pragma unroll 1
  for (; h < count; ++h) {
    rotate_heads<1, acc_t, io_t, W, VECTOR, INTERLEAVED>(x, o, x_step, o_step, second, ca, sa, cb, sb);
    x += x_step;
    o += o_step;
  }
}

// Copies the unit's run (dims past rotary_dim) of `count` heads, kHeadsInFlight loads in flight (fewer than the
// rotation's: partial rotary out of place is rare, and the report's hot loop is then the rotation's).
template <typename io_t, int W, bool VECTOR>
__device__ __forceinline__ void copy_unit_heads(const io_t* x, io_t* o, int64_t x_step, int64_t o_step,
                                                int64_t count) {
  using R = Run<io_t, W, VECTOR>;
  constexpr int kHeadsInFlight = kRunsInFlight / 2;
  int64_t h = 0;
#pragma unroll 1
  for (; h + kHeadsInFlight <= count; h += kHeadsInFlight) {
    R in[kHeadsInFlight];
#pragma unroll
    for (int k = 0; k < kHeadsInFlight; ++k) in[k] = R::load(x + k * x_step);
#pragma unroll
    for (int k = 0; k < kHeadsInFlight; ++k) in[k].store(o + k * o_step);
    x += kHeadsInFlight * x_step;
    o += kHeadsInFlight * o_step;
  }
#pragma unroll 1
  for (; h < count; ++h) {
    R::load(x).store(o);
    x += x_step;
    o += o_step;
  }
}

// W: elements per rotating run (the vector width, or 1 NeoX / 2 GPT-J element-wise); copy runs are W wide on the
// vector path and 1 element-wise (the copy tail need not be a multiple of anything there).
template <typename io_t, Precision P, bool VECTOR, bool INTERLEAVED>
__global__ void __launch_bounds__(kRopeThreads) rope_kernel(const rope::Params p, const rope::ThreadMap m) {
  using acc_t = rope::rope_accum_t<io_t, P>;
  constexpr int W = VECTOR ? 16 / int(sizeof(io_t)) : (INTERLEAVED ? 2 : 1);
  constexpr int CW = VECTOR ? W : 1;
  constexpr int kFreqs = INTERLEAVED ? W / 2 : W;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; thread < m.threads; thread += stride) {
    const rope::ThreadWork w = rope::thread_work(p, m, thread);
    const int64_t nq = rope::group_heads(p.hq, w.group, m.groups);
    const int64_t nk = p.k != nullptr ? rope::group_heads(p.hk, w.group, m.groups) : 0;
    const io_t* q = static_cast<const io_t*>(p.q) + w.b * p.q_stride[0] + w.s * p.q_stride[1] +
                    w.group * p.q_stride[2] + w.first_dim;
    io_t* qo = static_cast<io_t*>(p.q_out) + w.b * p.qo_stride[0] + w.s * p.qo_stride[1] +
               w.group * p.qo_stride[2] + w.first_dim;
    const io_t* k = static_cast<const io_t*>(p.k) + w.b * p.k_stride[0] + w.s * p.k_stride[1] +
                    w.group * p.k_stride[2] + w.first_dim;
    io_t* ko = static_cast<io_t*>(p.k_out) + w.b * p.ko_stride[0] + w.s * p.ko_stride[1] +
               w.group * p.ko_stride[2] + w.first_dim;
    const int64_t g = m.groups;
    if (!w.rotates) {
      copy_unit_heads<io_t, CW, VECTOR>(q, qo, g * p.q_stride[2], g * p.qo_stride[2], nq);
      copy_unit_heads<io_t, CW, VECTOR>(k, ko, g * p.k_stride[2], g * p.ko_stride[2], nk);
      continue;
    }
    // The unit's cos/sin, once per (token, frequency) for all its heads.
    int64_t pos[3] = {0, 0, 0};
    if (p.cos == nullptr) rope::token_positions(p, w.b, w.s, pos);
    float ca[kFreqs], sa[kFreqs], cb[kFreqs], sb[kFreqs];
#pragma unroll
    for (int i = 0; i < kFreqs; ++i) {
      const int64_t j = w.first_freq + i;
      rope::table_entry<acc_t, float>(p, w.b, w.s, pos[rope::mrope_row(p, j)], j, &ca[i], &sa[i], &cb[i], &sb[i]);
    }
    rotate_unit_heads<acc_t, io_t, W, VECTOR, INTERLEAVED>(q, qo, g * p.q_stride[2], g * p.qo_stride[2], nq,
                                                          p.rot_half, ca, sa, cb, sb);
    rotate_unit_heads<acc_t, io_t, W, VECTOR, INTERLEAVED>(k, ko, g * p.k_stride[2], g * p.ko_stride[2], nk,
                                                          p.rot_half, ca, sa, cb, sb);
  }
}

template <typename io_t, Precision P, bool VECTOR>
void launch_style(const rope::Params& p, const rope::ThreadMap& m, unsigned grid, cudaStream_t stream) {
  if (p.interleaved) {
    rope_kernel<io_t, P, VECTOR, true><<<grid, kRopeThreads, 0, stream>>>(p, m);
  } else {
    rope_kernel<io_t, P, VECTOR, false><<<grid, kRopeThreads, 0, stream>>>(p, m);
  }
}

template <typename io_t, Precision P>
void launch_path(const rope::Params& p, int64_t vec, const rope::ThreadMap& m, unsigned grid, cudaStream_t stream) {
  if (vec > 0) {
    launch_style<io_t, P, true>(p, m, grid, stream);
  } else {
    launch_style<io_t, P, false>(p, m, grid, stream);
  }
}

template <typename io_t>
cudaError_t rope_launch(const rope::Params& p, Precision precision, cudaStream_t stream) {
  const int64_t tokens = p.batch * p.seqlen;
  if (tokens == 0 || p.head_dim == 0 || (p.hq == 0 && (p.k == nullptr || p.hk == 0))) return cudaSuccess;
  const bool in_place = p.q_out == p.q && (p.k == nullptr || p.k_out == p.k);
  const bool copy_rest = !in_place && p.head_dim > 2 * p.rot_half;
  const int64_t vec = rope::rope_vector_width(p, sizeof(io_t), copy_rest);
  const rope::ThreadMap m = rope::make_thread_map(p, vec, copy_rest);
  if (m.threads == 0) return cudaSuccess;
  const int64_t blocks = (m.threads + kRopeThreads - 1) / kRopeThreads;
  const unsigned grid = unsigned(blocks < (int64_t(1) << 30) ? blocks : (int64_t(1) << 30));
  if (precision == Precision::kBF16) {
    launch_path<io_t, Precision::kBF16>(p, vec, m, grid, stream);
  } else {
    launch_path<io_t, Precision::kFP32>(p, vec, m, grid, stream);
  }
  return cudaGetLastError();
}

}  // namespace ropewkv::cuda
