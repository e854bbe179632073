"""The hub layer: stateless, as `kernels` requires (no __init__, no members beyond its two capability flags), with
the forward signature of HF's apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)."""
import inspect

import torch

# kernels' class for one function HF registered -> whether that function is HF's rotate_half RoPE (see _is_hf_rope).
_IS_HF_ROPE = {}


@torch.compiler.assume_constant_result  # under torch.compile: run while tracing, its answer a constant of the graph
def _is_hf_rope(function: torch.nn.Module) -> bool:
    """Whether `function`, one of the functions transformers registers as `rotary_pos_emb` (kernels wraps each in a
    module class of its own, whose class forward calls it), takes our arguments and computes HF's rotate_half RoPE.
    Not all of them do (GPT-OSS: half-width tables, both halves rotated), so each is probed once, in fp64, as
    ropewkv.patch.transformers probes what it replaces."""
    cls = type(function)
    if cls.forward is ApplyRotaryPosEmb.forward:  # the layer used as a module itself: no HF function to fall back to
        return True
    if cls not in _IS_HF_ROPE:
        from ropewkv.patch._hf import _probe

        def arguments(forward):
            return [(p.name, p.kind, p.default) for p in inspect.signature(forward).parameters.values()][1:]

        # kernels checks the signature for the first class it binds the layer to only; HF calls each positionally
        same_arguments = arguments(cls.forward) == arguments(ApplyRotaryPosEmb.forward)
        _IS_HF_ROPE[cls] = same_arguments and _probe(lambda *args: cls.forward(function, *args)) is None
    return _IS_HF_ROPE[cls]


class ApplyRotaryPosEmb(torch.nn.Module):
    """HF's apply_rotary_pos_emb fused by ropewkv: fp32 math on HF's cos/sin tables, q's and k's dtypes kept, one
    launch for q and k, backward included (see ropewkv.apply_rotary_pos_emb). kernelize() binds this forward to the
    function object HF registered (an instance attribute), so `self` is that object and its class's forward is HF's
    function, which runs instead wherever that function is not HF's rotate_half RoPE."""

    can_torch_compile = True  # an opaque custom op with a fake kernel: traced by torch.compile(fullgraph=True)
    has_backward = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        if not _is_hf_rope(self):
            return type(self).forward(self, q, k, cos, sin, unsqueeze_dim)
        from ropewkv.ops import rope  # the package that ships this layer; imported at call time, as HF calls it

        return rope.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
