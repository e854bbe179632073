"""Triton twin of the RWKV-7 raw decay: log d = -e^{-0.5} * sigmoid(x), computed in fp32."""
import triton
import triton.language as tl

EXP_MINUS_HALF = tl.constexpr(0.60653065971263342)  # e^{-1/2}; jit globals must be constexpr
BLOCK = 1024


@triton.jit
def sigmoid_pair(x):
    """(sigmoid(x), sigmoid(-x)), each relative-precise for any |x| (tl.sigmoid underflows for x << 0)."""
    e = tl.exp(-tl.abs(x))
    big = 1.0 / (1.0 + e)
    small = e / (1.0 + e)
    return tl.where(x >= 0, big, small), tl.where(x >= 0, small, big)


@triton.jit
def log_decay_from_raw(x):
    pos, _ = sigmoid_pair(x)
    return -(pos * EXP_MINUS_HALF)


@triton.jit
def log_decay_from_raw_grad(x):
    pos, neg = sigmoid_pair(x)
    return -(pos * neg * EXP_MINUS_HALF)


@triton.jit
def _log_decay_forward_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, log_decay_from_raw(x), mask=mask)


@triton.jit
def _log_decay_backward_kernel(grad_ptr, x_ptr, grad_x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(grad_x_ptr + offsets, (grad * log_decay_from_raw_grad(x)).to(grad_x_ptr.dtype.element_ty), mask=mask)


def log_decay_forward(x, out):
    """x: contiguous, any float dtype; out: contiguous fp32 of x's shape."""
    n = x.numel()
    if n:
        _log_decay_forward_kernel[(triton.cdiv(n, BLOCK),)](x, out, n, BLOCK=BLOCK)
    return out


def log_decay_backward(grad, x, grad_x):
    """grad: contiguous fp32; x, grad_x: contiguous, x's dtype."""
    n = x.numel()
    if n:
        _log_decay_backward_kernel[(triton.cdiv(n, BLOCK),)](grad, x, grad_x, n, BLOCK=BLOCK)
    return grad_x
