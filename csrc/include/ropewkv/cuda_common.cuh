#pragma once
// Shared by the .cu files: dtype dispatch over our storage types, launch-status plumbing, and runs of elements
// moved by 16-byte accesses. Torch-free; compiles with g++ too (over tests/data/host_cuda/cuda_prelude.h).
#include <cstdint>
#include <cuda_runtime_api.h>

#include "ropewkv/precision.h"

namespace ropewkv::cuda {

// Whether a 16-byte vector access at ptr is aligned (an absent optional pointer, nullptr, never blocks one).
inline bool aligned_16(const void* ptr) { return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Calls launch(io_t{}) for the storage type named by `dtype`, then returns the launch status.
template <typename F>
cudaError_t dispatch_io(DType dtype, F&& launch) {
  switch (dtype) {
    case DType::kFloat32:
      launch(float{});
      break;
    case DType::kFloat16:
      launch(fp16_t{});
      break;
    case DType::kBFloat16:
      launch(bf16_t{});
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// The bits of one stored element, and back (16-bit types fill half a word).
template <typename io_t>
__device__ __forceinline__ uint32_t to_bits(io_t v) {
  if constexpr (sizeof(io_t) == 4) {
    return __float_as_uint(v);
  } else {
    return v.bits;
  }
}

template <typename io_t>
__device__ __forceinline__ io_t from_bits(uint32_t u) {
  if constexpr (sizeof(io_t) == 4) {
    return __uint_as_float(u);
  } else {
    return io_t{uint16_t(u)};
  }
}

// N consecutive elements, moved by one 16-byte access when VECTOR (16-byte aligned), else one access per element.
template <typename io_t, int N, bool VECTOR>
struct Run {
  io_t v[N];

  __device__ __forceinline__ static Run load(const io_t* ptr) {
    Run r;
    if constexpr (VECTOR) {
      static_assert(N * sizeof(io_t) == sizeof(uint4));
      const uint4 bits = *reinterpret_cast<const uint4*>(ptr);
      const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
      constexpr int kPerWord = N / 4;
#pragma unroll
      for (int i = 0; i < N; ++i) r.v[i] = from_bits<io_t>(words[i / kPerWord] >> (16 * (i % kPerWord)));
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) r.v[i] = ptr[i];
    }
    return r;
  }

  __device__ __forceinline__ void store(io_t* ptr) const {
    if constexpr (VECTOR) {
      constexpr int kPerWord = N / 4;
      uint32_t words[4] = {0, 0, 0, 0};
#pragma unroll
      for (int i = 0; i < N; ++i) words[i / kPerWord] |= to_bits(v[i]) << (16 * (i % kPerWord));
#ifdef __CUDA_ARCH__
      // st.global.v4 in PTX: given a uint4 store, NVVM still split one of them into four 32-bit stores. No
      // "memory" clobber: the values stored depend on the loads of the same address (in place), nothing else aliases.
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(words[0]), "r"(words[1]),
                   "r"(words[2]), "r"(words[3]));
#else
      // Host compiles (nvcc's host pass; g++ in tests/data/host_cuda, where UBSan checks the uint4's alignment).
      *reinterpret_cast<uint4*>(ptr) = uint4{words[0], words[1], words[2], words[3]};
#endif
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) ptr[i] = v[i];
    }
  }
};

}  // namespace ropewkv::cuda
