"""ropewkv.patch.fla: route flash-linear-attention's RWKV-7 ops to ropewkv.compat.fla (FLA 0.6.0's signatures and
conventions: log decay, state [N, H, K, V]; ours also have a backward for the two fused forms)."""
from __future__ import annotations

import importlib
import sys
import types
from typing import Optional

from ._handle import PatchHandle

FUNCTIONS = ("chunk_rwkv7", "fused_recurrent_rwkv7", "fused_mul_recurrent_rwkv7")
# Where FLA defines the ops and re-exports them (fla/ops/rwkv7/__init__.py imports from .chunk and .fused_recurrent;
# RWKV7Attention trains with chunk_rwkv7 and infers with fused_mul_recurrent_rwkv7 below 64 tokens).
FLA_MODULES = ("fla.ops.rwkv7", "fla.ops.rwkv7.chunk", "fla.ops.rwkv7.fused_recurrent")


def fla(module: Optional[types.ModuleType] = None) -> PatchHandle:
    """Make FLA users call ropewkv.compat.fla's chunk_rwkv7 / fused_recurrent_rwkv7 / fused_mul_recurrent_rwkv7.

    Args:
        module: None: rebind the three names in FLA's own modules (fla.ops.rwkv7 and the files defining them) and in
            every already-imported module that holds FLA's original functions under those names (e.g. fla.layers.rwkv7,
            which did `from fla.ops.rwkv7 import chunk_rwkv7, fused_mul_recurrent_rwkv7`). Modules imported after the
            patch that import from fla.ops.rwkv7 get ours, and keep them after undo (they copied the name while it was
            ours; undo restores what the patch rebound). Raises ModuleNotFoundError if fla is not installed.
            A module: rebind those names in that module only (FLA itself need not be installed).
    Returns:
        a PatchHandle (undo(), or use it as a context manager). Names another active handle patched are left to it
        and listed in handle.skipped.
    """
    from ..compat import fla as compat

    handle = PatchHandle()
    if module is not None:
        targets = [module]
        originals = {name: getattr(module, name) for name in FUNCTIONS if hasattr(module, name)}
    else:
        ops = importlib.import_module("fla.ops.rwkv7")
        originals = {name: getattr(ops, name) for name in FUNCTIONS}
        targets = [importlib.import_module(name) for name in FLA_MODULES]
        # vars(), not getattr: a lazy module's __getattr__ could import things.
        # Once patched, FLA's names hold ours: compat itself is then a holder, but not a target.
        targets += [m for m in list(sys.modules.values()) if isinstance(m, types.ModuleType) and m not in targets
                    and m is not compat and any(vars(m).get(f) is originals[f] for f in FUNCTIONS)]
    for target in targets:
        for name, original in originals.items():
            if vars(target).get(name) is original and not handle._taken(target, name, getattr(compat, name)):
                handle._replace(target, name, getattr(compat, name))
    if not handle.patched and not handle.skipped:
        handle.skipped[getattr(module, "__name__", "fla")] = f"holds none of {FUNCTIONS}"
    return handle
