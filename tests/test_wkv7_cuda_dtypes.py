"""The CUDA WKV7 twin reads w at its own dtype (issue 13 item 1), checked without a GPU.

The bug this guards: the CUDA kernels read an fp32 w beside bf16 r..b as bf16 (one kernel type for all six inputs),
so the decay came out as garbage. Now w's storage is a template argument of every kernel (wkv7::DecayStorage), the
glue picks it with wkv7::decay_storage_of and refuses any other mix. Checked here: that function's table (compiled
for the host with g++, the header being torch- and CUDA-free), and the kernels one head size's two .cu files
instantiate (compiled with nvcc, names read from ptxas): every (r..b dtype, w dtype, precision) pair the glue can
pick exists, with w at the type the glue means, and nothing else. The GPU tests of the twins' mixed-dtype agreement
are in tests/test_wkv7_conventions.py.
"""
import itertools
import os
import re
import shutil
import subprocess

import pytest

from tools.static_report import cuda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"kFloat32": "float", "kFloat16": "fp16_t", "kBFloat16": "bf16_t"}  # DType -> the kernels' storage type

TABLE_PROGRAM = r"""
#include <cstdio>
#include "ropewkv/wkv7.h"
using ropewkv::DType;
int main() {
  const DType types[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  for (DType io : types) {
    for (DType w : types) {
      ropewkv::wkv7::DecayStorage storage;
      const bool ok = ropewkv::wkv7::decay_storage_of(io, w, storage);
      std::printf("%d %d %d\n", int(io), int(w), ok ? int(storage) : -1);
    }
  }
}
"""


def expected_storage(io: str, w: str) -> str | None:
    """What the CUDA twin should do with w of dtype `w` beside r..b of dtype `io` (both DType names)."""
    if w == io:
        return "kIO"
    if w == "kFloat32":
        return "kFloat32"
    return None  # the glue raises TypeError


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (the CPU extension's build needs it anyway)")
def test_decay_storage_table(tmp_path):
    source = tmp_path / "table.cpp"
    source.write_text(TABLE_PROGRAM)
    subprocess.run(["g++", "-std=c++20", "-I", os.path.join(ROOT, "csrc", "include"), str(source), "-o",
                    str(tmp_path / "table")], check=True)
    out = subprocess.run([str(tmp_path / "table")], capture_output=True, text=True, check=True).stdout
    names = list(DTYPES)  # in DType's order
    storages = {-1: None, 0: "kIO", 1: "kFloat32"}
    got = {(names[io], names[w]): storages[s] for io, w, s in (map(int, line.split()) for line in out.splitlines())}
    assert got == {(io, w): expected_storage(io, w) for io, w in itertools.product(names, names)}


@pytest.mark.skipif(cuda.nvcc() is None, reason="nvcc not found: the CUDA kernels cannot be compiled here (CI and "
                    "the GPU machine have it)")
def test_kernels_are_instantiated_for_every_dtype_pair():
    names = []
    for source in ("csrc/wkv7/wkv7_n32.cu", "csrc/wkv7/wkv7_n32_wf32.cu"):
        _, log = cuda.compile_cubin(ROOT, source)
        names += cuda.readable_names(re.findall(r"Compiling entry function '(\w+)'", log), cuda.enum_names(ROOT))
    expected = sorted(f"{kernel}<32, {DTYPES[io]}, {DTYPES[w]}, {precision}>"
                      for kernel in ("forward_kernel", "backward_kernel", "step_kernel")
                      for io, w in itertools.product(DTYPES, DTYPES) if expected_storage(io, w)
                      for precision in ("kFP32", "kBF16"))
    assert sorted(names) == expected
