#pragma once
// One spelling for functions that both the CPU twin (g++) and the CUDA kernels (nvcc) compile.
#if defined(__CUDACC__)
#define ROPEWKV_HD __host__ __device__ __forceinline__
#else
#define ROPEWKV_HD inline
#endif

// Loops over a state row in the shared math: vectorised on the host (`omp simd`; with ROPEWKV_SIMD_SUM the sum into
// `var` may be reassociated across lanes, which changes rounding only), unrolled on the device.
#define ROPEWKV_PRAGMA(x) _Pragma(#x)
#if defined(__CUDA_ARCH__)
#define ROPEWKV_SIMD ROPEWKV_PRAGMA(unroll)
#define ROPEWKV_SIMD_SUM(var) ROPEWKV_PRAGMA(unroll)
#else
#define ROPEWKV_SIMD ROPEWKV_PRAGMA(omp simd)
#define ROPEWKV_SIMD_SUM(var) ROPEWKV_PRAGMA(omp simd reduction(+ : var))
#endif
