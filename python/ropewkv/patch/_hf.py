"""ropewkv.patch.transformers: swap the fused RoPE into HF transformers' modeling code.

How HF calls RoPE (transformers 5.x): the model's rotary module (`LlamaRotaryEmbedding`, `Qwen2VLRotaryEmbedding`, ...)
turns position_ids into cos/sin tables once per forward: `position_ids.float() * inv_freq` (an fp32 product whose
rounding grows with the position: 0.03 rad at 2^20), cos/sin cast to the model dtype (bf16: 2^-9). Every attention
forward then calls `apply_rotary_pos_emb(q, k, cos, sin)` by name, a global of its own modeling module (each model's
modeling_*.py holds its own copy; Mistral, Qwen2, ... do not import Llama's). `@use_kernel_forward_from_hub
("rotary_pos_emb")` on that function and `@use_kernelized_func(...)` on the attention class are identities unless a
`kernels` version that transformers accepts is installed; with it, the function becomes a module object that a later,
explicit `kernelize()` may re-point (ropewkv.hub ships a layer for that), and the forward still looks the global up
at call time. So rebinding the module global is what makes the model call ours.

The precision promise needs the tables too: by default the rotary modules' `forward` is replaced (class attribute)
by one that returns fp32 tables of exact angles (position * inv_freq in fp64, where the product of a position below
2^24 and an fp32 inv_freq is exact; cos/sin rounded once to fp32), keeping HF's dynamic_rope_update (dynamic NTK,
longrope) and attention_scaling. So the fused op rounds once, to q's dtype: 0.5 ulp at any position.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Optional, Union

import torch

from .. import _backend
from ..reference import rope as reference
from ..reference.rope import hf_apply_rotary_pos_emb
from . import _hf_qk_norm
from ._handle import PatchHandle

# Architectures whose apply_rotary_pos_emb is HF's q*cos + rotate_half(q)*sin (full or, for gpt_neox/phi3,
# partial rotary). Every candidate is also probed before it is patched.
DEFAULT_MODELS = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
                  "granite", "olmo", "olmo2", "phi3", "gpt_neox", "starcoder2", "stablelm", "qwen2_vl", "qwen2_5_vl",
                  "qwen3_vl")
FUNCTION = "apply_rotary_pos_emb"
# The modules whose rotary tables may be swapped for exact fp32 ones: those of DEFAULT_MODELS, each checked to hand its
# tables to apply_rotary_pos_emb alone (tests/test_patch_transformers.py scans their sources). Elsewhere another
# function may read the same tables in the model's dtype (Youtu's MLA rotates with apply_rotary_pos_emb_interleave,
# which fp32 tables turn into an fp32 key beside a bf16 value: attention raises). An allowlist, not a scan of each
# module for other consumers: a scan can only guess at what reads cos/sin, and a wrong guess is a silent error.
EXACT_TABLE_MODULES = frozenset(f"transformers.models.{model}.modeling_{model}" for model in DEFAULT_MODELS)
ROTARY_SUFFIX = "RotaryEmbedding"
# The table layouts a rotary module may compose: plain RoPE, or M-RoPE from [3, B, S] positions in chunked
# (Qwen2/2.5-VL) or interleaved (Qwen3-VL) sections.
PLAIN, MROPE_CHUNKED, MROPE_INTERLEAVED = "plain", "mrope", "mrope interleaved"


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


def _hf_replacement(precision: Optional[str], backend: str, upcast: bool = False):
    """ropewkv's apply_rotary_pos_emb with these settings. upcast: rotate q and k in the wider of their dtype and the
    tables' and round the result once to their dtype, as OLMo's function does (see _computes_in_table_dtype)."""
    from ..ops import rope as rope_ops

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        # Looked up at call time so that ops-level instrumentation (and tests counting calls) sees every call.
        if not upcast:
            return rope_ops.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, precision=precision,
                                                  backend=backend)
        wide = torch.promote_types(q.dtype, cos.dtype)
        q_embed, k_embed = rope_ops.apply_rotary_pos_emb(q.to(wide), k.to(wide), cos, sin, unsqueeze_dim,
                                                         precision=precision, backend=backend)
        return q_embed.to(q.dtype), k_embed.to(k.dtype)

    apply_rotary_pos_emb.__doc__ = (f"ropewkv's fused apply_rotary_pos_emb (precision={precision!r}, "
                                    f"backend={backend!r}, upcast={upcast}).")
    apply_rotary_pos_emb._ropewkv = True
    return apply_rotary_pos_emb


def _computes_in_table_dtype(function) -> bool:
    """True if `function`, given bf16 q, k and fp32 tables, returns HF's formula computed in fp32 and rounded once to
    bf16, bit for bit (what _hf_replacement(upcast=True) computes): OLMo's and OLMo2's, whose rotary modules return
    fp32 tables in a bf16 model. HF's Llama-style function returns fp32 there (its tables are in the model's dtype)."""
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 16, 8, generator=generator).to(torch.bfloat16) for _ in range(2))
    angle = torch.rand(1, 16, 4, generator=generator) * 16
    cos, sin = torch.cat((angle.cos(), angle.cos()), -1), torch.cat((angle.sin(), angle.sin()), -1)
    try:
        got = function(q, k, cos, sin)
    except Exception:  # _probe accepted it in fp64; failing on mixed dtypes, it does not compute in fp32 either
        return False
    want = hf_apply_rotary_pos_emb(q.float(), k.float(), cos, sin)
    return all(g.dtype == torch.bfloat16 and torch.equal(g, w.to(torch.bfloat16)) for g, w in zip(got, want))


def exact_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, layout: str,
                  mrope_section=None, dtype: torch.dtype = torch.float32):
    """HF's (cos, sin) tables [B, S, 2n] (n = len(inv_freq), the two halves equal) of the exact angles
    position * inv_freq, times attention_scaling, rounded once to `dtype`. M-RoPE layouts take position_ids [3, B, S]
    (or [B, S], broadcast to the three rows, as HF does) and give frequency i the position of its section's row."""
    rows = None
    if layout != PLAIN:
        position_ids = position_ids.expand(3, *position_ids.shape[-2:])
        rows = reference.mrope_rows(inv_freq.numel(), mrope_section, layout == MROPE_INTERLEAVED)
    # fp64: the product of an integer position (< 2^24 here, 24 bits) and an fp32 inv_freq is exact.
    cos, sin = reference.cos_sin(position_ids, inv_freq, attention_scaling, torch.float64, rows)
    return torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype)


def _exact_rotary_forward(layout: str):
    """A rotary module forward(x, position_ids) returning exact fp32 tables (fp64 for an fp64 model), under HF's own
    dynamic_rope_update: dynamic NTK regrows inv_freq with the current length and longrope switches factors exactly
    as in HF's forward, and attention_scaling (yarn, longrope) multiplies cos and sin."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x, position_ids):
        return exact_cos_sin(position_ids, self.inv_freq, self.attention_scaling, layout,
                             getattr(self, "mrope_section", None), torch.promote_types(x.dtype, torch.float32))

    forward._ropewkv = True
    return forward


def _probe_rotary(cls) -> tuple[Optional[str], Optional[str]]:
    """(layout, None) if the rotary module class builds HF's tables of one of our layouts, else (None, why not). Runs
    the class's own forward on a bare instance (4 frequencies, M-RoPE section [2, 1, 1], default rope type) at
    positions below 16, where HF's fp32 angle errs by < 1e-6 rad, against exact_cos_sin."""
    probe = cls.__new__(cls)
    torch.nn.Module.__init__(probe)
    probe.inv_freq, probe.attention_scaling = reference.default_inv_freq(8), 1.0
    probe.rope_type, probe.mrope_section = "default", [2, 1, 1]
    x = torch.zeros(1)
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 16, (3, 1, 6), generator=generator)

    def matches(got, layout, position_ids) -> bool:
        want = exact_cos_sin(position_ids, probe.inv_freq, 1.0, layout, probe.mrope_section)
        return (isinstance(got, tuple) and len(got) == 2 and all(g.shape == w.shape for g, w in zip(got, want))
                and all(torch.allclose(g.double(), w.double(), rtol=0, atol=1e-5) for g, w in zip(got, want)))

    try:
        if not matches(cls.forward(probe, x, positions[0]), PLAIN, positions[0]):
            return None, "builds tables other than HF's cat(cos, cos) of position * inv_freq"
    except Exception as error:  # an unfamiliar signature or state is a reason to skip, not to fail
        return None, f"probe call failed: {type(error).__name__}: {error}"
    try:
        three_rows = cls.forward(probe, x, positions)
    except Exception:  # a plain rotary module need not take [3, B, S] positions
        return PLAIN, None
    for layout in (MROPE_CHUNKED, MROPE_INTERLEAVED):
        if matches(three_rows, layout, positions):
            return layout, None
    return PLAIN, None


def _patch_rotary_modules(module: types.ModuleType, handle: PatchHandle) -> None:
    """Replace the forward of every rotary module class defined in `module` whose tables the probe recognises, if
    `module` is one of EXACT_TABLE_MODULES."""
    for name, cls in list(vars(module).items()):
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module) and name.endswith(ROTARY_SUFFIX)
                and cls.__module__ == module.__name__):
            continue
        if module.__name__ in EXACT_TABLE_MODULES:
            layout, why = _probe_rotary(cls)
        else:
            layout, why = None, ("HF's tables kept: not an architecture verified to read them with "
                                 f"{FUNCTION} alone (see EXACT_TABLE_MODULES)")
        if layout is None:
            handle.skipped[f"{module.__name__}.{name}"] = why
        else:
            handle._replace(cls, "forward", _exact_rotary_forward(layout))


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
                 rwkv7: bool = True, precision: Optional[str] = None, *, qk_norm: bool = True,
                 backend: str = "auto") -> PatchHandle:
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
            computes something else (e.g. interleaved RoPE) are skipped and listed in handle.skipped. At precision
            "fp32", the rotary module classes (`*RotaryEmbedding`) of every DEFAULT_MODELS module so patched are
            swapped too, for exact fp32 tables (plain RoPE, and M-RoPE: Qwen2-VL / Qwen2.5-VL sections, Qwen3-VL
            interleaved), each probed against HF's own forward first; unrecognised ones, and those of other
            architectures (whose tables may have other readers, see EXACT_TABLE_MODULES), are listed in
            handle.skipped. Whatever another active handle patched is left to it (listed in handle.skipped).
        rwkv7: swap HF's RWKV-7 time-mix kernel, if the installed transformers has an RWKV-7 model. transformers
            5.24 has none (only RWKV v4): then nothing is patched and handle.skipped says so.
        precision: None (the build default, "fp32") or "fp32": exact angles end to end: fp32 tables of exact angles
            from the swapped rotary modules, fp32 math, one rounding to q's dtype (0.5 ulp in a bf16 model, at any
            position). "bf16": HF's own tables and HF's eager arithmetic, bit for bit: in the model's dtype, or, where
            the module's function computes in its fp32 tables' dtype and rounds once (OLMo, OLMo2; found by a probe),
            as it does. Not bit for bit with qk_norm=True in Qwen3 / Qwen3-MoE: the fused q/k RMSNorm sums its
            statistics in another order (a few fp32 ulps of HF, which a bf16 rounding can carry to one bf16 ulp).
        qk_norm: with rope, also fuse q_norm / k_norm with RoPE in Qwen3 / Qwen3-MoE attention (ropewkv.qk_norm_rope;
            one pass over q and k instead of three). False: those models call the swapped apply_rotary_pos_emb.
        backend: passed to every call ("auto": cuda, then triton, for CUDA tensors; cpu for CPU tensors).
    Returns:
        a PatchHandle (undo(), or use it as a context manager). Autograd, KV-cache generate() and
        torch.compile(fullgraph=True) keep working: the replacement is a custom op with autograd and a fake kernel.
    """
    handle = PatchHandle()
    if rope and qk_norm:
        _hf_qk_norm.patch_qk_norm(model_or_module, handle, precision, backend)  # Qwen3: q/k norm + RoPE fused
    if rope:
        exact_tables = _backend.resolve_precision(precision) == "fp32"
        replacements = {upcast: _hf_replacement(precision, backend, upcast) for upcast in (False, True)}
        for module in _candidate_modules(model_or_module, handle):
            function = getattr(module, FUNCTION, None)
            if function is None:
                handle.skipped[module.__name__] = f"has no {FUNCTION}"
                continue
            if handle._taken(module, FUNCTION):  # its rotary modules are that handle's too
                continue
            why = _probe(function)
            if why is not None:  # its rotary modules stay HF's too: fp32 tables would make HF's eager math fp32
                handle.skipped[f"{module.__name__}.{FUNCTION}"] = why
                continue
            # HF's tables and arithmetic: where HF computes in its fp32 tables' dtype (OLMo), so do we
            upcast = not exact_tables and _computes_in_table_dtype(function)
            handle._replace(module, FUNCTION, replacements[upcast])
            if exact_tables:
                _patch_rotary_modules(module, handle)
    if rwkv7:
        import transformers as hf

        if importlib.util.find_spec("transformers.models.rwkv7") is None:
            handle.skipped["rwkv7"] = f"transformers {hf.__version__} has no RWKV-7 model (only RWKV v4): nothing to patch"
        else:
            handle.skipped["rwkv7"] = "transformers.models.rwkv7 exists but its layout is not yet known to ropewkv"
    return handle
