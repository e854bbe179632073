"""Shared Triton helpers: the interpreter flag and the one dot product every kernel routes through."""
import os

import triton
import triton.language as tl

# Read once, at import, exactly as @triton.jit does.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


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
