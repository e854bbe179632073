"""Triton twin of the RWKV-7 raw decay: log d = -e^{-0.5} * sigmoid(x), computed in fp32.

The math is ropewkv/decay.h's, operation for operation: e^x by its exp_poly (not tl.exp, which compiles to
ex2.approx(x * log2 e) and loses ~|x| ulps: 18 ulps at x = -87 on an H200) and correctly rounded divisions (tl.div_rn:
Triton's `/` compiles to the approximate div.full.f32), so the CPU and Triton twins compute the same fp32 bits (launched without a*b+c contraction, which would fuse
1 + e^x's last product).
"""
import triton
import triton.language as tl

from ._common import INTERPRETING_CONSTEXPR as _INTERPRETING, fma, rint
from .rope import _round_to

EXP_MINUS_HALF = tl.constexpr(0.60653065971263342)  # e^{-1/2}; jit globals must be constexpr
# exp_poly's constants (ropewkv/decay.h) as the fp32 values its literals round to: 1/ln2, ln2 = C1 + C2, Cephes' expf
# coefficients.
LOG2_E = tl.constexpr(float.fromhex("0x1.715476p+0"))
LN2_C1 = tl.constexpr(0.693359375)
LN2_C2 = tl.constexpr(float.fromhex("-0x1.bd0106p-13"))
EXP_P0 = tl.constexpr(float.fromhex("0x1.a0d2cep-13"))
EXP_P1 = tl.constexpr(float.fromhex("0x1.6e879cp-10"))
EXP_P2 = tl.constexpr(float.fromhex("0x1.111210p-7"))
EXP_P3 = tl.constexpr(float.fromhex("0x1.555382p-5"))
EXP_P4 = tl.constexpr(float.fromhex("0x1.555554p-3"))
EXP_P5 = tl.constexpr(0.5)  # 5.0000001201e-1f rounds to 0.5
BLOCK = 1024


@triton.jit
def _power_of_two(n):
    """2^n as fp32 bits, for integer n in [-126, 127]."""
    return ((n + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def exp_poly(x):
    """e^x in fp32: ropewkv/decay.h's exp_poly (Cody-Waite reduction, Cephes' polynomial in fma Horner form, times 2^n
    as two exact powers of two), the same operations in the same order. NaN stays NaN."""
    x = tl.where(x < -104.0, -104.0, tl.where(x > 89.0, 89.0, x))
    n = rint(x * LOG2_E)
    r = fma(-n, LN2_C1, x, _INTERPRETING)
    r = fma(-n, LN2_C2, r, _INTERPRETING)
    p = fma(r, EXP_P0, EXP_P1, _INTERPRETING)
    p = fma(p, r, EXP_P2, _INTERPRETING)
    p = fma(p, r, EXP_P3, _INTERPRETING)
    p = fma(p, r, EXP_P4, _INTERPRETING)
    p = fma(p, r, EXP_P5, _INTERPRETING)
    p = fma(p * r, r, r, _INTERPRETING) + 1.0
    whole = tl.where(n == n, n, 0.0).to(tl.int32)  # in [-150, 128]
    half = whole >> 1
    return p * _power_of_two(half) * _power_of_two(whole - half)


@triton.jit
def exp_minus_abs(x):
    """e^{-|x|} in (0, 1] (NaN stays NaN): sigmoid and its derivative below are formed from it (ropewkv/decay.h)."""
    return exp_poly(-tl.abs(x))


@triton.jit
def log_decay_from_raw(x):
    """-e^{-1/2} sigmoid(x), sigmoid relative-precise for any x (tl.sigmoid underflows for x << 0): ropewkv/decay.h's
    operations in its order, the same fp32 bits."""
    e = exp_minus_abs(x)
    return -(tl.div_rn(tl.where(x >= 0, 1.0, e), 1.0 + e) * EXP_MINUS_HALF)


@triton.jit
def log_decay_from_raw_grad(x):
    """-e^{-1/2} sigmoid(x) sigmoid(-x) = -e^{-1/2} e / (1 + e)^2, e = e^{-|x|} (ropewkv/decay.h's order)."""
    e = exp_minus_abs(x)
    one_plus_e = 1.0 + e
    return -tl.div_rn(e * EXP_MINUS_HALF, one_plus_e * one_plus_e)  # (negating before or after: the same bits)


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
    # Rounded to nearest even: the interpreter's bf16 stores truncate, and the CPU twin rounds.
    grad_x = _round_to(grad * log_decay_from_raw_grad(x), grad_x_ptr.dtype.element_ty, _INTERPRETING)
    tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)


def log_decay_forward(x, out):
    """x: contiguous, any float dtype; out: contiguous fp32 of x's shape."""
    n = x.numel()
    if n:
        _log_decay_forward_kernel[(triton.cdiv(n, BLOCK),)](x, out, n, BLOCK=BLOCK, enable_fp_fusion=False)
    return out


def log_decay_backward(grad, x, grad_x):
    """grad: contiguous fp32; x, grad_x: contiguous, x's dtype."""
    n = x.numel()
    if n:
        _log_decay_backward_kernel[(triton.cdiv(n, BLOCK),)](grad, x, grad_x, n, BLOCK=BLOCK,
                                                             enable_fp_fusion=False)
    return grad_x
