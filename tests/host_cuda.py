"""Builds a driver that runs a CUDA kernel on the host: g++ with AddressSanitizer/UBSan over the stand-ins of
tests/data/host_cuda (cuda_prelude.h, cuda_block_prelude.h) and the CUDA headers (for uint4, dim3, cudaError_t).
Used by tests/test_rope_cuda_on_host.py, tests/test_cuda_block_on_host.py and the WKV7 ones
(tests/test_wkv7_cuda_on_host.py, tests/test_wkv7_chunked_cuda_on_host.py: their case directories are written here).
"""
import os
import shutil
import subprocess

import pytest
import torch

from ropewkv._backend import precision_code
from ropewkv.ops.rwkv7.api import _check_decay
from ropewkv.reference.rwkv7 import DECAYS as WKV7_DECAYS
from ropewkv.testing.rwkv7 import GRAD_NAMES

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


def build_driver(source: str, exe: str, include_dirs: list, sanitizers: str = "address,undefined",
                 defines: tuple = ()) -> str:
    """Compiles tests/data/<source> into `exe` with the host stand-ins first on the include path and the macros
    `defines` set; skips without g++. -ffp-contract=off, as the CPU extension's build; sanitizer findings abort the
    run."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found: the host run of a CUDA kernel compiles it with g++ (CI has g++)")
    cmd = ["g++", "-std=c++20", "-O1", "-g0", "-ffp-contract=off", "-fno-strict-aliasing", "-Wall",
           "-Wno-unknown-pragmas", f"-fsanitize={sanitizers}", "-fno-sanitize-recover=all", "-pthread",
           "-I", os.path.join(DATA, "host_cuda")]
    for directory in [*include_dirs, os.path.join(ROOT, "csrc", "include")]:
        cmd += ["-I", directory]
    cmd += ["-isystem", cuda_include_dir(), *(f"-D{name}" for name in defines)]
    build = subprocess.run(cmd + [os.path.join(DATA, source), "-o", exe], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    return exe


# ---- WKV7 case directories (tests/data/host_cuda/wkv7_case.h) --------------------------------------------------------
WKV7_NAMES = GRAD_NAMES[:6]
WKV7_IO = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# (I/O dtype, w in fp32 beside 16-bit r..b, precision) that the drivers instantiate (wkv7_case.h: dispatch_wkv7):
# each storage of w and each precision at least once.
WKV7_CONFIGS = [(torch.float32, False, "fp32"), (torch.float32, False, "bf16"), (torch.bfloat16, False, "fp32"),
                (torch.bfloat16, True, "bf16"), (torch.float16, True, "fp32")]
# Shapes of what a kernel handles per chunk: T not a multiple of 16, cu_seqlens with odd lengths (a 1-token sequence,
# sequences starting and ending inside a chunk), an initial state or none, N = 32, 64 and 128 (the sequential
# backward's sub-chunks: 8 tokens below N = 128, 4 at 128).
WKV7_CASES = [
    dict(name="batch_n64_t37_state", n=64, batch=2, seqlen=37, heads=2, cu=None, initial_state=True),
    dict(name="varlen_n32_state", n=32, batch=1, seqlen=53, heads=2, cu=[0, 5, 6, 21, 40, 53], initial_state=True),
    dict(name="varlen_n64", n=64, batch=1, seqlen=35, heads=1, cu=[0, 19, 35], initial_state=False),
    dict(name="n128_t21_state", n=128, batch=1, seqlen=21, heads=1, cu=None, initial_state=True),
]
UNIT_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def wkv7_cases(directory, config: int, generator):
    """For each WKV7_CASES entry under WKV7_CONFIGS[config]: its inputs drawn (w again at fp32, autocast's layout, where
    the config says so: not a widened 16-bit value) and written into directory/<name> as the drivers read them. Each
    config runs the three decay conventions, one per case. Yields (case, decay, case directory, inputs, cu_seqlens or
    None, initial state or None, sequence count)."""
    from ropewkv.testing.rwkv7 import rwkv7_inputs

    dtype, w_fp32, precision = WKV7_CONFIGS[config]
    for i, case in enumerate(WKV7_CASES):
        decay = WKV7_DECAYS[(i + config) % len(WKV7_DECAYS)]
        shape = (case["batch"], case["seqlen"], case["heads"], case["n"])
        x = rwkv7_inputs(*shape, dtype, decay, generator)
        if w_fp32:
            x["w"] = rwkv7_inputs(*shape, torch.float32, decay, generator)["w"]
        if decay == "loglog":  # decays that underflow to 0: their w's gradient is 0, as the chunked forms must give too
            x["w"][:, 2, :, :3] = 30.0
        cu = None if case["cu"] is None else torch.tensor(case["cu"], dtype=torch.int64)
        n_seqs = case["batch"] if cu is None else len(case["cu"]) - 1
        s0 = torch.randn(n_seqs, *shape[2:], case["n"], generator=generator) if case["initial_state"] else None
        case_dir = directory / case["name"]
        case_dir.mkdir()
        write_wkv7_case(case_dir, x, cu, s0, decay, precision, n_seqs)
        yield case, decay, case_dir, x, cu, s0, n_seqs


def write_wkv7_cotangents(directory, inputs: dict, n_seqs: int, generator, final_state: bool = True):
    """Random cotangents of y and the final state into a case directory (grad_y.bin, grad_final_state.bin: the
    backward drivers' inputs); final_state=False writes none for the state (a zero cotangent, where the driver allows
    it). Returns both (the state's as zeros when not written)."""
    batch, seqlen, heads, n = inputs["r"].shape
    grad_y = torch.randn(inputs["r"].shape, generator=generator).to(inputs["r"].dtype)
    write_raw(grad_y, directory / "grad_y.bin")
    if not final_state:
        return grad_y, torch.zeros(n_seqs, heads, n, n)
    grad_final = torch.randn(n_seqs, heads, n, n, generator=generator)
    write_raw(grad_final, directory / "grad_final_state.bin")
    return grad_y, grad_final


def read_wkv7_gradients(directory, inputs: dict, n_seqs: int) -> dict:
    """A backward driver's gradients, {"dr": ..., "dinitial_state": ...}: each at its input's dtype (fp32 for the
    state)."""
    shape = inputs["r"].shape
    got = {f"d{name}": read_raw(directory / f"grad_{name}.bin", inputs[name].dtype, shape) for name in WKV7_NAMES}
    got["dinitial_state"] = read_raw(directory / "grad_initial_state.bin", torch.float32,
                                     (n_seqs, shape[2], shape[3], shape[3]))
    return got


def output_unit_roundoff(name: str, stored, precision: str) -> float:
    """The unit roundoff of a WKV7 output's last rounding: its storage dtype's, or bf16's where precision="bf16"
    rounds it before storing (y and the gradients of r..b; the states and their gradients stay fp32)."""
    if name in ("final_state", "dinitial_state"):
        return 0.0
    return max(UNIT_ROUNDOFF[stored], UNIT_ROUNDOFF[torch.bfloat16] if precision == "bf16" else 0.0)


def rel_rms(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm())


def as_kernel_sees(x, precision):
    """A WKV7 input as the kernels load it: through bf16 in the bf16 mode (w too: wkv7::kDecayMode)."""
    return x.to(torch.bfloat16).to(x.dtype) if precision == "bf16" else x


def write_raw(tensor, path):
    """A tensor's elements as raw bytes (16-bit dtypes through int16, so numpy need not know bf16)."""
    bits = torch.int32 if tensor.element_size() == 4 else torch.int16
    tensor.contiguous().view(bits).numpy().tofile(path)


def read_raw(path, dtype, shape):
    bits = torch.int32 if dtype.itemsize == 4 else torch.int16
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=bits).view(dtype).view(shape)


def write_wkv7_case(directory, inputs: dict, cu_seqlens, initial_state, decay: str, precision: str, n_seqs: int,
                    save: bool = True):
    """inputs r..b [batch, seqlen, heads, N] (w may be fp32 beside 16-bit r..b) into `directory` as the drivers read
    them."""
    for name in WKV7_NAMES:
        write_raw(inputs[name], directory / f"{name}.bin")
    if cu_seqlens is not None:
        cu_seqlens.to(torch.int64).numpy().tofile(directory / "cu_seqlens.bin")
    if initial_state is not None:
        write_raw(initial_state.float(), directory / "initial_state.bin")
    batch, seqlen, heads, n = inputs["r"].shape
    w_fp32 = inputs["w"].dtype == torch.float32 and inputs["r"].dtype != torch.float32
    fields = (WKV7_IO[inputs["r"].dtype], int(w_fp32), precision_code(precision), _check_decay(decay), n, batch,
              seqlen, heads, n_seqs, int(cu_seqlens is not None), int(initial_state is not None), int(save))
    (directory / "case.txt").write_text(" ".join(str(f) for f in fields) + "\n")
