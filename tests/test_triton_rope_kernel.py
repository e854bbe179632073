"""The Triton RoPE launchers called directly (interpreter on CPU, compiled on a GPU) against the fp64 references.

Error metrics (measured under the interpreter, B2 S64 H4 D128, positions < 2^20: fp32 4.4 ulp at the pair norm before
ropefast, 4.1 since (the CPU twin's bits: same sincos polynomial, compensated rotation);
fp16/bf16 0.50 ulp at the pair norm and at most 0.86 (fp16) / 0.52 (bf16) ulp by max_ulp_error):
  - rotation_ulp_error: ulps of the output dtype at the norm of each rotated pair. A rotated element can cancel to
    ~0 while its inputs are O(1), so ulps at the element itself measure cancellation, not the kernel. fp32 bound,
    per element: cos/sin of the reduced angle (<= 2 roundings of |r| <= pi, <= 2^-22 rad, ~4 ulp at the norm;
    the shared sincos_poly: <= 0.85 ulp), the compensated difference of products (1 ulp): 8 ulp, with margin.
    fp16/bf16: fp32 math then one round-to-nearest-even store: 0.5 ulp + the fp32 error (8 fp32 ulp = 2^-10 fp16
    ulp): 0.51. The kernel rounds bf16 itself under the interpreter, whose own casts truncate, so the bounds hold
    there too.
  - max_ulp_error (fp16/bf16 outputs): 0.5 ulp for the store plus the fp32 error judged at the metric's floor
    (2^-12 of max |ref|), where an fp16 ulp is only ~2^-22 of max |ref|, i.e. comparable to the fp32 error: 1.5 ulp
    (the foundation's bound for one final rounding).
"""
import math
import re

import pytest
import torch

from ropewkv.reference import rope as reference
from ropewkv.testing import max_ulp_error, seeded, ulp
from ropewkv.testing.rope import rope_input, rope_inv_freq
from ropewkv.triton_kernels import rope as kernels
from triton_sm90 import captured_launches, compile_for_sm90, ptx_for_sm90, run_without_interpreter

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP32_PAIR_ULP = 8.0
HALF_PRECISION_PAIR_ULP = 0.51
HALF_PRECISION_ULP = 1.5


def poisoned(x):
    return torch.full_like(x, float("nan")) if x is not None else None


def rope(q, k, inv_freq, *, positions=None, offsets=None, cu_seqlens=None, interleaved=False, conjugate=False,
         scaling=1.0, low_precision=False, q_out=None, k_out=None):
    """rope_forward into NaN-poisoned outputs (or the given ones); returns (q_out, k_out)."""
    q_out = poisoned(q) if q_out is None else q_out
    k_out = poisoned(k) if k_out is None else k_out
    kernels.rope_forward(q, k, q_out, k_out, inv_freq, positions, offsets, cu_seqlens, interleaved, conjugate, scaling,
                         low_precision)
    return q_out, k_out


def rotation_ulp_error(out, ref, rotary_dim, interleaved):
    """max |out - ref| in ulps of out's dtype at the norm of each element's rotated pair (|ref| past rotary_dim)."""
    ref = ref.detach().to(torch.float64).cpu()
    rot = ref[..., :rotary_dim]
    if interleaved:
        norm = rot.unflatten(-1, (-1, 2)).norm(dim=-1).repeat_interleave(2, dim=-1)
    else:
        norm = rot.unflatten(-1, (2, -1)).norm(dim=-2).repeat(*([1] * (rot.dim() - 1)), 2)
    scale = torch.cat((norm, ref[..., rotary_dim:].abs()), dim=-1)
    err = (out.detach().to(torch.float64).cpu() - ref).abs().nan_to_num(float("inf"))
    return float((err / ulp(out.dtype, scale)).max())


def assert_close_to(out, ref, rotary_dim, interleaved):
    if out.dtype == torch.float32:
        err = rotation_ulp_error(out, ref, rotary_dim, interleaved)
        assert err <= FP32_PAIR_ULP, f"fp32: {err:.3g} ulp at the pair norm"
    else:
        err = rotation_ulp_error(out, ref, rotary_dim, interleaved)
        assert err <= HALF_PRECISION_PAIR_ULP, f"{out.dtype}: {err:.3g} ulp at the pair norm"
        err = max_ulp_error(out, ref)
        assert err <= HALF_PRECISION_ULP, f"{out.dtype}: {err:.3g} ulp"


def hf_reference(q, k, cos, sin, interleaved):
    """HF apply_rotary_pos_emb (in the inputs' dtype) on [B, S, H, D] with tables [B, S, R]. GPT-J style is HF's
    rotate_half on de-interleaved dims: permute (2i -> i, 2i+1 -> R/2 + i), rotate, permute back."""
    if not interleaved:
        return reference.hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    rotary_dim, head_dim = cos.shape[-1], q.shape[-1]
    perm = torch.cat((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                      torch.arange(rotary_dim, head_dim))).to(q.device)
    inverse = torch.argsort(perm)
    table = perm[:rotary_dim]
    out_q, out_k = reference.hf_apply_rotary_pos_emb(q[..., perm], k[..., perm], cos[..., table], sin[..., table],
                                                     unsqueeze_dim=2)
    return out_q[..., inverse], out_k[..., inverse]


def expected(x, inv_freq, positions, interleaved=False, scaling=1.0):
    """The fp64 oracle for a [B, S, H, D] view; positions [B, S]."""
    return reference.rope(x, inv_freq, positions, interleaved=interleaved, attention_scaling=scaling)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("head_dim,rotary_dim", [(72, 72), (80, 64), (96, 32), (160, 160)])
def test_matches_reference_gqa(device, dtype, interleaved, head_dim, rotary_dim):
    """GQA with one kv head, partial rotary, head dims that are not powers of two; q and k in one launch."""
    gen = seeded(head_dim + rotary_dim)
    batch, seqlen = 2, 5
    q = rope_input(batch, seqlen, 3, head_dim, dtype, generator=gen, device=device)
    k = rope_input(batch, seqlen, 1, head_dim, dtype, generator=gen, device=device)
    inv_freq = rope_inv_freq(rotary_dim, device=device)
    q_out, k_out = rope(q, k, inv_freq, interleaved=interleaved, scaling=1.25)
    positions = reference.token_positions(batch, seqlen)
    for out, x in ((q_out, q), (k_out, k)):
        assert_close_to(out, expected(x, inv_freq, positions, interleaved, 1.25), rotary_dim, interleaved)
        assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])  # pass-through, bit for bit


@pytest.mark.parametrize("layout", ["bhsd", "sbhd"])
def test_strided_views_positions_and_offsets(device, layout):
    """Non-contiguous bhsd/sbhd views in, a differently strided output; int32 positions and per-batch offsets."""
    gen = seeded(3)
    batch, seqlen, head_dim = 2, 6, 64
    q = reference.to_bshd(rope_input(batch, seqlen, 4, head_dim, torch.float32, layout, gen, device), layout)
    k = reference.to_bshd(rope_input(batch, seqlen, 2, head_dim, torch.float32, layout, gen, device), layout)
    assert not q.is_contiguous()
    q_out = poisoned(q.transpose(1, 2).contiguous()).transpose(1, 2)  # bhsd memory for the output
    positions = torch.randint(0, 5000, (batch, seqlen), generator=gen, dtype=torch.int32).to(device)
    offsets = torch.tensor([7, 300], dtype=torch.int64, device=device)
    inv_freq = rope_inv_freq(head_dim, device=device)
    q_out, k_out = rope(q, k, inv_freq, positions=positions, offsets=offsets, q_out=q_out)
    pos = reference.token_positions(batch, seqlen, positions, offsets.cpu())
    assert_close_to(q_out, expected(q, inv_freq, pos), head_dim, False)
    assert_close_to(k_out, expected(k, inv_freq, pos), head_dim, False)


def test_expanded_positions_and_mqa_interleaved_bf16(device):
    """positions as a stride-0 view [1, S] -> [B, S] (int64); MQA; no offsets."""
    gen = seeded(4)
    batch, seqlen, head_dim = 3, 4, 96
    q = rope_input(batch, seqlen, 2, head_dim, torch.bfloat16, generator=gen, device=device)
    k = rope_input(batch, seqlen, 1, head_dim, torch.bfloat16, generator=gen, device=device)
    positions = torch.tensor([[5, 900, 17, 123456]], device=device).expand(batch, seqlen)
    assert positions.stride(0) == 0
    inv_freq = rope_inv_freq(80, device=device)
    q_out, k_out = rope(q, k, inv_freq, positions=positions, interleaved=True)
    pos = reference.token_positions(batch, seqlen, positions)
    assert_close_to(q_out, expected(q, inv_freq, pos, True), 80, True)
    assert_close_to(k_out, expected(k, inv_freq, pos, True), 80, True)


@pytest.mark.parametrize("with_offsets", [False, True])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_packed_varlen(device, with_offsets, cu_dtype):
    """thd as [1, T, H, D]; uneven lengths, one of them empty; positions restart at each boundary (+ offsets)."""
    gen = seeded(5)
    cu_seqlens = torch.tensor([0, 3, 3, 4, 11, 13], dtype=cu_dtype, device=device)
    total, head_dim = 13, 80
    q = rope_input(1, total, 2, head_dim, torch.float16, "thd", gen, device).unsqueeze(0)
    k = rope_input(1, total, 1, head_dim, torch.float16, "thd", gen, device).unsqueeze(0)
    offsets = torch.tensor([0, 4, 1000, 20, 65536], device=device) if with_offsets else None
    inv_freq = rope_inv_freq(head_dim, device=device)
    q_out, k_out = rope(q, k, inv_freq, offsets=offsets, cu_seqlens=cu_seqlens)
    pos = reference.token_positions(1, total, None, offsets.cpu() if with_offsets else 0, cu_seqlens).view(1, total)
    assert_close_to(q_out, expected(q, inv_freq, pos), head_dim, False)
    assert_close_to(k_out, expected(k, inv_freq, pos), head_dim, False)


def test_packed_varlen_with_positions(device):
    """With cu_seqlens, a positions tensor [1, T] gives the positions (the offsets still add per sequence)."""
    gen = seeded(6)
    cu_seqlens = torch.tensor([0, 2, 7], dtype=torch.int32, device=device)
    q = rope_input(1, 7, 2, 64, torch.float32, "thd", gen, device).unsqueeze(0)
    positions = torch.randint(0, 1 << 16, (1, 7), generator=gen).to(device)
    offsets = torch.tensor([3, 11], device=device)
    inv_freq = rope_inv_freq(64, device=device)
    q_out, _ = rope(q, None, inv_freq, positions=positions, offsets=offsets, cu_seqlens=cu_seqlens)
    pos = reference.token_positions(1, 7, positions.view(7), offsets.cpu(), cu_seqlens).view(1, 7)
    assert_close_to(q_out, expected(q, inv_freq, pos), 64, False)


@pytest.mark.parametrize("interleaved", [False, True])
def test_conjugate_inverts(device, interleaved):
    """conjugate=True rotates by -theta: forward then conjugate gives x back (two fp32 rotations: 2x the bound)."""
    gen = seeded(7)
    q = rope_input(2, 4, 2, 72, torch.float32, generator=gen, device=device)
    positions = torch.randint(0, 1 << 20, (2, 4), generator=gen).to(device)
    inv_freq = rope_inv_freq(72, device=device)
    rotated, _ = rope(q, None, inv_freq, positions=positions, interleaved=interleaved)
    back, _ = rope(rotated, None, inv_freq, positions=positions, interleaved=interleaved, conjugate=True)
    assert rotation_ulp_error(back, q, 72, interleaved) <= 2 * FP32_PAIR_ULP


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place(device, dtype):
    """q_out is q: the same values as out of place; dims past rotary_dim are not written (nor poisoned)."""
    gen = seeded(8)
    q = rope_input(2, 3, 2, 80, dtype, generator=gen, device=device)
    k = rope_input(2, 3, 1, 80, dtype, generator=gen, device=device)
    inv_freq = rope_inv_freq(48, device=device)
    want_q, want_k = rope(q, k, inv_freq)
    q_in, k_in = q.clone(), k.clone()
    rope(q_in, k_in, inv_freq, q_out=q_in, k_out=k_in)
    assert torch.equal(q_in, want_q) and torch.equal(k_in, want_k)


def test_angle_precision_near_2_pow_20(device):
    """Rotating unit vectors gives (cos, sin) of the angle: its error vs fp64 stays < 1e-6 rad at positions ~2^20,
    all 64 frequencies of D=128 (theta up to 2^20 rad). Naive fp32 pos * inv_freq is off by up to ~0.03 rad there."""
    head_dim = 128
    positions = (2**20 - torch.arange(0, 8 * 61, 61)).view(1, 8).to(device)
    inv_freq = rope_inv_freq(head_dim, device=device)
    unit = torch.zeros(1, 8, 1, head_dim, device=device)
    unit[..., : head_dim // 2] = 1.0
    out, _ = rope(unit, None, inv_freq, positions=positions)
    measured = torch.atan2(out[..., head_dim // 2 :].double(), out[..., : head_dim // 2].double()).cpu()
    theta = positions.cpu().double().view(1, 8, 1, 1) * inv_freq.cpu().double()

    def angle_error(angle):
        return float(torch.remainder(angle - theta + math.pi, 2 * math.pi).sub(math.pi).abs().max())

    naive = positions.cpu().float().view(1, 8, 1, 1) * inv_freq.cpu()
    assert angle_error(naive.double()) > 1e-3  # the test can tell a naive angle from a precise one
    assert angle_error(measured) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_low_precision_reproduces_eager(device, dtype, interleaved):
    """low_precision with given tables is HF eager arithmetic in `dtype`, bit for bit; with inv_freq, its tables
    are the in-kernel fp32 cos/sin rounded to `dtype` (within 0.5 ulp + fp32 error of the truth), and the rest
    is again HF eager arithmetic."""
    gen = seeded(9)
    batch, seqlen, head_dim, rotary_dim = 2, 4, 80, 64
    q = rope_input(batch, seqlen, 2, head_dim, dtype, generator=gen, device=device)
    k = rope_input(batch, seqlen, 1, head_dim, dtype, generator=gen, device=device)
    positions = torch.randint(0, 1 << 14, (batch, seqlen), generator=gen).to(device)
    inv_freq = rope_inv_freq(rotary_dim, device=device)

    # The kernel's own tables: rotating unit vectors in low precision returns rnd(c), rnd(s).
    unit = torch.zeros(batch, seqlen, 1, rotary_dim, dtype=dtype, device=device)
    if interleaved:
        unit[..., 0::2] = 1
    else:
        unit[..., : rotary_dim // 2] = 1
    tables, _ = rope(unit, None, inv_freq, positions=positions, interleaved=interleaved, scaling=0.75,
                     low_precision=True)
    cos_sin = tables[:, :, 0].unflatten(-1, (-1, 2)).unbind(-1) if interleaved else tables[:, :, 0].chunk(2, -1)
    true_cos, true_sin = reference.cos_sin(positions.cpu(), inv_freq.cpu(), 0.75)
    for got, truth in zip(cos_sin, (true_cos, true_sin)):
        assert max_ulp_error(got, truth) <= HALF_PRECISION_ULP
    cos, sin = (torch.cat((t, t), -1) if not interleaved else t.repeat_interleave(2, -1) for t in cos_sin)

    got_q, got_k = rope(q, k, inv_freq, positions=positions, interleaved=interleaved, scaling=0.75,
                        low_precision=True)
    table_q, table_k = poisoned(q), poisoned(k)
    kernels.rope_cos_sin_forward(q, k, table_q, table_k, cos, sin, interleaved, False, True)
    want_q, want_k = hf_reference(q, k, cos, sin, interleaved)  # computed in `dtype`, as eager HF
    for got in (got_q, table_q):
        assert torch.equal(got, want_q)
    for got in (got_k, table_k):
        assert torch.equal(got, want_k)


def test_low_precision_fp32_is_hf_arithmetic_as_on_the_cpu_twin(device):
    """precision="bf16" with fp32 I/O is HF's eager fp32 arithmetic (rounded products and sum, no compensation), as the
    C++ twins compute it: the Triton kernel's bits equal the CPU twin's, and differ from the compensated fp32 mode."""
    import ropewkv

    gen = seeded(10)
    q = rope_input(2, 64, 4, 64, torch.float32, generator=gen, device=device)
    inv_freq = rope_inv_freq(64, device=device)
    got = rope(q, None, inv_freq, low_precision=True)[0].cpu()
    assert torch.equal(got, ropewkv.rope(q.cpu(), inv_freq=inv_freq.cpu(), precision="bf16", backend="cpu"))
    assert not torch.equal(got, rope(q, None, inv_freq)[0].cpu())


@pytest.mark.parametrize("dtype,table_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_cos_sin_tables(device, dtype, table_dtype, interleaved):
    """Given tables of any float dtype, broadcast over the batch (stride 0), partial rotary: fp32 math vs fp64 HF
    on the same table values, conjugate = the inverse rotation."""
    gen = seeded(11)
    batch, seqlen, head_dim, rotary_dim = 2, 5, 72, 40
    q = rope_input(batch, seqlen, 3, head_dim, dtype, generator=gen, device=device)
    k = rope_input(batch, seqlen, 1, head_dim, dtype, generator=gen, device=device)
    half_angle = torch.rand(1, seqlen, rotary_dim // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
    # HF's layout of the tables: NeoX repeats the frequencies (cat), GPT-J interleaves them.
    angle = half_angle.repeat_interleave(2, -1) if interleaved else torch.cat((half_angle, half_angle), -1)
    cos = angle.cos().to(table_dtype).to(device).expand(batch, -1, -1)
    sin = angle.sin().to(table_dtype).to(device).expand(batch, -1, -1)
    assert cos.stride(0) == 0
    for conjugate in (False, True):
        q_out, k_out = poisoned(q), poisoned(k)
        kernels.rope_cos_sin_forward(q, k, q_out, k_out, cos, sin, interleaved, conjugate, False)
        signed_sin = -sin.double() if conjugate else sin.double()
        want_q, want_k = hf_reference(q.double(), k.double(), cos.double(), signed_sin, interleaved)
        for out, want, x in ((q_out, want_q, q), (k_out, want_k, k)):
            assert_close_to(out, want, rotary_dim, interleaved)
            assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


def test_empty_inputs_launch_nothing(device):
    inv_freq = rope_inv_freq(16, device=device)
    for shape in ((0, 4, 2, 16), (2, 0, 2, 16)):
        q = torch.empty(shape, device=device)
        rope(q, q.clone(), inv_freq)
        kernels.rope_cos_sin_forward(q, None, q.clone(), None, torch.empty(shape[:2] + (16,), device=device),
                                     torch.empty(shape[:2] + (16,), device=device), False, False, False)


def rope_ptx(launcher, *args):
    with captured_launches() as launches:
        launcher(*args)
    return ptx_for_sm90(*launches[0])


def test_compiles_for_nvidia_as_intended():
    """Also without a GPU: the kernel compiles for sm_90; the angle uses explicit fp32 fmas (two-product, 2pi
    reduction constant) and the shared sincos polynomial (no libdevice sinf/cosf, no sin.approx); GPT-J pairs move
    as 16-byte vectors; low precision keeps every rounding of eager HF (no contraction into a bf16 fma)."""
    if kernels.INTERPRETING:  # @triton.jit gave interpreted functions here: compile in a process without it
        run_without_interpreter(__file__, "test_compiles_for_nvidia_as_intended")
        return
    q = torch.empty(1, 2, 4, 128, dtype=torch.bfloat16)
    positions = torch.zeros(1, 2, dtype=torch.int64)
    cu_seqlens = torch.tensor([0, 2], dtype=torch.int32)
    inv_freq = rope_inv_freq(128)
    ptx = rope_ptx(kernels.rope_forward, q, q, q, q, inv_freq, positions, positions[0], cu_seqlens, False, False,
                   1.0, False)
    assert "fma.rn.f32" in ptx and "0f40C90FDB" in ptx  # fp32(2pi) = 0x40C90FDB
    # sincos_poly's 2/pi and its last sin coefficient (-0x1.555546p-3), as fp32 immediates
    assert "0f3F22F983" in ptx and "0fBE2AAAA3" in ptx
    assert "__nv_sinf" not in ptx and "__nv_cosf" not in ptx and ".approx" not in ptx
    table = torch.empty(1, 2, 128, dtype=torch.bfloat16)
    ptx = rope_ptx(kernels.rope_cos_sin_forward, q, None, q, None, table, table, True, False, True)
    assert "mul.rn.bf16" in ptx and "fma.rn.bf16" not in ptx
    # GPT-J at 32 heads (a head block wide enough for 8 bf16 per thread): [heads, D] blocks, pairs split in registers
    q32 = torch.empty(1, 2, 32, 128, dtype=torch.bfloat16)
    ptx = rope_ptx(kernels.rope_forward, q32, None, q32, None, inv_freq, None, None, None, True, False, 1.0, False)
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx


def int32_argument_products(ttir: str) -> list:
    """The i32 multiplies of a TTIR that take a kernel argument (as it is, or splat): a stride times a dim or a row
    that wraps past 2^31 before it reaches an address."""
    signature = ttir[ttir.index("tt.func"):].split(" attributes", 1)[0]
    source = {name: name for name in re.findall(r"%(\w+): i32", signature)}
    source.update((value, arg) for value, arg in re.findall(r"%(\w+) = tt\.splat %(\w+)", ttir) if arg in source)
    return [line.strip() for line in ttir.splitlines()
            if (m := re.search(r"arith\.muli %(\w+), %(\w+) : (?:i32|tensor<\S*xi32>)", line))
            and (m[1] in source or m[2] in source)]


def test_no_int32_products_of_strides():
    """Compiled, every address product is int64: a table read with a large dim stride (a transposed [R, S] table's
    stride S: R * S passes 2^31 at S = 2^24) and M-RoPE's width row (2 * row stride from 2^30) were int32 products."""
    if kernels.INTERPRETING:
        run_without_interpreter(__file__, "test_no_int32_products_of_strides")
        return
    from ropewkv.triton_kernels import qk_norm_rope as qk_kernels

    q = torch.empty(1, 6, 2, 80, dtype=torch.bfloat16)
    table = torch.empty(1, 64, 6).transpose(1, 2)  # dim stride 6
    positions = torch.zeros(3, 1, 6, dtype=torch.int64)
    w = torch.empty(80)
    with captured_launches() as launches:
        kernels.rope_cos_sin_forward(q, q, q, q, table, table, False, False, False)
        kernels.rope_forward(q, q, q, q, rope_inv_freq(64), positions, None, None, False, False, 1.0, False,
                             [8, 12, 12], True)
        qk_kernels.backward(q, q, q, q, q, q, w, w, 1e-6, 0.0, None, table, table, None, None, None, None, 64, True,
                            1.0)
    for launch in launches:
        assert int32_argument_products(compile_for_sm90(*launch)[0].asm["ttir"]) == [], launch[0].fn.__name__
