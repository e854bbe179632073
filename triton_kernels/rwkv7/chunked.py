"""Triton twin of the chunked RWKV-7 WKV (derivation: python/ropewkv/ops/rwkv7/chunked.md; the symbols are its).

The fp32 state is held transposed, ST [N_k, N_v], so that every product with it is a tl.dot. Per chunk, with
T = (I - Ab)^{-1} = (I + Ab)(I + Ab^2)(I + Ab^4)(I + Ab^8)  (Ab^16 = 0),

    U = T (A~ ST + Ak V) = W ST + M V            with W = T A~, M = T Ak,
    Y = R~ ST + Qb U + Qk V = R' ST + Q' V       with R' = R~ + Qb W, Q' = Qb M + Qk,
    ST <- diag(E[L][0]) ST + B^^T U + K^^T V.

Forward: everything but ST depends on the chunk's own r, w, k, a, b only, so a first kernel forms W, R', B^, K^,
E[L][0], M and Q' for every chunk at once (a program per (chunk, head): the masked products, the exps and the
solve, which are most of the work, run on the whole GPU), into a temporary fp32 buffer (prep_floats per chunk and
head); a second kernel walks the chunks in order, a program per (sequence, head, VALUE_BLOCK columns of ST: the
columns evolve independently), doing only the products with the state. Its chain per chunk is six small dots.
The backward likewise: the prep again (with T, Ak, Qb, Qk too), then the state cotangent G through the chunks in
reverse, a program per (sequence, head, value block), G^T <- diag(E[L][0]) G^T + W^T (B^ G^T) + R'^T dY (the
forward's lines reversed: its columns are independent too), storing each chunk's incoming G^T in a buffer shaped like
the checkpoints; then every chunk's input gradients at once, a program per (chunk, head), from its checkpoint S0^T,
its G^T and its prep. Temporary memory: 18.7 KB (forward) and 46.8 KB (backward: prep, G^T, scratch) per chunk and
head at N = 64, i.e. 18 and 46 B per element of r.

The masked decay products Ab, Ak, Qb, Qk are sums over broadcasts of exp(c_x - c_y) with the exponent masked to
-inf outside x >= y (exp gives 0 there), so every decay factor formed is <= 1: no cumulative decay is divided by.
The chunk's cumulative log decays c come from an fp64 tl.cumsum of log d over the chunk's rows (log d floored at
LOG_D_FLOOR, so that a decay of 0 gives products of 0, not -inf - -inf = NaN), held as fp32 pairs c = hi + lo. A pair
decay exp(c_x - c_y) is exp(hi_x - hi_y) (1 + lo_x) (1 - lo_y): the his' difference is exact when they are within a
factor 2 (Sterbenz) and rounded once otherwise, and the los (|lo| <= ulp(hi) / 2, so 1 +- lo is e^{+-lo} to fp32)
become per-row factors of the operands, nothing per pair. With fp32 sums, a log decay near the floor on a chunk's
first row left ulp(110) = 7.6e-6 of rounding in every later pair's exponent: y was 2.3e-6 RMS off fp64 where the
sequential and CPU chunked twins were 1.1e-7 (`test_a_vanishing_decay_costs_no_precision`).

Registers: every product with the state either contracts over k or is indexed by k, and every other k-indexed
quantity (c, the decays, A~, R~, B^, K^ and the gradients of r, w, k, a, b) is per column k. So each pass over the
chunk (in the prep, the state pass and the backward) runs over BK = 16-column slices of k (a runtime loop: one
slice's code, so no two slices are live at once), reloading the slice's rows and recomputing its c, with the state
(forward: ST in the final-state output, each program its columns; backward: S0^T from the checkpoint and G^T in the
initial-state gradient output) read and written in [BK, N] slices of global memory, a barrier between a slice's last
read and its write. The backward's products over v run in BK-column slices of v too, U and dX through a per-program
scratch. No [N, N] block, no [L, L, N] decay block and no dot contracting over N is ever in registers (an FMA dot's
operands take (rows + columns per thread) x K registers: 256 for a [16, 64] x [64, 64] product at 8 warps). Every
address is a 64-bit scalar base (the chunk's first row, the program's state, checkpoint slot or scratch) plus 32-bit
per-thread offsets: 64-bit per-thread pointers held across the chunk loop were what the backward spilled.

Precision: every dot takes input_precision="ieee" (exact fp32 products, fp32 accumulate; the GPU default would be
TF32, and "ieee" runs on the FMA units, not the tensor cores). BF16_DOTS (precision="bf16") runs each N-sized
product on bf16 tensor cores as three products of hi/lo bf16 splits of both operands, fp32 accumulate (see _dot):
~2^-16 relative per product, so the bf16 mode's error is its I/O rounding alone, as in the sequential twins; the
16 x 16 x 16 products (T, M, Q') stay "ieee". The state, decays and every sum stay fp32. The interpreter cannot run
bf16 dots (notes: "silently wrong"), so there the bf16 operands are held in fp32 and multiplied exactly: the same
numbers a bf16 tensor-core dot produces, up to accumulation order. LOW_PRECISION (the RWKV-LM bf16 mode) also
rounds the inputs on load and outputs on store.

Sequences and checkpoints: chunks are aligned to each sequence's end (_chunk_rows: the first one short, its first
rows absent), so that left padding and packing change nothing bit for bit; the checkpoint of chunk c of sequence n
(ST before it, k-major) is slot cu[n] // L + n + c, as the recurrent kernel's, and the prep of that chunk is in the
same slot of the prep buffer (its first kernel finds a slot's sequence by binary search over cu_seqlens).
"""
import torch
import triton
import triton.language as tl

from .._common import INTERPRETING, rne_bf16
from .recurrent import DECAY_CODES, _log_decay, _sequence, _zero_gap_slot, launch_grid
from .recurrent import checkpoint_slots  # noqa: F401  (re-exported)

CHUNK = 16
# The least log decay the chunk's cumulative sums see: exp(-110) is 0 in fp32 (below half the least subnormal).
LOG_D_FLOOR = tl.constexpr(-110.0)
# The forward's kernels: the prep (a program per chunk and head) and the state pass (a program per sequence, head and
# VALUE_BLOCK state columns).
PREP_NUM_WARPS = {32: 4, 64: 4, 128: 4, 256: 4}
# The prep's register cap: 3 programs per SM (ptxas took 186 registers unasked: 2), so that a scheduler holds 3 warps
# to overlap one's dependent chain with another's (the H100 ran the chunked kernels near their chains' upper bound).
# No spills at N = 32-256 in either precision mode on Triton 3.6 and 3.7.1; at 128 registers it spilled 108 B.
PREP_MAX_REGISTERS = 168
VALUE_BLOCK = {32: 32, 64: 64, 128: 64, 256: 64}
STATE_NUM_WARPS = {32: 4, 64: 4, 128: 4, 256: 4}
# The backward at N = 32 on 4 warps: 255 registers and ~200-400 B spilled ([16, 16, 16] decay blocks, 32 per thread).
BWD_NUM_WARPS = {32: 8, 64: 8, 128: 8, 256: 8}


@triton.jit
def _bf16_dot(x, y, INTERPRET: tl.constexpr):
    """x @ y with bf16 operands x, y (values already bf16-exact) and fp32 accumulate."""
    if INTERPRET:  # the interpreter's bf16 dot is wrong: bf16 values held in fp32, multiplied exactly
        return tl.dot(x, y, input_precision="ieee")
    return tl.dot(x.to(tl.bfloat16), y.to(tl.bfloat16), out_dtype=tl.float32)


@triton.jit
def _dot(x, y, BF16_DOTS: tl.constexpr, INTERPRET: tl.constexpr, X_BF16: tl.constexpr = False,
         Y_BF16: tl.constexpr = False):
    """x @ y for fp32 x, y. BF16_DOTS: as three bf16 tensor-core products of the split x = x_hi + x_lo (x_hi = x
    rounded to bf16, x_lo = the rest rounded to bf16), x_hi y_hi + x_lo y_hi + x_hi y_lo, fp32 accumulate: each
    operand keeps ~16 significant bits (the dropped x_lo y_lo is 2^-16 relative), where one bf16 product would
    round both operands to 8 bits (2^-9 each, measured 2-4e-3 RMS on y and the gradients beyond the I/O rounding).
    X_BF16 / Y_BF16: that operand is bf16-exact (v and dY, rounded on load in the bf16 mode), so its lo part is zero
    and its product is skipped: the same sum, one tensor-core product and the split's registers fewer (both: one
    product)."""
    if BF16_DOTS:
        if X_BF16 and Y_BF16:
            return _bf16_dot(x, y, INTERPRET)
        if X_BF16:
            y_hi = rne_bf16(y)
            return _bf16_dot(x, y_hi, INTERPRET) + _bf16_dot(x, rne_bf16(y - y_hi), INTERPRET)
        x_hi = rne_bf16(x)
        if Y_BF16:
            return _bf16_dot(x_hi, y, INTERPRET) + _bf16_dot(rne_bf16(x - x_hi), y, INTERPRET)
        y_hi = rne_bf16(y)
        x_lo = rne_bf16(x - x_hi)
        y_lo = rne_bf16(y - y_hi)
        return _bf16_dot(x_hi, y_hi, INTERPRET) + (_bf16_dot(x_lo, y_hi, INTERPRET) + _bf16_dot(x_hi, y_lo, INTERPRET))
    return tl.dot(x, y, input_precision="ieee")


@triton.jit
def _load_rows(ptr, at, mask, LOW_PRECISION: tl.constexpr):
    x = tl.load(ptr + at, mask=mask, other=0.0).to(tl.float32)
    if LOW_PRECISION and ptr.dtype.element_ty != tl.bfloat16:  # bf16 inputs are bf16 already
        x = rne_bf16(x)
    return x


@triton.jit
def _store_rows(ptr, at, x, LOW_PRECISION: tl.constexpr, mask):
    # The explicit bf16 rounding also makes interpreted bf16 stores round to nearest (the interpreter truncates).
    if LOW_PRECISION or ptr.dtype.element_ty == tl.bfloat16:
        x = rne_bf16(x)
    tl.store(ptr + at, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split(x):
    """An fp64 x as fp32 (hi, lo): hi the rounded x, lo the rest, rounded."""
    hi = x.to(tl.float32)
    return hi, (x - hi.to(tl.float64)).to(tl.float32)


@triton.jit
def _decay_to_end(ca, ca_lo, clast, clast_lo):
    """E[len][l+1] per row l and column: exp(c[len] - c[l+1]) from the (hi, lo) pairs, whose his' difference cancels
    a large log decay that both hold exactly."""
    return tl.exp((clast[None, :] - ca) + (clast_lo[None, :] - ca_lo))


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
def _columns(r_ptr, w_ptr, k_ptr, a_ptr, b_ptr, row0, HN, valid, j0, L: tl.constexpr, BK: tl.constexpr,
             DECAY: tl.constexpr, LOW_PRECISION: tl.constexpr):
    """Columns [j0, j0 + BK) of the chunk's rows (the first at element row0, the next HN apart; zero where not
    valid, where log d = 0 too) and their cumulative log decays (per column, so a column slice is self-contained):
    c[l + 1], c[l] and c[len], each an fp32 (hi, lo) pair of its fp64 sum, so that a difference of two of them loses
    nothing to a large log decay that both hold (see the module's docstring)."""
    at = tl.arange(0, L)[:, None] * HN + tl.arange(0, BK)[None, :]
    r = _load_rows(r_ptr + row0 + j0, at, valid, LOW_PRECISION)
    k = _load_rows(k_ptr + row0 + j0, at, valid, LOW_PRECISION)
    a = _load_rows(a_ptr + row0 + j0, at, valid, LOW_PRECISION)
    b = _load_rows(b_ptr + row0 + j0, at, valid, LOW_PRECISION)
    log_d, dlog = _log_decay(_load_rows(w_ptr + row0 + j0, at, valid, LOW_PRECISION), DECAY)
    # A decay of 0 (log d = -inf: "loglog" w = +inf, "log" w = -inf) would make the cumulative sums' differences
    # -inf - -inf = NaN; at LOG_D_FLOOR every product over it is still exactly 0 (exp underflows), and NaN stays NaN.
    logd = tl.where(valid, tl.where(log_d < LOG_D_FLOOR, LOG_D_FLOOR, log_d), 0.0)
    logd64 = logd.to(tl.float64)
    after = tl.cumsum(logd64, axis=0)
    ca, ca_lo = _split(after)
    cb, cb_lo = _split(after - logd64)
    clast, clast_lo = _split(tl.sum(logd64, axis=0))
    return r, k, a, b, dlog, tl.exp(logd), ca, ca_lo, cb, cb_lo, clast, clast_lo


@triton.jit
def _add_masked_products(Ab, Ak, Qb, Qk, r, k, a, b, d, ca, ca_lo, cb, cb_lo, L: tl.constexpr):
    """Ab, Ak, Qb, Qk [L, L] plus one column slice's share (the sums over j of x_l[j] y_m[j] E[.][m+1][j], the
    decays as in _masked_decays), with the column j as the leading axis of the [BK, L, L] broadcasts: the compiler
    spreads a block's last axes over lanes and warps, so the sums over j stay within each thread (in [L, L, BK] form
    they were four 16-lane shuffle reductions per entry: 1,802 instructions per slice in the forward, then 955). One
    exp per pair: r_l E[l+1][m+1] = (r_l d_l) E[l][m+1] below the diagonal (704 instructions per slice, Triton 3.7.1;
    3.6.0 745; the product formed before the transpose, else 3.6.0 recomputes it per pair: 1,223). The pair decays
    take the his' differences, and the los enter as per-row factors of the operands (see the module's docstring)."""
    rows = tl.arange(0, L)
    strict = (rows[None, :] < rows[:, None])[None, :, :]
    diagonal = (rows[None, :] == rows[:, None])[None, :, :]
    Eb = tl.exp(tl.where(strict, tl.trans(cb)[:, :, None] - tl.trans(ca)[:, None, :], float("-inf")))
    row_factor = 1.0 + cb_lo
    col_factor = 1.0 - ca_lo
    aE = tl.trans(a * row_factor)[:, :, None] * Eb
    # On the diagonal (no decay) r cancels b's and k's column factor.
    rE = tl.where(diagonal, tl.trans(r * (1.0 + ca_lo))[:, :, None], tl.trans(r * d * row_factor)[:, :, None] * Eb)
    b_t = tl.trans(b * col_factor)[:, None, :]
    k_t = tl.trans(k * col_factor)[:, None, :]
    Ab += tl.sum(aE * b_t, axis=0)
    Ak += tl.sum(aE * k_t, axis=0)
    Qb += tl.sum(rE * b_t, axis=0)
    Qk += tl.sum(rE * k_t, axis=0)
    return Ab, Ak, Qb, Qk


@triton.jit
def _masked_cotangents(x, y1, y2, dM1, dM2, E):
    """For the masked products M1 = sum_j x y1 E, M2 = sum_j x y2 E ([L, L] from [L, BK] column slices):
    tx = sum_m E (dM1 y1 + dM2 y2) (dx = tx, dc[p(l)] += x tx) and ty = sum_l dM E x (dy = ty, dc[m+1] -= y ty)."""
    tx = tl.sum(E * (dM1[:, :, None] * y1[None, :, :] + dM2[:, :, None] * y2[None, :, :]), axis=1)
    ty1 = tl.sum(dM1[:, :, None] * E * x[:, None, :], axis=0)
    ty2 = tl.sum(dM2[:, :, None] * E * x[:, None, :], axis=0)
    return tx, ty1, ty2


@triton.jit
def _init_state_block(src_ptr, dst_ptr, state_at, N: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_SRC: tl.constexpr):
    """dst <- src (zeros without one), an [N, BV] block of a state in [BK, BV] slices (at state_at + j0), then a
    barrier: the kernels read the block back from dst."""
    for j0 in range(0, N, BK):
        if HAS_SRC:
            x = tl.load(src_ptr + j0 + state_at)
        else:
            x = tl.zeros((BK, BV), dtype=tl.float32)
        tl.store(dst_ptr + j0 + state_at, x)
    tl.debug_barrier()


@triton.jit
def _slot0(n, cu_ptr, T, L: tl.constexpr, VARLEN: tl.constexpr):
    """Sequence n's first prep and checkpoint slot, bos // L + n (bos clamped as _sequence does): increasing in n."""
    if VARLEN:
        bos = tl.minimum(tl.maximum(tl.load(cu_ptr + n).to(tl.int64), 0), T)
    else:
        bos = n * T
    return bos // L + n


@triton.jit
def _chunk_of_slot(slot, cu_ptr, n_seqs, T, L: tl.constexpr, VARLEN: tl.constexpr):
    """The sequence n and chunk c whose slot is `slot`: n by binary search over _slot0 (no host sync for varlen).
    Gap slots (past their sequence's last chunk) get a c whose rows are all invalid; c >= 0 even for malformed
    cu_seqlens, so every row read lies in [bos, eos)."""
    lo = slot * 0
    hi = lo + n_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        later = _slot0(mid, cu_ptr, T, L, VARLEN) <= slot
        lo = tl.where(later, mid, lo)
        hi = tl.where(later, hi, mid)
    return lo, tl.maximum(slot - _slot0(lo, cu_ptr, T, L, VARLEN), 0)


@triton.jit
def _slot_program(cu_ptr, T, H, n_seqs, L: tl.constexpr, VARLEN: tl.constexpr):
    """A one-chunk program's indices (grid: (slot, head), the head fastest): the program, the sequence n, head h,
    chunk c and _sequence's token range [bos, eos)."""
    program = tl.program_id(0).to(tl.int64)
    n, c = _chunk_of_slot(program // H, cu_ptr, n_seqs, T, L, VARLEN)
    _, h, bos, eos = _sequence(n * H + program % H, cu_ptr, T, H, VARLEN)
    return program, n, h, c, bos, eos


@triton.jit
def _chunk_rows(c, bos, eos, h, H, N: tl.constexpr, L: tl.constexpr):
    """Chunk c of the sequence [bos, eos), head h: the element offset of its first row in a [B, T, H, N] tensor (that
    row's token may precede bos), and its rows that are tokens ([L, 1]). Chunks
    are aligned to the sequence's end, the first one short with its first rows absent (zeros, log decay 0), so a
    token's row depends only on its distance to eos: left padding and the tokens packed before a sequence change its
    outputs by nothing, bit for bit (as in the CPU twin). No row of a c past the last chunk (a gap slot) is a token."""
    n_chunks = tl.cdiv(eos - bos, L)
    first = eos - (n_chunks - c) * L
    lowest = tl.where(c < n_chunks, bos - first, L)  # rows before it are absent (a gap slot's: all of them)
    return (first * H + h) * N, (tl.arange(0, L) >= lowest)[:, None]


@triton.jit
def _prep_rows(prep, i, L: tl.constexpr, N: tl.constexpr):
    """Block i of a chunk's prep: the [L, N] W, R', B^, K^ (i = 0..3, row-major), then E[L][0] [N] (i = 4)."""
    return prep + i * L * N


@triton.jit
def _prep_square(prep, i, L: tl.constexpr, N: tl.constexpr):
    """Square i of a chunk's prep, after its rows: the [L, L] M, Q' and (backward) T, Ak, Qb, Qk (i = 0..5)."""
    return prep + 4 * L * N + N + i * L * L


@triton.jit
def _chunked_prep_kernel(r_ptr, w_ptr, k_ptr, a_ptr, b_ptr, cu_ptr, prep_ptr, T, H, n_seqs,
                         N: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, PREP: tl.constexpr,
                         DECAY: tl.constexpr, LOW_PRECISION: tl.constexpr, VARLEN: tl.constexpr,
                         SQUARES: tl.constexpr):
    """The state-independent part of one chunk and head (a program per (slot, head), all chunks at once): W = T A~,
    R' = R~ + Qb W, B^, K^ [L, N], E[L][0] [N], M = T Ak, Q' = Qb M + Qk [L, L] and (SQUARES, for the backward)
    T, Ak, Qb, Qk [L, L], stored in that order at prep (PREP floats per program). Its dots are all 16 x 16 x 16
    ("ieee" in both precision modes)."""
    program, n, h, c, bos, eos = _slot_program(cu_ptr, T, H, n_seqs, L, VARLEN)
    rows = tl.arange(0, L)
    kk = tl.arange(0, BK)
    HN = H * N
    row0, valid = _chunk_rows(c, bos, eos, h, H, N, L)
    prep = prep_ptr + program * PREP
    Ab = tl.zeros((L, L), dtype=tl.float32)
    Ak = tl.zeros((L, L), dtype=tl.float32)
    Qb = tl.zeros((L, L), dtype=tl.float32)
    Qk = tl.zeros((L, L), dtype=tl.float32)
    for j0 in range(0, N, BK):
        r, k, a, b, dlog, d, ca, ca_lo, cb, cb_lo, _, _ = _columns(
            r_ptr, w_ptr, k_ptr, a_ptr, b_ptr, row0, HN, valid, j0, L, BK, DECAY, LOW_PRECISION)
        Ab, Ak, Qb, Qk = _add_masked_products(Ab, Ak, Qb, Qk, r, k, a, b, d, ca, ca_lo, cb, cb_lo, L)
    Tm = _solve_matrix(Ab, L)
    M = tl.dot(Tm, Ak, input_precision="ieee")
    square_at = rows[:, None] * L + rows[None, :]
    tl.store(_prep_square(prep, 0, L, N) + square_at, M)
    tl.store(_prep_square(prep, 1, L, N) + square_at, Qk + tl.dot(Qb, M, input_precision="ieee"))
    if SQUARES:
        tl.store(_prep_square(prep, 2, L, N) + square_at, Tm)
        tl.store(_prep_square(prep, 3, L, N) + square_at, Ak)
        tl.store(_prep_square(prep, 4, L, N) + square_at, Qb)
        tl.store(_prep_square(prep, 5, L, N) + square_at, Qk)
    slice_at = rows[:, None] * N + kk[None, :]
    for j0 in range(0, N, BK):
        r, k, a, b, dlog, _, ca, ca_lo, cb, _, clast, clast_lo = _columns(
            r_ptr, w_ptr, k_ptr, a_ptr, b_ptr, row0, HN, valid, j0, L, BK, DECAY, LOW_PRECISION)
        W = tl.dot(Tm, a * tl.exp(cb), input_precision="ieee")
        rest = _decay_to_end(ca, ca_lo, clast, clast_lo)
        tl.store(_prep_rows(prep, 0, L, N) + j0 + slice_at, W)
        tl.store(_prep_rows(prep, 1, L, N) + j0 + slice_at, r * tl.exp(ca) + tl.dot(Qb, W, input_precision="ieee"))
        tl.store(_prep_rows(prep, 2, L, N) + j0 + slice_at, b * rest)
        tl.store(_prep_rows(prep, 3, L, N) + j0 + slice_at, k * rest)
        tl.store(_prep_rows(prep, 4, L, N) + j0 + kk, tl.exp(clast))


@triton.jit
def _step_state_block(state, state_at, prep, first, x, second, y, N: tl.constexpr, L: tl.constexpr,
                      BK: tl.constexpr, BF16_DOTS: tl.constexpr, INTERPRET: tl.constexpr, Y_BF16: tl.constexpr):
    """state <- diag(E[L][0]) state + P_first^T x + P_second^T y, for an [N, BV] block of a state (or of its
    cotangent) held at state + state_at (+ j0 per [BK, BV] slice), P_i the prep's [L, N] rows i: the forward's update
    (B^ with U, K^ with V) and the backward's cotangent step (W with Z, R' with dY). Barriers: every thread has read
    a slice (here and in the pass before) before it is written, and the next chunk reads the whole block."""
    slice_at = tl.arange(0, L)[:, None] * N + tl.arange(0, BK)[None, :]
    kk = tl.arange(0, BK)
    for j0 in range(0, N, BK):
        block = tl.load(state + j0 + state_at)
        block = (tl.load(_prep_rows(prep, 4, L, N) + j0 + kk)[:, None] * block
                 + _dot(tl.trans(tl.load(_prep_rows(prep, first, L, N) + j0 + slice_at)), x, BF16_DOTS, INTERPRET)
                 + _dot(tl.trans(tl.load(_prep_rows(prep, second, L, N) + j0 + slice_at)), y, BF16_DOTS, INTERPRET,
                        Y_BF16=Y_BF16))
        tl.debug_barrier()
        tl.store(state + j0 + state_at, block)
    tl.debug_barrier()


@triton.jit
def _state_pass_program(cu_ptr, T, H, N: tl.constexpr, BV: tl.constexpr, VARLEN: tl.constexpr):
    """A state pass's program (grid: (sequence, head, block of BV state columns), the column block fastest):
    _sequence's (n, h, bos, eos) and its first column v0."""
    program = tl.program_id(0).to(tl.int64)
    n, h, bos, eos = _sequence(program // (N // BV), cu_ptr, T, H, VARLEN)
    return n, h, bos, eos, (program % (N // BV)) * BV


@triton.jit
def _chunked_state_kernel(v_ptr, s0_ptr, cu_ptr, prep_ptr, y_ptr, sT_ptr, ckpt_ptr, T, H,
                          N: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREP: tl.constexpr,
                          LOW_PRECISION: tl.constexpr, BF16_DOTS: tl.constexpr, INTERPRET: tl.constexpr,
                          HAS_S0: tl.constexpr, VARLEN: tl.constexpr, SAVE: tl.constexpr):
    """The chunks of one (sequence, head) in order, for BV value columns of the state (a program per (sequence,
    head, value block)): U = W ST + M V, Y = R' ST + Q' V, ST <- diag(E[L][0]) ST + B^^T U + K^^T V, the state's
    [N, BV] block kept in sT (the output) and read and written in [BK, BV] slices: see the module docstring."""
    n, h, bos, eos, v0 = _state_pass_program(cu_ptr, T, H, N, BV, VARLEN)
    rows = tl.arange(0, L)
    kk = tl.arange(0, BK)
    vv = tl.arange(0, BV)
    HN = H * N
    # ST[k][v] = S[v][k] at v * N + k of this program's sT (and s0); k-major in the checkpoints.
    sT = sT_ptr + (n * H + h) * N * N + v0 * N
    state_at = vv[None, :] * N + kk[:, None]     # + j0: slice j0 of the block
    _init_state_block(s0_ptr + (n * H + h) * N * N + v0 * N, sT, state_at, N, BK, BV, HAS_S0)
    ckpt_at = kk[:, None] * N + vv[None, :]      # + j0 * N
    rows_at = rows[:, None] * HN + vv[None, :]   # + v0
    slice_at = rows[:, None] * N + kk[None, :]   # + j0
    square_at = rows[:, None] * L + rows[None, :]
    slot0 = bos // L + n
    for c in range(0, tl.cdiv(eos - bos, L)):
        row0, valid = _chunk_rows(c, bos, eos, h, H, N, L)
        row0 += v0
        prep = prep_ptr + ((slot0 + c) * H + h) * PREP
        v = _load_rows(v_ptr + row0, rows_at, valid, LOW_PRECISION)
        U = _dot(tl.load(_prep_square(prep, 0, L, N) + square_at), v, BF16_DOTS, INTERPRET, Y_BF16=LOW_PRECISION)
        Y = _dot(tl.load(_prep_square(prep, 1, L, N) + square_at), v, BF16_DOTS, INTERPRET, Y_BF16=LOW_PRECISION)
        for j0 in range(0, N, BK):
            ST = tl.load(sT + j0 + state_at)
            if SAVE:
                tl.store(ckpt_ptr + ((slot0 + c) * H + h) * N * N + j0 * N + v0 + ckpt_at, ST)
            U += _dot(tl.load(_prep_rows(prep, 0, L, N) + j0 + slice_at), ST, BF16_DOTS, INTERPRET)
            Y += _dot(tl.load(_prep_rows(prep, 1, L, N) + j0 + slice_at), ST, BF16_DOTS, INTERPRET)
        _store_rows(y_ptr + row0, rows_at, Y, LOW_PRECISION, valid)
        # ST <- diag(E[L][0]) ST + B^^T U + K^^T V.
        _step_state_block(sT, state_at, prep, 2, U, 3, v, N, L, BK, BF16_DOTS, INTERPRET, Y_BF16=LOW_PRECISION)
    if SAVE:
        for j0 in range(0, N, BK):
            _zero_gap_slot(ckpt_ptr, slot0 + tl.cdiv(eos - bos, L), eos // L + n + 1, h, H, N, j0 * N + v0 + ckpt_at)


@triton.jit
def _chunked_state_bwd_kernel(gy_ptr, gsT_ptr, cu_ptr, prep_ptr, gck_ptr, ds0_ptr, T, H,
                              N: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                              PREP: tl.constexpr, LOW_PRECISION: tl.constexpr, BF16_DOTS: tl.constexpr,
                              INTERPRET: tl.constexpr, HAS_GST: tl.constexpr, VARLEN: tl.constexpr):
    """The state cotangent through the chunks in reverse, for BV value columns (a program per (sequence, head,
    value block)): before each chunk's step, G^T (the cotangent of the state after the chunk) is stored to its slot
    of gck; the step is G^T <- diag(E[L][0]) G^T + W^T (B^ G^T) + R'^T dY, the prep's W, B^, R', E[L][0] (the
    forward's U and Y lines in reverse: dX = T^T (B^ G^T + Qb^T dY), and A~^T T^T = W^T). G^T's block lives in ds0
    (the output: the initial state's gradient at the end), read and written in [BK, BV] slices."""
    n, h, bos, eos, v0 = _state_pass_program(cu_ptr, T, H, N, BV, VARLEN)
    rows = tl.arange(0, L)
    kk = tl.arange(0, BK)
    vv = tl.arange(0, BV)
    HN = H * N
    gT = ds0_ptr + (n * H + h) * N * N + v0 * N  # G^T[k][v] = dL/dS[v][k] at v * N + k (so in gsT and gck)
    state_at = vv[None, :] * N + kk[:, None]     # + j0: slice j0 of the block
    _init_state_block(gsT_ptr + (n * H + h) * N * N + v0 * N, gT, state_at, N, BK, BV, HAS_GST)
    rows_at = rows[:, None] * HN + vv[None, :]   # + v0
    slice_at = rows[:, None] * N + kk[None, :]   # + j0
    slot0 = bos // L + n
    n_chunks = tl.cdiv(eos - bos, L)
    for cc in range(0, n_chunks):
        c = n_chunks - 1 - cc
        row0, valid = _chunk_rows(c, bos, eos, h, H, N, L)
        row0 += v0
        prep = prep_ptr + ((slot0 + c) * H + h) * PREP
        gck = gck_ptr + ((slot0 + c) * H + h) * N * N + v0 * N
        dy = _load_rows(gy_ptr + row0, rows_at, valid, LOW_PRECISION)
        Z = tl.zeros((L, BV), dtype=tl.float32)
        for j0 in range(0, N, BK):
            GT = tl.load(gT + j0 + state_at)
            tl.store(gck + j0 + state_at, GT)
            Z += _dot(tl.load(_prep_rows(prep, 2, L, N) + j0 + slice_at), GT, BF16_DOTS, INTERPRET)
        # G^T <- diag(E[L][0]) G^T + W^T Z + R'^T dY.
        _step_state_block(gT, state_at, prep, 0, Z, 1, dy, N, L, BK, BF16_DOTS, INTERPRET, Y_BF16=LOW_PRECISION)


@triton.jit
def _chunked_bwd_kernel(r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, cu_ptr, ckpt_ptr, gy_ptr, gck_ptr, prep_ptr,
                        scratch_ptr, dr_ptr, dw_ptr, dk_ptr, dv_ptr, da_ptr, db_ptr, T, H, n_seqs,
                        N: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, PREP: tl.constexpr, DECAY: tl.constexpr,
                        LOW_PRECISION: tl.constexpr, BF16_DOTS: tl.constexpr, INTERPRET: tl.constexpr,
                        VARLEN: tl.constexpr):
    """The gradients of one chunk's inputs (a program per (slot, head), all chunks at once), from S0^T (its
    checkpoint), G^T (the state cotangent after it, from the backward's state pass) and the prep (with SQUARES):
    k runs in BK-row slices of both, the products over v in BK-column slices of v (U and dX through the scratch):
    see the module docstring."""
    program, n, h, c, bos, eos = _slot_program(cu_ptr, T, H, n_seqs, L, VARLEN)
    offs = tl.arange(0, N)
    kk = tl.arange(0, BK)
    rows = tl.arange(0, L)
    strict = rows[None, :] < rows[:, None]
    incl = rows[None, :] <= rows[:, None]
    HN = H * N
    # G^T[k][v] = dL/dS[v][k] after this chunk, at v * N + k; S0^T k-major.
    grad = gck_ptr + program * N * N
    ckpt = ckpt_ptr + program * N * N
    state_at = offs[None, :] * N + kk[:, None]   # + j0: slice j0 of G^T
    ckpt_at = kk[:, None] * N + offs[None, :]    # + j0 * N: slice j0 of S0^T (k-major)
    # U and dX [L, N] of the chunk, written full width, read back in column slices.
    scratch = scratch_ptr + program * 2 * L * N
    scratch_at = rows[:, None] * N + offs[None, :]
    slice_at = rows[:, None] * N + kk[None, :]   # + i0
    ckpt_at_i = kk[:, None] * N + kk[None, :]     # + j0 * N + i0: block (j0, i0) of S0^T
    state_at_i = kk[None, :] * N + kk[:, None]    # + j0 + i0 * N: block (j0, i0) of G^T
    rows_at = rows[:, None] * HN + offs[None, :]
    rows_at_i = rows[:, None] * HN + kk[None, :]  # + i0 (or + j0)
    # None valid in a gap slot (past its sequence's last chunk): its checkpoint, G^T and prep were never written, and
    # the program reads them (in bounds) but stores nothing.
    row0, valid = _chunk_rows(c, bos, eos, h, H, N, L)
    # The forward's U = W S0^T + M V (as its state pass), and dU, dV from S_L (B^ G^T, K^ G^T).
    prep = prep_ptr + program * PREP
    square_at = rows[:, None] * L + rows[None, :]
    U = _dot(tl.load(_prep_square(prep, 0, L, N) + square_at), _load_rows(v_ptr + row0, rows_at, valid,
                                                                           LOW_PRECISION), BF16_DOTS, INTERPRET,
             Y_BF16=LOW_PRECISION)
    dU = tl.zeros((L, N), dtype=tl.float32)
    dV = tl.zeros((L, N), dtype=tl.float32)
    # The pipelining depths and disable_licm here and below: no spills at N = 64 with Triton 3.6 and 3.7 (the
    # defaults spill 16-56 B of hoisted addresses and invariants).
    for j0 in tl.range(0, N, BK, num_stages=1):
        U += _dot(tl.load(_prep_rows(prep, 0, L, N) + j0 + slice_at), tl.load(ckpt + j0 * N + ckpt_at), BF16_DOTS,
                  INTERPRET)
        GT = tl.load(grad + j0 + state_at)
        dU += _dot(tl.load(_prep_rows(prep, 2, L, N) + j0 + slice_at), GT, BF16_DOTS, INTERPRET)
        dV += _dot(tl.load(_prep_rows(prep, 3, L, N) + j0 + slice_at), GT, BF16_DOTS, INTERPRET)
    # The products over v (dQb, dQk, dAb = dX U^T, dAk = dX V^T; dR~, dA~, dB^, dK^ per k slice below) run in
    # BK-column slices of v, U and dX read back from the scratch. Each [L, N] block is stored as soon as it is
    # complete, so that few are live at once (the peak of the backward's register pressure is here at N = 128).
    Tm = tl.load(_prep_square(prep, 2, L, N) + square_at)
    Ak = tl.load(_prep_square(prep, 3, L, N) + square_at)
    Qb = tl.load(_prep_square(prep, 4, L, N) + square_at)
    Qk = tl.load(_prep_square(prep, 5, L, N) + square_at)
    tl.store(scratch + scratch_at, U)
    # From Y (dQb = dY U^T, dQk = dY V^T below), and from U = T (A~ S0^T + Ak V).
    dy = _load_rows(gy_ptr + row0, rows_at, valid, LOW_PRECISION)
    dU += _dot(tl.trans(Qb), dy, BF16_DOTS, INTERPRET, Y_BF16=LOW_PRECISION)
    dV += _dot(tl.trans(Qk), dy, BF16_DOTS, INTERPRET, Y_BF16=LOW_PRECISION)
    dX = _dot(tl.trans(Tm), dU, BF16_DOTS, INTERPRET)
    tl.store(scratch + L * N + scratch_at, dX)
    dV += _dot(tl.trans(Ak), dX, BF16_DOTS, INTERPRET)
    _store_rows(dv_ptr + row0, rows_at, dV, LOW_PRECISION, valid)
    tl.debug_barrier()
    dQb = tl.zeros((L, L), dtype=tl.float32)
    dQk = tl.zeros((L, L), dtype=tl.float32)
    dAb = tl.zeros((L, L), dtype=tl.float32)
    dAk = tl.zeros((L, L), dtype=tl.float32)
    for i0 in tl.range(0, N, BK, num_stages=1):
        dy_i = _load_rows(gy_ptr + row0 + i0, rows_at_i, valid, LOW_PRECISION)
        v_i = _load_rows(v_ptr + row0 + i0, rows_at_i, valid, LOW_PRECISION)
        U_i = tl.load(scratch + i0 + slice_at)
        dX_i = tl.load(scratch + L * N + i0 + slice_at)
        dQb += _dot(dy_i, tl.trans(U_i), BF16_DOTS, INTERPRET, X_BF16=LOW_PRECISION)
        dQk += _dot(dy_i, tl.trans(v_i), BF16_DOTS, INTERPRET, X_BF16=LOW_PRECISION, Y_BF16=LOW_PRECISION)
        dAb += _dot(dX_i, tl.trans(U_i), BF16_DOTS, INTERPRET)
        dAk += _dot(dX_i, tl.trans(v_i), BF16_DOTS, INTERPRET, Y_BF16=LOW_PRECISION)
    dQb = tl.where(incl, dQb, 0.0)
    dQk = tl.where(incl, dQk, 0.0)
    dAb = tl.where(strict, dAb, 0.0)
    dAk = tl.where(strict, dAk, 0.0)
    # Per k slice: dR~ = dY S0, dA~ = dX S0, dB^ = U G, dK^ = V G, dc[L] = e^{c[L]} sum_v S0 G, and the masked
    # products' cotangents (dx = sum_m dM y E, dy = sum_l dM x E; dc[p(l)] += x dx, dc[m+1] -= y dy).
    for j0 in tl.range(0, N, BK, disable_licm=True):
        r, k, a, b, dlog, _, ca, ca_lo, cb, cb_lo, clast, clast_lo = _columns(
            r_ptr, w_ptr, k_ptr, a_ptr, b_ptr, row0, HN, valid, j0, L, BK, DECAY, LOW_PRECISION)
        Eb, Eq = _masked_decays(ca, cb, L)
        # The masked products' cotangents first and the exps after the products over v: fewer values live across
        # that loop (in the bf16 mode, the split products' operands fill the registers: 48-60 B spilled otherwise).
        # Eb and Eq hold the his' differences; the los are per-row factors, as in _add_masked_products (Eb's rows
        # take c[l]'s, Eq's c[l+1]'s, both columns c[m+1]'s).
        row_factor_b = 1.0 + cb_lo
        row_factor_q = 1.0 + ca_lo
        col_factor = 1.0 - ca_lo
        b_g = b * col_factor
        k_g = k * col_factor
        ax, ab, ak = _masked_cotangents(a * row_factor_b, b_g, k_g, dAb, dAk, Eb)
        ax *= row_factor_b
        rx, rb, rk = _masked_cotangents(r * row_factor_q, b_g, k_g, dQb, dQk, Eq)
        rx *= row_factor_q
        ab *= col_factor
        ak *= col_factor
        rb *= col_factor
        rk *= col_factor
        da = ax
        dcb = a * ax
        dr = rx
        db = ab + rb
        dk = ak + rk
        dca = r * rx - (b * db + k * dk)
        dRt = tl.zeros((L, BK), dtype=tl.float32)
        dAt = tl.zeros((L, BK), dtype=tl.float32)
        dBh = tl.zeros((L, BK), dtype=tl.float32)
        dKh = tl.zeros((L, BK), dtype=tl.float32)
        # Unpipelined, G's slice loaded after S0's products: no spills at N = 32-128 in either mode (Triton 3.7.1;
        # 2 stages with both slices loaded first spilled 16 B in the bf16 mode).
        for i0 in tl.range(0, N, BK, num_stages=1, disable_licm=True):
            dy_i = _load_rows(gy_ptr + row0 + i0, rows_at_i, valid, LOW_PRECISION)
            v_i = _load_rows(v_ptr + row0 + i0, rows_at_i, valid, LOW_PRECISION)
            S0_i = tl.trans(tl.load(ckpt + j0 * N + i0 + ckpt_at_i))
            dRt += _dot(dy_i, S0_i, BF16_DOTS, INTERPRET, X_BF16=LOW_PRECISION)
            dAt += _dot(tl.load(scratch + L * N + i0 + slice_at), S0_i, BF16_DOTS, INTERPRET)
            G_i = tl.trans(tl.load(grad + j0 + i0 * N + state_at_i))
            dBh += _dot(tl.load(scratch + i0 + slice_at), G_i, BF16_DOTS, INTERPRET)
            dKh += _dot(v_i, G_i, BF16_DOTS, INTERPRET, X_BF16=LOW_PRECISION)
        e_before = tl.exp(cb)
        e_after = tl.exp(ca)
        rest = _decay_to_end(ca, ca_lo, clast, clast_lo)
        e_all = tl.exp(clast)
        ST0 = tl.load(ckpt + j0 * N + ckpt_at)
        GT = tl.load(grad + j0 + state_at)
        dclast = e_all * tl.sum(ST0 * GT, axis=1)
        # A~ = a e_before, R~ = r e_after, B^ = b rest, K^ = k rest: e.g. a's share of dc is a (dA~ e_before).
        dAt *= e_before
        dRt *= e_after
        dBh *= rest
        dKh *= rest
        da += dAt
        dcb += a * dAt
        dr += dRt
        db += dBh
        dk += dKh
        to_last = b * dBh + k * dKh
        dca += r * dRt - to_last
        dclast += tl.sum(to_last, axis=0)
        # log d of row l is in c[x] for x >= l + 1: c_after of rows >= l, c_before of rows > l, and c[L].
        dlogd = (tl.cumsum(dca, axis=0, reverse=True) + tl.cumsum(dcb, axis=0, reverse=True) - dcb
                 + dclast[None, :])
        _store_rows(dr_ptr + row0 + j0, rows_at_i, dr, LOW_PRECISION, valid)
        # 0 where dlog < -87 (loglog's log d: d below fp32's smallest normal), whose -e^w (-1e13 at w = 30) would
        # multiply the cumulative sums' rounding up (wkv7::chunked_w_grad).
        _store_rows(dw_ptr + row0 + j0, rows_at_i, tl.where(dlog < -87.0, 0.0, dlogd * dlog), LOW_PRECISION, valid)
        _store_rows(dk_ptr + row0 + j0, rows_at_i, dk, LOW_PRECISION, valid)
        _store_rows(da_ptr + row0 + j0, rows_at_i, da, LOW_PRECISION, valid)
        _store_rows(db_ptr + row0 + j0, rows_at_i, db, LOW_PRECISION, valid)


def _check_row_offsets(heads: int, n: int):
    """The kernels address a chunk's token rows by a 64-bit base and 32-bit offsets up to L rows of H N elements."""
    if heads * n * CHUNK >= 2**31:
        raise ValueError(f"r: heads * head size must be below 2^31 / {CHUNK} = {2**31 // CHUNK} for the chunked "
                         f"Triton kernel, got {heads} * {n} = {heads * n}")


def prep_floats(n: int, backward: bool) -> int:
    """fp32 values per (chunk, head) that the prep kernel passes on (W, R', B^, K^, E[L][0], M, Q', and in the
    backward T, Ak, Qb, Qk): 18.7 / 22.8 KB at N = 64, 34.8 / 38.9 KB at N = 128 (the checkpoint: 16 and 64 KB)."""
    return 4 * CHUNK * n + n + (6 if backward else 2) * CHUNK * CHUNK


def _prep(r, w, k, a, b, cu_seqlens, n_seqs: int, decay: str, low_precision: bool, backward: bool):
    """Every chunk's prep ([slots, H, prep_floats], slot-indexed as the checkpoints), from the first kernel."""
    batch, seqlen, heads, n = r.shape
    slots = checkpoint_slots(batch * seqlen, n_seqs)
    prep = r.new_empty((slots, heads, prep_floats(n, backward)), dtype=torch.float32)
    _chunked_prep_kernel[(slots * heads,)](
        r, w, k, a, b, r if cu_seqlens is None else cu_seqlens, prep, seqlen, heads, n_seqs, N=n, L=CHUNK,
        BK=min(n, 16), PREP=prep.shape[-1], DECAY=DECAY_CODES[decay], LOW_PRECISION=low_precision,
        VARLEN=cu_seqlens is not None, SQUARES=backward, num_warps=PREP_NUM_WARPS[n],
        maxnreg=PREP_MAX_REGISTERS)
    return prep


def wkv7_forward(r, w, k, v, a, b, initial_state, cu_seqlens, y, final_state, checkpoints, decay: str,
                 low_precision: bool, bf16_dots: bool):
    """As recurrent.wkv7_forward (same arguments and checkpoint shape), chunked: two kernels, the state-independent
    part of every chunk at once, then the chunks in order per (sequence, head, value block)."""
    batch, seqlen, heads, n = r.shape
    n_seqs = final_state.shape[0]
    if n_seqs * heads == 0:
        return
    _check_row_offsets(heads, n)
    prep = _prep(r, w, k, a, b, cu_seqlens, n_seqs, decay, low_precision, backward=False)
    _chunked_state_kernel[launch_grid(n_seqs, heads, n // VALUE_BLOCK[n])](
        v, r if initial_state is None else initial_state, r if cu_seqlens is None else cu_seqlens, prep, y,
        final_state, final_state if checkpoints is None else checkpoints, seqlen, heads, N=n, L=CHUNK, BK=min(n, 16),
        BV=VALUE_BLOCK[n], PREP=prep.shape[-1], LOW_PRECISION=low_precision, BF16_DOTS=bf16_dots,
        INTERPRET=INTERPRETING, HAS_S0=initial_state is not None, VARLEN=cu_seqlens is not None,
        SAVE=checkpoints is not None, num_warps=STATE_NUM_WARPS[n])


def wkv7_backward(r, w, k, v, a, b, cu_seqlens, checkpoints, grad_y, grad_final, grads, grad_initial, decay: str,
                  low_precision: bool, bf16_dots: bool):
    """As recurrent.wkv7_backward, chunked: the forward's prep again, the state cotangent through the chunks in
    reverse (stored per chunk), then every chunk's input gradients at once."""
    batch, seqlen, heads, n = r.shape
    n_seqs = grad_initial.shape[0]
    if n_seqs * heads == 0:
        return
    _check_row_offsets(heads, n)
    prep = _prep(r, w, k, a, b, cu_seqlens, n_seqs, decay, low_precision, backward=True)
    state_grads = torch.empty_like(checkpoints)
    scratch = r.new_empty((prep.shape[0] * heads, 2, CHUNK, n), dtype=torch.float32)
    cu = r if cu_seqlens is None else cu_seqlens
    flags = dict(N=n, L=CHUNK, BK=min(n, 16), PREP=prep.shape[-1], VARLEN=cu_seqlens is not None)
    _chunked_state_bwd_kernel[launch_grid(n_seqs, heads, n // VALUE_BLOCK[n])](
        grad_y, grad_initial if grad_final is None else grad_final, cu, prep, state_grads, grad_initial, seqlen, heads,
        BV=VALUE_BLOCK[n], LOW_PRECISION=low_precision, BF16_DOTS=bf16_dots, INTERPRET=INTERPRETING,
        HAS_GST=grad_final is not None, num_warps=STATE_NUM_WARPS[n], **flags)
    _chunked_bwd_kernel[(prep.shape[0] * heads,)](
        r, w, k, v, a, b, cu, checkpoints, grad_y, state_grads, prep, scratch, *grads, seqlen, heads, n_seqs,
        DECAY=DECAY_CODES[decay], LOW_PRECISION=low_precision, BF16_DOTS=bf16_dots, INTERPRET=INTERPRETING,
        num_warps=BWD_NUM_WARPS[n], **flags)
