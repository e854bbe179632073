"""Drop-in replacements with other libraries' argument orders and conventions: compat.fla (flash-linear-attention),
compat.vllm and compat.flashinfer (the serving libraries' RoPE and fused QK-norm + RoPE signatures)."""
from . import fla, flashinfer, vllm

__all__ = ["fla", "flashinfer", "vllm"]
