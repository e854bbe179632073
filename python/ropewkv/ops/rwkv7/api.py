"""wkv7: argument validation shared by every WKV7 entry point, and the public call (see ropewkv.reference.rwkv7 for
the exact spec).

The public functions validate and normalise the arguments identically for every backend, then dispatch to an
algorithm's twins (recurrent.py: the C++ ops and the Triton kernel). None has an autocast kernel: under autocast the
inputs reach the kernel untouched and the decay is computed in fp32 inside it, always.
"""
from __future__ import annotations

from typing import Optional

import torch

from ... import _backend, _checks
from ...reference import rwkv7 as reference
from . import chunked, recurrent

DECAYS = reference.DECAYS
HEAD_SIZES = (32, 64, 128, 256)
# The CUDA sequential twin stops at 128 (see _check_inputs); 256 runs on the triton and cpu twins.
CUDA_HEAD_SIZES = (32, 64, 128)
_NAMES = ("r", "w", "k", "v", "a", "b")
ALGORITHMS = ("auto", "sequential", "chunked")


# ---- validation --------------------------------------------------------------------------------------------------

def _check_inputs(tensors, dims: int, layout: str, backend: str) -> str:
    """r..b: tensors of one shape and device; r, k, v, a, b of one dtype, w of any float dtype the backend takes (an
    fp32 decay beside bf16 r..b is how autocast runs). Returns the resolved backend."""
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
        if name != "w" and x.dtype != r.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but r has {r.dtype}; r, k, v, a, b must share a dtype "
                            "(only w, the decay input, may have its own, e.g. fp32 under autocast)")
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


# algorithm="auto" on the cpu twin: the chunked form from this many tokens per sequence (the mean, with cu_seqlens).
# Measured fwd+bwd on one core at B1 H4 N64 (two runs): 1.3-1.4x the sequential form at T = 8, 1.9-2.1x at 16,
# 3.3-4.4x at 4096, but 0.73-0.76x at T = 1, since a sequence's first chunk always runs as 16 rows
# (benchmarks/NOTES.md, "CPU twin: chunks aligned to each sequence's end").
CPU_CHUNKED_FROM_TOKENS = 8


def _resolve_algorithm(algorithm, backend: str, tokens_per_sequence: float) -> str:
    """The algorithm for `algorithm`: every backend runs both. "auto" is "chunked" on the cpu twin from
    CPU_CHUNKED_FROM_TOKENS tokens per sequence, else "sequential". The cpu twin's chunked form is as exact in its
    own way as the sequential one: a non-finite input reaches exactly the outputs it reaches sequentially, and left
    padding or the tokens packed before a sequence change nothing bit for bit (its chunks are aligned to each
    sequence's end); the two forms agree to fp32 rounding, so a padded batch and an unpadded row are bitwise equal
    when both take the same form (one of them shorter than CPU_CHUNKED_FROM_TOKENS: name the algorithm). On GPUs
    "auto" stays sequential: the Triton and CUDA chunked kernels are untimed there in their current form."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if algorithm == "auto":
        return "chunked" if backend == "cpu" and tokens_per_sequence >= CPU_CHUNKED_FROM_TOKENS else "sequential"
    return algorithm


def _check_decay(decay) -> int:
    if decay not in DECAYS:
        raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
    return DECAYS.index(decay)


def _check_state(state, name: str, shape: tuple, r: torch.Tensor, broadcast: bool = False) -> None:
    """broadcast: a state of batch size 1 may stand for every sequence (rwkv-ops' [1, H, N, N])."""
    _checks.check_tensor(state, name)
    if tuple(state.shape) != shape and not (broadcast and tuple(state.shape) == (1, *shape[1:])):
        also = f" or [1, {', '.join(map(str, shape[1:]))}] (broadcast)" if broadcast and shape[0] != 1 else ""
        raise ValueError(f"{name} must have shape {list(shape)}{also} ([n_seqs or B, H, N, N], S[v][k] layout), "
                         f"got {list(state.shape)}")
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


def _check_mask(mask, r: torch.Tensor) -> None:
    _checks.check_tensor(mask, "mask")
    if tuple(mask.shape) != tuple(r.shape[:2]):
        raise ValueError(f"mask must have shape [B, T] = {list(r.shape[:2])} (0 freezes the state at that token), "
                         f"got {list(mask.shape)}")
    if mask.dtype.is_complex:
        raise TypeError(f"mask must be bool, integer or float (nonzero = the token updates the state), got "
                        f"{mask.dtype}")
    _checks.check_same_device("r", r, mask=mask)


# w that makes the decay exactly 1, per convention: exp(-exp(-inf)), exp(-e^-0.5 sigmoid(-inf)), exp(0).
_NO_DECAY = {"loglog": float("-inf"), "raw": float("-inf"), "log": 0.0}


def _freeze_masked_steps(mask: torch.Tensor, w, k, v, a, b, decay: str):
    """w, k, v, a, b with every masked token (mask == 0) made an exact no-op of the state: decay 1 and no update
    (S_t = S_{t-1} * 1 + (S_{t-1} 0) 0^T + 0 0^T = S_{t-1}, bit for bit, in every twin). v and a are zeroed too, so
    that an inf or NaN in a padding slot cannot enter through inf * 0. Gradients stay exact: the masked tokens' w, k,
    v, a and b get zero gradient, and the state's cotangent passes through unchanged."""
    keep = (mask != 0)[:, :, None, None]
    return torch.where(keep, w, _NO_DECAY[decay]), *(torch.where(keep, x, 0.0) for x in (k, v, a, b))


def _decay_read_as_is(w: torch.Tensor, r: torch.Tensor) -> bool:
    """Whether the twins read w as it is: in r's dtype or fp32."""
    return w.dtype in (r.dtype, torch.float32)


def _decay_input(w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """w as the twins read it: any float w not in r's dtype nor fp32 is widened to fp32, exactly for fp16 and bf16
    (the math is fp32, so a wider w would be rounded to fp32 on load anyway)."""
    return w if _decay_read_as_is(w, r) else w.float()


# ---- public API --------------------------------------------------------------------------------------------------

def wkv7(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
         initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
         cu_seqlens: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None, decay: str = "loglog",
         precision: Optional[str] = None, backend: str = "auto", algorithm: str = "auto"):
    """The RWKV-7 WKV recurrence: S_t = S_{t-1} (diag(d_t) + a_t b_t^T) + v_t k_t^T, y_t = S_t r_t (scale 1).

    Args:
        r, w, k, v, a, b: [B, T, H, N]; r, k, v, a, b of one dtype: fp32, fp16 or bf16 (fp64 on the cpu and
            reference backends, for gradcheck). w, the decay input, may have its own float dtype and is read at its
            own precision: keep it fp32 beside bf16 r..b (autocast), as a bf16 decay would lose the precision that
            decays within 1e-3 of 1 need (FLA #181). N in HEAD_SIZES. Any T. Non-contiguous inputs are copied.
        initial_state: None (zeros) or [B, H, N, N] (with cu_seqlens: [n_seqs, H, N, N]) fp32 (fp64 for fp64
            inputs), in the RWKV-LM layout S[v][k] (FLA's [N, H, K, V] is the transpose). A state of batch size 1,
            [1, H, N, N], is broadcast to every sequence (as in rwkv-ops); its gradient sums over them.
        output_final_state: return the final state (else None).
        cu_seqlens: None, or int32/int64 [n_seqs + 1] offsets of packed sequences (B must be 1), non-decreasing from
            0 to T; each sequence starts from its own initial_state[n].
        mask: None, or [B, T] (bool, integer or float): where 0, the token leaves the state exactly as it was
            (left padding in batched inference, as rwkv-ops' mask), and y there reads that unchanged state
            (rwkv-ops reads the update it then discards; both are padding output), even if its w, k, v, a or b
            is inf or NaN. Gradients are exact: masked tokens' w, k, v, a, b get zero gradient. Costs five
            elementwise passes over w, k, v, a, b.
        decay: the convention of w: "loglog" d = exp(-exp(w)) (RWKV-LM), "raw" d = exp(-e^{-0.5} sigmoid(w)) (the
            LoRA pre-activation, fused; RWKV-LM clampw), "log" d = exp(w) (FLA, HF). Computed in fp32 in the kernel.
        precision: None (the build default), "fp32" (all arithmetic fp32), or "bf16" (RWKV-LM's bf16 mode: I/O
            values pass through bf16 rounding, inputs (w too, whatever its dtype, as RWKV-LM's bf16 kernels take a
            bf16 w) on load and y and input gradients on store, while the state,
            decay, sa and every sum stay fp32, because d can be within 1e-3 of 1 and S accumulates over thousands of
            steps). Ignored by fp64 inputs and by the reference backend.
        backend: "auto" | "cuda" | "triton" | "cpu" | "reference".
        algorithm: "auto" | "sequential" | "chunked". "sequential" steps the state token by token; "chunked" runs
            16-token chunks as matrix products (ops/rwkv7/chunked.md), the same result to fp32 rounding, on the cpu,
            triton and cuda backends (cuda: a chunked forward and backward, their products on tensor cores in
            precision="bf16", fp32 FMAs in precision="fp32"). "auto" is "chunked" on the cpu backend
            from 8 tokens per sequence (1.3-4x faster there), else "sequential" (see _resolve_algorithm). The
            reference backend is the fp64 oracle whatever the algorithm.
    Returns:
        (y [B, T, H, N] in r's dtype, final_state fp32 [B or n_seqs, H, N, N] S[v][k] or None).
    Differentiable w.r.t. r, w, k, v, a, b and initial_state, with the cotangent of final_state included; w's
    gradient comes in w's dtype.
    """
    resolved = _check_inputs((r, w, k, v, a, b), 4, "[B, T, H, N]", backend)
    decay_code = _check_decay(decay)
    precision = _backend.resolve_precision(precision)
    n_seqs = _check_cu_seqlens(cu_seqlens, r)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()  # the Triton twins read it through its data pointer as dense
    algorithm = _resolve_algorithm(algorithm, resolved, r.shape[0] * r.shape[1] / max(n_seqs, 1))
    _, _, heads, n = r.shape
    if initial_state is not None:
        _check_state(initial_state, "initial_state", (n_seqs, heads, n, n), r, broadcast=True)
        initial_state = initial_state.expand(n_seqs, heads, n, n).contiguous()
    w = _decay_input(w, r)
    if mask is not None:
        _check_mask(mask, r)
        w, k, v, a, b = _freeze_masked_steps(mask, w, k, v, a, b, decay)
    tensors = tuple(x.contiguous() for x in (r, w, k, v, a, b))
    y, final_state = _run(tensors, initial_state, bool(output_final_state), cu_seqlens, decay, decay_code, precision,
                          resolved, algorithm)
    if cu_seqlens is not None and torch.compiler.is_compiling():
        y, final_state = _poisoned_unless_valid(cu_seqlens, r.shape[1], y, final_state)
    return y, final_state


def _run(tensors, initial_state, output_final_state: bool, cu_seqlens, decay: str, decay_code: int, precision: str,
         backend: str, algorithm: str):
    """(y, final state or None) of the checked, contiguous r..b from the backend and algorithm wkv7 resolved."""
    if backend == "reference":
        y, final_state = reference.wkv7(*tensors, initial_state=initial_state, output_final_state=output_final_state,
                                        cu_seqlens=cu_seqlens, decay=decay,
                                        dtype=_backend.compute_dtype(tensors[0].dtype))
        return y.to(tensors[0].dtype), final_state
    if algorithm == "chunked":
        if backend == "triton":
            return chunked.wkv7_chunked_triton(*tensors, initial_state, output_final_state, cu_seqlens, decay,
                                               precision)
        return chunked.wkv7_chunked_cpp(*tensors, initial_state, output_final_state, cu_seqlens, decay_code,
                                        precision)
    if backend == "triton":
        return recurrent.wkv7_triton(*tensors, initial_state, output_final_state, cu_seqlens, decay, precision)
    save = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (*tensors, initial_state))
    y, final_state, _ = torch.ops.ropewkv.wkv7_forward(*tensors, initial_state, cu_seqlens, decay_code,
                                                      _backend.precision_code(precision), save)
    return y, (final_state if output_final_state else None)


def _poisoned_unless_valid(cu_seqlens: torch.Tensor, tokens: int, y, final_state):
    """Under torch.compile cu_seqlens' values go unchecked (the check needs a host sync). The kernels clamp malformed
    offsets, so nothing is read or written out of bounds, but tokens outside every sequence would be left unwritten
    and overlapping sequences would race: instead, y and the final state become NaN, on the device. (The backward's
    gradients are not poisoned: the loss is NaN already, and a pass over them would cost every valid call.)"""
    valid = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == tokens) & (cu_seqlens[1:] >= cu_seqlens[:-1]).all()
    nan = torch.tensor(float("nan"), device=y.device)
    return torch.where(valid, y, nan.to(y.dtype)), (None if final_state is None else
                                                    torch.where(valid, final_state, nan))
