"""The CUDA RoPE kernel's thread map (ropewkv/rope.h: rope_vector_width, make_thread_map, thread_work, group_heads),
compiled for the host with g++ and checked on many shapes: every element of q and k is written exactly once (the
rotated dims by the pair and frequency that pair_dims assigns, the dims past rotary_dim copied only out of place), and
the vector path is chosen only where every 16-byte access is aligned. CUDA cannot run here; this is its index math.
"""
import itertools
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Simulates the kernel: for each thread, the runs it loads and stores for each of its heads, as rope_kernel.cuh walks
# them (NeoX: `width` dims at first_dim and at first_dim + rot_half; GPT-J: `width` dims at first_dim, pairs (2i, 2i+1)
# with frequency first_freq + i; copy: copy_width dims at first_dim).
PROGRAM = r"""
#include <cstdio>
#include <vector>
#include "ropewkv/rope.h"
using namespace ropewkv::rope;

int main() {
  long long batch, seqlen, hq, hk, d, rot_half, interleaved, in_place, element_bytes, misalign, head_pad, target;
  int line = 0;
  while (scanf("%lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld", &batch, &seqlen, &hq, &hk, &d,
               &rot_half, &interleaved, &in_place, &element_bytes, &misalign, &head_pad, &target) == 12) {
    ++line;
    Params p;
    p.batch = batch; p.seqlen = seqlen; p.hq = hq; p.hk = hk; p.head_dim = d; p.rot_half = rot_half;
    p.interleaved = interleaved != 0;
    // q: [B, S, Hq, D] with each head padded by head_pad elements; k: a separate buffer; outputs alike or in place.
    const int64_t head = d + head_pad;
    const auto set = [&](int64_t* st, int64_t heads) {
      st[2] = head;
      st[1] = heads * head;
      st[0] = seqlen * st[1];
    };
    set(p.q_stride, hq); set(p.qo_stride, hq); set(p.k_stride, hk); set(p.ko_stride, hk);
    p.q = reinterpret_cast<const void*>(uintptr_t(0x10000 + misalign * element_bytes));
    p.k = hk > 0 ? reinterpret_cast<const void*>(uintptr_t(0x20000)) : nullptr;
    p.q_out = in_place ? const_cast<void*>(p.q) : reinterpret_cast<void*>(uintptr_t(0x30000));
    p.k_out = in_place ? const_cast<void*>(p.k) : reinterpret_cast<void*>(uintptr_t(0x40000));
    const bool copy_rest = !in_place && d > 2 * rot_half;
    const int64_t vec = rope_vector_width(p, element_bytes, copy_rest);
    // The vector path needs aligned pointers and strides, and runs that tile the rotary dims (and the rest if copied).
    const int64_t per = 16 / element_bytes;
    const bool aligned = misalign % per == 0 && head % per == 0 && (interleaved ? 2 * rot_half : rot_half) % per == 0 &&
                         (!copy_rest || (d - 2 * rot_half) % per == 0);
    if ((vec != 0) != aligned || (vec != 0 && vec != per)) {
      printf("line %d: vector width %lld\n", line, (long long)vec);
      return 1;
    }
    const ThreadMap m = make_thread_map(p, vec, copy_rest, target);
    const int64_t tokens = batch * seqlen, heads = hq + hk;
    std::vector<int> written(tokens * heads * d, 0);
    std::vector<int64_t> freq(tokens * heads * d, -1);
    for (int64_t t = 0; t < m.threads; ++t) {
      const ThreadWork w = thread_work(p, m, t);
      if (w.b < 0 || w.b >= batch || w.s < 0 || w.s >= seqlen || w.group < 0 || w.group >= m.groups) {
        printf("line %d: thread %lld out of range\n", line, (long long)t); return 1;
      }
      for (int tensor = 0; tensor < 2; ++tensor) {
        const int64_t n = tensor == 0 ? hq : hk;
        const int64_t count = group_heads(n, w.group, m.groups);
        for (int64_t c = 0; c < count; ++c) {
          const int64_t h = w.group + c * m.groups;
          if (h >= n) { printf("line %d: head %lld >= %lld\n", line, (long long)h, (long long)n); return 1; }
          const int64_t base = ((w.b * seqlen + w.s) * heads + (tensor == 0 ? h : hq + h)) * d;
          const auto mark = [&](int64_t dim, int64_t f) {
            if (dim < 0 || dim >= d) { printf("line %d: dim %lld\n", line, (long long)dim); exit(1); }
            ++written[base + dim];
            freq[base + dim] = f;
          };
          if (!w.rotates) {
            for (int64_t i = 0; i < m.copy_width; ++i) mark(w.first_dim + i, -2);
          } else if (interleaved) {
            for (int64_t i = 0; i < m.width / 2; ++i) {
              mark(w.first_dim + 2 * i, w.first_freq + i);
              mark(w.first_dim + 2 * i + 1, w.first_freq + i);
            }
          } else {
            for (int64_t i = 0; i < m.width; ++i) {
              mark(w.first_dim + i, w.first_freq + i);
              mark(w.first_dim + i + rot_half, w.first_freq + i);
            }
          }
        }
      }
    }
    for (int64_t e = 0; e < int64_t(written.size()); ++e) {
      const int64_t dim = e % d;
      const bool rotated = dim < 2 * rot_half;
      const int expected = rotated || copy_rest ? 1 : 0;
      int64_t want_freq = -2;
      if (rotated) want_freq = interleaved ? dim / 2 : (dim < rot_half ? dim : dim - rot_half);
      if (written[e] != expected || (expected && freq[e] != want_freq)) {
        printf("line %d: element %lld (dim %lld) written %d times, frequency %lld\n", line, (long long)e,
               (long long)dim, written[e], (long long)freq[e]);
        return 1;
      }
    }
    printf("%lld %lld %lld\n", (long long)vec, (long long)m.groups, (long long)m.threads);
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def thread_map(tmp_path_factory):
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        pytest.fail("no C++ compiler (g++) to build the thread-map check")
    folder = tmp_path_factory.mktemp("thread_map")
    source, binary = folder / "thread_map.cpp", folder / "thread_map"
    source.write_text(PROGRAM)
    subprocess.run([compiler, "-std=c++20", "-O1", "-I", os.path.join(ROOT, "csrc", "include"), str(source), "-o",
                    str(binary)], check=True)

    def run(cases):
        text = "\n".join(" ".join(str(v) for v in case) for case in cases) + "\n"
        done = subprocess.run([str(binary)], input=text, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        return [tuple(int(v) for v in line.split()) for line in done.stdout.splitlines()]

    return run


# (batch, seqlen, hq, hk, head_dim, rot_half): full and partial rotary, GQA, MQA, q only (hk 0), odd sizes,
# decode (few tokens), a packed varlen batch as [1, T] (the map is over tokens; positions are the shared math's).
SHAPES = [(2, 3, 4, 2, 128, 64), (1, 5, 3, 1, 64, 16), (2, 2, 4, 4, 80, 40), (1, 7, 2, 0, 128, 32),
          (3, 1, 32, 8, 128, 64), (1, 1, 5, 3, 96, 24), (1, 9, 1, 1, 40, 20), (2, 2, 3, 3, 10, 4),
          (1, 4, 2, 2, 130, 64), (1, 6, 6, 2, 24, 12), (1, 2, 2, 1, 16, 0), (2, 1, 7, 7, 256, 128)]


def _cases():
    for shape, interleaved, in_place, element_bytes, (misalign, head_pad), target in itertools.product(
            SHAPES, (0, 1), (0, 1), (2, 4), ((0, 0), (1, 0), (0, 2), (8, 8)), (1 << 17, 64, 1)):
        yield (*shape, interleaved, in_place, element_bytes, misalign, head_pad, target)


def test_thread_map_covers_every_element_once(thread_map):
    cases = list(_cases())
    results = thread_map(cases)
    assert len(results) == len(cases)
    by_case = dict(zip(cases, results))
    # Both paths and head grouping are exercised.
    assert any(vec > 0 for vec, _, _ in results) and any(vec == 0 for vec, _, _ in results)
    assert any(groups > 1 for _, groups, _ in results)
    # Decode (B=3, S=1, Hq 32, Hk 8, bf16, aligned): heads spread over groups, one q and at most one k head each.
    vec, groups, threads = by_case[(3, 1, 32, 8, 128, 64, 0, 0, 2, 0, 0, 1 << 17)]
    assert (vec, groups, threads) == (8, 32, 3 * 32 * 8)
    # Many tokens keep one group: the angle is computed once per (token, frequency).
    many = (8192, 1, 2, 1, 256, 128, 0, 0, 2, 0, 0, 1 << 17)
    assert thread_map([many]) == [(8, 1, 8192 * 16)]
