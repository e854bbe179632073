"""Parity harness: error metrics against an fp64 oracle, tolerances, poisoned outputs, running every backend.

Metrics:
  - max_ulp_error: max |out - ref| in ulps of out's dtype, the ulp taken at |ref| (floored at 2^-12 of max |ref|, so
    that outputs that cancel to ~0 are judged on the scale of the tensor rather than on their own tiny ulp);
  - rms_ratio: ||out - ref|| / ||ref||, in fp64.
NaN in out (where ref has none) counts as an infinite error, so unwritten, poisoned elements always fail.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from .._backend import available_backends

MANTISSA_BITS = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
DTYPE_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
FLOOR_RELATIVE = 2.0**-12


def ulp(dtype: torch.dtype, magnitude: torch.Tensor) -> torch.Tensor:
    """The spacing of `dtype` numbers at |magnitude| (fp64 tensor), never below the spacing at its smallest normal."""
    magnitude = magnitude.abs().clamp_min(torch.finfo(dtype).tiny)
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2^exponent, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(magnitude), exponent - 1 - MANTISSA_BITS[dtype])


def _error(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    out64, ref64 = out.detach().to(torch.float64).cpu(), ref.detach().to(torch.float64).cpu()
    if out64.shape != ref64.shape:
        raise AssertionError(f"shape {tuple(out64.shape)} != reference shape {tuple(ref64.shape)}")
    err = (out64 - ref64).abs()
    # A NaN or inf where the reference is finite is an infinite error; matching non-finite values are exact.
    same_nonfinite = ~torch.isfinite(ref64) & ((out64 == ref64) | (out64.isnan() & ref64.isnan()))
    err = torch.where(same_nonfinite, torch.zeros_like(err), err)
    return torch.where(err.isnan(), torch.full_like(err, float("inf")), err)


def max_ulp_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.numel() == 0:
        return 0.0
    ref64 = ref.detach().to(torch.float64).cpu()
    finite = ref64[torch.isfinite(ref64)]
    floor = finite.abs().max() * FLOOR_RELATIVE if finite.numel() else torch.tensor(0.0, dtype=torch.float64)
    scale = torch.maximum(ref64.abs().nan_to_num(0.0, 0.0, 0.0), floor)
    return float((_error(out, ref) / ulp(out.dtype, scale)).max())


def rms_ratio(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.numel() == 0:
        return 0.0
    ref_norm = float(torch.linalg.vector_norm(ref.detach().to(torch.float64).cpu().nan_to_num(0.0, 0.0, 0.0)))
    err_norm = float(torch.linalg.vector_norm(_error(out, ref)))
    return err_norm / ref_norm if ref_norm > 0 else err_norm


@dataclass(frozen=True)
class Tolerance:
    """Bounds on the two metrics (None: not bounded) and the reason they are what they are."""

    max_ulp: Optional[float]
    rms: Optional[float]
    why: str

    def bounds(self) -> str:
        """The bounds that apply, e.g. "ulp<=6, rms<=2e-07" (recurrences and models are bounded by RMS only)."""
        parts = [f"ulp<={self.max_ulp:.3g}"] if self.max_ulp is not None else []
        return ", ".join(parts + ([f"rms<={self.rms:.3g}"] if self.rms is not None else []))


# The columns of Measurement.cells(), for the parity table and the demo report.
MEASUREMENT_COLUMNS = ("op", "backend", "dtype", "precision", "max ulp", "rms ratio", "bounds", "result")


@dataclass
class Measurement:
    op: str
    backend: str
    dtype: str
    precision: str
    max_ulp: float
    rms: float
    tolerance: Tolerance

    @property
    def passed(self) -> bool:
        ulp_ok = self.tolerance.max_ulp is None or self.max_ulp <= self.tolerance.max_ulp
        rms_ok = self.tolerance.rms is None or self.rms <= self.tolerance.rms
        return ulp_ok and rms_ok

    def describe(self) -> str:
        return (f"{self.op} [{self.backend}, {self.dtype}, precision={self.precision}]: max {self.max_ulp:.3g} ulp, "
                f"rms ratio {self.rms:.3g} (bounds {self.tolerance.bounds()}: {self.tolerance.why})")

    def cells(self) -> tuple:
        """This row of a results table (MEASUREMENT_COLUMNS). Ops bounded by RMS alone (wkv7: each output mixes many
        inputs, so per-element ulps measure cancellation, not the kernel) show no ulp figure."""
        ulps = "-" if self.tolerance.max_ulp is None else f"{self.max_ulp:.3g}"
        return (self.op, self.backend, self.dtype, self.precision, ulps, f"{self.rms:.3g}", self.tolerance.bounds(),
                "pass" if self.passed else "FAIL")


def measure(op: str, backend: str, precision: str, out: torch.Tensor, ref: torch.Tensor,
            tolerance: Tolerance, dtype: Optional[torch.dtype] = None) -> Measurement:
    """Compare `out` with the fp64 `ref`; the dtype column defaults to out's dtype."""
    return Measurement(op, backend, DTYPE_NAMES[dtype or out.dtype], precision, max_ulp_error(out, ref),
                       rms_ratio(out, ref), tolerance)


def assert_within(m: Measurement) -> None:
    assert m.passed, m.describe()


@contextlib.contextmanager
def environment_variable(name: str, value: str):
    """The environment variable `name` set to `value` inside the block, restored (or unset again) after it."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


def poisoned_outputs():
    """Every twin fills the outputs it allocates with NaN before its kernel writes them (ROPEWKV_POISON_OUTPUTS)."""
    return environment_variable("ROPEWKV_POISON_OUTPUTS", "1")


def run_backends(call: Callable[[str], object], device: torch.device,
                 backends: Optional[Iterable[str]] = None) -> dict:
    """Run call(backend) for every available kernel backend on `device` (the eager "reference" backend excluded;
    the fp64 oracle is computed separately), with poisoned outputs. Returns {backend: result}."""
    chosen = [b for b in (backends or available_backends(device)) if b != "reference"]
    with poisoned_outputs():
        return {backend: call(backend) for backend in chosen}


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
