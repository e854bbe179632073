// Runs the sequential WKV7 CUDA kernels (csrc/wkv7/wkv7_kernels.cuh) on the host: the forward (saving checkpoints),
// then the backward from them, each grid block by block with every block's threads as concurrent std::threads and
// real barriers (tests/data/host_cuda/cuda_block_prelude.h). Driven by tests/test_wkv7_cuda_on_host.py; each argument
// is a case directory (tests/data/host_cuda/wkv7_case.h, save = 1) that also holds grad_y.bin ([batch, seqlen,
// heads, N], I/O dtype) and grad_final_state.bin (fp32 [n_seqs, heads, N, N]), and gets y.bin, final_state.bin,
// checkpoints.bin, grad_{r,w,k,v,a,b}.bin (grad_w in w's dtype) and grad_initial_state.bin: every output buffer and
// the backward's scratch NaN-filled before the run.
#include "cuda_block_prelude.h"
#include "wkv7_case.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "wkv7_kernels.cuh"  // csrc/wkv7/

namespace {

using namespace ropewkv;
using namespace ropewkv::cuda;

template <int N>
void run_kernels(const host_cuda::Wkv7Case& c, const Wkv7ForwardParams& fwd, const Wkv7BackwardParams& bwd) {
  const dim3 grid(unsigned(c.n_seqs * c.heads));
  host_cuda::dispatch_wkv7(c, [&]<typename io_t, typename w_t, Precision P>() {
    host_cuda::run_grid(grid, dim3(wkv7_detail::ForwardLanes<N>::kThreads),
                        [&] { wkv7_detail::forward_kernel<N, io_t, w_t, P>(fwd); });
    host_cuda::run_grid(grid, dim3(wkv7_detail::BackwardLanes<N>::kThreads),
                        [&] { wkv7_detail::backward_kernel<N, io_t, w_t, P>(bwd); });
  });
}

void run_case(const std::string& dir) {
  const host_cuda::Wkv7Case c = host_cuda::read_wkv7_case(dir);
  const int64_t nn = int64_t(c.n) * c.n;
  const size_t io_bytes = size_t(c.elements) * c.io_size, state_bytes = size_t(c.n_seqs * c.heads * nn) * 4;
  const std::vector<unsigned char> grad_y = host_cuda::read_file(dir + "/grad_y.bin"),
                                   grad_final = host_cuda::read_file(dir + "/grad_final_state.bin");
  if (grad_y.size() != io_bytes || grad_final.size() != state_bytes) {
    std::fprintf(stderr, "%s: grad_y.bin or grad_final_state.bin of the wrong size\n", dir.c_str());
    std::exit(2);
  }
  std::vector<unsigned char> y = host_cuda::nan_filled(io_bytes), final_state = host_cuda::nan_filled(state_bytes),
                             checkpoints = host_cuda::nan_filled(size_t(c.batch * c.chunks * c.heads * nn) * 4),
                             scratch = host_cuda::nan_filled(
                                 size_t(wkv7_backward_scratch_elems(c.n_seqs, c.heads, c.n)) * 4),
                             grad_initial = host_cuda::nan_filled(state_bytes);
  std::vector<unsigned char> grads[6];
  for (int i = 0; i < 6; ++i) grads[i] = host_cuda::nan_filled(size_t(c.elements) * (i == 1 ? c.w_size : c.io_size));
  const void* in[6];
  for (int i = 0; i < 6; ++i) in[i] = c.inputs[i].data();
  const Wkv7ForwardParams fwd{c.sizes(), in[0], in[1], in[2], in[3], in[4], in[5], c.initial_state(), y.data(),
                              reinterpret_cast<float*>(final_state.data()),
                              reinterpret_cast<float*>(checkpoints.data())};
  const Wkv7BackwardParams bwd{c.sizes(), in[0], in[1], in[2], in[3], in[4], in[5], c.initial_state(),
                               grad_y.data(), reinterpret_cast<const float*>(grad_final.data()),
                               reinterpret_cast<const float*>(checkpoints.data()),
                               reinterpret_cast<float*>(scratch.data()), grads[0].data(), grads[1].data(),
                               grads[2].data(), grads[3].data(), grads[4].data(), grads[5].data(),
                               reinterpret_cast<float*>(grad_initial.data())};
  host_cuda::dispatch_head_size(c, [&]<int N>() { run_kernels<N>(c, fwd, bwd); });
  host_cuda::write_forward_outputs(dir, y, final_state, checkpoints);
  const char* names[6] = {"r", "w", "k", "v", "a", "b"};
  for (int i = 0; i < 6; ++i) host_cuda::write_file(dir + "/grad_" + names[i] + ".bin", grads[i]);
  host_cuda::write_file(dir + "/grad_initial_state.bin", grad_initial);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) run_case(argv[i]);
  return 0;
}
