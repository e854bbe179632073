"""RoPE inside real HF transformers models: what attention handed RoPE and what came back, judged against the exact
rotation in fp64 (for the tests and the demo)."""
from __future__ import annotations

import contextlib
import sys

import torch

from ..patch._handle import PatchHandle
from ..patch._hf import FUNCTION, PLAIN, ROTARY_SUFFIX, MROPE_INTERLEAVED, _probe_rotary
from ..reference import rope as reference
from .rope import rotation_ulp_error


@contextlib.contextmanager
def recorded_rotations(model: torch.nn.Module):
    """Yields a list that collects (q, k, q_rotated, k_rotated), detached, for every apply_rotary_pos_emb call of
    `model`'s modeling modules (HF's function or ropewkv's, whichever is bound), in call order."""
    calls, handle = [], PatchHandle()
    modules = {sys.modules[type(m).__module__] for m in model.modules()}
    for module in sorted((m for m in modules if hasattr(m, FUNCTION)), key=lambda m: m.__name__):
        def recording(q, k, cos, sin, unsqueeze_dim=1, _apply=getattr(module, FUNCTION)):
            q_rot, k_rot = _apply(q, k, cos, sin, unsqueeze_dim)
            calls.append(tuple(t.detach() for t in (q, k, q_rot, k_rot)))
            return q_rot, k_rot

        handle._replace(module, FUNCTION, recording)
    try:
        yield calls
    finally:
        handle.undo()


def text_rotary(model: torch.nn.Module) -> torch.nn.Module:
    """The model's (text) rotary module: the first `*RotaryEmbedding` holding inv_freq that is not a vision one."""
    return next(m for m in model.modules() if type(m).__name__.endswith(ROTARY_SUFFIX) and hasattr(m, "inv_freq")
                and "Vision" not in type(m).__name__)


def model_rotation_error(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> float:
    """Run model(input_ids, position_ids) and return the max error, in ulps of q's dtype at each pair's norm, of every
    q and k that came out of RoPE, against the exact fp64 rotation of what went in: angle position * inv_freq (M-RoPE:
    the position of the frequency's row) with the rotary module's inv_freq and attention_scaling after the call (so
    dynamic NTK's regrown frequencies count), q and k as [B, H, S, D] (HF's unsqueeze_dim=1)."""
    rotary = text_rotary(model)
    layout, why = _probe_rotary(type(rotary))
    if layout is None:
        raise ValueError(f"{type(rotary).__name__}: {why}")
    mrope = {} if layout == PLAIN else dict(mrope_section=rotary.mrope_section,
                                            mrope_interleaved=layout == MROPE_INTERLEAVED)
    with torch.no_grad(), recorded_rotations(model) as calls:
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    if not calls:
        raise AssertionError("the model made no apply_rotary_pos_emb call")
    inv_freq, scaling = rotary.inv_freq.float().cpu(), float(rotary.attention_scaling)
    positions = position_ids.cpu()
    if mrope and positions.dim() == 2:
        positions = positions.expand(3, *positions.shape)
    errors = []
    for call in calls:
        for x, x_rot in ((call[0], call[2]), (call[1], call[3])):
            exact = reference.rope(x.double().cpu(), inv_freq, positions, layout="bhsd", attention_scaling=scaling,
                                   **mrope)
            errors.append(rotation_ulp_error(x_rot, exact, 2 * inv_freq.numel(), False))
    return max(errors)
