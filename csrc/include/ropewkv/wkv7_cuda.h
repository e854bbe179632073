#pragma once
// Framework-free CUDA entry points of the WKV7 ops (kernels in csrc/wkv7/wkv7_kernels.cuh, one .cu per head size
// and w storage). All tensors are contiguous; r..b and y are [B, T, H, N] in the I/O dtype (w and grad_w in w's: see
// wkv7::DecayStorage), states are fp32 [n_seqs, H, N, N] S[v][k], checkpoints fp32 [B, chunks, H, N, N] stored transposed (see csrc/wkv7/wkv7_glue.h).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ropewkv/precision.h"
#include "ropewkv/wkv7.h"

namespace ropewkv::cuda {

using wkv7::DecayStorage;

struct Wkv7Sizes {
  int64_t batch, seqlen, heads, n_seqs, chunks;
  int decay;                  // ropewkv::wkv7::Decay
  const int64_t* cu_seqlens;  // [n_seqs + 1] or nullptr
};

struct Wkv7ForwardParams {
  Wkv7Sizes size;
  const void *r, *w, *k, *v, *a, *b;
  const float* initial_state;  // or nullptr (zeros)
  void* y;
  float* final_state;
  float* checkpoints;  // or nullptr (no backward will run)
};

struct Wkv7BackwardParams {
  Wkv7Sizes size;
  const void *r, *w, *k, *v, *a, *b;
  const float* initial_state;     // or nullptr
  const void* grad_y;             // I/O dtype
  const float* grad_final_state;  // or nullptr (zero cotangent)
  const float* checkpoints;
  // wkv7_backward_scratch_elems floats: the recomputed states of one sub-chunk per (sequence, head); in the chunked
  // backward, wkv7_chunked_backward_scratch_elems: the state cotangent before each chunk
  float* scratch;
  void *grad_r, *grad_w, *grad_k, *grad_v, *grad_a, *grad_b;  // grad_w in w's dtype
  float* grad_initial_state;
};

struct Wkv7StepParams {
  int64_t batch, heads;
  int decay;
  const void *r, *w, *k, *v, *a, *b;  // [B, H, N], aligned to 4 elements
  float* state;                       // [B, H, N, N], updated in place, aligned to 16 bytes
  void* y;
};

// The backward recomputes each checkpoint chunk in sub-chunks of this many tokens (latest first, each from the
// chunk's checkpoint), keeping only a sub-chunk's states in its scratch: small enough that the scratch of every
// block resident on the GPU stays in the H100's 50 MB L2 (csrc/wkv7/wkv7_kernels.cuh, backward_kernel).
constexpr int wkv7_backward_sub_chunk(int head_size) { return head_size >= 128 ? 4 : 8; }

inline int64_t wkv7_backward_scratch_elems(int64_t n_seqs, int64_t heads, int64_t head_size) {
  return n_seqs * heads * (wkv7_backward_sub_chunk(int(head_size)) + 1) * head_size * head_size;
}

// Each returns the launch status. Instantiated for N = 32, 64, 128 (a state row lives in the registers of one to
// four threads: at 256 the forward's row and the backward's two rows of G would spill, so that head size runs on
// the triton and cpu twins) and for each DecayStorage (one .cu per pair, so that builds parallelise): kIO for
// fp32/fp16/bf16 I/O, kFloat32 for fp16/bf16 I/O.
template <int N, wkv7::DecayStorage W>
cudaError_t wkv7_forward(DType dtype, Precision precision, const Wkv7ForwardParams& p, cudaStream_t stream);
template <int N, wkv7::DecayStorage W>
cudaError_t wkv7_backward(DType dtype, Precision precision, const Wkv7BackwardParams& p, cudaStream_t stream);
template <int N, wkv7::DecayStorage W>
cudaError_t wkv7_step(DType dtype, Precision precision, const Wkv7StepParams& p, cudaStream_t stream);

#define ROPEWKV_WKV7_DECLARE(N, W)                                                                              \
  extern template cudaError_t wkv7_forward<N, W>(DType, Precision, const Wkv7ForwardParams&, cudaStream_t);    \
  extern template cudaError_t wkv7_backward<N, W>(DType, Precision, const Wkv7BackwardParams&, cudaStream_t);  \
  extern template cudaError_t wkv7_step<N, W>(DType, Precision, const Wkv7StepParams&, cudaStream_t);
ROPEWKV_WKV7_DECLARE(32, wkv7::DecayStorage::kIO)
ROPEWKV_WKV7_DECLARE(64, wkv7::DecayStorage::kIO)
ROPEWKV_WKV7_DECLARE(128, wkv7::DecayStorage::kIO)
ROPEWKV_WKV7_DECLARE(32, wkv7::DecayStorage::kFloat32)
ROPEWKV_WKV7_DECLARE(64, wkv7::DecayStorage::kFloat32)
ROPEWKV_WKV7_DECLARE(128, wkv7::DecayStorage::kFloat32)
#undef ROPEWKV_WKV7_DECLARE

// The chunked forward (ropewkv::wkv7_chunked_forward; csrc/wkv7/wkv7_chunked_kernels.cuh): the same parameters,
// outputs and checkpoints as wkv7_forward. The chunked backward (csrc/wkv7/wkv7_chunked_backward_kernels.cuh): the
// same parameters and gradients as wkv7_backward, from the chunked forward's checkpoints, with a scratch of
// wkv7_chunked_backward_scratch_elems floats. Instantiated for N = 32, 64, 128 and both storages of w.
template <int N, wkv7::DecayStorage W>
cudaError_t wkv7_chunked_forward(DType dtype, Precision precision, const Wkv7ForwardParams& p, cudaStream_t stream);
template <int N, wkv7::DecayStorage W>
cudaError_t wkv7_chunked_backward(DType dtype, Precision precision, const Wkv7BackwardParams& p, cudaStream_t stream);

// The dynamic shared memory per block of the chunked backward's gradients kernel at head size N, in bytes: 109,632 at
// N = 128, over the 101,376 that sm_86/89/120 GPUs allow (the glue says so instead of launching).
template <int N>
int wkv7_chunked_backward_shared_bytes();

// The chunked backward's scratch: the state cotangent before every chunk, shaped as the checkpoints.
inline int64_t wkv7_chunked_backward_scratch_elems(int64_t batch, int64_t chunks, int64_t heads, int64_t head_size) {
  return batch * chunks * heads * head_size * head_size;
}

#define ROPEWKV_WKV7_CHUNKED_DECLARE(N)                                                                           \
  extern template cudaError_t wkv7_chunked_forward<N, wkv7::DecayStorage::kIO>(DType, Precision,                \
                                                                                const Wkv7ForwardParams&,        \
                                                                                cudaStream_t);                   \
  extern template cudaError_t wkv7_chunked_forward<N, wkv7::DecayStorage::kFloat32>(DType, Precision,           \
                                                                                     const Wkv7ForwardParams&,   \
                                                                                     cudaStream_t);              \
  extern template cudaError_t wkv7_chunked_backward<N, wkv7::DecayStorage::kIO>(DType, Precision,               \
                                                                                 const Wkv7BackwardParams&,      \
                                                                                 cudaStream_t);                  \
  extern template cudaError_t wkv7_chunked_backward<N, wkv7::DecayStorage::kFloat32>(DType, Precision,          \
                                                                                      const Wkv7BackwardParams&, \
                                                                                      cudaStream_t);             \
  extern template int wkv7_chunked_backward_shared_bytes<N>();
ROPEWKV_WKV7_CHUNKED_DECLARE(32)
ROPEWKV_WKV7_CHUNKED_DECLARE(64)
ROPEWKV_WKV7_CHUNKED_DECLARE(128)
#undef ROPEWKV_WKV7_CHUNKED_DECLARE

}  // namespace ropewkv::cuda
