#pragma once
// The precision switch: storage types, the accumulate type, and the build default.
//
// Kernels are templated on the I/O storage type and on a Precision. Precision::kFP32 does all arithmetic in fp32
// whatever the I/O type; Precision::kBF16 is the "low precision" mode, where arithmetic is rounded to the I/O type
// after every operation (for bf16 I/O that is bf16 arithmetic, as PyTorch's eager bf16 ops do). Ops that keep state
// (RWKV-7) say in their own header which parts the low mode touches; their state and decay stay fp32.
//
// The build default is the RWKV-LM `typedef float bf16;` switch: building with ROPEWKV_ACCUM=bf16 (setup.py) defines
// ROPEWKV_ACCUM_BF16 for both the host and the device compiler; _C_cuda refuses to load if its two halves disagree.
// The runtime argument precision="fp32"|"bf16" picks either instantiation without a rebuild; None means this default.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "ropewkv/macros.h"

namespace ropewkv {

enum class Precision : int { kFP32 = 0, kBF16 = 1 };

#if defined(ROPEWKV_ACCUM_BF16)
inline constexpr Precision kBuildPrecision = Precision::kBF16;
#else
inline constexpr Precision kBuildPrecision = Precision::kFP32;
#endif

// I/O storage types, bit-compatible with c10::BFloat16 / __nv_bfloat16 and c10::Half / __half. Keeping them ours
// (not torch's, not CUDA's) lets one header serve g++ and nvcc, and makes the host and device roundings identical.
struct bf16_t {
  uint16_t bits;
};
struct fp16_t {
  uint16_t bits;
};

// The framework-free dtype tag that the CUDA launchers take (the .cu files see no torch types).
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

ROPEWKV_HD uint32_t float_as_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

ROPEWKV_HD float bits_as_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// widen: storage -> compute type (fp64 stays fp64: the CPU twin runs fp64 for gradcheck).
ROPEWKV_HD double widen(double v) { return v; }
ROPEWKV_HD float widen(float v) { return v; }
ROPEWKV_HD float widen(bf16_t v) { return bits_as_float(uint32_t(v.bits) << 16); }

// Device: the hardware conversion (one instruction; the integer version below costs ~15). It is exact, as the
// software one, for every finite value, inf and subnormal; a NaN stays NaN but its payload may differ (canonical).
// Host: branch-free (every case computed, one selected) so that CPU loops over it vectorize.
ROPEWKV_HD float widen(fp16_t v) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
#else
  const uint32_t sign = uint32_t(v.bits & 0x8000u) << 16;
  const uint32_t exponent = (v.bits >> 10) & 0x1fu;
  const uint32_t mantissa = v.bits & 0x3ffu;
  const uint32_t inf_nan = sign | 0x7f800000u | (mantissa << 13);
  const uint32_t normal = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  // mantissa * 2^-24, exact: 0.5 + mantissa * 2^-24 (0.5's ulp) has bits 0x3f000000 + mantissa
  const float subnormal = bits_as_float(0x3f000000u | mantissa) - 0.5f;
  const uint32_t signed_subnormal = sign | float_as_bits(subnormal);
  // Selects through masks: GCC turns nested ?: over these into branches, which do not vectorize.
  const uint32_t is_finite = -uint32_t(exponent != 0x1fu), is_normal = -uint32_t(exponent != 0);
  const uint32_t finite = (normal & is_normal) | (signed_subnormal & ~is_normal);
  return bits_as_float((finite & is_finite) | (inf_nan & ~is_finite));
#endif
}

// narrow<T>: compute type -> storage T, rounding to nearest even.
template <typename T>
struct Narrow;

template <>
struct Narrow<double> {
  ROPEWKV_HD static double apply(double v) { return v; }
};

template <>
struct Narrow<float> {
  ROPEWKV_HD static float apply(float v) { return v; }
};

// NaN stays NaN (quiet). Device (sm_80+): the hardware conversion, one instruction instead of ~6 integer ones (in
// precision="bf16" every arithmetic result goes through it); it rounds every finite value, inf and subnormal as the
// integer version does, but gives the canonical NaN (0x7fff) where the integer version keeps sign and payload. The
// packed form (v in the low half, 0 in the high): ptxas makes it F2FP.BF16.F32.PACK_AB, as it does for fp16, where
// the scalar cvt.rn.bf16.f32 becomes F2F.BF16.F32 on the slower conversion unit.
// Host: branch-free (a select, not an early return) so that CPU loops over it vectorize.
template <>
struct Narrow<bf16_t> {
  ROPEWKV_HD static bf16_t apply(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(0.f), "f"(v));
  return bf16_t{uint16_t(packed)};
#else
  const uint32_t u = float_as_bits(v);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return bf16_t{uint16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded)};
#endif
  }
};

// Overflow to inf, gradual underflow. Device: the hardware conversion (one instruction instead of ~15), the same
// rounding for every finite value, inf and subnormal; NaN gives the canonical 0x7fff, not the host's sign | 0x7e00.
// Host: branch-free (every case computed, one selected), as bf16's.
template <>
struct Narrow<fp16_t> {
  ROPEWKV_HD static fp16_t apply(float v) {
#if defined(__CUDA_ARCH__)
  fp16_t out;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out.bits) : "f"(v));
  return out;
#else
  const uint32_t all = float_as_bits(v);
  const uint16_t sign = uint16_t((all >> 16) & 0x8000u);
  const uint32_t u = all & 0x7fffffffu;
  // >= 65536: inf (or nan)
  const uint32_t inf_nan = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  // below 2^-14: fp16 subnormal or zero; the add rounds at the right bit (0.5f's ulp is 2^-24, the subnormal step)
  const uint32_t magic = 0x3f000000u;
  const uint32_t subnormal = float_as_bits(bits_as_float(u) + bits_as_float(magic)) - magic;
  // normal: rebias the exponent (-112 << 23) and round half to even
  const uint32_t normal = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;
  const uint32_t out = u >= 0x47800000u ? inf_nan : (u < 0x38800000u ? subnormal : normal);
  return fp16_t{uint16_t(out | sign)};
#endif
  }
};

template <typename T, typename V>
ROPEWKV_HD T narrow(V v) {
  return Narrow<T>::apply(v);
}

// A value rounded to the storage type T after every operation: arithmetic "in T", computed through fp32. Exact
// emulation for bf16 and fp16, since fp32 has more than 2p+2 significand bits (double rounding is innocuous), so it
// matches PyTorch's eager CPU and CUDA bf16/fp16 arithmetic bit for bit.
template <typename T>
struct Rounded {
  float v;
  ROPEWKV_HD Rounded() : v(0.f) {}
  ROPEWKV_HD Rounded(float x) : v(widen(narrow<T>(x))) {}
  ROPEWKV_HD explicit operator float() const { return v; }
  ROPEWKV_HD friend Rounded operator+(Rounded a, Rounded b) { return Rounded(a.v + b.v); }
  ROPEWKV_HD friend Rounded operator-(Rounded a, Rounded b) { return Rounded(a.v - b.v); }
  ROPEWKV_HD friend Rounded operator*(Rounded a, Rounded b) { return Rounded(a.v * b.v); }
  ROPEWKV_HD friend Rounded operator/(Rounded a, Rounded b) { return Rounded(a.v / b.v); }
  ROPEWKV_HD friend Rounded operator-(Rounded a) { return Rounded(-a.v); }
};

// The full-precision compute type: fp32, or fp64 for fp64 I/O (CPU twin only, for gradcheck).
template <typename io_t>
using compute_t = std::conditional_t<std::is_same_v<io_t, double>, double, float>;

// The type arithmetic is done in, for I/O type io_t and precision P. fp32 and fp64 I/O have no lower mode.
template <typename io_t, Precision P>
using accum_t = std::conditional_t<P == Precision::kBF16 && !std::is_same_v<io_t, compute_t<io_t>>, Rounded<io_t>,
                                   compute_t<io_t>>;

// The build default, as RWKV-LM's typedef: `default_accum_t<bf16_t>` is float unless built with ROPEWKV_ACCUM=bf16.
template <typename io_t>
using default_accum_t = accum_t<io_t, kBuildPrecision>;

// The plain floating value of an accumulator (float, double or Rounded).
ROPEWKV_HD double plain(double v) { return v; }
ROPEWKV_HD float plain(float v) { return v; }
template <typename T>
ROPEWKV_HD float plain(Rounded<T> v) {
  return v.v;
}

}  // namespace ropewkv
