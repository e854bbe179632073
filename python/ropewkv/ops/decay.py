"""rwkv7_log_decay: the fused RWKV-7 decay, raw pre-activation -> log decay in fp32 (the FLA #181 fix as a kernel).

The C++ op `ropewkv::log_decay` (CPU twin in _C, CUDA twin in _C_cuda) and the Triton op `ropewkv::log_decay_triton`
are opaque custom ops with fake kernels and autograd, so they run under torch.compile(fullgraph=True). Neither has an
autocast kernel, so autocast passes the input through untouched and the kernel upcasts it: the math is fp32 always.
"""
from __future__ import annotations

import torch

from .. import _backend, _checks
from ..reference import rwkv7 as reference


@torch.library.custom_op("ropewkv::log_decay_triton", mutates_args=())
def _log_decay_triton(x: torch.Tensor) -> torch.Tensor:
    from ..triton_kernels import decay as kernels

    x = x.contiguous()
    return kernels.log_decay_forward(x, _backend.new_output(x.shape, torch.float32, x.device))


@torch.library.custom_op("ropewkv::log_decay_backward_triton", mutates_args=())
def _log_decay_backward_triton(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    from ..triton_kernels import decay as kernels

    x = x.contiguous()
    grad = grad.to(torch.float32).contiguous()
    return kernels.log_decay_backward(grad, x, _backend.new_output(x.shape, x.dtype, x.device))


def _fake_forward(x):
    return x.new_empty(x.shape, dtype=_backend.compute_dtype(x.dtype))


def _fake_backward(grad, x):
    return x.new_empty(x.shape)  # contiguous whatever x's strides, as the twins' outputs


def _double_backward(ctx, grad_grad_x):
    """The backward op's own backward (create_graph=True: Hessians, gradient penalties), in eager fp32 (fp64) ops.
    With e = e^{-|x|}: grad_x = grad * f'(x), f' = -e^{-1/2} e / (1+e)^2, f'' = e^{-1/2} e / (1+e)^2 * tanh(x/2)."""
    grad, x = ctx.saved_tensors
    x_math = x.to(_backend.compute_dtype(x.dtype))
    e = torch.exp(-x_math.abs())
    slope = reference.EXP_MINUS_HALF * e / (1 + e) ** 2
    gg = grad_grad_x.to(x_math.dtype)
    return (-gg * slope).to(grad.dtype), (gg * grad * slope * torch.tanh(x_math / 2)).to(x.dtype)


def _register(forward: str, backward: str) -> None:
    torch.library.register_fake(forward)(_fake_forward)
    torch.library.register_fake(backward)(_fake_backward)
    backward_op = getattr(torch.ops.ropewkv, backward.split("::")[1])

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def grad_fn(ctx, grad):
        (x,) = ctx.saved_tensors
        return backward_op(grad, x)

    def setup_backward_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    torch.library.register_autograd(forward, grad_fn, setup_context=setup_context)
    # Without it the C++ twins' double backward silently dropped f'' (a warning only), the Triton twin's raised.
    torch.library.register_autograd(backward, _double_backward, setup_context=setup_backward_context)


_register("ropewkv::log_decay_triton", "ropewkv::log_decay_backward_triton")
if _backend._C is not None:
    _register("ropewkv::log_decay", "ropewkv::log_decay_backward")


def rwkv7_log_decay(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """RWKV-7's decay from the raw LoRA pre-activation: log d = -e^{-0.5} * sigmoid(x).

    Args:
        x: any shape, fp32/fp16/bf16 (fp64 on the cpu/reference backends), any device the backend supports.
        backend: "auto" | "cuda" | "triton" | "cpu" | "reference".
    Returns:
        log d, fp32 (fp64 for fp64 input), x's shape. In (-e^{-0.5}, 0): the "log" decay convention of FLA and HF.
        Feed it to wkv7(..., decay="log"), or use wkv7(..., decay="raw") to fuse this step into the recurrence.

    The math is fp32 whatever x's dtype and under autocast (FLA #181: bf16 sigmoid under autocast lost precision),
    and stays relative-precise for large |x| (no 1/(1+e^{-x}) overflow). The backward returns grad_x in x's dtype.
    """
    _checks.check_tensor(x, "x")
    resolved = _backend.resolve_backend(backend, x.device)
    _checks.check_float(x, "x", resolved)
    if resolved == "reference":
        return reference.rwkv7_log_decay(x.to(_backend.compute_dtype(x.dtype)))
    if resolved == "triton":
        return _log_decay_triton(x)
    return torch.ops.ropewkv.log_decay(x)
