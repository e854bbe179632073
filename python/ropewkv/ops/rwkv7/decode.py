"""wkv7_step: one decode token of the WKV7 recurrence, the state updated in place (the C++ op `ropewkv::wkv7_step`:
a dedicated CUDA kernel and the CPU twin; Triton runs it as the recurrent kernel with T = 1,
`ropewkv::wkv7_triton_step`)."""
from __future__ import annotations

from typing import Optional

import torch

from ... import _backend
from ...reference import rwkv7 as reference
from . import recurrent
from .api import _NAMES, _check_decay, _check_inputs, _check_state, _decay_input, _decay_read_as_is


def _fake_step(r, w, k, v, a, b, state, decay, precision):
    return torch.empty_like(r, memory_format=torch.contiguous_format)


if _backend._C is not None:
    torch.library.register_fake("ropewkv::wkv7_step")(_fake_step)


@torch.library.custom_op("ropewkv::wkv7_triton_step", mutates_args=("state",))
def _triton_step(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 state: torch.Tensor, decay: str, precision: str) -> torch.Tensor:
    """The recurrent Triton kernel at T = 1 with `state` as both its initial and its final state: each program loads
    its (batch, head) slice before it stores it (the stored state depends on every loaded element of its row), so the
    state moves once each way. (Through wkv7_triton and a copy back it moved twice: 48% of copy on the H100,
    2026-11-26.)"""
    recurrent._check(*(t.unsqueeze(1) for t in (r, w, k, v, a, b)), state, None, decay, precision)
    return _launch_triton_step(r, w, k, v, a, b, state, decay, precision == "bf16")


def _launch_triton_step(r, w, k, v, a, b, state, decay: str, low_precision: bool) -> torch.Tensor:
    y = _backend.new_output(r.shape, r.dtype, r.device)
    recurrent._kernels().wkv7_forward(*(t.unsqueeze(1) for t in (r, w, k, v, a, b)), state, None, y.unsqueeze(1),
                                      state, None, decay, low_precision)
    return y


_triton_step.register_fake(_fake_step)


def _cpp_step(op, r, w, k, v, a, b, state, decay_code: int, precision_code: int) -> torch.Tensor:
    """The C++ step, and the state's version counter bumped: the schema's mutation bumps none outside autograd, so a
    state some other op saved for backward was silently used changed (the Triton and reference paths bump it)."""
    y = op(r, w, k, v, a, b, state, decay_code, precision_code)
    torch.autograd.graph.increment_version(state)
    return y


def _cpp_runner(decay_code: int, precision_code: int):
    op = torch.ops.ropewkv.wkv7_step

    def run(r, w, k, v, a, b, state):
        return _cpp_step(op, r, w, k, v, a, b, state, decay_code, precision_code)
    return run


def _triton_runner(decay: str, precision: str):
    """The Triton kernel launched without the custom op: at decode the op's Python dispatch (argument defaults, the
    ADInplaceOrView and autograd kernels) and the checks the fast path has already made are ~85% of the host path
    (266 against 36 µs per call on the dev machine, launch stubbed out; ~100 µs per call in all on the H100,
    2026-11-26). The state's version counter is bumped as the op's declared mutation would."""
    low_precision = precision == "bf16"

    def run(r, w, k, v, a, b, state):
        y = _launch_triton_step(r, w, k, v, a, b, state, decay, low_precision)
        torch.autograd.graph.increment_version(state)
        return y
    return run


# The decode fast path (as rope's, in ropewkv/ops/rope.py): the common call (r..b of one shape and device, w of r's
# dtype or fp32, state as the op takes it) whose Python-level arguments the general path has accepted once for a
# kernel twin (_backend.fast_path_cacheable). It checks what varies per call and returns None for anything else: the
# general path then decides and raises.
# (backend, precision, decay, r dtype, w dtype, head size, r device) -> (state dtype, run(r, w, k, v, a, b, state))
_ACCEPTED: dict = {}


def _step_fast(r, w, k, v, a, b, state, decay, precision, backend) -> Optional[torch.Tensor]:
    if (not isinstance(r, torch.Tensor) or not isinstance(w, torch.Tensor) or not isinstance(state, torch.Tensor)
            or torch.compiler.is_compiling()):
        return None
    shape = r.shape
    if len(shape) != 3:
        return None
    device = r.device
    try:
        accepted = _ACCEPTED.get((backend, precision, decay, r.dtype, w.dtype, shape[2], device))
    except TypeError:  # an unhashable backend, precision or decay: the general path names it
        return None
    if accepted is None:
        return None
    dtype = r.dtype
    if w.shape != shape or w.device != device:
        return None
    for x in (k, v, a, b):
        if not isinstance(x, torch.Tensor) or x.shape != shape or x.dtype != dtype or x.device != device:
            return None
    batch, heads, n = shape
    state_dtype, run = accepted
    if (state.shape != (batch, heads, n, n) or state.dtype != state_dtype or state.device != device
            or not state.is_contiguous()):
        return None
    if torch.is_grad_enabled() and any(x.requires_grad for x in (r, w, k, v, a, b, state)):
        return None  # the op has no backward: the general path refuses (or differentiates the reference)
    return run(r.contiguous(), w.contiguous(), k.contiguous(), v.contiguous(), a.contiguous(), b.contiguous(), state)


def wkv7_step(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              state: torch.Tensor, *, decay: str = "loglog", precision: Optional[str] = None,
              backend: str = "auto") -> torch.Tensor:
    """One decode token of the WKV7 recurrence; equal to wkv7 with T = 1 at the same precision.

    Args:
        r, w, k, v, a, b: [B, H, N]; r, k, v, a, b of one dtype, w of its own float dtype if wanted (as wkv7);
            copied to contiguous if they are not.
        state: fp32 [B, H, N, N] (fp64 for fp64 inputs), S[v][k], contiguous. Updated IN PLACE to S_1.
        decay, precision, backend: as wkv7.
    Returns:
        y [B, H, N] in r's dtype.
    Inference only: there is no backward (train with wkv7); with grad mode on, an input or state that requires grad
    raises, except on the reference backend, which autograd differentiates. It is a mutating custom op, so
    torch.compile keeps it.
    """
    y = _step_fast(r, w, k, v, a, b, state, decay, precision, backend)
    if y is not None:
        return y
    resolved = _check_inputs((r, w, k, v, a, b), 3, "[B, H, N]", backend)
    decay_code = _check_decay(decay)
    batch, heads, n = r.shape
    _check_state(state, "state", (batch, heads, n, n), r)
    if not state.is_contiguous():
        raise ValueError("state must be contiguous: wkv7_step updates it in place")
    # The kernel ops have no autograd kernel: torch would only warn and return a y whose backward drops this step.
    if resolved != "reference" and torch.is_grad_enabled():
        needs_grad = [name for name, x in zip((*_NAMES, "state"), (r, w, k, v, a, b, state)) if x.requires_grad]
        if needs_grad:
            raise RuntimeError(f"wkv7_step has no backward on the {resolved} backend, but requires_grad is set on "
                               f"{', '.join(needs_grad)}: train with ropewkv.wkv7 (T = 1 for one token), which has "
                               "one, or call wkv7_step under torch.no_grad() or with detached inputs")
    precision_arg, precision = precision, _backend.resolve_precision(precision)
    tensors = tuple(x.contiguous() for x in (r, _decay_input(w, r), k, v, a, b))
    if _backend.fast_path_cacheable(resolved, r) and _decay_read_as_is(w, r) and not torch.compiler.is_compiling():
        run = (_triton_runner(decay, precision) if resolved == "triton"
               else _cpp_runner(decay_code, _backend.precision_code(precision)))
        _ACCEPTED[(backend, precision_arg, decay, r.dtype, w.dtype, n, r.device)] = (state.dtype, run)
    if resolved in ("cpu", "cuda"):
        return _cpp_step(torch.ops.ropewkv.wkv7_step, *tensors, state, decay_code, _backend.precision_code(precision))
    if resolved == "triton":
        return torch.ops.ropewkv.wkv7_triton_step(*tensors, state, decay, precision)
    y, new_state = reference.wkv7_step(*(x.to(state.dtype) for x in tensors), state, decay)
    state.copy_(new_state)
    return y.to(r.dtype)
