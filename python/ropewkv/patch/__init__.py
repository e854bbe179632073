"""Swap ropewkv's fused kernels into code you did not write; every patch returns an undo handle / context manager.

- `ropewkv.patch.transformers(...)`: HF transformers' apply_rotary_pos_emb (Llama family, GPT-NeoX partial rotary),
  its rotary modules swapped for exact fp32 angle tables, the M-RoPE models (Qwen2/2.5/3-VL), and Qwen3's q_norm /
  k_norm fused with RoPE (ropewkv.qk_norm_rope).
- `ropewkv.patch.fla(...)`: flash-linear-attention's chunk_rwkv7 / fused_recurrent_rwkv7 / fused_mul_recurrent_rwkv7 ->
  ropewkv.compat.fla.
"""
from ._fla import fla
from ._handle import PatchHandle
from ._hf import transformers

__all__ = ["PatchHandle", "fla", "transformers"]
