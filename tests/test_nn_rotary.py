"""ropewkv.nn.RotaryEmbedding inside a model that is cast: its frequencies stay fp32 (a bf16 inv_freq is off by up to
2^-9 of each frequency, whole radians of angle at position 4000), while a device move still moves them; and its
dynamic NTK regrowth bit-equal to HF's module."""
import pytest
import torch

import ropewkv
from ropewkv.testing import seeded

SCALINGS = {
    "default": None,
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32,
                 "original_max_position_embeddings": 2048},
}


def rotary(scaling):
    return ropewkv.nn.RotaryEmbedding(64, 10000.0, SCALINGS[scaling], max_position_embeddings=4096)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("cast", ["to(bfloat16)", "half()"])
def test_module_casts_keep_the_frequencies_fp32(scaling, cast):
    q = torch.randn(1, 64, 4, 64, generator=seeded(1)).bfloat16()
    k = torch.randn(1, 64, 2, 64, generator=seeded(2)).bfloat16()
    positions = (4000 + torch.arange(64))[None]  # past max_position_embeddings for dynamic and longrope's switch
    want = rotary(scaling)(q, k, positions=positions)
    module = rotary(scaling)
    model = torch.nn.Sequential(module)  # cast as part of a model, as model.to(...) reaches it
    model.to(torch.bfloat16) if cast == "to(bfloat16)" else model.half()
    assert module.inv_freq.dtype == module.original_inv_freq.dtype == torch.float32
    got = module(q, k, positions=positions)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert module.inv_freq.dtype == torch.float32  # and still after dynamic's regrowth or longrope's switch


def test_device_moves_still_move_the_frequencies():
    """The meta device stands in for an accelerator: .to(device, dtype) moves inv_freq and leaves it fp32."""
    module = rotary("default").to("meta", torch.bfloat16)
    assert module.inv_freq.device.type == "meta" and module.inv_freq.dtype == torch.float32
    module = rotary("default").to("meta")
    assert module.inv_freq.device.type == "meta" and module.inv_freq.dtype == torch.float32


def test_state_dict_round_trip():
    """inv_freq is non-persistent, as in HF: a cast model's state_dict loads into a fresh one, frequencies intact."""
    model = torch.nn.Sequential(rotary("default"), torch.nn.Linear(4, 4)).to(torch.bfloat16)
    fresh = torch.nn.Sequential(rotary("default"), torch.nn.Linear(4, 4)).to(torch.bfloat16)
    state = model.state_dict()
    assert not any("inv_freq" in name for name in state)
    fresh.load_state_dict(state)
    assert torch.equal(fresh[0].inv_freq, rotary("default").inv_freq) and fresh[0].inv_freq.dtype == torch.float32


def test_dynamic_regrowth_is_bit_equal_to_hf_module():
    """HF's module regrows dynamic NTK's base from an int64 tensor (fp32 arithmetic), its init function from an int
    (fp64): past ~40k positions the two differ, and the module is what a model runs."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=256, num_attention_heads=8, head_dim=32, max_position_embeddings=2048,
                         rope_parameters={"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0})
    for length in (3000, 40001):
        hf = LlamaRotaryEmbedding(config)
        positions = torch.arange(length)[None]
        hf(torch.zeros(1, length, 8, 32), positions)
        ours = ropewkv.nn.RotaryEmbedding(32, 10000.0, {"rope_type": "dynamic", "factor": 2.0},
                                          max_position_embeddings=2048)
        q = torch.zeros(1, length, 1, 32)
        ours(q, q, positions=positions)
        assert torch.equal(ours.inv_freq, hf.inv_freq), length
