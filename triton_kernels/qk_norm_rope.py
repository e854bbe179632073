"""Triton twin of the fused per-head RMSNorm + RoPE (ropewkv/qk_norm_rope.h holds the conventions).

Forward: one program per token. It computes the token's cos/sin once per frequency (rope.py's angle or HF-table
source, or a row of a vLLM cos_sin_cache at the clamped position), then for blocks of heads of q and then k loads each
row in three parts (the two halves of the rotated pairs and the pass-through rest), sums the squares in fp32, scales
by 1 / sqrt(mean + eps) and (offset + weight), rotates and stores once.
Backward: one program per chunk of CHUNK_TOKENS tokens (the C++ twins' chunking): dy = the conjugate rotation of the
cotangent, dx = r (dy w' - n sum(dy w' n) / D), and the chunk's weight-gradient partial sum(dy n) stored to its own
row; the caller sums the rows (no atomics: deterministic).
"""
import torch
import triton
import triton.language as tl

from ._common import INTERPRETING
from .rope import HEAD_BLOCK_ELEMENTS, _round_to, _strides, _token_cos_sin, _token_position, check_indexed

CHUNK_TOKENS = 16  # = qk_norm_rope::kChunkTokens
SOURCE_ANGLE, SOURCE_TABLE, SOURCE_CACHE = 0, 1, 2


@triton.jit
def _entries(token, b, s, i, half_mask, off1, off2, freq_ptr, pos_ptr, offset_ptr, cu_ptr, cos_ptr, sin_ptr,
             cache_ptr, n_seqs, search_steps, scaling, max_position, cache_stride, pos_sb, pos_ss, cos_sb, cos_ss,
             cos_sd, sin_sb, sin_ss, sin_sd, HALF: tl.constexpr, SOURCE: tl.constexpr, CONJUGATE: tl.constexpr,
             HAS_POSITIONS: tl.constexpr, HAS_OFFSETS: tl.constexpr, HAS_CU: tl.constexpr,
             INTERPRETING: tl.constexpr):
    """The token's (cos1, sin1, cos2, sin2) in fp32 for pairs i, conjugated (the backward) if asked."""
    if SOURCE == 2:
        position = _token_position(token, b, s, i, pos_ptr, offset_ptr, cu_ptr, n_seqs, search_steps, 0, pos_sb, pos_ss,
                                   0, 0, 0, HAS_POSITIONS, HAS_OFFSETS, HAS_CU, False, False)  # no M-RoPE here
        row = tl.minimum(tl.maximum(position, 0), max_position - 1) * cache_stride  # never outside the cache
        cos1 = tl.load(cache_ptr + row + i, mask=half_mask).to(tl.float32)
        sin1 = tl.load(cache_ptr + row + HALF + i, mask=half_mask).to(tl.float32)
        cos2 = cos1
        sin2 = sin1
    else:
        cos1, sin1, cos2, sin2 = _token_cos_sin(
            token, b, s, i, half_mask, off1, off2, freq_ptr, pos_ptr, offset_ptr, cu_ptr, cos_ptr, sin_ptr, n_seqs,
            search_steps, scaling, 0, 0, 0, 0, pos_sb, pos_ss, cos_sb, cos_ss, cos_sd, sin_sb, sin_ss, sin_sd,
            SOURCE == 1, HAS_POSITIONS, HAS_OFFSETS, HAS_CU, False, False, INTERPRETING)
    if CONJUGATE:
        sin1, sin2 = -sin2, -sin1
    return cos1, sin1, cos2, sin2


@triton.jit
def _inv_rms(x1, x2, xr, eps, HEAD_DIM: tl.constexpr):
    """1 / sqrt(mean square + eps) per row of the [BLOCK_H, *] parts, with correctly rounded sqrt and division."""
    total = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xr * xr, axis=1)
    return tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(total, HEAD_DIM) + eps))[:, None]


@triton.jit
def _normed(x, r, w, weight_offset, dtype: tl.constexpr, LOW_PRECISION: tl.constexpr, OFFSET_IS_ZERO: tl.constexpr,
            INTERPRETING: tl.constexpr):
    """y = (x r) (offset + w) in fp32; HF's roundings in the low mode (Qwen3: rnd(rnd(x r) rnd(w)); Gemma-3: one)."""
    n = x * r
    if LOW_PRECISION:
        if OFFSET_IS_ZERO:
            return _round_to(_round_to(n, dtype, INTERPRETING) * _round_to(w, dtype, INTERPRETING), dtype,
                             INTERPRETING)
        return _round_to(n * (weight_offset + w), dtype, INTERPRETING)
    return n * (weight_offset + w)


@triton.jit
def _forward_heads(x_ptr, o_ptr, w_ptr, x_sb, x_ss, x_sh, o_sb, o_ss, o_sh, b, s, n_heads, eps, weight_offset,
                   cos1, sin1, cos2, sin2, off1, off2, half_mask,
                   HALF: tl.constexpr, REST: tl.constexpr, BLOCK_REST: tl.constexpr, BLOCK_H: tl.constexpr,
                   NORMALIZE: tl.constexpr, OFFSET_IS_ZERO: tl.constexpr, LOW_PRECISION: tl.constexpr,
                   INTERPRETING: tl.constexpr):
    dtype: tl.constexpr = o_ptr.dtype.element_ty
    rest = tl.arange(0, BLOCK_REST)
    rest_in = rest < REST
    if NORMALIZE:
        w1 = tl.load(w_ptr + off1, mask=half_mask, other=0.0)[None, :]
        w2 = tl.load(w_ptr + off2, mask=half_mask, other=0.0)[None, :]
        wr = tl.load(w_ptr + 2 * HALF + rest, mask=rest_in, other=0.0)[None, :]
    x_tok = x_ptr + b * x_sb + s * x_ss
    o_tok = o_ptr + b * o_sb + s * o_ss
    for h0 in range(0, n_heads, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        head_mask = h < n_heads
        x_row = x_tok + h[:, None] * x_sh
        o_row = o_tok + h[:, None] * o_sh
        mask = head_mask[:, None] & half_mask[None, :]
        rest_mask = head_mask[:, None] & rest_in[None, :]
        x1 = tl.load(x_row + off1[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + off2[None, :], mask=mask, other=0.0).to(tl.float32)
        xr = tl.load(x_row + 2 * HALF + rest[None, :], mask=rest_mask, other=0.0).to(tl.float32)
        if NORMALIZE:
            r = _inv_rms(x1, x2, xr, eps, 2 * HALF + REST)
            x1 = _normed(x1, r, w1, weight_offset, dtype, LOW_PRECISION, OFFSET_IS_ZERO, INTERPRETING)
            x2 = _normed(x2, r, w2, weight_offset, dtype, LOW_PRECISION, OFFSET_IS_ZERO, INTERPRETING)
            xr = _normed(xr, r, wr, weight_offset, dtype, LOW_PRECISION, OFFSET_IS_ZERO, INTERPRETING)
        if LOW_PRECISION:  # HF eager: every product and the sum rounded to the I/O dtype
            out1 = _round_to(_round_to(x1 * cos1, dtype, INTERPRETING) - _round_to(x2 * sin1, dtype, INTERPRETING),
                             dtype, INTERPRETING)
            out2 = _round_to(_round_to(x2 * cos2, dtype, INTERPRETING) + _round_to(x1 * sin2, dtype, INTERPRETING),
                             dtype, INTERPRETING)
        else:
            out1 = _round_to(x1 * cos1 - x2 * sin1, dtype, INTERPRETING)
            out2 = _round_to(x2 * cos2 + x1 * sin2, dtype, INTERPRETING)
        tl.store(o_row + off1[None, :], out1.to(dtype), mask=mask)
        tl.store(o_row + off2[None, :], out2.to(dtype), mask=mask)
        if REST > 0:
            tl.store(o_row + 2 * HALF + rest[None, :], _round_to(xr, dtype, INTERPRETING).to(dtype), mask=rest_mask)


@triton.jit
def _forward_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, wq_ptr, wk_ptr, freq_ptr, pos_ptr, offset_ptr, cu_ptr, cos_ptr,
                    sin_ptr, cache_ptr, seqlen, n_qheads, n_kheads, n_seqs, search_steps, scaling, eps,
                    weight_offset, max_position, cache_stride,
                    q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, qo_sb, qo_ss, qo_sh, ko_sb, ko_ss, ko_sh,
                    pos_sb, pos_ss, cos_sb, cos_ss, cos_sd, sin_sb, sin_ss, sin_sd,
                    HALF: tl.constexpr, REST: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, INTERLEAVED: tl.constexpr,
                    SOURCE: tl.constexpr, HAS_K: tl.constexpr, HAS_POSITIONS: tl.constexpr,
                    HAS_OFFSETS: tl.constexpr, HAS_CU: tl.constexpr, NORMALIZE: tl.constexpr,
                    OFFSET_IS_ZERO: tl.constexpr, LOW_PRECISION: tl.constexpr, INTERPRETING: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    b = token // seqlen
    s = token - b * seqlen
    i = tl.arange(0, BLOCK_HALF)
    half_mask = i < HALF
    off1 = 2 * i if INTERLEAVED else i
    off2 = 2 * i + 1 if INTERLEAVED else i + HALF
    cos1, sin1, cos2, sin2 = _entries(
        token, b, s, i, half_mask, off1, off2, freq_ptr, pos_ptr, offset_ptr, cu_ptr, cos_ptr, sin_ptr, cache_ptr,
        n_seqs, search_steps, scaling, max_position, cache_stride, pos_sb, pos_ss, cos_sb, cos_ss, cos_sd, sin_sb,
        sin_ss, sin_sd, HALF, SOURCE, False, HAS_POSITIONS, HAS_OFFSETS, HAS_CU, INTERPRETING)
    if LOW_PRECISION:
        dtype: tl.constexpr = qo_ptr.dtype.element_ty
        cos1 = _round_to(cos1, dtype, INTERPRETING)
        sin1 = _round_to(sin1, dtype, INTERPRETING)
        cos2 = _round_to(cos2, dtype, INTERPRETING)
        sin2 = _round_to(sin2, dtype, INTERPRETING)
    _forward_heads(q_ptr, qo_ptr, wq_ptr, q_sb, q_ss, q_sh, qo_sb, qo_ss, qo_sh, b, s, n_qheads, eps, weight_offset,
                   cos1, sin1, cos2, sin2, off1, off2, half_mask, HALF, REST, BLOCK_REST, BLOCK_HQ, NORMALIZE,
                   OFFSET_IS_ZERO, LOW_PRECISION, INTERPRETING)
    if HAS_K:
        _forward_heads(k_ptr, ko_ptr, wk_ptr, k_sb, k_ss, k_sh, ko_sb, ko_ss, ko_sh, b, s, n_kheads, eps,
                       weight_offset, cos1, sin1, cos2, sin2, off1, off2, half_mask, HALF, REST, BLOCK_REST, BLOCK_HK,
                       NORMALIZE, OFFSET_IS_ZERO, LOW_PRECISION, INTERPRETING)


@triton.jit
def _backward_heads(x_ptr, g_ptr, dx_ptr, w_ptr, x_sb, x_ss, x_sh, g_sb, g_ss, g_sh, d_sb, d_ss, d_sh, b, s,
                    n_heads, eps, weight_offset, cos1, sin1, cos2, sin2, off1, off2, half_mask, dw1, dw2, dwr,
                    HALF: tl.constexpr, REST: tl.constexpr, BLOCK_REST: tl.constexpr, BLOCK_H: tl.constexpr,
                    NORMALIZE: tl.constexpr, INTERPRETING: tl.constexpr):
    """dx of every head of one token; returns the weight-gradient accumulators plus this token's sum(dy n)."""
    dtype: tl.constexpr = dx_ptr.dtype.element_ty
    rest = tl.arange(0, BLOCK_REST)
    rest_in = rest < REST
    if NORMALIZE:
        w1 = weight_offset + tl.load(w_ptr + off1, mask=half_mask, other=0.0)[None, :]
        w2 = weight_offset + tl.load(w_ptr + off2, mask=half_mask, other=0.0)[None, :]
        wr = weight_offset + tl.load(w_ptr + 2 * HALF + rest, mask=rest_in, other=0.0)[None, :]
    for h0 in range(0, n_heads, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        head_mask = h < n_heads
        mask = head_mask[:, None] & half_mask[None, :]
        rest_mask = head_mask[:, None] & rest_in[None, :]
        g_row = g_ptr + b * g_sb + s * g_ss + h[:, None] * g_sh
        d_row = dx_ptr + b * d_sb + s * d_ss + h[:, None] * d_sh
        g1 = tl.load(g_row + off1[None, :], mask=mask, other=0.0).to(tl.float32)
        g2 = tl.load(g_row + off2[None, :], mask=mask, other=0.0).to(tl.float32)
        dyr = tl.load(g_row + 2 * HALF + rest[None, :], mask=rest_mask, other=0.0).to(tl.float32)
        dy1 = g1 * cos1 - g2 * sin1
        dy2 = g2 * cos2 + g1 * sin2
        if NORMALIZE:
            x_row = x_ptr + b * x_sb + s * x_ss + h[:, None] * x_sh
            n1 = tl.load(x_row + off1[None, :], mask=mask, other=0.0).to(tl.float32)
            n2 = tl.load(x_row + off2[None, :], mask=mask, other=0.0).to(tl.float32)
            nr = tl.load(x_row + 2 * HALF + rest[None, :], mask=rest_mask, other=0.0).to(tl.float32)
            r = _inv_rms(n1, n2, nr, eps, 2 * HALF + REST)
            n1, n2, nr = n1 * r, n2 * r, nr * r
            dw1 += tl.sum(dy1 * n1, axis=0)
            dw2 += tl.sum(dy2 * n2, axis=0)
            dwr += tl.sum(dyr * nr, axis=0)
            dy1, dy2, dyr = dy1 * w1, dy2 * w2, dyr * wr
            dot = (tl.sum(dy1 * n1, axis=1) + tl.sum(dy2 * n2, axis=1) + tl.sum(dyr * nr, axis=1))[:, None]
            dot = dot / (2 * HALF + REST)
            dy1, dy2, dyr = r * (dy1 - n1 * dot), r * (dy2 - n2 * dot), r * (dyr - nr * dot)
        tl.store(d_row + off1[None, :], _round_to(dy1, dtype, INTERPRETING).to(dtype), mask=mask)
        tl.store(d_row + off2[None, :], _round_to(dy2, dtype, INTERPRETING).to(dtype), mask=mask)
        if REST > 0:
            tl.store(d_row + 2 * HALF + rest[None, :], _round_to(dyr, dtype, INTERPRETING).to(dtype), mask=rest_mask)
    return dw1, dw2, dwr


@triton.jit
def _backward_kernel(gq_ptr, gk_ptr, q_ptr, k_ptr, dq_ptr, dk_ptr, wq_ptr, wk_ptr, dwq_ptr, dwk_ptr, freq_ptr,
                     pos_ptr, offset_ptr, cu_ptr, cos_ptr, sin_ptr, cache_ptr, tokens, seqlen, n_qheads, n_kheads,
                     n_seqs, search_steps, scaling, eps, weight_offset, max_position, cache_stride, head_dim,
                     gq_sb, gq_ss, gq_sh, gk_sb, gk_ss, gk_sh, q_sb, q_ss, q_sh, k_sb, k_ss, k_sh,
                     dq_sb, dq_ss, dq_sh, dk_sb, dk_ss, dk_sh, pos_sb, pos_ss, cos_sb, cos_ss, cos_sd, sin_sb, sin_ss,
                     sin_sd, HALF: tl.constexpr, REST: tl.constexpr, BLOCK_HALF: tl.constexpr,
                     BLOCK_REST: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                     INTERLEAVED: tl.constexpr, SOURCE: tl.constexpr, HAS_K: tl.constexpr,
                     HAS_POSITIONS: tl.constexpr, HAS_OFFSETS: tl.constexpr, HAS_CU: tl.constexpr,
                     NORMALIZE: tl.constexpr, CHUNK_TOKENS: tl.constexpr, INTERPRETING: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    half_mask = i < HALF
    off1 = 2 * i if INTERLEAVED else i
    off2 = 2 * i + 1 if INTERLEAVED else i + HALF
    rest = tl.arange(0, BLOCK_REST)
    zeros_half = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    zeros_rest = tl.zeros([BLOCK_REST], dtype=tl.float32)
    dwq1, dwq2, dwqr = zeros_half, zeros_half, zeros_rest
    dwk1, dwk2, dwkr = zeros_half, zeros_half, zeros_rest
    for step in range(CHUNK_TOKENS):
        token = chunk * CHUNK_TOKENS + step
        if token < tokens:
            b = token // seqlen
            s = token - b * seqlen
            cos1, sin1, cos2, sin2 = _entries(
                token, b, s, i, half_mask, off1, off2, freq_ptr, pos_ptr, offset_ptr, cu_ptr, cos_ptr, sin_ptr,
                cache_ptr, n_seqs, search_steps, scaling, max_position, cache_stride, pos_sb, pos_ss, cos_sb, cos_ss,
                cos_sd, sin_sb, sin_ss, sin_sd, HALF, SOURCE, True, HAS_POSITIONS, HAS_OFFSETS, HAS_CU, INTERPRETING)
            dwq1, dwq2, dwqr = _backward_heads(
                q_ptr, gq_ptr, dq_ptr, wq_ptr, q_sb, q_ss, q_sh, gq_sb, gq_ss, gq_sh, dq_sb, dq_ss, dq_sh, b, s,
                n_qheads, eps, weight_offset, cos1, sin1, cos2, sin2, off1, off2, half_mask, dwq1, dwq2, dwqr, HALF,
                REST, BLOCK_REST, BLOCK_HQ, NORMALIZE, INTERPRETING)
            if HAS_K:
                dwk1, dwk2, dwkr = _backward_heads(
                    k_ptr, gk_ptr, dk_ptr, wk_ptr, k_sb, k_ss, k_sh, gk_sb, gk_ss, gk_sh, dk_sb, dk_ss, dk_sh, b, s,
                    n_kheads, eps, weight_offset, cos1, sin1, cos2, sin2, off1, off2, half_mask, dwk1, dwk2, dwkr,
                    HALF, REST, BLOCK_REST, BLOCK_HK, NORMALIZE, INTERPRETING)
    if NORMALIZE:
        row = chunk * head_dim
        rest_mask = rest < REST
        tl.store(dwq_ptr + row + off1, dwq1, mask=half_mask)
        tl.store(dwq_ptr + row + off2, dwq2, mask=half_mask)
        tl.store(dwq_ptr + row + 2 * HALF + rest, dwqr, mask=rest_mask)
        if HAS_K:
            tl.store(dwk_ptr + row + off1, dwk1, mask=half_mask)
            tl.store(dwk_ptr + row + off2, dwk2, mask=half_mask)
            tl.store(dwk_ptr + row + 2 * HALF + rest, dwkr, mask=rest_mask)


def _common(q, k, q_weight, k_weight, inv_freq, cos, sin, cache, positions, seqlen_offsets, cu_seqlens, rotary_dim,
            interleaved, attention_scaling, eps, weight_offset):
    """(positional args shared by both kernels after the tensors of q/k, their keyword constexprs), or None when there
    is nothing to do."""
    # What a table source does not read is refused, as the C++ glue does, not applied (offsets to a cache's rows) or
    # ignored: the twins would differ on one call.
    if inv_freq is None and (seqlen_offsets is not None or cu_seqlens is not None or attention_scaling != 1.0):
        raise ValueError("seqlen_offsets, cu_seqlens and attention_scaling apply to the inv_freq source only")
    if cos is not None and positions is not None:
        raise ValueError("cos/sin tables are read per token as given: positions apply to the inv_freq and "
                         "cos_sin_cache sources")
    check_indexed(q, k, rotary_dim, positions, seqlen_offsets, cu_seqlens, cos, sin)
    batch, seqlen, n_qheads, head_dim = q.shape
    # The rest of what the kernels index by (the C++ glue's checks): a frequency per pair, a cache row of rotary_dim,
    # weights of head_dim.
    if inv_freq is not None and inv_freq.numel() != rotary_dim // 2:
        raise ValueError(f"inv_freq must have rotary_dim / 2 = {rotary_dim // 2} entries, got {inv_freq.numel()}")
    if cache is not None and (cache.dim() != 2 or cache.shape[0] == 0 or cache.shape[1] != rotary_dim
                              or cache.stride(1) != 1 or positions is None):
        raise ValueError(f"cos_sin_cache must be a [max_position > 0, rotary_dim = {rotary_dim}] tensor with stride 1 "
                         f"in its last dim, read at positions, got {list(cache.shape)}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.dim() != 1 or not w.is_contiguous() or w.numel() != head_dim):
            raise ValueError(f"{name} must be contiguous [head_dim = {head_dim}], got {list(w.shape)}")
    n_kheads = k.shape[2] if k is not None else 0
    if batch * seqlen == 0 or (n_qheads == 0 and n_kheads == 0) or head_dim == 0:
        return None
    half = rotary_dim // 2
    block_half = triton.next_power_of_2(max(half, 1))
    rest = head_dim - rotary_dim
    block_rest = triton.next_power_of_2(max(rest, 1))
    # heads per block: a power of two (tl.arange's rule) within the element budget
    max_heads = 1 << max(0, (HEAD_BLOCK_ELEMENTS // (2 * block_half + block_rest)).bit_length() - 1)
    n_seqs = cu_seqlens.numel() - 1 if cu_seqlens is not None else 0
    source = SOURCE_CACHE if cache is not None else SOURCE_TABLE if cos is not None else SOURCE_ANGLE
    tensors = (inv_freq, positions, seqlen_offsets, cu_seqlens, cos, sin, cache)
    scalars = (seqlen, n_qheads, n_kheads, n_seqs, max(n_seqs - 1, 0).bit_length(), float(attention_scaling),
               float(eps), float(weight_offset), cache.shape[0] if cache is not None else 1,
               cache.stride(0) if cache is not None else 0)
    table_strides = (*_strides(positions, 2), *_strides(cos, 3), *_strides(sin, 3))
    constexprs = dict(
        HALF=half, REST=rest, BLOCK_HALF=block_half, BLOCK_REST=block_rest,
        BLOCK_HQ=min(triton.next_power_of_2(max(n_qheads, 1)), max_heads),
        BLOCK_HK=min(triton.next_power_of_2(max(n_kheads, 1)), max_heads),
        INTERLEAVED=bool(interleaved), SOURCE=source, HAS_K=k is not None, HAS_POSITIONS=positions is not None,
        HAS_OFFSETS=seqlen_offsets is not None, HAS_CU=cu_seqlens is not None, NORMALIZE=q_weight is not None,
        INTERPRETING=INTERPRETING,
        # No a*b+c contraction (as rope.py): the low-precision roundings must happen where written.
        enable_fp_fusion=False)
    return tensors, scalars, table_strides, constexprs


def forward(q, k, q_out, k_out, q_weight, k_weight, eps, weight_offset, inv_freq, cos, sin, cache, positions,
            seqlen_offsets, cu_seqlens, rotary_dim, interleaved, attention_scaling, low_precision) -> None:
    """Normalise (if q_weight is given) and rotate q (and k) into q_out (k_out), which may be q (k) themselves.

    q/k: [B, S, H, D] views with stride(-1) == 1 (thd as [1, T, H, D]); weights: compute-dtype [D] or None; exactly one
    of inv_freq (fp32 [R/2]), cos/sin ([B, S, R] views) or cache ([max_position, R], stride(-1) == 1); positions,
    seqlen_offsets, cu_seqlens as rope.rope_forward.
    """
    launch = _common(q, k, q_weight, k_weight, inv_freq, cos, sin, cache, positions, seqlen_offsets, cu_seqlens,
                     rotary_dim, interleaved, attention_scaling, eps, weight_offset)
    if launch is None:
        return
    tensors, scalars, table_strides, constexprs = launch
    batch, seqlen = q.shape[:2]
    _forward_kernel[(batch * seqlen,)](
        q, k, q_out, k_out, q_weight, k_weight, *tensors, *scalars, *_strides(q, 3), *_strides(k, 3),
        *_strides(q_out, 3), *_strides(k_out, 3), *table_strides, OFFSET_IS_ZERO=float(weight_offset) == 0.0,
        LOW_PRECISION=bool(low_precision), **constexprs)


def backward(grad_q, grad_k, q, k, dq, dk, q_weight, k_weight, eps, weight_offset, inv_freq, cos, sin, cache,
             positions, seqlen_offsets, cu_seqlens, rotary_dim, interleaved, attention_scaling):
    """dq (dk) from the cotangents and the saved inputs; returns the weights' gradients (compute dtype [D], summed
    over the chunks' partials in chunk order) or (None, None) without weights."""
    for name, grad, x in (("grad_q", grad_q, q), ("grad_k", grad_k, k)):
        if (grad is None) != (x is None) or (grad is not None and (grad.shape != x.shape
                                                                   or grad.shape[-1] > 1 and grad.stride(-1) != 1)):
            raise ValueError(f"{name} must have the shape of {name[5:]} with stride 1 in its last dim, got "
                             f"{None if grad is None else list(grad.shape)}")
    launch = _common(q, k, q_weight, k_weight, inv_freq, cos, sin, cache, positions, seqlen_offsets, cu_seqlens,
                     rotary_dim, interleaved, attention_scaling, eps, weight_offset)
    batch, seqlen, _, head_dim = q.shape
    chunks = triton.cdiv(batch * seqlen, CHUNK_TOKENS)
    normalize = q_weight is not None
    partials = [torch.zeros(chunks, head_dim, dtype=torch.float32, device=q.device) if normalize and w is not None
                else None for w in (q_weight, k_weight)]
    if launch is not None:
        tensors, scalars, table_strides, constexprs = launch
        _backward_kernel[(chunks,)](
            grad_q, grad_k, q, k, dq, dk, q_weight, k_weight, *partials, *tensors, batch * seqlen, *scalars, head_dim,
            *_strides(grad_q, 3), *_strides(grad_k, 3), *_strides(q, 3), *_strides(k, 3),
            *_strides(dq, 3), *_strides(dk, 3), *table_strides, CHUNK_TOKENS=CHUNK_TOKENS, **constexprs)
    return tuple(None if p is None else p.sum(0) for p in partials)


__all__ = ["forward", "backward"]
