"""The sequential WKV7 CUDA kernels (csrc/wkv7/wkv7_kernels.cuh: forward_kernel, then backward_kernel from its
checkpoints) run on the host, against the CPU twin (torch.ops.ropewkv.wkv7_forward / wkv7_backward on CPU) and the
fp64 reference's autograd. CUDA cannot run here; this runs the kernels' own code: each block's N threads as concurrent
std::threads with real barriers (tests/data/host_cuda/cuda_block_prelude.h), every block of the grid, built with
AddressSanitizer/UBSan by tests/host_cuda.py. Outputs, gradients and the backward's scratch start NaN-filled. What the
host does not model: tests/test_wkv7_chunked_cuda_on_host.py's docstring.

The backward's scratch layout (row-major since the H100 run of 2026-11-26: the recompute stores rows, the adjoint reads
columns) is what this guards: a mismatch between the two reads the wrong state and fails every gradient by far.

Tolerances (relative RMS) as in tests/test_wkv7_chunked_cuda_on_host.py: fp32 math on every side in different orders
(the forward kernel splits its row sums into 4 partial chains), so fp32 results agree to 2e-6 (measured ~1e-7 ..
4e-7); a 16-bit stored output adds u (its unit roundoff) against fp64 and 0.25 u against the CPU twin, which rounds
nearly the same fp32 values.
"""
import os
import random
import subprocess

import pytest
import torch

import ropewkv  # noqa: F401  (registers torch.ops.ropewkv)
from host_cuda import ROOT, WKV7_CONFIGS as CONFIGS, WKV7_NAMES, as_kernel_sees, build_driver, \
    output_unit_roundoff, read_raw, read_wkv7_gradients, rel_rms, wkv7_cases, write_wkv7_cotangents
from ropewkv._backend import precision_code
from ropewkv.ops.rwkv7.api import _check_decay
from ropewkv.testing.rwkv7 import oracle

FP32_BOUND = 2e-6


@pytest.fixture(scope="session")
def driver(tmp_path_factory) -> str:
    exe = str(tmp_path_factory.mktemp("wkv7_cuda_on_host") / "driver")
    return build_driver("wkv7_cuda_on_host.cpp", exe, [os.path.join(ROOT, "csrc", "wkv7")])


@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_forward_and_backward_kernels_on_host_match_cpu_twin_and_fp64(driver, tmp_path, config):
    dtype, w_fp32, precision = CONFIGS[config]
    seed = random.SystemRandom().randrange(2 ** 31)
    gen = torch.Generator().manual_seed(seed)
    runs = []
    for c, decay, d, x, cu, s0, n_seqs in wkv7_cases(tmp_path, config, gen):
        grad_y, grad_final = write_wkv7_cotangents(d, x, n_seqs, gen)
        runs.append((c, decay, d, x, cu, s0, n_seqs, grad_y, grad_final))
    run = subprocess.run([driver, *(str(r[2]) for r in runs)], capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, f"seed {seed}: {run.stderr[-4000:]}"

    for c, decay, d, x, cu, s0, n_seqs, grad_y, grad_final in runs:
        where = f"{c['name']} {dtype} w_fp32={w_fp32} {precision} {decay} (seed {seed})"
        n, shape = c["n"], x["r"].shape
        state_shape = (n_seqs, c["heads"], n, n)
        got = {"y": read_raw(d / "y.bin", dtype, shape),
               "final_state": read_raw(d / "final_state.bin", torch.float32, state_shape)}
        got.update(read_wkv7_gradients(d, x, n_seqs))
        for name, value in got.items():
            assert not value.isnan().any(), f"{where}: {name} has elements the kernels never wrote"

        args = [x[name] for name in WKV7_NAMES]
        codes = (_check_decay(decay), precision_code(precision))
        twin_y, twin_final, ckpt = torch.ops.ropewkv.wkv7_forward(*args, s0, cu, *codes, True)
        twin_grads = torch.ops.ropewkv.wkv7_backward(grad_y, grad_final, *args, s0, cu, ckpt, *codes)
        twin = {"y": twin_y, "final_state": twin_final, **dict(zip([f"d{n_}" for n_ in WKV7_NAMES], twin_grads))}
        seen = {name: as_kernel_sees(x[name], precision) for name in WKV7_NAMES}
        ref_y, ref_final, ref_grads = oracle({**seen, "initial_state": s0}, decay, as_kernel_sees(grad_y, precision),
                                             grad_final, cu_seqlens=cu)
        ref = {"y": ref_y, "final_state": ref_final, **{f"d{k}": g for k, g in ref_grads.items()}}
        if s0 is not None:
            twin["dinitial_state"] = twin_grads[6]
        for name in twin:
            u = output_unit_roundoff(name, got[name].dtype, precision)
            for what, want, bound in (("cpu twin", twin[name], FP32_BOUND + 0.25 * u),
                                      ("fp64", ref[name], FP32_BOUND + u)):
                err = rel_rms(got[name], want)
                assert err <= bound, f"{where}: {name} vs {what}: relative RMS {err:.3g} > {bound:.3g}"
