"""The recurrent (sequential over T) WKV7 algorithm: the autograd and fake kernels of the C++ ops
`ropewkv::wkv7_forward` / `wkv7_backward` (CPU twin in _C, CUDA twin in _C_cuda, both from
csrc/include/ropewkv/wkv7.h), and the Triton twin (triton_kernels/rwkv7/recurrent.py) as opaque custom ops.

Every op here is an opaque custom op with a fake kernel and autograd, so it runs under torch.compile(fullgraph). The
forward ops also return the fp32 state checkpoints (every CHECKPOINT_EVERY tokens) that the backward recomputes
from; they are only written when a gradient will be needed.
"""
from __future__ import annotations

from typing import Optional

import torch

from ... import _backend, _checks

# Tokens between the forward's state checkpoints: kCheckpointEvery in csrc/include/ropewkv/wkv7.h.
CHECKPOINT_EVERY = 16


# ---- the C++ ops (cpu and cuda twins): fake kernels and autograd -------------------------------------------------------------------

def _fake_forward(r, w, k, v, a, b, initial_state, cu_seqlens, decay, precision, save_checkpoints):
    batch, seqlen, heads, n = r.shape
    n_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dtype = _backend.compute_dtype(r.dtype)
    chunks = (seqlen + CHECKPOINT_EVERY - 1) // CHECKPOINT_EVERY
    ckpt_shape = (batch, chunks, heads, n, n) if save_checkpoints else (0,)
    return (torch.empty_like(r, memory_format=torch.contiguous_format), r.new_empty((n_seqs, heads, n, n), dtype=dtype),
            r.new_empty(ckpt_shape, dtype=dtype))


def _fake_backward(grad_y, grad_final_state, r, w, k, v, a, b, initial_state, cu_seqlens, checkpoints, decay,
                   precision):
    batch, _, heads, n = r.shape
    n_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    grads = tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (r, w, k, v, a, b))
    return grads + (r.new_empty((n_seqs, heads, n, n), dtype=_backend.compute_dtype(r.dtype)),)


def _setup_context(ctx, inputs, output):
    r, w, k, v, a, b, initial_state, cu_seqlens, decay, precision, _ = inputs
    ctx.save_for_backward(r, w, k, v, a, b, initial_state, cu_seqlens, output[2])
    ctx.decay, ctx.precision = decay, precision
    ctx.has_initial_state = initial_state is not None


def _backward(ctx, grad_y, grad_final_state, _grad_checkpoints):
    r, w, k, v, a, b, initial_state, cu_seqlens, checkpoints = ctx.saved_tensors
    if grad_y is None:
        grad_y = torch.zeros_like(r)
    grads = torch.ops.ropewkv.wkv7_backward(grad_y, grad_final_state, r, w, k, v, a, b, initial_state, cu_seqlens,
                                            checkpoints, ctx.decay, ctx.precision)
    grad_s0 = grads[6] if ctx.has_initial_state else None
    return (*grads[:6], grad_s0, None, None, None, None)


if _backend._C is not None:
    torch.library.register_fake("ropewkv::wkv7_forward")(_fake_forward)
    torch.library.register_fake("ropewkv::wkv7_backward")(_fake_backward)
    torch.library.register_autograd("ropewkv::wkv7_forward", _backward, setup_context=_setup_context)
    _backend.refuse_double_backward("ropewkv::wkv7_backward", "wkv7")



# ---- the Triton twin ---------------------------------------------------------------------------------------------

def _kernels():
    # Imported lazily: Triton reads TRITON_INTERPRET when the kernels are decorated.
    from ...triton_kernels.rwkv7 import recurrent

    return recurrent


def _n_seqs(r: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> int:
    return r.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _state_shape(r, cu_seqlens):
    return (_n_seqs(r, cu_seqlens), r.shape[2], r.shape[3], r.shape[3])


def _checkpoint_shape(r, cu_seqlens, save: bool):
    if not save:
        return (0,)
    slots = _kernels().checkpoint_slots(r.shape[0] * r.shape[1], _n_seqs(r, cu_seqlens))
    return (slots, r.shape[2], r.shape[3], r.shape[3])


@torch.library.custom_op("ropewkv::wkv7_triton_fwd", mutates_args=())
def _wkv7_fwd(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], decay: str, precision: str,
              save: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r, w, k, v, a, b = (x.contiguous() for x in (r, w, k, v, a, b))
    y = _backend.new_output(r.shape, r.dtype, r.device)
    final_state = _backend.new_output(_state_shape(r, cu_seqlens), torch.float32, r.device)
    checkpoints = _backend.new_output(_checkpoint_shape(r, cu_seqlens, save), torch.float32, r.device)
    _kernels().wkv7_forward(r, w, k, v, a, b, None if initial_state is None else initial_state.contiguous(),
                            cu_seqlens, y, final_state, checkpoints if save else None, decay, precision == "bf16")
    return y, final_state, checkpoints


@torch.library.register_fake("ropewkv::wkv7_triton_fwd")
def _wkv7_fwd_fake(r, w, k, v, a, b, initial_state, cu_seqlens, decay, precision, save):
    return (torch.empty_like(r), r.new_empty(_state_shape(r, cu_seqlens), dtype=torch.float32),
            r.new_empty(_checkpoint_shape(r, cu_seqlens, save), dtype=torch.float32))


@torch.library.custom_op("ropewkv::wkv7_triton_bwd", mutates_args=())
def _wkv7_bwd(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              cu_seqlens: Optional[torch.Tensor], checkpoints: torch.Tensor, grad_y: torch.Tensor,
              grad_final: Optional[torch.Tensor], decay: str, precision: str) -> list[torch.Tensor]:
    r, w, k, v, a, b, grad_y = (x.contiguous() for x in (r, w, k, v, a, b, grad_y))
    grads = [_backend.new_output(x.shape, x.dtype, x.device) for x in (r, w, k, v, a, b)]
    grad_initial = _backend.new_output(_state_shape(r, cu_seqlens), torch.float32, r.device)
    if grad_final is not None:
        grad_final = grad_final.to(torch.float32).contiguous()
    _kernels().wkv7_backward(r, w, k, v, a, b, cu_seqlens, checkpoints, grad_y, grad_final, grads, grad_initial,
                             decay, precision == "bf16")
    return grads + [grad_initial]


@torch.library.register_fake("ropewkv::wkv7_triton_bwd")
def _wkv7_bwd_fake(r, w, k, v, a, b, cu_seqlens, checkpoints, grad_y, grad_final, decay, precision):
    grads = [torch.empty_like(x) for x in (r, w, k, v, a, b)]
    return grads + [r.new_empty(_state_shape(r, cu_seqlens), dtype=torch.float32)]


def _triton_setup_context(ctx, inputs, output):
    r, w, k, v, a, b, initial_state, cu_seqlens, decay, precision, save = inputs
    ctx.save_for_backward(r, w, k, v, a, b, cu_seqlens, output[2])
    ctx.decay, ctx.precision, ctx.save = decay, precision, save
    ctx.has_initial_state = initial_state is not None


def _triton_backward_of(bwd_op, op_name: str):
    """The autograd backward of a Triton forward op set up by _triton_setup_context, computed by bwd_op (shared with
    the chunked twin)."""
    def backward(ctx, grad_y, grad_final, _grad_checkpoints):
        r, w, k, v, a, b, cu_seqlens, checkpoints = ctx.saved_tensors
        if not ctx.save:
            raise RuntimeError(f"{op_name}: backward through a forward that saved no checkpoints (it ran with no input "
                               "requiring grad, or with grad mode off)")
        if grad_y is None:
            grad_y = torch.zeros_like(r)
        *grads, grad_initial = bwd_op(r, w, k, v, a, b, cu_seqlens, checkpoints, grad_y, grad_final, ctx.decay,
                                      ctx.precision)
        return (*grads, grad_initial if ctx.has_initial_state else None, None, None, None, None)

    return backward


torch.library.register_autograd("ropewkv::wkv7_triton_fwd", _triton_backward_of(_wkv7_bwd, "wkv7_triton"),
                                setup_context=_triton_setup_context)
_backend.refuse_double_backward("ropewkv::wkv7_triton_bwd", "wkv7")


def _check(r, w, k, v, a, b, initial_state, cu_seqlens, decay, precision) -> None:
    kernels = _kernels()
    named = {"r": r, "w": w, "k": k, "v": v, "a": a, "b": b}
    for name, x in named.items():
        _checks.check_float(x, name, "triton")
        _checks.check_same_device("r", r, **{name: x})
        if x.dim() != 4:
            raise ValueError(f"{name} must be [B, T, H, N], got shape {tuple(x.shape)}")
        if x.shape != r.shape or (x.dtype != r.dtype and name != "w"):  # w may have its own dtype
            raise ValueError(f"{name} must match r's shape {tuple(r.shape)} and dtype {r.dtype}, "
                             f"got {tuple(x.shape)} {x.dtype}")
    if r.shape[3] not in kernels.HEAD_SIZES:
        raise ValueError(f"head size N = r.shape[3] must be one of {kernels.HEAD_SIZES}, got {r.shape[3]}")
    if decay not in kernels.DECAY_CODES:
        raise ValueError(f"decay must be one of {tuple(kernels.DECAY_CODES)}, got {decay!r}")
    if precision not in _backend.PRECISIONS:
        raise ValueError(f"precision must be one of {_backend.PRECISIONS}, got {precision!r}")
    if cu_seqlens is not None:
        _checks.check_tensor(cu_seqlens, "cu_seqlens")
        _checks.check_same_device("r", r, cu_seqlens=cu_seqlens)
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor [n_seqs + 1], got {cu_seqlens.dtype} "
                             f"shape {tuple(cu_seqlens.shape)}")
        if r.shape[0] != 1:
            raise ValueError(f"with cu_seqlens the sequences are packed, so B must be 1, got B = {r.shape[0]}")
    if initial_state is not None:
        _checks.check_tensor(initial_state, "initial_state")
        _checks.check_same_device("r", r, initial_state=initial_state)
        expected = _state_shape(r, cu_seqlens)
        if initial_state.dtype != torch.float32 or tuple(initial_state.shape) != expected:
            raise ValueError(f"initial_state must be fp32 of shape {expected}, got {initial_state.dtype} "
                             f"{tuple(initial_state.shape)}")


def wkv7_triton(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, initial_state: Optional[torch.Tensor], output_final_state: bool,
                cu_seqlens: Optional[torch.Tensor], decay: str, precision: str):
    """The WKV7 recurrence on the Triton twin (sequential kernel; fp32 state, decay and sums in every precision).

    Args:
        r, w, k, v, a, b: [B, T, H, N], one dtype (fp32/fp16/bf16; w may have its own, read at its precision),
            CUDA tensors (or CPU under TRITON_INTERPRET=1).
            N in (32, 64, 128, 256). Non-contiguous inputs are copied.
        initial_state: None (zeros) or fp32 [B (n_seqs with cu_seqlens), H, N, N], S[v][k] (RWKV-LM layout).
        output_final_state: return the final state too.
        cu_seqlens: None, or int32/int64 [n_seqs + 1] on r's device, with B == 1: packed sequences
            [cu[n], cu[n+1]), each from its own initial_state[n]. Must start at 0, end at T and not decrease
            (not checked here: that needs a host sync); empty sequences are fine.
        decay: "loglog" (d = exp(-exp(w))), "raw" (d = exp(-e^{-0.5} sigmoid(w))) or "log" (d = exp(w)).
        precision: "fp32" (all arithmetic fp32) or "bf16" (RWKV-LM bf16 mode: inputs rounded to bf16 on load, y
            and input gradients rounded to bf16 on store; state, decay and sums fp32).
    Returns:
        (y [B, T, H, N] in r's dtype, final_state fp32 [B or n_seqs, H, N, N] or None). Differentiable wrt r..b
        and initial_state, including through final_state.
    Memory: training saves one fp32 state per 16 tokens (T / 16 x N^2 x 4 bytes per sequence and head); at N = 256
    the backward also takes fp32 partial sums, 80 bytes per element of r, freed when it returns.
    """
    _check(r, w, k, v, a, b, initial_state, cu_seqlens, decay, precision)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()  # the kernels read it through its data pointer as dense
    tensors = (r, w, k, v, a, b, initial_state)
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    y, final_state, _ = _wkv7_fwd(r, w, k, v, a, b, initial_state, cu_seqlens, decay, precision, save)
    return y, (final_state if output_final_state else None)
