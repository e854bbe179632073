// WKV7 CUDA kernels for head size 256 (one file per head size, so that builds parallelise).
#include "wkv7_kernels.cuh"

namespace ropewkv::cuda {
ROPEWKV_WKV7_INSTANTIATE(256)
}  // namespace ropewkv::cuda
