"""flash-linear-attention (FLA) drop-ins for RWKV-7 on ropewkv's kernels: `chunk_rwkv7`, `fused_recurrent_rwkv7` and
`fused_mul_recurrent_rwkv7`, with FLA 0.6.0's signatures (every parameter, default and order; the tests check them
against the installed FLA), plus keyword-only `precision` and `backend` as in ropewkv.wkv7.

FLA's conventions, converted to ropewkv.wkv7 and back (all conversions are differentiable):
  - w is the LOG decay (d = exp(w)): wkv7(..., decay="log");
  - states are [N, H, K, V], the transpose of RWKV-LM's [N, H, V, K] used by wkv7 (a [1, H, K, V] initial state
    is broadcast to every sequence); the value size V must equal K;
  - `scale` multiplies r (RWKV-7 needs 1.0; fused_recurrent_rwkv7 defaults to K^-0.5 when scale is None). In a
    16-bit dtype, r * scale is rounded once more when scale is not 1.
  - fused_mul_recurrent_rwkv7(r, w, k, v, kk, a) is the recurrence with a = -kk and b = kk * a (FLA's inference form
    for RWKV7Attention); `reverse` runs every sequence from its last token to its first.
All three have a backward (FLA's fused forms have none). The math is ropewkv's: fp32 state, decay computed in fp32.

FLA's tuning hints, and what they mean here:
  - safe_gate, chunk_size: not needed. FLA uses them to choose a tensor-core scheme of its chunked form that is safe
    for the decay range. All three forms here call wkv7(algorithm="auto"): the chunked form on the cpu backend from
    8 tokens per sequence, else the sequential recurrence. Neither needs such a scheme: the chunked form never divides
    by a cumulative decay (ops/rwkv7/chunked.md), so both are fp32-accurate for any decay. Accepted, ignored.
  - disable_recompute: not needed: the backward always recomputes the states from fp32 checkpoints (every 16 tokens).
  - cu_seqlens_cpu: not needed: the kernels read cu_seqlens on the device. Checked to pair with cu_seqlens.
  - lower_bound: checked: FLA's kernels assume lower_bound <= w and let the caller guarantee it; here every w must
    lie in [lower_bound, 0], with lower_bound rounded to w's dtype through fp32 as FLA's RWKV7Attention computes
    w = lower_bound * sigmoid(.) (one reduction and a host sync; skipped under torch.compile).
  - cp_context: refused (NotImplementedError): FLA's context parallelism has its own sequence layouts; ropewkv's is
    ropewkv.distributed.wkv7_sequence_parallel.
Dtypes: FLA's kernels read every input at its own precision, and FLA's own RWKV7Attention under autocast passes bf16
r, w, k, v with fp32 a, b (a = -kk with kk normalised in fp32). So here, as there, w may have any float dtype (read at
its own precision, as by wkv7), and r, k, v, a, b of different dtypes are all widened to the widest of them (exact)
before the kernel. o comes back in FLA's output dtype: r's for chunk_rwkv7, v's for the two fused forms.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from .._backend import compute_dtype
from ..ops.rwkv7 import wkv7, wkv7_step


def _check_hints(w: torch.Tensor, cu_seqlens, cu_seqlens_cpu, cp_context, lower_bound) -> None:
    if cp_context is not None:
        raise NotImplementedError("cp_context: FLA's context parallelism is not implemented by ropewkv.compat.fla; "
                                  "split the sequence with ropewkv.distributed.wkv7_sequence_parallel instead")
    if cu_seqlens_cpu is not None and (cu_seqlens is None or tuple(cu_seqlens_cpu.shape) != tuple(cu_seqlens.shape)):
        raise ValueError("cu_seqlens_cpu must be the CPU copy of cu_seqlens (same shape), got "
                         f"{tuple(cu_seqlens_cpu.shape)} with cu_seqlens "
                         f"{None if cu_seqlens is None else tuple(cu_seqlens.shape)}")
    if lower_bound is None:
        return
    if lower_bound >= 0:
        raise ValueError(f"lower_bound must be negative (w is a log decay <= 0), got {lower_bound}")
    if torch.compiler.is_compiling() or w.numel() == 0:
        return
    bound = torch.tensor(lower_bound, dtype=torch.float32).to(w.dtype)
    low, high = torch.aminmax(w.detach())
    if low < bound or high > 0:
        raise ValueError(f"w must lie in [lower_bound, 0] = [{bound.item()}, 0] (the log decay), got values in "
                         f"[{low.item()}, {high.item()}]")


def _reversed_time(cu_seqlens: Optional[torch.Tensor], seqlen: int, device) -> torch.Tensor:
    """The token index that runs every sequence backwards: t -> start + end - 1 - t within its [start, end)."""
    t = torch.arange(seqlen, device=device)
    if cu_seqlens is None:
        return t.flip(0)
    bounds = cu_seqlens.to(torch.int64)
    sequence = torch.searchsorted(bounds[1:], t, right=True)
    return bounds[sequence] + bounds[sequence + 1] - 1 - t


def _run(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, out_dtype, precision, backend):
    """FLA's call on ropewkv.wkv7 (or ropewkv.wkv7_step for one token without autograd): (o, final_state)."""
    if scale is None:
        scale = r.shape[-1] ** -0.5
    io_dtype = functools.reduce(torch.promote_types, (x.dtype for x in (k, v, a, b)), r.dtype)
    r, k, v, a, b = (x.to(io_dtype) for x in (r, k, v, a, b))
    if scale != 1.0:
        r = r * scale
    state = None
    if initial_state is not None:
        state = initial_state.transpose(-1, -2).to(compute_dtype(io_dtype))
    tensors = (r, w, k, v, a, b)
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (*tensors, initial_state) if x is not None)
    batch, seqlen, heads, n = r.shape
    if seqlen == 1 and cu_seqlens is None and not needs_grad and (state is None or state.shape[0] in (1, batch)):
        # One decode token: the dedicated step kernel, on a fresh state that it updates in place (a state of another
        # batch size goes to wkv7, whose error names initial_state).
        if state is None:
            state = r.new_zeros((batch, heads, n, n), dtype=compute_dtype(io_dtype))
        else:
            state = state.expand(batch, heads, n, n).clone(memory_format=torch.contiguous_format)
        y = wkv7_step(*(x[:, 0] for x in tensors), state, decay="log", precision=precision,
                      backend=backend).unsqueeze(1)
        final_state = state if output_final_state else None
    else:
        y, final_state = wkv7(*tensors, initial_state=state, output_final_state=output_final_state,
                              cu_seqlens=cu_seqlens, decay="log", precision=precision, backend=backend)
    return y.to(out_dtype), (None if final_state is None else final_state.transpose(-1, -2))


def chunk_rwkv7(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, scale: float = 1.0, initial_state: Optional[torch.Tensor] = None,
                output_final_state: bool = False, cu_seqlens: Optional[torch.LongTensor] = None,
                cu_seqlens_cpu: Optional[torch.LongTensor] = None, safe_gate: bool = False,
                chunk_size: Optional[int] = None, disable_recompute: bool = False, cp_context: Any = None,
                lower_bound: Optional[float] = None, *, precision: Optional[str] = None, backend: str = "auto"):
    """FLA's chunk_rwkv7: r, w (log decay), k, v, a, b [B, T, H, K]; initial_state [N, H, K, V] or None.
    Returns (o [B, T, H, K] in r's dtype, final_state fp32 [N, H, K, V] or None). The hints: see the module doc."""
    _check_hints(w, cu_seqlens, cu_seqlens_cpu, cp_context, lower_bound)
    return _run(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, r.dtype, precision, backend)


def fused_recurrent_rwkv7(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                          b: torch.Tensor, scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                          output_final_state: bool = True, cu_seqlens: Optional[torch.LongTensor] = None, *,
                          precision: Optional[str] = None, backend: str = "auto"):
    """FLA's fused_recurrent_rwkv7, with FLA's defaults (scale None = K^-0.5, output_final_state True): pass
    scale=1.0 for RWKV-7. Shapes and conventions as chunk_rwkv7; o in v's dtype. Has a backward (FLA's has none)."""
    return _run(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, v.dtype, precision, backend)


def fused_mul_recurrent_rwkv7(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kk: torch.Tensor,
                              a: torch.Tensor, scale: float = 1.0, initial_state: Optional[torch.Tensor] = None,
                              output_final_state: bool = False, reverse: bool = False,
                              cu_seqlens: Optional[torch.Tensor] = None, *, precision: Optional[str] = None,
                              backend: str = "auto"):
    """FLA's fused_mul_recurrent_rwkv7: the recurrence with a = -kk, b = kk * a (kk the normalised key, a the
    in-context learning rate), as RWKV7Attention runs it without autograd for T < 64. reverse: every sequence runs
    from its last token to its first (o stays in the input order). o in v's dtype; has a backward."""
    if reverse:
        order = _reversed_time(cu_seqlens, r.shape[1], r.device)
        r, w, k, v, kk, a = (x.index_select(1, order) for x in (r, w, k, v, kk, a))
    # b = kk * a in fp32 (or wider), as FLA's kernel multiplies them: rounded to bf16 first, the state lost ~3000x
    # in precision. (A wider b widens the kernel's I/O, exactly: _run.)
    product_dtype = torch.promote_types(torch.promote_types(kk.dtype, a.dtype), torch.float32)
    y, final_state = _run(r, w, k, v, -kk, kk.to(product_dtype) * a.to(product_dtype), scale, initial_state,
                          output_final_state, cu_seqlens, v.dtype, precision, backend)
    return (y.index_select(1, order) if reverse else y), final_state
