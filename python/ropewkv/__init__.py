"""ropewkv: precise fused RoPE and RWKV-7 kernels for PyTorch, each in three twins (Triton, CUDA, CPU C++).

Math is fp32 (or better) by default whatever the input dtype and autocast; outputs keep the input dtype; every op's
error against an fp64 oracle is measured (`python -m ropewkv parity`).
"""
from ._backend import BackendUnavailableError, available_backends, build_precision
from .ops.decay import rwkv7_log_decay

__version__ = "0.1.0"

__all__ = ["BackendUnavailableError", "available_backends", "build_precision", "rwkv7_log_decay"]
