// Chunked WKV7 forward CUDA kernels for head size 128, w at r..b's type and fp32 w beside fp16/bf16 r..b.
#include "wkv7_chunked_launch.cuh"

namespace ropewkv::cuda {
ROPEWKV_WKV7_CHUNKED_INSTANTIATE(128)
}  // namespace ropewkv::cuda
