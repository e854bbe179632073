"""RoPE inputs for tests and the parity table."""
from __future__ import annotations

import torch

from ..reference.rope import default_inv_freq

PHYSICAL_SHAPE = {
    "bshd": lambda b, s, h, d: (b, s, h, d),
    "bhsd": lambda b, s, h, d: (b, h, s, d),
    "sbhd": lambda b, s, h, d: (s, b, h, d),
}


def rope_input(batch: int, seqlen: int, heads: int, head_dim: int, dtype: torch.dtype, layout: str = "bshd",
               generator: torch.Generator = None, device="cpu") -> torch.Tensor:
    """Activations like q or k: N(0, 1), drawn in fp64 and rounded to `dtype`, stored in `layout`'s memory order
    ([T, H, D] with T = batch * seqlen for "thd")."""
    shape = (batch * seqlen, heads, head_dim) if layout == "thd" else PHYSICAL_SHAPE[layout](batch, seqlen, heads,
                                                                                             head_dim)
    return torch.randn(shape, dtype=torch.float64, generator=generator).to(dtype).to(device)


def rope_inv_freq(rotary_dim: int, base: float = 10000.0, device="cpu") -> torch.Tensor:
    """HF's default inv_freq in fp32, as models hold it."""
    return default_inv_freq(rotary_dim, base).to(device)
