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

ROPEWKV_HD float widen(fp16_t v) {
  const uint32_t sign = uint32_t(v.bits & 0x8000u) << 16;
  const uint32_t exponent = (v.bits >> 10) & 0x1fu;
  const uint32_t mantissa = v.bits & 0x3ffu;
  if (exponent == 0x1fu) return bits_as_float(sign | 0x7f800000u | (mantissa << 13));  // inf, nan
  if (exponent != 0) return bits_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  const float subnormal = float(mantissa) * 5.9604644775390625e-8f;  // mantissa * 2^-24, exact
  return sign ? -subnormal : subnormal;
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

// NaN stays NaN (quiet). Branch-free (a select, not an early return) so that CPU loops over it vectorize.
template <>
struct Narrow<bf16_t> {
  ROPEWKV_HD static bf16_t apply(float v) {
  const uint32_t u = float_as_bits(v);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return bf16_t{uint16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded)};
  }
};

// Overflow to inf, gradual underflow.
template <>
struct Narrow<fp16_t> {
  ROPEWKV_HD static fp16_t apply(float v) {
  uint32_t u = float_as_bits(v);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  uint16_t out;
  if (u >= 0x47800000u) {  // >= 65536: inf (or nan)
    out = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (u < 0x38800000u) {  // below 2^-14: fp16 subnormal or zero; the add rounds at the right bit
    const uint32_t magic = 0x3f000000u;  // 0.5f: its ulp is 2^-24, the fp16 subnormal step
    out = uint16_t(float_as_bits(bits_as_float(u) + bits_as_float(magic)) - magic);
  } else {
    const uint32_t odd = (u >> 13) & 1u;
    u += 0xc8000fffu + odd;  // rebias exponent (-112 << 23) and round half to even
    out = uint16_t(u >> 13);
  }
  return fp16_t{uint16_t(out | sign)};
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

// The type arithmetic is done in, for I/O type io_t and precision P. fp32 and fp64 I/O have no lower mode, and
// fp64 I/O (CPU twin only, for gradcheck) computes in fp64.
template <typename io_t, Precision P>
using accum_t = std::conditional_t<
    std::is_same_v<io_t, double>, double,
    std::conditional_t<P == Precision::kBF16 && !std::is_same_v<io_t, float>, Rounded<io_t>, float>>;

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
