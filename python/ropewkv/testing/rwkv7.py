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
