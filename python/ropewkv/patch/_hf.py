"""ropewkv.patch.transformers: swap the fused RoPE into HF transformers' modeling code.

How HF calls RoPE (transformers 5.x): every attention forward calls `apply_rotary_pos_emb(q, k, cos, sin)` by name,
a global of its own modeling module (each model's modeling_*.py holds its own copy; Mistral, Qwen2, ... do not import
Llama's). `@use_kernel_forward_from_hub("rotary_pos_emb")` on that function and `@use_kernelized_func(...)` on the
attention class are identities unless the `kernels` package is installed; with it, they only register the function
for a later, explicit `kernels.kernelize(model)`, and the forward still looks the global up at call time. So
rebinding the module global is what makes the model call ours; a `kernelize()` run afterwards may override it.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Optional, Union

import torch

from ..reference.rope import hf_apply_rotary_pos_emb
from . import _hf_qk_norm
from ._handle import PatchHandle

# Architectures whose apply_rotary_pos_emb is HF's q*cos + rotate_half(q)*sin (full or, for gpt_neox/phi3,
# partial rotary). Every candidate is also probed before it is patched.
DEFAULT_MODELS = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
                  "granite", "olmo", "olmo2", "phi3", "gpt_neox", "starcoder2", "stablelm")
FUNCTION = "apply_rotary_pos_emb"


def _probe(function) -> Optional[str]:
    """None if `function` computes HF's NeoX-style rotation (checked in fp64 on random inputs), else why not."""
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 3, 8, dtype=torch.float64, generator=generator) for _ in range(2))
    cos, sin = (torch.randn(1, 3, 8, dtype=torch.float64, generator=generator) for _ in range(2))
    try:
        got = function(q, k, cos, sin)
    except Exception as error:  # an incompatible signature is a reason to skip, not to fail
        return f"probe call failed: {type(error).__name__}: {error}"
    want = hf_apply_rotary_pos_emb(q, k, cos, sin)
    # Same formula in fp64: only summation order could differ, a few fp64 ulps.
    if not (isinstance(got, tuple) and len(got) == 2
            and all(torch.allclose(g, w, rtol=1e-12, atol=1e-12) for g, w in zip(got, want))):
        return "computes something other than HF's rotate_half RoPE"
    return None


def _hf_replacement(precision: Optional[str], backend: str):
    from ..ops import rope as rope_ops

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        # Looked up at call time so that ops-level instrumentation (and tests counting calls) sees every call.
        return rope_ops.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, precision=precision,
                                              backend=backend)

    apply_rotary_pos_emb.__doc__ = f"ropewkv's fused apply_rotary_pos_emb (precision={precision!r}, backend={backend!r})."
    apply_rotary_pos_emb._ropewkv = True
    return apply_rotary_pos_emb


def _candidate_modules(model_or_module, handle: PatchHandle) -> list[types.ModuleType]:
    if isinstance(model_or_module, types.ModuleType):
        return [model_or_module]
    if isinstance(model_or_module, torch.nn.Module):
        names = {type(m).__module__ for m in model_or_module.modules()}
        return [sys.modules[n] for n in sorted(names) if hasattr(sys.modules.get(n), FUNCTION)]
    if model_or_module is not None:
        raise TypeError(f"model_or_module must be None, an nn.Module or a module, got {type(model_or_module)}")
    modules = {}
    for model in DEFAULT_MODELS:
        name = f"transformers.models.{model}.modeling_{model}"
        try:
            modules[name] = importlib.import_module(name)
        except Exception as error:  # optional dependencies of one architecture must not stop the others
            handle.skipped[name] = f"not importable: {error}"
    # "Friends" the user already imported (e.g. a model not in the default list) are covered too.
    for name, module in list(sys.modules.items()):
        if name.startswith("transformers.models.") and ".modeling_" in name and hasattr(module, FUNCTION):
            modules.setdefault(name, module)
    return list(modules.values())


def transformers(model_or_module: Union[None, torch.nn.Module, types.ModuleType] = None, rope: bool = True,
                 rwkv7: bool = True, precision: Optional[str] = None, *, backend: str = "auto") -> PatchHandle:
    """Make HF transformers models call ropewkv's fused RoPE.

    Args:
        model_or_module:
            None: patch every default architecture's modeling module (DEFAULT_MODELS) plus every HF modeling module
              already imported, process-wide.
            an nn.Module (e.g. a LlamaForCausalLM): patch the modeling modules its submodules' classes come from.
              This is still module-level: HF's attention looks the function up as a module global, so every other
              model of the same architectures in the process is patched too, until undo.
            a Python module: patch that module's `apply_rotary_pos_emb`.
        rope: swap `apply_rotary_pos_emb` for ropewkv.apply_rotary_pos_emb (same signature and semantics, partial
            rotary included). Each candidate is first probed in fp64 against HF's formula; modules whose function
            computes something else (e.g. interleaved or multimodal RoPE) are skipped and listed in handle.skipped.
        rwkv7: swap HF's RWKV-7 time-mix kernel, if the installed transformers has an RWKV-7 model. transformers
            5.23 has none (only RWKV v4): then nothing is patched and handle.skipped says so.
        precision: passed to every call. None (build default, fp32): read HF's cos/sin, compute in fp32, return q's
            dtype. "bf16": reproduce HF's eager arithmetic in the model's dtype bit for bit.
        backend: passed to every call ("auto": cuda, then triton, for CUDA tensors; cpu for CPU tensors).
    Returns:
        a PatchHandle (undo(), or use it as a context manager). Autograd, KV-cache generate() and
        torch.compile(fullgraph=True) keep working: the replacement is a custom op with autograd and a fake kernel.
    """
    handle = PatchHandle()
    if rope:
        _hf_qk_norm.patch_qk_norm(model_or_module, handle, precision, backend)  # Qwen3: q/k norm + RoPE fused
        replacement = _hf_replacement(precision, backend)
        for module in _candidate_modules(model_or_module, handle):
            function = getattr(module, FUNCTION, None)
            if function is None:
                handle.skipped[module.__name__] = f"has no {FUNCTION}"
                continue
            why = _probe(function)
            if why is None:
                handle._replace(module, FUNCTION, replacement)
            else:
                handle.skipped[f"{module.__name__}.{FUNCTION}"] = why
    if rwkv7:
        import transformers as hf

        if importlib.util.find_spec("transformers.models.rwkv7") is None:
            handle.skipped["rwkv7"] = f"transformers {hf.__version__} has no RWKV-7 model (only RWKV v4): nothing to patch"
        else:
            handle.skipped["rwkv7"] = "transformers.models.rwkv7 exists but its layout is not yet known to ropewkv"
    return handle
