#pragma once
// Host stand-ins for the CUDA language pieces that csrc/rope/rope_kernel.cuh uses, so that g++ compiles its kernel
// (tests/test_rope_cuda_on_host.py). The driver sets gridDim/blockDim/blockIdx/threadIdx and calls the kernel once per
// thread, sequentially: the kernel's threads share no memory and no barrier, so any order is a valid schedule.
#include <cstdint>

// As CUDA's: 16-byte aligned, so that a misaligned vector access through it is a fault (UBSan's alignment check).
struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
inline dim3 gridDim, blockDim, blockIdx, threadIdx;

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __isGlobal(ptr) true
#define __builtin_assume(cond) ((void)0)
