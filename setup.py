"""Builds ropewkv: the CPU extension `ropewkv._C` always, the CUDA extension `ropewkv._C_cuda` when possible.

Environment:
  ROPEWKV_CUDA=0|1|auto   build the CUDA extension never / always (fail loudly if impossible) / when possible.
  ROPEWKV_ACCUM=fp32|bf16 the build-default accumulate type (csrc/include/ropewkv/precision.h). The same define
                          reaches the host and the device compiler, so the two halves cannot disagree.
  ROPEWKV_CPU_ARCH=native the -march of the CPU twin (default native: it is built where it runs). Set a portable
                          target (e.g. x86-64-v3) to run the build on other machines, or empty for the compiler's
                          baseline.
  CUDA_HOME               the CUDA toolkit; default: the one the nvcc on PATH belongs to, also behind a wrapper script.
  TORCH_CUDA_ARCH_LIST    the GPU architectures; default: the visible GPUs', else DEFAULT_CUDA_ARCHS.
"""
import glob
import os
import re
import shutil
import subprocess

import setuptools
from setuptools import find_packages, setup

MIN_TORCH = "2.7"  # also python/ropewkv/_backend.py and the README
# Built where no GPU is visible (a build machine, CI): Ampere and Hopper; the PTX of 8.0 lets newer GPUs JIT it.
DEFAULT_CUDA_ARCHS = "8.0+PTX;9.0a"


def _toolkit_of_nvcc():
    """The toolkit folder of the nvcc on PATH. torch guesses nvcc's parent folder, wrong where nvcc is a wrapper script
    (/usr/local/bin/nvcc exec'ing /usr/local/cuda-13.0/bin/nvcc): nvcc -dryrun names its own folder (_HERE_)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        dryrun = subprocess.run([nvcc, "-dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                                capture_output=True, text=True, timeout=60).stderr
    except (OSError, subprocess.SubprocessError):
        return None
    here = re.search(r"^#\$ _HERE_=(.+)$", dryrun, flags=re.M)
    return os.path.dirname(os.path.realpath(here.group(1).strip())) if here else None


def _bdist_wheel_available():
    """Editable installs need bdist_wheel: setuptools >= 70.1 has it, older ones only with the wheel package."""
    major, minor = (int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2])
    if (major, minor) >= (70, 1):
        return True
    try:
        import wheel  # noqa: F401
    except ImportError:
        return False
    return True


if not _bdist_wheel_available():
    raise SystemExit(f"setuptools {setuptools.__version__} builds editable installs only with the `wheel` package: "
                     "pip install wheel (or setuptools>=70.1)")
if not os.environ.get("CUDA_HOME") and not os.environ.get("CUDA_PATH"):
    toolkit = _toolkit_of_nvcc()
    if toolkit:
        os.environ["CUDA_HOME"] = toolkit  # read when torch.utils.cpp_extension is imported, just below

from torch.utils import cpp_extension  # noqa: E402

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
# a*b+c into an fma is off on both compilers (g++ -ffp-contract=off: ISO C++ already implies it, stated so that -march
# cannot change results; nvcc --fmad=false: nvcc fuses by default, which made the CUDA twin differ from the CPU twin
# and from HF's eager fp32 arithmetic): the shared math writes its fmas explicitly. -fopenmp also enables the `#pragma omp simd` loops of the CPU twins. -fno-trapping-math
# changes no value (the floating-point exception flags are never read): without it GCC keeps the selects of exp_poly
# (ropewkv/decay.h) as branches, so no loop that calls it vectorises (-fopt-info-vec: "control flow in loop").
cxx_flags = ["-O3", "-g0", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", *defines]
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
    import torch

    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS  # torch's own default is empty then (IndexError)
    ext_modules.append(
        cpp_extension.CUDAExtension(
            "ropewkv._C_cuda",
            sources=_sources("csrc/*/*_cuda.cpp") + _sources("csrc/*/*.cu"),
            include_dirs=[INCLUDE],
            extra_compile_args={
                "cxx": cxx_flags,
                "nvcc": ["-O3", "--fmad=false", "--expt-relaxed-constexpr", "-lineinfo", *defines],
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
    install_requires=[f"torch>={MIN_TORCH}"],
)
