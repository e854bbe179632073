"""Shared Triton helpers: the interpreter flag, the one dot product every kernel routes through, and the exact fp32
building blocks (a single-rounding fma, C's rintf, bf16 rounding) that the shared math headers' polynomials are mirrored with."""
import triton
import triton.language as tl

# Read once, at import, as @triton.jit does, and through Triton's own parser: it takes "true", "on" and "yes" too (with
# == "1", a GPU run under TRITON_INTERPRET=true was interpreted with the compiled paths' fma and dots, wrong there).
INTERPRETING = triton.knobs.runtime.interpret
# The same flag for @triton.jit code to read as a global (jit globals must be constexpr).
INTERPRETING_CONSTEXPR = tl.constexpr(INTERPRETING)


@triton.jit
def dot(a, b, LOW_PRECISION: tl.constexpr, INTERPRETING: tl.constexpr):
    """a @ b with an fp32 result. LOW_PRECISION rounds the operands to bf16 (the tensor-core fast path); fp32 mode
    uses IEEE fp32 products (never the tf32 default). The interpreter computes bf16 dots wrongly, so there the
    operands are rounded to bf16 and multiplied in fp32, which gives the same products."""
    if LOW_PRECISION:
        if INTERPRETING:
            return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32),
                          input_precision="ieee")
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def fma(x, y, z, INTERPRETING: tl.constexpr):
    """x * y + z rounded once (x an fp32 tensor; y, z fp32 tensors or fp32-exact constants). The interpreter's tl.fma
    rounds the product first (numpy has no fma), so there it is done in fp64: the fp32 product is exact there, and the
    sum rounds twice, which can differ from a true fma by one ulp in rare ties (~1 in 2^29)."""
    if INTERPRETING:
        return (x.to(tl.float64) * y + z).to(tl.float32)
    return tl.fma(x, y, z)


@triton.jit
def rint(x):
    """x rounded to the nearest integer, ties to even (C rintf): |x| < 2^23 plus and minus 2^23 rounds at the units
    (exact otherwise, no contraction); larger |x| are integers already."""
    a = tl.abs(x)
    r = tl.where(a < 8388608.0, (a + 8388608.0) - 8388608.0, a)
    return tl.where(x < 0, -r, r)


@triton.jit
def rne_bf16(x):
    """x (fp32) rounded to the nearest bf16, ties to even, kept in fp32; NaN stays NaN. In integer operations, so that
    the interpreter (whose bf16 casts truncate) and the compiled kernels give the same bits."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))
