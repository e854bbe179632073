// A small CUDA kernel with block cooperation, run on the host by host_cuda::run_grid (host_cuda/cuda_block_prelude.h),
// driven by tests/test_cuda_block_on_host.py. Arguments: a directory and the grid's x and y. It reads
//   x.bin: fp32 [blocks * kThreads], ints.bin: int32 [blocks * kThreads] (block b's values at b * kThreads, thread t's
//          at b * kThreads + t, t = threadIdx.x + kTile * threadIdx.y; blocks numbered blockIdx.x + gridDim.x * y)
// and writes, laid out the same (each starting NaN- or INT_MIN-filled, so that an element never written fails):
//   warp_sum.bin (fp32): the sum of x over the thread's warp, by an __shfl_xor_sync butterfly;
//   block_sum.bin (fp32): the sum over its block: warp sums through shared memory and __syncthreads, then
//                         __shfl_down_sync and a broadcast by __shfl_sync;
//   transpose.bin (fp32): the block's kTile x kTile tile of x transposed through shared memory;
//   prefix.bin (int32): the inclusive prefix sum of ints over the warp, by __shfl_up_sync;
//   rotate16.bin (int32): ints of the next lane in its group of 16 (wrapping), __shfl_sync with width 16;
//   down16.bin (int32): ints 3 lanes down in its group of 16 (its own past the group), __shfl_down_sync width 16;
//   math.bin (fp32): -(exp(x) * max(x, 0.5) + min(x, -0.5)) by the math stand-ins (the sign flipped on the bits).
#include "cuda_block_prelude.h"
#include "driver_files.h"

#include <climits>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace {

constexpr unsigned kTile = 16;
constexpr unsigned kThreads = kTile * kTile;
constexpr unsigned kWarps = kThreads / 32;

struct Outputs {
  float* warp_sum;
  float* block_sum;
  float* transpose;
  int* prefix;
  int* rotate16;
  int* down16;
  float* math;
};

__global__ void __launch_bounds__(kThreads) block_kernel(const float* x, const int* ints, Outputs out) {
  __shared__ float warp_sums[kWarps];
  __shared__ float tile[kTile][kTile + 1];  // +1: no bank conflicts on the transposed read
  const unsigned t = threadIdx.x + kTile * threadIdx.y;
  const unsigned lane = t % 32;
  const size_t i = size_t(blockIdx.x + gridDim.x * blockIdx.y) * kThreads + t;

  float sum = x[i];
  for (int lane_mask = 16; lane_mask > 0; lane_mask /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, lane_mask);
  out.warp_sum[i] = sum;
  if (lane == 0) warp_sums[t / 32] = sum;
  tile[threadIdx.y][threadIdx.x] = x[i];
  __syncthreads();

  float block_sum = lane < kWarps ? warp_sums[lane] : 0.0f;
  for (unsigned delta = kWarps / 2; delta > 0; delta /= 2) block_sum += __shfl_down_sync(0xffffffffu, block_sum, delta);
  out.block_sum[i] = __shfl_sync(0xffffffffu, block_sum, 0);
  out.transpose[i] = tile[threadIdx.x][threadIdx.y];

  int prefix = ints[i];
  for (unsigned delta = 1; delta < 32; delta *= 2) {
    const int before = __shfl_up_sync(0xffffffffu, prefix, delta);
    if (lane >= delta) prefix += before;
  }
  out.prefix[i] = prefix;
  out.rotate16[i] = __shfl_sync(0xffffffffu, ints[i], int(lane) + 1, 16);
  out.down16[i] = __shfl_down_sync(0xffffffffu, ints[i], 3, 16);

  const float math = __fmaf_rn(__expf(__ldg(x + i)), fmaxf(x[i], 0.5f), min(x[i], -0.5f));
  out.math[i] = __uint_as_float(__float_as_uint(math) ^ 0x80000000u);
}

using host_cuda::read_file;
using host_cuda::write_file;

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s DIR GRID_X GRID_Y\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const dim3 grid(unsigned(std::stoul(argv[2])), unsigned(std::stoul(argv[3])));
  const std::vector<float> x = read_file<float>(dir + "/x.bin");
  const std::vector<int> ints = read_file<int>(dir + "/ints.bin");
  const size_t n = size_t(grid.x) * grid.y * kThreads;
  if (x.size() != n || ints.size() != n) {
    std::fprintf(stderr, "x.bin and ints.bin need %zu values\n", n);
    return 2;
  }
  std::vector<float> warp_sum(n, NAN), block_sum(n, NAN), transpose(n, NAN), math(n, NAN);
  std::vector<int> prefix(n, INT_MIN), rotate16(n, INT_MIN), down16(n, INT_MIN);
  const Outputs out{warp_sum.data(), block_sum.data(), transpose.data(), prefix.data(),
                    rotate16.data(), down16.data(), math.data()};
  host_cuda::run_grid(grid, dim3(kTile, kTile), [&] { block_kernel(x.data(), ints.data(), out); });
  write_file(dir + "/warp_sum.bin", warp_sum);
  write_file(dir + "/block_sum.bin", block_sum);
  write_file(dir + "/transpose.bin", transpose);
  write_file(dir + "/prefix.bin", prefix);
  write_file(dir + "/rotate16.bin", rotate16);
  write_file(dir + "/down16.bin", down16);
  write_file(dir + "/math.bin", math);
  return 0;
}
