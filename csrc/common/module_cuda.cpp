// The Python module `ropewkv._C_cuda`. Loading it registers the CUDA impls of every op (TORCH_LIBRARY_IMPL in the
// *_cuda.cpp glue). It refuses to load if nvcc and the host compiler saw different build-default precisions.
#include <Python.h>

#include "ropewkv/precision.h"

namespace ropewkv::cuda {
int build_precision_seen_by_nvcc();
}

extern "C" PyObject* PyInit__C_cuda(void) {
  const int host = static_cast<int>(ropewkv::kBuildPrecision);
  const int device = ropewkv::cuda::build_precision_seen_by_nvcc();
  if (host != device) {
    PyErr_Format(PyExc_ImportError,
                 "ropewkv._C_cuda was built with ROPEWKV_ACCUM_BF16 seen differently by the host compiler (%d) and "
                 "nvcc (%d); rebuild with ROPEWKV_ACCUM set for both (setup.py does this)",
                 host, device);
    return nullptr;
  }
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C_cuda",
                                   "ropewkv CUDA twin; ops live in torch.ops.ropewkv", -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  if (PyModule_AddStringConstant(module, "build_precision", host ? "bf16" : "fp32") != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
