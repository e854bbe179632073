// WKV7 CUDA kernels for head size 64, w at r..b's type (one file per head size and w storage: builds parallelise).
#include "wkv7_launch.cuh"

namespace ropewkv::cuda {
ROPEWKV_WKV7_INSTANTIATE(64, DecayStorage::kIO)
}  // namespace ropewkv::cuda
