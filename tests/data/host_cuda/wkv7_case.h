#pragma once
// A WKV7 case directory as the host drivers of the WKV7 CUDA kernels read it (tests/data/wkv7*_cuda_on_host.cpp,
// written by tests/host_cuda.py: write_wkv7_case):
//   case.txt: io (0 fp32, 1 bf16, 2 fp16) w_fp32 (0: w in r's dtype, 1: fp32) precision (0 fp32, 1 bf16)
//             decay (0 loglog, 1 raw, 2 log) N batch seqlen heads n_seqs has_cu_seqlens has_initial_state save
//   r.bin w.bin k.bin v.bin a.bin b.bin: [batch, seqlen, heads, N], raw elements; cu_seqlens.bin: int64 [n_seqs + 1];
//   initial_state.bin: fp32 [n_seqs, heads, N, N]
// Every buffer is a heap block of exactly its size (AddressSanitizer stops an access past it).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "driver_files.h"
#include "ropewkv/wkv7_cuda.h"

namespace host_cuda {

struct Wkv7Case {
  int io, w_fp32, precision, decay, n, has_cu, has_s0, save;
  int64_t batch, seqlen, heads, n_seqs, chunks, elements;
  size_t io_size, w_size;
  std::vector<unsigned char> inputs[6];  // r, w, k, v, a, b
  std::vector<unsigned char> cu, s0;

  ropewkv::cuda::Wkv7Sizes sizes() const {
    return {batch, seqlen, heads, n_seqs, chunks, decay,
            has_cu ? reinterpret_cast<const int64_t*>(cu.data()) : nullptr};
  }
  const float* initial_state() const { return has_s0 ? reinterpret_cast<const float*>(s0.data()) : nullptr; }
};

// All-ones bits: NaN in every dtype, so an element a kernel never writes stays NaN.
inline std::vector<unsigned char> nan_filled(size_t bytes) { return std::vector<unsigned char>(bytes, 0xff); }

inline Wkv7Case read_wkv7_case(const std::string& dir) {
  Wkv7Case c;
  std::ifstream fields(dir + "/case.txt");
  if (!(fields >> c.io >> c.w_fp32 >> c.precision >> c.decay >> c.n >> c.batch >> c.seqlen >> c.heads >> c.n_seqs >>
        c.has_cu >> c.has_s0 >> c.save)) {
    std::fprintf(stderr, "%s/case.txt: bad fields\n", dir.c_str());
    std::exit(2);
  }
  c.io_size = c.io == 0 ? 4 : 2;
  c.w_size = c.w_fp32 ? 4 : c.io_size;
  c.elements = c.batch * c.seqlen * c.heads * c.n;
  c.chunks = (c.seqlen + 15) / 16;
  const char* names[6] = {"r", "w", "k", "v", "a", "b"};
  for (int i = 0; i < 6; ++i) {
    c.inputs[i] = read_file(dir + "/" + names[i] + ".bin");
    if (c.inputs[i].size() != size_t(c.elements) * (i == 1 ? c.w_size : c.io_size)) {
      std::fprintf(stderr, "%s/%s.bin: %zu bytes\n", dir.c_str(), names[i], c.inputs[i].size());
      std::exit(2);
    }
  }
  if (c.has_cu) c.cu = read_file(dir + "/cu_seqlens.bin");
  if (c.has_s0) c.s0 = read_file(dir + "/initial_state.bin");
  return c;
}

// Calls run.template operator()<io_t, w_t, P>() for the case's I/O dtype, storage of w and precision: only the
// configurations the tests run (tests/host_cuda.py, WKV7_CONFIGS), since each instantiation costs build time.
template <typename Run>
void dispatch_wkv7(const Wkv7Case& c, Run&& run) {
  using ropewkv::Precision;
  using ropewkv::bf16_t;
  using ropewkv::fp16_t;
  const bool bf16_mode = c.precision == 1;
  if (c.io == 0 && !c.w_fp32) {
    return bf16_mode ? run.template operator()<float, float, Precision::kBF16>()
                     : run.template operator()<float, float, Precision::kFP32>();
  }
  if (c.io == 1 && !c.w_fp32 && !bf16_mode) return run.template operator()<bf16_t, bf16_t, Precision::kFP32>();
  if (c.io == 1 && c.w_fp32 && bf16_mode) return run.template operator()<bf16_t, float, Precision::kBF16>();
  if (c.io == 2 && c.w_fp32 && !bf16_mode) return run.template operator()<fp16_t, float, Precision::kFP32>();
  std::fprintf(stderr, "io %d, w_fp32 %d, precision %d: not a configuration of WKV7_CONFIGS\n", c.io, c.w_fp32,
               c.precision);
  std::exit(2);
}

// Calls run.template operator()<N>() for the case's head size (the drivers run 32 and 64).
template <typename Run>
void dispatch_head_size(const Wkv7Case& c, Run&& run) {
  if (c.n == 32) return run.template operator()<32>();
  if (c.n == 64) return run.template operator()<64>();
  if (c.n == 128) return run.template operator()<128>();
  std::fprintf(stderr, "head size %d: the drivers run 32, 64 and 128\n", c.n);
  std::exit(2);
}

// A forward's outputs into the case directory, as the tests read them.
inline void write_forward_outputs(const std::string& dir, const std::vector<unsigned char>& y,
                                  const std::vector<unsigned char>& final_state,
                                  const std::vector<unsigned char>& checkpoints) {
  write_file(dir + "/y.bin", y);
  write_file(dir + "/final_state.bin", final_state);
  write_file(dir + "/checkpoints.bin", checkpoints);
}

}  // namespace host_cuda
