// Runs the chunked WKV7 forward CUDA kernel (csrc/wkv7/wkv7_chunked_kernels.cuh) on the host: its grid block by block,
// each block's threads as concurrent std::threads with real barriers and shuffles (tests/data/host_cuda/
// cuda_block_prelude.h). Driven by tests/test_wkv7_chunked_cuda_on_host.py; each argument is a case directory holding
//   case.txt: io (0 fp32, 1 bf16, 2 fp16) w_fp32 (0: w in r's dtype, 1: fp32) precision (0 fp32, 1 bf16)
//             decay (0 loglog, 1 raw, 2 log) N batch seqlen heads n_seqs has_cu_seqlens has_initial_state save
//   r.bin w.bin k.bin v.bin a.bin b.bin: [batch, seqlen, heads, N], raw elements; cu_seqlens.bin: int64 [n_seqs + 1];
//   initial_state.bin: fp32 [n_seqs, heads, N, N]
// and gets y.bin, final_state.bin and checkpoints.bin: the output buffers, NaN-filled before the run (an element the
// kernel never writes stays NaN). Every buffer is a heap block of exactly its size (AddressSanitizer stops an access
// past it).
#include "cuda_block_prelude.h"
#include "driver_files.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "wkv7_chunked_kernels.cuh"  // csrc/wkv7/

namespace {

using namespace ropewkv;
using namespace ropewkv::cuda;

using host_cuda::read_file;
using host_cuda::write_file;

template <int N, typename io_t, typename w_t, Precision P>
void run_grid(const Wkv7ForwardParams& p) {
  using namespace wkv7_chunked_detail;
  constexpr int kVS = kValueSlice<N>;
  host_cuda::run_grid(dim3(unsigned(p.size.n_seqs * p.size.heads), N / kVS), dim3(kThreads),
                      [&] { chunked_forward_kernel<N, kVS, io_t, w_t, P>(p); });
}

template <int N, typename io_t, typename w_t>
void run_precision(const Wkv7ForwardParams& p, int precision) {
  if (precision == 1) {
    run_grid<N, io_t, w_t, Precision::kBF16>(p);
  } else {
    run_grid<N, io_t, w_t, Precision::kFP32>(p);
  }
}

template <int N, typename io_t>
void run_w(const Wkv7ForwardParams& p, bool w_fp32, int precision) {
  if constexpr (std::is_same_v<io_t, float>) {
    run_precision<N, float, float>(p, precision);
  } else {
    w_fp32 ? run_precision<N, io_t, float>(p, precision) : run_precision<N, io_t, io_t>(p, precision);
  }
}

template <int N>
void run_io(const Wkv7ForwardParams& p, int io, bool w_fp32, int precision) {
  if (io == 0) run_w<N, float>(p, w_fp32, precision);
  if (io == 1) run_w<N, bf16_t>(p, w_fp32, precision);
  if (io == 2) run_w<N, fp16_t>(p, w_fp32, precision);
}

void run_case(const std::string& dir) {
  std::ifstream fields(dir + "/case.txt");
  int io, w_fp32, precision, decay, n, has_cu, has_s0, save;
  int64_t batch, seqlen, heads, n_seqs;
  if (!(fields >> io >> w_fp32 >> precision >> decay >> n >> batch >> seqlen >> heads >> n_seqs >> has_cu >> has_s0 >>
        save)) {
    std::fprintf(stderr, "%s/case.txt: bad fields\n", dir.c_str());
    std::exit(2);
  }
  const size_t io_size = io == 0 ? 4 : 2, w_size = w_fp32 ? 4 : io_size;
  const int64_t elements = batch * seqlen * heads * n, chunks = (seqlen + 15) / 16, nn = int64_t(n) * n;
  std::vector<unsigned char> inputs[6];
  const char* names[6] = {"r", "w", "k", "v", "a", "b"};
  for (int i = 0; i < 6; ++i) {
    inputs[i] = read_file(dir + "/" + names[i] + ".bin");
    if (inputs[i].size() != size_t(elements) * (i == 1 ? w_size : io_size)) {
      std::fprintf(stderr, "%s/%s.bin: %zu bytes\n", dir.c_str(), names[i], inputs[i].size());
      std::exit(2);
    }
  }
  const std::vector<unsigned char> cu = has_cu ? read_file(dir + "/cu_seqlens.bin") : std::vector<unsigned char>();
  const std::vector<unsigned char> s0 = has_s0 ? read_file(dir + "/initial_state.bin") : std::vector<unsigned char>();
  std::vector<unsigned char> y(size_t(elements) * io_size, 0xff), final_state(size_t(n_seqs * heads * nn) * 4, 0xff),
      checkpoints(save ? size_t(batch * chunks * heads * nn) * 4 : 0, 0xff);  // all-ones bits: NaN in every dtype
  Wkv7ForwardParams p{};
  p.size = {batch, seqlen, heads, n_seqs, chunks, decay,
            has_cu ? reinterpret_cast<const int64_t*>(cu.data()) : nullptr};
  p.r = inputs[0].data();
  p.w = inputs[1].data();
  p.k = inputs[2].data();
  p.v = inputs[3].data();
  p.a = inputs[4].data();
  p.b = inputs[5].data();
  p.initial_state = has_s0 ? reinterpret_cast<const float*>(s0.data()) : nullptr;
  p.y = y.data();
  p.final_state = reinterpret_cast<float*>(final_state.data());
  p.checkpoints = save ? reinterpret_cast<float*>(checkpoints.data()) : nullptr;
  if (n == 32) {
    run_io<32>(p, io, w_fp32, precision);
  } else if (n == 64) {
    run_io<64>(p, io, w_fp32, precision);
  } else {
    std::fprintf(stderr, "head size %d: the driver runs 32 and 64\n", n);
    std::exit(2);
  }
  write_file(dir + "/y.bin", y);
  write_file(dir + "/final_state.bin", final_state);
  write_file(dir + "/checkpoints.bin", checkpoints);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) run_case(argv[i]);
  return 0;
}
