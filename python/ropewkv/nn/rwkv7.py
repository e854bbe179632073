"""RWKV7TimeMix: RWKV-7's attention block ("time mix") on the fused kernels, state_dict-compatible with RWKV-LM.

RWKV-7 conventions side by side (per head; N = head size; ropewkv.wkv7 speaks all three decay forms):

| | decay argument `w` | decay d_t | state layout | scale | where |
|---|---|---|---|---|---|
| RWKV-LM wkv7 / wind_rwkv | log-log, w in (-inf, -0.5) | exp(-exp(w)) | [B, H, N_v, N_k] (S[v][k]) | 1 | `decay="loglog"` |
| RWKV-LM clampw kernels | raw LoRA output x | exp(-e^-0.5 sigmoid(x)) | [B, H, N_v, N_k] | 1 | `decay="raw"` (this module) |
| FLA chunk/fused_recurrent_rwkv7 | log decay, in (-0.607, 0) | exp(w) | [B, H, K, V] (transpose) | K^-0.5 default in fused_recurrent; pass 1 | `ropewkv.compat.fla` |
| HF transformers | no RWKV-7 model in 5.24 (RWKV v4 only) | - | - | - | - |

The three decays are one function of the LoRA output x: loglog w = -softplus(-x) - 0.5, log w = -e^-0.5 sigmoid(x).
RWKV-LM's model computes the loglog w in the I/O dtype; this module hands x to the kernel (decay="raw"), which
computes the same decay in fp32 (the FLA #181 fix).

Mixed precision (torch.autocast, CPU or CUDA): the matmuls run in the autocast dtype and the kernel's r, k, v, a, b
are cast to it, while the decay path stays fp32: its LoRA runs with autocast off and the kernel reads the fp32 x at
full precision (a bf16 decay near 1 would forget over long sequences).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import _backend
from ..ops.rwkv7 import wkv7, wkv7_step


def _lora_dim(hidden_size: int, factor: float) -> int:
    """RWKV-LM's LoRA rank: max(32, round(factor * sqrt(C) / 32) * 32)."""
    return max(32, int(round(factor * hidden_size**0.5 / 32)) * 32)


@dataclass
class RWKV7State:
    """Recurrent state of one RWKV7TimeMix for decoding: x_prev [B, C] (the last input token, for the token shift)
    and wkv fp32 [B, H, N, N] (S[v][k], RWKV-LM's layout)."""

    x_prev: torch.Tensor
    wkv: torch.Tensor


class RWKV7TimeMix(nn.Module):
    """RWKV-7 time mix with RWKV-LM's parameter names and shapes (RWKV_Tmix_x070), so RWKV-LM state_dicts load.

    Args:
        hidden_size: C (= dim_att); head_size: N (C % N == 0, H = C / N); layer_id, n_layer: as in RWKV-LM (layer 0
            produces v_first; they also shape the initialisation); *_lora: LoRA ranks (default: RWKV-LM's formulas);
        backend, precision: passed to ropewkv.wkv7 / wkv7_step (attributes, not in the state_dict).
    Parameters: x_r, x_w, x_k, x_v, x_a, x_g, w0, a0, v0, k_k, k_a [1, 1, C]; w1 [C, Dw], w2 [Dw, C]; a1/a2, v1/v2,
        g1/g2 likewise; r_k [H, N]; receptance, key, value, output Linear(C, C, bias=False); ln_x GroupNorm(H, C).
    The initialisation follows RWKV-LM's scheme (output starts at zero, as there).
    """

    def __init__(self, hidden_size: int, head_size: int = 64, layer_id: int = 0, n_layer: int = 1, *,
                 decay_lora: Optional[int] = None, a_lora: Optional[int] = None, v_lora: Optional[int] = None,
                 gate_lora: Optional[int] = None, backend: str = "auto", precision: Optional[str] = None):
        super().__init__()
        if hidden_size % head_size:
            raise ValueError(f"hidden_size {hidden_size} must be a multiple of head_size {head_size}")
        C, N = hidden_size, head_size
        H = C // N
        self.hidden_size, self.head_size, self.n_head, self.layer_id = C, N, H, layer_id
        self.backend, self.precision = backend, precision
        ranks = {"w": decay_lora or _lora_dim(C, 2.5), "a": a_lora or _lora_dim(C, 2.5),
                 "v": v_lora or _lora_dim(C, 1.7), "g": gate_lora or _lora_dim(C, 5.0)}

        depth = layer_id / (n_layer - 1) if n_layer > 1 else 0.0  # 0 at the first layer, 1 at the last
        shallowness = 1.0 - layer_id / n_layer  # 1 at the first layer, towards 0 at the last
        channel = torch.arange(C, dtype=torch.float64)
        fraction = (channel / C).view(1, 1, C)
        for name, power in (("r", 0.2), ("w", 0.9), ("k", 0.7), ("v", 0.7), ("a", 0.9), ("g", 0.2)):
            self.register_parameter(f"x_{name}", nn.Parameter((1.0 - fraction ** (power * shallowness)).float()))
        linear = channel / (C - 1) - 0.5
        within_head = (channel % N - (N - 1) / 2) / ((N - 1) / 2)
        zigzag = within_head * within_head.abs()
        decay_speed = -6 + 6 * (channel / (C - 1)) ** (1 + depth**0.3)

        def row(values):
            return nn.Parameter(values.view(1, 1, C).float())

        self.w0 = row(decay_speed + 0.5 + zigzag * 2.5)
        self.a0 = row(-0.19 + zigzag * 0.3 + linear * 0.4)
        self.v0 = row(0.73 - linear * 0.4)
        for name, rank in ranks.items():
            down = torch.zeros(C, rank)
            up = torch.empty(rank, C)
            nn.init.orthogonal_(up, gain=0.1 * (math.sqrt(rank / C) if rank > C else 1.0))
            self.register_parameter(f"{name}1", nn.Parameter(down))
            self.register_parameter(f"{name}2", nn.Parameter(up))
        self.k_k = row(0.71 - linear * 0.1)
        self.k_a = row(torch.full((C,), 1.02, dtype=torch.float64))
        self.r_k = nn.Parameter(torch.full((H, N), -0.04))
        self.receptance, self.key, self.value, self.output = (nn.Linear(C, C, bias=False) for _ in range(4))
        self.ln_x = nn.GroupNorm(H, C, eps=64e-5)
        with torch.no_grad():
            for linear_layer, bound in ((self.receptance, 0.5), (self.key, 0.05), (self.value, 0.5)):
                linear_layer.weight.uniform_(-bound / C**0.5, bound / C**0.5)
            self.output.weight.zero_()

    def initial_state(self, batch: int, device=None, dtype: Optional[torch.dtype] = None) -> RWKV7State:
        """A zero decode state: x_prev [batch, C] in `dtype` (default: the parameters'), wkv [batch, H, N, N] in fp32
        (fp64 for an fp64 module, as wkv7 wants)."""
        device = device if device is not None else self.w0.device
        dtype = dtype or self.w0.dtype
        return RWKV7State(torch.zeros(batch, self.hidden_size, device=device, dtype=dtype),
                          torch.zeros(batch, self.n_head, self.head_size, self.head_size, device=device,
                                      dtype=_backend.compute_dtype(dtype)))

    def forward(self, x: torch.Tensor, v_first: Optional[torch.Tensor] = None,
                state: Optional[RWKV7State] = None):
        """x [B, T, C] -> (out [B, T, C], v_first), as RWKV-LM's forward(x, v_first).

        v_first: the first layer's value, [B, T, C] (ignored by layer 0, which returns its own).
        state: optional RWKV7State carried across calls (prefill, then decode one token at a time): its x_prev feeds
            the token shift and its wkv is the initial state; both are replaced by the values after x. A one-token
            call without autograd runs ropewkv.wkv7_step, updating state.wkv in place.
        """
        C, H, N = self.hidden_size, self.n_head, self.head_size
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != C or not x.is_floating_point():
            raise ValueError(f"x must be a float tensor [B, T, C = {C}], got "
                             f"{f'{x.dtype} of shape {tuple(x.shape)}' if isinstance(x, torch.Tensor) else type(x)}")
        B, T, _ = x.shape
        if state is not None and (tuple(state.x_prev.shape) != (B, C) or tuple(state.wkv.shape) != (B, H, N, N)):
            raise ValueError(f"state must hold x_prev [B, C] = [{B}, {C}] and wkv [B, H, N, N] = [{B}, {H}, {N}, {N}] "
                             f"for x's batch, got {tuple(state.x_prev.shape)} and {tuple(state.wkv.shape)}")
        if self.layer_id != 0 and v_first is not None and v_first.shape != x.shape:
            raise ValueError(f"v_first must have x's shape {tuple(x.shape)}, got {tuple(v_first.shape)}")
        previous = (state.x_prev.unsqueeze(1) if state is not None else x.new_zeros(B, 1, C))
        xx = torch.cat((previous, x[:, :-1]), dim=1) - x  # token shift: x[t-1] - x[t]
        xr, xw, xk, xv, xa, xg = (x + xx * mix for mix in (self.x_r, self.x_w, self.x_k, self.x_v, self.x_a,
                                                           self.x_g))
        r = self.receptance(xr)
        with torch.autocast(x.device.type, enabled=False):  # the decay path in fp32 (fp64 for an fp64 module)
            decay_dtype = torch.promote_types(xw.dtype, torch.float32)
            w1, w2, w0 = (p.to(decay_dtype) for p in (self.w1, self.w2, self.w0))
            w = w0 + torch.tanh(xw.to(decay_dtype) @ w1) @ w2  # the raw pre-activation: the kernel applies the decay
        k = self.key(xk)
        v = self.value(xv)
        if self.layer_id == 0:
            v_first = v
        else:
            if v_first is None:
                raise ValueError(f"v_first is required by layer {self.layer_id} (layers after the first mix in "
                                 "layer 0's value: pass the v_first that layer 0's forward returned)")
            v = v + (v_first - v) * torch.sigmoid(self.v0 + (xv @ self.v1) @ self.v2)  # value residual
        a = torch.sigmoid(self.a0 + (xa @ self.a1) @ self.a2)  # in-context learning rate
        g = torch.sigmoid(xg @ self.g1) @ self.g2
        kk = F.normalize((k * self.k_k).view(B, T, H, N), dim=-1, p=2.0).view(B, T, C)
        k = k * (1 + (a - 1) * self.k_a)

        # r, k, v, a, b in r's dtype (under autocast the autocast dtype; there k, v, a come out fp32 from the fp32
        # parameters they meet); w keeps its own.
        heads = [t.view(B, T, H, N) for t in (r, w, *(u.to(r.dtype) for u in (k, v, -kk, kk * a)))]
        if state is not None and T == 1 and not torch.is_grad_enabled():
            y = wkv7_step(*(t[:, 0] for t in heads), state.wkv, decay="raw", precision=self.precision,
                          backend=self.backend).unsqueeze(1)
        else:
            y, final = wkv7(*heads, initial_state=None if state is None else state.wkv,
                            output_final_state=state is not None, decay="raw", precision=self.precision,
                            backend=self.backend)
            if state is not None:
                state.wkv = final
        if state is not None:
            state.x_prev = x[:, -1]
        y = self.ln_x(y.reshape(B * T, C)).view(B, T, C)
        bonus = (heads[0] * heads[2] * self.r_k).sum(dim=-1, keepdim=True) * heads[3]
        return self.output((y + bonus.view(B, T, C)) * g), v_first
