"""nn.Modules built on the fused ops."""
from .rotary import RotaryEmbedding

__all__ = ["RotaryEmbedding"]
