"""qk_norm_rope: per-head RMSNorm of q and k (Qwen3, Qwen3-MoE, Gemma-3) fused with RoPE, one pass over q and k.

Ops (opaque custom ops with fake kernels and autograd, so torch.compile(fullgraph=True) traces them):
  - ropewkv::qk_norm_rope / qk_norm_rope_ / qk_norm_rope_backward: C++ (CPU twin in _C, CUDA twin in _C_cuda),
    schemas in qk_norm_rope_cpu.cpp;
  - ropewkv::qk_norm_rope_triton / _triton_ / backward_triton: the Triton twin (triton_kernels/qk_norm_rope.py).
Every twin gets the arguments normalised here: q and k as [B, S, H, D] views (ropewkv.rope's normalisation: layouts
are views, positions/offsets/cu_seqlens checked there), weights in the compute dtype, and exactly one cos/sin source:
inv_freq (the angle computed in the kernel), HF's cos/sin tables as [B, S, R] views, or a vLLM cos_sin_cache
[max_position, R] read at each token's position. Without weights the op is plain RoPE from that source (the serving
compat layer uses it so). The backward computes dq, dk and both weight gradients in one pass (fp32 partial sums over
fixed chunks of tokens, summed in chunk order: deterministic).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import _backend, _checks
from ..reference import qk_norm_rope as reference
from ..reference import rope as rope_reference
from . import rope as rope_ops

_SOURCE_ARGS = 15  # the schema's arguments after q and k (ROPEWKV_QK_NORM_ROPE_ARGS)
MAX_CUDA_HEAD_DIM = 256  # cuda::kQkMaxHeadDim: a row in the registers of one warp; "auto" uses Triton beyond


# ----------------------------------------------------------------------------------------------------------------------
# Triton twin as opaque custom ops (wrap_triton/triton_op fail under torch.compile on CPU).


@torch.library.custom_op("ropewkv::qk_norm_rope_triton", mutates_args=())
def _forward_triton(q: torch.Tensor, k: Optional[torch.Tensor], q_weight: Optional[torch.Tensor],
                    k_weight: Optional[torch.Tensor], eps: float, weight_offset: float,
                    inv_freq: Optional[torch.Tensor], cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                    cos_sin_cache: Optional[torch.Tensor], positions: Optional[torch.Tensor],
                    seqlen_offsets: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], rotary_dim: int,
                    interleaved: bool, attention_scaling: float, precision: int) -> list[torch.Tensor]:
    from ..triton_kernels import qk_norm_rope as kernels

    out = rope_ops._outputs(q, k)
    kernels.forward(q, k, out[0], out[1] if k is not None else None, q_weight, k_weight, eps, weight_offset, inv_freq,
                    cos, sin, cos_sin_cache, positions, seqlen_offsets, cu_seqlens, rotary_dim, interleaved,
                    attention_scaling, precision == 1)
    return out


@torch.library.custom_op("ropewkv::qk_norm_rope_triton_", mutates_args=("q", "k"))
def _forward_triton_inplace(q: torch.Tensor, k: Optional[torch.Tensor], q_weight: Optional[torch.Tensor],
                            k_weight: Optional[torch.Tensor], eps: float, weight_offset: float,
                            inv_freq: Optional[torch.Tensor], cos: Optional[torch.Tensor],
                            sin: Optional[torch.Tensor], cos_sin_cache: Optional[torch.Tensor],
                            positions: Optional[torch.Tensor], seqlen_offsets: Optional[torch.Tensor],
                            cu_seqlens: Optional[torch.Tensor], rotary_dim: int, interleaved: bool,
                            attention_scaling: float, precision: int) -> None:
    from ..triton_kernels import qk_norm_rope as kernels

    kernels.forward(q, k, q, k, q_weight, k_weight, eps, weight_offset, inv_freq, cos, sin, cos_sin_cache, positions,
                    seqlen_offsets, cu_seqlens, rotary_dim, interleaved, attention_scaling, precision == 1)


@torch.library.custom_op("ropewkv::qk_norm_rope_backward_triton", mutates_args=())
def _backward_triton(grad_q: torch.Tensor, grad_k: Optional[torch.Tensor], q: torch.Tensor,
                     k: Optional[torch.Tensor], q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor],
                     eps: float, weight_offset: float, inv_freq: Optional[torch.Tensor], cos: Optional[torch.Tensor],
                     sin: Optional[torch.Tensor], cos_sin_cache: Optional[torch.Tensor],
                     positions: Optional[torch.Tensor], seqlen_offsets: Optional[torch.Tensor],
                     cu_seqlens: Optional[torch.Tensor], rotary_dim: int, interleaved: bool, attention_scaling: float,
                     precision: int) -> list[torch.Tensor]:
    from ..triton_kernels import qk_norm_rope as kernels

    grads = rope_ops._outputs(q, k)
    dq, dk = grads[0], grads[1] if k is not None else None
    dwq, dwk = kernels.backward(grad_q, grad_k, q, k, dq, dk, q_weight, k_weight, eps, weight_offset, inv_freq, cos,
                                sin, cos_sin_cache, positions, seqlen_offsets, cu_seqlens, rotary_dim, interleaved,
                                attention_scaling)
    compute = _backend.compute_dtype(q.dtype)
    # What the C++ op returns; a custom op's outputs may not alias one another, so each absent one is its own tensor.
    return [dq, dk if dk is not None else q.new_empty(0), dwq if dwq is not None else q.new_empty(0, dtype=compute),
            dwk if dwk is not None else q.new_empty(0, dtype=compute)]


# ----------------------------------------------------------------------------------------------------------------------
# Fake kernels and autograd, shared by the C++ and the Triton ops.


def _fake_backward(grad_q, grad_k, q, k, q_weight, k_weight, *args):
    def weight_grad(w):  # [D], or empty without the weight: in the compute dtype either way
        return q.new_empty(w.shape if w is not None else (0,), dtype=_backend.compute_dtype(q.dtype))

    return [torch.empty_like(q), torch.empty_like(k) if k is not None else q.new_empty(0), weight_grad(q_weight),
            weight_grad(k_weight)]


def _register(functional: str, inplace: str, backward_name: str) -> None:
    backward_op = getattr(torch.ops.ropewkv, backward_name.split("::")[1])
    torch.library.register_fake(functional)(rope_ops._fake)
    torch.library.register_fake(inplace)(rope_ops._fake_inplace)
    torch.library.register_fake(backward_name)(_fake_backward)

    def setup(ctx, inputs, output):
        ctx.has_k = inputs[1] is not None
        ctx.save_for_backward(*(x for x in inputs if isinstance(x, torch.Tensor) or x is None))
        ctx.scalars = {i: x for i, x in enumerate(inputs) if not (isinstance(x, torch.Tensor) or x is None)}

    def backward(ctx, grads):
        saved = iter(ctx.saved_tensors)
        inputs = [ctx.scalars[i] if i in ctx.scalars else next(saved) for i in range(2 + _SOURCE_ARGS)]
        gq, gk = rope_ops._stride1(grads[0]), rope_ops._stride1(grads[1]) if ctx.has_k else None
        dq, dk, dwq, dwk = backward_op(gq, gk, *inputs)
        weights = inputs[2], inputs[3]
        return (dq, dk if ctx.has_k else None, dwq if weights[0] is not None else None,
                dwk if weights[1] is not None else None) + (None,) * (_SOURCE_ARGS - 2)

    torch.library.register_autograd(functional, backward, setup_context=setup)
    _backend.refuse_double_backward(backward_name, "qk_norm_rope")


_register("ropewkv::qk_norm_rope_triton", "ropewkv::qk_norm_rope_triton_", "ropewkv::qk_norm_rope_backward_triton")
if _backend._C is not None:
    _register("ropewkv::qk_norm_rope", "ropewkv::qk_norm_rope_", "ropewkv::qk_norm_rope_backward")


def _ops(backend: str):
    """(functional, in-place) ops of a kernel backend; cpu and cuda share the dispatched C++ ops."""
    if backend == "triton":
        return torch.ops.ropewkv.qk_norm_rope_triton, torch.ops.ropewkv.qk_norm_rope_triton_
    return torch.ops.ropewkv.qk_norm_rope, torch.ops.ropewkv.qk_norm_rope_


# ----------------------------------------------------------------------------------------------------------------------
# Argument normalisation: clear Python errors first, then the ops' arguments.


class _Normalised(NamedTuple):
    q4: torch.Tensor
    k4: Optional[torch.Tensor]
    args: tuple  # the op arguments after q and k (the schema's ROPEWKV_QK_NORM_ROPE_ARGS)
    backend: str
    precision: str


def _weight(w, name: str, q: torch.Tensor, head_dim: int) -> torch.Tensor:
    _checks.check_tensor(w, name)
    _checks.check_same_device("q", q, **{name: w})
    if not w.is_floating_point() or tuple(w.shape) != (head_dim,):
        raise ValueError(f"{name} must be a float tensor of shape [head_dim = {head_dim}], got {w.dtype} "
                         f"{tuple(w.shape)}")
    return w.to(_backend.compute_dtype(q.dtype)).contiguous()


def _table(t, name: str, target: tuple, resolved: str, q: torch.Tensor) -> torch.Tensor:
    """HF's cos or sin as a [B, S, R] view (broadcast welcome; [T, R] for thd)."""
    _checks.check_tensor(t, name)
    _checks.check_same_device("q", q, **{name: t})
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {t.dtype}")
    if torch.is_grad_enabled() and t.requires_grad:
        raise NotImplementedError(f"qk_norm_rope does not differentiate {name}; detach it")
    try:
        view = t.expand(target)
    except RuntimeError:
        raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to {target}") from None
    if resolved not in ("cpu", "reference") and view.dtype == torch.float64:  # the CUDA and Triton twins read fp32
        view = view.to(torch.float32)
    return view


def _check_cache_shape(cache) -> None:
    _checks.check_tensor(cache, "cos_sin_cache")
    if not cache.is_floating_point() or cache.dim() != 2 or cache.shape[1] % 2 or cache.shape[0] == 0:
        raise ValueError(f"cos_sin_cache must be a float [max_position, rotary_dim] tensor with even rotary_dim, got "
                         f"{cache.dtype} {tuple(cache.shape)}")


def _cache(cache, positions, q: torch.Tensor, resolved: str) -> torch.Tensor:
    _checks.check_same_device("q", q, cos_sin_cache=cache)
    if positions is None:
        raise ValueError("cos_sin_cache needs positions (the cache row of each token)")
    if rope_ops._checks_values(positions) and positions.numel():  # elsewhere the kernels clamp instead
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or high >= cache.shape[0]:
            raise ValueError(f"positions must lie in [0, {cache.shape[0]}) (the cos_sin_cache rows), got "
                             f"[{low}, {high}]")
    if resolved not in ("cpu", "reference") and cache.dtype == torch.float64:
        cache = cache.to(torch.float32)
    return cache if cache.stride(1) == 1 else cache.contiguous()


def _normalise(q, k, q_weight, k_weight, eps, weight_offset, inv_freq, cos, sin, cos_sin_cache, positions,
               seqlen_offsets, cu_seqlens, layout, interleaved, rotary_dim, attention_scaling, precision,
               backend) -> _Normalised:
    sources = [name for name, t in (("inv_freq", inv_freq), ("cos/sin", cos if cos is not None else sin),
                                    ("cos_sin_cache", cos_sin_cache)) if t is not None]
    if len(sources) != 1:
        raise ValueError(f"give exactly one cos/sin source (inv_freq, cos and sin, or cos_sin_cache), got {sources}")
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin must be given together")
    _checks.check_tensor(q, "q")
    if inv_freq is None:  # q, k, positions and offsets are checked by RoPE's normalisation, which reads inv_freq
        table = cos if cos is not None else cos_sin_cache
        _checks.check_tensor(table, "cos") if cos is not None else _check_cache_shape(cos_sin_cache)
        width = table.shape[-1] if table.dim() else 0
        if cos is not None and (table.dim() == 0 or width % 2):
            raise ValueError(f"cos and sin must be [..., R] tables with an even rotated width R, got cos of shape "
                             f"{tuple(table.shape)}")
        if rotary_dim is not None and rotary_dim != width:
            raise ValueError(f"rotary_dim {rotary_dim} must equal the table's last dim {width}")
        rotary_dim = width
        stand_in = q.new_empty(max(width, 0) // 2, dtype=torch.float32)  # shape only: never read
    n = rope_ops._normalise_rope(q, k, inv_freq if inv_freq is not None else stand_in, positions, seqlen_offsets,
                                 cu_seqlens, layout, interleaved, rotary_dim, attention_scaling, precision, backend)
    if backend == "auto" and n.backend == "cuda" and n.q4.shape[-1] > MAX_CUDA_HEAD_DIM:
        n = n._replace(backend=_backend.resolve_backend("triton", q.device))
    inv, pos, offsets, cu = n.args[:4]
    rot = 2 * inv.numel()
    batch, seqlen, _, head_dim = n.q4.shape
    if (k_weight is not None and k is None) or (k is not None and (q_weight is None) != (k_weight is None)):
        raise ValueError("q_weight and k_weight must be given together (k_weight needs k), or both be None (no norm)")
    weights = [None if w is None else _weight(w, name, q, head_dim)
               for w, name in ((q_weight, "q_weight"), (k_weight, "k_weight"))]
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    if not isinstance(weight_offset, (int, float)):
        raise TypeError(f"weight_offset must be a float, got {type(weight_offset).__name__}")
    tables = [None, None, None]
    if inv_freq is None and attention_scaling != 1.0:
        raise ValueError("attention_scaling applies to the inv_freq source only (scale the cos/sin tables instead)")
    if cos is not None:
        if pos is not None or offsets is not None or cu is not None:
            raise ValueError("cos/sin tables are read per token as given: positions, seqlen_offsets and cu_seqlens "
                             "apply to the inv_freq and cos_sin_cache sources")
        target = (seqlen, rot) if layout == "thd" else (batch, seqlen, rot)
        tables[:2] = [_table(t, name, target, n.backend, q) for t, name in ((cos, "cos"), (sin, "sin"))]
        if layout == "thd":
            tables[:2] = [t.unsqueeze(0) for t in tables[:2]]
        inv = None
    elif cos_sin_cache is not None:
        if offsets is not None or cu is not None:
            raise ValueError("a cos_sin_cache takes explicit positions only (no seqlen_offsets, no cu_seqlens)")
        tables[2] = _cache(cos_sin_cache, pos, q, n.backend)
        inv = None
    args = (*weights, float(eps), float(weight_offset), inv, *tables, pos, offsets, cu, rot, bool(interleaved),
            float(attention_scaling), n.args[7])
    return _Normalised(n.q4, n.k4, args, n.backend, n.precision)


def _reference(n: _Normalised, x4: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.Tensor:
    """The eager path: fp32 math (fp64 for fp64), or HF's eager arithmetic for precision="bf16" on fp16/bf16."""
    _, _, eps, offset, inv, cos, sin, cache, pos, offsets, cu, rot, interleaved, scaling, _ = n.args
    batch, seqlen = x4.shape[:2]
    compute = _backend.compute_dtype(x4.dtype)
    if cos is None:
        if cache is not None:
            half_cos, half_sin = reference.cache_cos_sin(cache.to(compute), pos)
        else:
            if cu is not None:
                positions = rope_reference.token_positions(1, seqlen, None if pos is None else pos[0],
                                                           0 if offsets is None else offsets, cu).view(1, seqlen)
            else:
                positions = rope_reference.token_positions(batch, seqlen, pos, 0 if offsets is None else offsets)
            half_cos, half_sin = rope_reference.cos_sin(positions.to(x4.device), inv, scaling, compute)
        cos, sin = (reference.full_table(t, interleaved) for t in (half_cos, half_sin))
    cos, sin = cos.unsqueeze(2).to(compute), sin.unsqueeze(2).to(compute)
    if n.precision == "bf16" and x4.dtype in (torch.float16, torch.bfloat16):
        y = x4 if weight is None else reference.hf_rms_norm(x4, weight.to(x4.dtype if offset == 0 else weight.dtype),
                                                            eps, offset)
        return reference.rotate_table(y, cos.to(x4.dtype), sin.to(x4.dtype), interleaved)
    return reference.qk_norm_rope(x4, weight, eps, cos, sin, weight_offset=offset, interleaved=interleaved,
                                  dtype=compute).to(x4.dtype)


# ----------------------------------------------------------------------------------------------------------------------
# Public function.


def qk_norm_rope(q: torch.Tensor, k: Optional[torch.Tensor] = None, q_weight: Optional[torch.Tensor] = None,
                 k_weight: Optional[torch.Tensor] = None, eps: float = 1e-6, *, weight_offset: float = 0.0,
                 inv_freq: Optional[torch.Tensor] = None, cos: Optional[torch.Tensor] = None,
                 sin: Optional[torch.Tensor] = None, cos_sin_cache: Optional[torch.Tensor] = None,
                 positions: Optional[torch.Tensor] = None, seqlen_offsets=0, cu_seqlens: Optional[torch.Tensor] = None,
                 layout: str = "bshd", interleaved: bool = False, rotary_dim: Optional[int] = None,
                 attention_scaling: float = 1.0, inplace: bool = False, precision: Optional[str] = None,
                 backend: str = "auto"):
    """Per-head RMSNorm of q and k (q_norm / k_norm of Qwen3, Qwen3-MoE, Gemma-3), then RoPE: one pass over q and k.

    Args:
        q, k: as ropewkv.rope: [B, S, H, D] ("bshd"), "bhsd", "sbhd" or [T, H, D] ("thd") views, any strides with
            stride 1 in the last dim; k may have its own head count (GQA/MQA) or be None. fp32/fp16/bf16 (fp64 on
            cpu/reference).
        q_weight, k_weight: [D] norm weights (any float dtype; the gradient comes back in it), applied as
            (weight_offset + weight). Both None: no norm, plain RoPE from the chosen source.
        eps: added to the mean square (HF's rms_norm_eps).
        weight_offset: 0 for Qwen3 (y = n w), 1 for Gemma-3 (y = n (1 + w)).
        inv_freq | cos, sin | cos_sin_cache: the cos/sin source, exactly one:
            inv_freq [R/2]: the angle position * inv_freq computed in the kernel (ropewkv.rope's exact reduction),
                positions / seqlen_offsets / cu_seqlens / attention_scaling as in ropewkv.rope;
            cos, sin: HF's tables [B, S, R] (broadcastable; [T, R] for thd), any float dtype, read at each
                output's dim (not differentiated);
            cos_sin_cache [max_position, R]: vLLM's cache (cos half, then sin half) read at `positions`
                (broadcastable to [B, S], [T] for thd; required, each in [0, max_position): checked on the CPU in
                eager mode, clamped into range by the kernels otherwise).
        interleaved: GPT-J pairs (x[2i], x[2i+1]) instead of NeoX halves (x[i], x[i + R/2]).
        rotary_dim: R <= D (default: 2 len(inv_freq), or the table's width); dims past R are normalised, not
            rotated.
        inplace: write into q and k (inference only: the backward needs the inputs).
        precision: "fp32" (default build): statistics, norm and rotation in fp32, one rounding to the output.
            "bf16": HF's eager arithmetic on fp16/bf16: statistics in fp32, then Qwen3RMSNorm's rounding of the
            normalised value to the I/O dtype and its product with the weight in that dtype (weight_offset 0), or
            Gemma3RMSNorm's single rounding of n (1 + w) (weight_offset != 0), then HF's low-precision RoPE (cos/sin,
            products and sums rounded to the I/O dtype). The statistics' summation order differs from torch's, so an
            output can differ from HF eager by one ulp where that fp32 difference crosses a rounding boundary. The
            backward computes in fp32 in both modes.
        backend: "auto" | "cuda" | "triton" | "cpu" | "reference".
    Returns:
        (q_out, k_out) (q_out alone when k is None) in q's layout and dtype. Backward: dq, dk, and both weights'
        gradients (fp32 sums over fixed chunks of tokens, added in a fixed order: deterministic).
    """
    n = _normalise(q, k, q_weight, k_weight, eps, weight_offset, inv_freq, cos, sin, cos_sin_cache, positions,
                   seqlen_offsets, cu_seqlens, layout, interleaved, rotary_dim, attention_scaling, precision, backend)
    empty = n.q4.numel() == 0 and (n.k4 is None or n.k4.numel() == 0)
    if inplace:
        rope_ops._check_inplace(q, k, n.q4, n.k4)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, q_weight, k_weight)):
            raise ValueError("inplace=True is for inference: the backward needs q and k, which it overwrites; "
                             "use inplace=False (or torch.no_grad())")
    if n.backend == "reference" or empty:
        outs = [(_reference(n, x4, w) if not empty else x4.clone())
                for x4, w in ((n.q4, q_weight), (n.k4, k_weight)) if x4 is not None]
        if inplace:
            for x4, out in zip((n.q4, n.k4), outs):
                x4.copy_(out)
            return q if k is None else (q, k)
    elif inplace:
        rope_ops._run_inplace_op(_ops(n.backend)[1], n, q, k)
        return q if k is None else (q, k)
    else:
        outs = _ops(n.backend)[0](n.q4, n.k4, *n.args)
    outs = [rope_ops._from_bshd(o, layout) for o in outs]
    return outs[0] if k is None else (outs[0], outs[1])
