// The build-default precision as the device compiler saw it; module_cuda.cpp compares it with the host's.
#include "ropewkv/precision.h"

namespace ropewkv::cuda {

int build_precision_seen_by_nvcc() { return static_cast<int>(kBuildPrecision); }

}  // namespace ropewkv::cuda
