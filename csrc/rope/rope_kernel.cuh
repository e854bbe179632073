#pragma once
// The RoPE CUDA kernel, instantiated per I/O dtype by rope_{fp32,fp16,bf16}.cu. Torch-free.
//
// One block per token (grid-stride over B*S tokens: a linear token grid, also for packed varlen). The block computes
// the token's cos/sin once per frequency into shared memory, then rotates every pair of every head of q and k.
#include "ropewkv/cuda_common.cuh"
#include "ropewkv/rope.h"
#include "ropewkv/rope_cuda.h"

namespace ropewkv::cuda {

inline constexpr int kRopeThreads = 128;

template <typename io_t, Precision P>
__global__ void __launch_bounds__(kRopeThreads) rope_kernel(const rope::Params p) {
  using acc_t = accum_t<io_t, P>;
  extern __shared__ float table[];
  const int64_t rh = p.rot_half;
  float* ca = table;
  float* sa = ca + rh;
  float* cb = sa + rh;
  float* sb = cb + rh;
  const int64_t tokens = p.batch * p.seqlen;
  const int64_t hk = p.k != nullptr ? p.hk : 0;
  const int64_t pairs = (p.hq + hk) * rh;
  const int64_t pass = p.head_dim - 2 * rh;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t b = t / p.seqlen;
    const int64_t s = t - b * p.seqlen;
    int64_t pos[3] = {0, 0, 0};
    if (p.cos == nullptr) rope::token_positions(p, b, s, pos);
    __syncthreads();  // the previous token's table is no longer read
    for (int64_t j = threadIdx.x; j < rh; j += blockDim.x) {
      rope::table_entry<acc_t, float>(p, b, s, pos[rope::mrope_row(p, j)], j, &ca[j], &sa[j], &cb[j], &sb[j]);
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < pairs + (p.hq + hk) * pass; i += blockDim.x) {
      const bool rotating = i < pairs;
      const int64_t per_head = rotating ? rh : pass;
      const int64_t flat = rotating ? i : i - pairs;
      int64_t h = flat / per_head;
      const int64_t j = flat - h * per_head;
      const bool is_q = h < p.hq;
      if (!is_q) h -= p.hq;
      const int64_t* in_st = is_q ? p.q_stride : p.k_stride;
      const int64_t* out_st = is_q ? p.qo_stride : p.ko_stride;
      const io_t* x = static_cast<const io_t*>(is_q ? p.q : p.k) + b * in_st[0] + s * in_st[1] + h * in_st[2];
      io_t* o = static_cast<io_t*>(is_q ? p.q_out : p.k_out) + b * out_st[0] + s * out_st[1] + h * out_st[2];
      if (rotating) {
        int64_t a, bd;
        rope::pair_dims(p.interleaved, rh, j, a, bd);
        rope::rotate_pair<acc_t>(x, o, a, bd, ca[j], sa[j], cb[j], sb[j]);
      } else if (o != x) {
        o[2 * rh + j] = x[2 * rh + j];  // dims past rotary_dim: a bit-exact copy
      }
    }
  }
}

template <typename io_t>
cudaError_t rope_launch(const rope::Params& p, Precision precision, cudaStream_t stream) {
  const int64_t tokens = p.batch * p.seqlen;
  if (tokens == 0 || p.head_dim == 0 || (p.hq == 0 && (p.k == nullptr || p.hk == 0))) return cudaSuccess;
  if (p.rot_half > kMaxRotHalf) return cudaErrorInvalidValue;
  const unsigned grid = unsigned(tokens < (int64_t(1) << 30) ? tokens : (int64_t(1) << 30));
  const size_t smem = size_t(4 * p.rot_half) * sizeof(float);
  if (precision == Precision::kBF16) {
    rope_kernel<io_t, Precision::kBF16><<<grid, kRopeThreads, smem, stream>>>(p);
  } else {
    rope_kernel<io_t, Precision::kFP32><<<grid, kRopeThreads, smem, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace ropewkv::cuda
