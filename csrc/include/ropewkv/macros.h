#pragma once
// One spelling for functions that both the CPU twin (g++) and the CUDA kernels (nvcc) compile.
#if defined(__CUDACC__)
#define ROPEWKV_HD __host__ __device__ __forceinline__
#else
#define ROPEWKV_HD inline
#endif
