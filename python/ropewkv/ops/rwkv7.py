"""wkv7 and wkv7_step: the RWKV-7 WKV recurrence (see ropewkv.reference.rwkv7 for the exact spec).

Twins: the C++ ops `ropewkv::wkv7_forward` / `wkv7_backward` / `wkv7_step` (CPU twin in _C, CUDA twin in _C_cuda,
both from csrc/include/ropewkv/wkv7.h), the Triton twin (ropewkv.ops.rwkv7_triton), and the eager reference. The
public functions validate and normalise the arguments identically for every backend, then dispatch.

The C++ ops are opaque custom ops with fake kernels and autograd, so they run under torch.compile(fullgraph=True).
None has an autocast kernel: under autocast the inputs reach the kernel untouched and the decay is computed in fp32
inside it, always.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _backend, _checks
from ..reference import rwkv7 as reference

DECAYS = reference.DECAYS
HEAD_SIZES = (32, 64, 128, 256)
# The CUDA sequential twin stops at 128 (see _check_inputs); 256 runs on the triton and cpu twins.
CUDA_HEAD_SIZES = (32, 64, 128)
# Tokens between the forward's state checkpoints: kCheckpointEvery in csrc/include/ropewkv/wkv7.h.
CHECKPOINT_EVERY = 16
_NAMES = ("r", "w", "k", "v", "a", "b")


# ---- fake kernels and autograd of the C++ ops -------------------------------------------------------------------

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
    grads = tuple(torch.empty_like(r, memory_format=torch.contiguous_format) for _ in range(6))
    return grads + (r.new_empty((n_seqs, heads, n, n), dtype=_backend.compute_dtype(r.dtype)),)


def _fake_step(r, w, k, v, a, b, state, decay, precision):
    return torch.empty_like(r, memory_format=torch.contiguous_format)


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
    torch.library.register_fake("ropewkv::wkv7_step")(_fake_step)
    torch.library.register_autograd("ropewkv::wkv7_forward", _backward, setup_context=_setup_context)


# ---- validation --------------------------------------------------------------------------------------------------

def _check_inputs(tensors, dims: int, layout: str, backend: str) -> str:
    """r..b: tensors of one shape, dtype and device; returns the resolved backend."""
    for name, x in zip(_NAMES, tensors):
        _checks.check_tensor(x, name)
    r = tensors[0]
    resolved = _backend.resolve_backend(backend, r.device)
    if r.dim() != dims:
        raise ValueError(f"r must have shape {layout}, got {tuple(r.shape)}")
    for name, x in zip(_NAMES, tensors):
        _checks.check_float(x, name, resolved)
        if x.shape != r.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)} but r has {tuple(r.shape)} (all of r, w, k, v, a, "
                             f"b are {layout})")
        if x.dtype != r.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but r has {r.dtype}; r, w, k, v, a, b must share a dtype")
    _checks.check_same_device("r", r, **dict(zip(_NAMES[1:], tensors[1:])))
    n = r.shape[-1]
    if n not in HEAD_SIZES:
        raise ValueError(f"head size N = {n} (the last dimension of r) is not supported; supported: {HEAD_SIZES}")
    if resolved == "cuda" and n not in CUDA_HEAD_SIZES:
        if backend == "auto" and _backend.unavailable_reason("triton", r.device) is None:
            return "triton"
        raise ValueError(f"head size N = {n} is not supported by the cuda backend (supported: {CUDA_HEAD_SIZES}; "
                         "its thread-per-state-row kernel would hold 3 x 256 fp32 per thread and spill): use "
                         "backend='triton' (or 'auto', which picks it)")
    return resolved


def _check_decay(decay) -> int:
    if decay not in DECAYS:
        raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
    return DECAYS.index(decay)


def _check_state(state, name: str, shape: tuple, r: torch.Tensor) -> None:
    _checks.check_tensor(state, name)
    if tuple(state.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)} ([n_seqs or B, H, N, N], S[v][k] layout), got "
                         f"{list(state.shape)}")
    expected = _backend.compute_dtype(r.dtype)
    if state.dtype != expected:
        raise TypeError(f"{name} must be {expected} (the state is fp32 whatever the input dtype; fp64 only for fp64 "
                        f"inputs), got {state.dtype}")
    _checks.check_same_device("r", r, **{name: state})


def _check_cu_seqlens(cu_seqlens, r: torch.Tensor) -> int:
    """Returns the number of sequences."""
    if cu_seqlens is None:
        return r.shape[0]
    _checks.check_tensor(cu_seqlens, "cu_seqlens")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D with n_seqs + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if r.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs packed sequences with batch size 1, got r of shape {tuple(r.shape)}")
    _checks.check_same_device("r", r, cu_seqlens=cu_seqlens)
    if not torch.compiler.is_compiling():  # a value check (one host sync); the kernels also clamp offsets
        bounds = cu_seqlens.tolist()
        if bounds[0] != 0 or bounds[-1] != r.shape[1] or any(x > y for x, y in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T = {r.shape[1]}, got {bounds}")
    return cu_seqlens.shape[0] - 1


# ---- public API --------------------------------------------------------------------------------------------------

def wkv7(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
         initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
         cu_seqlens: Optional[torch.Tensor] = None, decay: str = "loglog", precision: Optional[str] = None,
         backend: str = "auto"):
    """The RWKV-7 WKV recurrence: S_t = S_{t-1} (diag(d_t) + a_t b_t^T) + v_t k_t^T, y_t = S_t r_t (scale 1).

    Args:
        r, w, k, v, a, b: [B, T, H, N], one dtype: fp32, fp16 or bf16 (fp64 on the cpu and reference backends, for
            gradcheck). N in HEAD_SIZES. Any T. Non-contiguous inputs are copied to contiguous ones.
        initial_state: None (zeros) or [B, H, N, N] (with cu_seqlens: [n_seqs, H, N, N]) fp32 (fp64 for fp64
            inputs), in the RWKV-LM layout S[v][k] (FLA's [N, H, K, V] is the transpose).
        output_final_state: return the final state (else None).
        cu_seqlens: None, or int32/int64 [n_seqs + 1] offsets of packed sequences (B must be 1), non-decreasing from
            0 to T; each sequence starts from its own initial_state[n].
        decay: the convention of w: "loglog" d = exp(-exp(w)) (RWKV-LM), "raw" d = exp(-e^{-0.5} sigmoid(w)) (the
            LoRA pre-activation, fused; RWKV-LM clampw), "log" d = exp(w) (FLA, HF). Computed in fp32 in the kernel.
        precision: None (the build default), "fp32" (all arithmetic fp32), or "bf16" (RWKV-LM's bf16 mode: I/O
            values pass through bf16 rounding, inputs on load and y and input gradients on store, while the state,
            decay, sa and every sum stay fp32, because d can be within 1e-3 of 1 and S accumulates over thousands of
            steps). Ignored by fp64 inputs and by the reference backend.
        backend: "auto" | "cuda" | "triton" | "cpu" | "reference".
    Returns:
        (y [B, T, H, N] in r's dtype, final_state fp32 [B or n_seqs, H, N, N] S[v][k] or None).
    Differentiable w.r.t. r, w, k, v, a, b and initial_state, with the cotangent of final_state included.
    """
    tensors = (r, w, k, v, a, b)
    resolved = _check_inputs(tensors, 4, "[B, T, H, N]", backend)
    decay_code = _check_decay(decay)
    precision = _backend.resolve_precision(precision)
    n_seqs = _check_cu_seqlens(cu_seqlens, r)
    _, _, heads, n = r.shape
    if initial_state is not None:
        _check_state(initial_state, "initial_state", (n_seqs, heads, n, n), r)
        initial_state = initial_state.contiguous()
    tensors = tuple(x.contiguous() for x in tensors)
    if resolved == "reference":
        y, final_state = reference.wkv7(*tensors, initial_state=initial_state, output_final_state=output_final_state,
                                        cu_seqlens=cu_seqlens, decay=decay, dtype=_backend.compute_dtype(r.dtype))
        return y.to(r.dtype), final_state
    if resolved == "triton":
        from .rwkv7_triton import wkv7_triton

        return wkv7_triton(*tensors, initial_state, bool(output_final_state), cu_seqlens, decay, precision)
    save = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (*tensors, initial_state))
    y, final_state, _ = torch.ops.ropewkv.wkv7_forward(*tensors, initial_state, cu_seqlens, decay_code,
                                                      _backend.precision_code(precision), save)
    return y, (final_state if output_final_state else None)


def wkv7_step(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              state: torch.Tensor, *, decay: str = "loglog", backend: str = "auto") -> torch.Tensor:
    """One decode token of the WKV7 recurrence; equal to wkv7 with T = 1 (at the build-default precision).

    Args:
        r, w, k, v, a, b: [B, H, N], one dtype (as wkv7); copied to contiguous if they are not.
        state: fp32 [B, H, N, N] (fp64 for fp64 inputs), S[v][k], contiguous. Updated IN PLACE to S_1.
        decay, backend: as wkv7.
    Returns:
        y [B, H, N] in r's dtype.
    Inference only: there is no backward (train with wkv7). It is a mutating custom op, so torch.compile keeps it.
    """
    tensors = (r, w, k, v, a, b)
    resolved = _check_inputs(tensors, 3, "[B, H, N]", backend)
    decay_code = _check_decay(decay)
    batch, heads, n = r.shape
    _check_state(state, "state", (batch, heads, n, n), r)
    if not state.is_contiguous():
        raise ValueError("state must be contiguous: wkv7_step updates it in place")
    precision = _backend.resolve_precision(None)
    tensors = tuple(x.contiguous() for x in tensors)
    if resolved in ("cpu", "cuda"):
        return torch.ops.ropewkv.wkv7_step(*tensors, state, decay_code, _backend.precision_code(precision))
    if resolved == "reference":
        y, new_state = reference.wkv7_step(*(x.to(state.dtype) for x in tensors), state, decay)
    else:
        from .rwkv7_triton import wkv7_triton

        y, new_state = wkv7_triton(*(x.unsqueeze(1) for x in tensors), state, True, None, decay, precision)
        y = y.squeeze(1)
    state.copy_(new_state)
    return y.to(r.dtype)
