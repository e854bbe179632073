"""The hub layer: stateless, as `kernels` requires (no __init__, no members beyond its two capability flags), with
the forward signature of HF's apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)."""
import torch


class ApplyRotaryPosEmb(torch.nn.Module):
    """HF's apply_rotary_pos_emb fused by ropewkv: fp32 math on HF's cos/sin tables, q's and k's dtypes kept, one
    launch for q and k, backward included (see ropewkv.apply_rotary_pos_emb). kernelize() binds this forward to the
    function object HF registered, so `self` is that object."""

    can_torch_compile = True  # an opaque custom op with a fake kernel: traced by torch.compile(fullgraph=True)
    has_backward = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        from ropewkv.ops import rope  # the package that ships this layer; imported at call time, as HF calls it

        return rope.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
