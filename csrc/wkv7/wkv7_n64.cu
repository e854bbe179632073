// WKV7 CUDA kernels for head size 64 (one file per head size, so that builds parallelise).
#include "wkv7_kernels.cuh"

namespace ropewkv::cuda {
ROPEWKV_WKV7_INSTANTIATE(64)
}  // namespace ropewkv::cuda
