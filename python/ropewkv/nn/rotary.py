"""RotaryEmbedding: HF-compatible inv_freq / attention_scaling (all rope_scaling variants), applied by the fused op."""
from __future__ import annotations

from typing import Optional

import torch

from ..ops.rope import rope
from ..rope_scaling import compute_inv_freq


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embedding for q and k, with HF's rope_scaling variants.

    Args:
        dim: rotary dim (even; <= head_dim, the rest of the head passes through).
        base: rope_theta.
        rope_scaling: HF's rope_parameters dict without rope_theta, e.g. {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}; rope_type one
            of default, linear, dynamic, yarn, llama3, longrope. None: default RoPE. With "mrope_section" (and
            "mrope_interleaved"), as Qwen2-VL / Qwen3-VL configs carry them, it is M-RoPE: positions [3, B, S].
        max_position_embeddings: the model's context length (needed by dynamic, and by yarn/longrope without
            original_max_position_embeddings).
        interleaved: GPT-J pairs (x[2i], x[2i+1]) instead of NeoX halves.
    Attributes:
        inv_freq: fp32 [dim/2] buffer (non-persistent, as in HF), fp32 through module casts (model.to(torch.bfloat16),
            .half()), which move it only; attention_scaling: float multiplying cos and sin.

    Dynamic NTK and longrope depend on the current sequence length (max position + 1), exactly as HF's
    dynamic_rope_update: dynamic regrows inv_freq when the length exceeds what it has seen and resets below
    max_position_embeddings; longrope picks long or short factors per call. Both read the positions' maximum, a device
    sync for CUDA tensors.
    """

    def __init__(self, dim: int, base: float = 10000.0, rope_scaling: Optional[dict] = None,
                 max_position_embeddings: Optional[int] = None, interleaved: bool = False):
        super().__init__()
        self.dim, self.base, self.interleaved = dim, float(base), interleaved
        self.rope_scaling = dict(rope_scaling or {})
        self.rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
        if self.rope_type == "mrope":  # HF's legacy spelling of default RoPE with an mrope_section
            self.rope_type = self.rope_scaling["rope_type"] = "default"
        self.mrope_section = self.rope_scaling.pop("mrope_section", None)
        self.mrope_interleaved = bool(self.rope_scaling.pop("mrope_interleaved", False))
        self.max_position_embeddings = max_position_embeddings
        inv_freq, self.attention_scaling = compute_inv_freq(dim, base, self.rope_scaling, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.original_inv_freq = inv_freq
        self.max_seq_len_cached = max_position_embeddings

    def _apply(self, fn, recurse=True):
        # A cast would round the frequencies (bf16 inv_freq: angles off by whole radians at position 4000); keep the
        # fp32 values, on the device fn moved the buffer to.
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != inv_freq.dtype:
            self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def _update_for(self, seq_len: int) -> None:
        if self.rope_type == "dynamic":
            if seq_len > self.max_seq_len_cached:  # growth, from an int64 tensor as HF's module (fp32 arithmetic)
                inv_freq, self.attention_scaling = compute_inv_freq(self.dim, self.base, self.rope_scaling,
                                                                    self.max_position_embeddings,
                                                                    torch.tensor(seq_len))
                self.inv_freq = inv_freq.to(self.inv_freq.device)
                self.max_seq_len_cached = seq_len
            if seq_len < self.max_position_embeddings < self.max_seq_len_cached:  # reset
                self.inv_freq = self.original_inv_freq.to(self.inv_freq.device)
                self.max_seq_len_cached = self.max_position_embeddings
        elif self.rope_type == "longrope":
            inv_freq, _ = compute_inv_freq(self.dim, self.base, self.rope_scaling, self.max_position_embeddings,
                                           seq_len)
            self.inv_freq.copy_(inv_freq)

    @staticmethod
    def _seq_len(q, layout, positions, seqlen_offsets, cu_seqlens) -> int:
        if positions is not None:
            longest = int(positions.max()) + 1
        elif cu_seqlens is not None:
            longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        else:
            longest = q.shape[{"bshd": 1, "bhsd": 2, "sbhd": 0, "thd": 0}[layout]]
        offset = seqlen_offsets if isinstance(seqlen_offsets, int) else int(seqlen_offsets.max())
        return longest + offset

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: Optional[torch.Tensor] = None, seqlen_offsets=0,
                cu_seqlens: Optional[torch.Tensor] = None, *, layout: Optional[str] = None, inplace: bool = False,
                precision: Optional[str] = None, backend: str = "auto"):
        """Rotate q [B, S, Hq, D] and k [B, S, Hk, D] (layout "bshd"; "thd" [T, H, D] when cu_seqlens is given; any
        layout of ropewkv.rope by keyword). Returns (q, k) in their dtype and layout. See ropewkv.rope."""
        layout = layout or ("thd" if cu_seqlens is not None else "bshd")
        if self.rope_type in ("dynamic", "longrope"):
            self._update_for(self._seq_len(q, layout, positions, seqlen_offsets, cu_seqlens))
        return rope(q, k, inv_freq=self.inv_freq, positions=positions, seqlen_offsets=seqlen_offsets,
                    cu_seqlens=cu_seqlens, layout=layout, interleaved=self.interleaved,
                    attention_scaling=self.attention_scaling, inplace=inplace, precision=precision, backend=backend,
                    mrope_section=self.mrope_section, mrope_interleaved=self.mrope_interleaved)
