#pragma once
// Host stand-in for csrc/include/ropewkv/cuda_common.cuh (tests/test_rope_cuda_on_host.py): the same Run, with
// memcpy for the bit casts and the 16-byte accesses, and an abort where a vector access is not 16-byte aligned (the
// device would fault).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "ropewkv/precision.h"

namespace ropewkv::cuda {

inline void check_aligned_16(const void* ptr, const char* what) {
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) {
    std::fprintf(stderr, "misaligned 16-byte %s at %p\n", what, ptr);
    std::abort();
  }
}

template <typename io_t>
inline uint32_t to_bits(io_t v) {
  if constexpr (sizeof(io_t) == 4) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return u;
  } else {
    return v.bits;
  }
}

template <typename io_t>
inline io_t from_bits(uint32_t u) {
  if constexpr (sizeof(io_t) == 4) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else {
    return io_t{uint16_t(u)};
  }
}

template <typename io_t, int N, bool VECTOR>
struct Run {
  io_t v[N];

  static Run load(const io_t* ptr) {
    Run r;
    if constexpr (VECTOR) {
      static_assert(N * sizeof(io_t) == sizeof(uint4));
      check_aligned_16(ptr, "load");
      uint4 bits;
      std::memcpy(&bits, ptr, 16);
      const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
      constexpr int kPerWord = N / 4;
      for (int i = 0; i < N; ++i) r.v[i] = from_bits<io_t>(words[i / kPerWord] >> (16 * (i % kPerWord)));
    } else {
      for (int i = 0; i < N; ++i) r.v[i] = ptr[i];
    }
    return r;
  }

  void store(io_t* ptr) const {
    if constexpr (VECTOR) {
      constexpr int kPerWord = N / 4;
      uint32_t words[4] = {0, 0, 0, 0};
      for (int i = 0; i < N; ++i) words[i / kPerWord] |= to_bits(v[i]) << (16 * (i % kPerWord));
      check_aligned_16(ptr, "store");
      std::memcpy(ptr, words, 16);
    } else {
      for (int i = 0; i < N; ++i) ptr[i] = v[i];
    }
  }
};

}  // namespace ropewkv::cuda
