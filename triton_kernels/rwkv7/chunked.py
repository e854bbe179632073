"""Triton twin of the chunked RWKV-7 WKV (derivation: python/ropewkv/ops/rwkv7/chunked.md; the symbols are its).

One program per (sequence, head) walks its chunks of L = 16 tokens. The fp32 state lives in registers transposed,
ST [N_k, N_v], so that every product with it is a tl.dot: per chunk

    X = A~ ST + Ak V,   U = T X  with T = (I - Ab)^{-1} = (I + Ab)(I + Ab^2)(I + Ab^4)(I + Ab^8)  (Ab^16 = 0),
    Y = R~ ST + Qb U + Qk V,    ST <- diag(E[L][0]) ST + B^^T U + K^^T V.

The masked decay products Ab, Ak, Qb, Qk are [L, L, N] broadcasts of exp(c_x - c_y) with the exponent masked to
-inf outside x >= y (exp gives 0 there), so every decay factor formed is <= 1: no cumulative decay is divided by.
The chunk's cumulative log decays c come from tl.cumsum of log d over the chunk's rows.

Precision: every dot takes input_precision="ieee" (exact fp32 products, fp32 accumulate; the GPU default would be
TF32, and "ieee" runs on the FMA units, not the tensor cores). BF16_DOTS (precision="bf16") runs each N-sized
product on bf16 tensor cores as three products of hi/lo bf16 splits of both operands, fp32 accumulate (see _dot):
~2^-16 relative per product, so the bf16 mode's error is its I/O rounding alone, as in the sequential twins; the
16 x 16 products that build T stay "ieee". The state, decays and every sum stay fp32. The interpreter cannot run
bf16 dots (notes: "silently wrong"), so there the bf16 operands are held in fp32 and multiplied exactly: the same
numbers a bf16 tensor-core dot produces, up to accumulation order. LOW_PRECISION (the RWKV-LM bf16 mode) also rounds the inputs on load and outputs on store.

Sequences and checkpoints as the recurrent kernel: chunks start at each sequence's first token; the checkpoint of
chunk c of sequence n (ST before it, k-major) is slot cu[n] // L + n + c.
"""
import triton
import triton.language as tl

from .recurrent import _log_decay, _rne_bf16, _sequence, launch_grid
from .recurrent import checkpoint_slots  # noqa: F401  (re-exported)

CHUNK = 16
DECAY_CODES = {"loglog": 0, "raw": 1, "log": 2}
HEAD_SIZES = (32, 64, 128, 256)
NUM_WARPS = {32: 4, 64: 8, 128: 8, 256: 8}


@triton.jit
def _bf16_dot(x, y, INTERPRET: tl.constexpr):
    """x @ y with bf16 operands x, y (values already bf16-exact) and fp32 accumulate."""
    if INTERPRET:  # the interpreter's bf16 dot is wrong: bf16 values held in fp32, multiplied exactly
        return tl.dot(x, y, input_precision="ieee")
    return tl.dot(x.to(tl.bfloat16), y.to(tl.bfloat16), out_dtype=tl.float32)


@triton.jit
def _dot(x, y, BF16_DOTS: tl.constexpr, INTERPRET: tl.constexpr):
    """x @ y for fp32 x, y. BF16_DOTS: as three bf16 tensor-core products of the split x = x_hi + x_lo (x_hi = x
    rounded to bf16, x_lo = the rest rounded to bf16), x_hi y_hi + x_lo y_hi + x_hi y_lo, fp32 accumulate: each
    operand keeps ~16 significant bits (the dropped x_lo y_lo is 2^-16 relative), where one bf16 product would
    round both operands to 8 bits (2^-9 each, measured 2-4e-3 RMS on y and the gradients beyond the I/O rounding)."""
    if BF16_DOTS:
        x_hi = _rne_bf16(x)
        y_hi = _rne_bf16(y)
        x_lo = _rne_bf16(x - x_hi)
        y_lo = _rne_bf16(y - y_hi)
        return _bf16_dot(x_hi, y_hi, INTERPRET) + (_bf16_dot(x_lo, y_hi, INTERPRET) + _bf16_dot(x_hi, y_lo, INTERPRET))
    return tl.dot(x, y, input_precision="ieee")


@triton.jit
def _load_rows(ptr, at, mask, LOW_PRECISION: tl.constexpr):
    x = tl.load(ptr + at, mask=mask, other=0.0).to(tl.float32)
    if LOW_PRECISION:
        x = _rne_bf16(x)
    return x


@triton.jit
def _store_rows(ptr, at, x, LOW_PRECISION: tl.constexpr, mask):
    # The explicit bf16 rounding also makes interpreted bf16 stores round to nearest (the interpreter truncates).
    if LOW_PRECISION or ptr.dtype.element_ty == tl.bfloat16:
        x = _rne_bf16(x)
    tl.store(ptr + at, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chunk(r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, t0, t1, h, H, N: tl.constexpr, L: tl.constexpr,
           DECAY: tl.constexpr, LOW_PRECISION: tl.constexpr):
    """The chunk [t0, t1)'s rows (zero beyond t1, where log d = 0 too) and its state-independent quantities."""
    rows = tl.arange(0, L)
    cols = tl.arange(0, N)
    tok = (t0 + rows).to(tl.int64)
    valid = (tok < t1)[:, None]
    at = (tok[:, None] * H + h) * N + cols[None, :]
    r = _load_rows(r_ptr, at, valid, LOW_PRECISION)
    k = _load_rows(k_ptr, at, valid, LOW_PRECISION)
    v = _load_rows(v_ptr, at, valid, LOW_PRECISION)
    a = _load_rows(a_ptr, at, valid, LOW_PRECISION)
    b = _load_rows(b_ptr, at, valid, LOW_PRECISION)
    w = _load_rows(w_ptr, at, valid, LOW_PRECISION)
    log_d, dlog = _log_decay(w, DECAY)
    logd = tl.where(valid, log_d, 0.0)
    ca = tl.cumsum(logd, axis=0)   # c[l + 1]
    cb = ca - logd                 # c[l]
    clast = tl.sum(logd, axis=0)   # c[len]
    return r, k, v, a, b, logd, dlog, ca, cb, clast, at, valid


@triton.jit
def _masked_products(r_ptr, w_ptr, k_ptr, a_ptr, b_ptr, t0, t1, h, H, N: tl.constexpr, L: tl.constexpr,
                     BK: tl.constexpr, DECAY: tl.constexpr, LOW_PRECISION: tl.constexpr):
    """Ab, Ak, Qb, Qk [L, L], summed over BK-column slices of the chunk (re-read from global and their c recomputed
    per slice, as c is per column), so that the [L, L, BK] decay blocks fit in registers."""
    rows = tl.arange(0, L)
    tok = (t0 + rows).to(tl.int64)
    valid = (tok < t1)[:, None]
    Ab = tl.zeros((L, L), dtype=tl.float32)
    Ak = tl.zeros((L, L), dtype=tl.float32)
    Qb = tl.zeros((L, L), dtype=tl.float32)
    Qk = tl.zeros((L, L), dtype=tl.float32)
    for j0 in tl.static_range(0, N, BK):
        at = (tok[:, None] * H + h) * N + j0 + tl.arange(0, BK)[None, :]
        r = _load_rows(r_ptr, at, valid, LOW_PRECISION)
        k = _load_rows(k_ptr, at, valid, LOW_PRECISION)
        a = _load_rows(a_ptr, at, valid, LOW_PRECISION)
        b = _load_rows(b_ptr, at, valid, LOW_PRECISION)
        log_d, _ = _log_decay(_load_rows(w_ptr, at, valid, LOW_PRECISION), DECAY)
        logd = tl.where(valid, log_d, 0.0)
        ca = tl.cumsum(logd, axis=0)
        Eb, Eq = _masked_decays(ca, ca - logd, L)
        Ab += tl.sum(a[:, None, :] * Eb * b[None, :, :], axis=2)
        Ak += tl.sum(a[:, None, :] * Eb * k[None, :, :], axis=2)
        Qb += tl.sum(r[:, None, :] * Eq * b[None, :, :], axis=2)
        Qk += tl.sum(r[:, None, :] * Eq * k[None, :, :], axis=2)
    return Ab, Ak, Qb, Qk


@triton.jit
def _masked_decays(ca, cb, L: tl.constexpr):
    """E[l][m+1] for m < l (the Ab, Ak pairs) and E[l+1][m+1] for m <= l (Qb, Qk), [L, L, N], 0 elsewhere."""
    rows = tl.arange(0, L)
    strict = (rows[None, :] < rows[:, None])[:, :, None]
    incl = (rows[None, :] <= rows[:, None])[:, :, None]
    Eb = tl.exp(tl.where(strict, cb[:, None, :] - ca[None, :, :], float("-inf")))
    Eq = tl.exp(tl.where(incl, ca[:, None, :] - ca[None, :, :], float("-inf")))
    return Eb, Eq


@triton.jit
def _solve_matrix(Ab, L: tl.constexpr):
    """T = (I - Ab)^{-1} for strictly lower triangular Ab (nilpotent: Ab^L = 0, L = 16), by four doublings."""
    rows = tl.arange(0, L)
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    P2 = tl.dot(Ab, Ab, input_precision="ieee")
    P4 = tl.dot(P2, P2, input_precision="ieee")
    P8 = tl.dot(P4, P4, input_precision="ieee")
    T = eye + Ab
    T = T + tl.dot(T, P2, input_precision="ieee")
    T = T + tl.dot(T, P4, input_precision="ieee")
    T = T + tl.dot(T, P8, input_precision="ieee")
    return T


@triton.jit
def _chunked_fwd_kernel(r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, s0_ptr, cu_ptr, y_ptr, sT_ptr, ckpt_ptr, T, H,
                        N: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, DECAY: tl.constexpr, LOW_PRECISION: tl.constexpr,
                        BF16_DOTS: tl.constexpr, INTERPRET: tl.constexpr, HAS_S0: tl.constexpr,
                        VARLEN: tl.constexpr, SAVE: tl.constexpr):
    n, h, bos, eos = _sequence(cu_ptr, T, H, VARLEN)
    offs = tl.arange(0, N).to(tl.int64)
    kmaj = offs[:, None] * N + offs[None, :]      # ST[k][v] at k * N + v (checkpoints)
    transposed = offs[:, None] + offs[None, :] * N  # ST[k][v] = S[v][k] at v * N + k (states in and out)
    state_at = (n * H + h) * N * N
    if HAS_S0:
        ST = tl.load(s0_ptr + state_at + transposed)
    else:
        ST = tl.zeros((N, N), dtype=tl.float32)
    slot0 = bos // L + n
    for c in range(0, tl.cdiv(eos - bos, L)):
        t0 = bos + c * L
        if SAVE:
            tl.store(ckpt_ptr + ((slot0 + c) * H + h) * N * N + kmaj, ST)
        r, k, v, a, b, logd, dlog, ca, cb, clast, at, valid = _chunk(
            r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, t0, tl.minimum(t0 + L, eos), h, H, N, L, DECAY, LOW_PRECISION)
        Ab, Ak, Qb, Qk = _masked_products(r_ptr, w_ptr, k_ptr, a_ptr, b_ptr, t0, tl.minimum(t0 + L, eos), h, H, N, L,
                                          BK, DECAY, LOW_PRECISION)
        At = a * tl.exp(cb)
        Rt = r * tl.exp(ca)
        rest = tl.exp(clast[None, :] - ca)
        Bh = b * rest
        Kh = k * rest
        X = _dot(At, ST, BF16_DOTS, INTERPRET) + _dot(Ak, v, BF16_DOTS, INTERPRET)
        U = _dot(_solve_matrix(Ab, L), X, BF16_DOTS, INTERPRET)
        Y = _dot(Rt, ST, BF16_DOTS, INTERPRET) + _dot(Qb, U, BF16_DOTS, INTERPRET) + _dot(Qk, v, BF16_DOTS,
                                                                                            INTERPRET)
        _store_rows(y_ptr, at, Y, LOW_PRECISION, valid)
        ST = (tl.exp(clast)[:, None] * ST + _dot(tl.trans(Bh), U, BF16_DOTS, INTERPRET)
              + _dot(tl.trans(Kh), v, BF16_DOTS, INTERPRET))
    tl.store(sT_ptr + state_at + transposed, ST)


@triton.jit
def _chunked_bwd_kernel(r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, cu_ptr, ckpt_ptr, gy_ptr, gsT_ptr,
                        dr_ptr, dw_ptr, dk_ptr, dv_ptr, da_ptr, db_ptr, ds0_ptr, T, H,
                        N: tl.constexpr, L: tl.constexpr, DECAY: tl.constexpr, LOW_PRECISION: tl.constexpr,
                        BF16_DOTS: tl.constexpr, INTERPRET: tl.constexpr, HAS_GST: tl.constexpr,
                        VARLEN: tl.constexpr):
    n, h, bos, eos = _sequence(cu_ptr, T, H, VARLEN)
    offs = tl.arange(0, N).to(tl.int64)
    kmaj = offs[:, None] * N + offs[None, :]
    transposed = offs[:, None] + offs[None, :] * N
    state_at = (n * H + h) * N * N
    if HAS_GST:
        GT = tl.load(gsT_ptr + state_at + transposed)  # dL/dS after the current chunk, transposed like ST
    else:
        GT = tl.zeros((N, N), dtype=tl.float32)
    rows = tl.arange(0, L)
    strict = rows[None, :] < rows[:, None]
    incl = rows[None, :] <= rows[:, None]
    slot0 = bos // L + n
    n_chunks = tl.cdiv(eos - bos, L)
    for cc in range(0, n_chunks):
        c = n_chunks - 1 - cc
        t0 = bos + c * L
        ST0 = tl.load(ckpt_ptr + ((slot0 + c) * H + h) * N * N + kmaj)
        r, k, v, a, b, logd, dlog, ca, cb, clast, at, valid = _chunk(
            r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, t0, tl.minimum(t0 + L, eos), h, H, N, L, DECAY, LOW_PRECISION)
        dy = tl.load(gy_ptr + at, mask=valid, other=0.0).to(tl.float32)
        # Recompute the forward's quantities.
        Eb, Eq = _masked_decays(ca, cb, L)
        Ab = tl.sum(a[:, None, :] * Eb * b[None, :, :], axis=2)
        Ak = tl.sum(a[:, None, :] * Eb * k[None, :, :], axis=2)
        Qb = tl.sum(r[:, None, :] * Eq * b[None, :, :], axis=2)
        Qk = tl.sum(r[:, None, :] * Eq * k[None, :, :], axis=2)
        e_before = tl.exp(cb)
        e_after = tl.exp(ca)
        rest = tl.exp(clast[None, :] - ca)
        e_all = tl.exp(clast)
        At = a * e_before
        Rt = r * e_after
        Bh = b * rest
        Kh = k * rest
        Tm = _solve_matrix(Ab, L)
        U = _dot(Tm, _dot(At, ST0, BF16_DOTS, INTERPRET) + _dot(Ak, v, BF16_DOTS, INTERPRET), BF16_DOTS, INTERPRET)
        # From S_L: dU = B^ G^T, dV = K^ G^T, dB^ = U G, dK^ = V G, dc[L] = e^{c[L]} sum_v S0 G.
        G = tl.trans(GT)
        S0 = tl.trans(ST0)
        dU = _dot(Bh, GT, BF16_DOTS, INTERPRET)
        dV = _dot(Kh, GT, BF16_DOTS, INTERPRET)
        dBh = _dot(U, G, BF16_DOTS, INTERPRET)
        dKh = _dot(v, G, BF16_DOTS, INTERPRET)
        dclast = e_all * tl.sum(ST0 * GT, axis=1)
        # From Y.
        dQb = tl.where(incl, _dot(dy, tl.trans(U), BF16_DOTS, INTERPRET), 0.0)
        dQk = tl.where(incl, _dot(dy, tl.trans(v), BF16_DOTS, INTERPRET), 0.0)
        dU += _dot(tl.trans(Qb), dy, BF16_DOTS, INTERPRET)
        dV += _dot(tl.trans(Qk), dy, BF16_DOTS, INTERPRET)
        dRt = _dot(dy, S0, BF16_DOTS, INTERPRET)
        # From U = (I - Ab)^{-1} X.
        dX = _dot(tl.trans(Tm), dU, BF16_DOTS, INTERPRET)
        dAb = tl.where(strict, _dot(dX, tl.trans(U), BF16_DOTS, INTERPRET), 0.0)
        dAk = tl.where(strict, _dot(dX, tl.trans(v), BF16_DOTS, INTERPRET), 0.0)
        dV += _dot(tl.trans(Ak), dX, BF16_DOTS, INTERPRET)
        dAt = _dot(dX, S0, BF16_DOTS, INTERPRET)
        GT = (e_all[:, None] * GT + _dot(tl.trans(Rt), dy, BF16_DOTS, INTERPRET)
              + _dot(tl.trans(At), dX, BF16_DOTS, INTERPRET))
        # The masked products (dx = sum_m dM y E, dy = sum_l dM x E; dc[p(l)] += x dx, dc[m+1] -= y dy).
        tx = tl.sum(Eb * (dAb[:, :, None] * b[None, :, :] + dAk[:, :, None] * k[None, :, :]), axis=1)
        tyb = tl.sum(dAb[:, :, None] * Eb * a[:, None, :], axis=0)
        tyk = tl.sum(dAk[:, :, None] * Eb * a[:, None, :], axis=0)
        da = tx + dAt * e_before
        dcb = a * tx + dAt * At
        db = tyb
        dk = tyk
        dca = -(b * tyb + k * tyk)
        tx = tl.sum(Eq * (dQb[:, :, None] * b[None, :, :] + dQk[:, :, None] * k[None, :, :]), axis=1)
        tyb = tl.sum(dQb[:, :, None] * Eq * r[:, None, :], axis=0)
        tyk = tl.sum(dQk[:, :, None] * Eq * r[:, None, :], axis=0)
        dr = tx + dRt * e_after
        dca += r * tx - (b * tyb + k * tyk) + dRt * Rt
        db += tyb + dBh * rest
        dk += tyk + dKh * rest
        to_last = dBh * Bh + dKh * Kh
        dca -= to_last
        dclast += tl.sum(to_last, axis=0)
        # log d of row l is in c[x] for x >= l + 1: c_after of rows >= l, c_before of rows > l, and c[L].
        dlogd = tl.cumsum(dca, axis=0, reverse=True) + tl.cumsum(dcb, axis=0, reverse=True) - dcb + dclast[None, :]
        _store_rows(dr_ptr, at, dr, LOW_PRECISION, valid)
        _store_rows(dw_ptr, at, dlogd * dlog, LOW_PRECISION, valid)
        _store_rows(dk_ptr, at, dk, LOW_PRECISION, valid)
        _store_rows(dv_ptr, at, dV, LOW_PRECISION, valid)
        _store_rows(da_ptr, at, da, LOW_PRECISION, valid)
        _store_rows(db_ptr, at, db, LOW_PRECISION, valid)
    tl.store(ds0_ptr + state_at + transposed, GT)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def wkv7_forward(r, w, k, v, a, b, initial_state, cu_seqlens, y, final_state, checkpoints, decay: str,
                 low_precision: bool, bf16_dots: bool):
    """As recurrent.wkv7_forward (same arguments and checkpoint shape), chunked."""
    batch, seqlen, heads, n = r.shape
    n_seqs = final_state.shape[0]
    if n_seqs * heads == 0:
        return
    _chunked_fwd_kernel[launch_grid(n_seqs, heads)](
        r, w, k, v, a, b, r if initial_state is None else initial_state, r if cu_seqlens is None else cu_seqlens,
        y, final_state, final_state if checkpoints is None else checkpoints, seqlen, heads,
        N=n, L=CHUNK, BK=min(n, 16), DECAY=DECAY_CODES[decay], LOW_PRECISION=low_precision, BF16_DOTS=bf16_dots,
        INTERPRET=_interpreting(), HAS_S0=initial_state is not None, VARLEN=cu_seqlens is not None,
        SAVE=checkpoints is not None, num_warps=NUM_WARPS[n])


def wkv7_backward(r, w, k, v, a, b, cu_seqlens, checkpoints, grad_y, grad_final, grads, grad_initial, decay: str,
                  low_precision: bool, bf16_dots: bool):
    """As recurrent.wkv7_backward, chunked."""
    batch, seqlen, heads, n = r.shape
    n_seqs = grad_initial.shape[0]
    if n_seqs * heads == 0:
        return
    _chunked_bwd_kernel[launch_grid(n_seqs, heads)](
        r, w, k, v, a, b, r if cu_seqlens is None else cu_seqlens, checkpoints, grad_y,
        grad_initial if grad_final is None else grad_final, *grads, grad_initial, seqlen, heads,
        N=n, L=CHUNK, DECAY=DECAY_CODES[decay], LOW_PRECISION=low_precision, BF16_DOTS=bf16_dots,
        INTERPRET=_interpreting(), HAS_GST=grad_final is not None, VARLEN=cu_seqlens is not None,
        num_warps=NUM_WARPS[n])
