// CUDA glue of the WKV7 ops (sequential and chunked): checks, allocation, head-size dispatch, stream; the kernels live
// in wkv7_n*.cu, wkv7_chunked_n*.cu and wkv7_chunked_backward_n*.cu.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <type_traits>

#include "ropewkv/wkv7_cuda.h"
#include "wkv7_glue.h"

namespace ropewkv {
namespace {

// Calls f(std::integral_constant<int, N>{}) for the supported head sizes.
template <typename F>
cudaError_t by_head_size(int64_t n, F&& f) {
  switch (n) {
    case 32:
      return f(std::integral_constant<int, 32>{});
    case 64:
      return f(std::integral_constant<int, 64>{});
    case 128:
      return f(std::integral_constant<int, 128>{});
    default:  // 256 runs on the triton and cpu twins (ops/rwkv7/api.py routes it there)
      TORCH_CHECK_VALUE(false, "head size ", n, " is not supported by the CUDA twin (32, 64, 128)");
  }
}

// Calls f(std::integral_constant<wkv7::DecayStorage, W>{}) for the storage of w beside r (wkv7::decay_storage_of).
template <typename F>
cudaError_t by_decay_storage(const at::Tensor& r, const at::Tensor& w, F&& f) {
  using wkv7::DecayStorage;
  DecayStorage storage;
  TORCH_CHECK_TYPE(wkv7::decay_storage_of(dtype_tag(r, "r"), dtype_tag(w, "w"), storage), "w must have r's dtype (",
                   r.scalar_type(), ") or float32 on the CUDA twin, got ", w.scalar_type());
  if (storage == DecayStorage::kIO) return f(std::integral_constant<DecayStorage, DecayStorage::kIO>{});
  return f(std::integral_constant<DecayStorage, DecayStorage::kFloat32>{});
}

// by_head_size, then by_decay_storage: f(N, W) for the kernel instantiation that reads these inputs.
template <typename F>
cudaError_t by_instantiation(const wkv7::Inputs& in, F&& f) {
  return by_head_size(in.head_size, [&](auto n) {
    return by_decay_storage(in.r, in.w, [&](auto storage) { return f(n, storage); });
  });
}

// t if its data is aligned to `bytes`, else an aligned copy (a fresh allocation is).
at::Tensor aligned(const at::Tensor& t, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % bytes == 0 ? t : t.clone();
}

// r, w, k, a, b for the kernels of the algorithm: the chunked ones load 4 values per access (load_chunk), so there
// aligned to 4 elements (else aligned copies).
template <bool CHUNKED>
std::array<at::Tensor, 5> chunk_rows(const wkv7::Inputs& in) {
  std::array<at::Tensor, 5> rows{in.r, in.w, in.k, in.a, in.b};
  if constexpr (CHUNKED) {
    for (at::Tensor& x : rows) x = aligned(x, 4 * x.element_size());
  }
  return rows;
}

template <typename T>
const T* optional_ptr(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

cuda::Wkv7Sizes sizes_of(const wkv7::Inputs& in, int64_t decay) {
  (void)wkv7::decay_from(decay);
  return {in.batch, in.seqlen, in.heads, in.n_seqs, in.chunks, int(decay), optional_ptr<int64_t>(in.cu_seqlens)};
}

// The forward of either algorithm: CHUNKED picks cuda::wkv7_chunked_forward over cuda::wkv7_forward (same
// parameters, outputs and checkpoints).
template <bool CHUNKED>
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_cuda(
    const at::Tensor& r, const at::Tensor& w, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
    const at::Tensor& b, const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens,
    int64_t decay, int64_t precision, bool save_checkpoints) {
  const c10::cuda::CUDAGuard guard(r.device());
  const wkv7::Inputs in = wkv7::check_inputs(r, w, k, v, a, b, initial_state, cu_seqlens, /*allow_fp64=*/false);
  const DType dtype = dtype_tag(in.r, "r");
  at::Tensor y = new_output_like(in.r);
  at::Tensor final_state = wkv7::new_state(in, in.n_seqs);
  at::Tensor ckpt = wkv7::new_checkpoints(in, save_checkpoints);
  const std::array<at::Tensor, 5> rwkab = chunk_rows<CHUNKED>(in);
  const cuda::Wkv7ForwardParams params{sizes_of(in, decay),
                                       rwkab[0].const_data_ptr(),
                                       rwkab[1].const_data_ptr(),
                                       rwkab[2].const_data_ptr(),
                                       in.v.const_data_ptr(),
                                       rwkab[3].const_data_ptr(),
                                       rwkab[4].const_data_ptr(),
                                       optional_ptr<float>(in.initial_state),
                                       y.data_ptr(),
                                       final_state.data_ptr<float>(),
                                       save_checkpoints ? ckpt.data_ptr<float>() : nullptr};
  C10_CUDA_CHECK(by_instantiation(in, [&](auto n, auto storage) {
    constexpr int kN = decltype(n)::value;
    constexpr wkv7::DecayStorage kW = decltype(storage)::value;
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    if constexpr (CHUNKED) return cuda::wkv7_chunked_forward<kN, kW>(dtype, precision_from(precision), params, stream);
    return cuda::wkv7_forward<kN, kW>(dtype, precision_from(precision), params, stream);
  }));
  return {y, final_state, ckpt};
}

// The chunked backward's gradients kernel takes `bytes` of shared memory per block: a clear error where the current
// GPU allows less (sm_86/89/120 at head size 128), not the launch's "invalid argument".
void check_shared_memory_fits(int bytes, int head_size) {
  int device = 0, limit = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  TORCH_CHECK_NOT_IMPLEMENTED(bytes <= limit, "wkv7 algorithm=\"chunked\": its backward at head size ", head_size,
                              " needs ", bytes, " bytes of shared memory per block, and this GPU allows ", limit,
                              ": use algorithm=\"sequential\" (what \"auto\" runs on CUDA)");
}

// The backward of either algorithm: CHUNKED picks cuda::wkv7_chunked_backward (the chunked forward's checkpoints;
// its scratch holds the state cotangent before each chunk, shaped as the checkpoints) over cuda::wkv7_backward.
template <bool CHUNKED>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_final_state, const at::Tensor& r,
    const at::Tensor& w, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a, const at::Tensor& b,
    const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& checkpoints, int64_t decay, int64_t precision) {
  const c10::cuda::CUDAGuard guard(r.device());
  const wkv7::Inputs in = wkv7::check_inputs(r, w, k, v, a, b, initial_state, cu_seqlens, /*allow_fp64=*/false);
  const DType dtype = dtype_tag(in.r, "r");
  wkv7::check_checkpoints(checkpoints, in);
  check_same_device(checkpoints, r, "checkpoints", "r");
  TORCH_CHECK_VALUE(grad_y.sizes() == r.sizes(), "grad_y has shape ", grad_y.sizes(), " but r has ", r.sizes());
  check_same_device(grad_y, r, "grad_y", "r");
  const at::Tensor gy = grad_y.to(r.scalar_type()).contiguous();
  const at::Tensor gs = wkv7::check_grad_state(grad_final_state, in);
  const at::Tensor ckpt = checkpoints.contiguous();
  at::Tensor scratch =
      at::empty({CHUNKED ? cuda::wkv7_chunked_backward_scratch_elems(in.batch, in.chunks, in.heads, in.head_size)
                         : cuda::wkv7_backward_scratch_elems(in.n_seqs, in.heads, in.head_size)},
                ckpt.options());
  std::array<at::Tensor, 6> grads;
  for (int i = 0; i < 6; ++i) grads[i] = new_output_like(i == 1 ? in.w : in.r);  // grad_w in w's dtype
  at::Tensor grad_s0 = wkv7::new_state(in, in.n_seqs);
  const std::array<at::Tensor, 5> rwkab = chunk_rows<CHUNKED>(in);
  const cuda::Wkv7BackwardParams params{sizes_of(in, decay),
                                        rwkab[0].const_data_ptr(),
                                        rwkab[1].const_data_ptr(),
                                        rwkab[2].const_data_ptr(),
                                        in.v.const_data_ptr(),
                                        rwkab[3].const_data_ptr(),
                                        rwkab[4].const_data_ptr(),
                                        optional_ptr<float>(in.initial_state),
                                        gy.const_data_ptr(),
                                        optional_ptr<float>(gs),
                                        ckpt.const_data_ptr<float>(),
                                        scratch.data_ptr<float>(),
                                        grads[0].data_ptr(),
                                        grads[1].data_ptr(),
                                        grads[2].data_ptr(),
                                        grads[3].data_ptr(),
                                        grads[4].data_ptr(),
                                        grads[5].data_ptr(),
                                        grad_s0.data_ptr<float>()};
  C10_CUDA_CHECK(by_instantiation(in, [&](auto n, auto storage) {
    constexpr int kN = decltype(n)::value;
    constexpr wkv7::DecayStorage kW = decltype(storage)::value;
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    if constexpr (CHUNKED) {
      check_shared_memory_fits(cuda::wkv7_chunked_backward_shared_bytes<kN>(), kN);
      return cuda::wkv7_chunked_backward<kN, kW>(dtype, precision_from(precision), params, stream);
    }
    return cuda::wkv7_backward<kN, kW>(dtype, precision_from(precision), params, stream);
  }));
  return {grads[0], grads[1], grads[2], grads[3], grads[4], grads[5], grad_s0};
}

at::Tensor wkv7_step_cuda(const at::Tensor& r, const at::Tensor& w, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& a, const at::Tensor& b, at::Tensor& state, int64_t decay,
                          int64_t precision) {
  const c10::cuda::CUDAGuard guard(r.device());
  const at::Tensor xs[] = {r, w, k, v, a, b};
  const wkv7::Inputs in = wkv7::check_step_inputs(xs, state, /*allow_fp64=*/false);
  const DType dtype = dtype_tag(r, "r");
  (void)wkv7::decay_from(decay);
  at::Tensor y = new_output_like(in.r);
  // The kernel moves 4 values per access: r..b aligned to 4 elements, the state to 16 bytes (else aligned copies).
  std::array<at::Tensor, 6> vecs;
  const at::Tensor* given[] = {&in.r, &in.w, &in.k, &in.v, &in.a, &in.b};
  for (int i = 0; i < 6; ++i) vecs[i] = aligned(*given[i], 4 * given[i]->element_size());
  at::Tensor work = aligned(state, 16);
  const cuda::Wkv7StepParams params{in.batch,
                                    in.heads,
                                    int(decay),
                                    vecs[0].const_data_ptr(),
                                    vecs[1].const_data_ptr(),
                                    vecs[2].const_data_ptr(),
                                    vecs[3].const_data_ptr(),
                                    vecs[4].const_data_ptr(),
                                    vecs[5].const_data_ptr(),
                                    work.data_ptr<float>(),
                                    y.data_ptr()};
  C10_CUDA_CHECK(by_instantiation(in, [&](auto n, auto storage) {
    constexpr int kN = decltype(n)::value;
    constexpr wkv7::DecayStorage kW = decltype(storage)::value;
    return cuda::wkv7_step<kN, kW>(dtype, precision_from(precision), params, c10::cuda::getCurrentCUDAStream());
  }));
  if (!work.is_same(state)) state.copy_(work);
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(ropewkv, CUDA, m) {
  m.impl("wkv7_forward", &forward_cuda<false>);
  m.impl("wkv7_backward", &backward_cuda<false>);
  m.impl("wkv7_chunked_forward", &forward_cuda<true>);
  m.impl("wkv7_chunked_backward", &backward_cuda<true>);
  m.impl("wkv7_step", &wkv7_step_cuda);
}

}  // namespace ropewkv
