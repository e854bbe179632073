"""rope and apply_rotary_pos_emb: fused rotary embeddings for q and k in one launch, fp32 math by default.

Ops (all opaque custom ops with fake kernels and autograd, so torch.compile(fullgraph=True) traces them):
  - ropewkv::rope / rope_ / rope_cos_sin: C++ (CPU twin in _C, CUDA twin in _C_cuda), schemas in rope_cpu.cpp;
  - ropewkv::rope_triton / rope_triton_ / rope_cos_sin_triton: the Triton twin (triton_kernels/rope.py).
Every twin gets the same normalised arguments, built here: q and k as [B, S, H, D] views (layouts are transposes,
never copies, unless stride(-1) != 1), positions None or an int32/int64 [B, S] view, seqlen_offsets None or int64 [B]
([n_seqs] for varlen), cu_seqlens None or int32/int64 [n_seqs + 1], inv_freq fp32 contiguous [rotary_dim / 2],
then interleaved, conjugate, attention_scaling, precision, and the M-RoPE section (None for plain RoPE; positions are
then [3, B, S]) and layout flag.
The backward is the forward with conjugate=True (the transpose of the rotation: sin -> -sin).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from .. import _backend, _checks
from ..reference import rope as reference

LAYOUTS = reference.LAYOUTS
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_EXACT_POSITION = 2**24  # positions convert to fp32 exactly below this (ropewkv/rope.h)


# ----------------------------------------------------------------------------------------------------------------------
# Triton twin as opaque custom ops (wrap_triton/triton_op fail under torch.compile on CPU). The functional ones are
# plain functions registered as ops, so that a no-grad fast-path call can take the function itself (_no_grad_ops).


def _outputs(q: torch.Tensor, k: Optional[torch.Tensor]) -> list[torch.Tensor]:
    return [_backend.new_output_like(q)] + ([_backend.new_output_like(k)] if k is not None else [])


def _rope_triton(q: torch.Tensor, k: Optional[torch.Tensor], inv_freq: torch.Tensor, positions: Optional[torch.Tensor],
                 seqlen_offsets: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], interleaved: bool,
                 conjugate: bool, attention_scaling: float, precision: int, mrope_section: Optional[list[int]],
                 mrope_interleaved: bool) -> list[torch.Tensor]:
    from ..triton_kernels import rope as kernels

    out = _outputs(q, k)
    kernels.rope_forward(q, k, out[0], out[1] if k is not None else None, inv_freq, positions, seqlen_offsets,
                         cu_seqlens, interleaved, conjugate, attention_scaling, precision == 1, mrope_section,
                         mrope_interleaved)
    return out


torch.library.custom_op("ropewkv::rope_triton", mutates_args=())(_rope_triton)


@torch.library.custom_op("ropewkv::rope_triton_", mutates_args=("q", "k"))
def _rope_triton_inplace(q: torch.Tensor, k: Optional[torch.Tensor], inv_freq: torch.Tensor,
                         positions: Optional[torch.Tensor], seqlen_offsets: Optional[torch.Tensor],
                         cu_seqlens: Optional[torch.Tensor], interleaved: bool, conjugate: bool,
                         attention_scaling: float, precision: int, mrope_section: Optional[list[int]],
                         mrope_interleaved: bool) -> None:
    from ..triton_kernels import rope as kernels

    kernels.rope_forward(q, k, q, k, inv_freq, positions, seqlen_offsets, cu_seqlens, interleaved, conjugate,
                         attention_scaling, precision == 1, mrope_section, mrope_interleaved)


def _rope_cos_sin_triton(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                         interleaved: bool, conjugate: bool, precision: int) -> list[torch.Tensor]:
    from ..triton_kernels import rope as kernels

    out = _outputs(q, k)
    kernels.rope_cos_sin_forward(q, k, out[0], out[1] if k is not None else None, cos, sin, interleaved, conjugate,
                                 precision == 1)
    return out


torch.library.custom_op("ropewkv::rope_cos_sin_triton", mutates_args=())(_rope_cos_sin_triton)


# ----------------------------------------------------------------------------------------------------------------------
# Fake kernels and autograd, shared by the C++ and the Triton ops.


def _fake(q, k, *args):
    return [torch.empty_like(q)] + ([torch.empty_like(k)] if k is not None else [])


def _fake_inplace(*args):
    return None


def _stride1(g: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return g if g is None or g.is_contiguous() or g.stride(-1) == 1 or g.shape[-1] <= 1 else g.contiguous()


def _grads(ctx, grads, op, extra):
    """The backward of a rotation: the same op on the output grads, conjugated (the transpose)."""
    gq, gk = _stride1(grads[0]), _stride1(grads[1]) if ctx.has_k else None
    dq = op(gq, gk, *extra)
    return dq[0], dq[1] if ctx.has_k else None


def _register(functional: str, inplace: str, cos_sin: str) -> None:
    op = getattr(torch.ops.ropewkv, functional.split("::")[1])
    cs_op = getattr(torch.ops.ropewkv, cos_sin.split("::")[1])
    torch.library.register_fake(functional)(_fake)
    torch.library.register_fake(cos_sin)(_fake)
    torch.library.register_fake(inplace)(_fake_inplace)

    def setup(ctx, inputs, output):
        q, k, inv_freq, positions, offsets, cu_seqlens, interleaved, conjugate, *rest = inputs
        ctx.has_k = k is not None
        ctx.save_for_backward(inv_freq, positions, offsets, cu_seqlens)
        ctx.flags = (interleaved, not conjugate, *rest)  # scaling, precision, mrope_section, mrope_interleaved

    def backward(ctx, grads):
        return (*_grads(ctx, grads, op, (*ctx.saved_tensors, *ctx.flags)),) + (None,) * 10

    def setup_cos_sin(ctx, inputs, output):
        q, k, cos, sin, interleaved, conjugate, precision = inputs
        ctx.has_k = k is not None
        ctx.save_for_backward(cos, sin)
        ctx.flags = (interleaved, not conjugate, precision)

    def backward_cos_sin(ctx, grads):
        return (*_grads(ctx, grads, cs_op, (*ctx.saved_tensors, *ctx.flags)),) + (None,) * 5

    torch.library.register_autograd(functional, backward, setup_context=setup)
    torch.library.register_autograd(cos_sin, backward_cos_sin, setup_context=setup_cos_sin)


_register("ropewkv::rope_triton", "ropewkv::rope_triton_", "ropewkv::rope_cos_sin_triton")
if _backend._C is not None:
    _register("ropewkv::rope", "ropewkv::rope_", "ropewkv::rope_cos_sin")


_OP_HANDLES: dict = {}  # backend -> its ops: looked up once, not through torch.ops on every call


def _ops(backend: str):
    """(functional, in-place, cos/sin) ops of a kernel backend; cpu and cuda share the dispatched C++ ops."""
    handles = _OP_HANDLES.get(backend)
    if handles is None:
        if backend == "triton":
            handles = (torch.ops.ropewkv.rope_triton, torch.ops.ropewkv.rope_triton_,
                       torch.ops.ropewkv.rope_cos_sin_triton)
        else:
            handles = torch.ops.ropewkv.rope, torch.ops.ropewkv.rope_, torch.ops.ropewkv.rope_cos_sin
        _OP_HANDLES[backend] = handles
    return handles


def _no_grad_ops(backend: str):
    """(functional, cos/sin) for a fast-path call that needs no gradient: the C++ ops (below the Autograd key), or for
    Triton the custom ops' Python functions themselves, past the custom ops' Python dispatch, which costs more than
    the rest of the call (38 against 11 µs per decode call here, kernel launch stubbed out). Only the functional ops,
    which mutate nothing, skip it; torch.compile traces the general path."""
    if backend == "triton":
        return _rope_triton, _rope_cos_sin_triton
    functional, _, cos_sin = _ops(backend)
    return functional, cos_sin


class _InplaceRope(torch.autograd.Function):
    """The in-place op for autograd: it mutates q and k in their own layout (mark_dirty: their history moves on, and
    the version counters the op bumps make a tensor that some other op saved for backward fail autograd's check
    instead of being silently used) and backpropagates with the functional op, conjugated. Autograd cannot give a
    Function several dirty outputs when one is a view, so such q and k go through it one at a time."""

    @staticmethod
    def forward(ctx, q, k, layout, backend, args):
        functional, inplace, _ = _ops(backend)
        inplace(_bshd(q, layout, "q"), None if k is None else _bshd(k, layout, "k"), *args)
        ctx.functional, ctx.layout, ctx.has_k = functional, layout, k is not None
        ctx.save_for_backward(*args[:4])
        ctx.flags = (args[4], not args[5], *args[6:])
        if k is None:
            ctx.mark_dirty(q)
            return q
        ctx.mark_dirty(q, k)
        return q, k

    @staticmethod
    def backward(ctx, *grads):
        grads = [None if g is None else reference.to_bshd(g, ctx.layout) for g in grads] + [None]
        dq, dk = _grads(ctx, grads, ctx.functional, (*ctx.saved_tensors, *ctx.flags))
        return (_from_bshd(dq, ctx.layout), None if dk is None else _from_bshd(dk, ctx.layout), None, None, None)


def _run_inplace_op(op, n, q, k) -> None:
    """The in-place op `op` on the normalised views n.q4, n.k4 (RoPE's or qk_norm_rope's), and q's and k's version
    counters bumped: the C++ schema's mutation bumps none outside autograd (the Triton op's wrapper does)."""
    op(n.q4, n.k4, *n.args)
    if n.backend != "triton":
        torch.autograd.graph.increment_version([x for x in (q, k) if x is not None])


def _rope_inplace(n: "_Normalised", q, k, layout: str) -> None:
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))
    if not needs_grad:
        _run_inplace_op(_ops(n.backend)[1], n, q, k)
    elif k is None or not (q._is_view() or k._is_view()):
        _InplaceRope.apply(q, k, layout, n.backend, n.args)
    else:
        for x in (q, k):
            _InplaceRope.apply(x, None, layout, n.backend, n.args)


def _check_inplace(q, k, q4, k4) -> None:
    """In place, the twins rotate q and k through their own memory, each element once: a strided last dim (the
    normalised view would be a copy), an expanded tensor or q and k sharing memory would rotate some elements twice
    or none. torch.compile traces no memory addresses: there only k being q itself is caught here (an expanded tensor
    fails torch's own functionalisation)."""
    for name, x in (("q", q), ("k", k)):
        if x is None:
            continue
        if x.numel() and x.shape[-1] > 1 and x.stride(-1) != 1:
            raise ValueError(f"inplace=True needs {name} with stride 1 in its last dim")
        if not torch.compiler.is_compiling() and torch._debug_has_internal_overlap(x) == 1:
            raise ValueError(f"inplace=True needs {name} whose elements do not share memory (an expanded tensor?), "
                             "clone it")
    if k is not None and (k is q or (not torch.compiler.is_compiling() and _share_memory(q4, k4))):
        raise ValueError("inplace=True needs q and k in separate memory (not one tensor, nor overlapping views; the "
                         "check is conservative: views whose spans interleave within a head count as overlapping). "
                         "Rotate them out of place, or pass separate tensors")


def _share_memory(q4: torch.Tensor, k4: torch.Tensor) -> bool:
    """Whether the [B, S, H, D] views q4 and k4 (one dtype, one B and S) may share an element; True when unsure.
    Slices of one buffer (a fused qkv projection) share none though their spans interleave: with the same batch and
    token strides, and one token of both (their spans within a token, from the lower start) within a token stride,
    nested likewise in the batch stride, no token can meet another, and the spans within a token decide. Otherwise
    (views shifted by whole tokens, say) the spans of the whole views decide."""
    if not q4.numel() or not k4.numel():
        return False
    size = q4.element_size()

    def last(x, dims):  # the address of x's last element over dims (from its first)
        return x.data_ptr() + size * sum((x.shape[d] - 1) * x.stride(d) for d in dims)

    outer = sorted((d for d in (0, 1) if q4.shape[d] > 1), key=q4.stride)
    if all(q4.stride(d) == k4.stride(d) for d in outer):
        q_last, k_last = last(q4, (2, 3)), last(k4, (2, 3))
        window = max(q_last, k_last) + size - min(q4.data_ptr(), k4.data_ptr())  # the bytes one token of both spans
        for d in outer:
            if window > q4.stride(d) * size:
                break
            window += (q4.shape[d] - 1) * q4.stride(d) * size
        else:
            return q4.data_ptr() <= k_last and k4.data_ptr() <= q_last
    return q4.data_ptr() <= last(k4, range(4)) and k4.data_ptr() <= last(q4, range(4))


# ----------------------------------------------------------------------------------------------------------------------
# Argument normalisation: clear Python errors first, then [B, S, H, D] views and index tensors.


def _bshd(x: torch.Tensor, layout: str, name: str) -> torch.Tensor:
    expected = 3 if layout == "thd" else 4
    if x.dim() != expected:
        raise ValueError(f"{name} must have {expected} dims for layout {layout!r}, got shape {tuple(x.shape)}")
    return reference.to_bshd(x, layout)


def _from_bshd(x4: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "thd":
        return x4.squeeze(0)
    return x4.transpose(1, 2) if layout == "bhsd" else x4.transpose(0, 1) if layout == "sbhd" else x4


def _index_tensor(t, name: str, q: torch.Tensor) -> torch.Tensor:
    _checks.check_tensor(t, name)
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must have dtype int32 or int64, got {t.dtype}")
    _checks.check_same_device("q", q, **{name: t})
    return t


def _checks_values(t: torch.Tensor) -> bool:
    """Whether to validate an index tensor's values on the host: CPU tensors, outside torch.compile (which cannot
    trace a data-dependent check). Elsewhere they are trusted: no twin indexes memory with them unchecked (positions
    and offsets only give other angles, cache rows are clamped, cu_seqlens only steer a bounded binary search)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def _check_cpu_nonnegative(t: torch.Tensor, name: str) -> None:
    if _checks_values(t) and t.numel() and int(t.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got min {int(t.min())}")


def _cu_seqlens(cu_seqlens, total: int, q: torch.Tensor) -> torch.Tensor:
    cu = _index_tensor(cu_seqlens, "cu_seqlens", q)
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with n_seqs + 1 >= 2 entries, got shape {tuple(cu.shape)}")
    if _checks_values(cu):
        if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu.tolist()[:8]}...")
        if int(cu[-1]) != total:
            raise ValueError(f"cu_seqlens[-1] = {int(cu[-1])} does not match the total token count T = {total}")
    return cu.contiguous()


def _offsets_as_taken(off: torch.Tensor) -> bool:
    """Whether a seqlen_offsets tensor (of the right length) is already what the ops take."""
    return off.dtype == torch.int64 and off.dim() == 1 and off.is_contiguous()


def _offsets(seqlen_offsets, n: int, q: torch.Tensor) -> Optional[torch.Tensor]:
    if isinstance(seqlen_offsets, torch.Tensor):
        off = _index_tensor(seqlen_offsets, "seqlen_offsets", q)
        if off.dim() > 1 or (off.dim() == 1 and off.numel() != n):
            raise ValueError(f"seqlen_offsets must be an int or a [{n}] tensor, got shape {tuple(off.shape)}")
        _check_cpu_nonnegative(off, "seqlen_offsets")
        if _offsets_as_taken(off):
            return off  # the usual decode call: no conversion calls
        return off.to(torch.int64).expand(n).contiguous()
    if not isinstance(seqlen_offsets, int) or isinstance(seqlen_offsets, bool):
        raise TypeError(f"seqlen_offsets must be an int or an integer tensor, got {type(seqlen_offsets).__name__}")
    if seqlen_offsets < 0:
        raise ValueError(f"seqlen_offsets must be >= 0, got {seqlen_offsets}")
    if seqlen_offsets == 0:
        return None
    return torch.full((n,), seqlen_offsets, dtype=torch.int64, device=q.device)


def _positions(positions, batch: int, seqlen: int, thd: bool, q: torch.Tensor, mrope: bool) -> Optional[torch.Tensor]:
    if positions is None:
        if mrope:
            raise ValueError("mrope_section needs positions of shape [3, B, S] ([3, T] for layout 'thd')")
        return None
    pos = _index_tensor(positions, "positions", q)
    target = ((seqlen,) if thd else (batch, seqlen))
    if mrope:
        target = (3,) + target
        if pos.dim() != len(target) or pos.shape[0] != 3:
            raise ValueError(f"positions for M-RoPE must have shape {target} (rows temporal, height, width), got "
                             f"{tuple(positions.shape)}")
    try:
        pos = pos.expand(target)
    except RuntimeError:
        raise ValueError(f"positions of shape {tuple(positions.shape)} do not broadcast to {target}") from None
    return pos.unsqueeze(-2) if thd else pos


def _check_exact_positions(pos, seqlen_offsets, cu, batch: int, seqlen: int, thd: bool, mrope: bool) -> None:
    """Every absolute position (the given position, or the token's index in its sequence, plus the sequence's offset)
    must be within (-2^24, 2^24), where it converts to fp32 exactly; past that the angles, hence the rotation, are
    wrong. Checked wherever the values are known on the host (_checks_values), not assumed elsewhere. pos: as
    _positions returns it."""
    known = _checks_values(pos) if pos is not None else cu is None or _checks_values(cu)
    if not known or (pos is not None and not pos.numel()):
        low, high = 0, 0  # no positions known here: an int offset alone is checked
    elif pos is not None:
        low, high = map(int, torch.aminmax(pos))  # (not abs().max(): abs of the int64 minimum overflows)
    elif cu is not None:
        low, high = 0, int((cu[1:] - cu[:-1]).max()) - 1
    else:
        low, high = 0, seqlen - 1
    offset = seqlen_offsets
    if isinstance(seqlen_offsets, torch.Tensor):
        if not _checks_values(seqlen_offsets) or not seqlen_offsets.numel():
            return
        offset = int(seqlen_offsets.max())  # (offsets are >= 0)
    if -MAX_EXACT_POSITION < low and high + offset < MAX_EXACT_POSITION:
        return
    if known and isinstance(seqlen_offsets, torch.Tensor) and max(-low, high, offset) < 2**62:  # (no int64 overflow)
        # The largest offset may be another sequence's than the largest position's: the exact absolute positions.
        rows = list(pos) if mrope else [pos]  # (a "thd" row is [1, T])
        absolute = [reference.token_positions(batch, seqlen, None if row is None else row.reshape(-1) if thd else row,
                                              seqlen_offsets, cu) for row in rows]
        low, high, offset = min(int(a.min()) for a in absolute), max(int(a.max()) for a in absolute), 0
        if -MAX_EXACT_POSITION < low and high < MAX_EXACT_POSITION:
            return
    raise ValueError(f"positions plus seqlen_offsets must be within (-2^24, 2^24), where they are exact in fp32; got "
                     f"positions from {low} to {high}" + (f" and offsets up to {offset}" if offset else ""))


def _mrope_section(mrope_section, mrope_interleaved, rotary_dim: int) -> Optional[list[int]]:
    """The checked M-RoPE section as a list (None for plain RoPE)."""
    if mrope_section is None:
        if mrope_interleaved:
            raise ValueError("mrope_interleaved=True needs mrope_section")
        return None
    section = list(mrope_section)
    if (len(section) != 3 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in section)
            or sum(section) != rotary_dim // 2):
        raise ValueError(f"mrope_section must be 3 non-negative ints (temporal, height, width) summing to "
                         f"rotary_dim / 2 = {rotary_dim // 2}, got {mrope_section!r}")
    if mrope_interleaved and any(3 * (n - 1) + row >= rotary_dim // 2 for row, n in ((1, section[1]), (2, section[2]))
                                 if n):
        raise ValueError(f"mrope_section {section} does not fit interleaved in {rotary_dim // 2} frequencies: "
                         "height and width take every third one from 1 and 2")
    return section


class _Normalised(NamedTuple):
    q4: torch.Tensor
    k4: Optional[torch.Tensor]
    args: tuple  # the op arguments after q and k
    backend: str
    precision: str


def _normalise_rope(q, k, inv_freq, positions, seqlen_offsets, cu_seqlens, layout, interleaved, rotary_dim,
                    attention_scaling, precision, backend, mrope_section=None, mrope_interleaved=False) -> _Normalised:
    _checks.check_tensor(q, "q")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    resolved = _backend.resolve_backend(backend, q.device)
    precision = _backend.resolve_precision(precision)
    _checks.check_float(q, "q", resolved)
    q4 = _bshd(q, layout, "q")
    batch, seqlen, _, head_dim = q4.shape
    k4 = None
    if k is not None:
        _checks.check_tensor(k, "k")
        _checks.check_same_device("q", q, k=k)
        if k.dtype != q.dtype:
            raise TypeError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
        k4 = _bshd(k, layout, "k")
        if (k4.shape[0], k4.shape[1], k4.shape[3]) != (batch, seqlen, head_dim):
            raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)} in all but the head count")
    _checks.check_tensor(inv_freq, "inv_freq")
    _checks.check_same_device("q", q, inv_freq=inv_freq)
    if not inv_freq.is_floating_point() or inv_freq.dim() != 1:
        raise TypeError(f"inv_freq must be a 1-D float tensor, got {inv_freq.dtype} of shape {tuple(inv_freq.shape)}")
    if resolved != "reference" and inv_freq.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(f"inv_freq gets no gradient on backend {resolved!r}; detach it, or use "
                                  "backend='reference'")
    if rotary_dim is None:
        rotary_dim = 2 * inv_freq.numel()
    if not isinstance(rotary_dim, int) or rotary_dim % 2 or rotary_dim < 0:
        raise ValueError(f"rotary_dim must be a non-negative even int, got {rotary_dim!r}")
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} (2 * len(inv_freq) by default) exceeds head_dim {head_dim}")
    if rotary_dim > 2 * inv_freq.numel():
        raise ValueError(f"rotary_dim {rotary_dim} needs {rotary_dim // 2} frequencies, inv_freq has {inv_freq.numel()}")
    inv = inv_freq
    if inv.dtype != torch.float32 or inv.numel() != rotary_dim // 2 or not inv.is_contiguous():
        inv = inv_freq[: rotary_dim // 2].to(torch.float32).contiguous()
    if cu_seqlens is not None and layout != "thd":
        raise ValueError(f"cu_seqlens needs layout='thd', got layout={layout!r}")
    cu = _cu_seqlens(cu_seqlens, seqlen, q) if cu_seqlens is not None else None
    n_offsets = cu.numel() - 1 if cu is not None else batch
    offsets = _offsets(seqlen_offsets, n_offsets, q)
    section = _mrope_section(mrope_section, mrope_interleaved, rotary_dim)
    pos = _positions(positions, batch, seqlen, layout == "thd", q, section is not None)
    _check_exact_positions(pos, seqlen_offsets, cu, batch, seqlen, layout == "thd", section is not None)
    if not isinstance(attention_scaling, (int, float)):
        raise TypeError(f"attention_scaling must be a float, got {type(attention_scaling).__name__}")
    args = (inv, pos, offsets, cu, bool(interleaved), False, float(attention_scaling),
            _backend.precision_code(precision), section, bool(mrope_interleaved))
    return _Normalised(_stride1(q4), _stride1(k4), args, resolved, precision)


def _reference_rope(n: _Normalised, x4: torch.Tensor) -> torch.Tensor:
    """The eager path: fp32 math (fp64 for fp64), or HF's low-precision eager arithmetic for precision="bf16"."""
    inv, pos, offsets, cu = n.args[:4]
    section, mrope_interleaved = n.args[8:10]
    batch, seqlen = x4.shape[:2]

    def row_positions(row_pos):  # the absolute positions of one row of positions (plain RoPE: the only one)
        if cu is not None:
            return reference.token_positions(1, seqlen, None if row_pos is None else row_pos[0],
                                             0 if offsets is None else offsets, cu).view(1, seqlen)
        return reference.token_positions(batch, seqlen, row_pos, 0 if offsets is None else offsets)

    positions = row_positions(pos) if section is None else torch.stack([row_positions(row) for row in pos])
    low = n.precision == "bf16" and x4.dtype in (torch.float16, torch.bfloat16)
    compute = _backend.compute_dtype(x4.dtype)
    rows = None if section is None else reference.mrope_rows(inv.numel(), section, mrope_interleaved)
    cos, sin = reference.cos_sin(positions.to(x4.device), inv, n.args[6], compute, rows)
    cos, sin = (cos.to(x4.dtype), sin.to(x4.dtype)) if low else (cos, sin)
    out = reference.rotate(x4 if low else x4.to(compute), cos.unsqueeze(2), sin.unsqueeze(2), n.args[4])
    return out.to(x4.dtype)


# ----------------------------------------------------------------------------------------------------------------------
# The decode fast paths. At decode the host time of a call is its speed, and the general path above costs several
# times the op itself (argument normalisation, views, backend resolution). A fast path takes only the common call,
# checks what varies per call (tensor types, dims, shapes, dtypes, devices) with cheap attribute reads, and returns None
# for anything else: the general path then decides, and raises, as it always has. The Python-level arguments (backend,
# precision, layout, q's dtype and device) are only trusted once the general path has accepted the same values.

# (backend, precision, layout or unsqueeze_dim, q dtype, q device) -> (ops, code, backend, no-grad ops)
_ACCEPTED: dict = {}


def _accept(key: tuple, resolved: str, q: torch.Tensor, precision: str) -> None:
    """Remember that the general path accepted `key` and resolved it to `resolved` (_backend.fast_path_cacheable)."""
    if torch.compiler.is_compiling():
        return
    if _backend.fast_path_cacheable(resolved, q):
        _ACCEPTED[key] = (_ops(resolved), _backend.precision_code(precision), resolved, _no_grad_ops(resolved))


def _lookup(backend, precision, layout, q: torch.Tensor, device: torch.device) -> Optional[tuple]:
    try:
        return _ACCEPTED.get((backend, precision, layout, q.dtype, device))
    except TypeError:  # an unhashable backend, precision or layout: the general path names it
        return None


def _rope_fast(q, k, inv_freq, seqlen_offsets, layout, interleaved, rotary_dim, attention_scaling, precision,
               backend):
    """rope's result for a call with no positions, cu_seqlens, M-RoPE nor inplace, or None."""
    if not isinstance(q, torch.Tensor) or torch.compiler.is_compiling():  # compile traces the general path
        return None
    device = q.device
    accepted = _lookup(backend, precision, layout, q, device)
    if accepted is None or q.dim() != 4:
        return None
    q4 = q if layout == "bshd" else reference.to_bshd(q, layout)
    batch, seqlen, _, head_dim = q4.shape
    if k is not None:
        if not isinstance(k, torch.Tensor) or k.dim() != 4 or k.dtype != q.dtype or k.device != device:
            return None
        k4 = k if layout == "bshd" else reference.to_bshd(k, layout)
        k_batch, k_seqlen, _, k_head_dim = k4.shape
        if k_batch != batch or k_seqlen != seqlen or k_head_dim != head_dim:
            return None
        k4 = _stride1(k4)
    else:
        k4 = None
    if (not isinstance(inv_freq, torch.Tensor) or inv_freq.dtype != torch.float32 or inv_freq.dim() != 1
            or not inv_freq.is_contiguous() or inv_freq.device != device or inv_freq.requires_grad):
        return None
    rot = 2 * inv_freq.numel()
    if rot > head_dim or (rotary_dim is not None and (type(rotary_dim) is not int or rotary_dim != rot)):
        return None
    if seqlen > MAX_EXACT_POSITION:  # positions past 2^24: the general path raises
        return None
    if isinstance(seqlen_offsets, torch.Tensor):
        offsets = seqlen_offsets
        if not _offsets_as_taken(offsets) or offsets.numel() != batch or offsets.device != device:
            return None
        if q.is_cpu and batch:  # as _check_cpu_nonnegative and _check_exact_positions (one reduction for both)
            low, high = torch.aminmax(offsets)
            if int(low) < 0 or int(high) + seqlen > MAX_EXACT_POSITION:
                return None
    elif type(seqlen_offsets) is int and seqlen_offsets == 0:
        offsets = None
    else:
        return None
    if not isinstance(attention_scaling, (int, float)) or not q.numel():
        return None
    q4 = _stride1(q4)
    ops, code, _, no_grad_ops = accepted
    args = (q4, k4, inv_freq, None, offsets, None, bool(interleaved), False, float(attention_scaling), code, None,
            False)
    if torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)):
        outs = ops[0](*args)
    else:
        with torch._C._AutoDispatchBelowAutograd():  # as _backend.call_op (compile takes the general path)
            outs = no_grad_ops[0](*args)
    if layout != "bshd":
        outs = [_from_bshd(o, layout) for o in outs]
    return outs[0] if k is None else (outs[0], outs[1])


def _apply_rotary_pos_emb_fast(q, k, cos, sin, unsqueeze_dim, backend, precision):
    """apply_rotary_pos_emb's result for 4-D q and k of one dtype with [B or 1, S or 1, R] cos and sin of one dtype
    (HF's decode call), or None."""
    if (not isinstance(q, torch.Tensor) or type(unsqueeze_dim) is not int  # (not a bool, nor a float)
            or torch.compiler.is_compiling()):
        return None
    device = q.device
    accepted = _lookup(backend, precision, unsqueeze_dim, q, device)
    if (accepted is None or not isinstance(k, torch.Tensor) or not isinstance(cos, torch.Tensor)
            or not isinstance(sin, torch.Tensor)):
        return None
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or k.dtype != q.dtype or cos.dtype != sin.dtype:
        return None
    if not cos.is_floating_point() or (cos.dtype == torch.float64 and accepted[2] != "cpu"):
        return None
    if k.device != device or cos.device != device or sin.device != device:
        return None
    needs_grad = torch.is_grad_enabled()
    if needs_grad and (cos.requires_grad or sin.requires_grad):
        return None
    # unsqueeze_dim 1 (HF's [B, H, S, D]) or 2 ([B, S, H, D]): the head axis; [B, S, R] tables are then the kernel's
    # [B, S, R] views as they are, and [1, S, R] ones (HF's position_ids [1, S]) expanded: what _table_view gives.
    q4, k4 = (q.transpose(1, 2), k.transpose(1, 2)) if unsqueeze_dim == 1 else (q, k)
    batch, seqlen, _, head_dim = q4.shape
    k_batch, k_seqlen, _, _ = k4.shape
    shape = cos.shape
    table_batch, table_seqlen, rot = shape
    if (k_batch != batch or k_seqlen != seqlen or table_batch not in (1, batch) or table_seqlen not in (1, seqlen)
            or sin.shape != shape or rot % 2 or rot > head_dim or k4.shape[3] != head_dim or not q.numel()):
        return None
    if table_batch != batch or table_seqlen != seqlen:
        cos, sin = cos.expand(batch, seqlen, rot), sin.expand(batch, seqlen, rot)
    ops, code, _, no_grad_ops = accepted
    args = (_stride1(q4), _stride1(k4), cos, sin, False, False, code)
    if needs_grad and (q.requires_grad or k.requires_grad):
        q_out, k_out = ops[2](*args)
    else:
        with torch._C._AutoDispatchBelowAutograd():
            q_out, k_out = no_grad_ops[1](*args)
    return (q_out.transpose(1, 2), k_out.transpose(1, 2)) if unsqueeze_dim == 1 else (q_out, k_out)


# ----------------------------------------------------------------------------------------------------------------------
# Public functions.


def rope(q: torch.Tensor, k: Optional[torch.Tensor] = None, *, inv_freq: torch.Tensor,
         positions: Optional[torch.Tensor] = None, seqlen_offsets=0, cu_seqlens: Optional[torch.Tensor] = None,
         max_seqlen: Optional[int] = None, layout: str = "bshd", interleaved: bool = False,
         rotary_dim: Optional[int] = None, attention_scaling: float = 1.0, inplace: bool = False,
         precision: Optional[str] = None, backend: str = "auto", mrope_section: Optional[Sequence[int]] = None,
         mrope_interleaved: bool = False):
    """Rotary position embedding of q (and k) in one fused launch, the angle computed in the kernel.

    Args:
        q: [B, S, Hq, D] ("bshd"), [B, Hq, S, D] ("bhsd"), [S, B, Hq, D] ("sbhd") or [T, Hq, D] ("thd", packed
            varlen); any strides (no copy unless the last dim is strided). fp32/fp16/bf16 (fp64 on cpu/reference).
        k: None, or like q with its own head count Hk (GQA/MQA, Hk = 1 included), same dtype. Rotated in the same
            launch as q.
        inv_freq: [n] float tensor (HF's inv_freq, used as fp32), on q's device; rotary_dim defaults to 2n.
        positions: int32/int64, broadcastable to [B, S] ([T] for "thd"); default: token s of each sequence is at s.
        seqlen_offsets: int or int tensor [B] ([n_seqs] with cu_seqlens), added to every position (KV cache,
            context-parallel shards). Must be >= 0. Every position plus its offset must be within (-2^24, 2^24),
            where it is exact in fp32 (checked on CPU tensors in eager mode, trusted on CUDA and under torch.compile).
        cu_seqlens: int32/int64 [n_seqs + 1], "thd" only: cumulative sequence starts; positions restart at 0 in each
            sequence (0, non-decreasing, ending at T; checked on the CPU in eager mode, trusted on CUDA to avoid a
            sync and under torch.compile).
        max_seqlen: accepted for API compatibility and unused (the kernels run on a linear token grid).
        layout: "bshd" | "bhsd" | "sbhd" | "thd".
        interleaved: False = NeoX half style, pairs (x[i], x[i + R/2]); True = GPT-J style, pairs (x[2i], x[2i+1]).
        rotary_dim: R, even, <= D and <= 2n; dims past R are passed through bit-exactly.
        attention_scaling: multiplies cos and sin (HF's attention_scaling of yarn/longrope).
        inplace: rotate q and k in place (autograd-aware; returns the same tensors). q and k must not share memory.
        precision: "fp32" (math in fp32: the default build), "bf16" (HF eager low-precision arithmetic: cos/sin
            rounded to q's dtype, then every product and sum rounded to it), or None for the build default.
        backend: "auto" | "cuda" | "triton" | "cpu" | "reference".
        mrope_section: M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): (temporal, height, width) frequency counts summing to
            rotary_dim / 2, e.g. [16, 24, 24]; positions is then [3, B, S] ([3, T] for "thd"), one row each, and
            frequency i is turned by the position of its row. seqlen_offsets add to every row.
        mrope_interleaved: False: the rows own consecutive chunks of frequencies (Qwen2/2.5-VL: T..T H..H W..W);
            True: they alternate T H W T H W ... while height and width have frequencies left, then T (Qwen3-VL).
    Returns:
        The rotated q, or (q, k), in q's layout and dtype.

    The angle position * inv_freq[i] is computed in fp32 with an exact fma two-product and a three-piece 2*pi
    reduction (error < 1e-6 rad for positions up to 2^20), then an accurate sincos. No
    cos/sin cache is read. Backward: the same kernel with sin negated.
    """
    common_call = (positions is None and cu_seqlens is None and mrope_section is None and not mrope_interleaved
                   and not inplace)
    if common_call:
        outs = _rope_fast(q, k, inv_freq, seqlen_offsets, layout, interleaved, rotary_dim, attention_scaling,
                          precision, backend)
        if outs is not None:
            return outs
    n = _normalise_rope(q, k, inv_freq, positions, seqlen_offsets, cu_seqlens, layout, interleaved, rotary_dim,
                        attention_scaling, precision, backend, mrope_section, mrope_interleaved)
    if common_call and layout != "thd":
        _accept((backend, precision, layout, q.dtype, q.device), n.backend, q, n.precision)
    if inplace:
        _check_inplace(q, k, n.q4, n.k4)
    empty = n.q4.numel() == 0 and (n.k4 is None or n.k4.numel() == 0)
    if n.backend == "reference" or empty:
        outs = [_reference_rope(n, x4) if not empty else x4.clone() for x4 in (n.q4, n.k4) if x4 is not None]
        if inplace:
            for x4, out in zip((n.q4, n.k4), outs):
                x4.copy_(out)
            return q if k is None else (q, k)
    elif inplace:
        _rope_inplace(n, q, k, layout)
        return q if k is None else (q, k)
    else:
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))
        outs = _backend.call_op(_ops(n.backend)[0], needs_grad, n.q4, n.k4, *n.args)
    outs = [_from_bshd(o, layout) for o in outs]
    return outs[0] if k is None else (outs[0], outs[1])


def _table_view(table_u: torch.Tensor, x: torch.Tensor, rot: int, axis: int) -> torch.Tensor:
    """The [B', S', R] view of an unsqueezed cos/sin table (size 1 on x's head axis `axis`) broadcast over x's other
    axes, in the order of x.movedim(axis, 2)."""
    one_head = x.shape[:axis] + (1,) + x.shape[axis + 1:-1] + (rot,)
    return table_u.expand(one_head).select(axis, 0)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1,
                         *, backend: str = "auto", precision: Optional[str] = None, position_ids=None):
    """Drop-in for HF transformers' apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1), fused.

    Args:
        q, k: [B, H, S, D] with unsqueeze_dim=1 (HF's default), or [B, S, H, D] with unsqueeze_dim=2; k may have its
            own head count (not its own head_dim, as in HF). fp32/fp16/bf16 (fp64 on cpu/reference).
        cos, sin: HF's tables, e.g. [B, S, R] (any float dtype, broadcast views welcome); cos.unsqueeze(unsqueeze_dim)
            must broadcast to q[..., :R]. R < D is partial rotary (GPT-NeoX): dims past R pass through bit-exactly.
        precision: "fp32" reads cos/sin and computes in fp32; "bf16" reproduces HF's eager arithmetic in q's dtype
            bit for bit: cos/sin rounded to q's dtype, out = rnd(rnd(x1 c) - rnd(x2 s)) etc. (Where cos/sin are wider
            than q, HF would promote to fp32 and return fp32; we round cos/sin to q's dtype and keep q's dtype.)
            None: the build default.
        position_ids: accepted and ignored, as older HF versions did.
    Returns:
        (q_embed, k_embed) in q's and k's dtypes and layouts. cos/sin get no gradient (HF computes them under no_grad).
    """
    del position_ids
    outs = _apply_rotary_pos_emb_fast(q, k, cos, sin, unsqueeze_dim, backend, precision)
    if outs is not None:
        return outs
    _checks.check_tensor(q, "q")
    _checks.check_tensor(k, "k")
    for name, t in (("cos", cos), ("sin", sin)):
        _checks.check_tensor(t, name)
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a float tensor, got {t.dtype}")
    _checks.check_same_device("q", q, k=k, cos=cos, sin=sin)
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise NotImplementedError("apply_rotary_pos_emb does not differentiate cos/sin; detach them")
    resolved = _backend.resolve_backend(backend, q.device)
    resolved_precision = _backend.resolve_precision(precision)
    _checks.check_float(q, "q", resolved)
    _checks.check_float(k, "k", resolved)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D, got {tuple(q.shape)} and {tuple(k.shape)}")
    if k.shape[-1] != q.shape[-1]:  # as HF's, which rotates both with the same cos/sin
        raise ValueError(f"k's head_dim {k.shape[-1]} must equal q's {q.shape[-1]}")
    rot = cos.shape[-1]
    if rot % 2 or rot > q.shape[-1]:
        raise ValueError(f"cos/sin last dim (rotary_dim) must be even and <= head_dim {q.shape[-1]}, got {rot}")
    cos_u, sin_u = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    axis = unsqueeze_dim % cos_u.dim() + q.dim() - cos_u.dim()
    if not 0 <= axis <= 2:
        raise ValueError(f"unsqueeze_dim={unsqueeze_dim} does not select a head axis of q {tuple(q.shape)}")
    for name, x in (("q", q), ("k", k)):
        target = x.shape[:-1] + (rot,)
        if not _checks.broadcasts_to(cos_u.shape, target):
            raise ValueError(f"cos/sin {tuple(cos.shape)} unsqueezed at {unsqueeze_dim} do not broadcast to "
                             f"{name}[..., :{rot}] {tuple(target)}")
    q4, k4 = q.movedim(axis, 2), k.movedim(axis, 2)
    fused = q.dtype == k.dtype and q4.shape[:2] == k4.shape[:2]
    c3, s3 = (_table_view(t, q, rot, axis) for t in (cos_u, sin_u))
    kc3, ks3 = (c3, s3) if fused else (_table_view(t, k, rot, axis) for t in (cos_u, sin_u))
    if resolved not in ("cpu", "reference") and cos.dtype == torch.float64:  # the CUDA and Triton twins read fp32
        c3, s3, kc3, ks3 = (t.to(torch.float32) for t in (c3, s3, kc3, ks3))
    code = _backend.precision_code(resolved_precision)
    if unsqueeze_dim in (1, 2) and type(unsqueeze_dim) is int:
        _accept((backend, precision, unsqueeze_dim, q.dtype, q.device), resolved, q, resolved_precision)
    if q.numel() == 0 and k.numel() == 0:
        return q.clone(), k.clone()
    if resolved == "reference":
        results = [_reference_cos_sin(x4, c, s, resolved_precision) for x4, c, s in ((q4, c3, s3), (k4, kc3, ks3))]
    elif fused:
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
        results = _backend.call_op(_ops(resolved)[2], needs_grad, _stride1(q4), _stride1(k4), c3, s3, False, False,
                                   code)
    else:
        op = _ops(resolved)[2]
        results = [op(_stride1(x4), None, c, s, False, False, code)[0] for x4, c, s in ((q4, c3, s3), (k4, kc3, ks3))]
    return results[0].movedim(2, axis), results[1].movedim(2, axis)


def _reference_cos_sin(x4, cos, sin, precision):
    low = precision == "bf16" and x4.dtype in (torch.float16, torch.bfloat16)
    compute = x4.dtype if low else _backend.compute_dtype(x4.dtype)
    xc = x4.to(compute)
    return reference.hf_apply_rotary_pos_emb(xc, xc, cos.to(compute), sin.to(compute), unsqueeze_dim=2)[0].to(x4.dtype)
