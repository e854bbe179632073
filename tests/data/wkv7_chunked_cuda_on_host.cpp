// Runs the chunked WKV7 CUDA kernels on the host: the forward (csrc/wkv7/wkv7_chunked_kernels.cuh), then, where the
// case directory holds grad_y.bin, the backward's two passes from its checkpoints (wkv7_chunked_backward_kernels.cuh);
// each grid block by block, each block's threads as concurrent std::threads with real barriers and shuffles
// (tests/data/host_cuda/cuda_block_prelude.h). Driven by tests/test_wkv7_chunked_cuda_on_host.py; each argument is a
// case directory (tests/data/host_cuda/wkv7_case.h) and gets y.bin, final_state.bin and checkpoints.bin, and for the
// backward (grad_y.bin [batch, seqlen, heads, N] in the I/O dtype; grad_final_state.bin fp32 [n_seqs, heads, N, N],
// or none: a zero cotangent)
// grad_{r,w,k,v,a,b}.bin (grad_w in w's dtype) and grad_initial_state.bin: every output buffer and the backward's
// scratch NaN-filled before the run (an element the kernels never write stays NaN).
#include "cuda_block_prelude.h"
#include "wkv7_case.h"

#include <filesystem>
#include <string>

#include "wkv7_chunked_backward_kernels.cuh"  // csrc/wkv7/

namespace {

using namespace ropewkv;
using namespace ropewkv::cuda;

template <int N>
void run_grids(const host_cuda::Wkv7Case& c, const Wkv7ForwardParams& fwd, const Wkv7BackwardParams* bwd) {
  using namespace wkv7_chunked_detail;
  host_cuda::dispatch_wkv7(c, [&]<typename io_t, typename w_t, Precision P>() {
    const unsigned tasks = unsigned(c.n_seqs * c.heads);
    constexpr int kVS = kValueSlice<N, P>;
    host_cuda::run_grid(dim3(tasks, N / kVS), dim3(kThreads), [&] { chunked_forward_kernel<N, io_t, w_t, P>(fwd); });
    if (bwd == nullptr) return;
    host_cuda::run_grid(dim3(tasks, N / kVS), dim3(kThreads),
                        [&] { chunked_state_cotangent_kernel<N, io_t, w_t, P>(*bwd); });
    host_cuda::run_grid(dim3(unsigned(c.batch * c.chunks * c.heads)), dim3(kThreads), sizeof(GradientShared<N>),
                        [&] { chunked_gradients_kernel<N, io_t, w_t, P>(*bwd); });
  });
}

void run_case(const std::string& dir) {
  const host_cuda::Wkv7Case c = host_cuda::read_wkv7_case(dir);
  const int64_t nn = int64_t(c.n) * c.n;
  const size_t io_bytes = size_t(c.elements) * c.io_size, state_bytes = size_t(c.n_seqs * c.heads * nn) * 4;
  const size_t checkpoint_bytes = c.save ? size_t(c.batch * c.chunks * c.heads * nn) * 4 : 0;
  std::vector<unsigned char> y = host_cuda::nan_filled(io_bytes), final_state = host_cuda::nan_filled(state_bytes),
                             checkpoints = host_cuda::nan_filled(checkpoint_bytes);
  const void* in[6];
  for (int i = 0; i < 6; ++i) in[i] = c.inputs[i].data();
  const Wkv7ForwardParams fwd{c.sizes(), in[0], in[1], in[2], in[3], in[4], in[5], c.initial_state(), y.data(),
                              reinterpret_cast<float*>(final_state.data()),
                              c.save ? reinterpret_cast<float*>(checkpoints.data()) : nullptr};
  const bool backward = std::filesystem::exists(dir + "/grad_y.bin");
  std::vector<unsigned char> grad_y, grad_final, scratch, grad_initial, grads[6];
  Wkv7BackwardParams bwd{};
  if (backward) {
    grad_y = host_cuda::read_file(dir + "/grad_y.bin");
    const bool has_grad_final = std::filesystem::exists(dir + "/grad_final_state.bin");
    if (has_grad_final) grad_final = host_cuda::read_file(dir + "/grad_final_state.bin");
    if (!c.save || grad_y.size() != io_bytes || (has_grad_final && grad_final.size() != state_bytes)) {
      std::fprintf(stderr, "%s: a backward case needs save = 1 and grad_y, grad_final_state of their sizes\n",
                   dir.c_str());
      std::exit(2);
    }
    scratch = host_cuda::nan_filled(checkpoint_bytes);
    grad_initial = host_cuda::nan_filled(state_bytes);
    for (int i = 0; i < 6; ++i) grads[i] = host_cuda::nan_filled(size_t(c.elements) * (i == 1 ? c.w_size : c.io_size));
    bwd = {c.sizes(), in[0], in[1], in[2], in[3], in[4], in[5], c.initial_state(), grad_y.data(),
           has_grad_final ? reinterpret_cast<const float*>(grad_final.data()) : nullptr,
           reinterpret_cast<const float*>(checkpoints.data()),
           reinterpret_cast<float*>(scratch.data()), grads[0].data(), grads[1].data(), grads[2].data(),
           grads[3].data(), grads[4].data(), grads[5].data(), reinterpret_cast<float*>(grad_initial.data())};
  }
  host_cuda::dispatch_head_size(c, [&]<int N>() { run_grids<N>(c, fwd, backward ? &bwd : nullptr); });
  host_cuda::write_forward_outputs(dir, y, final_state, checkpoints);
  if (!backward) return;
  const char* names[6] = {"r", "w", "k", "v", "a", "b"};
  for (int i = 0; i < 6; ++i) host_cuda::write_file(dir + "/grad_" + names[i] + ".bin", grads[i]);
  host_cuda::write_file(dir + "/grad_initial_state.bin", grad_initial);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) run_case(argv[i]);
  return 0;
}
