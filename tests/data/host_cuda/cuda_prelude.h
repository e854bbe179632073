#pragma once
// Host stand-ins for the CUDA language pieces that our kernels use, so that g++ compiles a kernel header as it is,
// together with the real ropewkv/cuda_common.cuh (its device-only code is under __CUDA_ARCH__). The CUDA include
// directory must be on the include path: its cuda_runtime_api.h gives uint4 (16-byte aligned, so that UBSan faults a
// misaligned vector access, as the device would), dim3 and cudaError_t.
//
// This header alone models threads that share no memory and no barrier (tests/test_rope_cuda_on_host.py): the driver
// sets gridDim/blockDim/blockIdx/threadIdx and calls the kernel once per thread, one after another, a valid schedule
// for such a kernel. cuda_block_prelude.h adds blocks of concurrent threads: shared memory, barriers, warp shuffles.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include <cuda_runtime_api.h>
#include <vector_functions.h>  // make_float4 and the like

// CUDA's host_defines.h maps these to attributes for nvcc, which g++ does not have; here they mean nothing.
#undef __device__
#undef __global__
#undef __host__
#define __device__
#define __global__
#define __host__
#define __launch_bounds__(...)
#define __isGlobal(ptr) true
#define __builtin_assume(cond) ((void)0)

// Thread-local, so that the concurrent threads of cuda_block_prelude.h each have their own.
inline dim3 gridDim, blockDim;
inline thread_local dim3 blockIdx, threadIdx;

// Math builtins. __expf is the exact expf here; the device's is an approximation (ex2.approx), so results that go
// through it differ from the device's in the last bits.
inline uint32_t __float_as_uint(float f) { return std::bit_cast<uint32_t>(f); }
inline float __uint_as_float(uint32_t u) { return std::bit_cast<float>(u); }
inline float __expf(float x) { return std::exp(x); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
template <typename T>
inline T __ldg(const T* ptr) {
  return *ptr;
}
using std::max;
using std::min;
