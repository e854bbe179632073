"""Builds ropewkv: the CPU extension `ropewkv._C` always, the CUDA extension `ropewkv._C_cuda` when possible.

Environment:
  ROPEWKV_CUDA=0|1|auto   build the CUDA extension never / always (fail loudly if impossible) / when possible.
  ROPEWKV_ACCUM=fp32|bf16 the build-default accumulate type (csrc/include/ropewkv/precision.h). The same define
                          reaches the host and the device compiler, so the two halves cannot disagree.
  ROPEWKV_CPU_ARCH=native the -march of the CPU twin (default native: it is built where it runs). Set a portable
                          target (e.g. x86-64-v3) to run the build on other machines, or empty for the compiler's
                          baseline.
"""
import glob
import os
import shutil

from setuptools import find_packages, setup

from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.path.join(ROOT, "csrc", "include")


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


def _precision_defines():
    accum = os.environ.get("ROPEWKV_ACCUM", "fp32")
    if accum not in ("fp32", "bf16"):
        raise SystemExit(f"ROPEWKV_ACCUM must be 'fp32' or 'bf16', got {accum!r}")
    return ["-DROPEWKV_ACCUM_BF16"] if accum == "bf16" else []


def _cuda_wanted():
    mode = os.environ.get("ROPEWKV_CUDA", "auto")
    if mode not in ("0", "1", "auto"):
        raise SystemExit(f"ROPEWKV_CUDA must be 0, 1 or auto, got {mode!r}")
    if mode == "0":
        return False
    problems = []
    if getattr(__import__("torch").version, "cuda", None) is None:
        problems.append("the installed torch is a CPU build (torch.version.cuda is None)")
    if cpp_extension.CUDA_HOME is None and shutil.which("nvcc") is None:
        problems.append("no CUDA toolkit found (CUDA_HOME unset and no nvcc on PATH)")
    if problems and mode == "1":
        raise SystemExit("ROPEWKV_CUDA=1 but the CUDA extension cannot be built: " + "; ".join(problems))
    return not problems


def _cpu_arch_flags():
    arch = os.environ.get("ROPEWKV_CPU_ARCH", "native")
    return [f"-march={arch}"] if arch else []


defines = _precision_defines()
# No -ffast-math / --use_fast_math anywhere: the point of the package is precision (TE does the same). Contraction of
# a*b+c into an fma is off (ISO C++ already implies it; stated so that -march cannot change results): the shared math
# writes its fmas explicitly. -fopenmp also enables the `#pragma omp simd` loops of the CPU twins.
cxx_flags = ["-O3", "-g0", "-fopenmp", "-ffp-contract=off", *defines]
ext_modules = [
    cpp_extension.CppExtension(
        "ropewkv._C",
        sources=_sources("csrc/*/*_cpu.cpp"),
        include_dirs=[INCLUDE],
        extra_compile_args={"cxx": [*cxx_flags, *_cpu_arch_flags()]},
        extra_link_args=["-fopenmp"],
    )
]
if _cuda_wanted():
    ext_modules.append(
        cpp_extension.CUDAExtension(
            "ropewkv._C_cuda",
            sources=_sources("csrc/*/*_cuda.cpp") + _sources("csrc/*/*.cu"),
            include_dirs=[INCLUDE],
            extra_compile_args={
                "cxx": cxx_flags,
                "nvcc": ["-O3", "--expt-relaxed-constexpr", "-lineinfo", *defines],
            },
        )
    )

setup(
    name="ropewkv",
    version="0.1.0",
    description="Precise fused RoPE and RWKV-7 kernels for PyTorch (Triton, CUDA, CPU)",
    package_dir={"": "python", "ropewkv.triton_kernels": "triton_kernels"},
    package_data={"ropewkv.hub.rotary": ["metadata.json"]},  # the kernel-hub layout kernels' loader reads
    packages=find_packages("python") + ["ropewkv.triton_kernels"]
    + ["ropewkv.triton_kernels." + name for name in find_packages("triton_kernels")],
    ext_modules=ext_modules,
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    python_requires=">=3.10",
)
