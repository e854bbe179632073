// Schemas and CPU twin of the chunked WKV7 ops (ropewkv::wkv7_chunked_forward / _backward), built from the chunk
// math in ropewkv/wkv7_chunked.h (derivation: python/ropewkv/ops/rwkv7/chunked.md). Same arguments, outputs and
// checkpoint tensor shape as the sequential ops; parallel over (sequence, head), each task walks its chunks in order.
// The checkpoints hold the state before each chunk, k-major (ST[k][v]), as the sequential ops store theirs.
//
// The chunk grid is aligned to each sequence's end: chunks [stop - 16 j - 16, stop - 16 j), the first one shorter,
// its tokens the last rows of a full 16-row chunk whose first rows are absent (zero inputs, decay 1). So a token's
// row in its chunk depends only on its distance to the sequence's end, and the blocked products sum the same terms
// in the same order whatever comes before the sequence: left padding (frozen tokens, whose terms are exact zeros)
// and the sequence's position in a packed batch leave its outputs and final state unchanged bit for bit, as in the
// sequential form. A chunk after the first starts at q and holds 16 tokens, so no two share q / 16: its checkpoint
// is slot q / 16, within the sequential ops' ceil(T / 16) slots per row.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "ropewkv/wkv7_chunked.h"
#include "wkv7_cpu_glue.h"

namespace ropewkv {
namespace {

using wkv7::Decay;
using wkv7::chunked::Chunk;
using wkv7::chunked::ChunkGrads;
using wkv7::chunked::kChunk;

// The log decays of `count` loaded w values (and d(log d)/dw when dlog is given): one loop per convention, so that
// each vectorises (a per-element switch on the convention does not).
template <Decay D, typename acc_t>
void log_decays(const acc_t* w, int64_t count, acc_t* logd, acc_t* dlog) {
  ROPEWKV_SIMD
  for (int64_t j = 0; j < count; ++j) logd[j] = wkv7::log_decay(w[j], D);
  if (dlog == nullptr) return;
  ROPEWKV_SIMD
  for (int64_t j = 0; j < count; ++j) dlog[j] = wkv7::log_decay_grad(w[j], D);
}

// Asks the cache for one head's rows of tokens [q0, q1) of a [B, T, H, N] tensor: the rows lie H * N apart, a stride
// the hardware prefetcher learns slowly, and the chunk loop otherwise waits on every line of them.
template <typename T>
void prefetch_rows(const wkv7::Inputs& in, const T* x, int64_t batch, int64_t q0, int64_t q1, int64_t h) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t q = q0; q < q1; ++q) {
    const T* row = x + ((batch * in.seqlen + q) * in.heads + h) * in.head_size;
    for (int64_t j = 0; j < in.head_size; j += kLine) __builtin_prefetch(row + j);
  }
}

template <typename scalar_t, typename w_scalar_t>
void prefetch_inputs(const wkv7::Inputs& in, int64_t batch, int64_t q0, int64_t q1, int64_t h) {
  for (const at::Tensor* x : {&in.r, &in.k, &in.v, &in.a, &in.b})
    prefetch_rows(in, storage_ptr<scalar_t>(*x), batch, q0, q1, h);
  prefetch_rows(in, storage_ptr<w_scalar_t>(in.w), batch, q0, q1, h);
}

// Reads one chunk's inputs into ch: tokens q .. q + len - 1 of batch row `batch`, head h, as rows pad .. pad + len - 1
// after `pad` absent rows (zero inputs, log decay 0: they leave the state as it is and add exact zeros to every sum).
template <Precision P, typename scalar_t, typename w_scalar_t, typename acc_t>
void load_chunk(const wkv7::Inputs& in, int64_t batch, int64_t q, int pad, int len, int64_t h, Decay decay,
                bool with_grad, Chunk<acc_t>& ch) {
  using io_t = storage_t<scalar_t>;
  const int64_t n = in.head_size;
  ch.len = pad + len;  // first: v's rows lie after the chunk's U rows
  const io_t* src[5] = {storage_ptr<scalar_t>(in.r), storage_ptr<scalar_t>(in.k), storage_ptr<scalar_t>(in.v),
                        storage_ptr<scalar_t>(in.a), storage_ptr<scalar_t>(in.b)};
  acc_t* dst[5] = {ch.r.data(), ch.k.data(), ch.v(), ch.a.data(), ch.b.data()};
  const int64_t absent = int64_t(pad) * n;
  for (acc_t* x : {dst[0], dst[1], dst[2], dst[3], dst[4], ch.logd.data(), ch.dlog.data()})
    std::fill(x, x + absent, acc_t(0));
  const storage_t<w_scalar_t>* w = storage_ptr<w_scalar_t>(in.w);
  acc_t* w_rows = ch.tmp_rows.data();
  for (int l = 0; l < len; ++l) {
    const int64_t base = ((batch * in.seqlen + q + l) * in.heads + h) * n, row = (pad + l) * n;
    for (int x = 0; x < 5; ++x) {
      ROPEWKV_SIMD
      for (int64_t j = 0; j < n; ++j) dst[x][row + j] = wkv7::load<P>(src[x][base + j]);
    }
    ROPEWKV_SIMD
    for (int64_t j = 0; j < n; ++j) w_rows[l * n + j] = wkv7::load<wkv7::kDecayMode<P, io_t>>(w[base + j]);
  }
  acc_t* logd = ch.logd.data() + absent;
  acc_t* dlog = with_grad ? ch.dlog.data() + absent : nullptr;
  const int64_t count = int64_t(len) * n;
  if (decay == Decay::kLogLog) log_decays<Decay::kLogLog>(w_rows, count, logd, dlog);
  if (decay == Decay::kRaw) log_decays<Decay::kRaw>(w_rows, count, logd, dlog);
  if (decay == Decay::kLog) log_decays<Decay::kLog>(w_rows, count, logd, dlog);
  ch.prepare();
}

// The first token of the chunk that ends at chunk_end, in a sequence [start, stop) (see the top of the file).
inline int64_t chunk_first(int64_t chunk_end, int64_t start) { return std::max(chunk_end - kChunk, start); }

// The chunk that holds the sequence's first token ends here.
inline int64_t first_chunk_end(int64_t start, int64_t stop) { return start + (stop - start - 1) % kChunk + 1; }

// ST (k-major) <- the state at the start of sequence s (initial_state[s] or zeros).
template <typename acc_t>
void load_initial(const wkv7::Inputs& in, int64_t s, int64_t h, acc_t* ST) {
  const int64_t n = in.head_size, nn = n * n;
  if (!in.initial_state.defined()) {
    std::fill(ST, ST + nn, acc_t(0));
    return;
  }
  const acc_t* src = in.initial_state.const_data_ptr<acc_t>() + (s * in.heads + h) * nn;
  wkv7::chunked::transpose(ST, src, n);
}

template <typename acc_t>
acc_t* checkpoint_slot(const wkv7::Inputs& in, acc_t* ckpt, int64_t batch, int64_t q, int64_t h) {
  const int64_t nn = in.head_size * in.head_size;
  return ckpt + ((batch * in.chunks + q / kChunk) * in.heads + h) * nn;
}

// Zeros in the checkpoint slots that no chunk's state lands in (a sequence's first chunk starts from its initial
// state: one slot per row without cu_seqlens, any number with), so that every element of the tensor is defined.
template <typename acc_t>
void zero_unused_slots(const wkv7::Inputs& in, const int64_t* cu, acc_t* ckpt) {
  std::vector<bool> used(in.batch * in.chunks, false);
  for (int64_t s = 0; s < in.n_seqs; ++s) {
    int64_t batch, start, stop;
    wkv7::sequence_range(cu, s, in.seqlen, batch, start, stop);
    for (int64_t q = first_chunk_end(start, stop); q < stop; q += kChunk) used[batch * in.chunks + q / kChunk] = true;
  }
  const int64_t slot = in.heads * in.head_size * in.head_size;
  for (int64_t c = 0; c < int64_t(used.size()); ++c) {
    if (!used[c]) std::fill(ckpt + c * slot, ckpt + (c + 1) * slot, acc_t(0));
  }
}

// The chunk's blocked products take the head size in blocks of 16 columns (api.HEAD_SIZES are 32 .. 256): checked
// here too, for callers of the op itself.
inline void check_head_size(const wkv7::Inputs& in) {
  TORCH_CHECK_VALUE(in.head_size % 16 == 0 && in.head_size > 0,
                    "wkv7_chunked: the head size N (r.size(3)) must be a positive multiple of 16, got ", in.head_size);
}

template <typename io_t, Precision P, typename scalar_t, typename w_scalar_t>
void forward_impl(const wkv7::Inputs& in, Decay decay, bool save, at::Tensor& y_out, at::Tensor& final_out,
                  at::Tensor& ckpt_out) {
  using acc_t = compute_t<io_t>;
  using w_t = storage_t<w_scalar_t>;
  check_head_size(in);
  const int64_t n = in.head_size, nn = n * n;
  io_t* y = storage_ptr<scalar_t>(y_out);
  acc_t* final_state = final_out.data_ptr<acc_t>();
  acc_t* ckpt = save ? ckpt_out.data_ptr<acc_t>() : nullptr;
  const int64_t* cu = in.cu_seqlens.defined() ? in.cu_seqlens.const_data_ptr<int64_t>() : nullptr;
  if (save) zero_unused_slots(in, cu, ckpt);
  at::parallel_for(0, in.n_seqs * in.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> ST(nn);
    Chunk<acc_t> ch(n);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / in.heads, h = task % in.heads;
      int64_t batch, start, stop;
      wkv7::sequence_range(cu, s, in.seqlen, batch, start, stop);
      load_initial(in, s, h, ST.data());
      for (int64_t q = start, chunk_end = first_chunk_end(start, stop); q < stop;) {
        const int len = int(chunk_end - q), pad = kChunk - len;
        if (save && q > start) std::copy(ST.begin(), ST.end(), checkpoint_slot(in, ckpt, batch, q, h));
        load_chunk<P, scalar_t, w_scalar_t>(in, batch, q, pad, len, h, decay, false, ch);
        prefetch_inputs<scalar_t, w_scalar_t>(in, batch, chunk_end, std::min(chunk_end + kChunk, stop), h);
        ch.forward(ST.data());
        const acc_t* ybuf = ch.y() + int64_t(pad) * n;
        for (int l = 0; l < len; ++l) {
          const int64_t base = ((batch * in.seqlen + q + l) * in.heads + h) * n;
          for (int64_t i = 0; i < n; ++i) y[base + i] = wkv7::store<io_t, P>(ybuf[l * n + i]);
        }
        q = chunk_end;
        chunk_end += kChunk;
      }
      acc_t* out = final_state + task * nn;
      wkv7::chunked::transpose(out, ST.data(), n);
    }
  });
}

template <typename io_t, Precision P, typename scalar_t, typename w_scalar_t>
void backward_impl(const wkv7::Inputs& in, Decay decay, const at::Tensor& grad_y, const at::Tensor& grad_state,
                   const at::Tensor& ckpt_in, std::array<at::Tensor, 6>& grads, at::Tensor& grad_s0) {
  using acc_t = compute_t<io_t>;
  using w_t = storage_t<w_scalar_t>;
  check_head_size(in);
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
    std::vector<acc_t> GT(nn), ST0(nn);
    Chunk<acc_t> ch(n);
    ChunkGrads<acc_t> g(n);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / in.heads, h = task % in.heads;
      int64_t batch, start, stop;
      wkv7::sequence_range(cu, s, in.seqlen, batch, start, stop);
      if (gs != nullptr) {
        const acc_t* src = gs + task * nn;
        wkv7::chunked::transpose(GT.data(), src, n);
      } else {
        std::fill(GT.begin(), GT.end(), acc_t(0));
      }
      for (int64_t chunk_end = stop; chunk_end > start;) {
        const int64_t q = chunk_first(chunk_end, start);
        const int len = int(chunk_end - q), pad = kChunk - len;
        const acc_t* st0 = ST0.data();  // the state before the chunk: the initial state, or read in its checkpoint
        if (q == start) {
          load_initial(in, s, h, ST0.data());
        } else {
          st0 = checkpoint_slot(in, const_cast<acc_t*>(ckpt), batch, q, h);
        }
        load_chunk<P, scalar_t, w_scalar_t>(in, batch, q, pad, len, h, decay, true, ch);
        const int64_t previous = chunk_first(q, start);  // the next chunk this task reads
        prefetch_inputs<scalar_t, w_scalar_t>(in, batch, previous, q, h);
        prefetch_rows(in, gy, batch, previous, q, h);
        // and its checkpoint: a task's checkpoints lie H N^2 apart, walked backwards, which no prefetcher follows
        if (previous > start) {
          const acc_t* next_state = checkpoint_slot(in, ckpt, batch, previous, h);
          for (int64_t j = 0; j < nn; j += 64 / int64_t(sizeof(acc_t))) __builtin_prefetch(next_state + j);
        }
        ch.solve_u(st0);
        acc_t* dy = g.dy();
        std::fill(dy, dy + int64_t(pad) * n, acc_t(0));
        for (int l = 0; l < len; ++l) {
          const int64_t base = ((batch * in.seqlen + q + l) * in.heads + h) * n;
          for (int64_t j = 0; j < n; ++j) dy[(pad + l) * n + j] = wkv7::load<P>(gy[base + j]);
        }
        wkv7::chunked::chunk_backward(ch, st0, GT.data(), g);
        const acc_t* token_grads[6] = {g.dr.data(), nullptr, g.dk.data(), g.dv(), g.da.data(), g.db.data()};
        for (int l = 0; l < len; ++l) {
          const int64_t base = ((batch * in.seqlen + q + l) * in.heads + h) * n;
          for (int x = 0; x < 6; ++x) {
            if (x == 1) continue;
            const acc_t* src = token_grads[x] + (pad + l) * n;
            io_t* dst = out[x] + base;
            for (int64_t j = 0; j < n; ++j) dst[j] = wkv7::store<io_t, P>(src[j]);
          }
          for (int64_t j = 0; j < n; ++j) {
            const int64_t o = (pad + l) * n + j;
            grad_w[base + j] = wkv7::store<w_t, wkv7::kDecayMode<P, io_t>>(
                compute_t<w_t>(wkv7::chunked_w_grad(g.dlogd[o], ch.dlog[o])));
          }
        }
        chunk_end = q;
      }
      acc_t* dst = ds0 + task * nn;
      wkv7::chunked::transpose(dst, GT.data(), n);
    }
  });
}

// The chunk-by-chunk algorithm, for the glue in wkv7_cpu_glue.h.
struct Chunked {
  static constexpr const char* kForwardName = "wkv7_chunked_forward_cpu";
  static constexpr const char* kBackwardName = "wkv7_chunked_backward_cpu";
  template <typename io_t, Precision P, typename scalar_t, typename w_scalar_t>
  static constexpr auto forward = &forward_impl<io_t, P, scalar_t, w_scalar_t>;
  template <typename io_t, Precision P, typename scalar_t, typename w_scalar_t>
  static constexpr auto backward = &backward_impl<io_t, P, scalar_t, w_scalar_t>;
};

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
  m.impl("wkv7_chunked_forward", &wkv7::cpu_forward<Chunked>);
  m.impl("wkv7_chunked_backward", &wkv7::cpu_backward<Chunked>);
}

}  // namespace ropewkv
