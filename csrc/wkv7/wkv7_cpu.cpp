// Schemas and CPU twin of the RWKV-7 WKV ops, built from the math header the CUDA kernels use (ropewkv/wkv7.h).
// Parallel over (sequence, head); each task runs its recurrence sequentially in fp32 (fp64 for fp64 I/O).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "wkv7_cpu_glue.h"

namespace ropewkv {
namespace {

using wkv7::Decay;
using wkv7::dispatch_w;
using wkv7::kCheckpointEvery;

// The inputs of a call: r, k, v, a, b in the I/O type, w in its own type w_t (io_t, or float: an fp32 decay input
// beside low-precision r..b, as under autocast, is read at full precision).
template <typename io_t, typename w_t>
struct InputPtrs {
  const io_t *r, *k, *v, *a, *b;
  const w_t* w;
};

template <typename scalar_t, typename w_scalar_t>
InputPtrs<storage_t<scalar_t>, storage_t<w_scalar_t>> input_ptrs(const wkv7::Inputs& in) {
  return {storage_ptr<scalar_t>(in.r), storage_ptr<scalar_t>(in.k), storage_ptr<scalar_t>(in.v),
          storage_ptr<scalar_t>(in.a), storage_ptr<scalar_t>(in.b), storage_ptr<w_scalar_t>(in.w)};
}

// One token's per-channel inputs, widened (and bf16-rounded in the bf16 mode). The decay is computed here, in the
// compute type, whatever the I/O dtype.
template <typename acc_t>
struct Token {
  std::vector<acc_t> r, d, dlog, k, v, a, b;
  explicit Token(int64_t n) : r(n), d(n), dlog(n), k(n), v(n), a(n), b(n) {}

  template <Precision P, typename io_t, typename w_t>
  void load(const wkv7::Inputs& in, const InputPtrs<io_t, w_t>& ptrs, int64_t base, Decay decay, bool with_grad) {
    const int64_t n = in.head_size;
    for (int64_t j = 0; j < n; ++j) {
      r[j] = wkv7::load<P>(ptrs.r[base + j]);
      const acc_t w = wkv7::load<wkv7::kDecayMode<P, io_t>>(ptrs.w[base + j]);
      d[j] = wkv7::decay_of(w, decay);
      if (with_grad) dlog[j] = wkv7::log_decay_grad(w, decay);
      k[j] = wkv7::load<P>(ptrs.k[base + j]);
      v[j] = wkv7::load<P>(ptrs.v[base + j]);
      a[j] = wkv7::load<P>(ptrs.a[base + j]);
      b[j] = wkv7::load<P>(ptrs.b[base + j]);
    }
  }
};

// S (n x n) <- the state at the start of sequence s (initial_state[s] or zeros).
template <typename acc_t>
void load_initial(const wkv7::Inputs& in, int64_t s, int64_t h, acc_t* S) {
  const int64_t nn = in.head_size * in.head_size;
  if (!in.initial_state.defined()) {
    std::fill(S, S + nn, acc_t(0));
    return;
  }
  const acc_t* src = in.initial_state.const_data_ptr<acc_t>() + (s * in.heads + h) * nn;
  std::copy(src, src + nn, S);
}

template <typename acc_t>
acc_t* checkpoint_slot(const wkv7::Inputs& in, acc_t* ckpt, int64_t batch, int64_t p, int64_t h) {
  const int64_t nn = in.head_size * in.head_size;
  return ckpt + ((batch * in.chunks + p / kCheckpointEvery) * in.heads + h) * nn;
}

template <typename io_t, Precision P, typename scalar_t, typename w_scalar_t>
void forward_impl(const wkv7::Inputs& in, Decay decay, bool save, at::Tensor& y_out, at::Tensor& final_out,
                  at::Tensor& ckpt_out) {
  using acc_t = compute_t<io_t>;
  const int64_t n = in.head_size, nn = n * n;
  const auto ptrs = input_ptrs<scalar_t, w_scalar_t>(in);
  io_t* y = storage_ptr<scalar_t>(y_out);
  acc_t* final_state = final_out.data_ptr<acc_t>();
  acc_t* ckpt = save ? ckpt_out.data_ptr<acc_t>() : nullptr;
  const int64_t* cu = in.cu_seqlens.defined() ? in.cu_seqlens.const_data_ptr<int64_t>() : nullptr;
  at::parallel_for(0, in.n_seqs * in.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> S(nn);
    Token<acc_t> tok(n);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / in.heads, h = task % in.heads;
      int64_t batch, start, stop;
      wkv7::sequence_range(cu, s, in.seqlen, batch, start, stop);
      load_initial(in, s, h, S.data());
      for (int64_t p = start; p < stop; ++p) {
        if (save && p % kCheckpointEvery == 0) {
          acc_t* slot = checkpoint_slot(in, ckpt, batch, p, h);
          for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < n; ++j) slot[j * n + i] = S[i * n + j];
        }
        const int64_t base = ((batch * in.seqlen + p) * in.heads + h) * n;
        tok.template load<P>(in, ptrs, base, decay, false);
        for (int64_t i = 0; i < n; ++i) {
          acc_t sa;
          const acc_t yi = wkv7::step_row(&S[i * n], int(n), tok.r.data(), tok.d.data(), tok.k.data(),
                                          tok.a.data(), tok.b.data(), tok.v[i], sa);
          y[base + i] = wkv7::store<io_t, P>(yi);
        }
      }
      std::copy(S.begin(), S.end(), final_state + task * nn);
    }
  });
}

template <typename io_t, Precision P, typename scalar_t, typename w_scalar_t>
void backward_impl(const wkv7::Inputs& in, Decay decay, const at::Tensor& grad_y, const at::Tensor& grad_state,
                   const at::Tensor& ckpt_in, std::array<at::Tensor, 6>& grads, at::Tensor& grad_s0) {
  using acc_t = compute_t<io_t>;
  using w_t = storage_t<w_scalar_t>;
  const int64_t n = in.head_size, nn = n * n;
  const auto ptrs = input_ptrs<scalar_t, w_scalar_t>(in);
  const io_t* gy = storage_ptr<scalar_t>(grad_y);
  const acc_t* gs = grad_state.defined() ? grad_state.const_data_ptr<acc_t>() : nullptr;
  const acc_t* ckpt = ckpt_in.const_data_ptr<acc_t>();
  io_t* out[6];
  for (int i = 0; i < 6; ++i) out[i] = i == 1 ? nullptr : storage_ptr<scalar_t>(grads[i]);
  w_t* grad_w = storage_ptr<w_scalar_t>(grads[1]);
  acc_t* ds0 = grad_s0.data_ptr<acc_t>();
  const int64_t* cu = in.cu_seqlens.defined() ? in.cu_seqlens.const_data_ptr<int64_t>() : nullptr;
  at::parallel_for(0, in.n_seqs * in.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> G(nn), states((kCheckpointEvery + 1) * nn), sa(kCheckpointEvery * n), dy(n);
    std::vector<acc_t> dr(n), dk(n), db(n), dd(n), da(n);
    Token<acc_t> tok(n);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / in.heads, h = task % in.heads;
      int64_t batch, start, stop;
      wkv7::sequence_range(cu, s, in.seqlen, batch, start, stop);
      if (gs != nullptr) {
        std::copy(gs + task * nn, gs + (task + 1) * nn, G.begin());
      } else {
        std::fill(G.begin(), G.end(), acc_t(0));
      }
      for (int64_t chunk_end = stop; chunk_end > start;) {
        const int64_t q = wkv7::chunk_start(chunk_end - 1, start), len = chunk_end - q;
        // Recompute S_{q-1} .. S_{chunk_end-1} (states[l] = the state before token q + l) and sa from the chunk's
        // checkpoint, exactly as the forward computed them.
        if (q == start) {
          load_initial(in, s, h, states.data());
        } else {
          const acc_t* slot = checkpoint_slot(in, ckpt, batch, q, h);
          for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < n; ++j) states[i * n + j] = slot[j * n + i];
        }
        for (int64_t l = 0; l < len; ++l) {
          const int64_t base = ((batch * in.seqlen + q + l) * in.heads + h) * n;
          tok.template load<P>(in, ptrs, base, decay, false);
          acc_t* next = &states[(l + 1) * nn];
          std::copy(&states[l * nn], &states[l * nn] + nn, next);
          for (int64_t i = 0; i < n; ++i) {
            wkv7::step_row(next + i * n, int(n), tok.r.data(), tok.d.data(), tok.k.data(), tok.a.data(),
                           tok.b.data(), tok.v[i], sa[l * n + i]);
          }
        }
        for (int64_t l = len - 1; l >= 0; --l) {
          const int64_t base = ((batch * in.seqlen + q + l) * in.heads + h) * n;
          tok.template load<P>(in, ptrs, base, decay, true);
          for (int64_t j = 0; j < n; ++j) dy[j] = wkv7::load<P>(gy[base + j]);
          const acc_t* prev = &states[l * nn];
          const acc_t* cur = &states[(l + 1) * nn];
          std::fill(dr.begin(), dr.end(), acc_t(0));
          std::fill(dk.begin(), dk.end(), acc_t(0));
          std::fill(db.begin(), db.end(), acc_t(0));
          std::fill(dd.begin(), dd.end(), acc_t(0));
          std::fill(da.begin(), da.end(), acc_t(0));
          for (int64_t i = 0; i < n; ++i) {
            acc_t* g = &G[i * n];
            acc_t dv_i, dsa_i;
            wkv7::adjoint_row_output(g, int(n), dy[i], tok.r.data(), tok.k.data(), tok.b.data(), dv_i, dsa_i);
            const acc_t v_i = tok.v[i], sa_i = sa[l * n + i];
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) {  // row i's share of the column sums (independent j: vectorised)
              dr[j] += cur[i * n + j] * dy[i];
              dk[j] += g[j] * v_i;
              db[j] += g[j] * sa_i;
              dd[j] += g[j] * prev[i * n + j];
              da[j] += prev[i * n + j] * dsa_i;
            }
            wkv7::adjoint_row_propagate(g, int(n), tok.d.data(), dsa_i, tok.a.data());
            out[3][base + i] = wkv7::store<io_t, P>(dv_i);
          }
          for (int64_t j = 0; j < n; ++j) {
            out[0][base + j] = wkv7::store<io_t, P>(dr[j]);
            const compute_t<w_t> dw = dd[j] * tok.d[j] * tok.dlog[j];
            grad_w[base + j] = wkv7::store<w_t, wkv7::kDecayMode<P, io_t>>(dw);
            out[2][base + j] = wkv7::store<io_t, P>(dk[j]);
            out[4][base + j] = wkv7::store<io_t, P>(da[j]);
            out[5][base + j] = wkv7::store<io_t, P>(db[j]);
          }
        }
        chunk_end = q;
      }
      std::copy(G.begin(), G.end(), ds0 + task * nn);
    }
  });
}

// The token-by-token recurrence, for the glue in wkv7_cpu_glue.h.
struct Sequential {
  static constexpr const char* kForwardName = "wkv7_forward_cpu";
  static constexpr const char* kBackwardName = "wkv7_backward_cpu";
  template <typename io_t, Precision P, typename scalar_t, typename w_scalar_t>
  static constexpr auto forward = &forward_impl<io_t, P, scalar_t, w_scalar_t>;
  template <typename io_t, Precision P, typename scalar_t, typename w_scalar_t>
  static constexpr auto backward = &backward_impl<io_t, P, scalar_t, w_scalar_t>;
};

at::Tensor wkv7_step_cpu(const at::Tensor& r, const at::Tensor& w, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& a, const at::Tensor& b, at::Tensor& state, int64_t decay_code,
                         int64_t precision) {
  const at::Tensor xs[] = {r, w, k, v, a, b};
  const wkv7::Inputs in = wkv7::check_step_inputs(xs, state, /*allow_fp64=*/true);
  const Decay decay = wkv7::decay_from(decay_code);
  const int64_t batch = in.batch, heads = in.heads, n = in.head_size, nn = n * n;
  at::Tensor y = new_output_like(in.r);
  ROPEWKV_DISPATCH_IO(r.scalar_type(), "wkv7_step_cpu", [&] {
    ROPEWKV_DISPATCH_PRECISION(precision_from(precision), [&] {
      dispatch_w<scalar_t>(in, [&](auto w_tag) {
        using w_scalar_t = typename decltype(w_tag)::type;
        using acc_t = compute_t<io_t>;
        const auto ptrs = input_ptrs<scalar_t, w_scalar_t>(in);
        io_t* out = storage_ptr<scalar_t>(y);
        acc_t* S = state.data_ptr<acc_t>();
        at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
          Token<acc_t> tok(n);
          for (int64_t task = begin; task < end; ++task) {
            const int64_t base = task * n;
            tok.template load<kPrecision>(in, ptrs, base, decay, false);
            for (int64_t i = 0; i < n; ++i) {
              acc_t sa;
              const acc_t yi = wkv7::step_row(S + task * nn + i * n, int(n), tok.r.data(), tok.d.data(),
                                              tok.k.data(), tok.a.data(), tok.b.data(), tok.v[i], sa);
              out[base + i] = wkv7::store<io_t, kPrecision>(yi);
            }
          }
        });
      });
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ropewkv, m) {
  m.def(
      "wkv7_forward(Tensor r, Tensor w, Tensor k, Tensor v, Tensor a, Tensor b, Tensor? initial_state, "
      "Tensor? cu_seqlens, int decay, int precision, bool save_checkpoints) -> (Tensor, Tensor, Tensor)");
  m.def(
      "wkv7_backward(Tensor grad_y, Tensor? grad_final_state, Tensor r, Tensor w, Tensor k, Tensor v, Tensor a, "
      "Tensor b, Tensor? initial_state, Tensor? cu_seqlens, Tensor checkpoints, int decay, int precision) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "wkv7_step(Tensor r, Tensor w, Tensor k, Tensor v, Tensor a, Tensor b, Tensor(s!) state, int decay, "
      "int precision) -> Tensor");
}

TORCH_LIBRARY_IMPL(ropewkv, CPU, m) {
  m.impl("wkv7_forward", &wkv7::cpu_forward<Sequential>);
  m.impl("wkv7_backward", &wkv7::cpu_backward<Sequential>);
  m.impl("wkv7_step", &wkv7_step_cpu);
}

}  // namespace ropewkv
