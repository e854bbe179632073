"""Eager PyTorch references: readable, runnable in fp64, the oracle of every test."""
from . import qk_norm_rope, rope, rwkv7

__all__ = ["qk_norm_rope", "rope", "rwkv7"]
