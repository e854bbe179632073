// Kernels for tests/test_static_report.py: ropewkv/precision.h's roundings and fp16 widening on the device.
#include "ropewkv/precision.h"

using ropewkv::bf16_t;
using ropewkv::fp16_t;

// precision="bf16"'s arithmetic: each input and each result rounded to bf16 (Rounded<bf16_t>).
__global__ void rounded_bf16(const float* x, float* y) {
  const int i = threadIdx.x;
  const ropewkv::Rounded<bf16_t> a(x[i]), b(x[i + 32]), c(x[i + 64]);
  y[i] = ropewkv::plain(a * b - c);
}

// fp32 -> fp16 (rounded to nearest even) -> fp32.
__global__ void fp16_round_trip(const float* x, float* y) {
  const int i = threadIdx.x;
  y[i] = ropewkv::widen(ropewkv::narrow<fp16_t>(x[i]));
}
