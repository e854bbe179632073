"""Which twin runs an op: extension loading, backend and precision resolution, output poisoning.

Backends:
  "cuda"      the CUDA twin (`ropewkv._C_cuda`), CUDA tensors only;
  "triton"    the Triton twin, CUDA tensors, or CPU tensors under TRITON_INTERPRET=1;
  "cpu"       the C++ CPU twin (`ropewkv._C`), CPU tensors only;
  "reference" the eager PyTorch reference, any device (fp32 math, or fp64 for fp64 input);
  "auto"      cuda, then triton, for CUDA tensors; cpu for CPU tensors.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Optional

import torch

MIN_TORCH = (2, 7)  # custom_op annotations, list[Tensor] returns, increment_version of a list; README, setup.py
if tuple(int(part) for part in torch.__version__.split(".")[:2]) < MIN_TORCH:
    raise ImportError(f"ropewkv needs torch >= {'.'.join(map(str, MIN_TORCH))}, found torch {torch.__version__}")

BACKENDS = ("auto", "cuda", "triton", "cpu", "reference")
PRECISIONS = ("fp32", "bf16")


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here; the message says why."""


def _try_import(name: str):
    try:
        return importlib.import_module(name), None
    except ImportError as error:  # kept to explain later why a backend is missing
        return None, error


_C, _C_error = _try_import("ropewkv._C")
if torch.version.cuda is None:
    _C_cuda, _C_cuda_error = None, (f"the installed torch is a {'ROCm' if torch.version.hip else 'CPU'} build "
                                    f"(torch.version.cuda is None), so ropewkv._C_cuda was not built")
else:
    _C_cuda, _C_cuda_error = _try_import("ropewkv._C_cuda")


def build_precision() -> str:
    """The build-default precision ("fp32" unless built with ROPEWKV_ACCUM=bf16)."""
    return _C.build_precision if _C is not None else "fp32"


def resolve_precision(precision: Optional[str]) -> str:
    """None means the build default; otherwise "fp32" or "bf16"."""
    if precision is None:
        return build_precision()
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} or None (the build default), got {precision!r}")
    return precision


def precision_code(precision: str) -> int:
    """The integer the C++ ops take (ropewkv::Precision)."""
    return PRECISIONS.index(precision)


# Looked up once, at import: find_spec is not traceable by dynamo (torch 2.11), and the ops resolve under compile.
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def _no_cuda_device() -> Optional[str]:
    """Why no CUDA tensor can exist here, or None. Tensors imply their device; a device named (the CLI's --device,
    available_backends) does not."""
    if torch.cuda.is_available():
        return None
    return f"torch {torch.__version__} sees no CUDA device (torch.version.cuda={torch.version.cuda})"


def triton_interprets() -> bool:
    """TRITON_INTERPRET as Triton reads it (triton.knobs.runtime.interpret: 1, true, on, yes, y, any case), in Python:
    torch.compile traces this check, and not Triton's C++ reader."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes", "y")


def _triton_unavailable_reason(device: torch.device) -> Optional[str]:
    if not _TRITON_INSTALLED:
        return "triton is not installed"
    if device.type == "cuda":
        return _no_cuda_device()
    if device.type == "cpu":
        if triton_interprets():
            return None
        return "Triton runs CPU tensors only under TRITON_INTERPRET=1 (set before ropewkv is imported)"
    return f"Triton does not run on {device.type} tensors"


def unavailable_reason(backend: str, device: torch.device) -> Optional[str]:
    """None if `backend` can run tensors on `device`, else why not."""
    if backend == "reference":
        return None
    if backend == "cpu":
        if device.type != "cpu":
            return f"the cpu backend needs CPU tensors, got {device.type}"
        return None if _C is not None else f"ropewkv._C failed to import: {_C_error}"
    if backend == "cuda":
        if device.type != "cuda":
            return f"the cuda backend needs CUDA tensors, got {device.type}"
        return _no_cuda_device() if _C_cuda is not None else f"ropewkv._C_cuda is unavailable: {_C_cuda_error}"
    if backend == "triton":
        return _triton_unavailable_reason(device)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


# (backend, device type) -> the concrete backend: what decides it cannot change after import, except TRITON_INTERPRET
# for Triton on CPU tensors (tests toggle it), which is resolved on every call. Failures are not cached.
_resolved: dict = {}


def resolve_backend(backend: str, device: torch.device) -> str:
    """Turn `backend` (possibly "auto") into a concrete backend for `device`, or raise BackendUnavailableError."""
    key = (backend, device.type)
    resolved = _resolved.get(key) if isinstance(backend, str) else None
    if resolved is None:
        resolved = _resolve_backend(backend, device)
        if key != ("triton", "cpu"):
            _resolved[key] = resolved
    return resolved


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda":
            candidates = ("cuda", "triton")
        elif device.type == "cpu":
            candidates = ("cpu",)
        else:
            candidates = ()
        for candidate in candidates:
            if unavailable_reason(candidate, device) is None:
                return candidate
        reasons = "; ".join(f"{c}: {unavailable_reason(c, device)}" for c in candidates) or "no twin for this device"
        raise BackendUnavailableError(f"no backend available for {device.type} tensors ({reasons}); "
                                      "pass backend='reference' for the eager PyTorch path")
    reason = unavailable_reason(backend, device)
    if reason is not None:
        raise BackendUnavailableError(f"backend={backend!r} is unavailable: {reason}")
    return backend


def fast_path_cacheable(resolved: str, t: torch.Tensor) -> bool:
    """Whether a decode fast path may remember that calls with tensors like `t` resolve to `resolved`: kernel twins
    only, and Triton on CPU tensors never (that depends on TRITON_INTERPRET, which tests toggle, so it is resolved on
    every call; tests/test_host_fast_path.py lifts this to run the Triton fast paths in the interpreter)."""
    return resolved != "reference" and (t.is_cuda or (t.is_cpu and resolved != "triton"))


def call_op(op, needs_grad: bool, *args):
    """op(*args); when no gradient can flow, below the Autograd key. torch.library's Python autograd kernel would only
    redispatch there, after a C++ -> Python -> C++ round trip that costs several µs per call: at decode the host is the
    speed. Under torch.compile the op is traced as it is."""
    if needs_grad or torch.compiler.is_compiling():
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def refuse_double_backward(backward_op: str, what: str) -> None:
    """Make differentiating through backward_op raise. Without an autograd formula the C++ twins' double backward
    returned zeros (PyTorch only warns) and the Triton twins' raised PyTorch's generic error."""
    def double_backward(ctx, *grads):
        raise NotImplementedError(f"{what} has no double backward (second derivatives); use backend='reference' "
                                  "for them")

    torch.library.register_autograd(backward_op, double_backward)


def best_device(name: Optional[str] = None) -> torch.device:
    """The device named, or the best one present: CUDA if available, else the CPU."""
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def available_backends(device: torch.device) -> list[str]:
    """The concrete backends that can run on `device`, kernels first and "reference" last."""
    return [b for b in ("cuda", "triton", "cpu", "reference") if unavailable_reason(b, device) is None]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype every twin computes in, and wkv7's state dtype: fp64 for fp64 input (gradcheck), else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def poison_outputs() -> bool:
    """Tests set ROPEWKV_POISON_OUTPUTS=1: every twin then fills new outputs with NaN before its kernel runs."""
    return os.environ.get("ROPEWKV_POISON_OUTPUTS") == "1"


def new_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a kernel output (NaN-filled when poisoning is on, so unwritten elements show)."""
    if poison_outputs():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def new_output_like(t: torch.Tensor) -> torch.Tensor:
    """A kernel output like t, with t's strides when t is dense (so transposed layouts stay views); poisoned alike."""
    out = torch.empty_like(t)
    return out.fill_(float("nan")) if poison_outputs() else out
