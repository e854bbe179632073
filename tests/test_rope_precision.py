"""RoPE fp32 precision with given cos/sin (issue 12, item 3): the compensated difference of products.

Each output is a b - c d (x1 cos - x2 sin, x2 cos + x1 sin). ropewkv/rope.h's diff_of_products recovers the rounding
error of c d exactly with an fma and adds it back: <= 1 ulp at the pair norm against fp64 of the same fp32 inputs,
where two rounded products and a rounded sum reach ~1.5. The CPU twin (and the CUDA twin: the same header) and the
Triton kernel's mirror (_diff_of_products) do the same operations, so they agree bit for bit.

The Triton interpreter has no fma: it takes the product exactly in fp64 and rounds the sum twice (fp64, then fp32).
The error term's fma is exact either way (its result fits in fp32); the other can differ from a true fma by one ulp
of its result only when the fp64 sum lands exactly halfway between two fp32 values, about once in 2^29 random inputs.
The bit-identity check of the first test below runs ~1.3 M outputs, so it flags any systematic difference and, with
odds ~1/400, could meet that tie; on a GPU tl.fma is a true fma and the identity is exact.
"""
import pytest
import torch
import triton
import triton.language as tl

import ropewkv  # noqa: F401  (registers the C++ ops)
from ropewkv import _backend
from ropewkv.reference import rope as reference
from ropewkv.testing import assert_within, max_ulp_error, poisoned_outputs, seeded
from ropewkv.testing import rope as rp
from ropewkv.testing.rope import rotation_ulp_error
from ropewkv.triton_kernels import rope as triton_rope
from ropewkv.triton_kernels._common import INTERPRETING

B, S, HQ, HK, D = 2, 128, 8, 2, 128


def _inputs(seed, rotary_dim):
    gen = seeded(seed)
    q = torch.randn(B, S, HQ, D, generator=gen)
    k = torch.randn(B, S, HK, D, generator=gen)
    # fp32 tables of angles spread over many turns; cos and sin rounded independently (as real tables are)
    angle = torch.rand(B, S, rotary_dim, generator=gen, dtype=torch.float64) * 2000.0
    return q, k, angle.cos().float(), angle.sin().float()


def _oracle(x, cos, sin, rotary_dim, interleaved, conjugate):
    """fp64 rotation of x with the given fp32 tables, each element using the table entry at its own dim."""
    x64, c, s = x.double(), cos.double().unsqueeze(2), sin.double().unsqueeze(2)
    out = x64.clone()
    half = rotary_dim // 2
    ia, ib = (slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)) if interleaved else (slice(0, half),
                                                                                      slice(half, rotary_dim))
    xa, xb = x64[..., ia], x64[..., ib]
    ca, cb, sa, sb = c[..., ia], c[..., ib], s[..., ia], s[..., ib]
    if conjugate:
        sa, sb = -sb, -sa
    out[..., ia] = xa * ca - xb * sa
    out[..., ib] = xb * cb + xa * sb
    return out


def _cpu(q, k, cos, sin, interleaved, conjugate):
    return torch.ops.ropewkv.rope_cos_sin(q, k, cos, sin, interleaved, conjugate, _backend.precision_code("fp32"))


def _triton(device, q, k, cos, sin, interleaved, conjugate):
    """The Triton launcher on `device` (compiled Triton takes CUDA tensors only; interpreted, CPU ones), outputs back
    on the CPU beside the CPU twin's."""
    q, k, cos, sin = (t.to(device) for t in (q, k, cos, sin))
    q_out = torch.full_like(q, float("nan"))
    k_out = torch.full_like(k, float("nan"))
    triton_rope.rope_cos_sin_forward(q, k, q_out, k_out, cos, sin, interleaved, conjugate, False)
    return q_out.cpu(), k_out.cpu()


CASES = [(interleaved, conjugate, rotary_dim) for interleaved in (False, True) for conjugate in (False, True)
         for rotary_dim in (D, 64)]


@pytest.mark.parametrize("interleaved,conjugate,rotary_dim", CASES)
def test_fp32_within_one_ulp_at_the_pair_norm_and_bit_identical(device, interleaved, conjugate, rotary_dim):
    """Both twins within 1 ulp of the fp64 oracle, and the CPU and Triton twins bit for bit the same (one run of each
    serves both checks: the interpreted Triton call is what costs)."""
    q, k, cos, sin = _inputs(1, rotary_dim)
    outputs = {"cpu": _cpu(q, k, cos, sin, interleaved, conjugate),
               "triton": _triton(device, q, k, cos, sin, interleaved, conjugate)}
    for name, outs in outputs.items():
        for out, x in zip(outs, (q, k)):
            err = rotation_ulp_error(out, _oracle(x, cos, sin, rotary_dim, interleaved, conjugate), rotary_dim,
                                     interleaved)
            assert err <= 1.0, f"{name}: {err:.3f} ulp at the pair norm"
    for cpu, triton in zip(outputs["cpu"], outputs["triton"]):
        assert torch.equal(cpu.view(torch.int32), triton.view(torch.int32))


def test_the_bound_discriminates():
    """On the same inputs the plain fp32 form (rounded products, rounded sum) exceeds 1 ulp: the test above would
    fail without the compensation."""
    q, k, cos, sin = _inputs(1, D)
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    half = D // 2
    plain = torch.cat([q[..., :half] * c[..., :half] - q[..., half:] * s[..., :half],
                       q[..., half:] * c[..., half:] + q[..., :half] * s[..., half:]], dim=-1)
    assert rotation_ulp_error(plain, _oracle(q, cos, sin, D, False, False), D, False) > 1.0


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "fp32"),
                                             (torch.bfloat16, "bf16"), (torch.float16, "fp32")])
@pytest.mark.parametrize("interleaved", [False, True])
def test_cpu_and_triton_bit_identical_with_angles(device, dtype, precision, interleaved):
    """Angles computed in the kernel (positions up to 2^20, attention scaling): the same reduction, the same
    polynomial sincos (rope.h's sincos_poly, mirrored by Triton's _sincos) and the same rotation give the same bits.
    S / 2 tokens (8192 angles per case): the interpreted kernel costs per token, and the sincos polynomial itself is
    checked bit for bit over 65k arguments and the quadrant boundaries by the last test."""
    gen = seeded(3)
    seqlen = S // 2
    q = torch.randn(B, seqlen, HQ, D, generator=gen).to(dtype)
    k = torch.randn(B, seqlen, HK, D, generator=gen).to(dtype)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    positions = torch.randint(0, 1 << 20, (B, seqlen), generator=gen)
    scaling = 1.0625
    with poisoned_outputs():
        cpu = torch.ops.ropewkv.rope(q, k, inv_freq, positions, None, None, interleaved, False, scaling,
                                     _backend.precision_code(precision), None, False)
    # Bit-identical twins can share a bug (the polynomial, the reduction): the CPU twin's bits (hence Triton's) are
    # judged against the fp64 oracle too.
    for out, x in zip(cpu, (q, k)):
        ref = reference.rope(x.double(), inv_freq, positions, interleaved=interleaved, attention_scaling=scaling)
        assert_within(rp.rotation_measure("rope angles", "cpu", precision, out, ref,
                                          rp.tolerance(dtype, precision, "cpu", "cpu"), D, interleaved))
    qd, kd, inv_freq_d, positions_d = (t.to(device) for t in (q, k, inv_freq, positions))  # Triton on its device
    q_out, k_out = torch.full_like(qd, float("nan")), torch.full_like(kd, float("nan"))
    triton_rope.rope_forward(qd, kd, q_out, k_out, inv_freq_d, positions_d, None, None, interleaved, False, scaling,
                             precision == "bf16")
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for a, b in zip(cpu, (q_out.cpu(), k_out.cpu())):
        assert torch.equal(a.view(bits), b.view(bits))


@triton.jit
def _sincos_kernel(r_ptr, out_ptr, n, BLOCK: tl.constexpr, INTERPRETING: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    sin, cos = triton_rope._sincos(tl.load(r_ptr + i, mask=mask, other=0.0), INTERPRETING)
    tl.store(out_ptr + i, sin, mask=mask)
    tl.store(out_ptr + n + i, cos, mask=mask)


def test_triton_sincos_mirrors_the_shared_polynomial(device):
    """Triton's _sincos against the CPU twin's sincos_poly (the test hook), bit for bit over |r| <= 3.25 and at the
    quadrant boundaries (ties of the quadrant's rint)."""
    gen = seeded(4)
    boundaries = torch.tensor([k * torch.pi / 4 for k in range(-4, 5)], dtype=torch.float64).float()
    near = torch.cat([torch.nextafter(boundaries, torch.full_like(boundaries, 9.0)), boundaries,
                      torch.nextafter(boundaries, torch.full_like(boundaries, -9.0))])
    r = torch.cat([(torch.rand(1 << 16, generator=gen) * 2 - 1) * 3.25, near, torch.tensor([0.0, 1e-30, -1e-30])])
    out = torch.full((2 * r.numel(),), float("nan"), device=device)
    block = 1 << 12
    _sincos_kernel[(triton.cdiv(r.numel(), block),)](r.to(device), out, r.numel(), BLOCK=block,
                                                     INTERPRETING=INTERPRETING)
    out = out.cpu()
    sin, cos = torch.ops.ropewkv._host_sincos(r)
    assert torch.equal(out[: r.numel()].view(torch.int32), sin.view(torch.int32))
    assert torch.equal(out[r.numel():].view(torch.int32), cos.view(torch.int32))
    # Mirroring the CPU polynomial bit for bit says nothing if the polynomial is wrong: both within 1 ulp of fp64
    # sin/cos (measured max 0.81 ulp (sin), 0.79 (cos); floor at 2^-12 for the arguments near 0).
    assert max_ulp_error(sin, r.double().sin()) <= 1.0
    assert max_ulp_error(cos, r.double().cos()) <= 1.0
