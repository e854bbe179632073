"""The chunked WKV7 CUDA kernels run on the host: the forward (csrc/wkv7/wkv7_chunked_kernels.cuh) against the CPU
chunked twin (torch.ops.ropewkv.wkv7_chunked_forward on CPU: y and the final state), the CPU sequential twin (the
checkpoints: the CUDA chunked forward keeps the sequential ops' grid, while the CPU chunked twin aligns its chunks to
each sequence's end) and the fp64 reference; then the backward's two passes (wkv7_chunked_backward_kernels.cuh) from
those checkpoints, every gradient against the CPU sequential twin's and fp64 autograd. CUDA cannot run here; this runs
the kernels' own code: each block's 128 threads as concurrent std::threads with real barriers and warp shuffles
(tests/data/host_cuda/cuda_block_prelude.h; the gradients kernel's dynamic shared memory NaN-filled before each
block), every block of each grid (sequence x head x value slice; 16-token window x head), built by tests/host_cuda.py
with AddressSanitizer/UBSan (an access past a buffer stops the run). Not covered: the device-only code of
ropewkv/precision.h and decay.h (the hardware bf16/fp16 conversions, which round as the host's software ones for every
finite value; expf, which the host replaces with the CPU twin's exp_poly: both within ~1 ulp).

Shapes cover what the kernel handles per chunk: T not a multiple of 16, cu_seqlens with odd lengths (a sequence of
1 token, sequences starting and ending inside a chunk, so short first and last chunks), an initial state or none,
several value slices (N = 64: 2 blocks per head), the three decay conventions, fp32/bf16/fp16 I/O, fp32 w beside
16-bit r..b, precision fp32 and bf16. Outputs start NaN-filled: an element the kernel never writes fails, and the
checkpoint slots no sequence starts a chunk in must stay NaN.

Tolerances (relative RMS, ||out - ref|| / ||ref||). fp32 math on both sides, in different orders (the CPU twin
blocks its products and forms E as running products from each row down; the kernel sums over k in shuffled partial
sums and forms the scaling decays as prefix/suffix products), so fp32 outputs agree to fp32 rounding accumulated over
a chunk's sums: measured 0.8e-7 .. 1.7e-7 against both (y, final state, checkpoints); bound 2e-6 (the "1e-6 class",
10x the measured). A stored 16-bit y adds its rounding to nearest, ~0.4 u relative RMS (u = 2^-8 bf16, 2^-11 fp16,
the unit roundoff; measured against fp64 1.7e-3 bf16, 2.1e-4 fp16): bound 1.0 u on top. The CPU twin rounds nearly the
same fp32 value, so most of its elements agree exactly and a few differ by an ulp, each flip ~1e-5 of these small
tensors' norm (measured 1e-9 .. 2e-5): bound 0.25 u on top (1e-3 bf16, 1.2e-4 fp16), which a wrong decay or a
missing term exceeds by orders of magnitude. The gradients take the same bounds against the CPU sequential twin and
fp64, u being the unit roundoff of their storage, or bf16's in precision="bf16": measured 1.5e-7 .. 4.7e-7 with fp32
storage, the 16-bit ones at their rounding (1.7e-3 bf16, 2.1e-4 fp16 against fp64).
Mutation: the masked products' decay cotangent with its sign flipped gives dw 3.9 relative RMS.

precision="bf16" runs the tensor-core forms (the forward's and the state pass's MmaSlice, the gradients kernel's row
products and contractions): on the host each mma.sync is formed from the same register fragments, gathered from the
warp's lanes (ropewkv/mma_bf16.cuh, itself held to the PTX ISA's fragment table by test_mma_bf16_on_host.py), so the
fragments as the kernel builds them are checked here; that the hardware agrees is checked on a GPU (the CUDA parity
rows). Its split
products add up to SPLIT_PRODUCT_RMS (2^-16) to the fp32 bound (measured: states 2.0e-6 .. 2.6e-6 against the CPU twin
where fp32 math gives ~1.5e-7); products that drop their lo halves (one bf16 product each) give 2.9e-4 .. 5.4e-4.
"""
import math
import os
import random
import subprocess

import pytest
import torch

import ropewkv  # noqa: F401  (registers torch.ops.ropewkv)
from host_cuda import ROOT, UNIT_ROUNDOFF, WKV7_CONFIGS as CONFIGS, WKV7_NAMES, as_kernel_sees, build_driver, \
    output_unit_roundoff, read_raw, read_wkv7_gradients, rel_rms, wkv7_cases, write_wkv7_cotangents
from ropewkv._backend import precision_code
from ropewkv.ops.rwkv7.api import _check_decay
from ropewkv.reference.rwkv7 import wkv7 as reference_wkv7
from ropewkv.testing.rwkv7 import SPLIT_PRODUCT_RMS, oracle

FP32_BOUND = 2e-6


@pytest.fixture(scope="session")
def driver(tmp_path_factory) -> str:
    exe = str(tmp_path_factory.mktemp("wkv7_chunked_cuda_on_host") / "driver")
    return build_driver("wkv7_chunked_cuda_on_host.cpp", exe, [os.path.join(ROOT, "csrc", "wkv7")])


def _written_slots(c):
    """The checkpoint slots [batch, chunk] the forward writes: every chunk start aligned to 16 inside a sequence."""
    chunks = math.ceil(c["seqlen"] / 16)
    written = torch.zeros(c["batch"], chunks, dtype=torch.bool)
    bounds = c["cu"] or [0, c["seqlen"]]
    for start, end in zip(bounds[:-1], bounds[1:]):
        for q in range(start, end):
            if q % 16 == 0:
                written[:, q // 16] = True
    return written


@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_cuda_kernel_on_host_matches_cpu_twin_and_fp64(driver, tmp_path, config):
    dtype, w_fp32, precision = CONFIGS[config]
    seed = random.SystemRandom().randrange(2 ** 31)
    gen = torch.Generator().manual_seed(seed)
    runs = []
    for c, decay, d, x, cu, s0, n_seqs in wkv7_cases(tmp_path, config, gen):
        # No initial state, no final-state cotangent either: the kernels' null-pointer paths (zeros).
        grad_y, grad_final = write_wkv7_cotangents(d, x, n_seqs, gen, final_state=s0 is not None)
        runs.append((c, decay, d, x, cu, s0, n_seqs, grad_y, grad_final))
    run = subprocess.run([driver, *(str(r[2]) for r in runs)], capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, f"seed {seed}: {run.stderr[-4000:]}"

    for c, decay, d, x, cu, s0, n_seqs, grad_y, grad_final in runs:
        where = f"{c['name']} {dtype} w_fp32={w_fp32} {precision} {decay} (seed {seed})"
        n, chunks = c["n"], math.ceil(c["seqlen"] / 16)
        shape = (c["batch"], c["seqlen"], c["heads"], n)
        y = read_raw(d / "y.bin", dtype, shape)
        final = read_raw(d / "final_state.bin", torch.float32, (n_seqs, c["heads"], n, n))
        ckpt = read_raw(d / "checkpoints.bin", torch.float32, (c["batch"], chunks, c["heads"], n, n))
        assert not y.isnan().any(), f"{where}: y has elements the kernel never wrote"
        assert not final.isnan().any(), f"{where}: final state not written"
        written = _written_slots(c)
        assert not ckpt[written].isnan().any(), f"{where}: checkpoint slots not written"
        assert ckpt[~written].isnan().all(), f"{where}: wrote a checkpoint slot no chunk starts in"

        args = [x[name] for name in ("r", "w", "k", "v", "a", "b")]
        twin_y, twin_final, _ = torch.ops.ropewkv.wkv7_chunked_forward(
            *args, s0, cu, _check_decay(decay), precision_code(precision), False)
        _, _, sequential_ckpt = torch.ops.ropewkv.wkv7_forward(*args, s0, cu, _check_decay(decay),
                                                                precision_code(precision), True)
        ref_y, ref_final = reference_wkv7(*(as_kernel_sees(t, precision) for t in args), initial_state=s0,
                                          output_final_state=True, cu_seqlens=cu, decay=decay, dtype=torch.float64)
        y_dtype = torch.bfloat16 if precision == "bf16" and dtype != torch.bfloat16 else dtype
        u = max(UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[y_dtype])
        fp32 = FP32_BOUND + (SPLIT_PRODUCT_RMS if precision == "bf16" else 0)  # the bf16 mode's tensor-core products
        for what, got, want, bound in (
                ("y vs cpu twin", y, twin_y, fp32 + 0.25 * u), ("y vs fp64", y, ref_y, fp32 + u),
                ("final state vs cpu twin", final, twin_final, fp32), ("final state vs fp64", final, ref_final, fp32),
                ("checkpoints vs cpu sequential twin", ckpt[written], sequential_ckpt[written], fp32)):
            err = rel_rms(got, want)
            assert err <= bound, f"{where}: {what} relative RMS {err:.3g} > {bound:.3g}"
        _check_backward(where, c, decay, d, x, cu, s0, n_seqs, grad_y, grad_final, precision)


def _check_backward(where, c, decay, d, x, cu, s0, n_seqs, grad_y, grad_final, precision):
    """The backward's gradients against the CPU sequential twin's (its own forward's checkpoints) and fp64 autograd:
    fp32 math on every side, so FP32_BOUND (plus SPLIT_PRODUCT_RMS in precision="bf16", whose gradients kernel runs
    its row products and contractions as split tensor-core products), plus the unit roundoff of a gradient's last
    rounding."""
    got = read_wkv7_gradients(d, x, n_seqs)
    for name, value in got.items():
        assert not value.isnan().any(), f"{where}: {name} has elements the backward never wrote"
    args = [x[name] for name in WKV7_NAMES]
    codes = (_check_decay(decay), precision_code(precision))
    _, _, ckpt = torch.ops.ropewkv.wkv7_forward(*args, s0, cu, *codes, True)
    twin = dict(zip([f"d{name}" for name in WKV7_NAMES] + ["dinitial_state"],
                    torch.ops.ropewkv.wkv7_backward(grad_y, grad_final, *args, s0, cu, ckpt, *codes)))
    seen = {name: as_kernel_sees(x[name], precision) for name in WKV7_NAMES}
    _, _, ref = oracle({**seen, "initial_state": s0}, decay, as_kernel_sees(grad_y, precision), grad_final,
                       cu_seqlens=cu)
    ref = {f"d{name}": g for name, g in ref.items()}  # no dinitial_state without an initial state
    fp32 = FP32_BOUND + (SPLIT_PRODUCT_RMS if precision == "bf16" else 0)
    for name, value in got.items():
        u = output_unit_roundoff(name, value.dtype, precision)
        for what, want, bound in (("cpu twin", twin[name], fp32 + 0.25 * u), ("fp64", ref.get(name), fp32 + u)):
            if want is None:
                continue
            err = rel_rms(value, want)
            assert err <= bound, f"{where}: {name} vs {what}: relative RMS {err:.3g} > {bound:.3g}"
