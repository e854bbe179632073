"""FlashInfer drop-ins (flashinfer/rope.py's signatures, defaults and return conventions).

  - apply_rope(q, k, indptr, offsets, ...) / apply_rope_pos_ids(q, k, pos_ids, ...) and their llama31 variants return
    (q_rope, k_rope); the `_inplace` twins rotate q and k and return None. q [nnz, num_q_heads, head_dim], k
    [nnz, num_k_heads, head_dim]; indptr [batch + 1] (ragged: token t of segment i sits at position
    offsets[i] + t - indptr[i]); pos_ids [nnz]. rotary_dim None means head_dim; interleave=False pairs (x[i],
    x[i + rotary_dim/2]), True pairs (x[2i], x[2i+1]). The frequency of pair i is
    1 / (rope_scale * rope_theta^(2i / rotary_dim)); the llama31 variants blend it with freq / rope_scale by Llama 3.1's
    smooth factor clamp((old_context_len freq / 2pi - low_freq_factor) / (high_freq_factor - low_freq_factor), 0, 1)
    (high-frequency pairs keep freq, low-frequency ones get freq / rope_scale).
    FlashInfer computes freq with __powf and the angle with __sincosf of an fp32 product; here freq is computed in fp64
    and rounded once, and the angle in the kernel with an exact reduction (ropewkv.rope).
  - apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox=True) returns
    (query_out, key_out); `_inplace` returns None. query/key [nnz, num_heads * head_size] (or [nnz, heads,
    head_size]), cos_sin_cache float32 [max_seq_len, rotary_dim], cos half then sin half; vLLM's layout (see
    ropewkv.compat.vllm). Out-of-range positions raise on CPU tensors and are clamped into the cache on CUDA.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from ..ops.rope import rope
from . import vllm


# The frequencies are built on the host and copied to the device once per setting: a copy from pageable host memory
# on every call (every layer of every step) cost a host sync and broke CUDA graph capture, which serving engines run
# their decode steps under (after warm-up calls, which fill this cache).
@functools.lru_cache(maxsize=64)
def _inv_freq(rotary_dim: int, rope_scale: float, rope_theta: float, device) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return (1.0 / (rope_scale * rope_theta**exponents)).to(torch.float32).to(device)


@functools.lru_cache(maxsize=64)
def _llama31_inv_freq(rotary_dim: int, rope_scale: float, rope_theta: float, low_freq_factor: float,
                      high_freq_factor: float, old_context_len: float, device) -> torch.Tensor:
    freq = 1.0 / rope_theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    smooth = ((old_context_len * freq / (2 * math.pi) - low_freq_factor) / (high_freq_factor - low_freq_factor))
    smooth = smooth.clamp(0.0, 1.0)
    return ((1 - smooth) * freq / rope_scale + smooth * freq).to(torch.float32).to(device)


def _rotary_dim(q: torch.Tensor, rotary_dim: Optional[int]) -> int:
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError("q must be a [nnz, num_q_heads, head_dim] tensor")
    rot = q.shape[-1] if rotary_dim is None else rotary_dim
    # Checked here: an odd rot would reach rope as ceil(rot / 2) frequencies, a rotation of rot + 1 dims.
    if not isinstance(rot, int) or rot % 2 or rot < 0:
        raise ValueError(f"rotary_dim must be a non-negative even int, got {rot!r}")
    return rot


def _apply(q, k, inv_freq, inplace, **kwargs):
    out = rope(q, k, inv_freq=inv_freq, layout="thd", inplace=inplace, **kwargs)
    return None if inplace else out


def apply_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4, *,
               backend="auto"):
    rot = _rotary_dim(q, rotary_dim)
    return _apply(q, k, _inv_freq(rot, rope_scale, rope_theta, q.device), False, cu_seqlens=indptr,
                  seqlen_offsets=offsets, interleaved=interleave, backend=backend)


def apply_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4, *,
                       backend="auto"):
    rot = _rotary_dim(q, rotary_dim)
    return _apply(q, k, _inv_freq(rot, rope_scale, rope_theta, q.device), True, cu_seqlens=indptr,
                  seqlen_offsets=offsets, interleaved=interleave, backend=backend)


def apply_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4, *,
                       backend="auto"):
    rot = _rotary_dim(q, rotary_dim)
    return _apply(q, k, _inv_freq(rot, rope_scale, rope_theta, q.device), False, positions=pos_ids,
                  interleaved=interleave, backend=backend)


def apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4, *,
                               backend="auto"):
    rot = _rotary_dim(q, rotary_dim)
    return _apply(q, k, _inv_freq(rot, rope_scale, rope_theta, q.device), True, positions=pos_ids,
                  interleaved=interleave, backend=backend)


def apply_llama31_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8, rope_theta=5e5,
                       low_freq_factor=1, high_freq_factor=4, old_context_len=8192, *, backend="auto"):
    rot = _rotary_dim(q, rotary_dim)
    inv = _llama31_inv_freq(rot, rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len, q.device)
    return _apply(q, k, inv, False, cu_seqlens=indptr, seqlen_offsets=offsets, interleaved=interleave,
                  backend=backend)


def apply_llama31_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8,
                               rope_theta=5e5, low_freq_factor=1, high_freq_factor=4, old_context_len=8192, *,
                               backend="auto"):
    rot = _rotary_dim(q, rotary_dim)
    inv = _llama31_inv_freq(rot, rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len, q.device)
    return _apply(q, k, inv, True, cu_seqlens=indptr, seqlen_offsets=offsets, interleaved=interleave,
                  backend=backend)


def apply_llama31_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8, rope_theta=5e5,
                               low_freq_factor=1, high_freq_factor=4, old_context_len=8192, *, backend="auto"):
    rot = _rotary_dim(q, rotary_dim)
    inv = _llama31_inv_freq(rot, rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len, q.device)
    return _apply(q, k, inv, False, positions=pos_ids, interleaved=interleave, backend=backend)


def apply_llama31_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8,
                                       rope_theta=5e5, low_freq_factor=1, high_freq_factor=4, old_context_len=8192, *,
                                       backend="auto"):
    rot = _rotary_dim(q, rotary_dim)
    inv = _llama31_inv_freq(rot, rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len, q.device)
    return _apply(q, k, inv, True, positions=pos_ids, interleaved=interleave, backend=backend)


def _check_cache(cos_sin_cache) -> None:
    if isinstance(cos_sin_cache, torch.Tensor) and cos_sin_cache.dtype != torch.float32:
        raise ValueError("cos_sin_cache should be float32")  # FlashInfer's own check and message


def apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox=True, *, backend="auto"):
    _check_cache(cos_sin_cache)
    return vllm.cache_rope(positions, query, key, head_size, cos_sin_cache, is_neox, False, backend)


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True, *,
                                          backend="auto"):
    _check_cache(cos_sin_cache)
    vllm.cache_rope(positions, query, key, head_size, cos_sin_cache, is_neox, True, backend)
