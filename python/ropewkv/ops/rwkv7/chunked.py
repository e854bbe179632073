"""The chunked WKV7 algorithm (derivation and where each quantity lives: chunked.md beside this file): the autograd
of the C++ ops `ropewkv::wkv7_chunked_forward` / `wkv7_chunked_backward` (CPU twin in _C, from
csrc/include/ropewkv/wkv7_chunked.h), and the Triton twin (triton_kernels/rwkv7/chunked.py) as opaque custom ops.

Chunks are CHUNK = 16 tokens: in the CPU and Triton twins aligned to each sequence's end (its first chunk short, run
as 16 rows after absent ones, so that left padding and packing change nothing bit for bit; the Triton twin's
checkpoints in the recurrent kernel's slots), in the CUDA chunked kernels to multiples of 16 in the (packed) time
axis (the grid of the sequential ops' checkpoints); the checkpoint
tensors have the sequential ops' shapes, so their fake kernels serve. The forward
saves the fp32 state before each chunk, the backward recomputes one chunk at a time from it (chunked.md, "Chunks,
sequences, checkpoints").
"""
from __future__ import annotations

from typing import Optional

import torch

from ... import _backend
from . import recurrent

CHUNK = 16  # kChunk in csrc/include/ropewkv/wkv7_chunked.h (= the checkpoint interval, recurrent.CHECKPOINT_EVERY)


# ---- the C++ ops (cpu twin): fake kernels and autograd ------------------------------------------------------------

def _backward(ctx, grad_y, grad_final_state, _grad_checkpoints):
    r, w, k, v, a, b, initial_state, cu_seqlens, checkpoints = ctx.saved_tensors
    if checkpoints.dim() != 5:
        raise RuntimeError("wkv7 chunked: backward through a forward that saved no checkpoints (it ran with no "
                           "input requiring grad, or with grad mode off)")
    if grad_y is None:
        grad_y = torch.zeros_like(r)
    grads = torch.ops.ropewkv.wkv7_chunked_backward(grad_y, grad_final_state, r, w, k, v, a, b, initial_state,
                                                    cu_seqlens, checkpoints, ctx.decay, ctx.precision)
    grad_s0 = grads[6] if ctx.has_initial_state else None
    return (*grads[:6], grad_s0, None, None, None, None)


if _backend._C is not None and hasattr(torch.ops.ropewkv, "wkv7_chunked_forward"):
    # Same outputs and shapes as the sequential ops (the chunk is the checkpoint interval).
    torch.library.register_fake("ropewkv::wkv7_chunked_forward")(recurrent._fake_forward)
    torch.library.register_fake("ropewkv::wkv7_chunked_backward")(recurrent._fake_backward)
    torch.library.register_autograd("ropewkv::wkv7_chunked_forward", _backward,
                                    setup_context=recurrent._setup_context)
    _backend.refuse_double_backward("ropewkv::wkv7_chunked_backward", "wkv7 (chunked)")


def wkv7_chunked_cpp(r, w, k, v, a, b, initial_state, output_final_state: bool, cu_seqlens, decay_code: int,
                     precision: str):
    """The chunked C++ op on validated, contiguous inputs (api.wkv7 checks them)."""
    save = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (r, w, k, v, a, b,
                                                                                       initial_state))
    y, final_state, _ = torch.ops.ropewkv.wkv7_chunked_forward(r, w, k, v, a, b, initial_state, cu_seqlens,
                                                               decay_code, _backend.precision_code(precision), save)
    return y, (final_state if output_final_state else None)


# ---- the Triton twin ---------------------------------------------------------------------------------------------

def _kernels():
    # Imported lazily: Triton reads TRITON_INTERPRET when the kernels are decorated.
    from ...triton_kernels.rwkv7 import chunked

    return chunked


@torch.library.custom_op("ropewkv::wkv7_chunked_triton_fwd", mutates_args=())
def _triton_fwd(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], decay: str,
                precision: str, save: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r, w, k, v, a, b = (x.contiguous() for x in (r, w, k, v, a, b))
    y = _backend.new_output(r.shape, r.dtype, r.device)
    final_state = _backend.new_output(recurrent._state_shape(r, cu_seqlens), torch.float32, r.device)
    checkpoints = _backend.new_output(recurrent._checkpoint_shape(r, cu_seqlens, save), torch.float32, r.device)
    low = precision == "bf16"
    _kernels().wkv7_forward(r, w, k, v, a, b, None if initial_state is None else initial_state.contiguous(),
                            cu_seqlens, y, final_state, checkpoints if save else None, decay, low, low)
    return y, final_state, checkpoints


# The recurrent twin's checkpoint slots, so its fake kernels and autograd serve here too.
torch.library.register_fake("ropewkv::wkv7_chunked_triton_fwd")(recurrent._wkv7_fwd_fake)


@torch.library.custom_op("ropewkv::wkv7_chunked_triton_bwd", mutates_args=())
def _triton_bwd(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, cu_seqlens: Optional[torch.Tensor], checkpoints: torch.Tensor, grad_y: torch.Tensor,
                grad_final: Optional[torch.Tensor], decay: str, precision: str) -> list[torch.Tensor]:
    r, w, k, v, a, b, grad_y = (x.contiguous() for x in (r, w, k, v, a, b, grad_y))
    grads = [_backend.new_output(x.shape, x.dtype, x.device) for x in (r, w, k, v, a, b)]
    grad_initial = _backend.new_output(recurrent._state_shape(r, cu_seqlens), torch.float32, r.device)
    if grad_final is not None:
        grad_final = grad_final.to(torch.float32).contiguous()
    low = precision == "bf16"
    _kernels().wkv7_backward(r, w, k, v, a, b, cu_seqlens, checkpoints, grad_y, grad_final, grads, grad_initial,
                             decay, low, low)
    return grads + [grad_initial]


torch.library.register_fake("ropewkv::wkv7_chunked_triton_bwd")(recurrent._wkv7_bwd_fake)
torch.library.register_autograd("ropewkv::wkv7_chunked_triton_fwd",
                                recurrent._triton_backward_of(_triton_bwd, "wkv7 chunked (triton)"),
                                setup_context=recurrent._triton_setup_context)
_backend.refuse_double_backward("ropewkv::wkv7_chunked_triton_bwd", "wkv7 (chunked)")


def wkv7_chunked_triton(r, w, k, v, a, b, initial_state, output_final_state: bool, cu_seqlens, decay: str,
                        precision: str):
    """The chunked Triton twin; arguments and result as recurrent.wkv7_triton. precision="bf16" also feeds bf16
    operands to the N-sized tensor-core products (fp32 accumulate; state, decays and sums fp32)."""
    recurrent._check(r, w, k, v, a, b, initial_state, cu_seqlens, decay, precision)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()  # the kernels read it through its data pointer as dense
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (r, w, k, v, a, b,
                                                                                       initial_state))
    y, final_state, _ = _triton_fwd(r, w, k, v, a, b, initial_state, cu_seqlens, decay, precision, save)
    return y, (final_state if output_final_state else None)
