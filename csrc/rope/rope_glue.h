#pragma once
// Torch-facing glue shared by the CPU twin (rope_cpu.cpp) and the CUDA glue (rope_cuda.cpp): argument checks (the
// second guard behind the Python layer's), tensors -> rope::Params, output allocation, and the three op bodies.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "ropewkv/rope.h"
#include "ropewkv/torch_glue.h"

namespace ropewkv::rope {

inline void check_bshd(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 4, name, " must be a [batch, seq, heads, head_dim] view, got ", t.dim(), " dims");
  TORCH_CHECK_VALUE(t.size(3) <= 1 || t.stride(3) == 1, name, " must have stride 1 in its last dim, got ",
                    t.stride(3));
}

// rotary_name: where rotary_dim comes from, as the caller gave it (the error names it).
inline void set_io(Params& p, const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& q_out,
                   const std::optional<at::Tensor>& k_out, int64_t rotary_dim, const char* rotary_name,
                   bool allow_fp64) {
  check_bshd(q, "q");
  check_io_dtype(q, "q", allow_fp64);
  TORCH_CHECK_VALUE(rotary_dim % 2 == 0 && rotary_dim >= 0 && rotary_dim <= q.size(3), rotary_name,
                    " (the rotary dim) must be even and <= head_dim ", q.size(3), ", got ", rotary_dim);
  p.batch = q.size(0);
  p.seqlen = q.size(1);
  p.hq = q.size(2);
  p.head_dim = q.size(3);
  p.rot_half = rotary_dim / 2;
  p.q = q.const_data_ptr();
  p.q_out = q_out.data_ptr();
  for (int i = 0; i < 3; ++i) {
    p.q_stride[i] = q.stride(i);
    p.qo_stride[i] = q_out.stride(i);
  }
  if (k.has_value()) {
    check_bshd(*k, "k");
    TORCH_CHECK_TYPE(k->scalar_type() == q.scalar_type(), "k has dtype ", k->scalar_type(), " but q has ",
                     q.scalar_type());
    check_same_device(*k, q, "k", "q");
    TORCH_CHECK_VALUE(k->size(0) == q.size(0) && k->size(1) == q.size(1) && k->size(3) == q.size(3),
                      "k must be [batch, seq, kv_heads, head_dim] matching q ", q.sizes(), ", got ", k->sizes());
    p.hk = k->size(2);
    p.k = k->const_data_ptr();
    p.k_out = k_out->data_ptr();
    for (int i = 0; i < 3; ++i) {
      p.k_stride[i] = k->stride(i);
      p.ko_stride[i] = k_out->stride(i);
    }
  }
}

// Whether the [B, S, H, D] views q and k (one dtype, one B and S) may share an element; true when unsure:
// ropewkv/ops/rope.py's _share_memory. Slices of one buffer (a fused qkv projection) share none though their spans
// interleave: with the same batch and token strides, and one token of both within a token stride (nested likewise in
// the batch stride), no token can meet another, and the spans within a token decide. Otherwise (views shifted by
// whole tokens, say) the spans of the whole views decide.
inline bool may_share_memory(const at::Tensor& q, const at::Tensor& k) {
  if (q.numel() == 0 || k.numel() == 0) return false;
  const auto size = int64_t(q.element_size());
  const auto first = [](const at::Tensor& x) { return int64_t(reinterpret_cast<uintptr_t>(x.const_data_ptr())); };
  const auto last = [&](const at::Tensor& x, int from_dim) {  // x's last element over dims from_dim..3
    int64_t offset = 0;
    for (int d = from_dim; d < 4; ++d) offset += (x.size(d) - 1) * x.stride(d);
    return first(x) + size * offset;
  };
  std::vector<int> outer;  // the batch and token dims (of size > 1), by stride
  for (int d = 0; d < 2; ++d) {
    if (q.size(d) > 1) outer.push_back(d);
  }
  std::sort(outer.begin(), outer.end(), [&](int a, int b) { return q.stride(a) < q.stride(b); });
  bool nested = true;
  for (int d : outer) nested = nested && q.stride(d) == k.stride(d);
  if (nested) {
    const int64_t q_last = last(q, 2), k_last = last(k, 2);
    int64_t window = std::max(q_last, k_last) + size - std::min(first(q), first(k));  // one token of both
    for (int d : outer) {
      nested = nested && window <= q.stride(d) * size;
      window += (q.size(d) - 1) * q.stride(d) * size;
    }
    if (nested) return first(q) <= k_last && first(k) <= q_last;
  }
  return first(q) <= last(k, 0) && first(k) <= last(q, 0);
}

// In place, every element must be rotated exactly once: an expanded q or k, or q and k sharing memory, would have
// some rotated twice (and raced on by the CPU twin's threads). The Python layer checks this outside torch.compile
// only; a direct op call reaches here unchecked.
inline void check_inplace(const at::Tensor& q, const std::optional<at::Tensor>& k) {
  TORCH_CHECK_VALUE(at::has_internal_overlap(q) != at::MemOverlap::Yes,
                    "in place, q must not have elements sharing memory (an expanded tensor?); clone it");
  if (!k.has_value()) return;
  TORCH_CHECK_VALUE(at::has_internal_overlap(*k) != at::MemOverlap::Yes,
                    "in place, k must not have elements sharing memory (an expanded tensor?); clone it");
  TORCH_CHECK_VALUE(!may_share_memory(q, *k), "in place, q and k must not share memory (not one tensor, nor "
                    "overlapping views)");
}

inline bool is_index_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kInt || t.scalar_type() == at::kLong;
}

inline void set_angle_source(Params& p, const at::Tensor& q, const at::Tensor& inv_freq,
                             const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& offsets,
                             const std::optional<at::Tensor>& cu_seqlens, double attention_scaling,
                             at::OptionalIntArrayRef mrope_section, bool mrope_interleaved) {
  TORCH_CHECK_TYPE(inv_freq.scalar_type() == at::kFloat, "inv_freq must be float32, got ", inv_freq.scalar_type());
  TORCH_CHECK_VALUE(inv_freq.dim() == 1 && inv_freq.is_contiguous(), "inv_freq must be contiguous 1-D");
  check_same_device(inv_freq, q, "inv_freq", "q");
  p.inv_freq = inv_freq.const_data_ptr<float>();
  p.attention_scaling = float(attention_scaling);
  p.mrope = mrope_section.has_value();
  p.mrope_interleaved = mrope_interleaved;
  if (p.mrope) {
    const at::IntArrayRef section = *mrope_section;
    TORCH_CHECK_VALUE(section.size() == 3 && section[0] >= 0 && section[1] >= 0 && section[2] >= 0 &&
                          section[0] + section[1] + section[2] == p.rot_half,
                      "mrope_section must be 3 non-negative ints summing to rotary_dim / 2 = ", p.rot_half, ", got ",
                      section);
    TORCH_CHECK_VALUE(positions.has_value(), "mrope_section needs positions of shape [3, batch, seq]");
    for (int r = 0; r < 3; ++r) p.mrope_section[r] = section[r];
  }
  if (positions.has_value()) {
    TORCH_CHECK_TYPE(is_index_dtype(*positions), "positions must be int32 or int64, got ", positions->scalar_type());
    const int64_t rows = p.mrope ? 1 : 0;  // M-RoPE positions carry a leading row dim of 3
    TORCH_CHECK_VALUE(positions->dim() == 2 + rows && (!p.mrope || positions->size(0) == 3) &&
                          positions->size(rows) == p.batch && positions->size(rows + 1) == p.seqlen,
                      "positions must be a ", p.mrope ? "[3, batch, seq]" : "[batch, seq]", " view, got ",
                      positions->sizes());
    check_same_device(*positions, q, "positions", "q");
    p.positions = positions->const_data_ptr();
    p.positions_int64 = positions->scalar_type() == at::kLong;
    p.pos_row_stride = p.mrope ? positions->stride(0) : 0;
    p.pos_stride[0] = positions->stride(rows);
    p.pos_stride[1] = positions->stride(rows + 1);
  }
  int64_t n_offsets = p.batch;
  if (cu_seqlens.has_value()) {
    TORCH_CHECK_TYPE(is_index_dtype(*cu_seqlens), "cu_seqlens must be int32 or int64, got ",
                     cu_seqlens->scalar_type());
    TORCH_CHECK_VALUE(cu_seqlens->dim() == 1 && cu_seqlens->is_contiguous() && cu_seqlens->numel() >= 2,
                      "cu_seqlens must be contiguous 1-D with n_seqs + 1 >= 2 entries");
    TORCH_CHECK_VALUE(p.batch == 1, "with cu_seqlens, q must be a [1, total_tokens, heads, head_dim] view");
    check_same_device(*cu_seqlens, q, "cu_seqlens", "q");
    p.cu_seqlens = cu_seqlens->const_data_ptr();
    p.cu_int64 = cu_seqlens->scalar_type() == at::kLong;
    p.n_seqs = cu_seqlens->numel() - 1;
    n_offsets = p.n_seqs;
  }
  if (offsets.has_value()) {
    TORCH_CHECK_TYPE(offsets->scalar_type() == at::kLong, "seqlen_offsets must be int64, got ",
                     offsets->scalar_type());
    TORCH_CHECK_VALUE(offsets->dim() == 1 && offsets->is_contiguous() && offsets->numel() == n_offsets,
                      "seqlen_offsets must be contiguous [", n_offsets, "], got ", offsets->sizes());
    check_same_device(*offsets, q, "seqlen_offsets", "q");
    p.offsets = offsets->const_data_ptr<int64_t>();
  }
}

inline TableType table_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return TableType::kFloat32;
    case at::kHalf:
      return TableType::kFloat16;
    case at::kBFloat16:
      return TableType::kBFloat16;
    case at::kDouble:
      return TableType::kFloat64;
    default:
      TORCH_CHECK_TYPE(false, "cos/sin must be floating point, got ", t.scalar_type());
  }
}

inline void set_table_source(Params& p, const at::Tensor& q, const at::Tensor& cos, const at::Tensor& sin,
                             bool allow_fp64) {
  TORCH_CHECK_VALUE(cos.sizes() == sin.sizes(), "cos has shape ", cos.sizes(), " but sin has ", sin.sizes());
  TORCH_CHECK_TYPE(cos.scalar_type() == sin.scalar_type(), "cos and sin must have the same dtype");
  TORCH_CHECK_VALUE(cos.dim() == 3 && cos.size(0) == p.batch && cos.size(1) == p.seqlen &&
                        cos.size(2) == 2 * p.rot_half,
                    "cos/sin must be [batch, seq, rotary_dim] views, got ", cos.sizes());
  check_same_device(cos, q, "cos", "q");
  check_same_device(sin, q, "sin", "q");
  p.table_type = table_type(cos);
  TORCH_CHECK_TYPE(allow_fp64 || p.table_type != TableType::kFloat64, "cos/sin must not be float64 on this device");
  p.cos = cos.const_data_ptr();
  p.sin = sin.const_data_ptr();
  for (int i = 0; i < 3; ++i) {
    p.cos_stride[i] = cos.stride(i);
    p.sin_stride[i] = sin.stride(i);
  }
}

inline std::vector<at::Tensor> outputs(const at::Tensor& q, const std::optional<at::Tensor>& k) {
  std::vector<at::Tensor> out{new_output_like(q)};
  if (k.has_value()) out.push_back(new_output_like(*k));
  return out;
}

inline std::optional<at::Tensor> second(const std::vector<at::Tensor>& v) {
  return v.size() > 1 ? std::optional<at::Tensor>(v[1]) : std::nullopt;
}

// The op bodies, parameterised by the device's launch(params, q dtype, precision) and whether fp64 is allowed.
template <typename Launch>
std::vector<at::Tensor> rope_functional(Launch&& launch, bool allow_fp64, const at::Tensor& q,
                                        const std::optional<at::Tensor>& k, const at::Tensor& inv_freq,
                                        const std::optional<at::Tensor>& positions,
                                        const std::optional<at::Tensor>& offsets,
                                        const std::optional<at::Tensor>& cu_seqlens, bool interleaved, bool conjugate,
                                        double attention_scaling, int64_t precision,
                                        at::OptionalIntArrayRef mrope_section, bool mrope_interleaved) {
  std::vector<at::Tensor> out = outputs(q, k);
  Params p;
  set_io(p, q, k, out[0], second(out), 2 * inv_freq.numel(), "2 * inv_freq.numel()", allow_fp64);
  set_angle_source(p, q, inv_freq, positions, offsets, cu_seqlens, attention_scaling, mrope_section,
                   mrope_interleaved);
  p.interleaved = interleaved;
  p.conjugate = conjugate;
  launch(p, q.scalar_type(), precision_from(precision));
  return out;
}

template <typename Launch>
void rope_inplace(Launch&& launch, bool allow_fp64, const at::Tensor& q, const std::optional<at::Tensor>& k,
                  const at::Tensor& inv_freq, const std::optional<at::Tensor>& positions,
                  const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& cu_seqlens,
                  bool interleaved, bool conjugate, double attention_scaling, int64_t precision,
                  at::OptionalIntArrayRef mrope_section, bool mrope_interleaved) {
  Params p;
  set_io(p, q, k, q, k, 2 * inv_freq.numel(), "2 * inv_freq.numel()", allow_fp64);
  check_inplace(q, k);
  set_angle_source(p, q, inv_freq, positions, offsets, cu_seqlens, attention_scaling, mrope_section,
                   mrope_interleaved);
  p.interleaved = interleaved;
  p.conjugate = conjugate;
  launch(p, q.scalar_type(), precision_from(precision));
}

template <typename Launch>
std::vector<at::Tensor> rope_cos_sin_functional(Launch&& launch, bool allow_fp64, const at::Tensor& q,
                                                const std::optional<at::Tensor>& k, const at::Tensor& cos,
                                                const at::Tensor& sin, bool interleaved, bool conjugate,
                                                int64_t precision) {
  std::vector<at::Tensor> out = outputs(q, k);
  Params p;
  TORCH_CHECK_VALUE(cos.dim() == 3, "cos must be a [batch, seq, rotary_dim] view, got ", cos.sizes());
  set_io(p, q, k, out[0], second(out), cos.size(2), "cos.size(-1)", allow_fp64);
  set_table_source(p, q, cos, sin, allow_fp64);
  p.interleaved = interleaved;
  p.conjugate = conjugate;
  launch(p, q.scalar_type(), precision_from(precision));
  return out;
}

}  // namespace ropewkv::rope

// The schemas, shared by rope_cpu.cpp (which defines them) and the impl registrations of both devices.
#define ROPEWKV_ROPE_ANGLE_ARGS                                                                            \
  "Tensor inv_freq, Tensor? positions, Tensor? seqlen_offsets, Tensor? cu_seqlens, bool interleaved, " \
  "bool conjugate, float attention_scaling, int precision, int[]? mrope_section, bool mrope_interleaved"
