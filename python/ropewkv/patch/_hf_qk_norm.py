"""Swap ropewkv.qk_norm_rope into HF transformers' Qwen3 / Qwen3-MoE attention: q_norm, k_norm and RoPE in one pass.

HF's Qwen3Attention.forward projects q and k, applies q_norm / k_norm (Qwen3RMSNorm per head) and then
apply_rotary_pos_emb with the rotary module's cos/sin. The patched forward does the same with one fused call on the
[B, S, H, D] projections (views, no copy), reading the norms' own weights and eps and HF's cos/sin; the rest (KV cache
update, the configured attention function, o_proj) is HF's unchanged interface. The swap is class-level (every model
of the class in the process, until undo), and each class is first probed in fp64 against its own forward.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import Optional

import torch

from ._handle import PatchHandle

# modeling module -> attention class whose forward has Qwen3's q_norm/k_norm-then-RoPE structure
ATTENTION_CLASSES = {
    "transformers.models.qwen3.modeling_qwen3": "Qwen3Attention",
    "transformers.models.qwen3_moe.modeling_qwen3_moe": "Qwen3MoeAttention",
}


def _fused_forward(precision: Optional[str], backend: str):
    from ..ops import qk_norm_rope as ops

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, past_key_values=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        # transformers 5.24 renamed the KV cache argument past_key_values -> cache; earlier versions pass the old name
        cache = cache if cache is not None else past_key_values
        batch_seq = hidden_states.shape[:-1]
        heads = (*batch_seq, -1, self.head_dim)
        cos, sin = position_embeddings
        q, k = ops.qk_norm_rope(self.q_proj(hidden_states).view(heads), self.k_proj(hidden_states).view(heads),
                                self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon, cos=cos,
                                sin=sin, precision=precision, backend=backend)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(hidden_states).view(heads).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        eager = sys.modules[type(self).__module__].eager_attention_forward
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
        out, weights = attention(self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                                 scaling=self.scaling, sliding_window=self.sliding_window, **kwargs)
        return self.o_proj(out.reshape(*batch_seq, -1).contiguous()), weights

    forward._ropewkv = True
    return forward


def _probe(cls, module: types.ModuleType, forward) -> Optional[str]:
    """None if `forward` reproduces the class's own forward on a tiny random fp64 layer (eager attention, GQA, a
    trained-looking norm weight), else why not."""
    try:
        config_cls = getattr(module, cls.__name__.replace("Attention", "Config"), None) or \
            getattr(importlib.import_module(module.__name__.replace("modeling_", "configuration_")),
                    cls.__name__.replace("Attention", "Config"))
        config = config_cls(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_hidden_layers=1, intermediate_size=32, vocab_size=16)
        config._attn_implementation = "eager"
        generator = torch.Generator().manual_seed(0)
        layer = cls(config, 0).double()
        with torch.no_grad():
            for norm in (layer.q_norm, layer.k_norm):
                norm.weight.copy_(1 + 0.3 * torch.randn(norm.weight.shape, generator=generator, dtype=torch.float64))
        x = torch.randn(1, 5, 32, generator=generator, dtype=torch.float64)
        angle = torch.arange(5, dtype=torch.float64)[:, None] * torch.rand(4, generator=generator, dtype=torch.float64)
        cos, sin = (torch.cat((t, t), -1)[None] for t in (angle.cos(), angle.sin()))
        mask = torch.full((5, 5), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        from transformers.cache_utils import DynamicCache

        caches = DynamicCache(), DynamicCache()  # passed positionally: the argument's name changed in 5.24
        with torch.no_grad():
            want = layer(x, (cos, sin), mask, caches[0])[0]
            got = forward(layer, x, (cos, sin), mask, caches[1])[0]
    except Exception as error:  # an incompatible class is a reason to skip, not to fail
        return f"probe failed: {type(error).__name__}: {error}"
    # HF's Qwen3RMSNorm computes in fp32 even for fp64 input: fp32 agreement (a different structure is off by O(1))
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())):
        return "its forward computes something other than Qwen3's q_norm/k_norm-then-RoPE attention"
    if caches[1].get_seq_length() != caches[0].get_seq_length():
        return "its forward passes the KV cache in a way the fused forward does not update"
    return None


def _targets(model_or_module, handle: PatchHandle) -> list:
    """(module, class) pairs to patch."""
    if isinstance(model_or_module, torch.nn.Module):
        names = {type(m).__module__ for m in model_or_module.modules()}
    elif isinstance(model_or_module, types.ModuleType):
        names = {model_or_module.__name__}
    else:
        names = set(ATTENTION_CLASSES)
    targets = []
    for name in sorted(names & set(ATTENTION_CLASSES)):
        try:
            module = sys.modules.get(name) or importlib.import_module(name)
        except Exception as error:  # optional dependencies of one architecture must not stop the others
            handle.skipped[name] = f"not importable: {error}"
            continue
        targets.append((module, getattr(module, ATTENTION_CLASSES[name])))
    return targets


def patch_qk_norm(model_or_module, handle: PatchHandle, precision: Optional[str], backend: str) -> None:
    """Swap the fused forward into the Qwen3-family attention classes that `model_or_module` selects (None: all of
    ATTENTION_CLASSES); records what it patched or skipped in `handle`."""
    forward = _fused_forward(precision, backend)
    for module, cls in _targets(model_or_module, handle):
        if handle._taken(cls, "forward"):  # another handle's fused forward, with its own precision and backend
            continue
        why = _probe(cls, module, _fused_forward("fp32", "auto"))  # structure only, on the CPU in fp64
        if why is None:
            handle._replace(cls, "forward", forward)
        else:
            handle.skipped[f"{module.__name__}.{cls.__name__}.forward"] = why
