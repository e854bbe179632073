"""Parity of rwkv7_log_decay: inputs, tolerances, rows of the parity table."""
from __future__ import annotations

import torch

from ..reference import rwkv7 as reference
from . import DTYPE_NAMES, Tolerance, measure, run_backends, seeded

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Forward: the output is fp32 for every input dtype; exp, one add, one division and one product in fp32 give at most
# a few ulp (exp is faithful to ~1 ulp, each other operation adds 0.5).
FORWARD = Tolerance(max_ulp=4, rms=1e-6, why="fp32 exp + 3 rounded ops")
# Backward: grad_x is stored in x's dtype. In fp32 ~5 rounded ops; in bf16/fp16 the final rounding dominates
# (0.5 ulp), and the Triton interpreter truncates instead of rounding (1 ulp more).
BACKWARD = {
    torch.float32: Tolerance(max_ulp=6, rms=1e-6, why="fp32 exp + 5 rounded ops"),
    torch.float16: Tolerance(max_ulp=1.5, rms=1e-3, why="fp32 math, one rounding to fp16 (interpreter truncates)"),
    torch.bfloat16: Tolerance(max_ulp=1.5, rms=8e-3, why="fp32 math, one rounding to bf16 (interpreter truncates)"),
}


def decay_input(n: int, dtype: torch.dtype, generator: torch.Generator, device="cpu") -> torch.Tensor:
    """Pre-activations over the model's range U(-6, 2), plus the tails where naive sigmoid loses precision."""
    body = -6.0 + 8.0 * torch.rand(n, dtype=torch.float64, generator=generator)
    tails = torch.tensor([-120.0, -90.0, -40.0, -17.0, 17.0, 40.0, 90.0], dtype=torch.float64)
    return torch.cat([body, tails]).to(dtype).to(device)


def parity_rows(device: torch.device, seed: int = 0):
    from ..ops.decay import rwkv7_log_decay

    for dtype in DTYPES:
        gen = seeded(seed)
        x = decay_input(4096, dtype, gen, device)
        cotangent = torch.randn(x.shape, dtype=torch.float64, generator=gen).to(torch.float32).to(device)
        x64 = x.detach().to(torch.float64).requires_grad_()
        ref = reference.rwkv7_log_decay(x64)
        (ref_grad,) = torch.autograd.grad(ref, x64, cotangent.to(torch.float64))

        def call(backend):
            xb = x.detach().clone().requires_grad_()
            out = rwkv7_log_decay(xb, backend=backend)
            (grad,) = torch.autograd.grad(out, xb, cotangent)
            return out, grad

        for backend, (out, grad) in run_backends(call, device).items():
            yield measure("rwkv7_log_decay fwd", backend, "-", out, ref, FORWARD, dtype=dtype)
            yield measure("rwkv7_log_decay bwd", backend, "-", grad, ref_grad, BACKWARD[dtype])


__all__ = ["DTYPES", "FORWARD", "BACKWARD", "DTYPE_NAMES", "decay_input", "parity_rows"]
