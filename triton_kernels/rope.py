"""Triton twin of the fused RoPE kernels.

One program per token (a linear token grid, also for packed varlen): it computes the token's position, the cos/sin
of its rotary frequencies once, and rotates every head of q and then of k with them (one launch for both).

Angle: theta_i = position * inv_freq[i] is reduced to r in [-pi, pi] without losing the low bits of the product:
  p + e = pf * f exactly (fma two-product), n = rint(p / 2pi) (ties to even),
  r = ((p - n*HI) - n*MID) - n*LO + e with 2pi = HI + MID + LO (three fp32 parts, each step one fma).
The error of r is ~2 fp32 roundings of |r| <= pi (~2.4e-7 rad) whatever the position, where naive fp32 pos*f loses
~ulp(pos*f) (0.03 rad at pos*f ~ 1e6). sin and cos of r: _sincos, the shared header's branch-free polynomial
(ropewkv/rope.h: sincos_poly, <= 0.85 ulp), operation for operation, and the pairs rotate with its compensated
difference of products (_diff_of_products): the CPU, CUDA and Triton twins compute the same fp32 bits.

Interpreter notes (TRITON_INTERPRET=1, CPU): its tl.fma rounds the product first (numpy has no fma), so there the
fma is done in fp64 (an fp32 product is exact in fp64; the sum rounds twice, which can differ from a true fma by one
ulp in rare ties, never in the exact steps of the two-product); and its fp32->bf16 casts truncate, so there
bf16 rounding is done with integer ops (round to nearest even). On a GPU, tl.fma and .to() are used directly.
"""
import torch
import triton
import triton.language as tl

from ._common import INTERPRETING, fma, rint, rne_bf16

# 2pi split into three fp32 parts (exact decomposition computed with mpmath), and fp32(1/2pi). Globals read in
# @triton.jit code must be tl.constexpr when compiled.
TWO_PI_HI = tl.constexpr(6.2831854820251465)          # fp32(2pi)            0x1.921fb6p+2
TWO_PI_MID = tl.constexpr(-1.7484555314695172e-07)    # fp32(2pi - HI)       -0x1.777a5cp-23
TWO_PI_LO = tl.constexpr(-6.8604980400235275e-15)     # fp32(2pi - HI - MID) -0x1.ee59dap-48
INV_TWO_PI = tl.constexpr(0.15915493667125702)        # fp32(1/2pi)
# sincos_poly's constants (ropewkv/rope.h), as the fp32 values the C++ literals round to: 2/pi, 2pi/4 in three parts,
# Cephes' sinf and cosf minimax coefficients.
TWO_OVER_PI = tl.constexpr(float.fromhex("0x1.45f306p-1"))
QUARTER_TWO_PI_HI = tl.constexpr(float.fromhex("0x1.921fb6p+0"))
QUARTER_TWO_PI_MID = tl.constexpr(float.fromhex("-0x1.777a5cp-25"))
QUARTER_TWO_PI_LO = tl.constexpr(float.fromhex("-0x1.ee59dap-50"))
SIN_P0 = tl.constexpr(float.fromhex("-0x1.9943f2p-13"))
SIN_P1 = tl.constexpr(float.fromhex("0x1.11073cp-7"))
SIN_P2 = tl.constexpr(float.fromhex("-0x1.555546p-3"))
COS_Q0 = tl.constexpr(float.fromhex("0x1.99eb9cp-16"))
COS_Q1 = tl.constexpr(float.fromhex("-0x1.6c0c34p-10"))
COS_Q2 = tl.constexpr(float.fromhex("0x1.55554ap-5"))

# Elements of one head block [BLOCK_H, BLOCK_HALF]: enough to keep a GPU's loads wide, few enough for registers.
HEAD_BLOCK_ELEMENTS = 2048


@triton.jit
def _diff_of_products(a, b, c, d, INTERPRETING: tl.constexpr):
    """a b - c d, compensated: ropewkv/rope.h's diff_of_products, the same operations in the same order."""
    cd = c * d
    cd_error = fma(-c, d, cd, INTERPRETING)
    return fma(a, b, -cd, INTERPRETING) + tl.where(cd_error == cd_error, cd_error, 0.0)


@triton.jit
def _round_to(x, dtype: tl.constexpr, INTERPRETING: tl.constexpr):
    """x (fp32) rounded to nearest even in `dtype`, returned as fp32."""
    if INTERPRETING and dtype == tl.bfloat16:
        return rne_bf16(x)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _reduced_angle(pf, f, INTERPRETING: tl.constexpr):
    """pf * f (both fp32, the product taken exactly) reduced modulo 2pi to about [-pi, pi]."""
    p = pf * f
    e = fma(pf, f, -p, INTERPRETING)
    n = rint(p * INV_TWO_PI)
    r = fma(-n, TWO_PI_HI, p, INTERPRETING)
    r = fma(-n, TWO_PI_MID, r, INTERPRETING)
    r = fma(-n, TWO_PI_LO, r, INTERPRETING)
    return r + e


@triton.jit
def _sincos(r, INTERPRETING: tl.constexpr):
    """(sin r, cos r) of a reduced angle |r| <= ~pi: ropewkv/rope.h's sincos_poly, operation for operation (its
    comments give the derivation and the 0.85 ulp bound), so that every twin computes the same bits."""
    q = rint(r * TWO_OVER_PI)
    yh = fma(-q, QUARTER_TWO_PI_HI, r, INTERPRETING)
    yl = fma(-q, QUARTER_TWO_PI_LO, -q * QUARTER_TWO_PI_MID, INTERPRETING)
    y = yh + yl
    z = y * y
    sp = yh + fma(y * z, fma(fma(z, SIN_P0, SIN_P1, INTERPRETING), z, SIN_P2, INTERPRETING), yl, INTERPRETING)
    zh = yh * yh
    ze = fma(yh, yh, -zh, INTERPRETING)
    cq = fma(fma(z, COS_Q0, COS_Q1, INTERPRETING), z, COS_Q2, INTERPRETING)
    cp = 1.0 + fma(zh, -0.5, fma(z * z, cq, fma(-yh, yl, -0.5 * ze, INTERPRETING), INTERPRETING), INTERPRETING)
    quadrant = tl.where(tl.abs(q) < 4194304.0, q, 0.0).to(tl.int32) & 3
    sin_y = tl.where((quadrant & 1) != 0, cp, sp)
    cos_y = tl.where((quadrant & 1) != 0, sp, cp)
    return tl.where((quadrant & 2) != 0, -sin_y, sin_y), tl.where(((quadrant + 1) & 2) != 0, -cos_y, cos_y)


@triton.jit
def _mrope_row(i, section0, section1, section2, INTERLEAVED: tl.constexpr):
    """The M-RoPE position row (0 temporal, 1 height, 2 width) of frequency i: ropewkv/rope.h's mrope_row."""
    if INTERLEAVED:  # Qwen3-VL: T H W T H W ... while i < 3 * section[i % 3], then T
        r = i % 3
        return tl.where((r != 0) & (i < 3 * tl.where(r == 1, section1, section2)), r, 0)
    return tl.where(i < section0, 0, tl.where(i < section0 + section1, 1, 2))  # chunks T..T H..H W..W


@triton.jit
def _token_position(token, b, s, i, pos_ptr, offset_ptr, cu_ptr, n_seqs, search_steps, pos_sr, pos_sb, pos_ss,
                    section0, section1, section2, HAS_POSITIONS: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                    HAS_CU: tl.constexpr, MROPE: tl.constexpr, MROPE_INTERLEAVED: tl.constexpr):
    """The absolute position of token (b, s) (flat index `token`), as ropewkv.reference.rope.token_positions; with
    M-RoPE, frequency i takes its position from row _mrope_row(i) of positions [3, B, S] (always given)."""
    if HAS_CU:
        # The sequence n with cu[n] <= token < cu[n+1]: binary search, invariant cu[lo] <= token < cu[hi].
        lo = token * 0
        hi = lo + n_seqs
        for _ in range(search_steps):
            mid = (lo + hi) // 2
            right = tl.load(cu_ptr + mid).to(tl.int64) <= token
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
        seq = lo
        pos_offset = token * pos_ss
    else:
        seq = b
        pos_offset = b * pos_sb + s * pos_ss
    if HAS_POSITIONS:  # pos_ptr may be None otherwise
        position = tl.load(pos_ptr + pos_offset).to(tl.int64)
    elif HAS_CU:
        position = token - tl.load(cu_ptr + seq).to(tl.int64)
    else:
        position = s
    if MROPE:
        row = _mrope_row(i, section0, section1, section2, MROPE_INTERLEAVED)
        height_ptr = pos_ptr + pos_offset + pos_sr
        height = tl.load(height_ptr).to(tl.int64)
        width = tl.load(height_ptr + pos_sr).to(tl.int64)  # not 2 * pos_sr: an int32 product, wraps from 2^30
        position = tl.where(row == 0, position, tl.where(row == 1, height, width))
    if HAS_OFFSETS:
        position += tl.load(offset_ptr + seq).to(tl.int64)
    return position


@triton.jit
def _token_cos_sin(token, b, s, i, half_mask, off1, off2, freq_ptr, pos_ptr, offset_ptr, cu_ptr, cos_ptr, sin_ptr,
                   n_seqs, search_steps, scaling, section0, section1, section2, pos_sr, pos_sb, pos_ss,
                   cos_sb, cos_ss, cos_sd, sin_sb, sin_ss, sin_sd,
                   FROM_TABLE: tl.constexpr, HAS_POSITIONS: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                   HAS_CU: tl.constexpr, MROPE: tl.constexpr, MROPE_INTERLEAVED: tl.constexpr,
                   INTERPRETING: tl.constexpr):
    """(cos1, sin1, cos2, sin2) in fp32 of the token's pairs i (dims off1, off2): from HF's tables, read at the
    output dim of each element, or from the angle position * inv_freq[i] (then cos1 == cos2, sin1 == sin2)."""
    if FROM_TABLE:
        cos_tok = cos_ptr + b * cos_sb + s * cos_ss
        sin_tok = sin_ptr + b * sin_sb + s * sin_ss
        # int64 dims: a table's dim stride can be large (a transposed [S, R] view: S), and int32 dim * stride wraps.
        dim1 = off1.to(tl.int64)
        dim2 = off2.to(tl.int64)
        cos1 = tl.load(cos_tok + dim1 * cos_sd, mask=half_mask).to(tl.float32)
        cos2 = tl.load(cos_tok + dim2 * cos_sd, mask=half_mask).to(tl.float32)
        sin1 = tl.load(sin_tok + dim1 * sin_sd, mask=half_mask).to(tl.float32)
        sin2 = tl.load(sin_tok + dim2 * sin_sd, mask=half_mask).to(tl.float32)
    else:
        position = _token_position(token, b, s, i, pos_ptr, offset_ptr, cu_ptr, n_seqs, search_steps, pos_sr, pos_sb,
                                   pos_ss, section0, section1, section2, HAS_POSITIONS, HAS_OFFSETS, HAS_CU, MROPE,
                                   MROPE_INTERLEAVED)
        f = tl.load(freq_ptr + i, mask=half_mask, other=0.0)
        r = _reduced_angle(position.to(tl.float32), f, INTERPRETING)
        sin_r, cos_r = _sincos(r, INTERPRETING)
        cos1 = cos_r * scaling
        sin1 = sin_r * scaling
        cos2 = cos1
        sin2 = sin1
    return cos1, sin1, cos2, sin2


@triton.jit
def _rotate_heads(x_ptr, o_ptr, x_sb, x_ss, x_sh, o_sb, o_ss, o_sh, b, s, n_heads, cos1, sin1, cos2, sin2,
                  off1, off2, half_mask,
                  ROTARY_DIM: tl.constexpr, REST: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                  BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, LOW_PRECISION: tl.constexpr,
                  COPY_REST: tl.constexpr, INTERPRETING: tl.constexpr):
    """Rotate every head of one token: out[off1] = x1 cos1 - x2 sin1, out[off2] = x2 cos2 + x1 sin2. GPT-J pairs
    (off1, off2) = (2i, 2i+1) are loaded and stored as one contiguous [BLOCK_H, 2 BLOCK_HALF] block (16-byte vectors on
    a GPU), split into x1, x2 and joined back; NeoX halves are two contiguous blocks already."""
    dtype: tl.constexpr = o_ptr.dtype.element_ty
    if LOW_PRECISION:  # HF eager in the io dtype: the tables are rounded, then every product and the sum.
        cos1 = _round_to(cos1, dtype, INTERPRETING)
        sin1 = _round_to(sin1, dtype, INTERPRETING)
        cos2 = _round_to(cos2, dtype, INTERPRETING)
        sin2 = _round_to(sin2, dtype, INTERPRETING)
    x_tok = x_ptr + b * x_sb + s * x_ss
    o_tok = o_ptr + b * o_sb + s * o_ss
    rest = tl.arange(0, BLOCK_REST)
    dims = tl.arange(0, 2 * BLOCK_HALF)
    for h0 in range(0, n_heads, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        head_mask = h < n_heads
        x_row = x_tok + h[:, None] * x_sh
        o_row = o_tok + h[:, None] * o_sh
        if INTERLEAVED:  # GPT-J: the pairs are adjacent; load the rotary dims whole (16-byte vectors) and split
            pair_mask = head_mask[:, None] & (dims < ROTARY_DIM)[None, :]
            x = tl.load(x_row + dims[None, :], mask=pair_mask).to(tl.float32)
            x1, x2 = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_HALF, 2)))
        else:
            mask = head_mask[:, None] & half_mask[None, :]
            x1 = tl.load(x_row + off1[None, :], mask=mask).to(tl.float32)
            x2 = tl.load(x_row + off2[None, :], mask=mask).to(tl.float32)
        if LOW_PRECISION:
            out1 = _round_to(_round_to(x1 * cos1, dtype, INTERPRETING) - _round_to(x2 * sin1, dtype, INTERPRETING),
                             dtype, INTERPRETING)
            out2 = _round_to(_round_to(x2 * cos2, dtype, INTERPRETING) + _round_to(x1 * sin2, dtype, INTERPRETING),
                             dtype, INTERPRETING)
        else:
            out1 = _round_to(_diff_of_products(x1, cos1, x2, sin1, INTERPRETING), dtype, INTERPRETING)
            out2 = _round_to(_diff_of_products(x2, cos2, -x1, sin2, INTERPRETING), dtype, INTERPRETING)
        # out1/out2 hold values exact in `dtype`, so this cast is exact (also where the interpreter truncates).
        if INTERLEAVED:
            out = tl.reshape(tl.join(out1, out2), (BLOCK_H, 2 * BLOCK_HALF))
            tl.store(o_row + dims[None, :], out.to(dtype), mask=pair_mask)
        else:
            tl.store(o_row + off1[None, :], out1.to(dtype), mask=mask)
            tl.store(o_row + off2[None, :], out2.to(dtype), mask=mask)
        if COPY_REST:  # dims past rotary_dim, bit for bit in the storage dtype
            rest_mask = head_mask[:, None] & (rest < REST)[None, :]
            tail = tl.load(x_row + ROTARY_DIM + rest[None, :], mask=rest_mask)
            tl.store(o_row + ROTARY_DIM + rest[None, :], tail, mask=rest_mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, freq_ptr, pos_ptr, offset_ptr, cu_ptr, cos_ptr, sin_ptr,
                 seqlen, n_qheads, n_kheads, n_seqs, search_steps, scaling, section0, section1, section2,
                 q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, qo_sb, qo_ss, qo_sh, ko_sb, ko_ss, ko_sh,
                 pos_sr, pos_sb, pos_ss, cos_sb, cos_ss, cos_sd, sin_sb, sin_ss, sin_sd,
                 HALF: tl.constexpr, REST: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                 INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr, LOW_PRECISION: tl.constexpr,
                 FROM_TABLE: tl.constexpr, HAS_K: tl.constexpr, HAS_POSITIONS: tl.constexpr,
                 HAS_OFFSETS: tl.constexpr, HAS_CU: tl.constexpr, COPY_REST: tl.constexpr,
                 MROPE: tl.constexpr, MROPE_INTERLEAVED: tl.constexpr, INTERPRETING: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    b = token // seqlen
    s = token - b * seqlen

    i = tl.arange(0, BLOCK_HALF)
    half_mask = i < HALF
    if INTERLEAVED:  # GPT-J pairs (2i, 2i+1)
        off1 = 2 * i
        off2 = 2 * i + 1
    else:  # NeoX pairs (i, i + R/2)
        off1 = i
        off2 = i + HALF

    cos1, sin1, cos2, sin2 = _token_cos_sin(
        token, b, s, i, half_mask, off1, off2, freq_ptr, pos_ptr, offset_ptr, cu_ptr, cos_ptr, sin_ptr, n_seqs,
        search_steps, scaling, section0, section1, section2, pos_sr, pos_sb, pos_ss, cos_sb, cos_ss, cos_sd, sin_sb,
        sin_ss, sin_sd, FROM_TABLE, HAS_POSITIONS, HAS_OFFSETS, HAS_CU, MROPE, MROPE_INTERLEAVED, INTERPRETING)
    if CONJUGATE:  # the transpose of the rotation (backward pass): for tables with unequal halves the two sines
        sin1, sin2 = -sin2, -sin1  # also trade places; for an angle this is the inverse rotation, sin -> -sin

    _rotate_heads(q_ptr, qo_ptr, q_sb, q_ss, q_sh, qo_sb, qo_ss, qo_sh, b, s, n_qheads, cos1, sin1, cos2, sin2,
                  off1, off2, half_mask, 2 * HALF, REST, BLOCK_HALF, BLOCK_REST, BLOCK_HQ, INTERLEAVED, LOW_PRECISION,
                  COPY_REST, INTERPRETING)
    if HAS_K:
        _rotate_heads(k_ptr, ko_ptr, k_sb, k_ss, k_sh, ko_sb, ko_ss, ko_sh, b, s, n_kheads, cos1, sin1, cos2, sin2,
                      off1, off2, half_mask, 2 * HALF, REST, BLOCK_HALF, BLOCK_REST, BLOCK_HK, INTERLEAVED,
                      LOW_PRECISION, COPY_REST, INTERPRETING)


def _strides(x, n):
    """The first n strides of x (zeros for an absent tensor)."""
    return tuple(x.stride(d) for d in range(n)) if x is not None else (0,) * n


def check_k(q, k) -> None:
    """k's shape against q's (the kernels size k from q's), as the C++ glue's set_io checks it."""
    if k is not None and (k.dim() != 4 or (k.shape[0], k.shape[1], k.shape[3]) != (q.shape[0], q.shape[1], q.shape[3])):
        raise ValueError(f"k must be [batch, seq, kv_heads, head_dim] matching q {list(q.shape)}, got {list(k.shape)}")


def check_indexed(q, k, rotary_dim, positions=None, seqlen_offsets=None, cu_seqlens=None, cos=None, sin=None,
                  mrope=False) -> None:
    """The shapes the kernels index by, as the C++ glue checks them: the ops called directly (torch.ops.ropewkv.*)
    with another shape read out of bounds."""
    check_k(q, k)
    batch, seqlen, _, head_dim = q.shape
    for name, x in (("q", q), ("k", k)):
        if x is not None and x.shape[-1] > 1 and x.stride(-1) != 1:
            raise ValueError(f"{name} must have stride 1 in its last dim, got strides {list(x.stride())}")
    if rotary_dim % 2 or not 0 <= rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and <= head_dim {head_dim}, got {rotary_dim}")
    rows = [3] if mrope else []
    if (positions is not None or mrope) and (positions is None or list(positions.shape) != rows + [batch, seqlen]):
        raise ValueError(f"positions must be a {'[3, batch, seq]' if mrope else '[batch, seq]'} view "
                         f"{rows + [batch, seqlen]}, got {None if positions is None else list(positions.shape)}")
    n_offsets = batch
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or not cu_seqlens.is_contiguous() or cu_seqlens.numel() < 2 or batch != 1:
            raise ValueError(f"cu_seqlens must be contiguous 1-D with n_seqs + 1 >= 2 entries and q a [1, total_tokens,"
                             f" heads, head_dim] view, got cu_seqlens {list(cu_seqlens.shape)}, q {list(q.shape)}")
        n_offsets = cu_seqlens.numel() - 1
    if seqlen_offsets is not None and (seqlen_offsets.dim() != 1 or not seqlen_offsets.is_contiguous()
                                       or seqlen_offsets.numel() < n_offsets):  # (more are never read)
        raise ValueError(f"seqlen_offsets must be contiguous [{n_offsets}], got {list(seqlen_offsets.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table is not None and list(table.shape) != [batch, seqlen, rotary_dim]:
            raise ValueError(f"{name} must be a [batch, seq, rotary_dim] view {[batch, seqlen, rotary_dim]}, got "
                             f"{list(table.shape)}")


def _launch_arguments(q, k, q_out, k_out, rotary_dim, interleaved, conjugate, low_precision, *, inv_freq=None,
                      positions=None, seqlen_offsets=None, cu_seqlens=None, cos=None, sin=None, attention_scaling=1.0,
                      mrope_section=None, mrope_interleaved=False):
    """(grid, positional args, keyword args: constexprs and compile options) of one _rope_kernel launch; None when
    there is nothing to do."""
    check_indexed(q, k, rotary_dim, positions, seqlen_offsets, cu_seqlens, cos, sin, mrope_section is not None)
    batch, seqlen, n_qheads, head_dim = q.shape
    n_kheads = k.shape[2] if k is not None else 0
    if batch * seqlen == 0 or (n_qheads == 0 and n_kheads == 0):
        return None
    half = rotary_dim // 2
    block_half = triton.next_power_of_2(max(half, 1))
    rest = head_dim - rotary_dim
    in_place = q_out.data_ptr() == q.data_ptr() and (k is None or k_out.data_ptr() == k.data_ptr())
    max_heads = max(1, HEAD_BLOCK_ELEMENTS // block_half)
    n_seqs = cu_seqlens.numel() - 1 if cu_seqlens is not None else 0
    mrope = mrope_section is not None
    # M-RoPE positions [3, B, S]: the row stride first; plain positions [B, S] get a zero row stride.
    pos_strides = _strides(positions, 3) if mrope else (0, *_strides(positions, 2))
    args = (q, k, q_out, k_out, inv_freq, positions, seqlen_offsets, cu_seqlens, cos, sin,
            seqlen, n_qheads, n_kheads, n_seqs, max(n_seqs - 1, 0).bit_length(), float(attention_scaling),
            *(tuple(mrope_section) if mrope else (0, 0, 0)),
            *_strides(q, 3), *_strides(k, 3), *_strides(q_out, 3), *_strides(k_out, 3),
            *pos_strides, *_strides(cos, 3), *_strides(sin, 3))
    kwargs = dict(
        HALF=half, REST=rest, BLOCK_HALF=block_half, BLOCK_REST=triton.next_power_of_2(max(rest, 1)),
        BLOCK_HQ=min(triton.next_power_of_2(max(n_qheads, 1)), max_heads),
        BLOCK_HK=min(triton.next_power_of_2(max(n_kheads, 1)), max_heads),
        INTERLEAVED=bool(interleaved), CONJUGATE=bool(conjugate),
        # HF's eager arithmetic: with fp32 I/O, plain rounded products and sum (bit-equal to HF), as the C++ twins
        LOW_PRECISION=bool(low_precision),
        FROM_TABLE=cos is not None, HAS_K=k is not None, HAS_POSITIONS=positions is not None,
        HAS_OFFSETS=seqlen_offsets is not None, HAS_CU=cu_seqlens is not None,
        COPY_REST=rest > 0 and not in_place, MROPE=mrope, MROPE_INTERLEAVED=bool(mrope_interleaved),
        INTERPRETING=INTERPRETING,
        # No a*b+c contraction: with it LLVM narrows rnd(rnd(x1 c) - rnd(x2 s)) to a bf16/fp16 fma (one rounding
        # fewer than eager HF), and the GPU would differ from the interpreter. Explicit tl.fma is unaffected.
        enable_fp_fusion=False)
    return (batch * seqlen,), args, kwargs


def _run(launch):
    if launch is not None:
        grid, args, kwargs = launch
        _rope_kernel[grid](*args, **kwargs)


def rope_forward(q, k, q_out, k_out, inv_freq, positions, seqlen_offsets, cu_seqlens, interleaved: bool,
                 conjugate: bool, attention_scaling: float, low_precision: bool, mrope_section=None,
                 mrope_interleaved: bool = False) -> None:
    """Rotate q (and k) at positions computed in the kernel; writes q_out (and k_out).

    q: [B, S, Hq, D] and k: [B, S, Hk, D] or None, any strides with stride(-1) == 1 (thd as [1, T, H, D]);
    q_out/k_out: same shapes (any strides, stride(-1) == 1), may be q/k themselves (in place: dims >= rotary_dim are
    then not touched; otherwise they are copied bit for bit). inv_freq: fp32 contiguous [R/2], R = rotary_dim <= D.
    positions: None or int32/int64 [B, S] (any strides, 0 allowed); seqlen_offsets: None or int64 [B] ([n_seqs] with
    cu_seqlens); cu_seqlens: None or int32/int64 [n_seqs + 1] (then B == 1). The position of a token is that of
    ropewkv.reference.rope.token_positions. conjugate rotates by -theta (the backward pass). low_precision reproduces
    HF eager arithmetic in the io dtype; otherwise all math is fp32 with one rounding at the store.
    M-RoPE: mrope_section = (temporal, height, width) frequency counts summing to R/2 and positions [3, B, S]
    ([3, 1, T] for thd); frequency i takes its position from row _mrope_row(i), chunked or interleaved.
    """
    _run(_launch_arguments(q, k, q_out, k_out, 2 * inv_freq.numel(), interleaved, conjugate, low_precision,
                           inv_freq=inv_freq, positions=positions, seqlen_offsets=seqlen_offsets,
                           cu_seqlens=cu_seqlens, attention_scaling=attention_scaling, mrope_section=mrope_section,
                           mrope_interleaved=mrope_interleaved))


def rope_cos_sin_forward(q, k, q_out, k_out, cos, sin, interleaved: bool, conjugate: bool,
                         low_precision: bool) -> None:
    """HF's q * cos + rotate_half(q) * sin with the given tables; writes q_out (and k_out).

    q/k/q_out/k_out as in rope_forward. cos, sin: [B, S, R] views (any strides, 0 allowed; any float
    dtype), R = rotary_dim <= D, read at each element's output dim. conjugate negates sin; low_precision rounds the
    tables and every operation to the io dtype (bit-equal to HF eager bf16/fp16).
    """
    _run(_launch_arguments(q, k, q_out, k_out, cos.shape[-1], interleaved, conjugate, low_precision, cos=cos,
                           sin=sin))


__all__ = ["rope_forward", "rope_cos_sin_forward"]
