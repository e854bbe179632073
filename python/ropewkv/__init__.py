"""ropewkv: precise fused RoPE and RWKV-7 kernels for PyTorch, each in three twins (Triton, CUDA, CPU C++).

Math is fp32 (or better) by default whatever the input dtype and autocast; outputs keep the input dtype; every op's
error against an fp64 oracle is measured (`python -m ropewkv parity`).
"""
from . import compat, distributed, nn, patch
from ._backend import BackendUnavailableError, available_backends, build_precision
from .nn import RotaryEmbedding
from .ops.decay import rwkv7_log_decay
from .ops.qk_norm_rope import qk_norm_rope
from .ops.rope import apply_rotary_pos_emb, rope
from .ops.rwkv7 import wkv7, wkv7_step

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "RotaryEmbedding",
    "apply_rotary_pos_emb",
    "available_backends",
    "build_precision",
    "compat",
    "distributed",
    "nn",
    "patch",
    "qk_norm_rope",
    "rope",
    "rwkv7_log_decay",
    "wkv7",
    "wkv7_step",
]
