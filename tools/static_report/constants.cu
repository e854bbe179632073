// Prints, as JSON, the launch constants of the WKV7 CUDA kernels that tools/static_report/model.py needs, so that the
// model reads them instead of restating them: per head size the threads per block of the sequential forward and
// backward, the backward's columns per thread and sub-chunk, the chunked forward's value slice per precision mode, the
// chunked backward's value rows per pass and dynamic shared memory (its gradients kernel) and the chunked kernels'
// masked-product trips per precision mode (kMaskedBlock + 1) and the trips of its row products' loop over k (0: no
// loop, unrolled in full); the unroll of the backward's column sums. Host code only (no kernel is launched): it runs
// without a GPU.
#include <cstdio>

#include "wkv7/wkv7_chunked_backward_kernels.cuh"
#include "wkv7/wkv7_kernels.cuh"

namespace {

using namespace ropewkv;
using namespace ropewkv::cuda;

template <int N>
int row_product_trips() {
  using Rows = wkv7_chunked_detail::GradientRows<N>;
  return Rows::kGroupUnroll < Rows::kGroups ? Rows::kGroups / Rows::kGroupUnroll : 0;
}

template <int N>
void print_head_size(const char* separator) {
  std::printf("\"%d\": {\"forward_threads\": %d, \"backward_threads\": %d, \"backward_cols\": %d, \"sub_chunk\": %d, "
              "\"chunked_value_slice\": %d, \"chunked_value_slice_bf16\": %d, \"chunked_gradient_rows\": %d, "
              "\"chunked_gradient_shared\": %d, \"chunked_masked_trips\": %d, \"chunked_masked_trips_bf16\": %d, "
              "\"chunked_row_product_trips\": %d}%s",
              N, wkv7_detail::ForwardLanes<N>::kThreads, wkv7_detail::BackwardLanes<N>::kThreads,
              wkv7_detail::BackwardLanes<N>::kCols, wkv7_backward_sub_chunk(N),
              wkv7_chunked_detail::kValueSlice<N, Precision::kFP32>,
              wkv7_chunked_detail::kValueSlice<N, Precision::kBF16>, wkv7_chunked_detail::GradientRows<N>::kRows,
              int(sizeof(wkv7_chunked_detail::GradientShared<N>)),
              wkv7_chunked_detail::kMaskedBlock<N, Precision::kFP32> + 1,
              wkv7_chunked_detail::kMaskedBlock<N, Precision::kBF16> + 1, row_product_trips<N>(), separator);
}

}  // namespace

int main() {
  std::printf("{\"column_unroll\": %d, \"chunked_threads\": %d, \"head_sizes\": {", wkv7_detail::kColumnUnroll,
              wkv7_chunked_detail::kThreads);
  print_head_size<32>(", ");
  print_head_size<64>(", ");
  print_head_size<128>("");
  std::printf("}}\n");
  return 0;
}
