"""Triton twin of the RWKV-7 WKV recurrence: a sequential kernel, one program per (sequence, head, block of state rows).

The fp32 state S [N_v, N_k] (row i = value index, the RWKV-LM layout) lives in registers, each program holding a
block of its rows as one 2-D block, and each token is a few broadcasts and row/column reductions on it (no tl.dot, so
no tensor-core rounding):
    d = decay(w); sa = S a; S = S * d[None, :] + sa b^T + v k^T; y = S r.
Every 2-D block of a kernel must have one layout: a state created by tl.zeros got another than the states loaded
from memory, and the backward then converted its adjoint state through shared memory at every token (_load_state).
Rows evolve independently (sa, the update and y are per row), so the forward splits them freely: at N >= 128 one
warp per program holds a few rows (FWD_ROWS_AND_WARPS), which keeps every reduction inside a warp (shuffles, where a
multi-warp program pays a shared-memory round trip and a barrier per reduction) and lets the benchmark's grid run in
two or three waves of many resident programs. It saves an fp32 checkpoint of S before every CHUNK-th token.

The backward walks the chunks backwards, and each chunk's sub-chunks of sub_chunk(N) tokens backwards: it recomputes
the chunk from its checkpoint up to the sub-chunk's end, keeping the sub-chunk's states in a per-program scratch
buffer (exactly the forward's arithmetic), then runs the sub-chunk's adjoint recurrence token by token in reverse.
The adjoint needs only the state before each token, so the recompute stops before the sub-chunk's last token.
Sub-chunks cost 1.375 recompute steps per token (2.25 at N >= 128) and keep the scratch of every resident program
within an H100's 50 MB L2, as the CUDA twin does (whole 16-token chunks streamed ~33 GB of scratch through DRAM at
B8 T4096 H64 N64). No backstepping (dividing by the decay), so the backward is as precise as the forward for any
decay. The gradients of r, w, k, a and b are sums over all rows, so splitting the rows needs partial sums: only
N = 256, where a whole state per program spills 12 KB, splits (BWD_ROWS_AND_WARPS: 4 blocks of 64 rows), its
programs storing fp32 partial sums that a second kernel adds in a fixed order (deterministic): 80 B of temporary
memory per element of r, about what the forward's checkpoints take at that head size.

Precision: the state, the decay, sa and every sum are fp32 always (the decay can be within 1e-3 of 1, where bf16
cannot tell d from 1). LOW_PRECISION (the RWKV-LM bf16 mode) rounds the inputs to bf16 on load and y and the input
gradients to bf16 on store, round-to-nearest-even (done with integer ops, so the interpreter rounds like a GPU).

Sequences: without cu_seqlens, sequence n covers tokens [n*T, (n+1)*T) of the flattened [B*T] token axis; with it,
[cu[n], cu[n+1]) (clamped into [0, T], as the CUDA twin does). Checkpoint slot of chunk c of sequence n =
cu[n] // CHUNK + n + c: disjoint across sequences for any lengths, so the buffer needs (B*T) // CHUNK + n_seqs slots
and no host sync.
"""
import torch
import triton
import triton.language as tl

from .._common import INTERPRETING_CONSTEXPR as _INTERPRETING, rne_bf16
from ..decay import log_decay_from_raw, log_decay_from_raw_grad

CHUNK = 16
DECAY_CODES = {"loglog": 0, "raw": 1, "log": 2}
HEAD_SIZES = (32, 64, 128, 256)
# Per head size N, (state rows per program, warps per program), chosen from the static report's predictions
# (benchmarks/NOTES.md, "Triton WKV7: one layout per state, rows split over programs"). Backward: the fewest row
# blocks that keep the token loops free of spills (each block adds partial sums to store and add up).
FWD_ROWS_AND_WARPS = {32: (32, 2), 64: (64, 4), 128: (8, 1), 256: (8, 1)}
BWD_ROWS_AND_WARPS = {32: (32, 2), 64: (64, 4), 128: (128, 8), 256: (64, 16)}
COMBINE_BLOCK = 1024  # elements per program of the kernel that adds the backward's partial sums


def sub_chunk(n: int) -> int:
    """The backward's sub-chunk at head size n: its states of every resident program fit the L2 (34 MB at the
    benchmark's shapes; 8 at N = 128 would stream ~70 MB of scratch through DRAM), as the CUDA twin's
    wkv7_backward_sub_chunk."""
    return 4 if n >= 128 else 8


def checkpoint_slots(tokens: int, n_seqs: int) -> int:
    """Rows of the checkpoint buffer for `tokens` flattened tokens split into `n_seqs` sequences (see above)."""
    return tokens // CHUNK + n_seqs


@triton.jit
def _load_in(ptr, offsets, LOW_PRECISION: tl.constexpr, mask=None):
    x = tl.load(ptr + offsets, mask=mask).to(tl.float32)
    if LOW_PRECISION and ptr.dtype.element_ty != tl.bfloat16:  # bf16 inputs are bf16 already
        x = rne_bf16(x)
    return x


@triton.jit
def _store_out(ptr, offsets, x, LOW_PRECISION: tl.constexpr, mask=None):
    # The explicit bf16 rounding also makes interpreted bf16 stores round to nearest (the interpreter truncates).
    if LOW_PRECISION or ptr.dtype.element_ty == tl.bfloat16:
        x = rne_bf16(x)
    tl.store(ptr + offsets, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _log_decay(w, DECAY: tl.constexpr):
    """(log d, d log d / dw) in fp32 for the convention DECAY (0 loglog, 1 raw, 2 log); the chunked kernel's too."""
    if DECAY == 0:
        log_d = -tl.exp(w)
        dlog = log_d
    elif DECAY == 1:
        log_d = log_decay_from_raw(w)
        dlog = log_decay_from_raw_grad(w)
    else:
        log_d = w
        dlog = tl.full(w.shape, 1.0, tl.float32)
    return log_d, dlog


@triton.jit
def _decay(w, DECAY: tl.constexpr):
    """(d, d log d / dw) in fp32 for the convention DECAY."""
    log_d, dlog = _log_decay(w, DECAY)
    return tl.exp(log_d), dlog


@triton.jit
def _sequence(seq_head, cu_ptr, T, H, VARLEN: tl.constexpr):
    """The sequence n, head h and token range [bos, eos) of the (sequence, head) index seq_head = n * H + h (grid
    axis 0: axis 1 holds at most 65,535 programs); the chunked kernel's too. cu_seqlens values are clamped as the
    CUDA twin does (into [0, T], eos >= bos): malformed offsets, which Python cannot check under torch.compile
    without a host sync, then give wrong sequences but never an out-of-bounds address."""
    n = seq_head // H
    h = seq_head % H
    if VARLEN:
        bos = tl.minimum(tl.maximum(tl.load(cu_ptr + n).to(tl.int64), 0), T)
        eos = tl.minimum(tl.maximum(tl.load(cu_ptr + n + 1).to(tl.int64), bos), T)
    else:
        bos = n * T
        eos = bos + T
    return n, h, bos, eos


@triton.jit
def _program(cu_ptr, T, H, N: tl.constexpr, ROWS: tl.constexpr, VARLEN: tl.constexpr):
    """_sequence's (n, h, bos, eos), this program's block of ROWS state rows (row_block, and the value indices
    `rows`), the key indices `cols` and the block's offsets in an N x N state."""
    program = tl.program_id(0).to(tl.int64)
    n, h, bos, eos = _sequence(program // (N // ROWS), cu_ptr, T, H, VARLEN)
    row_block = program % (N // ROWS)
    rows = row_block * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, N).to(tl.int64)
    return n, h, bos, eos, row_block, rows, cols, rows[:, None] * N + cols[None, :]


def launch_grid(n_seqs: int, heads: int, row_blocks: int = 1) -> tuple:
    """One program per (sequence, head, block of state rows), all on grid axis 0 (up to 2^31 - 1 programs)."""
    return (n_seqs * heads * row_blocks,)


@triton.jit
def _load_state(ptr, offsets, GIVEN: tl.constexpr):
    """The state at ptr + offsets, or zeros (nothing read) in the layout that a load of it gets. (With tl.zeros, the
    backward's adjoint state was carried in another layout than the states it meets, and converted through shared
    memory at every token: at N = 64, 2,035 instructions per adjoint step instead of 1,177, and 255 registers.)"""
    if GIVEN:
        return tl.load(ptr + offsets)
    return tl.load(ptr + offsets, mask=offsets < 0, other=0.0).to(tl.float32)


@triton.jit
def _token_inputs(S, at_rows, at_cols, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, DECAY: tl.constexpr,
                  LOW_PRECISION: tl.constexpr):
    """A token's inputs and sa = S a for the row block S of S_{t-1}: (sa, d, dlog, k, v, a, b), what the adjoint
    needs. at_rows / at_cols: the token's [B, T, H, N] offsets of the block's rows / of every key."""
    d, dlog = _decay(_load_in(w_ptr, at_cols, LOW_PRECISION), DECAY)
    k, v, a, b = _token_vectors(at_rows, at_cols, k_ptr, v_ptr, a_ptr, b_ptr, LOW_PRECISION)
    return tl.sum(S * a[None, :], axis=1), d, dlog, k, v, a, b


@triton.jit
def _token_vectors(at_rows, at_cols, k_ptr, v_ptr, a_ptr, b_ptr, LOW_PRECISION: tl.constexpr):
    """A token's k, v (the block's rows), a and b."""
    k = _load_in(k_ptr, at_cols, LOW_PRECISION)
    v = _load_in(v_ptr, at_rows, LOW_PRECISION)
    a = _load_in(a_ptr, at_cols, LOW_PRECISION)
    b = _load_in(b_ptr, at_cols, LOW_PRECISION)
    return k, v, a, b


@triton.jit
def _step(S, d, at_rows, at_cols, k_ptr, v_ptr, a_ptr, b_ptr, LOW_PRECISION: tl.constexpr):
    """One step of the recurrence from the row block S of S_{t-1} with the token's decays d: S_t's rows."""
    k, v, a, b = _token_vectors(at_rows, at_cols, k_ptr, v_ptr, a_ptr, b_ptr, LOW_PRECISION)
    sa = tl.sum(S * a[None, :], axis=1)
    return S * d[None, :] + sa[:, None] * b[None, :] + v[:, None] * k[None, :]


@triton.jit
def _token(S, at_rows, at_cols, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, DECAY: tl.constexpr,
           LOW_PRECISION: tl.constexpr):
    """One step of the recurrence from the row block S of S_{t-1}, its decays from w: S_t's rows."""
    d, _ = _decay(_load_in(w_ptr, at_cols, LOW_PRECISION), DECAY)
    return _step(S, d, at_rows, at_cols, k_ptr, v_ptr, a_ptr, b_ptr, LOW_PRECISION)


@triton.jit
def _zero_gap_slot(ckpt_ptr, slot, next_slot0, h, H, N: tl.constexpr, at):
    """Zeros at `at` (this program's part of a state) in checkpoint `slot`, the one after a sequence's last chunk, if
    it is a gap before the next sequence's first slot `next_slot0` (checkpoint_slots counts one slot per sequence
    more than its chunks may use): no output of the forward then holds uninitialised memory."""
    if slot < next_slot0:
        tl.store(ckpt_ptr + (slot * H + h) * N * N + at, tl.full(at.shape, 0.0, tl.float32))


@triton.jit
def _wkv7_fwd_kernel(r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, s0_ptr, cu_ptr, y_ptr, sT_ptr, ckpt_ptr, decays_ptr,
                     T, H, N: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, DECAY: tl.constexpr,
                     LOW_PRECISION: tl.constexpr, HAS_S0: tl.constexpr, VARLEN: tl.constexpr, SAVE: tl.constexpr,
                     STAGED: tl.constexpr):
    """STAGED: each chunk's decays are computed once, a [CHUNK, N] block in the state's layout (one token's keys per
    row of threads), into the program's decays_ptr [CHUNK, N], and each token reads its row back. In the loop each
    thread computed the decays of all its keys, which every row of threads and every warp repeated (16 times at
    N = 64): 100 of 434 instructions per token."""
    n, h, bos, eos, row_block, rows, cols, mat = _program(cu_ptr, T, H, N, ROWS, VARLEN)
    state_at = (n * H + h) * N * N + mat
    # The state's register layout is the one its loads give it: r's, with or without an initial state. An fp32
    # initial state brought its own (at N = 64 and 16-bit I/O, 4 keys per thread and 16 lanes per row instead of 8
    # and 8: longer row sums), 475 instead of 434 instructions per token (bf16), 789 instead of 729 at N = 256. The
    # select never takes the zeros (a load of nothing from r): it ties the two loads to one layout, bit for bit.
    S = _load_state(r_ptr, mat, False)
    if HAS_S0:
        S = tl.where(mat < 0, S, tl.load(s0_ptr + state_at))
    slot0 = bos // CHUNK + n
    decays = decays_ptr + tl.program_id(0).to(tl.int64) * CHUNK * N  # STAGED: this program's [CHUNK, N]
    chunk_rows = tl.arange(0, CHUNK)[:, None]
    for c in range(0, tl.cdiv(eos - bos, CHUNK)):
        t0 = bos + c * CHUNK
        if SAVE:
            tl.store(ckpt_ptr + ((slot0 + c) * H + h) * N * N + mat, S)
        if STAGED:
            inside = t0 + chunk_rows < eos
            w = _load_in(w_ptr, ((t0 + chunk_rows) * H + h) * N + cols[None, :], LOW_PRECISION, inside)
            tl.store(decays + chunk_rows * N + cols[None, :], _decay(w, DECAY)[0], mask=inside)
            tl.debug_barrier()
        for t in range(t0, tl.minimum(t0 + CHUNK, eos)):
            token = (t * H + h) * N
            if STAGED:
                S = _step(S, tl.load(decays + (t - t0) * N + cols), token + rows, token + cols, k_ptr, v_ptr, a_ptr,
                          b_ptr, LOW_PRECISION)
            else:
                S = _token(S, token + rows, token + cols, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, DECAY, LOW_PRECISION)
            y = tl.sum(S * _load_in(r_ptr, token + cols, LOW_PRECISION)[None, :], axis=1)
            _store_out(y_ptr, token + rows, y, LOW_PRECISION)
        if STAGED:
            tl.debug_barrier()  # the next chunk's decays overwrite these
    tl.store(sT_ptr + state_at, S)
    if SAVE:
        _zero_gap_slot(ckpt_ptr, slot0 + tl.cdiv(eos - bos, CHUNK), eos // CHUNK + n + 1, h, H, N, mat)


@triton.jit
def _stacked(x0, x1, x2, x3, x4, HEIGHT: tl.constexpr):
    """[HEIGHT, N]: row g is x_g (g < 5), the rows after x4 repeat it. Built from column sums held by every warp, it
    takes the state block's layout when HEIGHT is that layout's rows of threads (max(8, warps) at every head size), so
    a store of it moves nothing between threads. Stored one at a time, each vector was first moved through shared
    memory into a layout of one element per thread: a store, a barrier, a load and a barrier per vector."""
    g = tl.arange(0, HEIGHT)[:, None]
    return tl.where(g == 0, x0[None, :], tl.where(g == 1, x1[None, :], tl.where(g == 2, x2[None, :],
                                                                             tl.where(g == 3, x3[None, :],
                                                                                      x4[None, :]))))


@triton.jit
def _store_key_grads(dr_ptr, dk_ptr, db_ptr, da_ptr, dw_ptr, at_cols, dr, dk, db, da, dw,
                     LOW_PRECISION: tl.constexpr, HEIGHT: tl.constexpr):
    """The token's key-indexed gradients in one store (_stacked), dw among them where it has the others' dtype."""
    g = tl.arange(0, HEIGHT)[:, None]
    x = _stacked(dr, dk, db, da, dw, HEIGHT)
    if dw_ptr.dtype == dr_ptr.dtype:
        ptr = tl.where(g == 0, dr_ptr, tl.where(g == 1, dk_ptr, tl.where(g == 2, db_ptr,
                                                                         tl.where(g == 3, da_ptr, dw_ptr))))
        _store_out(ptr, at_cols[None, :], x, LOW_PRECISION, mask=g < 5)
    else:
        ptr = tl.where(g == 0, dr_ptr, tl.where(g == 1, dk_ptr, tl.where(g == 2, db_ptr, da_ptr)))
        _store_out(ptr, at_cols[None, :], x, LOW_PRECISION, mask=g < 4)
        _store_out(dw_ptr, at_cols, dw, LOW_PRECISION)


@triton.jit
def _add5(a0, a1, a2, a3, a4, b0, b1, b2, b3, b4):
    """The combine of five sums reduced together (tl.reduce over a tuple)."""
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4


@triton.jit
def _column_sums(x0, x1, x2, x3, x4):
    """The column sums of five [ROWS, N] blocks. Compiled: one reduction, as the rows are split over warps and each
    separate tl.sum crossed them through shared memory with its own barriers (N = 64: 35 -> 23 barriers per token).
    Interpreted: five tl.sum (numpy's sum), as the interpreter runs a tuple reduction's combine ~40x slower."""
    if _INTERPRETING:
        return tl.sum(x0, axis=0), tl.sum(x1, axis=0), tl.sum(x2, axis=0), tl.sum(x3, axis=0), tl.sum(x4, axis=0)
    return tl.reduce((x0, x1, x2, x3, x4), 0, _add5)


@triton.jit
def _add2(a0, a1, b0, b1):
    """The combine of two sums reduced together."""
    return a0 + b0, a1 + b1


@triton.jit
def _key_sums(x0, x1):
    """The sums of two key-indexed [N] vectors. Each warp holds every key, so these stay inside warps: one reduction
    of the two (compiled) also gives both the layout of the column sums, where x1 alone was loaded in a layout that
    spread it over the warps and crossed them. Interpreted: two tl.sum (see _column_sums)."""
    if _INTERPRETING:
        return tl.sum(x0, axis=0), tl.sum(x1, axis=0)
    return tl.reduce((x0, x1), 0, _add2)


@triton.jit
def _wkv7_bwd_kernel(r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, cu_ptr, ckpt_ptr, gy_ptr, gsT_ptr, scratch_ptr,
                     dr_ptr, dw_ptr, dk_ptr, dv_ptr, da_ptr, db_ptr, partial_ptr, numel, T, H,
                     N: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
                     DECAY: tl.constexpr, LOW_PRECISION: tl.constexpr, HAS_GST: tl.constexpr, VARLEN: tl.constexpr,
                     STACK: tl.constexpr):
    """With ROWS < N the gradients of r, w, k, a and b are sums over every row of the state: each program stores its
    rows' fp32 sums in partial_ptr [N // ROWS, 5, B*T*H*N] (dw's without its d * dlog factor) for
    _combine_key_grads_kernel, in a fixed order. dv and the state gradient are the program's own rows; the state
    gradient goes to the scratch's first state, whose addresses the token loops hold anyway (holding its own 64-bit
    addresses across the loops spilled them at N = 128), and the launcher copies it out. The scratch's addresses are
    formed at each use from its scalar base and the block's offsets: a tensor of pointers made once before the loops
    kept one of its 64-bit bases in local memory at N = 128 (8-40 B of spills, where now none)."""
    n, h, bos, eos, row_block, rows, cols, mat = _program(cu_ptr, T, H, N, ROWS, VARLEN)
    # dS: the adjoint of the state after the current token, starting from the final state's cotangent.
    dS = _load_state(gsT_ptr, (n * H + h) * N * N + mat, HAS_GST)
    scratch = scratch_ptr + (n * H + h) * SUB * N * N
    numel = numel.to(tl.int64)  # 5 * numel can pass 2^31
    partial = partial_ptr + row_block * 5 * numel
    slot0 = bos // CHUNK + n
    n_subs = tl.cdiv(eos - bos, SUB)
    for jj in range(0, n_subs):
        # Sub-chunk j: tokens [s0, s1), in chunk c (CHUNK is a multiple of SUB), latest first.
        j = n_subs - 1 - jj
        s0 = bos + j * SUB
        s1 = tl.minimum(s0 + SUB, eos)
        c = j // (CHUNK // SUB)
        t0 = bos + c * CHUNK
        # Recompute the chunk up to the sub-chunk's last token (same arithmetic as the forward), keeping the states
        # before each of the sub-chunk's tokens. The adjoint needs no state after the last one (it works from S_{t-1}
        # alone), so the last token is not stepped: 1 step per sub-chunk fewer.
        S = tl.load(ckpt_ptr + ((slot0 + c) * H + h) * N * N + mat)
        for t in range(t0, s1 - 1):
            if t >= s0:
                tl.store(scratch + (t - s0) * N * N + mat, S)
            token = (t * H + h) * N
            S = _token(S, token + rows, token + cols, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, DECAY, LOW_PRECISION)
        tl.store(scratch + (s1 - 1 - s0) * N * N + mat, S)
        tl.debug_barrier()
        for tt in range(0, s1 - s0):
            t = s1 - 1 - tt
            prev = tl.load(scratch + (t - s0) * N * N + mat)
            token = (t * H + h) * N
            at_rows = token + rows
            at_cols = token + cols
            sa, d, dlog, k, v, a, b = _token_inputs(prev, at_rows, at_cols, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, DECAY,
                                                    LOW_PRECISION)
            r = _load_in(r_ptr, at_cols, LOW_PRECISION)
            gy = _load_in(gy_ptr, at_rows, LOW_PRECISION)
            # v_i gy_i over the block's rows i, loaded again at the key indices (v and gy have N elements too): their
            # sum then stays inside warps, where over the rows it crossed them (two barriers and a shared round trip).
            if ROWS == N:
                v_gy = _load_in(v_ptr, at_cols, LOW_PRECISION) * _load_in(gy_ptr, at_cols, LOW_PRECISION)
            else:
                in_block = (cols >= row_block * ROWS) & (cols < (row_block + 1) * ROWS)
                v_gy = (_load_in(v_ptr, at_cols, LOW_PRECISION, in_block)
                        * _load_in(gy_ptr, at_cols, LOW_PRECISION, in_block))
            dS += gy[:, None] * r[None, :]
            dsa = tl.sum(dS * b[None, :], axis=1)
            _store_out(dv_ptr, at_rows, tl.sum(dS * k[None, :], axis=1), LOW_PRECISION)
            # S_t^T gy from S_{t-1} (S_t = S_{t-1} diag(d) + sa b^T + v k^T): S_t is never formed, so two N x N
            # blocks are live instead of three (N = 128 held three at 255 registers and spilled).
            prev_gy, dk, db, da, dw = _column_sums(prev * gy[:, None], dS * v[:, None], dS * sa[:, None],
                                                   prev * dsa[:, None], dS * prev)
            # dr = S_t^T gy = d * S_{t-1}^T gy + b (sa . gy) + k (v . gy), with sa . gy = a . (S_{t-1}^T gy).
            a_prev_gy, v_dot_gy = _key_sums(a * prev_gy, v_gy)
            dr = d * prev_gy + b * a_prev_gy + k * v_dot_gy
            if ROWS == N:
                _store_key_grads(dr_ptr, dk_ptr, db_ptr, da_ptr, dw_ptr, at_cols, dr, dk, db, da, dw * d * dlog,
                                 LOW_PRECISION, STACK)
            else:
                g = tl.arange(0, STACK)[:, None]
                tl.store(partial + g * numel + at_cols[None, :], _stacked(dr, dw, dk, da, db, STACK), mask=g < 5)
            dS = dS * d[None, :] + dsa[:, None] * a[None, :]
        # The next sub-chunk's recompute overwrites the scratch rows read above.
        tl.debug_barrier()
    tl.store(scratch + mat, dS)


@triton.jit
def _summed(partial_ptr, grad: tl.constexpr, at, inside, numel, ROW_BLOCKS: tl.constexpr):
    """Gradient `grad`'s partial sums (_wkv7_bwd_kernel's order) added in row-block order."""
    total = tl.load(partial_ptr + grad * numel + at, mask=inside)
    for block in tl.static_range(1, ROW_BLOCKS):
        total += tl.load(partial_ptr + (block * 5 + grad) * numel + at, mask=inside)
    return total


@triton.jit
def _combine_key_grads_kernel(partial_ptr, w_ptr, dr_ptr, dw_ptr, dk_ptr, da_ptr, db_ptr, numel,
                              ROW_BLOCKS: tl.constexpr, DECAY: tl.constexpr, LOW_PRECISION: tl.constexpr,
                              BLOCK: tl.constexpr):
    """The gradients of r, w, k, a, b from the backward's per-row-block partial sums; dw times d * dlog."""
    numel = numel.to(tl.int64)
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = at < numel
    d, dlog = _decay(_load_in(w_ptr, at, LOW_PRECISION, inside), DECAY)
    _store_out(dr_ptr, at, _summed(partial_ptr, 0, at, inside, numel, ROW_BLOCKS), LOW_PRECISION, inside)
    _store_out(dw_ptr, at, _summed(partial_ptr, 1, at, inside, numel, ROW_BLOCKS) * d * dlog, LOW_PRECISION, inside)
    _store_out(dk_ptr, at, _summed(partial_ptr, 2, at, inside, numel, ROW_BLOCKS), LOW_PRECISION, inside)
    _store_out(da_ptr, at, _summed(partial_ptr, 3, at, inside, numel, ROW_BLOCKS), LOW_PRECISION, inside)
    _store_out(db_ptr, at, _summed(partial_ptr, 4, at, inside, numel, ROW_BLOCKS), LOW_PRECISION, inside)


def wkv7_forward(r, w, k, v, a, b, initial_state, cu_seqlens, y, final_state, checkpoints, decay: str,
                 low_precision: bool):
    """r..b, y: contiguous [B, T, H, N] (B == 1 with cu_seqlens); initial_state: None or fp32 [n_seqs, H, N, N];
    cu_seqlens: None or int32/int64 [n_seqs + 1]; final_state: fp32 [n_seqs, H, N, N]; checkpoints: None (no
    backward) or fp32 [checkpoint_slots(B*T, n_seqs), H, N, N]."""
    batch, seqlen, heads, n = r.shape
    n_seqs = final_state.shape[0]
    if n_seqs * heads == 0:
        return
    rows, warps = FWD_ROWS_AND_WARPS[n]
    # The decays staged per chunk where a program holds whole states on several warps (every one of them computed
    # them all), and the sequences average a chunk or more: decode (one token) would write 16 rows to read one.
    staged = rows == n and warps > 1 and batch * seqlen >= CHUNK * n_seqs
    decays = r.new_empty((n_seqs * heads, CHUNK, n), dtype=torch.float32) if staged else final_state
    _wkv7_fwd_kernel[launch_grid(n_seqs, heads, n // rows)](
        r, w, k, v, a, b, r if initial_state is None else initial_state, r if cu_seqlens is None else cu_seqlens,
        y, final_state, final_state if checkpoints is None else checkpoints, decays, seqlen, heads,
        N=n, ROWS=rows, CHUNK=CHUNK, DECAY=DECAY_CODES[decay], LOW_PRECISION=low_precision,
        HAS_S0=initial_state is not None, VARLEN=cu_seqlens is not None, SAVE=checkpoints is not None,
        STAGED=staged, num_warps=warps)


def wkv7_backward(r, w, k, v, a, b, cu_seqlens, checkpoints, grad_y, grad_final, grads, grad_initial, decay: str,
                  low_precision: bool):
    """grads: six contiguous [B, T, H, N] outputs (dr, dw, dk, dv, da, db); grad_y: contiguous [B, T, H, N];
    grad_final: None or fp32 [n_seqs, H, N, N]; grad_initial: fp32 [n_seqs, H, N, N] output."""
    batch, seqlen, heads, n = r.shape
    n_seqs = grad_initial.shape[0]
    if n_seqs * heads == 0:
        return
    rows, warps = BWD_ROWS_AND_WARPS[n]
    row_blocks = n // rows
    numel = r.numel()
    scratch = r.new_empty((n_seqs, heads, sub_chunk(n), n, n), dtype=checkpoints.dtype)
    # fp32 partial sums of the key-indexed gradients, one set per row block (unused when one block has every row).
    partial = r.new_empty((row_blocks, 5, numel), dtype=torch.float32) if row_blocks > 1 else grad_initial
    _wkv7_bwd_kernel[launch_grid(n_seqs, heads, row_blocks)](
        r, w, k, v, a, b, r if cu_seqlens is None else cu_seqlens, checkpoints, grad_y,
        grad_initial if grad_final is None else grad_final, scratch, *grads, partial, numel, seqlen,
        heads, N=n, ROWS=rows, CHUNK=CHUNK, SUB=sub_chunk(n), DECAY=DECAY_CODES[decay], LOW_PRECISION=low_precision,
        HAS_GST=grad_final is not None, VARLEN=cu_seqlens is not None, STACK=max(8, warps), num_warps=warps)
    grad_initial.copy_(scratch[:, :, 0])
    if row_blocks > 1 and numel > 0:
        dr, dw, dk, _, da, db = grads
        _combine_key_grads_kernel[(triton.cdiv(numel, COMBINE_BLOCK),)](
            partial, w, dr, dw, dk, da, db, numel, ROW_BLOCKS=row_blocks, DECAY=DECAY_CODES[decay],
            LOW_PRECISION=low_precision, BLOCK=COMBINE_BLOCK, num_warps=4)
