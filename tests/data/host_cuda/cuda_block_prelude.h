#pragma once
// Host stand-ins for block cooperation, on top of cuda_prelude.h: a kernel that uses __shared__ arrays,
// __syncthreads and warp shuffles compiles with g++ as it is and runs on the CPU (tests/test_cuda_block_on_host.py
// shows the use; tests/host_cuda.py builds a driver with the sanitizers). Launch with
//   host_cuda::run_grid(grid, block, [&] { my_kernel<...>(args); });
// in place of my_kernel<<<grid, block>>>(args).
//
// Modelled:
// - Blocks run one after another; each block's threads are blockDim.x * y * z concurrent std::threads (threadIdx and
//   blockIdx are thread_local; the linear id x + y * blockDim.x + z * blockDim.x * blockDim.y), joined at its end.
// - __shared__ is `static`: one array for all the threads of the running block, which is per-block shared memory
//   because blocks do not overlap. So: declare shared arrays at kernel scope, size them at compile time (for
//   `extern __shared__`, see dynamic shared memory below), and do not read one before the block writes it: it starts zeroed for the first block and
//   then holds the previous block's values (the device gives undefined values); run several blocks to catch that.
// - __syncthreads(): a barrier over the block's threads (std::barrier: writes before it are seen after it). Threads
//   waiting at different __syncthreads release each other (bar.sync counts arrivals, not call sites), and a thread
//   that returned is no longer awaited; CUDA leaves a __syncthreads that not every thread reaches undefined, and one
//   here can hang: run drivers with a timeout.
// - Warps: 32 consecutive linear ids. __shfl_sync, __shfl_xor_sync, __shfl_up_sync, __shfl_down_sync (4-byte
//   values: float, int, unsigned; width a power of two up to 32) and __syncwarp, with the full mask only: every lane
//   of a full warp must take part (checked: a shuffle in a partial warp, or after a lane of the warp returned, aborts).
//   host_cuda::warp_gather (HOST_CUDA_WARP_GATHER) hands every lane all the lanes' words at once, for code whose
//   device form exchanges many registers (each shuffle here costs two barrier waits of the warp's threads).
// - Dynamic shared memory: a kernel names it with ROPEWKV_DYNAMIC_SHARED(name) (a float4 pointer here, the extern
//   __shared__ array on the device), sized by run_grid's shared_bytes; it is filled with all-ones bytes (NaN floats)
//   before every block, so that a read before the block's write shows.
// Not modelled: the device's memory ordering. A race (two threads on one shared or global element with no barrier
// between, one writing) is undefined behaviour here too and may well give the expected answer: build with
// -fsanitize=thread, as tests/test_cuda_block_on_host.py does, to have it reported. Nor other warp intrinsics (__ballot_sync etc.: no stand-in, so they do not compile), or the device's approximate math
// (cuda_prelude.h: __expf is exact here).
#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "cuda_prelude.h"

#undef __shared__
#define __shared__ static

namespace host_cuda {

inline constexpr unsigned kWarpSize = 32;
inline constexpr unsigned kFullMask = 0xffffffffu;
inline constexpr unsigned kMaxGather = 8;  // words per lane in one warp_gather

inline void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "host_cuda: %s\n", what);
    std::abort();
  }
}

struct Warp {
  explicit Warp(unsigned lanes) : lanes(lanes), barrier(lanes) {}
  const unsigned lanes;  // kWarpSize, but in a block's last warp when the block size is not a multiple of it
  std::barrier<> barrier;
  std::atomic<bool> lane_returned{false};
  uint32_t exchange[kWarpSize];  // each lane's value of the shuffle in progress
  uint32_t gathered[kWarpSize][kMaxGather];  // each lane's words of the warp_gather in progress
};

struct Block {
  Block(unsigned threads, size_t shared_bytes)
      : barrier(threads), dynamic_shared((shared_bytes + sizeof(float4) - 1) / sizeof(float4)) {
    std::fill_n(reinterpret_cast<unsigned char*>(dynamic_shared.data()), dynamic_shared.size() * sizeof(float4), 0xff);
    for (unsigned first = 0; first < threads; first += kWarpSize) {
      warps.push_back(std::make_unique<Warp>(std::min(kWarpSize, threads - first)));
    }
  }
  std::barrier<> barrier;
  std::vector<std::unique_ptr<Warp>> warps;
  std::vector<float4> dynamic_shared;
};

inline thread_local Block* this_block = nullptr;
inline thread_local Warp* this_warp = nullptr;
inline thread_local unsigned this_lane = 0;

// Every lane posts its value, then reads the one of lane source(lane); the second wait keeps the exchange until every
// lane has read it.
template <typename T, typename Source>
T shuffle(unsigned mask, T value, unsigned width, Source source) {
  static_assert(sizeof(T) == 4 && std::is_trivially_copyable_v<T>, "shuffles of 4-byte values only");
  require(this_warp != nullptr, "a warp shuffle outside host_cuda::run_grid");
  require(mask == kFullMask, "a warp shuffle with a mask other than 0xffffffff");
  require(width > 0 && width <= kWarpSize && std::has_single_bit(width), "a shuffle width not a power of two <= 32");
  Warp& warp = *this_warp;
  require(warp.lanes == kWarpSize, "a warp shuffle in a partial warp");
  warp.exchange[this_lane] = std::bit_cast<uint32_t>(value);
  warp.barrier.arrive_and_wait();
  require(!warp.lane_returned, "a warp shuffle after a lane of the warp returned");
  const unsigned group = this_lane & ~(width - 1);  // the first lane of this lane's group of `width`
  const T result = std::bit_cast<T>(warp.exchange[source(group, this_lane - group)]);
  warp.barrier.arrive_and_wait();
  return result;
}

// all[lane] = that lane's `mine`, for every lane of a full warp: a register exchange the device does by shuffles,
// here in two barrier waits instead of two per word and source lane (ropewkv/mma_bf16.cuh forms each emulated mma
// from its 32 lanes' fragments this way: 64 waits -> 2).
template <unsigned n>
void warp_gather(const uint32_t (&mine)[n], uint32_t (&all)[kWarpSize][n]) {
  static_assert(n <= kMaxGather, "at most kMaxGather words per lane");
  require(this_warp != nullptr, "a warp gather outside host_cuda::run_grid");
  Warp& warp = *this_warp;
  require(warp.lanes == kWarpSize, "a warp gather in a partial warp");
  std::copy_n(mine, n, warp.gathered[this_lane]);
  warp.barrier.arrive_and_wait();
  require(!warp.lane_returned, "a warp gather after a lane of the warp returned");
  for (unsigned lane = 0; lane < kWarpSize; ++lane) std::copy_n(warp.gathered[lane], n, all[lane]);
  warp.barrier.arrive_and_wait();
}

inline float4* dynamic_shared() {
  require(this_block != nullptr, "dynamic shared memory outside host_cuda::run_grid");
  return this_block->dynamic_shared.data();
}

// Runs body() as every thread of every block of the grid, each block with shared_bytes of dynamic shared memory; see
// the top of this file.
template <typename F>
void run_grid(dim3 grid, dim3 block, size_t shared_bytes, F&& body) {
  const unsigned threads = block.x * block.y * block.z;
  require(threads > 0 && threads <= 1024, "a block of 1 to 1024 threads");
  gridDim = grid;
  blockDim = block;
  for (unsigned bz = 0; bz < grid.z; ++bz) {
    for (unsigned by = 0; by < grid.y; ++by) {
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block state(threads, shared_bytes);
        std::vector<std::jthread> workers;
        workers.reserve(threads);
        for (unsigned t = 0; t < threads; ++t) {
          workers.emplace_back([&, t] {
            blockIdx = dim3(bx, by, bz);
            threadIdx = dim3(t % block.x, t / block.x % block.y, t / (block.x * block.y));
            this_block = &state;
            this_warp = state.warps[t / kWarpSize].get();
            this_lane = t % kWarpSize;
            body();
            this_warp->lane_returned = true;
            this_warp->barrier.arrive_and_drop();
            state.barrier.arrive_and_drop();
          });
        }
      }  // the block's threads join here, before the next block starts
    }
  }
}

template <typename F>
void run_grid(dim3 grid, dim3 block, F&& body) {
  run_grid(grid, block, 0, body);
}

}  // namespace host_cuda

#define ROPEWKV_DYNAMIC_SHARED(name) float4* name = host_cuda::dynamic_shared()
#define HOST_CUDA_WARP_GATHER 1  // host_cuda::warp_gather is here

inline void __syncthreads() {
  host_cuda::require(host_cuda::this_block != nullptr, "__syncthreads outside host_cuda::run_grid");
  host_cuda::this_block->barrier.arrive_and_wait();
}

inline void __syncwarp(unsigned mask = host_cuda::kFullMask) {
  host_cuda::require(host_cuda::this_warp != nullptr, "__syncwarp outside host_cuda::run_grid");
  host_cuda::require(mask == host_cuda::kFullMask, "__syncwarp with a mask other than 0xffffffff");
  host_cuda::this_warp->barrier.arrive_and_wait();
}

// As CUDA's: a source lane outside the group of `width` lanes wraps (__shfl_sync), or leaves the lane its own value
// (__shfl_up_sync, __shfl_down_sync); __shfl_xor_sync reads lane ^ lane_mask, or its own value where that lane is
// past its group.
template <typename T>
T __shfl_sync(unsigned mask, T value, int src_lane, unsigned width = host_cuda::kWarpSize) {
  return host_cuda::shuffle(mask, value, width,
                            [&](unsigned group, unsigned) { return group + (unsigned(src_lane) & (width - 1)); });
}

template <typename T>
T __shfl_up_sync(unsigned mask, T value, unsigned delta, unsigned width = host_cuda::kWarpSize) {
  return host_cuda::shuffle(mask, value, width, [&](unsigned group, unsigned lane) {
    return group + (lane >= delta ? lane - delta : lane);
  });
}

template <typename T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta, unsigned width = host_cuda::kWarpSize) {
  return host_cuda::shuffle(mask, value, width, [&](unsigned group, unsigned lane) {
    return group + (lane + delta < width ? lane + delta : lane);
  });
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, unsigned width = host_cuda::kWarpSize) {
  host_cuda::require(lane_mask >= 0 && unsigned(lane_mask) < host_cuda::kWarpSize, "a shuffle lane mask past 31");
  return host_cuda::shuffle(mask, value, width, [&](unsigned group, unsigned lane) {
    const unsigned source = (group + lane) ^ unsigned(lane_mask);
    return source < group + width ? source : group + lane;
  });
}
