#pragma once
// RoPE math shared by the CPU twin and the CUDA kernels (torch-free).
//
// Conventions (python/ropewkv/reference/rope.py is the oracle):
//  - q and k arrive as [B, S, H, D] views (any strides, stride(-1) == 1); rotary_dim R = 2 * rot_half <= D.
//  - Pair j of a head is (x[a], x[b]) with (a, b) = (j, j + R/2) in the NeoX half style, (2j, 2j+1) interleaved.
//  - out[a] = x[a] cos_a - x[b] sin_a, out[b] = x[b] cos_b + x[a] sin_b (HF's x*cos + rotate_half(x)*sin). From
//    inv_freq, cos_a = cos_b = cos(pos * inv_freq[j]) * attention_scaling (sin alike); from a cos/sin table (HF's
//    apply_rotary_pos_emb) they are the table's entries at dims a and b.
//  - conjugate = the transpose of the rotation (the backward): cos stays, sin_a <- -sin_b and sin_b <- -sin_a. For
//    an angle (sin_a == sin_b) that is the rotation by -angle.
//  - Dims past R are copied unchanged when out-of-place.
//  - M-RoPE (Qwen2-VL's multimodal RoPE): positions hold three rows (temporal, height, width) per token and frequency j
//    takes its position from row mrope_row(p, j); everything else is plain RoPE.
//  - Precision::kBF16 rounds cos and sin to the I/O type and every product and sum to it (Rounded<io_t>): HF's eager
//    low-precision arithmetic, rnd(rnd(x1 c) - rnd(x2 s)), bit for bit given the same cos/sin.
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ropewkv/precision.h"

namespace ropewkv::rope {

// 2*pi split into three fp32 pieces (Cody-Waite), from a 200-bit value: HI + MID + LO = 2*pi to ~1e-22.
inline constexpr float kTwoPiHi = 0x1.921fb6p+2f;
inline constexpr float kTwoPiMid = -0x1.777a5cp-23f;
inline constexpr float kTwoPiLo = -0x1.ee59dap-48f;
inline constexpr float kInvTwoPi = 0x1.45f306p-3f;
// Positions are converted to fp32 exactly below this magnitude (2^24).
inline constexpr int64_t kMaxExactPosition = int64_t(1) << 24;

// The angle pos * f reduced to about [-pi, pi], in fp32 with error < 1e-6 rad for |pos| <= 2^20 (measured in
// tests/test_rope_angle.py): an exact two-product pos*f = p + e (fma), a three-piece Cody-Waite reduction of p, then e
// added back. Naive fp32 rounds pos*f itself, an error that grows like ulp(pos*f) (~3e-2 rad at 2^20).
ROPEWKV_HD float reduced_angle(float pos, float f) {
  const float p = pos * f;
  const float e = fmaf(pos, f, -p);  // exact: pos*f == p + e
  const float n = rintf(p * kInvTwoPi);
  float r = fmaf(-n, kTwoPiHi, p);  // exact: n has <= 18 bits, so n*HI and its cancellation with p fit in fp32
  r = fmaf(-n, kTwoPiMid, r);
  r = fmaf(-n, kTwoPiLo, r);
  return r + e;
}

// sin and cos of a reduced angle |r| <= ~pi (larger |r| lose accuracy): a quadrant reduction by pi/2
// (the three Cody-Waite pieces of 2*pi over 4, exact scalings) to |y| <= pi/4, then Cephes' minimax polynomials
// (sinf/cosf) in fma Horner form. Branch-free, so the CPU twin's `omp simd` loop vectorizes it; fmas only where written
// (no contraction), so the result does not depend on -march. Measured against sin/cos in fp64 of the fp32 argument
// (every 61st fp32 with |r| <= 3.25): <= 0.85 ulp (glibc's sinf/cosf: 0.56); the angle itself errs by up to 1e-6 rad.
// The CUDA twin runs it too (not sincosf, whose last bit differs from the host's; never __sinf, ~1e-2 off at large
// arguments), and triton_kernels/rope.py mirrors it (_sincos): the same bits on every twin.
ROPEWKV_HD void sincos_poly(float r, float* s, float* c) {
  const float q = rintf(r * 0x1.45f306p-1f);  // r * 2/pi: the quadrant
  // y = yh + yl, kept as a pair: yh exact (|q| <= 2 and yh cancels), yl = -q (MID + LO) the small rest.
  const float yh = fmaf(-q, 0.25f * kTwoPiHi, r);
  const float yl = fmaf(-q, 0.25f * kTwoPiLo, -q * (0.25f * kTwoPiMid));
  const float y = yh + yl;
  const float z = y * y;
  // sin: yh + (yl + y z P(z)), rounded once at the result's scale.
  const float sp = yh + fmaf(y * z, fmaf(fmaf(-1.9515295891e-4f, z, 8.3321608736e-3f), z, -1.6666654611e-1f), yl);
  // cos: 1 + (z^2 Q(z) - y^2/2), the small part summed first so that only the final addition rounds at 1's scale, and
  // y^2/2 = (zh + ze)/2 + yh yl to first order, zh + ze = yh^2 exactly (z's rounding would cost ~0.6 ulp near pi/4).
  const float zh = yh * yh;
  const float ze = fmaf(yh, yh, -zh);
  const float cq = fmaf(fmaf(2.443315711809948e-5f, z, -1.388731625493765e-3f), z, 4.166664568298827e-2f);
  const float cp = 1.f + fmaf(-0.5f, zh, fmaf(z * z, cq, fmaf(-yh, yl, -0.5f * ze)));
  // Quadrant q mod 4 (NaN and huge q -> 0; y is then NaN or the angle was meaningless anyway).
  const uint32_t quadrant = uint32_t(int32_t(fabsf(q) < 0x1p22f ? q : 0.f)) & 3u;
  const float sin_y = quadrant & 1u ? cp : sp;  // sin(y + q pi/2) = sin y, cos y, -sin y, -cos y
  const float cos_y = quadrant & 1u ? sp : cp;  // cos(y + q pi/2) = cos y, -sin y, -cos y, sin y
  *s = quadrant & 2u ? -sin_y : sin_y;
  *c = (quadrant + 1u) & 2u ? -cos_y : cos_y;
}

// cos and sin of the angle pos * f (the inv_freq source), times attention_scaling.
ROPEWKV_HD void angle_cos_sin(float pos, float f, float scaling, float* c, float* s) {
  float sv, cv;
  sincos_poly(reduced_angle(pos, f), &sv, &cv);
  *c = cv * scaling;
  *s = sv * scaling;
}

// dtype of a cos/sin table (apply_rotary_pos_emb reads any float dtype; fp64 on the CPU twin only).
enum class TableType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

// Everything a launch needs, normalised by the Python layer: sizes, element strides, raw pointers. Torch-free.
struct Params {
  int64_t batch = 0, seqlen = 0, hq = 0, hk = 0, head_dim = 0, rot_half = 0;
  // Element strides over [batch, seq, head] of q, k, q_out, k_out (stride of the last dim is 1).
  const void* q = nullptr;
  const void* k = nullptr;  // null when only q is rotated
  void* q_out = nullptr;
  void* k_out = nullptr;
  int64_t q_stride[3] = {0, 0, 0}, k_stride[3] = {0, 0, 0}, qo_stride[3] = {0, 0, 0}, ko_stride[3] = {0, 0, 0};
  bool interleaved = false, conjugate = false;

  // Angle source (cos == nullptr): inv_freq [rot_half] fp32; positions null or [B, S] (strides, stride 0 allowed);
  // offsets null or int64 [B] ([n_seqs] with cu_seqlens); cu_seqlens null or [n_seqs + 1] (then batch == 1).
  const float* inv_freq = nullptr;
  const void* positions = nullptr;
  bool positions_int64 = true;
  int64_t pos_stride[2] = {0, 0};
  // M-RoPE: positions is [3, B, S] (row stride pos_row_stride); mrope_section[r] frequencies follow row r, in chunks
  // (Qwen2/2.5-VL: T..T H..H W..W) or interleaved (Qwen3-VL: T H W T H W ..., the tail T).
  bool mrope = false, mrope_interleaved = false;
  int64_t mrope_section[3] = {0, 0, 0};
  int64_t pos_row_stride = 0;
  const int64_t* offsets = nullptr;
  const void* cu_seqlens = nullptr;
  bool cu_int64 = true;
  int64_t n_seqs = 0;
  float attention_scaling = 1.f;

  // Table source (cos != nullptr): cos and sin are [B, S, R] views of dtype table_type.
  const void* cos = nullptr;
  const void* sin = nullptr;
  TableType table_type = TableType::kFloat32;
  int64_t cos_stride[3] = {0, 0, 0}, sin_stride[3] = {0, 0, 0};
};

ROPEWKV_HD int64_t load_index(const void* p, bool is_int64, int64_t i) {
  return is_int64 ? static_cast<const int64_t*>(p)[i] : int64_t(static_cast<const int32_t*>(p)[i]);
}

// The sequence holding token t: the last i with cu_seqlens[i] <= t (binary search; a linear token grid, TE #2866).
ROPEWKV_HD int64_t sequence_of(const Params& p, int64_t t) {
  int64_t lo = 0, hi = p.n_seqs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (load_index(p.cu_seqlens, p.cu_int64, mid) <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Absolute position of token (b, s) in position row `row` (0 unless M-RoPE), as
// ropewkv.reference.rope.token_positions defines it.
ROPEWKV_HD int64_t token_position(const Params& p, int64_t b, int64_t s, int64_t row = 0) {
  const int64_t row_base = row * p.pos_row_stride;
  if (p.cu_seqlens != nullptr) {
    const int64_t seq = sequence_of(p, s);
    const int64_t base = p.positions != nullptr
                             ? load_index(p.positions, p.positions_int64, row_base + s * p.pos_stride[1])
                             : s - load_index(p.cu_seqlens, p.cu_int64, seq);
    return base + (p.offsets != nullptr ? p.offsets[seq] : 0);
  }
  const int64_t base =
      p.positions != nullptr
          ? load_index(p.positions, p.positions_int64, row_base + b * p.pos_stride[0] + s * p.pos_stride[1])
          : s;
  return base + (p.offsets != nullptr ? p.offsets[b] : 0);
}

// The M-RoPE row (0 temporal, 1 height, 2 width) whose position drives frequency j; 0 for plain RoPE.
ROPEWKV_HD int64_t mrope_row(const Params& p, int64_t j) {
  if (!p.mrope) return 0;
  if (p.mrope_interleaved) {
    const int64_t r = j % 3;
    return r != 0 && j < 3 * p.mrope_section[r] ? r : 0;
  }
  return j < p.mrope_section[0] ? 0 : j < p.mrope_section[0] + p.mrope_section[1] ? 1 : 2;
}

// The positions of token (b, s) in rows 0..2, indexed by mrope_row (plain RoPE: row 0's, repeated).
ROPEWKV_HD void token_positions(const Params& p, int64_t b, int64_t s, int64_t pos[3]) {
  pos[0] = token_position(p, b, s);
  pos[1] = p.mrope ? token_position(p, b, s, 1) : pos[0];
  pos[2] = p.mrope ? token_position(p, b, s, 2) : pos[0];
}

template <typename tab_t>
ROPEWKV_HD tab_t load_table(const void* ptr, TableType type, int64_t i) {
  switch (type) {
    case TableType::kFloat16:
      return tab_t(widen(static_cast<const fp16_t*>(ptr)[i]));
    case TableType::kBFloat16:
      return tab_t(widen(static_cast<const bf16_t*>(ptr)[i]));
    case TableType::kFloat64:
      return tab_t(static_cast<const double*>(ptr)[i]);
    default:
      return tab_t(static_cast<const float*>(ptr)[i]);
  }
}

ROPEWKV_HD void pair_dims(bool interleaved, int64_t rot_half, int64_t j, int64_t& a, int64_t& b) {
  a = interleaved ? 2 * j : j;
  b = interleaved ? 2 * j + 1 : j + rot_half;
}

// The stored table entries of one pair from its raw cos/sin at dims a and b: conjugated if asked, and rounded as acc_t
// rounds (to the I/O type in the low-precision mode).
template <typename acc_t, typename tab_t>
ROPEWKV_HD void finish_entry(bool conjugate, tab_t c_a, tab_t s_a, tab_t c_b, tab_t s_b, tab_t* ca, tab_t* sa,
                             tab_t* cb, tab_t* sb) {
  *ca = tab_t(plain(acc_t(c_a)));
  *sa = tab_t(plain(acc_t(conjugate ? -s_b : s_a)));
  *cb = tab_t(plain(acc_t(c_b)));
  *sb = tab_t(plain(acc_t(conjugate ? -s_a : s_b)));
}

// cos/sin of pair j of the token at (b, s) with absolute position `pos` (that of frequency j), for dims a and b
// (finish_entry). tab_t is
// float, or double for fp64 I/O (the CPU twin's gradcheck path, whose angle is computed in fp64).
template <typename acc_t, typename tab_t>
ROPEWKV_HD void table_entry(const Params& p, int64_t b, int64_t s, int64_t pos, int64_t j, tab_t* ca, tab_t* sa,
                            tab_t* cb, tab_t* sb) {
  tab_t c_a, s_a, c_b, s_b;
  if (p.cos == nullptr) {
    if constexpr (sizeof(tab_t) == sizeof(double)) {
      const double angle = double(pos) * double(p.inv_freq[j]);
      c_a = std::cos(angle) * double(p.attention_scaling);
      s_a = std::sin(angle) * double(p.attention_scaling);
    } else {
      angle_cos_sin(float(pos), p.inv_freq[j], p.attention_scaling, &c_a, &s_a);
    }
    c_b = c_a;
    s_b = s_a;
  } else {
    int64_t a, bd;
    pair_dims(p.interleaved, p.rot_half, j, a, bd);
    const int64_t cbase = b * p.cos_stride[0] + s * p.cos_stride[1];
    const int64_t sbase = b * p.sin_stride[0] + s * p.sin_stride[1];
    c_a = load_table<tab_t>(p.cos, p.table_type, cbase + a * p.cos_stride[2]);
    c_b = load_table<tab_t>(p.cos, p.table_type, cbase + bd * p.cos_stride[2]);
    s_a = load_table<tab_t>(p.sin, p.table_type, sbase + a * p.sin_stride[2]);
    s_b = load_table<tab_t>(p.sin, p.table_type, sbase + bd * p.sin_stride[2]);
  }
  finish_entry<acc_t>(p.conjugate, c_a, s_a, c_b, s_b, ca, sa, cb, sb);
}

// a b - c d in fp32 with Kahan's compensated difference of products: cd's rounding error is recovered exactly by an
// fma and added back, so the result errs by <= 1 ulp of max(|a b|, |c d|) (about the pair norm for a rotation: 0.5
// ulp in the fma, 0.5 in the final sum), where rounding both products errs by up to 1.5. Only fmas and a plain
// sum: nothing a compiler may contract, so every twin (and the Triton mirror, triton_kernels/rope.py's
// _diff_of_products) gives the same bits.
// An infinite c d has no finite error (the fma gives inf - inf = NaN): the term is dropped there (a select, so the
// CPU loops still vectorize), and infinities and NaN propagate as in the plain form.
ROPEWKV_HD float diff_of_products(float a, float b, float c, float d) {
  const float cd = c * d;
  const float cd_error = fmaf(-c, d, cd);  // exact: cd - c d
  return fmaf(a, b, -cd) + (cd_error == cd_error ? cd_error : 0.f);
}

// RoPE's arithmetic type: accum_t, except that precision="bf16" with fp32 I/O is HF's eager fp32 arithmetic (each
// product and the sum rounded: Rounded<float>), not the compensated fp32 form, so it stays bit-equal to HF.
template <typename io_t, Precision P>
using rope_accum_t =
    std::conditional_t<P == Precision::kBF16 && std::is_same_v<io_t, float>, Rounded<float>, accum_t<io_t, P>>;

// Rotate one pair of stored values in acc_t arithmetic: fp32 (compensated, diff_of_products), fp64, or rounded to the
// I/O type after each operation (HF's eager low-precision arithmetic, bit for bit).
template <typename acc_t, typename io_t, typename tab_t>
ROPEWKV_HD void rotate_values(io_t x_a, io_t x_b, tab_t ca, tab_t sa, tab_t cb, tab_t sb, io_t* out_a, io_t* out_b) {
  const acc_t xa = acc_t(widen(x_a));
  const acc_t xb = acc_t(widen(x_b));
  if constexpr (std::is_same_v<acc_t, float>) {
    *out_a = narrow<io_t>(diff_of_products(xa, float(ca), xb, float(sa)));
    *out_b = narrow<io_t>(diff_of_products(xb, float(cb), -xa, float(sb)));
  } else {
    const acc_t oa = xa * acc_t(ca) - xb * acc_t(sa);
    const acc_t ob = xb * acc_t(cb) + xa * acc_t(sb);
    *out_a = narrow<io_t>(plain(oa));
    *out_b = narrow<io_t>(plain(ob));
  }
}

// rotate_values on dims a and b of one head.
template <typename acc_t, typename io_t, typename tab_t>
ROPEWKV_HD void rotate_pair(const io_t* x, io_t* out, int64_t a, int64_t b, tab_t ca, tab_t sa, tab_t cb, tab_t sb) {
  const io_t x_a = x[a], x_b = x[b];  // both read before either is written (in place)
  rotate_values<acc_t>(x_a, x_b, ca, sa, cb, sb, &out[a], &out[b]);
}

// ------------------------------------------------------------------------------------------------------------------
// The CUDA kernel's thread map, here so that the host can test it (tests/test_rope_thread_map.py compiles this header
// with g++ and checks that every element of q and k is written exactly once).
//
// A thread owns one (token, head group, unit) and walks the heads group, group + groups, ... of q, then of k. A unit
// is a run of `width` consecutive dims, read and written with one access each on the vector path (width = 16 bytes
// of elements, all pointers and strides 16-byte aligned: rope_vector_width) or element by element otherwise:
//  - NeoX rotating unit u < rot_units: dims [u w, u w + w) and their partners [u w + R/2, ...): w pairs, w frequencies.
//  - GPT-J rotating unit u < rot_units: dims [u w, u w + w): w/2 adjacent pairs, w/2 frequencies.
//  - copy unit u >= rot_units (out of place only): dims [R + (u - rot_units) copy_w, ... + copy_w), unchanged.
// A thread computes the cos/sin of its unit's frequencies once per token and reuses them for all its heads; `groups`
// (> 1 when there are few tokens: decode) spreads a token's heads over more threads.
struct ThreadMap {
  int64_t width = 1;       // elements per rotating access run (GPT-J: an even number)
  int64_t copy_width = 1;  // elements per copying access run
  int64_t rot_units = 0, copy_units = 0, units = 0;  // per (token, head group)
  int64_t groups = 1;      // head groups per token
  int64_t threads = 0;     // tokens * groups * units
};

// Threads the map aims for before it splits a token's heads into groups: about two waves of an H100 at the vector
// kernel's occupancy (132 SMs x 4 blocks of 128 threads at <= 128 registers). More tokens than that keep one group,
// so each (token, frequency) angle is computed once; fewer (decode, short prefill) recompute it once per group.
inline constexpr int64_t kRopeTargetThreads = int64_t(1) << 17;

// Elements per 16-byte access if every access of the vector path is 16-byte aligned (pointers, strides of dims longer
// than 1, the rotary split and, when copying, head_dim), else 0: the element-wise path.
inline int64_t rope_vector_width(const Params& p, int64_t element_bytes, bool copy_rest) {
  const int64_t vec = 16 / element_bytes;
  const int64_t rot_run = p.interleaved ? 2 * p.rot_half : p.rot_half;
  if (rot_run % vec != 0 || (copy_rest && (p.head_dim - 2 * p.rot_half) % vec != 0)) return 0;
  const auto aligned = [&](const void* ptr, const int64_t* stride, int64_t heads) {
    const int64_t sizes[3] = {p.batch, p.seqlen, heads};
    bool ok = reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
    for (int i = 0; i < 3; ++i) ok = ok && (sizes[i] <= 1 || stride[i] % vec == 0);
    return ok;
  };
  bool ok = aligned(p.q, p.q_stride, p.hq) && aligned(p.q_out, p.qo_stride, p.hq);
  if (p.k != nullptr) ok = ok && aligned(p.k, p.k_stride, p.hk) && aligned(p.k_out, p.ko_stride, p.hk);
  return ok ? vec : 0;
}

// vec: rope_vector_width's answer (0: element-wise). copy_rest: dims past rotary_dim are copied (out of place).
inline ThreadMap make_thread_map(const Params& p, int64_t vec, bool copy_rest,
                                 int64_t target_threads = kRopeTargetThreads) {
  ThreadMap m;
  m.width = vec > 0 ? vec : (p.interleaved ? 2 : 1);
  m.copy_width = vec > 0 ? vec : 1;
  m.rot_units = (p.interleaved ? 2 * p.rot_half : p.rot_half) / m.width;
  m.copy_units = copy_rest ? (p.head_dim - 2 * p.rot_half) / m.copy_width : 0;
  m.units = m.rot_units + m.copy_units;
  const int64_t tokens = p.batch * p.seqlen;
  if (tokens == 0) return m;
  const int64_t heads = p.hq > (p.k != nullptr ? p.hk : 0) ? p.hq : p.hk;
  const int64_t per_token = m.units > 0 ? m.units : 1;
  const int64_t wanted = (target_threads + tokens * per_token - 1) / (tokens * per_token);
  m.groups = wanted < heads ? wanted : heads;
  if (m.groups < 1) m.groups = 1;
  m.threads = tokens * m.groups * m.units;
  return m;
}

// n / d and n % d, in 32 bits when n fits (the common case: no 64-bit division routine).
ROPEWKV_HD void divmod(int64_t n, int64_t d, int64_t* quotient, int64_t* remainder) {
  if ((n | d) >> 31 == 0) {
    const uint32_t q32 = uint32_t(n) / uint32_t(d);
    *quotient = q32;
    *remainder = n - int64_t(q32) * d;
  } else {
    *quotient = n / d;
    *remainder = n - *quotient * d;
  }
}

// How many of the heads group, group + groups, ... are below n.
ROPEWKV_HD int64_t group_heads(int64_t n, int64_t group, int64_t groups) {
  int64_t count = 0, rest;
  if (group < n) divmod(n - group + groups - 1, groups, &count, &rest);
  return count;
}

// What thread `thread` (< m.threads) owns.
struct ThreadWork {
  int64_t b, s;       // the token
  int64_t group;      // its heads: group, group + m.groups, ...
  int64_t unit;
  bool rotates;       // unit < m.rot_units
  int64_t first_dim;  // of its (first) run
  int64_t first_freq; // rotating: the frequency of its first pair
};

ROPEWKV_HD ThreadWork thread_work(const Params& p, const ThreadMap& m, int64_t thread) {
  ThreadWork w;
  int64_t row, token;
  divmod(thread, m.units, &row, &w.unit);
  divmod(row, m.groups, &token, &w.group);
  divmod(token, p.seqlen, &w.b, &w.s);
  w.rotates = w.unit < m.rot_units;
  if (w.rotates) {
    w.first_dim = w.unit * m.width;
    w.first_freq = p.interleaved ? w.first_dim / 2 : w.first_dim;
  } else {
    w.first_dim = 2 * p.rot_half + (w.unit - m.rot_units) * m.copy_width;
    w.first_freq = 0;
  }
  return w;
}

}  // namespace ropewkv::rope
