"""nn.Modules built on the fused ops."""
from .rotary import RotaryEmbedding
from .rwkv7 import RWKV7State, RWKV7TimeMix

__all__ = ["RWKV7State", "RWKV7TimeMix", "RotaryEmbedding"]
