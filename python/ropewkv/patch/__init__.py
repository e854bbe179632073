"""Swap ropewkv's fused kernels into code you did not write; every patch returns an undo handle / context manager.

- `ropewkv.patch.transformers(...)`: HF transformers' apply_rotary_pos_emb (Llama family, GPT-NeoX partial rotary).
- `ropewkv.patch.fla(...)`: flash-linear-attention's chunk_rwkv7 / fused_recurrent_rwkv7 / fused_mul_recurrent_rwkv7 ->
  ropewkv.compat.fla.
"""
from ._fla import fla
from ._handle import PatchHandle
from ._hf import transformers

__all__ = ["PatchHandle", "fla", "transformers"]
