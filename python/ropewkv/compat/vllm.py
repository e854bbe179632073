"""vLLM drop-ins: `rotary_embedding` (vLLM's `torch.ops._C.rotary_embedding`), its cache-free twin
`rotary_embedding_inv_freq`, and `fused_qk_norm_rope` (vLLM's Qwen3 op), all in place.

vLLM's conventions, kept exactly:
  - positions [num_tokens] with query/key [num_tokens, num_heads * head_size] or [num_tokens, num_heads, head_size];
    or positions [batch, seq] with query/key [batch, seq, num_heads * head_size] or [batch, seq, num_heads, head_size].
    key may be None. Any strides with stride 1 in the head dim (e.g. slices of a fused qkv projection).
  - cos_sin_cache [max_position, rot_dim]: row p holds cos(p f_i), i < rot_dim/2, then sin(p f_i). rot_dim =
    cos_sin_cache.shape[1] <= head_size; the dims past rot_dim pass through unchanged.
  - is_neox: pairs (x[i], x[i + rot_dim/2]); otherwise GPT-J pairs (x[2i], x[2i+1]).
  - The math is fp32 with the cache read in its own dtype, as vLLM's CUDA kernel does (vLLM's RotaryEmbedding casts
    the cache to the model dtype: with a bf16 cache the angle's cos/sin carry bf16 rounding, ~2^-9 relative).
    `rotary_embedding_inv_freq` drops the cache and computes cos/sin of position * inv_freq in the kernel with an exact
    fp32 angle reduction: that is the precision loss of the bf16 cache, fixed.
Positions outside [0, max_position) raise ValueError on CPU tensors in eager mode; on CUDA (no host sync) and under
torch.compile the kernels clamp them into the cache, so no position reads outside it.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops.qk_norm_rope import qk_norm_rope
from ..ops.rope import rope


def _views(positions: torch.Tensor, query: torch.Tensor, key: Optional[torch.Tensor], head_size: int):
    """(layout, q, k) with q/k as [T, H, D] ("thd") or [B, S, H, D] ("bshd") views of vLLM's query/key."""
    if not isinstance(positions, torch.Tensor) or positions.dim() not in (1, 2):
        raise ValueError("positions must be a [num_tokens] or [batch_size, seq_len] tensor")
    if not isinstance(head_size, int) or head_size <= 0:
        raise ValueError(f"head_size must be a positive int, got {head_size!r}")

    def heads(x: torch.Tensor, name: str) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == positions.dim() + 1:
            if x.shape[-1] % head_size:
                raise ValueError(f"{name}'s last dim {x.shape[-1]} is not a multiple of head_size {head_size}")
            x = x.unflatten(-1, (-1, head_size))
        if x.dim() != positions.dim() + 2 or x.shape[-1] != head_size or x.shape[:-2] != positions.shape:
            raise ValueError(f"{name} {tuple(x.shape)} must be [*positions.shape, num_heads (* or ,) head_size = "
                             f"{head_size}] with positions {tuple(positions.shape)}")
        return x

    q = heads(query, "query")
    k = None if key is None else heads(key, "key")
    if k is not None and k.shape[-2] and q.shape[-2] % k.shape[-2]:  # (no key heads: nothing to rotate)
        raise ValueError(f"the query heads {q.shape[-2]} must be a multiple of the key heads {k.shape[-2]}")
    return ("thd" if positions.dim() == 1 else "bshd"), q, k


def cache_rope(positions: torch.Tensor, query: torch.Tensor, key: Optional[torch.Tensor], head_size: int,
               cos_sin_cache: torch.Tensor, is_neox: bool, inplace: bool, backend: str = "auto"):
    """query and key rotated with cos/sin from the cache, in place (returns None) or into new tensors shaped as
    query and key (returns (query_out, key_out), key_out None without key)."""
    layout, q, k = _views(positions, query, key, head_size)
    with torch.no_grad():
        out = qk_norm_rope(q, k, cos_sin_cache=cos_sin_cache, positions=positions, layout=layout,
                           interleaved=not is_neox, inplace=inplace, backend=backend)
    if inplace:
        return None
    q_out, k_out = out if k is not None else (out, None)
    return q_out.reshape(query.shape), None if k_out is None else k_out.reshape(key.shape)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: Optional[torch.Tensor], head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool, *, backend: str = "auto") -> None:
    """vLLM's rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox): rotates query and key in
    place with cos/sin read from the cache at each token's position (fp32 math). Returns None."""
    cache_rope(positions, query, key, head_size, cos_sin_cache, is_neox, True, backend)


def rotary_embedding_inv_freq(positions: torch.Tensor, query: torch.Tensor, key: Optional[torch.Tensor],
                              head_size: int, inv_freq: torch.Tensor, is_neox: bool, *, attention_scaling: float = 1.0,
                              backend: str = "auto") -> None:
    """rotary_embedding without a cache: cos/sin of position * inv_freq (inv_freq [rot_dim/2], e.g. vLLM's
    RotaryEmbedding._compute_inv_freq(base)) computed in the kernel, exact at any position < 2^24, times
    attention_scaling (vLLM's mscale of yarn / longrope). In place; returns None."""
    layout, q, k = _views(positions, query, key, head_size)
    with torch.no_grad():
        rope(q, k, inv_freq=inv_freq, positions=positions, layout=layout, interleaved=not is_neox,
             attention_scaling=attention_scaling, inplace=True, backend=backend)


def fused_qk_norm_rope(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int, head_dim: int,
                       eps: float, q_weight: torch.Tensor, k_weight: torch.Tensor, cos_sin_cache: torch.Tensor,
                       is_neox: bool, position_ids: torch.Tensor, *, backend: str = "auto") -> None:
    """vLLM's fused_qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight,
    cos_sin_cache, is_neox, position_ids): Qwen3's per-head RMSNorm (y = x / rms(x) * w, fp32 statistics) of the q and
    k heads of a packed [num_tokens, (num_heads_q + num_heads_k + num_heads_v) * head_dim] projection, then RoPE from
    the cache, in place (v untouched). Returns None."""
    total = num_heads_q + num_heads_k + num_heads_v
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 2 or qkv.shape[1] != total * head_dim:
        raise ValueError(f"qkv must be [num_tokens, {total} * {head_dim}], got "
                         f"{tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}")
    heads = qkv.unflatten(-1, (total, head_dim))
    with torch.no_grad():
        qk_norm_rope(heads[:, :num_heads_q], heads[:, num_heads_q:num_heads_q + num_heads_k], q_weight, k_weight, eps,
                     cos_sin_cache=cos_sin_cache, positions=position_ids, layout="thd", interleaved=not is_neox,
                     inplace=True, backend=backend)
