"""RWKV-7 inputs that do not blow up, as every working harness draws them (FLA #150: naive rand gives NaN).

  - the decay pre-activation x ~ U(-6, 2), so d = exp(-e^{-0.5} sigmoid(x)) spans (0.58, 0.9985): from fast decays
    to the near-1 decays that make fp32 state necessary. w is x itself ("raw"), -softplus(-x) - 0.5 ("loglog", the
    same decay), or -e^{-0.5} sigmoid(x) ("log");
  - kk = normalize(randn) per head, a = -kk, b = kk * lambda with lambda ~ U(0, 1) (the model's a-gate);
  - r, k, v ~ randn; the initial state ~ randn.
Everything is drawn in fp64 and then rounded to the I/O dtype, so that the fp64 oracle sees the same inputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._backend import compute_dtype
from ..reference.rwkv7 import EXP_MINUS_HALF


def decay_w(x: torch.Tensor, decay: str) -> torch.Tensor:
    """The w argument, in convention `decay`, for the raw pre-activation x (fp64)."""
    if decay == "raw":
        return x
    if decay == "loglog":
        return -F.softplus(-x) - 0.5
    if decay == "log":
        return -EXP_MINUS_HALF * torch.sigmoid(x)
    raise ValueError(f"unknown decay {decay!r}")


def rwkv7_inputs(batch: int, seqlen: int, heads: int, head_size: int, dtype: torch.dtype = torch.float32,
                 decay: str = "loglog", generator: torch.Generator = None, device="cpu",
                 initial_state: bool = False) -> dict:
    """{"r","w","k","v","a","b": [B, T, H, N] in dtype, "initial_state": fp32 [B, H, N, N] or None}."""
    shape = (batch, seqlen, heads, head_size)

    def draw(low=None, high=None):
        x = torch.randn(shape, dtype=torch.float64, generator=generator)
        if low is not None:
            x = low + (high - low) * torch.rand(shape, dtype=torch.float64, generator=generator)
        return x

    x = draw(-6.0, 2.0)
    kk = F.normalize(draw(), dim=-1)
    a_gate = draw(0.0, 1.0)
    tensors = {"r": draw(), "w": decay_w(x, decay), "k": draw(), "v": draw(), "a": -kk, "b": kk * a_gate}
    out = {name: t.to(dtype).to(device) for name, t in tensors.items()}
    out["initial_state"] = None
    if initial_state:
        state = torch.randn(batch, heads, head_size, head_size, dtype=torch.float64, generator=generator)
        out["initial_state"] = state.to(torch.float32).to(device)
    return out


# ---- tolerances and parity ---------------------------------------------------------------------------------------
# Metric: RMS error ratio ||out - ref|| / ||ref|| against the fp64 reference fed the same (already rounded) inputs,
# for y, the final state and every gradient (under random cotangents on y and on the final state).

GRAD_NAMES = ("r", "w", "k", "v", "a", "b", "initial_state")
# The chunked form's bf16 mode (Triton: triton_kernels/rwkv7/chunked.py, _dot; CUDA: the forward's MmaSlice) multiplies
# hi/lo bf16 splits of fp32 operands on the tensor cores: each product misses the lo x lo term and the splits' own
# rounding (ropewkv/mma_bf16.cuh: measured max 2^-15.3, RMS 2^-17.8 relative per product), so the fp32 outputs (the
# states, which are not rounded to bf16) carry up to ~2^-16 more RMS than fp32 math (found by hypothesis: a Triton
# final state 2.5e-6 from fp64 with 3 tokens, over a 2e-6 bound).
SPLIT_PRODUCT_RMS = 2.0**-16


def tolerance(dtype: torch.dtype, precision: str, seqlen: int):
    """The RMS-ratio bound for y, final_state and the gradients of an fp32/fp16/bf16 run of length `seqlen`."""
    from . import Tolerance

    if dtype == torch.float64:
        # fp64 end to end (cpu twin): only summation order differs from the reference.
        return Tolerance(None, 1e-12, "fp64 throughout; summation order only")
    # Each bound is ~2.5-3x the largest error measured over the test suite (cpu twin, interpreted Triton, sequential
    # and chunked; 2026-11-29) and the H100/H200 parity runs (every twin, B2 T256 H2 N64; 2026-11-26).
    if precision == "bf16" and dtype != torch.bfloat16:
        # Every input is rounded to bf16 (2^-9 relative) on load: that perturbs y, the state and the gradients by a
        # few times 2^-9 through the recurrence, and outputs are rounded to bf16 again. Measured: 4.6e-3 (tests),
        # 4.2e-3 (GPU).
        return Tolerance(None, 1.2e-2, "inputs and outputs rounded through bf16 (2^-9) in the bf16 mode")
    if dtype == torch.bfloat16:
        # Inputs are exact for the oracle and the math is fp32 (the bf16 mode's products too: hi/lo splits), but
        # each stored bf16 output carries ~2^-9/sqrt(3) = 1.1e-3 RMS relative rounding error, and autograd hands the
        # kernels a cotangent already rounded to bf16 (a second 2^-9). Measured, either precision: 2.7e-3 (tests),
        # 2.4e-3 (GPU).
        return Tolerance(None, 6e-3, "bf16 output and cotangent roundings (2^-9) on fp32 math")
    if dtype == torch.float16:
        # As bf16 with 2^-11 (4x smaller). Measured: 3.2e-4 (tests), 3.0e-4 (GPU).
        return Tolerance(None, 1e-3, "fp16 output and cotangent roundings (2^-11) on fp32 math")
    # fp32: rounding errors of the fp32 state accumulate like a random walk over the steps. Measured: 3.7e-7 at
    # T = 15 (tests; 2.3x under the bound), 3.4e-7 at T = 256 (GPU, the Triton chunked form).
    return Tolerance(None, 6e-7 * (1 + seqlen / 16) ** 0.5, "fp32 state and sums, error grows ~sqrt(T)")


def oracle(inputs: dict, decay: str, cotangent_y: torch.Tensor, cotangent_state: torch.Tensor, cu_seqlens=None,
           mask=None):
    """fp64 y, final state and gradients {name: grad} of <y, cot_y> + <final_state, cot_state> by autograd."""
    from ..reference.rwkv7 import wkv7 as reference_wkv7

    leaves = {n: inputs[n].detach().to(torch.float64).requires_grad_() for n in GRAD_NAMES[:6]}
    s0 = inputs["initial_state"]
    if s0 is not None:
        leaves["initial_state"] = s0.detach().to(torch.float64).requires_grad_()
    y, state = reference_wkv7(*(leaves[n] for n in GRAD_NAMES[:6]), initial_state=leaves.get("initial_state"),
                              output_final_state=True, cu_seqlens=cu_seqlens, mask=mask, decay=decay)
    loss = (y * cotangent_y.to(torch.float64)).sum() + (state * cotangent_state.to(torch.float64)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return y, state, dict(zip(leaves, grads))


def run_wkv7(backend: str, inputs: dict, decay: str, precision: str, cotangent_y, cotangent_state, cu_seqlens=None,
             mask=None, algorithm: str = "auto"):
    """One backend's y, final state and gradients (of `algorithm`), computed like `oracle`."""
    from ..ops.rwkv7 import wkv7

    leaves = {n: inputs[n].detach().clone().requires_grad_() for n in GRAD_NAMES[:6]}
    if inputs["initial_state"] is not None:
        leaves["initial_state"] = inputs["initial_state"].detach().clone().requires_grad_()
    y, state = wkv7(*(leaves[n] for n in GRAD_NAMES[:6]), initial_state=leaves.get("initial_state"),
                    output_final_state=True, cu_seqlens=cu_seqlens, mask=mask, decay=decay, precision=precision,
                    backend=backend, algorithm=algorithm)
    loss = (y.float() * cotangent_y).sum() + (state * cotangent_state).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return y, state, dict(zip(leaves, grads))


def cotangents(inputs: dict, n_seqs: int, generator: torch.Generator, device="cpu"):
    batch, seqlen, heads, n = inputs["r"].shape
    cot_y = torch.randn(batch, seqlen, heads, n, dtype=torch.float64, generator=generator)
    cot_s = torch.randn(n_seqs, heads, n, n, dtype=torch.float64, generator=generator)
    dtype = compute_dtype(inputs["r"].dtype)
    return cot_y.to(dtype).to(device), cot_s.to(dtype).to(device)


def measurements(backend: str, precision: str, result, reference, tol, dtype) -> list:
    """Measurement rows for y, final_state and every gradient."""
    from . import measure

    y, state, grads = result
    ref_y, ref_state, ref_grads = reference
    rows = [measure("wkv7 y", backend, precision, y, ref_y, tol, dtype=dtype),
            measure("wkv7 final_state", backend, precision, state, ref_state, tol, dtype=dtype)]
    rows += [measure(f"wkv7 d{name}", backend, precision, grads[name], ref_grads[name], tol, dtype=dtype)
             for name in grads]
    return rows


def parity_rows(device: torch.device, seed: int = 0):
    """For `python -m ropewkv parity`: every kernel backend x dtype x precision x algorithm (sequential, chunked),
    loglog decay, varlen-free."""
    from . import run_backends, seeded

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for precision in ("fp32", "bf16"):
            gen = seeded(seed)
            # Interpreted Triton (CPU) is slow: a small shape there, a realistic one on a GPU.
            shape = (2, 256, 2, 64) if device.type == "cuda" else (1, 40, 1, 32)
            inputs = rwkv7_inputs(*shape, dtype=dtype, decay="loglog", generator=gen, device=device,
                                  initial_state=True)
            cot_y, cot_s = cotangents(inputs, shape[0], gen, device)
            reference = oracle(inputs, "loglog", cot_y, cot_s)
            tol = tolerance(dtype, precision, shape[1])
            results = run_backends(
                lambda backend: run_wkv7(backend, inputs, "loglog", precision, cot_y, cot_s), device)
            for backend, result in results.items():
                yield from measurements(backend, precision, result, reference, tol, dtype)
            # The chunked algorithm: the same oracle and bounds.
            chunked = run_backends(
                lambda backend: run_wkv7(backend, inputs, "loglog", precision, cot_y, cot_s, algorithm="chunked"),
                device)
            for backend, result in chunked.items():
                yield from measurements(f"{backend} chunked", precision, result, reference, tol, dtype)
