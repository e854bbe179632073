// Schemas and CPU twin of the chunked WKV7 ops (ropewkv::wkv7_chunked_forward / _backward), built from the chunk
// math in ropewkv/wkv7_chunked.h (derivation: python/ropewkv/ops/rwkv7/chunked.md). Same arguments, outputs and
// checkpoint tensor shape as the sequential ops; parallel over (sequence, head), each task walks its chunks in order.
// The checkpoints hold the state before each chunk, k-major (ST[k][v]), as the sequential ops store theirs.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "ropewkv/wkv7_chunked.h"
#include "wkv7_glue.h"

namespace ropewkv {
namespace {

using wkv7::Decay;
using wkv7::chunked::Chunk;
using wkv7::chunked::ChunkGrads;
using wkv7::chunked::kChunk;

template <typename T>
struct TypeTag {
  using type = T;
};

template <typename scalar_t, typename Body>
void dispatch_w(const wkv7::Inputs& in, Body&& body) {
  if (in.w.scalar_type() == in.r.scalar_type()) return body(TypeTag<scalar_t>{});
  TORCH_CHECK_TYPE(in.w.scalar_type() == at::kFloat, "w must have r's dtype (", in.r.scalar_type(),
                   ") or float32, got ", in.w.scalar_type());
  body(TypeTag<float>{});
}

void check_cu_seqlens_values(const wkv7::Inputs& in) {
  if (!in.cu_seqlens.defined()) return;
  const int64_t* cu = in.cu_seqlens.const_data_ptr<int64_t>();
  TORCH_CHECK_VALUE(cu[0] == 0 && cu[in.n_seqs] == in.seqlen, "cu_seqlens must start at 0 and end at T = ",
                    in.seqlen, ", got ", in.cu_seqlens);
  for (int64_t s = 0; s < in.n_seqs; ++s) {
    TORCH_CHECK_VALUE(cu[s] <= cu[s + 1], "cu_seqlens must be non-decreasing, got ", in.cu_seqlens);
  }
}

// Reads one chunk's inputs (tokens q .. q + len - 1 of batch row `batch`, head h) into ch.
template <Precision P, typename scalar_t, typename w_scalar_t, typename acc_t>
void load_chunk(const wkv7::Inputs& in, int64_t batch, int64_t q, int len, int64_t h, Decay decay, bool with_grad,
                Chunk<acc_t>& ch) {
  using io_t = storage_t<scalar_t>;
  const int64_t n = in.head_size;
  const io_t* src[5] = {storage_ptr<scalar_t>(in.r), storage_ptr<scalar_t>(in.k), storage_ptr<scalar_t>(in.v),
                        storage_ptr<scalar_t>(in.a), storage_ptr<scalar_t>(in.b)};
  acc_t* dst[5] = {ch.r.data(), ch.k.data(), ch.v.data(), ch.a.data(), ch.b.data()};
  const storage_t<w_scalar_t>* w = storage_ptr<w_scalar_t>(in.w);
  ch.len = len;
  for (int l = 0; l < len; ++l) {
    const int64_t base = ((batch * in.seqlen + q + l) * in.heads + h) * n;
    for (int x = 0; x < 5; ++x)
      for (int64_t j = 0; j < n; ++j) dst[x][l * n + j] = wkv7::load<P>(src[x][base + j]);
    for (int64_t j = 0; j < n; ++j) {
      const acc_t wj = wkv7::load<wkv7::kDecayMode<P, io_t>>(w[base + j]);
      ch.logd[l * n + j] = wkv7::log_decay(wj, decay);
      if (with_grad) ch.dlog[l * n + j] = wkv7::log_decay_grad(wj, decay);
    }
  }
  ch.prepare();
}

// ST (k-major) <- the state at the start of sequence s (initial_state[s] or zeros).
template <typename acc_t>
void load_initial(const wkv7::Inputs& in, int64_t s, int64_t h, acc_t* ST) {
  const int64_t n = in.head_size, nn = n * n;
  if (!in.initial_state.defined()) {
    std::fill(ST, ST + nn, acc_t(0));
    return;
  }
  const acc_t* src = in.initial_state.const_data_ptr<acc_t>() + (s * in.heads + h) * nn;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) ST[j * n + i] = src[i * n + j];
}

template <typename acc_t>
acc_t* checkpoint_slot(const wkv7::Inputs& in, acc_t* ckpt, int64_t batch, int64_t q, int64_t h) {
  const int64_t nn = in.head_size * in.head_size;
  return ckpt + ((batch * in.chunks + q / kChunk) * in.heads + h) * nn;
}

template <typename io_t, Precision P, typename scalar_t, typename w_scalar_t>
void forward_impl(const wkv7::Inputs& in, Decay decay, bool save, at::Tensor& y_out, at::Tensor& final_out,
                  at::Tensor& ckpt_out) {
  using acc_t = compute_t<io_t>;
  using w_t = storage_t<w_scalar_t>;
  const int64_t n = in.head_size, nn = n * n;
  io_t* y = storage_ptr<scalar_t>(y_out);
  acc_t* final_state = final_out.data_ptr<acc_t>();
  acc_t* ckpt = save ? ckpt_out.data_ptr<acc_t>() : nullptr;
  const int64_t* cu = in.cu_seqlens.defined() ? in.cu_seqlens.const_data_ptr<int64_t>() : nullptr;
  at::parallel_for(0, in.n_seqs * in.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> ST(nn), ybuf(kChunk * n);
    Chunk<acc_t> ch(n);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / in.heads, h = task % in.heads;
      int64_t batch, start, stop;
      wkv7::sequence_range(cu, s, in.seqlen, batch, start, stop);
      load_initial(in, s, h, ST.data());
      for (int64_t q = start; q < stop;) {
        const int64_t chunk_end = std::min(q - q % kChunk + kChunk, stop);
        const int len = int(chunk_end - q);
        if (save && q % kChunk == 0) std::copy(ST.begin(), ST.end(), checkpoint_slot(in, ckpt, batch, q, h));
        load_chunk<P, scalar_t, w_scalar_t>(in, batch, q, len, h, decay, false, ch);
        ch.forward(ST.data(), ybuf.data());
        for (int l = 0; l < len; ++l) {
          const int64_t base = ((batch * in.seqlen + q + l) * in.heads + h) * n;
          for (int64_t i = 0; i < n; ++i) y[base + i] = wkv7::store<io_t, P>(ybuf[l * n + i]);
        }
        q = chunk_end;
      }
      acc_t* out = final_state + task * nn;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j) out[i * n + j] = ST[j * n + i];
    }
  });
}

template <typename io_t, Precision P, typename scalar_t, typename w_scalar_t>
void backward_impl(const wkv7::Inputs& in, Decay decay, const at::Tensor& grad_y, const at::Tensor& grad_state,
                   const at::Tensor& ckpt_in, std::array<at::Tensor, 6>& grads, at::Tensor& grad_s0) {
  using acc_t = compute_t<io_t>;
  using w_t = storage_t<w_scalar_t>;
  const int64_t n = in.head_size, nn = n * n;
  const io_t* gy = storage_ptr<scalar_t>(grad_y);
  const acc_t* gs = grad_state.defined() ? grad_state.const_data_ptr<acc_t>() : nullptr;
  const acc_t* ckpt = ckpt_in.const_data_ptr<acc_t>();
  io_t* out[6];
  for (int i = 0; i < 6; ++i) out[i] = i == 1 ? nullptr : storage_ptr<scalar_t>(grads[i]);
  w_t* grad_w = storage_ptr<w_scalar_t>(grads[1]);
  acc_t* ds0 = grad_s0.data_ptr<acc_t>();
  const int64_t* cu = in.cu_seqlens.defined() ? in.cu_seqlens.const_data_ptr<int64_t>() : nullptr;
  at::parallel_for(0, in.n_seqs * in.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> GT(nn), ST0(nn), dy(kChunk * n);
    Chunk<acc_t> ch(n);
    ChunkGrads<acc_t> g(n);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / in.heads, h = task % in.heads;
      int64_t batch, start, stop;
      wkv7::sequence_range(cu, s, in.seqlen, batch, start, stop);
      if (gs != nullptr) {
        const acc_t* src = gs + task * nn;
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < n; ++j) GT[j * n + i] = src[i * n + j];
      } else {
        std::fill(GT.begin(), GT.end(), acc_t(0));
      }
      for (int64_t chunk_end = stop; chunk_end > start;) {
        const int64_t q = wkv7::chunk_start(chunk_end - 1, start);
        const int len = int(chunk_end - q);
        if (q == start) {
          load_initial(in, s, h, ST0.data());
        } else {
          const acc_t* slot = checkpoint_slot(in, const_cast<acc_t*>(ckpt), batch, q, h);
          std::copy(slot, slot + nn, ST0.begin());
        }
        load_chunk<P, scalar_t, w_scalar_t>(in, batch, q, len, h, decay, true, ch);
        ch.solve_u(ST0.data());
        for (int l = 0; l < len; ++l) {
          const int64_t base = ((batch * in.seqlen + q + l) * in.heads + h) * n;
          for (int64_t j = 0; j < n; ++j) dy[l * n + j] = wkv7::load<P>(gy[base + j]);
        }
        wkv7::chunked::chunk_backward(ch, ST0.data(), GT.data(), dy.data(), g);
        const acc_t* token_grads[6] = {g.dr.data(), nullptr, g.dk.data(), g.dv.data(), g.da.data(), g.db.data()};
        for (int l = 0; l < len; ++l) {
          const int64_t base = ((batch * in.seqlen + q + l) * in.heads + h) * n;
          for (int x = 0; x < 6; ++x) {
            if (x == 1) continue;
            const acc_t* src = token_grads[x] + l * n;
            io_t* dst = out[x] + base;
            for (int64_t j = 0; j < n; ++j) dst[j] = wkv7::store<io_t, P>(src[j]);
          }
          for (int64_t j = 0; j < n; ++j) {
            const int64_t o = l * n + j;
            grad_w[base + j] = wkv7::store<w_t, wkv7::kDecayMode<P, io_t>>(compute_t<w_t>(g.dlogd[o] * ch.dlog[o]));
          }
        }
        chunk_end = q;
      }
      acc_t* dst = ds0 + task * nn;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j) dst[i * n + j] = GT[j * n + i];
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> wkv7_chunked_forward_cpu(
    const at::Tensor& r, const at::Tensor& w, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
    const at::Tensor& b, const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens,
    int64_t decay_code, int64_t precision, bool save_checkpoints) {
  const wkv7::Inputs in = wkv7::check_inputs(r, w, k, v, a, b, initial_state, cu_seqlens, /*allow_fp64=*/true);
  const Decay decay = wkv7::decay_from(decay_code);
  check_cu_seqlens_values(in);
  at::Tensor y = new_output_like(in.r);
  at::Tensor final_state = wkv7::new_state(in, in.n_seqs);
  at::Tensor ckpt = wkv7::new_checkpoints(in, save_checkpoints);
  ROPEWKV_DISPATCH_IO(in.r.scalar_type(), "wkv7_chunked_forward_cpu", [&] {
    ROPEWKV_DISPATCH_PRECISION(precision_from(precision), [&] {
      dispatch_w<scalar_t>(in, [&](auto w_tag) {
        using w_scalar_t = typename decltype(w_tag)::type;
        forward_impl<io_t, kPrecision, scalar_t, w_scalar_t>(in, decay, save_checkpoints, y, final_state, ckpt);
      });
    });
  });
  return {y, final_state, ckpt};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
wkv7_chunked_backward_cpu(const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_final_state,
                          const at::Tensor& r, const at::Tensor& w, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& initial_state,
                          const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& checkpoints,
                          int64_t decay_code, int64_t precision) {
  const wkv7::Inputs in = wkv7::check_inputs(r, w, k, v, a, b, initial_state, cu_seqlens, /*allow_fp64=*/true);
  const Decay decay = wkv7::decay_from(decay_code);
  check_cu_seqlens_values(in);
  wkv7::check_checkpoints(checkpoints, in);
  TORCH_CHECK_VALUE(grad_y.sizes() == r.sizes(), "grad_y has shape ", grad_y.sizes(), " but r has ", r.sizes());
  const at::Tensor gy = grad_y.to(r.scalar_type()).contiguous();
  const at::Tensor gs = wkv7::check_grad_state(grad_final_state, in);
  const at::Tensor ckpt = checkpoints.contiguous();
  std::array<at::Tensor, 6> grads;
  for (int i = 0; i < 6; ++i) grads[i] = new_output_like(i == 1 ? in.w : in.r);
  at::Tensor grad_s0 = wkv7::new_state(in, in.n_seqs);
  ROPEWKV_DISPATCH_IO(in.r.scalar_type(), "wkv7_chunked_backward_cpu", [&] {
    ROPEWKV_DISPATCH_PRECISION(precision_from(precision), [&] {
      dispatch_w<scalar_t>(in, [&](auto w_tag) {
        using w_scalar_t = typename decltype(w_tag)::type;
        backward_impl<io_t, kPrecision, scalar_t, w_scalar_t>(in, decay, gy, gs, ckpt, grads, grad_s0);
      });
    });
  });
  return {grads[0], grads[1], grads[2], grads[3], grads[4], grads[5], grad_s0};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ropewkv, m) {
  m.def(
      "wkv7_chunked_forward(Tensor r, Tensor w, Tensor k, Tensor v, Tensor a, Tensor b, Tensor? initial_state, "
      "Tensor? cu_seqlens, int decay, int precision, bool save_checkpoints) -> (Tensor, Tensor, Tensor)");
  m.def(
      "wkv7_chunked_backward(Tensor grad_y, Tensor? grad_final_state, Tensor r, Tensor w, Tensor k, Tensor v, "
      "Tensor a, Tensor b, Tensor? initial_state, Tensor? cu_seqlens, Tensor checkpoints, int decay, int precision) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ropewkv, CPU, m) {
  m.impl("wkv7_chunked_forward", &wkv7_chunked_forward_cpu);
  m.impl("wkv7_chunked_backward", &wkv7_chunked_backward_cpu);
}

}  // namespace ropewkv
