// ropewkv/mma_bf16.cuh on the host: one warp of the block emulator (host_cuda/cuda_block_prelude.h) runs mma_bf16 on
// register fragments that tests/test_mma_bf16_on_host.py built from whole matrices by the PTX ISA's table, and splits
// fp32 pairs into hi/lo bf16. Argument: a directory holding
//   a.bin: uint32 [32][4], b.bin: uint32 [32][2] (each lane's A and B registers), c.bin: fp32 [32][4] (its C),
//   x.bin: fp32 [2 * pairs] (values to split),
// and getting d.bin: fp32 [32][4] (each lane's D = C + A B) and split.bin: uint32 [pairs][2] (hi, lo of each pair).
#include "cuda_block_prelude.h"
#include "driver_files.h"

#include <string>
#include <vector>

#include "ropewkv/mma_bf16.cuh"

namespace {

using namespace ropewkv::cuda;

__global__ void mma_kernel(const uint32_t* a, const uint32_t* b, const float* c, float* d, const float* x,
                           uint32_t* split, int pairs) {
  const int lane = int(threadIdx.x);
  const uint32_t a_regs[4] = {a[4 * lane], a[4 * lane + 1], a[4 * lane + 2], a[4 * lane + 3]};
  const uint32_t b_regs[2] = {b[2 * lane], b[2 * lane + 1]};
  float acc[4] = {c[4 * lane], c[4 * lane + 1], c[4 * lane + 2], c[4 * lane + 3]};
  mma::mma_bf16(acc, a_regs, b_regs);
  for (int i = 0; i < 4; ++i) d[4 * lane + i] = acc[i];
  for (int p = lane; p < pairs; p += 32) {
    const mma::Split s = mma::split_bf16x2(x[2 * p], x[2 * p + 1]);
    split[2 * p] = s.hi;
    split[2 * p + 1] = s.lo;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string dir = argv[1];
  const auto a = host_cuda::read_file<uint32_t>(dir + "/a.bin");
  const auto b = host_cuda::read_file<uint32_t>(dir + "/b.bin");
  const auto c = host_cuda::read_file<float>(dir + "/c.bin");
  const auto x = host_cuda::read_file<float>(dir + "/x.bin");
  const int pairs = int(x.size() / 2);
  std::vector<float> d(32 * 4, __builtin_nanf(""));
  std::vector<uint32_t> split(2 * size_t(pairs), 0xffffffffu);
  host_cuda::run_grid(dim3(1), dim3(32), [&] { mma_kernel(a.data(), b.data(), c.data(), d.data(), x.data(),
                                                          split.data(), pairs); });
  host_cuda::write_file(dir + "/d.bin", d);
  host_cuda::write_file(dir + "/split.bin", split);
  return 0;
}
