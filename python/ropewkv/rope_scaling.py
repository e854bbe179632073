"""HF rope_scaling (rope_parameters) variants: inv_freq and attention_scaling, the formulas of transformers'
ROPE_INIT_FUNCTIONS (modeling_rope_utils), reproduced in the same fp32 arithmetic so that inv_freq matches bit for bit.

Each function takes (dim, base, params, max_position_embeddings, seq_len) where dim is the rotary dim and params is
the rope_scaling dict (HF's rope_parameters without rope_theta). It returns (inv_freq fp32 [dim/2], attention_scaling).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim


def default(dim, base, params, max_pos, seq_len):
    return 1.0 / (base**_exponents(dim)), 1.0


def linear(dim, base, params, max_pos, seq_len):
    inv_freq, _ = default(dim, base, params, max_pos, seq_len)
    return inv_freq / params["factor"], 1.0


def dynamic(dim, base, params, max_pos, seq_len):
    """NTK-aware: the base grows with the current sequence length past max_position_embeddings. seq_len as HF's
    callers pass it: an int (the init function: fp64 arithmetic) or an int64 tensor (its module's dynamic update: the
    new base in fp32)."""
    factor = params["factor"]
    seq_len = max_pos if seq_len is None else max(seq_len, max_pos)
    base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base**_exponents(dim)), 1.0


def _original_max(params, max_pos):
    return params.get("original_max_position_embeddings") or max_pos


def yarn(dim, base, params, max_pos, seq_len):
    original = _original_max(params, max_pos)
    factor = params.get("factor") or max_pos / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def longrope(dim, base, params, max_pos, seq_len):
    """Long factors once the sequence is longer than original_max_position_embeddings, short factors otherwise."""
    original = _original_max(params, max_pos)
    factor = params.get("factor") or max_pos / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    key = "long_factor" if seq_len and seq_len > original else "short_factor"
    ext = torch.tensor(params[key], dtype=torch.float32)
    return 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), attention_factor


def llama3(dim, base, params, max_pos, seq_len):
    inv_freq, _ = default(dim, base, params, max_pos, seq_len)
    factor, low_ff, high_ff = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low_ff, old_context / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


ROPE_TYPES = {"default": default, "linear": linear, "dynamic": dynamic, "yarn": yarn, "longrope": longrope,
              "llama3": llama3}


def compute_inv_freq(dim: int, base: float = 10000.0, rope_scaling: Optional[dict] = None,
                     max_position_embeddings: Optional[int] = None,
                     seq_len: Union[int, torch.Tensor, None] = None):
    """(inv_freq fp32 [dim/2], attention_scaling) for HF's rope_scaling dict (None: default RoPE). seq_len: an int, or
    an int64 0-d tensor as HF's rotary modules pass it to dynamic NTK (see dynamic)."""
    params = dict(rope_scaling or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling['rope_type'] must be one of {sorted(ROPE_TYPES)}, got {rope_type!r}")
    if not isinstance(dim, int) or dim <= 0 or dim % 2:
        raise ValueError(f"dim must be a positive even int, got {dim!r}")
    needs_max = rope_type == "dynamic" or (rope_type in ("yarn", "longrope") and
                                           not params.get("original_max_position_embeddings"))
    if needs_max and max_position_embeddings is None:
        raise ValueError(f"rope_type {rope_type!r} needs max_position_embeddings")
    return ROPE_TYPES[rope_type](dim, float(base), params, max_position_embeddings, seq_len)
