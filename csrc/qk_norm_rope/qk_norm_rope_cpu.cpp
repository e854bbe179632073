// CPU twin and schemas of the fused QK-RMSNorm + RoPE. Parallel over tokens (forward) or over fixed chunks of
// kChunkTokens tokens (backward: each chunk writes its own weight-gradient partial, summed afterwards in chunk order,
// so dw is bitwise the same for any thread count). Per token the cos/sin of each frequency is computed once and reused
// by every head of q and k; the math is ropewkv/qk_norm_rope.h, shared with CUDA.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "qk_norm_rope_glue.h"

namespace ropewkv::qk_norm_rope {
namespace {

// The token's cos/sin entries [4, rot_half] (ca, sa, cb, sb). The angle source as a loop that vectorizes.
template <typename acc_t, typename c_t>
[[gnu::flatten]] void fill_entries(const Params& p, int64_t b, int64_t s, int64_t pos, c_t* table) {
  const int64_t rh = p.rope.rot_half;
  c_t *ca = table, *sa = table + rh, *cb = table + 2 * rh, *sb = table + 3 * rh;
  if constexpr (std::is_same_v<c_t, float>) {
    if (p.cache == nullptr && p.rope.cos == nullptr) {
      const float posf = float(pos), scaling = p.rope.attention_scaling;
      const float* inv_freq = p.rope.inv_freq;
      const bool conjugate = p.rope.conjugate;
#pragma omp simd
      for (int64_t j = 0; j < rh; ++j) {
        float c, sn;
        rope::angle_cos_sin(posf, inv_freq[j], scaling, &c, &sn);
        rope::finish_entry<acc_t>(false, c, sn, c, sn, &ca[j], &sa[j], &cb[j], &sb[j]);
      }
      if (conjugate) {  // sin_a <- -sin_b, sin_b <- -sin_a; equal halves for an angle
        for (int64_t j = 0; j < rh; ++j) sa[j] = sb[j] = -sa[j];
      }
      return;
    }
  }
  for (int64_t j = 0; j < rh; ++j) pair_entry<acc_t>(p, b, s, pos, j, &ca[j], &sa[j], &cb[j], &sb[j]);
}

struct Row {
  const void* x;
  void* out;
  const void* grad;
  const void* weight;
};

// Row `h` of q (h < hq) or k of token (b, s).
inline Row row_of(const Params& p, int64_t b, int64_t s, int64_t h, size_t elem) {
  const bool is_q = h < p.rope.hq;
  const int64_t hh = is_q ? h : h - p.rope.hq;
  const int64_t* in = is_q ? p.rope.q_stride : p.rope.k_stride;
  const int64_t* out = is_q ? p.rope.qo_stride : p.rope.ko_stride;
  const int64_t* g = is_q ? p.gq_stride : p.gk_stride;
  const auto at = [&](const void* base, const int64_t* st) {
    return base == nullptr ? nullptr
                           : static_cast<const char*>(base) + elem * (b * st[0] + s * st[1] + hh * st[2]);
  };
  return Row{at(is_q ? p.rope.q : p.rope.k, in), const_cast<char*>(at(is_q ? p.rope.q_out : p.rope.k_out, out)),
             at(is_q ? p.grad_q : p.grad_k, g), is_q ? p.q_weight : p.k_weight};
}

template <typename io_t, typename c_t>
c_t inv_rms_of(const Params& p, const io_t* x) {
  c_t sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < p.rope.head_dim; ++d) sum += c_t(widen(x[d])) * c_t(widen(x[d]));
  return inv_rms<c_t>(sum, p.rope.head_dim, p.eps);
}

template <typename acc_t, typename io_t, typename c_t>
[[gnu::flatten]] void forward_row(const Params& p, const Row& row, const c_t* table, c_t* y) {
  const int64_t rh = p.rope.rot_half, dim = p.rope.head_dim;
  const io_t* x = static_cast<const io_t*>(row.x);
  io_t* out = static_cast<io_t*>(row.out);
  if (p.normalize()) {
    const c_t r = inv_rms_of<io_t, c_t>(p, x);
    const c_t* w = static_cast<const c_t*>(row.weight);
    const float offset = p.weight_offset;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) y[d] = normed<acc_t>(c_t(widen(x[d])), r, w[d], offset);
  } else {
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) y[d] = c_t(widen(x[d]));
  }
  const c_t *ca = table, *sa = table + rh, *cb = table + 2 * rh, *sb = table + 3 * rh;
  const int64_t step = p.rope.interleaved ? 2 : 1, partner = p.rope.interleaved ? 1 : rh;
  // `omp simd`: iteration j reads y and writes only its own pair of out, so in place (out == x) is safe too.
#pragma omp simd
  for (int64_t j = 0; j < rh; ++j) {
    const int64_t a = step * j, bd = a + partner;
    c_t oa, ob;
    rotate_values<acc_t>(y[a], y[bd], ca[j], sa[j], cb[j], sb[j], &oa, &ob);
    out[a] = narrow<io_t>(oa);
    out[bd] = narrow<io_t>(ob);
  }
  for (int64_t d = 2 * rh; d < dim; ++d) out[d] = narrow<io_t>(y[d]);
}

// dx of one row into row.out; adds dy * n to dw (the chunk's partial) when normalising.
template <typename io_t, typename c_t>
[[gnu::flatten]] void backward_row(const Params& p, const Row& row, const c_t* table, c_t* dy, c_t* dw) {
  const int64_t rh = p.rope.rot_half, dim = p.rope.head_dim;
  const io_t* x = static_cast<const io_t*>(row.x);
  const io_t* g = static_cast<const io_t*>(row.grad);
  io_t* dx = static_cast<io_t*>(row.out);
  const c_t *ca = table, *sa = table + rh, *cb = table + 2 * rh, *sb = table + 3 * rh;
  const int64_t step = p.rope.interleaved ? 2 : 1, partner = p.rope.interleaved ? 1 : rh;
#pragma omp simd
  for (int64_t j = 0; j < rh; ++j) {
    const int64_t a = step * j, bd = a + partner;
    rotate_values<c_t>(c_t(widen(g[a])), c_t(widen(g[bd])), ca[j], sa[j], cb[j], sb[j], &dy[a], &dy[bd]);
  }
  for (int64_t d = 2 * rh; d < dim; ++d) dy[d] = c_t(widen(g[d]));
  if (!p.normalize()) {
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) dx[d] = narrow<io_t>(dy[d]);
    return;
  }
  const c_t r = inv_rms_of<io_t, c_t>(p, x);
  const c_t* w = static_cast<const c_t*>(row.weight);
  const c_t offset = c_t(p.weight_offset);
  c_t dot = 0;
#pragma omp simd reduction(+ : dot)
  for (int64_t d = 0; d < dim; ++d) {
    const c_t n = c_t(widen(x[d])) * r;
    dw[d] += dy[d] * n;
    dot += dy[d] * (offset + w[d]) * n;
  }
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) {
    dx[d] = narrow<io_t>(norm_input_grad(dy[d], c_t(widen(x[d])) * r, offset + w[d], r, dot, dim));
  }
}

inline int64_t rows_per_token(const Params& p) { return p.rope.hq + (p.rope.k != nullptr ? p.rope.hk : 0); }

template <typename io_t, Precision P>
void forward_kernel(const Params& p) {
  using acc_t = accum_t<io_t, P>;
  using c_t = compute_t<io_t>;
  const int64_t tokens = p.rope.batch * p.rope.seqlen, rows = rows_per_token(p);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / (rows * p.rope.head_dim + 1));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<c_t> table(4 * p.rope.rot_half), y(p.rope.head_dim);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / p.rope.seqlen, s = t - b * p.rope.seqlen;
      const bool from_table = p.rope.cos != nullptr;
      fill_entries<acc_t>(p, b, s, from_table ? 0 : rope::token_position(p.rope, b, s), table.data());
      for (int64_t h = 0; h < rows; ++h) {
        forward_row<acc_t, io_t>(p, row_of(p, b, s, h, sizeof(io_t)), table.data(), y.data());
      }
    }
  });
}

template <typename io_t>
void backward_kernel(const Params& p) {
  using c_t = compute_t<io_t>;
  const int64_t tokens = p.rope.batch * p.rope.seqlen, rows = rows_per_token(p), dim = p.rope.head_dim;
  const int64_t chunks = (tokens + p.chunk_tokens - 1) / p.chunk_tokens;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<c_t> table(4 * p.rope.rot_half), dy(dim);
    for (int64_t c = begin; c < end; ++c) {
      c_t* dwq = p.normalize() ? static_cast<c_t*>(p.dq_weight) + c * dim : nullptr;
      c_t* dwk = p.normalize() && p.dk_weight != nullptr ? static_cast<c_t*>(p.dk_weight) + c * dim : nullptr;
      if (dwq != nullptr) std::fill(dwq, dwq + dim, c_t(0));
      if (dwk != nullptr) std::fill(dwk, dwk + dim, c_t(0));
      for (int64_t t = c * p.chunk_tokens; t < std::min(tokens, (c + 1) * p.chunk_tokens); ++t) {
        const int64_t b = t / p.rope.seqlen, s = t - b * p.rope.seqlen;
        const bool from_table = p.rope.cos != nullptr;
        fill_entries<c_t>(p, b, s, from_table ? 0 : rope::token_position(p.rope, b, s), table.data());
        for (int64_t h = 0; h < rows; ++h) {
          backward_row<io_t>(p, row_of(p, b, s, h, sizeof(io_t)), table.data(), dy.data(),
                             h < p.rope.hq ? dwq : dwk);
        }
      }
    }
  });
}

void launch_forward(const Params& p, at::ScalarType dtype, Precision precision) {
  if (p.rope.batch * p.rope.seqlen == 0 || p.rope.head_dim == 0) return;
  ROPEWKV_DISPATCH_IO(dtype, "qk_norm_rope_cpu", [&] {
    ROPEWKV_DISPATCH_PRECISION(precision, [&] { forward_kernel<io_t, kPrecision>(p); });
  });
}

void launch_backward(const Params& p, at::ScalarType dtype) {
  if (p.rope.batch * p.rope.seqlen == 0 || p.rope.head_dim == 0) return;
  ROPEWKV_DISPATCH_IO(dtype, "qk_norm_rope_backward_cpu", [&] { backward_kernel<io_t>(p); });
}

// Sums the [chunks, head_dim] partials over chunks, in chunk order.
at::Tensor reduce_chunks(const at::Tensor& partial) {
  at::Tensor sum = at::zeros({partial.size(1)}, partial.options());
  AT_DISPATCH_FLOATING_TYPES(partial.scalar_type(), "qk_norm_rope_reduce", [&] {
    const scalar_t* src = partial.const_data_ptr<scalar_t>();
    scalar_t* dst = sum.data_ptr<scalar_t>();
    for (int64_t c = 0; c < partial.size(0); ++c) {
      for (int64_t d = 0; d < partial.size(1); ++d) dst[d] += src[c * partial.size(1) + d];
    }
  });
  return sum;
}

std::vector<at::Tensor> forward_cpu(const at::Tensor& q, const OptTensor& k, ROPEWKV_QK_SOURCE_PARAMS) {
  return forward(launch_forward, true, q, k, ROPEWKV_QK_SOURCE_VALUES, precision);
}

void forward_inplace_cpu(const at::Tensor& q, const OptTensor& k, ROPEWKV_QK_SOURCE_PARAMS) {
  forward_inplace(launch_forward, true, q, k, ROPEWKV_QK_SOURCE_VALUES, precision);
}

std::vector<at::Tensor> backward_cpu(const at::Tensor& grad_q, const OptTensor& grad_k, const at::Tensor& q,
                                     const OptTensor& k, ROPEWKV_QK_SOURCE_PARAMS) {
  return backward(launch_backward, reduce_chunks, true, grad_q, grad_k, q, k, ROPEWKV_QK_SOURCE_VALUES, precision);
}

}  // namespace
}  // namespace ropewkv::qk_norm_rope

TORCH_LIBRARY_FRAGMENT(ropewkv, m) {
  m.def("qk_norm_rope(Tensor q, Tensor? k, " ROPEWKV_QK_NORM_ROPE_ARGS ") -> Tensor[]");
  m.def("qk_norm_rope_(Tensor(a!) q, Tensor(b!)? k, " ROPEWKV_QK_NORM_ROPE_ARGS ") -> ()");
  m.def("qk_norm_rope_backward(Tensor grad_q, Tensor? grad_k, Tensor q, Tensor? k, " ROPEWKV_QK_NORM_ROPE_ARGS
        ") -> Tensor[]");
}

TORCH_LIBRARY_IMPL(ropewkv, CPU, m) {
  m.impl("qk_norm_rope", &ropewkv::qk_norm_rope::forward_cpu);
  m.impl("qk_norm_rope_", &ropewkv::qk_norm_rope::forward_inplace_cpu);
  m.impl("qk_norm_rope_backward", &ropewkv::qk_norm_rope::backward_cpu);
}
