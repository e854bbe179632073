// Chunked WKV7 backward CUDA kernels for head size 32, w at r..b's type and fp32 w beside fp16/bf16 r..b.
#include "wkv7_chunked_backward_launch.cuh"

namespace ropewkv::cuda {
ROPEWKV_WKV7_CHUNKED_BACKWARD_INSTANTIATE(32)
}  // namespace ropewkv::cuda
