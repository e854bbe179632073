// Kernels for tests/test_static_report.py: one the static report must flag, one it must pass.
#include <cstdint>

// 2-byte scalar loads and stores, and register spills: __launch_bounds__(1024, 2) caps it at 32 registers per
// thread while 64 accumulators stay live across the loop.
__global__ void __launch_bounds__(1024, 2) narrow_and_spilling(const uint16_t* x, uint16_t* y, int n) {
  float acc[64];
#pragma unroll
  for (int j = 0; j < 64; ++j) acc[j] = float(j);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = float(x[i]);
#pragma unroll
    for (int j = 0; j < 64; ++j) acc[j] = acc[j] * v + float(x[i + j]);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 64; ++j) sum += acc[j];
    y[i] = uint16_t(sum);
  }
}

// 16-byte vector loads and stores, no spills.
__global__ void wide_copy(const uint4* x, uint4* y, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = x[i];
}
