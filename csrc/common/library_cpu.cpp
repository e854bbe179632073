// The ropewkv op library (schemas of each op family live beside their CPU twins as fragments) and the Python
// module `ropewkv._C`, which carries the build-default precision.
#include <ATen/Parallel.h>
#include <Python.h>
#include <torch/library.h>

#include "ropewkv/decay.h"
#include "ropewkv/rope.h"
#include "ropewkv/torch_glue.h"

namespace ropewkv {
namespace {

// Test hooks for the storage conversions every kernel relies on: fp32 -> bf16/fp16 via our narrow<T>, and back.
at::Tensor narrow_to_cpu(const at::Tensor& x_in, at::ScalarType dtype) {
  TORCH_CHECK_TYPE(x_in.scalar_type() == at::kFloat, "x must be float32, got ", x_in.scalar_type());
  TORCH_CHECK_VALUE(dtype == at::kHalf || dtype == at::kBFloat16, "dtype must be float16 or bfloat16, got ", dtype);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(dtype));
  AT_DISPATCH_REDUCED_FLOATING_TYPES(dtype, "narrow_to_cpu", [&] {
    using io_t = storage_t<scalar_t>;
    const float* src = x.const_data_ptr<float>();
    io_t* dst = storage_ptr<scalar_t>(out);
    at::parallel_for(0, x.numel(), 1 << 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) dst[i] = narrow<io_t>(src[i]);
    });
  });
  return out;
}

at::Tensor widen_cpu(const at::Tensor& x_in) {
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "widen_cpu", [&] {
    const storage_t<scalar_t>* src = storage_ptr<scalar_t>(x);
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, x.numel(), 1 << 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) dst[i] = widen(src[i]);
    });
  });
  return out;
}

// Test hooks for the host's branch-free math (exp_poly, sincos_poly): elementwise over an fp32 tensor.
template <typename F>
at::Tensor elementwise_fp32(const at::Tensor& x_in, int64_t outputs, F&& f) {
  TORCH_CHECK_TYPE(x_in.scalar_type() == at::kFloat, "x must be float32, got ", x_in.scalar_type());
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({outputs, x.numel()}, x.options());
  const float* src = x.const_data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t n = x.numel();
  at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) f(src[i], dst + i, dst + n + i);
  });
  return out;
}

at::Tensor host_exp_cpu(const at::Tensor& x) {
  return elementwise_fp32(x, 1, [](float v, float* e, float*) { *e = exp_poly(v); });
}

at::Tensor host_sincos_cpu(const at::Tensor& r) {
  return elementwise_fp32(r, 2, [](float v, float* s, float* c) { rope::sincos_poly(v, s, c); });
}

}  // namespace

TORCH_LIBRARY(ropewkv, m) {
  m.def("_narrow_to(Tensor x, ScalarType dtype) -> Tensor");
  m.def("_widen(Tensor x) -> Tensor");
  m.def("_host_exp(Tensor x) -> Tensor");
  m.def("_host_sincos(Tensor r) -> Tensor");
}

TORCH_LIBRARY_IMPL(ropewkv, CPU, m) {
  m.impl("_narrow_to", &narrow_to_cpu);
  m.impl("_widen", &widen_cpu);
  m.impl("_host_exp", &host_exp_cpu);
  m.impl("_host_sincos", &host_sincos_cpu);
}

}  // namespace ropewkv

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "ropewkv CPU twin; ops live in torch.ops.ropewkv",
                                   -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  const char* precision = ropewkv::kBuildPrecision == ropewkv::Precision::kBF16 ? "bf16" : "fp32";
  if (PyModule_AddStringConstant(module, "build_precision", precision) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
