"""qk_norm_rope inputs, fp64 oracles, tolerances and rows of the parity table.

Metrics: the forward is a rotation of the normalised row, so rotated dims are judged in ulps of the output dtype at the
norm of each pair (ropewkv.testing.rope.rotation_ulp_error); the backward's dx = r (dy w' - n <dy w', n> / D) cancels
by construction, and dw sums over every token and head, so both are judged by the RMS ratio against fp64.

Tolerances (forward, precision="fp32"): the statistics (a sum of D squares, a division, a sqrt and a division: a few
fp32 ulp), the products x r w' (2 roundings), then the rotation (rope.py's fp32 budget).
  - fp32 output: <= 10 ulp at the pair norm (rotation alone: 6).
  - fp16/bf16 output: one rounding of an fp32-accurate value: 0.5 ulp + 2^-12 (bf16) / 2^-9 (fp16) ulp: bounds 0.51
    and 0.53; the Triton interpreter truncates its stores: +1.
precision="bf16" (fp16/bf16 I/O): HF's eager roundings, n and n w (or n (1 + w)) rounded, then cos/sin, two products and
the sum: <= 4 ulp at the pair norm against fp64 (measured ~2); against HF eager itself the kernels agree bit for bit
except where the fp32 statistics (a different summation order) cross a rounding boundary: <= 1 ulp.
Backward (fp32 math in both modes): RMS ratio <= 4e-7 for fp32 (dx and dw), one rounding of dx to fp16/bf16:
the dtype's RMS rounding error (fp16 6e-4, bf16 5e-3); dw stays fp32-accurate (its own RMS bound 1e-6).
"""
from __future__ import annotations

import torch

from ..reference import qk_norm_rope as reference
from ..reference import rope as rope_reference
from . import DTYPE_NAMES, Measurement, Tolerance, rms_ratio, run_backends, seeded
from .rope import rope_input, rope_inv_freq, rotation_ulp_error

FORWARD = {
    torch.float32: Tolerance(max_ulp=10, rms=4e-7, why="fp32 statistics + norm + rotation"),
    torch.float16: Tolerance(max_ulp=0.53, rms=3e-4, why="fp32 math, one rounding to fp16"),
    torch.bfloat16: Tolerance(max_ulp=0.51, rms=2.5e-3, why="fp32 math, one rounding to bf16"),
}
LOW_FORWARD = {
    torch.float16: Tolerance(max_ulp=4, rms=1.5e-3, why="HF eager fp16: n, n w, cos/sin, products, sum rounded"),
    torch.bfloat16: Tolerance(max_ulp=4, rms=1.2e-2, why="HF eager bf16: n, n w, cos/sin, products, sum rounded"),
}
BACKWARD_DX = {
    torch.float32: Tolerance(max_ulp=None, rms=4e-7, why="fp32 backward"),
    torch.float16: Tolerance(max_ulp=None, rms=6e-4, why="fp32 backward, dx rounded to fp16"),
    torch.bfloat16: Tolerance(max_ulp=None, rms=5e-3, why="fp32 backward, dx rounded to bf16"),
}
BACKWARD_DW = Tolerance(max_ulp=None, rms=1e-6, why="fp32 partial sums over 16-token chunks")


def tolerance(dtype: torch.dtype, precision: str, backend: str, device) -> Tolerance:
    """The forward bound for `backend` producing `dtype` at `precision`; +1 ulp for interpreted Triton."""
    base = LOW_FORWARD.get(dtype) if precision == "bf16" else None
    base = base or FORWARD[dtype]
    if backend == "triton" and torch.device(device).type == "cpu" and dtype != torch.float32:
        return Tolerance(base.max_ulp + 1, base.rms * 2, base.why + "; interpreter truncates (+1 ulp)")
    return base


def norm_weight(head_dim: int, weight_offset: float, generator: torch.Generator, device="cpu") -> torch.Tensor:
    """A trained-looking norm weight: around 1 (Qwen3, offset 0) or around 0 (Gemma-3, offset 1), fp32."""
    centre = 1.0 - weight_offset
    return (centre + 0.3 * torch.randn(head_dim, dtype=torch.float64, generator=generator)).float().to(device)


def oracle(x4: torch.Tensor, weight, eps: float, cos: torch.Tensor, sin: torch.Tensor, weight_offset: float = 0.0,
           interleaved: bool = False) -> torch.Tensor:
    """fp64 result for a [B, S, H, D] view x4 and full-width [B, S, R] tables (weights None: plain RoPE)."""
    return reference.qk_norm_rope(x4.double().cpu(), None if weight is None else weight.double().cpu(), eps,
                                  cos.double().cpu().unsqueeze(2), sin.double().cpu().unsqueeze(2),
                                  weight_offset=weight_offset, interleaved=interleaved)


def angle_tables(positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool = False, scaling: float = 1.0):
    """fp64 full-width cos, sin [..., R] of positions * inv_freq."""
    cos, sin = rope_reference.cos_sin(positions.cpu(), inv_freq.double().cpu(), scaling, torch.float64)
    return reference.full_table(cos, interleaved), reference.full_table(sin, interleaved)


def parity_rows(device, seed: int = 0):
    """fwd (q, k) and bwd (dq, dk, dq_weight, dk_weight) of every backend x dtype x precision: GQA (4 q heads, 2 kv
    heads), head_dim 80 with rotary_dim 64 (partial: normalised but unrotated dims too), NeoX pairs, Qwen3 weights
    (offset 0) for fp32 and bf16, Gemma-3 (offset 1) for fp16, per-batch offsets."""
    from ..ops.qk_norm_rope import qk_norm_rope

    batch, seqlen, hq, hk, dim, rot, eps = 2, 12, 4, 2, 80, 64, 1e-6
    for dtype, offset in ((torch.float32, 0.0), (torch.float16, 1.0), (torch.bfloat16, 0.0)):
        gen = seeded(seed)
        q = rope_input(batch, seqlen, hq, dim, dtype, "bshd", gen, device) * 3
        k = rope_input(batch, seqlen, hk, dim, dtype, "bshd", gen, device) * 3
        wq, wk = norm_weight(dim, offset, gen, device), norm_weight(dim, offset, gen, device)
        cot_q = torch.randn(q.shape, dtype=torch.float64, generator=gen).to(dtype).to(device)
        cot_k = torch.randn(k.shape, dtype=torch.float64, generator=gen).to(dtype).to(device)
        inv = rope_inv_freq(rot, device=device)
        offsets = torch.tensor([3, 1000], device=device)
        cos, sin = angle_tables(rope_reference.token_positions(batch, seqlen, None, offsets.cpu()), inv)
        leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, wq, wk)]
        ref_q = oracle(leaves[0], leaves[2], eps, cos, sin, offset)
        ref_k = oracle(leaves[1], leaves[3], eps, cos, sin, offset)
        ref_grads = torch.autograd.grad((ref_q, ref_k), leaves, (cot_q.cpu().double(), cot_k.cpu().double()))
        for precision in ("fp32", "bf16"):

            def call(backend):
                inputs = [t.detach().clone().requires_grad_() for t in (q, k, wq, wk)]
                oq, ok = qk_norm_rope(*inputs, eps, weight_offset=offset, inv_freq=inv, seqlen_offsets=offsets,
                                      precision=precision, backend=backend)
                return (oq, ok, *torch.autograd.grad((oq, ok), inputs, (cot_q, cot_k)))

            for backend, (oq, ok, *grads) in run_backends(call, device).items():
                tol = tolerance(dtype, precision, backend, device)
                for name, out, ref in (("qk_norm_rope fwd q", oq, ref_q), ("qk_norm_rope fwd k", ok, ref_k)):
                    yield Measurement(name, backend, DTYPE_NAMES[dtype], precision,
                                      rotation_ulp_error(out, ref, rot, False), rms_ratio(out, ref), tol)
                for name, got, ref in zip(("dq", "dk", "dq_weight", "dk_weight"), grads, ref_grads):
                    bound = BACKWARD_DX[dtype] if name in ("dq", "dk") else BACKWARD_DW
                    yield Measurement(f"qk_norm_rope bwd {name}", backend, DTYPE_NAMES[dtype], precision, 0.0,
                                      rms_ratio(got, ref), bound)
