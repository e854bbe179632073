"""Eager PyTorch references: readable, runnable in fp64, the oracle of every test."""
from . import rope, rwkv7

__all__ = ["rope", "rwkv7"]
