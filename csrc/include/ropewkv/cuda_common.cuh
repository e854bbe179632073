#pragma once
// Shared by the .cu files: dtype dispatch over our storage types, and launch-status plumbing. Torch-free.
#include <cuda_runtime_api.h>

#include "ropewkv/precision.h"

namespace ropewkv::cuda {

// Calls launch(io_t{}) for the storage type named by `dtype`, then returns the launch status.
template <typename F>
cudaError_t dispatch_io(DType dtype, F&& launch) {
  switch (dtype) {
    case DType::kFloat32:
      launch(float{});
      break;
    case DType::kFloat16:
      launch(fp16_t{});
      break;
    case DType::kBFloat16:
      launch(bf16_t{});
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace ropewkv::cuda
