"""`python -m ropewkv parity`: every op x backend x dtype x precision against the fp64 oracle."""
from __future__ import annotations

import importlib
import sys

import torch

from ._backend import best_device
from .testing import MEASUREMENT_COLUMNS

# Each module ropewkv.testing.<family> provides parity_rows(device) -> Iterable[Measurement].
FAMILIES = ("decay", "rope", "qk_norm_rope", "rwkv7")


def parity_rows(device: torch.device):
    for family in FAMILIES:
        yield from importlib.import_module(f"ropewkv.testing.{family}").parity_rows(device)


def format_table(rows) -> str:
    lines = [MEASUREMENT_COLUMNS] + [m.cells() for m in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(MEASUREMENT_COLUMNS))]
    text = [" | ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in lines]
    text.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(text)


def main(device: str | None = None) -> int:
    dev = best_device(device)
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
