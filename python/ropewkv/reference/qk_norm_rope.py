"""Per-head RMSNorm of q and k followed by RoPE (Qwen3, Qwen3-MoE, Gemma-3), in any dtype (fp64 for the oracle).

Conventions:
  - Each head row x (head_dim D) is normalised over all D dims: n = x / sqrt(mean(x^2) + eps), then scaled by
    (weight_offset + weight): weight_offset 0 is Qwen3's RMSNorm (weight initialised to 1), 1 is Gemma-3's (weight
    initialised to 0, used as 1 + weight).
  - The first rotary_dim dims of the normalised row y are then rotated with full-width tables cos, sin [..., R] (HF's
    layout): pair (a, b) becomes (y_a cos_a - y_b sin_a, y_b cos_b + y_a sin_b), pairs as in
    ropewkv.reference.rope; the rest (normalised) pass through.
  - A vLLM / FlashInfer cos_sin_cache is [max_position, rotary_dim]: row p holds cos(p f_i) for i < rotary_dim/2, then
    sin(p f_i).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import rope as rope_ref


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * (weight_offset + weight), all in x's dtype."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight_offset + weight.to(x.dtype))


def full_table(half: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """A per-frequency table [..., R/2] spread to the R rotated dims: cat(t, t) (NeoX) or each entry twice (GPT-J)."""
    return half.repeat_interleave(2, dim=-1) if interleaved else torch.cat((half, half), dim=-1)


def rotate_table(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first R = cos.shape[-1] dims of y with full-width tables (each output reads its own dim's entry)."""
    rot = cos.shape[-1]
    if interleaved:
        partner = torch.stack((-y[..., 1:rot:2], y[..., 0:rot:2]), dim=-1).flatten(-2)
    else:
        partner = rope_ref.rotate_half(y[..., :rot])
    return torch.cat((y[..., :rot] * cos + partner * sin, y[..., rot:]), dim=-1)


def qk_norm_rope(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 *, weight_offset: float = 0.0, interleaved: bool = False,
                 dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """x [..., D] normalised (unless weight is None) and rotated by full-width cos/sin broadcastable to
    x[..., :rotary_dim], computed and returned in `dtype`."""
    y = x.to(dtype)
    if weight is not None:
        y = rms_norm(y, weight.to(dtype), eps, weight_offset)
    return rotate_table(y, cos.to(dtype), sin.to(dtype), interleaved)


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    """HF's eager per-head norms, verbatim arithmetic: Qwen3RMSNorm (weight_offset 0: statistics in fp32, the normalised
    value rounded to x's dtype, then times the weight in that dtype) or Gemma3RMSNorm (weight_offset 1: everything in
    fp32, (1 + weight) included, one rounding to x's dtype)."""
    xf = x.to(torch.float32)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_offset == 0.0:
        return weight * normed.to(x.dtype)
    return (normed * (weight_offset + weight.float())).type_as(x)


def cache_cos_sin(cos_sin_cache: torch.Tensor, positions: torch.Tensor):
    """cos and sin [..., rotary_dim/2] of each position from a vLLM cos_sin_cache (cos half, then sin half)."""
    rows = cos_sin_cache[positions.long()]
    half = cos_sin_cache.shape[-1] // 2
    return rows[..., :half], rows[..., half:]


def cos_sin_cache(inv_freq: torch.Tensor, max_position: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """vLLM's RotaryEmbedding._compute_cos_sin_cache: fp32 angles t * inv_freq, cat(cos, sin), cast to `dtype` (vLLM
    casts it to the model dtype)."""
    freqs = torch.arange(max_position, dtype=torch.float32).unsqueeze(-1) * inv_freq.to(torch.float32)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)
