// WKV7 CUDA kernels for head size 64, fp32 w beside fp16/bf16 r..b (autocast; see wkv7::DecayStorage).
#include "wkv7_launch.cuh"

namespace ropewkv::cuda {
ROPEWKV_WKV7_INSTANTIATE(64, DecayStorage::kFloat32)
}  // namespace ropewkv::cuda
