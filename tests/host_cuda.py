"""Builds a driver that runs a CUDA kernel on the host: g++ with AddressSanitizer/UBSan over the stand-ins of
tests/data/host_cuda (cuda_prelude.h, cuda_block_prelude.h) and the CUDA headers (for uint4, dim3, cudaError_t).
Used by tests/test_rope_cuda_on_host.py and tests/test_cuda_block_on_host.py.
"""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")


def cuda_include_dir() -> str:
    """A directory holding cuda_runtime_api.h: nvcc's, else CUDA_HOME's or /usr/local/cuda's, else the copy that
    Triton's NVIDIA backend ships (a dependency, so present on a machine without the CUDA toolkit too)."""
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        candidates.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include"))
    candidates += [os.path.join(home, "include") for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if home]
    import triton
    candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include"))
    for directory in candidates:
        if os.path.isfile(os.path.join(directory, "cuda_runtime_api.h")):
            return directory
    raise AssertionError(f"no cuda_runtime_api.h in any of {candidates}")


def build_driver(source: str, exe: str, include_dirs: list, sanitizers: str = "address,undefined") -> str:
    """Compiles tests/data/<source> into `exe` with the host stand-ins first on the include path; skips without g++.
    -ffp-contract=off, as the CPU extension's build; sanitizer findings abort the run."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found: the host run of a CUDA kernel compiles it with g++ (CI has g++)")
    cmd = ["g++", "-std=c++20", "-O1", "-g0", "-ffp-contract=off", "-fno-strict-aliasing", "-Wall",
           "-Wno-unknown-pragmas", f"-fsanitize={sanitizers}", "-fno-sanitize-recover=all", "-pthread",
           "-I", os.path.join(DATA, "host_cuda")]
    for directory in [*include_dirs, os.path.join(ROOT, "csrc", "include")]:
        cmd += ["-I", directory]
    cmd += ["-isystem", cuda_include_dir()]
    build = subprocess.run(cmd + [os.path.join(DATA, source), "-o", exe], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    return exe
