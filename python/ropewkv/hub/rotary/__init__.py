"""A kernel-hub package (the `kernels` library's layout, loaded by LocalLayerRepository) whose `layers` module holds
ropewkv's replacement for HF transformers' `rotary_pos_emb` (apply_rotary_pos_emb). Relative imports only, so it loads
under whatever name `kernels` gives it; the layer itself calls the installed ropewkv."""
from . import layers
from .layers import ApplyRotaryPosEmb

__all__ = ["ApplyRotaryPosEmb", "layers"]
