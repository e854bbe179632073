// Host replay of the CUDA decode step (step_kernel in csrc/wkv7/wkv7_kernels.cuh) for fp32 I/O, fp32 mode: the same
// lane map (wkv7::StepLanes), per-lane FMA chains and xor-butterfly row sums, the warp's lanes run in lockstep here.
// Usage: wkv7_step_lanes N decay tasks in.bin out.bin. in.bin: fp32 r, w, k, v, a, b [tasks, N] then the state
// [tasks, N, N]; out.bin: fp32 y [tasks, N] then the new state. Exits 1 if the lane map misses or repeats an element.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ropewkv/wkv7.h"
#include "ropewkv/wkv7_step_lanes.h"

using namespace ropewkv::wkv7;

template <int N>
bool step(Decay decay, long tasks, const float* in, float* y, float* state) {
  using Lanes = StepLanes<N>;
  constexpr int L = Lanes::kLanesPerRow;
  const float *r = in, *w = r + tasks * N, *k = w + tasks * N, *v = k + tasks * N, *a = v + tasks * N,
              *b = a + tasks * N;
  for (long task = 0; task < tasks; ++task) {
    float* S = state + task * N * N;
    std::vector<int> seen(N * N, 0);
    // Each thread's 4 columns of r, d, k, a, b (its registers).
    std::vector<float> r4(Lanes::kThreads * 4), d4(r4.size()), k4(r4.size()), a4(r4.size()), b4(r4.size());
    for (int t = 0; t < Lanes::kThreads; ++t) {
      for (int q = 0; q < 4; ++q) {
        const long j = task * N + Lanes::col(t) + q;
        r4[t * 4 + q] = r[j];
        d4[t * 4 + q] = decay_of(w[j], decay);
        k4[t * 4 + q] = k[j];
        a4[t * 4 + q] = a[j];
        b4[t * 4 + q] = b[j];
      }
    }
    for (int pass = 0; pass < Lanes::kPasses; ++pass) {
      // The row groups of this pass: threads g L .. g L + L - 1 (lane l = t % L) share row Lanes::row(t, pass).
      for (int group = 0; group < Lanes::kThreads / L; ++group) {
        const int first = group * L, i = Lanes::row(first, pass);
        float partial[L], s[L][4];
        for (int l = 0; l < L; ++l) {
          const int t = first + l, at = Lanes::offset(t, pass);
          if (Lanes::row(t, pass) != i || at != i * N + Lanes::col(t)) return false;
          for (int q = 0; q < 4; ++q) {
            s[l][q] = S[at + q];
            seen[at + q] += 1;
          }
          partial[l] = lane_dot4(&a4[t * 4], s[l]);
        }
        const float sa = butterfly_sum<L>(partial);
        for (int l = 0; l < L; ++l) {
          const int t = first + l;
          lane_update4(s[l], &d4[t * 4], sa, &b4[t * 4], v[task * N + i], &k4[t * 4]);
          partial[l] = lane_dot4(&r4[t * 4], s[l]);
        }
        y[task * N + i] = butterfly_sum<L>(partial);
        for (int l = 0; l < L; ++l)
          for (int q = 0; q < 4; ++q) S[Lanes::offset(first + l, pass) + q] = s[l][q];
      }
    }
    for (int count : seen)
      if (count != 1) return false;
  }
  return true;
}

int main(int argc, char** argv) {
  if (argc != 6) return 2;
  const int n = std::atoi(argv[1]);
  const Decay decay = static_cast<Decay>(std::atoi(argv[2]));
  const long tasks = std::atol(argv[3]);
  std::vector<float> in(tasks * n * 6), state(tasks * n * n), y(tasks * n);
  FILE* f = std::fopen(argv[4], "rb");
  if (!f || std::fread(in.data(), 4, in.size(), f) != in.size() ||
      std::fread(state.data(), 4, state.size(), f) != state.size())
    return 2;
  std::fclose(f);
  bool ok = n == 32   ? step<32>(decay, tasks, in.data(), y.data(), state.data())
            : n == 64 ? step<64>(decay, tasks, in.data(), y.data(), state.data())
                      : n == 128 && step<128>(decay, tasks, in.data(), y.data(), state.data());
  if (!ok) return 1;
  f = std::fopen(argv[5], "wb");
  std::fwrite(y.data(), 4, y.size(), f);
  std::fwrite(state.data(), 4, state.size(), f);
  std::fclose(f);
  return 0;
}
