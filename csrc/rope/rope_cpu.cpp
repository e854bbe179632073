// CPU twin and schemas of RoPE. Parallel over tokens (at::parallel_for); per token the cos/sin table is computed
// once per frequency and reused across every head of q and k (ropewkv/rope.h holds the math, shared with CUDA).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "rope_glue.h"

namespace ropewkv::rope {
namespace {

// The token's cos/sin table [4, rot_half] (ca, sa, cb, sb), as table_entry defines it. gnu::flatten here and on
// rotate_heads: the shared math must be inlined into the loops for them to vectorize (GCC's heuristics balk at some).
template <typename acc_t, typename tab_t>
[[gnu::flatten]] void fill_table(const Params& p, int64_t b, int64_t s, const int64_t pos[3], tab_t* table) {
  const int64_t rh = p.rot_half;
  tab_t *ca = table, *sa = table + rh, *cb = table + 2 * rh, *sb = table + 3 * rh;
  if constexpr (std::is_same_v<tab_t, float>) {
    if (p.cos == nullptr) {  // the angle source: table_entry's path, as a loop that vectorizes
      // Locals, not loads through p: the stores below could alias p as far as the vectorizer knows. `conjugate` is a
      // compile-time constant per loop (a runtime bool in the loop body stops GCC's vectorizer).
      const float posf[3] = {float(pos[0]), float(pos[1]), float(pos[2])}, scaling = p.attention_scaling;
      const float* inv_freq = p.inv_freq;
      const auto fill = [&](auto conjugate) {
#pragma omp simd
        for (int64_t j = 0; j < rh; ++j) {
          float c, sn;
          angle_cos_sin(posf[mrope_row(p, j)], inv_freq[j], scaling, &c, &sn);
          finish_entry<acc_t>(conjugate.value, c, sn, c, sn, &ca[j], &sa[j], &cb[j], &sb[j]);
        }
      };
      p.conjugate ? fill(std::true_type{}) : fill(std::false_type{});
      return;
    }
  }
  for (int64_t j = 0; j < rh; ++j) {
    table_entry<acc_t>(p, b, s, pos[mrope_row(p, j)], j, &ca[j], &sa[j], &cb[j], &sb[j]);
  }
}

template <typename acc_t, typename io_t, typename tab_t>
[[gnu::flatten]] void rotate_heads(const Params& p, int64_t b, int64_t s, const void* in, void* out, int64_t heads,
                  const int64_t* in_st, const int64_t* out_st, const tab_t* table) {
  const int64_t rh = p.rot_half;
  const tab_t *ca = table, *sa = table + rh, *cb = table + 2 * rh, *sb = table + 3 * rh;
  for (int64_t h = 0; h < heads; ++h) {
    const io_t* x = static_cast<const io_t*>(in) + b * in_st[0] + s * in_st[1] + h * in_st[2];
    io_t* o = static_cast<io_t*>(out) + b * out_st[0] + s * out_st[1] + h * out_st[2];
    // `omp simd`: iteration j reads and writes only its own pair, so in place (o == x) is safe too.
    if (p.interleaved) {
#pragma omp simd
      for (int64_t j = 0; j < rh; ++j) rotate_pair<acc_t>(x, o, 2 * j, 2 * j + 1, ca[j], sa[j], cb[j], sb[j]);
    } else {
#pragma omp simd
      for (int64_t j = 0; j < rh; ++j) rotate_pair<acc_t>(x, o, j, j + rh, ca[j], sa[j], cb[j], sb[j]);
    }
    if (o != x) std::copy(x + 2 * rh, x + p.head_dim, o + 2 * rh);  // dims past rotary_dim, bit-exact
  }
}

template <typename io_t, Precision P>
void rope_cpu_kernel(const Params& p) {
  using acc_t = rope_accum_t<io_t, P>;
  using tab_t = compute_t<io_t>;
  const int64_t tokens = p.batch * p.seqlen;
  const int64_t per_token = (p.hq + (p.k != nullptr ? p.hk : 0)) * p.head_dim + 1;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / per_token);
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<tab_t> table(4 * p.rot_half);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / p.seqlen;
      const int64_t s = t - b * p.seqlen;
      int64_t pos[3] = {0, 0, 0};
      if (p.cos == nullptr) token_positions(p, b, s, pos);
      fill_table<acc_t>(p, b, s, pos, table.data());
      rotate_heads<acc_t, io_t>(p, b, s, p.q, p.q_out, p.hq, p.q_stride, p.qo_stride, table.data());
      if (p.k != nullptr) rotate_heads<acc_t, io_t>(p, b, s, p.k, p.k_out, p.hk, p.k_stride, p.ko_stride, table.data());
    }
  });
}

void launch_cpu(const Params& p, at::ScalarType dtype, Precision precision) {
  if (p.batch * p.seqlen == 0) return;
  ROPEWKV_DISPATCH_IO(dtype, "rope_cpu", [&] {
    ROPEWKV_DISPATCH_PRECISION(precision, [&] { rope_cpu_kernel<io_t, kPrecision>(p); });
  });
}

std::vector<at::Tensor> rope_cpu(const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& inv_freq,
                                 const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& offsets,
                                 const std::optional<at::Tensor>& cu_seqlens, bool interleaved, bool conjugate,
                                 double attention_scaling, int64_t precision, at::OptionalIntArrayRef mrope_section,
                                 bool mrope_interleaved) {
  return rope_functional(launch_cpu, true, q, k, inv_freq, positions, offsets, cu_seqlens, interleaved, conjugate,
                         attention_scaling, precision, mrope_section, mrope_interleaved);
}

void rope_inplace_cpu(const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& inv_freq,
                      const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& offsets,
                      const std::optional<at::Tensor>& cu_seqlens, bool interleaved, bool conjugate,
                      double attention_scaling, int64_t precision, at::OptionalIntArrayRef mrope_section,
                      bool mrope_interleaved) {
  rope_inplace(launch_cpu, true, q, k, inv_freq, positions, offsets, cu_seqlens, interleaved, conjugate,
               attention_scaling, precision, mrope_section, mrope_interleaved);
}

std::vector<at::Tensor> rope_cos_sin_cpu(const at::Tensor& q, const std::optional<at::Tensor>& k,
                                         const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                                         bool conjugate, int64_t precision) {
  return rope_cos_sin_functional(launch_cpu, true, q, k, cos, sin, interleaved, conjugate, precision);
}

}  // namespace
}  // namespace ropewkv::rope

TORCH_LIBRARY_FRAGMENT(ropewkv, m) {
  m.def("rope(Tensor q, Tensor? k, " ROPEWKV_ROPE_ANGLE_ARGS ") -> Tensor[]");
  m.def("rope_(Tensor(a!) q, Tensor(b!)? k, " ROPEWKV_ROPE_ANGLE_ARGS ") -> ()");
  m.def("rope_cos_sin(Tensor q, Tensor? k, Tensor cos, Tensor sin, bool interleaved, bool conjugate, int precision) "
        "-> Tensor[]");
}

TORCH_LIBRARY_IMPL(ropewkv, CPU, m) {
  m.impl("rope", &ropewkv::rope::rope_cpu);
  m.impl("rope_", &ropewkv::rope::rope_inplace_cpu);
  m.impl("rope_cos_sin", &ropewkv::rope::rope_cos_sin_cpu);
}
