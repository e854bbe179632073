"""flash-linear-attention (FLA) drop-ins for RWKV-7: `chunk_rwkv7` and `fused_recurrent_rwkv7`.

FLA's conventions, converted to ropewkv.wkv7 and back (all conversions are differentiable):
  - w is the LOG decay (d = exp(w)): wkv7(..., decay="log");
  - states are [N, H, K, V], the transpose of RWKV-LM's [N, H, V, K] used by wkv7;
  - `scale` multiplies r (RWKV-7 needs 1.0; FLA's fused_recurrent defaults to K^-0.5 when scale is None).
Unlike FLA's fused_recurrent_rwkv7, both have a backward. The math is ropewkv's (fp32 state, decay in fp32).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops.rwkv7 import wkv7


def _run(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, backend):
    if scale is None:
        scale = r.shape[-1] ** -0.5
    if scale != 1.0:
        r = r * scale
    state = None if initial_state is None else initial_state.transpose(-1, -2)
    y, final_state = wkv7(r, w, k, v, a, b, initial_state=state, output_final_state=output_final_state,
                          cu_seqlens=cu_seqlens, decay="log", backend=backend)
    return y, (None if final_state is None else final_state.transpose(-1, -2))


def chunk_rwkv7(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, scale: float = 1.0, initial_state: Optional[torch.Tensor] = None,
                output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None, *,
                backend: str = "auto"):
    """FLA's chunk_rwkv7: r, w (log decay), k, v, a, b [B, T, H, K]; initial_state [N, H, K, V] fp32 or None.
    Returns (o [B, T, H, V] in r's dtype, final_state [N, H, K, V] fp32 or None)."""
    return _run(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, backend)


def fused_recurrent_rwkv7(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                          b: torch.Tensor, scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                          output_final_state: bool = True, cu_seqlens: Optional[torch.Tensor] = None, *,
                          backend: str = "auto"):
    """FLA's fused_recurrent_rwkv7, with FLA's defaults (scale None = K^-0.5, output_final_state True): pass
    scale=1.0 for RWKV-7. Shapes and conventions as chunk_rwkv7. Has a backward (FLA's has none)."""
    return _run(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, backend)
