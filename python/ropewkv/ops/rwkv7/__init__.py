"""RWKV-7 WKV ops, one file per algorithm (as FLA's fla/ops/rwkv7/):

  api.py        validation shared by every entry point, and the public `wkv7`;
  recurrent.py  the sequential-over-T algorithm: the C++ ops (CPU twin, CUDA twin) and the Triton twin;
  decode.py     `wkv7_step`, one token with the state updated in place.

The math: ropewkv.reference.rwkv7 (the fp64 oracle) and csrc/include/ropewkv/wkv7.h (the shared header).
"""
from .api import CUDA_HEAD_SIZES, DECAYS, HEAD_SIZES, wkv7
from .decode import wkv7_step
from .recurrent import CHECKPOINT_EVERY

__all__ = ["CHECKPOINT_EVERY", "CUDA_HEAD_SIZES", "DECAYS", "HEAD_SIZES", "wkv7", "wkv7_step"]
