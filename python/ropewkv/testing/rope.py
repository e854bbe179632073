"""RoPE inputs for tests and the parity table."""
from __future__ import annotations

import torch

from ..reference import rope as reference
from ..reference.rope import default_inv_freq
from . import DTYPE_NAMES, MANTISSA_BITS, Measurement, Tolerance, _error, rms_ratio, run_backends, seeded, ulp

PHYSICAL_SHAPE = {
    "bshd": lambda b, s, h, d: (b, s, h, d),
    "bhsd": lambda b, s, h, d: (b, h, s, d),
    "sbhd": lambda b, s, h, d: (s, b, h, d),
}


def rope_input(batch: int, seqlen: int, heads: int, head_dim: int, dtype: torch.dtype, layout: str = "bshd",
               generator: torch.Generator = None, device="cpu") -> torch.Tensor:
    """Activations like q or k: N(0, 1), drawn in fp64 and rounded to `dtype`, stored in `layout`'s memory order
    ([T, H, D] with T = batch * seqlen for "thd")."""
    shape = (batch * seqlen, heads, head_dim) if layout == "thd" else PHYSICAL_SHAPE[layout](batch, seqlen, heads,
                                                                                             head_dim)
    return torch.randn(shape, dtype=torch.float64, generator=generator).to(dtype).to(device)


def rope_inv_freq(rotary_dim: int, base: float = 10000.0, device="cpu") -> torch.Tensor:
    """HF's default inv_freq in fp32, as models hold it."""
    return default_inv_freq(rotary_dim, base).to(device)


# ----------------------------------------------------------------------------------------------------------------------
# Error metric. A rotation maps the pair (x_a, x_b) to (x_a c - x_b s, x_b c + x_a s): each output's error is
# relative to the pair's norm |(x_a, x_b)| (which the rotation preserves), not to the output itself, which can cancel to
# ~0. So rotated dims are judged in ulps of the output dtype at the pair norm (rotation_ulp_error); pass-through dims
# at their own magnitude (they must be bit-exact: any error there is >= 1 ulp).
#
# Tolerances (ulps of the output dtype at the pair norm; RMS ratio against the fp64 oracle):
# precision="fp32": fp32 angle (< 1e-6 rad at 2^20, ~1 ulp at these positions), sincos ~1 ulp, two products and a sum
#   (0.5 ulp each), then one rounding to the output dtype.
#  - fp32 output: measured <= 3.9 ulp at positions ~1000 (the reduced angle is then near pi, where its roundings are
#    largest), bound 6.
#  - fp16/bf16 output: the fp32 error is 2^-13 (bf16) / 2^-10 (fp16) of an output ulp: one final rounding, 0.5 ulp
#    plus that sliver: bound 0.51 (fp16 0.52). The Triton interpreter truncates instead of rounding: 1 ulp more.
# precision="bf16" (fp16/bf16 I/O): HF's eager arithmetic: cos and sin rounded to the I/O type (0.5 ulp each, times
#   |x|), both products rounded (0.5 ulp each), the sum rounded (0.5 ulp): <= 3 ulp of the pair norm; bound 3. The
#   interpreter truncates the final store: +1. fp32 I/O has no low mode (identical to fp32).
# Backward: the same kernel on the cotangent (conjugated rotation), so the same bounds.
FP32_MATH = {
    torch.float32: Tolerance(max_ulp=6, rms=2e-7, why="fp32 angle + sincos + 3 roundings"),
    torch.float16: Tolerance(max_ulp=0.52, rms=3e-4, why="fp32 math, one rounding to fp16"),
    torch.bfloat16: Tolerance(max_ulp=0.51, rms=2.5e-3, why="fp32 math, one rounding to bf16"),
    torch.float64: Tolerance(max_ulp=8, rms=1e-15, why="fp64 math on the cpu twin (gradcheck path)"),
}
LOW_MATH = {
    torch.float16: Tolerance(max_ulp=3, rms=1e-3, why="HF eager fp16: cos/sin, 2 products, sum rounded to fp16"),
    torch.bfloat16: Tolerance(max_ulp=3, rms=8e-3, why="HF eager bf16: cos/sin, 2 products, sum rounded to bf16"),
}


def rotation_ulp_error(out: torch.Tensor, ref: torch.Tensor, rotary_dim: int, interleaved: bool) -> float:
    """Max error in ulps of out's dtype at each rotated pair's norm (pass-through dims: at their own magnitude).
    out and ref have the head dim last; ref is the fp64 oracle. NaN (unwritten, poisoned) counts as infinite."""
    if out.numel() == 0:
        return 0.0
    ref64 = ref.detach().to(torch.float64).cpu()
    scale = ref64.abs().clone()
    half = rotary_dim // 2
    a = ref64[..., 0:rotary_dim:2] if interleaved else ref64[..., :half]
    b = ref64[..., 1:rotary_dim:2] if interleaved else ref64[..., half:rotary_dim]
    norm = torch.sqrt(a * a + b * b)
    for part in ((slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)) if interleaved
                 else (slice(0, half), slice(half, rotary_dim))):
        scale[..., part] = norm
    return float((_error(out, ref) / ulp(out.dtype, scale)).max())


# The RMS bounds above are statistical: over many outputs, roundings average out. On a tensor of a few outputs they can
# all round the same way (hypothesis found 20 bf16 outputs, each within 0.497 ulp, at an RMS ratio of 2.65e-3 > 2.5e-3),
# so below RMS_MIN_ELEMENTS the RMS bound is the one the ulp bound implies for any size: each output's error is at most
# max_ulp ulps of its pair norm |p|, an ulp is at most 2^-mantissa |p|, so each pair's error norm is at most
# sqrt(2) max_ulp 2^-mantissa |p|, and summing over pairs, the RMS ratio is at most sqrt(2) max_ulp 2^-mantissa.
RMS_MIN_ELEMENTS = 1024


def rotation_measure(op: str, backend: str, precision: str, out, ref, tolerance: Tolerance, rotary_dim: int,
                     interleaved: bool) -> Measurement:
    if out.numel() < RMS_MIN_ELEMENTS and None not in (tolerance.max_ulp, tolerance.rms):
        worst_rms = 2**0.5 * tolerance.max_ulp * 2.0 ** -MANTISSA_BITS[out.dtype]
        tolerance = Tolerance(tolerance.max_ulp, max(tolerance.rms, worst_rms),
                              tolerance.why + f"; rms bound implied by the ulp bound below {RMS_MIN_ELEMENTS} outputs")
    return Measurement(op, backend, DTYPE_NAMES[out.dtype], precision,
                       rotation_ulp_error(out, ref, rotary_dim, interleaved), rms_ratio(out, ref), tolerance)


def tolerance(dtype: torch.dtype, precision: str, backend: str, device) -> Tolerance:
    """The bound for `backend` producing `dtype` at `precision` on `device`; +1 ulp for interpreted Triton
    (it truncates fp32 -> bf16/fp16 stores)."""
    base = LOW_MATH.get(dtype) if precision == "bf16" else None
    base = base or FP32_MATH[dtype]
    interpreted = backend == "triton" and torch.device(device).type == "cpu"
    if interpreted and dtype in (torch.float16, torch.bfloat16):
        return Tolerance(base.max_ulp + 1, base.rms * 2, base.why + "; interpreter truncates (+1 ulp)")
    return base


# ----------------------------------------------------------------------------------------------------------------------
# A case: inputs, the fp64 reference (forward and backward), and the call for a backend.


def reference_positions(batch, seqlen, positions=None, seqlen_offsets=0, cu_seqlens=None, layout="bshd"):
    """Positions as the reference defines them, shaped for reference.rope ([B, S], or [T] for thd)."""
    if layout == "thd":
        total = seqlen * batch
        if cu_seqlens is None:
            pos = reference.token_positions(1, total, positions, seqlen_offsets).view(total)
        else:
            pos = reference.token_positions(1, total, positions, seqlen_offsets, cu_seqlens)
        return pos
    return reference.token_positions(batch, seqlen, positions, seqlen_offsets)


def rope_reference64(x, inv_freq, positions, layout="bshd", interleaved=False, attention_scaling=1.0, head_dim=None):
    """fp64 oracle of ropewkv.rope(x) with the (already resolved) positions; partial rotary via len(inv_freq)."""
    return reference.rope(x.detach().to(torch.float64).cpu(), inv_freq.cpu(), positions, layout=layout,
                          interleaved=interleaved, attention_scaling=attention_scaling)


def parity_rows(device, seed: int = 0):
    """rope fwd/bwd and apply_rotary_pos_emb fwd, every backend x dtype x precision: GQA (4 q heads, 2 kv heads),
    head_dim 80 with rotary_dim 64 (partial), interleaved, per-batch offsets."""
    from ..ops.rope import apply_rotary_pos_emb, rope

    batch, seqlen, hq, hk, dim, rot = 2, 12, 4, 2, 80, 64
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        gen = seeded(seed)
        q = rope_input(batch, seqlen, hq, dim, dtype, "bshd", gen, device)
        k = rope_input(batch, seqlen, hk, dim, dtype, "bshd", gen, device)
        cot_q = torch.randn(q.shape, dtype=torch.float64, generator=gen).to(dtype).to(device)
        cot_k = torch.randn(k.shape, dtype=torch.float64, generator=gen).to(dtype).to(device)
        inv = rope_inv_freq(rot, device=device)
        offsets = torch.tensor([3, 1000], device=device)
        pos = reference_positions(batch, seqlen, None, offsets.cpu())
        q64, k64 = (t.detach().to(torch.float64).cpu().requires_grad_() for t in (q, k))
        ref_q = reference.rope(q64, inv.cpu(), pos, interleaved=True)
        ref_k = reference.rope(k64, inv.cpu(), pos, interleaved=True)
        grad_q, grad_k = torch.autograd.grad((ref_q, ref_k), (q64, k64), (cot_q.cpu().double(), cot_k.cpu().double()))
        # apply_rotary_pos_emb: an fp32 HF table [B, S, R] (NeoX), the oracle fed the same table in fp64.
        cos, sin = reference.cos_sin(pos, inv.cpu(), 1.0, torch.float64)
        cos32, sin32 = (torch.cat((t, t), -1).to(torch.float32) for t in (cos, sin))
        qh, kh = q.transpose(1, 2), k.transpose(1, 2)
        ref_hq, _ = reference.hf_apply_rotary_pos_emb(qh.double().cpu(), kh.double().cpu(), cos32.double(),
                                                      sin32.double())
        for precision in ("fp32", "bf16"):

            def call(backend):
                qb, kb = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
                oq, ok = rope(qb, kb, inv_freq=inv, seqlen_offsets=offsets, interleaved=True, precision=precision,
                              backend=backend)
                gq, gk = torch.autograd.grad((oq, ok), (qb, kb), (cot_q, cot_k))
                hq_out, _ = apply_rotary_pos_emb(qh, kh, cos32.to(device), sin32.to(device), precision=precision,
                                                 backend=backend)
                return oq, ok, gq, gk, hq_out

            for backend, (oq, ok, gq, gk, hq_out) in run_backends(call, device).items():
                tol = tolerance(dtype, precision, backend, device)
                for name, out, ref, style in (("rope fwd q", oq, ref_q, True), ("rope fwd k", ok, ref_k, True),
                                              ("rope bwd q", gq, grad_q, True), ("rope bwd k", gk, grad_k, True),
                                              ("apply_rotary_pos_emb fwd", hq_out, ref_hq, False)):
                    yield rotation_measure(name, backend, precision, out, ref, tol, rot, style)
