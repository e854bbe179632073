"""RoPE reference, the HF formula, in any dtype (fp64 for the oracle).

Conventions:
  - NeoX half style (HF `rotate_half`): the rotated pairs are (x[i], x[i + rotary_dim/2]).
  - GPT-J interleaved style: the pairs are (x[2i], x[2i+1]).
  - Each pair (x1, x2) becomes (x1 cos - x2 sin, x2 cos + x1 sin) with angle position * inv_freq[i], scaled by
    attention_scaling (HF multiplies cos and sin by it).
  - Dims past rotary_dim pass through unchanged.
  - M-RoPE (Qwen2-VL): positions has three rows (temporal, height, width) and frequency i turns by the position of
    row mrope_rows(...)[i]; chunked (Qwen2/2.5-VL) or interleaved (Qwen3-VL).
"""
from __future__ import annotations

from typing import Optional

import torch

LAYOUTS = ("bshd", "bhsd", "sbhd", "thd")


def default_inv_freq(dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """HF's inv_freq = 1 / base^(2i/dim), i < dim/2 (computed in fp64, then cast)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float64) / dim
    return (1.0 / (base**exponents)).to(dtype)


def token_positions(batch: int, seqlen: int, positions: Optional[torch.Tensor] = None, seqlen_offsets=0,
                    cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The absolute position of every token, as int64 on the CPU (whatever the device of the offsets): [batch, seqlen],
    or [total_tokens] when cu_seqlens is given.

    - positions (broadcastable to [batch, seqlen], or [T] for packed varlen) wins when given; offsets add to it.
    - otherwise token s of a sequence has position s;
    - seqlen_offsets (int or [batch] / [n_seqs] tensor) is added per sequence (KV cache, context-parallel shard).
    For packed varlen (cu_seqlens), the position restarts at 0 at each cu_seqlens boundary.
    """
    offsets = torch.as_tensor(seqlen_offsets, dtype=torch.int64).cpu()  # positions are built on the CPU
    if cu_seqlens is not None:
        cu = cu_seqlens.to(torch.int64).cpu()
        lengths = cu[1:] - cu[:-1]
        seq_of_token = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        if positions is None:
            base = torch.arange(int(cu[-1])) - cu[:-1][seq_of_token]
        else:
            base = positions.to(torch.int64).cpu().expand(int(cu[-1]))
        per_token_offset = offsets.expand(len(lengths))[seq_of_token] if offsets.dim() else offsets
        return base + per_token_offset
    if positions is None:
        base = torch.arange(seqlen, dtype=torch.int64).expand(batch, seqlen)
    else:
        base = positions.to(torch.int64).cpu().expand(batch, seqlen)
    if offsets.dim():
        offsets = offsets.view(batch, 1)
    return base + offsets


def to_bshd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A view of x as [batch, seq, heads, dim] ([1, T, heads, dim] for thd)."""
    if layout == "bshd":
        return x
    if layout == "bhsd":
        return x.transpose(1, 2)
    if layout == "sbhd":
        return x.transpose(0, 1)
    if layout == "thd":
        return x.unsqueeze(0)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def mrope_rows(n_freqs: int, mrope_section, interleaved: bool = False) -> torch.Tensor:
    """The position row (0 temporal, 1 height, 2 width) of each of the n_freqs frequencies under M-RoPE, as int64.

    Chunked (Qwen2-VL, Qwen2.5-VL): the first mrope_section[0] frequencies follow row 0, the next mrope_section[1]
    row 1, the last mrope_section[2] row 2. Interleaved (Qwen3-VL): frequency i with i % 3 = r in (1, 2) follows row
    r while i < 3 * mrope_section[r]; every other frequency follows row 0."""
    i = torch.arange(n_freqs)
    if interleaved:
        rows = i % 3
        limits = torch.tensor([0, 3 * mrope_section[1], 3 * mrope_section[2]])[rows]
        return torch.where(i < limits, rows, 0)
    return torch.repeat_interleave(torch.arange(3), torch.tensor(list(mrope_section)))


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
            dtype: torch.dtype = torch.float64, rows: Optional[torch.Tensor] = None):
    """cos and sin of position * inv_freq in `dtype`, shape [..., rotary_dim/2], times attention_scaling.
    M-RoPE: positions is [3, ...] and frequency i takes row rows[i] (mrope_rows); the result is [..., rotary_dim/2]."""
    pos = positions.to(dtype)
    if rows is None:
        angle = pos.unsqueeze(-1) * inv_freq.to(dtype)
    else:
        angle = pos.index_select(0, rows.to(pos.device)).movedim(0, -1) * inv_freq.to(dtype)
    return angle.cos() * attention_scaling, angle.sin() * attention_scaling


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first 2*cos.shape[-1] dims of x by (cos, sin) of shape broadcastable to x[..., :half]."""
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((out, rest), dim=-1)


def rope(x: torch.Tensor, inv_freq: torch.Tensor, positions: torch.Tensor, *, layout: str = "bshd",
         interleaved: bool = False, attention_scaling: float = 1.0, dtype: torch.dtype = torch.float64,
         mrope_section=None, mrope_interleaved: bool = False) -> torch.Tensor:
    """x rotated at absolute `positions` ([B, S], or [T] for thd; see token_positions), computed in `dtype` and
    returned in `dtype`. rotary_dim is 2 * len(inv_freq). With mrope_section, positions is [3, B, S] ([3, T])."""
    x_bshd = to_bshd(x, layout).to(dtype)
    rows = None if mrope_section is None else mrope_rows(inv_freq.numel(), mrope_section, mrope_interleaved)
    pos = positions.reshape(*positions.shape[:-1], 1, -1) if layout == "thd" else positions
    cos, sin = cos_sin(pos.to(x.device), inv_freq.to(x.device), attention_scaling, dtype, rows)
    out = rotate(x_bshd, cos.unsqueeze(2), sin.unsqueeze(2), interleaved)
    if layout == "thd":
        return out.squeeze(0)
    return out.transpose(1, 2) if layout == "bhsd" else out.transpose(0, 1) if layout == "sbhd" else out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's rotate_half: cat(-x2, x1)."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """HF transformers' apply_rotary_pos_emb, verbatim semantics, in the dtype of its inputs (the bf16 baseline).
    cos/sin narrower than the head dim rotate the first cos.shape[-1] dims (partial rotary, as GPT-NeoX)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]

    def apply(x):
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat(((rot * cos) + (rotate_half(rot) * sin), rest), dim=-1)

    return apply(q), apply(k)
