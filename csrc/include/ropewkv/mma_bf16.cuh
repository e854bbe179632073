#pragma once
// Warp-wide bf16 tensor-core products with fp32 accumulate (mma.sync m16n8k16, sm_80+), and the hi/lo bf16 split
// that keeps an fp32 operand to ~2^-16 relative through them (precision="bf16": three products per split product).
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16", .bf16), lane = 4 g + t (g < 8, t < 4), each register two
// bf16 with the lower column (A, C) or row (B) index in its low half:
//   A 16 x 16, row-major:  a[0] = A[g][2t, 2t+1]      a[1] = A[g+8][2t, 2t+1]
//                          a[2] = A[g][2t+8, 2t+9]    a[3] = A[g+8][2t+8, 2t+9]
//   B 16 x 8:              b[0] = B[2t, 2t+1][g]      b[1] = B[2t+8, 2t+9][g]
//   C, D 16 x 8, fp32:     d[0] = D[g][2t]  d[1] = D[g][2t+1]  d[2] = D[g+8][2t]  d[3] = D[g+8][2t+1]
// so two adjacent C tiles (columns 0-7, 8-15) hold, rounded, the A fragment of the same 16 x 16 block: a product's
// result feeds the next product with no exchange between lanes.
//
// Off the device (the host emulator of CUDA blocks, tests/data/host_cuda), and on GPUs before sm_80, the product is
// formed from the same fragments: every lane gathers its row of A and its two columns of B (through warp shuffles; on
// the host, through the emulator's one-step warp_gather) and sums the exact bf16 products in fp32. The tensor core's
// order of summation is its own, so the two agree to fp32 rounding, not bit for bit.
#include <cstdint>

#include "ropewkv/precision.h"

namespace ropewkv::cuda::mma {

// Two fp32 values as one bf16x2 register, each rounded to nearest even; `first` in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float first, float second) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(second), "f"(first));
  return packed;
#else
  return uint32_t(Narrow<bf16_t>::apply(first).bits) | uint32_t(Narrow<bf16_t>::apply(second).bits) << 16;
#endif
}

__device__ __forceinline__ float low_half(uint32_t x) { return bits_as_float(x << 16); }
__device__ __forceinline__ float high_half(uint32_t x) { return bits_as_float(x & 0xffff0000u); }

// x = hi + lo + e per element, hi = bf16(x), lo = bf16(x - hi) (x - hi is exact in fp32), |e| <= 2^-16 |x| bar
// underflow (measured over 10^6 normal values: max 2^-17, RMS 2^-18.6). The products hi y_hi + lo y_hi + hi y_lo miss
// lo y_lo and the e terms: measured max 2^-15.3, RMS 2^-17.8 relative to x y.
struct Split {
  uint32_t hi, lo;
};

__device__ __forceinline__ Split split_bf16x2(float first, float second) {
  const uint32_t hi = pack_bf16x2(first, second);
  return {hi, pack_bf16x2(first - low_half(hi), second - high_half(hi))};
}

// d += A B from the warp's fragments, lane 4 g + t forming its elements of D: fetch(lane, r) is register r of
// `lane` (0-3 A's, 4-5 B's), called in the same order on every lane (a shuffle is a warp-wide step).
template <typename Fetch>
__device__ __forceinline__ void mma_from_lanes(float (&d)[4], Fetch&& fetch) {
  const int lane = int(threadIdx.x % 32), g = lane / 4, t = lane % 4;
  for (int src = 0; src < 4; ++src) {  // lane 4 g' + src holds the k pairs {2 src, 2 src + 1} and {+8, +9}
    uint32_t a_row[4], b_col[2][2];
    for (int i = 0; i < 4; ++i) a_row[i] = fetch(4 * g + src, i);
    for (int c = 0; c < 2; ++c)
      for (int i = 0; i < 2; ++i) b_col[c][i] = fetch(4 * (2 * t + c) + src, 4 + i);
    for (int r = 0; r < 2; ++r)      // row g + 8 r
      for (int c = 0; c < 2; ++c)    // column 2 t + c
        for (int h = 0; h < 2; ++h) {  // k < 8 or k >= 8
          const uint32_t x = a_row[r + 2 * h], y = b_col[c][h];
          d[2 * r + c] = fmaf(high_half(x), high_half(y), fmaf(low_half(x), low_half(y), d[2 * r + c]));
        }
  }
}

// d += A B on one 16 x 8 x 16 tile; every lane of the warp takes part.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(HOST_CUDA_WARP_GATHER) && !defined(ROPEWKV_MMA_SHUFFLES)  // (tests build the shuffle form too)
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  uint32_t all[32][6];
  host_cuda::warp_gather(mine, all);
  mma_from_lanes(d, [&](int lane, int r) { return all[lane][r]; });
#else
  mma_from_lanes(d, [&](int lane, int r) { return __shfl_sync(0xffffffffu, r < 4 ? a[r] : b[r - 4], lane); });
#endif
}

// d += A B for fp32 A (split, a_hi/a_lo) and B (split), or B exact in bf16 (b_lo absent): the small terms first.
__device__ __forceinline__ void mma_split(float (&d)[4], const uint32_t (&a_hi)[4], const uint32_t (&a_lo)[4],
                                          const uint32_t (&b_hi)[2], const uint32_t (&b_lo)[2]) {
  mma_bf16(d, a_lo, b_hi);
  mma_bf16(d, a_hi, b_lo);
  mma_bf16(d, a_hi, b_hi);
}

// d += A B for A exact in bf16 (V, rounded on load in precision="bf16") and a split fp32 B.
__device__ __forceinline__ void mma_exact_a(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b_hi)[2],
                                            const uint32_t (&b_lo)[2]) {
  mma_bf16(d, a, b_lo);
  mma_bf16(d, a, b_hi);
}

}  // namespace ropewkv::cuda::mma
