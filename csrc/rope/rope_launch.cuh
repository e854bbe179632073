#pragma once
// The host launch of the RoPE CUDA kernel (rope_kernel.cuh), instantiated per I/O dtype by rope_{fp32,fp16,bf16}.cu.
#include "rope_kernel.cuh"
#include "ropewkv/rope_cuda.h"

namespace ropewkv::cuda {

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
  const RopeLaunchPlan plan = plan_rope_launch(p, sizeof(io_t));
  if (plan.map.threads == 0) return cudaSuccess;
  const int64_t blocks = (plan.map.threads + kRopeThreads - 1) / kRopeThreads;
  // One thread per work item, and gridDim.x <= 2^31 - 1: 2.7e11 threads, each owning at least one element of q or k
  // (550 GB of bf16), more than any GPU holds; never hit in practice.
  if (blocks > int64_t(INT32_MAX)) return cudaErrorInvalidValue;
  const auto grid = unsigned(blocks);
  if (precision == Precision::kBF16) {
    launch_path<io_t, Precision::kBF16>(p, plan.vec, plan.map, grid, stream);
  } else {
    launch_path<io_t, Precision::kFP32>(p, plan.vec, plan.map, grid, stream);
  }
  return cudaGetLastError();
}

}  // namespace ropewkv::cuda
