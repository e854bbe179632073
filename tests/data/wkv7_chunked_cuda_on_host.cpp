// Runs the chunked WKV7 forward CUDA kernel (csrc/wkv7/wkv7_chunked_kernels.cuh) on the host: its grid block by block,
// each block's threads as concurrent std::threads with real barriers and shuffles (tests/data/host_cuda/
// cuda_block_prelude.h). Driven by tests/test_wkv7_chunked_cuda_on_host.py; each argument is a case directory
// (tests/data/host_cuda/wkv7_case.h) and gets y.bin, final_state.bin and checkpoints.bin: the output buffers,
// NaN-filled before the run (an element the kernel never writes stays NaN).
#include "cuda_block_prelude.h"
#include "wkv7_case.h"

#include <string>

#include "wkv7_chunked_kernels.cuh"  // csrc/wkv7/

namespace {

using namespace ropewkv;
using namespace ropewkv::cuda;

template <int N>
void run_grid(const host_cuda::Wkv7Case& c, const Wkv7ForwardParams& p) {
  using namespace wkv7_chunked_detail;
  host_cuda::dispatch_wkv7(c, [&]<typename io_t, typename w_t, Precision P>() {
    constexpr int kVS = kValueSlice<N, P>;
    host_cuda::run_grid(dim3(unsigned(p.size.n_seqs * p.size.heads), N / kVS), dim3(kThreads),
                        [&] { chunked_forward_kernel<N, kVS, io_t, w_t, P>(p); });
  });
}

void run_case(const std::string& dir) {
  const host_cuda::Wkv7Case c = host_cuda::read_wkv7_case(dir);
  const int64_t nn = int64_t(c.n) * c.n;
  std::vector<unsigned char> y = host_cuda::nan_filled(size_t(c.elements) * c.io_size),
                             final_state = host_cuda::nan_filled(size_t(c.n_seqs * c.heads * nn) * 4),
                             checkpoints = host_cuda::nan_filled(c.save ? size_t(c.batch * c.chunks * c.heads * nn) * 4 : 0);
  Wkv7ForwardParams p{};
  p.size = c.sizes();
  p.r = c.inputs[0].data();
  p.w = c.inputs[1].data();
  p.k = c.inputs[2].data();
  p.v = c.inputs[3].data();
  p.a = c.inputs[4].data();
  p.b = c.inputs[5].data();
  p.initial_state = c.initial_state();
  p.y = y.data();
  p.final_state = reinterpret_cast<float*>(final_state.data());
  p.checkpoints = c.save ? reinterpret_cast<float*>(checkpoints.data()) : nullptr;
  host_cuda::dispatch_head_size(c, [&]<int N>() { run_grid<N>(c, p); });
  host_cuda::write_forward_outputs(dir, y, final_state, checkpoints);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) run_case(argv[i]);
  return 0;
}
