#pragma once
// The RoPE CUDA kernel, launched by rope_launch.cuh (instantiated per I/O dtype by rope_{fp32,fp16,bf16}.cu).
// Torch-free.
//
// The thread map (ropewkv/rope.h, tested on the host): a thread owns one (token, head group, unit of `width` dims),
// computes the cos/sin of its unit's frequencies once, then walks its heads of q and of k in batches of
// kRunsPerBatch runs, software-pipelined: the next batch's loads are in flight while the current one rotates (and the
// first batch's while the angles are computed), one 16-byte access per run of dims on the vector path. No
// per-element index math: a batch advances a pointer by a stride. Inputs that are not 16-byte aligned (pointers,
// strides, the rotary split) take the element-wise instantiation (VECTOR = false), chosen on the host.
//
// The host launch (<<<>>>) is in rope_launch.cuh, so that this header also compiles with g++ against a host stand-in
// of ropewkv/cuda_common.cuh: tests/test_rope_cuda_on_host.py runs the kernel's every thread on the CPU.
#include <type_traits>

#include "ropewkv/cuda_common.cuh"
#include "ropewkv/rope.h"

namespace ropewkv::cuda {

inline constexpr int kRopeThreads = 128;
// 16-byte runs per batch of heads (2 NeoX heads, 4 GPT-J heads): 64 B per thread in flight while it rotates the
// previous batch, 128 B while it waits. Two batches in registers: 128 registers (4 blocks per SM) at bf16 NeoX.
inline constexpr int kRunsPerBatch = 4;
// Blocks per SM that ptxas fits the registers to: 4 (128 registers; its choice unbounded, 130, would leave 3), with
// no spills in every instantiation but one: NeoX in fp16 I/O and precision="bf16" (each operation rounded to fp16),
// which needs more and gets 3 (168).
template <typename io_t, Precision P, bool INTERLEAVED>
inline constexpr int kRopeMinBlocks = std::is_same_v<io_t, fp16_t> && P == Precision::kBF16 && !INTERLEAVED ? 3 : 4;

// One run pair (NeoX: a run in each half, `second` elements apart) or run (GPT-J) of each of HEADS heads of one
// tensor, `step` elements apart.
template <int HEADS, typename io_t, int W, bool VECTOR, bool INTERLEAVED>
struct HeadBatch {
  using R = Run<io_t, W, VECTOR>;
  static constexpr int kRuns = INTERLEAVED ? 1 : 2;
  // As loaded: each run's 16 raw bytes on the vector path, unpacked only in rotate_store (two batches are live at
  // once; carried as 16-bit elements they cost PRMT shuffles and 40 registers more), else its elements.
  using Loaded = std::conditional_t<VECTOR, uint4, R>;
  Loaded loaded[HEADS][kRuns];

  __device__ __forceinline__ void load(const io_t* x, int64_t step, int64_t second) {
    __builtin_assume(__isGlobal(x));  // LDG: through the batch cursors NVVM loses the address space (generic LD)
#pragma unroll
    for (int k = 0; k < HEADS; ++k) {
#pragma unroll
      for (int r = 0; r < kRuns; ++r) {
        const io_t* ptr = x + k * step + r * second;
        if constexpr (VECTOR) {
          loaded[k][r] = *reinterpret_cast<const uint4*>(ptr);
        } else {
          loaded[k][r] = R::load(ptr);
        }
      }
    }
  }

  __device__ __forceinline__ R run(int k, int r) const {
    if constexpr (VECTOR) {
      return R::load(reinterpret_cast<const io_t*>(&loaded[k][r]));  // R's unpacking, from registers
    } else {
      return loaded[k][r];
    }
  }

  template <typename acc_t>
  __device__ __forceinline__ void rotate_store(io_t* o, int64_t step, int64_t second, const float* ca,
                                               const float* sa, const float* cb, const float* sb) const {
    __builtin_assume(__isGlobal(o));  // STG on the element-wise path, as in load
#pragma unroll
    for (int k = 0; k < HEADS; ++k) {
      R in[kRuns];
#pragma unroll
      for (int r = 0; r < kRuns; ++r) in[r] = run(k, r);
      R out[kRuns];
      if constexpr (INTERLEAVED) {
#pragma unroll
        for (int i = 0; i < W / 2; ++i) {
          rope::rotate_values<acc_t>(in[0].v[2 * i], in[0].v[2 * i + 1], ca[i], sa[i], cb[i], sb[i],
                                     &out[0].v[2 * i], &out[0].v[2 * i + 1]);
        }
      } else {
#pragma unroll
        for (int i = 0; i < W; ++i) {
          rope::rotate_values<acc_t>(in[0].v[i], in[1].v[i], ca[i], sa[i], cb[i], sb[i], &out[0].v[i],
                                     &out[1].v[i]);
        }
      }
#pragma unroll
      for (int r = 0; r < kRuns; ++r) out[r].store(o + k * step + r * second);
    }
  }
};

// A thread's heads of one tensor (q or k): `count` heads read at x and written at o, x_step / o_step elements apart.
template <typename io_t>
struct UnitHeads {
  const io_t* x;
  io_t* o;
  int64_t x_step, o_step, count;

  // The heads past the first count % HEADS: whole batches of HEADS.
  template <int HEADS>
  __device__ __forceinline__ UnitHeads batched() const {
    const int64_t lead = count % HEADS;
    return {x + lead * x_step, o + lead * o_step, x_step, o_step, count - lead};
  }
};

// Rotates the first count % HEADS heads of a tensor one by one (`Head`: a batch of 1; rotate(head, o, step) rotates
// it and stores it at o).
template <typename Head, int HEADS, typename io_t, typename Rotate>
__device__ __forceinline__ void rotate_lead_heads(const UnitHeads<io_t>& t, int64_t second, const Rotate& rotate) {
#pragma unroll 1
  for (int64_t h = 0; h < t.count % HEADS; ++h) {
    Head head;
    head.load(t.x + h * t.x_step, 0, second);
    rotate(head, t.o + h * t.o_step, 0);
  }
}

// The batches of q's heads, then of k's (both `batched`): where the first is, and a step to batch i.
template <int HEADS, typename io_t>
struct BatchOrder {
  UnitHeads<io_t> q, k;

  // Head counts fit 32 bits (a tensor dimension), and so do batch indices: fewer registers in the hot loop.
  __device__ __forceinline__ int count() const { return int((q.count + k.count) / HEADS); }
  __device__ __forceinline__ UnitHeads<io_t> first() const { return q.count > 0 ? q : k; }
  // From batch i - 1 (at t) to batch i.
  __device__ __forceinline__ void advance(UnitHeads<io_t>& t, int i) const {
    if (i == int(q.count / HEADS)) {
      t = k;
    } else {
      t.x += HEADS * t.x_step;
      t.o += HEADS * t.o_step;
    }
  }
};

// Rotates the batches in `order` (rotate(batch, o, step) rotates one and stores it at o); `a` holds the first,
// loaded by the caller before it computed the angles. Two batches alternate in registers (no copies): the
// loads of batch i + 1 are issued right after the stores of batch i - 1, into the registers batch i - 1 has freed, so
// they are in flight while batch i rotates. A store may alias a load (in place), so ptxas keeps that order.
template <typename Batch, int HEADS, typename io_t, typename Rotate>
__device__ __forceinline__ void rotate_batches(Batch& a, const BatchOrder<HEADS, io_t>& order, int64_t second,
                                               const Rotate& rotate) {
  const int batches = order.count();
  UnitHeads<io_t> loading = order.first(), storing = loading;  // where the next batch is read, the current written
  Batch b;
  if (batches > 1) {
    order.advance(loading, 1);
    b.load(loading.x, loading.x_step, second);
  }
  // Rotates batch i from `current`, then, if `reload`, loads batch i + 2 into it.
  const auto step = [&](Batch& current, int i, bool reload) {
    rotate(current, storing.o, storing.o_step);
    order.advance(storing, i + 1);
    if (reload) {
      order.advance(loading, i + 2);
      current.load(loading.x, loading.x_step, second);
    }
  };
  int i = 0;
#pragma unroll 1
  for (; i + 2 < batches; ++i) {  // the hot loop: batch i is in `a` when i is even, in `b` when it is odd
    // Two branches, not one body with both steps: ptxas schedules within a basic block, and given both it hoisted the
    // second rotation above the first one's reload, so that nothing was in flight while it ran.
    if (i % 2 == 0) {
      step(a, i, true);
    } else {
      step(b, i, true);
    }
  }
  // The last one or two batches, in straight code (the loop above stays the hot loop the static report judges).
  const auto last_two = [&](Batch& earlier, Batch& later) {
    if (i < batches) step(earlier, i, false);
    if (i + 1 < batches) step(later, i + 1, false);
  };
  if (i % 2 == 0) {
    last_two(a, b);
  } else {
    last_two(b, a);
  }
}

// Copies the unit's run (dims past rotary_dim, out of place) of a tensor's heads, kCopyHeads loads at a time: 48 B
// per thread in flight, not pipelined (a copy batch as large as the rotation's, 64 B, made the copy loop the hot loop
// the static report judges; a pipelined copy cost a spill in the rotating path).
template <typename io_t, int W, bool VECTOR>
__device__ __forceinline__ void copy_unit_heads(UnitHeads<io_t> t) {
  using R = Run<io_t, W, VECTOR>;
  constexpr int kCopyHeads = 3;
  if (t.count == 0) return;  // then t's pointers may be null-based (no k): nothing to assume about them
  __builtin_assume(__isGlobal(t.x) && __isGlobal(t.o));
  int64_t h = 0;
#pragma unroll 1
  for (; h + kCopyHeads <= t.count; h += kCopyHeads) {
    R in[kCopyHeads];
#pragma unroll
    for (int k = 0; k < kCopyHeads; ++k) in[k] = R::load(t.x + k * t.x_step);
#pragma unroll
    for (int k = 0; k < kCopyHeads; ++k) in[k].store(t.o + k * t.o_step);
    t.x += kCopyHeads * t.x_step;
    t.o += kCopyHeads * t.o_step;
  }
#pragma unroll 1
  for (; h < t.count; ++h) {
    R::load(t.x).store(t.o);
    t.x += t.x_step;
    t.o += t.o_step;
  }
}

// W: elements per rotating run (the vector width, or 1 NeoX / 2 GPT-J element-wise); copy runs are W wide on the
// vector path and 1 element-wise (the copy tail need not be a multiple of anything there).
template <typename io_t, Precision P, bool VECTOR, bool INTERLEAVED>
__global__ void __launch_bounds__(kRopeThreads, kRopeMinBlocks<io_t, P, INTERLEAVED>)
    rope_kernel(const rope::Params p, const rope::ThreadMap m) {
  using acc_t = rope::rope_accum_t<io_t, P>;
  constexpr int W = VECTOR ? 16 / int(sizeof(io_t)) : (INTERLEAVED ? 2 : 1);
  constexpr int CW = VECTOR ? W : 1;
  constexpr int kFreqs = INTERLEAVED ? W / 2 : W;
  constexpr int kHeads = INTERLEAVED ? kRunsPerBatch : kRunsPerBatch / 2;  // per batch
  // One thread per work item: the host keeps the grid within gridDim.x's limit (no grid-stride loop, whose index
  // would stay live across the rotation and cost the register that keeps the hot loop at 128 without spills).
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (thread >= m.threads) return;
  const rope::ThreadWork w = rope::thread_work(p, m, thread);
  const int64_t nq = rope::group_heads(p.hq, w.group, m.groups);
  const int64_t nk = p.k != nullptr ? rope::group_heads(p.hk, w.group, m.groups) : 0;
  const io_t* q = static_cast<const io_t*>(p.q) + w.b * p.q_stride[0] + w.s * p.q_stride[1] +
                  w.group * p.q_stride[2] + w.first_dim;
  io_t* qo = static_cast<io_t*>(p.q_out) + w.b * p.qo_stride[0] + w.s * p.qo_stride[1] +
             w.group * p.qo_stride[2] + w.first_dim;
  const io_t* k = static_cast<const io_t*>(p.k) + w.b * p.k_stride[0] + w.s * p.k_stride[1] +
                  w.group * p.k_stride[2] + w.first_dim;
  io_t* ko = static_cast<io_t*>(p.k_out) + w.b * p.ko_stride[0] + w.s * p.ko_stride[1] +
             w.group * p.ko_stride[2] + w.first_dim;
  const int64_t g = m.groups;
  const UnitHeads<io_t> q_heads{q, qo, g * p.q_stride[2], g * p.qo_stride[2], nq};
  const UnitHeads<io_t> k_heads{k, ko, g * p.k_stride[2], g * p.ko_stride[2], nk};
  if (!w.rotates) {
    copy_unit_heads<io_t, CW, VECTOR>(q_heads);
    copy_unit_heads<io_t, CW, VECTOR>(k_heads);
    return;
  }
  using Rotation = HeadBatch<kHeads, io_t, W, VECTOR, INTERLEAVED>;
  const BatchOrder<kHeads, io_t> order{q_heads.template batched<kHeads>(), k_heads.template batched<kHeads>()};
  // The first batch's loads are in flight while the angles are computed.
  Rotation batch;
  if (order.count() > 0) batch.load(order.first().x, order.first().x_step, p.rot_half);
  // The unit's cos/sin, once per (token, frequency) for all its heads.
  int64_t pos[3] = {0, 0, 0};
  if (p.cos == nullptr) rope::token_positions(p, w.b, w.s, pos);
  float ca[kFreqs], sa[kFreqs], cb[kFreqs], sb[kFreqs];
#pragma unroll
  for (int i = 0; i < kFreqs; ++i) {
    const int64_t j = w.first_freq + i;
    rope::table_entry<acc_t, float>(p, w.b, w.s, pos[rope::mrope_row(p, j)], j, &ca[i], &sa[i], &cb[i], &sb[i]);
  }
  const auto rotate = [&](const auto& heads, io_t* o, int64_t step) {
    heads.template rotate_store<acc_t>(o, step, p.rot_half, ca, sa, cb, sb);
  };
  using RotationHead = HeadBatch<1, io_t, W, VECTOR, INTERLEAVED>;
  rotate_lead_heads<RotationHead, kHeads>(q_heads, p.rot_half, rotate);
  rotate_lead_heads<RotationHead, kHeads>(k_heads, p.rot_half, rotate);
  rotate_batches(batch, order, p.rot_half, rotate);
}

// What rope_launch runs: the vector width (0: the element-wise instantiation) and the thread map. target_threads:
// make_thread_map's (the host test lowers it to give threads several heads at small shapes).
struct RopeLaunchPlan {
  int64_t vec;
  rope::ThreadMap map;
};

inline RopeLaunchPlan plan_rope_launch(const rope::Params& p, int64_t element_bytes,
                                       int64_t target_threads = rope::kRopeTargetThreads) {
  const bool in_place = p.q_out == p.q && (p.k == nullptr || p.k_out == p.k);
  const bool copy_rest = !in_place && p.head_dim > 2 * p.rot_half;
  const int64_t vec = rope::rope_vector_width(p, element_bytes, copy_rest);
  return {vec, rope::make_thread_map(p, vec, copy_rest, target_threads)};
}

}  // namespace ropewkv::cuda
