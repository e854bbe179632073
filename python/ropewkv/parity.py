"""`python -m ropewkv parity`: every op x backend x dtype x precision against the fp64 oracle."""
from __future__ import annotations

import importlib
import sys

import torch

# Each module ropewkv.testing.<family> provides parity_rows(device) -> Iterable[Measurement].
FAMILIES = ("decay", "rope", "rwkv7")


def parity_rows(device: torch.device):
    for family in FAMILIES:
        yield from importlib.import_module(f"ropewkv.testing.{family}").parity_rows(device)


def format_table(rows) -> str:
    header = ("op", "backend", "dtype", "precision", "max ulp", "rms ratio", "tol ulp", "tol rms", "result")
    def bound(value):
        return "-" if value is None else f"{value:.3g}"

    # Ops judged by RMS alone (wkv7: each output mixes many inputs, so per-element ulps measure cancellation, not
    # the kernel) show no ulp figure.
    lines = [header] + [
        (m.op, m.backend, m.dtype, m.precision, "-" if m.tolerance.max_ulp is None else f"{m.max_ulp:.3g}",
         f"{m.rms:.3g}", bound(m.tolerance.max_ulp), bound(m.tolerance.rms), "pass" if m.passed else "FAIL")
        for m in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [" | ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in lines]
    text.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(text)


def main(device: str | None = None) -> int:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for row in parity_rows(dev):
        rows.append(row)
        if sys.stderr.isatty():  # progress on long runs, without littering logs
            print(f"  {row.op} [{row.backend}, {row.dtype}, {row.precision}]".ljust(79), file=sys.stderr, end="\r")
    print(f"parity on {dev} (errors against the fp64 eager reference)")
    print(format_table(rows))
    failed = [m for m in rows if not m.passed]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0
