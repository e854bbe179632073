// Runs the RoPE CUDA kernel (csrc/rope/rope_kernel.cuh) on the host: every thread of every block, one after another.
// Driven by tests/test_rope_cuda_on_host.py; each argument is a case directory holding
//   case.txt: dtype (0 fp32, 1 bf16, 2 fp16) precision (0 fp32, 1 bf16) interleaved conjugate in_place has_k
//             has_offsets batch seqlen hq hk head_dim rot_half head_stride offset groups attention_scaling
//   q.bin, k.bin: [offset + batch * seqlen * heads * head_stride] elements (the tensor at element `offset` of a
//             16-byte aligned buffer, [batch, seqlen, heads, head_stride] contiguous, dims past head_dim padding)
//   inv_freq.bin: fp32 [rot_half]; offsets.bin: int64 [batch] (seqlen_offsets)
// and gets q_out.bin, k_out.bin (the output buffers, laid out as the inputs: out of place they start NaN-filled) and
// q_after.bin, k_after.bin (the input buffers after the run), and plan.txt: the vector width and the head groups.
// groups: 0 runs the thread map of rope_launch; g > 0 lowers its thread target so that it picks min(g, heads) groups.
#include "cuda_prelude.h"
#include "driver_files.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <new>
#include <string>
#include <vector>

#include "rope_kernel.cuh"  // csrc/rope/

namespace {

using namespace ropewkv;
using namespace ropewkv::cuda;

using host_cuda::read_file;
using host_cuda::write_file;

// A 16-byte aligned copy, exactly as long (AddressSanitizer then sees an access past its end).
unsigned char* aligned_copy(const std::vector<unsigned char>& from) {
  auto* to = static_cast<unsigned char*>(::operator new[](from.size(), std::align_val_t(16)));
  std::memcpy(to, from.data(), from.size());
  return to;
}

template <typename io_t, Precision P, bool VECTOR, bool INTERLEAVED>
void run_threads(const rope::Params& p, const rope::ThreadMap& m) {
  const int64_t blocks = (m.threads + kRopeThreads - 1) / kRopeThreads;
  gridDim.x = unsigned(blocks);
  blockDim.x = kRopeThreads;
  for (int64_t b = 0; b < blocks; ++b) {
    blockIdx.x = unsigned(b);
    for (unsigned t = 0; t < unsigned(kRopeThreads); ++t) {
      threadIdx.x = t;
      rope_kernel<io_t, P, VECTOR, INTERLEAVED>(p, m);
    }
  }
}

template <typename io_t, Precision P>
void run_instantiation(const rope::Params& p, const RopeLaunchPlan& plan) {
  if (plan.vec > 0) {
    p.interleaved ? run_threads<io_t, P, true, true>(p, plan.map) : run_threads<io_t, P, true, false>(p, plan.map);
  } else {
    p.interleaved ? run_threads<io_t, P, false, true>(p, plan.map) : run_threads<io_t, P, false, false>(p, plan.map);
  }
}

template <typename io_t>
void run(const rope::Params& p, const RopeLaunchPlan& plan, int precision) {
  if (precision == 1) {
    run_instantiation<io_t, Precision::kBF16>(p, plan);
  } else {
    run_instantiation<io_t, Precision::kFP32>(p, plan);
  }
}

void run_case(const std::string& dir) {
  std::ifstream params(dir + "/case.txt");
  int dtype, precision, interleaved, conjugate, in_place, has_k, has_offsets;
  int64_t batch, seqlen, hq, hk, head_dim, rot_half, head_stride, offset, groups;
  float scaling;
  if (!(params >> dtype >> precision >> interleaved >> conjugate >> in_place >> has_k >> has_offsets >> batch >>
        seqlen >> hq >> hk >> head_dim >> rot_half >> head_stride >> offset >> groups >> scaling)) {
    std::fprintf(stderr, "bad %s/case.txt\n", dir.c_str());
    std::exit(2);
  }
  const int64_t element = dtype == 0 ? 4 : 2;
  rope::Params p;
  p.batch = batch;
  p.seqlen = seqlen;
  p.hq = hq;
  p.hk = has_k ? hk : 0;
  p.head_dim = head_dim;
  p.rot_half = rot_half;
  p.interleaved = interleaved != 0;
  p.conjugate = conjugate != 0;
  p.attention_scaling = scaling;
  const std::vector<unsigned char> inv_freq = read_file(dir + "/inv_freq.bin");
  const std::vector<unsigned char> offsets =
      has_offsets ? read_file(dir + "/offsets.bin") : std::vector<unsigned char>{};
  p.inv_freq = reinterpret_cast<const float*>(inv_freq.data());
  p.offsets = has_offsets ? reinterpret_cast<const int64_t*>(offsets.data()) : nullptr;

  const std::vector<unsigned char> q_in = read_file(dir + "/q.bin");
  const std::vector<unsigned char> k_in = has_k ? read_file(dir + "/k.bin") : std::vector<unsigned char>{};
  unsigned char* q = aligned_copy(q_in);
  unsigned char* k = has_k ? aligned_copy(k_in) : nullptr;
  unsigned char* q_out = in_place ? q : aligned_copy(std::vector<unsigned char>(q_in.size(), 0xff));  // NaN
  unsigned char* k_out = !has_k ? nullptr : in_place ? k : aligned_copy(std::vector<unsigned char>(k_in.size(), 0xff));
  const auto set_strides = [&](int64_t* stride, int64_t heads) {
    stride[2] = head_stride;
    stride[1] = heads * head_stride;
    stride[0] = seqlen * stride[1];
  };
  set_strides(p.q_stride, hq);
  set_strides(p.qo_stride, hq);
  set_strides(p.k_stride, hk);
  set_strides(p.ko_stride, hk);
  p.q = q + offset * element;
  p.q_out = q_out + offset * element;
  p.k = has_k ? k + offset * element : nullptr;
  p.k_out = has_k ? k_out + offset * element : nullptr;

  RopeLaunchPlan plan = plan_rope_launch(p, element);
  if (groups > 0) plan = plan_rope_launch(p, element, groups * batch * seqlen * plan.map.units);
  if (dtype == 0) {
    run<float>(p, plan, precision);
  } else if (dtype == 1) {
    run<bf16_t>(p, plan, precision);
  } else {
    run<fp16_t>(p, plan, precision);
  }
  write_file(dir + "/q_out.bin", q_out, q_in.size());
  write_file(dir + "/q_after.bin", q, q_in.size());
  if (has_k) {
    write_file(dir + "/k_out.bin", k_out, k_in.size());
    write_file(dir + "/k_after.bin", k, k_in.size());
  }
  std::ofstream(dir + "/plan.txt") << plan.vec << " " << plan.map.groups << " " << plan.map.threads << "\n";
  for (unsigned char* buffer : {q, k, in_place ? nullptr : q_out, in_place ? nullptr : k_out}) {
    if (buffer != nullptr) ::operator delete[](buffer, std::align_val_t(16));
  }
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) run_case(argv[i]);
  return 0;
}
