"""RWKV-7 references in RWKV-LM's convention, runnable in fp64.

Per batch b and head h, with head size N and the state S of shape [N_v, N_k] (row i = value index):
    d_t    = decay(w_t)                          (see DECAYS)
    sa_i   = sum_j a_j S_{t-1}[i, j]             (before the update)
    S_t    = S_{t-1} * d_t[None, :] + sa[:, None] * b_t[None, :] + v_t[:, None] * k_t[None, :]
    y_t[i] = sum_j S_t[i, j] r_t[j]
i.e. S_t = S_{t-1} (diag(d_t) + a_t b_t^T) + v_t k_t^T and y_t = S_t r_t (scale 1).

Inputs r, w, k, v, a, b are [B, T, H, N]; states are [B, H, N, N] (S[v][k], the RWKV-LM layout; FLA's [N, H, K, V]
is its transpose).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

EXP_MINUS_HALF = math.exp(-0.5)

# The three conventions for the w argument:
#   "loglog": d = exp(-exp(w))                 RWKV-LM wkv7, wind_rwkv; w in (-inf, -0.5)
#   "raw":    d = exp(-e^{-0.5} * sigmoid(w))  RWKV-LM clampw kernels (w is the LoRA pre-activation)
#   "log":    d = exp(w)                       FLA, HF rwkv7; w in (-0.6065, 0)
DECAYS = ("loglog", "raw", "log")


def log_decay(w: torch.Tensor, decay: str = "loglog") -> torch.Tensor:
    """log d for each convention, computed in w's dtype."""
    if decay == "loglog":
        return -torch.exp(w)
    if decay == "raw":
        return -EXP_MINUS_HALF * torch.sigmoid(w)
    if decay == "log":
        return w
    raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")


def convert_w(w: torch.Tensor, source: str, target: str) -> torch.Tensor:
    """The w of convention `target` that gives the same decay as w of convention `source`.
    ("raw" can be produced only from "raw": it is the pre-activation, not a function of d.)"""
    if source == target:
        return w
    log_w = log_decay(w, source)
    if target == "log":
        return log_w
    if target == "loglog":
        return torch.log(-log_w)
    raise ValueError(f"cannot convert decay {source!r} to {target!r}")


def rwkv7_log_decay(x: torch.Tensor) -> torch.Tensor:
    """The fused-decay op's reference: -e^{-0.5} * sigmoid(x), in x's dtype."""
    return log_decay(x, "raw")


def wkv7_step(r, w, k, v, a, b, state, decay: str = "loglog"):
    """One token. r..b: [B, H, N]; state: [B, H, N, N] (not modified). Returns (y [B, H, N], new_state)."""
    d = torch.exp(log_decay(w, decay))
    sa = torch.einsum("bhij,bhj->bhi", state, a)
    new_state = state * d.unsqueeze(-2) + sa.unsqueeze(-1) * b.unsqueeze(-2) + v.unsqueeze(-1) * k.unsqueeze(-2)
    y = torch.einsum("bhij,bhj->bhi", new_state, r)
    return y, new_state


def wkv7(r, w, k, v, a, b, *, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
         cu_seqlens: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None, decay: str = "loglog",
         dtype: torch.dtype = torch.float64):
    """The WKV7 recurrence over [B, T, H, N] inputs, computed in `dtype` (differentiable: autograd through the loop
    gives the gradient oracle). With cu_seqlens (B must be 1), each packed sequence starts from its own
    initial_state[n] (zeros if None), and final_state has one entry per sequence. A [1, H, N, N] initial_state is
    broadcast to every sequence. mask [B, T]: where 0 the state is kept as it was (S_t = S_{t-1}) and
    y_t = S_t r_t reads it.
    Returns (y [B, T, H, N] in `dtype`, final_state [B or n_seqs, H, N, N] in `dtype`, or None)."""
    r, w, k, v, a, b = (x.to(dtype) for x in (r, w, k, v, a, b))
    if cu_seqlens is not None:
        bounds = [int(c) for c in cu_seqlens]
        ys, finals = [], []
        for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            piece = [x[:, start:end] for x in (r, w, k, v, a, b)]
            s0 = None if initial_state is None else initial_state[n if initial_state.shape[0] > 1 else 0][None]
            y, s = wkv7(*piece, initial_state=s0, output_final_state=True,
                        mask=None if mask is None else mask[:, start:end], decay=decay, dtype=dtype)
            ys.append(y)
            finals.append(s)
        return torch.cat(ys, dim=1), (torch.cat(finals) if output_final_state else None)
    batch, seqlen, heads, n = r.shape
    if initial_state is None:
        state = torch.zeros(batch, heads, n, n, dtype=dtype, device=r.device)
    else:
        state = initial_state.to(dtype).expand(batch, heads, n, n)
    ys = []
    for t in range(seqlen):
        y, updated = wkv7_step(r[:, t], w[:, t], k[:, t], v[:, t], a[:, t], b[:, t], state, decay)
        if mask is not None:
            updated = torch.where((mask[:, t] != 0)[:, None, None, None], updated, state)
            y = torch.einsum("bhij,bhj->bhi", updated, r[:, t])
        state = updated
        ys.append(y)
    y = torch.stack(ys, dim=1) if ys else r.new_zeros(batch, 0, heads, n)
    return y, (state if output_final_state else None)
