"""Triton twin of the RWKV-7 WKV recurrence: a sequential kernel, one program per (sequence, head).

Per program the fp32 state S [N_v, N_k] (row i = value index, the RWKV-LM layout) lives in registers as one 2-D
block, and each token is a few broadcasts and row/column reductions on it (no tl.dot, so no tensor-core rounding):
    d = decay(w); sa = S a; S = S * d[None, :] + sa b^T + v k^T; y = S r.
The forward saves an fp32 checkpoint of S before every CHUNK-th token. The backward walks the chunks backwards, and
each chunk's sub-chunks of sub_chunk(N) tokens backwards: it recomputes the chunk from its checkpoint up to the
sub-chunk's end, keeping the sub-chunk's states in a per-program scratch buffer (exactly the forward's arithmetic),
then runs the sub-chunk's adjoint recurrence token by token in reverse. Sub-chunks cost 1.5 recompute steps per token
(2.5 at N >= 128) and keep the scratch of every resident program within an H100's 50 MB L2, as the CUDA twin does
(whole 16-token chunks streamed ~33 GB of scratch through DRAM at B8 T4096 H64 N64). No backstepping (dividing by the
decay), so the backward is as precise as the forward for any decay.

Precision: the state, the decay, sa and every sum are fp32 always (the decay can be within 1e-3 of 1, where bf16
cannot tell d from 1). LOW_PRECISION (the RWKV-LM bf16 mode) rounds the inputs to bf16 on load and y and the input
gradients to bf16 on store, round-to-nearest-even (done with integer ops, so the interpreter rounds like a GPU).

Sequences: without cu_seqlens, sequence n covers tokens [n*T, (n+1)*T) of the flattened [B*T] token axis; with it,
[cu[n], cu[n+1]) (clamped into [0, T], as the CUDA twin does). Checkpoint slot of chunk c of sequence n = cu[n] // CHUNK + n + c: disjoint across sequences for
any lengths, so the buffer needs (B*T) // CHUNK + n_seqs slots and no host sync.
"""
import triton
import triton.language as tl

from ..decay import log_decay_from_raw, log_decay_from_raw_grad

CHUNK = 16
DECAY_CODES = {"loglog": 0, "raw": 1, "log": 2}
HEAD_SIZES = (32, 64, 128, 256)
# Enough threads that the N x N fp32 blocks (three in the backward) mostly fit in registers.
NUM_WARPS = {32: 2, 64: 4, 128: 8, 256: 16}


def sub_chunk(n: int) -> int:
    """The backward's sub-chunk length at head size n (the CUDA twin's wkv7_backward_sub_chunk)."""
    return 4 if n >= 128 else 8


def checkpoint_slots(tokens: int, n_seqs: int) -> int:
    """Rows of the checkpoint buffer for `tokens` flattened tokens split into `n_seqs` sequences (see above)."""
    return tokens // CHUNK + n_seqs


@triton.jit
def _rne_bf16(x):
    """x rounded to the nearest bf16 (ties to even), kept in fp32; NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))


@triton.jit
def _load_in(ptr, offsets, LOW_PRECISION: tl.constexpr):
    x = tl.load(ptr + offsets).to(tl.float32)
    if LOW_PRECISION:
        x = _rne_bf16(x)
    return x


@triton.jit
def _store_out(ptr, offsets, x, LOW_PRECISION: tl.constexpr):
    # The explicit bf16 rounding also makes interpreted bf16 stores round to nearest (the interpreter truncates).
    if LOW_PRECISION or ptr.dtype.element_ty == tl.bfloat16:
        x = _rne_bf16(x)
    tl.store(ptr + offsets, x.to(ptr.dtype.element_ty))


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
def _sequence(cu_ptr, T, H, VARLEN: tl.constexpr):
    """This program's sequence n, head h and token range [bos, eos); the chunked kernel's too.
    (sequence, head) is grid axis 0 (axis 1 holds at most 65,535 programs). cu_seqlens values are clamped as the CUDA
    twin does (into [0, T], eos >= bos): malformed offsets, which Python cannot check under torch.compile without a
    host sync, then give wrong sequences but never an out-of-bounds address."""
    program = tl.program_id(0).to(tl.int64)
    n = program // H
    h = program % H
    if VARLEN:
        bos = tl.minimum(tl.maximum(tl.load(cu_ptr + n).to(tl.int64), 0), T)
        eos = tl.minimum(tl.maximum(tl.load(cu_ptr + n + 1).to(tl.int64), bos), T)
    else:
        bos = n * T
        eos = bos + T
    return n, h, bos, eos


@triton.jit
def _program(cu_ptr, T, H, N: tl.constexpr, VARLEN: tl.constexpr):
    """_sequence's (n, h, bos, eos), the index vector and the N x N block offsets."""
    n, h, bos, eos = _sequence(cu_ptr, T, H, VARLEN)
    offs = tl.arange(0, N).to(tl.int64)
    return n, h, bos, eos, offs, offs[:, None] * N + offs[None, :]


def launch_grid(n_seqs: int, heads: int) -> tuple:
    """One program per (sequence, head), all on grid axis 0 (up to 2^31 - 1 programs)."""
    return (n_seqs * heads,)


@triton.jit
def _load_state(ptr, offsets, GIVEN: tl.constexpr, N: tl.constexpr):
    if GIVEN:
        return tl.load(ptr + offsets)
    return tl.zeros((N, N), dtype=tl.float32)


@triton.jit
def _token(S, vec, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, DECAY: tl.constexpr, LOW_PRECISION: tl.constexpr):
    """One step of the recurrence from S = S_{t-1}: returns S_t and what the adjoint needs (sa, d, dlog, k, v, a, b)."""
    d, dlog = _decay(_load_in(w_ptr, vec, LOW_PRECISION), DECAY)
    k = _load_in(k_ptr, vec, LOW_PRECISION)
    v = _load_in(v_ptr, vec, LOW_PRECISION)
    a = _load_in(a_ptr, vec, LOW_PRECISION)
    b = _load_in(b_ptr, vec, LOW_PRECISION)
    sa = tl.sum(S * a[None, :], axis=1)
    return S * d[None, :] + sa[:, None] * b[None, :] + v[:, None] * k[None, :], sa, d, dlog, k, v, a, b


@triton.jit
def _wkv7_fwd_kernel(r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, s0_ptr, cu_ptr, y_ptr, sT_ptr, ckpt_ptr, T, H,
                     N: tl.constexpr, CHUNK: tl.constexpr, DECAY: tl.constexpr, LOW_PRECISION: tl.constexpr,
                     HAS_S0: tl.constexpr, VARLEN: tl.constexpr, SAVE: tl.constexpr):
    n, h, bos, eos, offs, mat = _program(cu_ptr, T, H, N, VARLEN)
    state_at = (n * H + h) * N * N + mat
    S = _load_state(s0_ptr, state_at, HAS_S0, N)
    slot0 = bos // CHUNK + n
    for c in range(0, tl.cdiv(eos - bos, CHUNK)):
        t0 = bos + c * CHUNK
        if SAVE:
            tl.store(ckpt_ptr + ((slot0 + c) * H + h) * N * N + mat, S)
        for t in range(t0, tl.minimum(t0 + CHUNK, eos)):
            vec = (t * H + h) * N + offs
            S, _, _, _, _, _, _, _ = _token(S, vec, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, DECAY, LOW_PRECISION)
            y = tl.sum(S * _load_in(r_ptr, vec, LOW_PRECISION)[None, :], axis=1)
            _store_out(y_ptr, vec, y, LOW_PRECISION)
    tl.store(sT_ptr + state_at, S)


@triton.jit
def _wkv7_bwd_kernel(r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, cu_ptr, ckpt_ptr, gy_ptr, gsT_ptr, scratch_ptr,
                     dr_ptr, dw_ptr, dk_ptr, dv_ptr, da_ptr, db_ptr, ds0_ptr, T, H,
                     N: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, DECAY: tl.constexpr,
                     LOW_PRECISION: tl.constexpr, HAS_GST: tl.constexpr, VARLEN: tl.constexpr):
    n, h, bos, eos, offs, mat = _program(cu_ptr, T, H, N, VARLEN)
    state_at = (n * H + h) * N * N + mat
    # dS: the adjoint of the state after the current token, starting from the final state's cotangent.
    dS = _load_state(gsT_ptr, state_at, HAS_GST, N)
    scratch = scratch_ptr + (n * H + h) * SUB * N * N + mat
    slot0 = bos // CHUNK + n
    n_subs = tl.cdiv(eos - bos, SUB)
    for jj in range(0, n_subs):
        # Sub-chunk j: tokens [s0, s1), in chunk c (CHUNK is a multiple of SUB), latest first.
        j = n_subs - 1 - jj
        s0 = bos + j * SUB
        s1 = tl.minimum(s0 + SUB, eos)
        c = j // (CHUNK // SUB)
        t0 = bos + c * CHUNK
        # Recompute the chunk up to the sub-chunk's end (same arithmetic as the forward), keeping the states before
        # each of the sub-chunk's tokens.
        S = tl.load(ckpt_ptr + ((slot0 + c) * H + h) * N * N + mat)
        for t in range(t0, s1):
            if t >= s0:
                tl.store(scratch + (t - s0) * N * N, S)
            S, _, _, _, _, _, _, _ = _token(S, (t * H + h) * N + offs, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, DECAY,
                                            LOW_PRECISION)
        tl.debug_barrier()
        for tt in range(0, s1 - s0):
            t = s1 - 1 - tt
            prev = tl.load(scratch + (t - s0) * N * N)
            vec = (t * H + h) * N + offs
            S, sa, d, dlog, k, v, a, b = _token(prev, vec, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, DECAY,
                                                LOW_PRECISION)
            r = _load_in(r_ptr, vec, LOW_PRECISION)
            gy = tl.load(gy_ptr + vec).to(tl.float32)
            dS += gy[:, None] * r[None, :]
            dsa = tl.sum(dS * b[None, :], axis=1)
            _store_out(dr_ptr, vec, tl.sum(S * gy[:, None], axis=0), LOW_PRECISION)
            _store_out(dv_ptr, vec, tl.sum(dS * k[None, :], axis=1), LOW_PRECISION)
            _store_out(dk_ptr, vec, tl.sum(dS * v[:, None], axis=0), LOW_PRECISION)
            _store_out(db_ptr, vec, tl.sum(dS * sa[:, None], axis=0), LOW_PRECISION)
            _store_out(da_ptr, vec, tl.sum(prev * dsa[:, None], axis=0), LOW_PRECISION)
            _store_out(dw_ptr, vec, tl.sum(dS * prev, axis=0) * d * dlog, LOW_PRECISION)
            dS = dS * d[None, :] + dsa[:, None] * a[None, :]
        # The next sub-chunk's recompute overwrites the scratch rows read above.
        tl.debug_barrier()
    tl.store(ds0_ptr + state_at, dS)


def wkv7_forward(r, w, k, v, a, b, initial_state, cu_seqlens, y, final_state, checkpoints, decay: str,
                 low_precision: bool):
    """r..b, y: contiguous [B, T, H, N] (B == 1 with cu_seqlens); initial_state: None or fp32 [n_seqs, H, N, N];
    cu_seqlens: None or int32/int64 [n_seqs + 1]; final_state: fp32 [n_seqs, H, N, N]; checkpoints: None (no
    backward) or fp32 [checkpoint_slots(B*T, n_seqs), H, N, N]."""
    batch, seqlen, heads, n = r.shape
    n_seqs = final_state.shape[0]
    if n_seqs * heads == 0:
        return
    _wkv7_fwd_kernel[launch_grid(n_seqs, heads)](
        r, w, k, v, a, b, r if initial_state is None else initial_state, r if cu_seqlens is None else cu_seqlens,
        y, final_state, final_state if checkpoints is None else checkpoints, seqlen, heads,
        N=n, CHUNK=CHUNK, DECAY=DECAY_CODES[decay], LOW_PRECISION=low_precision, HAS_S0=initial_state is not None,
        VARLEN=cu_seqlens is not None, SAVE=checkpoints is not None, num_warps=NUM_WARPS[n])


def wkv7_backward(r, w, k, v, a, b, cu_seqlens, checkpoints, grad_y, grad_final, grads, grad_initial, decay: str,
                  low_precision: bool):
    """grads: six contiguous [B, T, H, N] outputs (dr, dw, dk, dv, da, db); grad_y: contiguous [B, T, H, N];
    grad_final: None or fp32 [n_seqs, H, N, N]; grad_initial: fp32 [n_seqs, H, N, N] output."""
    batch, seqlen, heads, n = r.shape
    n_seqs = grad_initial.shape[0]
    if n_seqs * heads == 0:
        return
    scratch = r.new_empty((n_seqs, heads, sub_chunk(n), n, n), dtype=checkpoints.dtype)
    _wkv7_bwd_kernel[launch_grid(n_seqs, heads)](
        r, w, k, v, a, b, r if cu_seqlens is None else cu_seqlens, checkpoints, grad_y,
        grad_initial if grad_final is None else grad_final, scratch, *grads, grad_initial, seqlen, heads,
        N=n, CHUNK=CHUNK, SUB=sub_chunk(n), DECAY=DECAY_CODES[decay], LOW_PRECISION=low_precision,
        HAS_GST=grad_final is not None, VARLEN=cu_seqlens is not None, num_warps=NUM_WARPS[n])
