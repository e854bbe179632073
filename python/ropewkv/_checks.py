"""Argument checks shared by the public ops: clear Python exceptions that name the argument, before any kernel."""
from __future__ import annotations

import torch

IO_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_float(x, name: str, backend: str) -> None:
    """fp32/fp16/bf16 for every twin; fp64 too for the cpu and reference twins (gradcheck runs there)."""
    check_tensor(x, name)
    allowed = IO_DTYPES + ((torch.float64,) if backend in ("cpu", "reference") else ())
    if x.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} must have dtype {names} for backend {backend!r}, got {x.dtype}")


def check_same_device(reference_name: str, reference: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t is not None and t.device != reference.device:
            raise ValueError(f"{name} is on {t.device} but {reference_name} is on {reference.device}")


def broadcasts_to(shape, target) -> bool:
    """Whether a tensor of `shape` broadcasts to exactly `target` (what torch.broadcast_shapes(shape, target) ==
    target says, ~20x faster: it runs on every call)."""
    return len(shape) <= len(target) and all(s == t or s == 1 for s, t in zip(reversed(shape), reversed(target)))
