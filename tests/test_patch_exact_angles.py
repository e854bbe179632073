"""The precision promise inside patched HF models: at positions near 2^20 a bf16 model patched at the default
precision rotates q and k to within half a bf16 ulp (at each pair's norm) of the exact rotation of what attention
handed RoPE, for every scaling variant and the M-RoPE models, where HF eager (fp32 angle, bf16 tables, bf16
arithmetic) is several ulps off; precision="bf16" stays bit-equal to HF."""
import pytest
import torch

import ropewkv.patch
from ropewkv.testing.hf import model_rotation_error, recorded_rotations
from test_patch_transformers import positions_for, tiny_model

NEAR = 2**20 - 32  # positions NEAR .. NEAR + S - 1
SEQLEN = 16
# HF's rope_parameters for each variant (rope_theta 1e4 added); the tiny models have max_position_embeddings 256.
SCALING = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "longrope": {"rope_type": "longrope", "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
                 "short_factor": [1.0] * 8, "original_max_position_embeddings": 64},
}
CASES = [("llama", s) for s in SCALING] + [("qwen3", "default"), ("gpt_neox", "default"), ("qwen2_vl", "default"),
                                             ("qwen3_vl", "default")]


def long_inputs(arch):
    ids = torch.randint(0, 128, (1, SEQLEN), generator=torch.Generator().manual_seed(8))
    return ids, positions_for(arch, 1, SEQLEN, start=NEAR, spread=24)


@pytest.mark.parametrize("arch,scaling", CASES, ids=[f"{a}-{s}" for a, s in CASES])
def test_patched_bf16_model_rotates_exactly_at_2_pow_20(arch, scaling):
    model = tiny_model(arch, dtype=torch.bfloat16, rope_parameters=SCALING[scaling])
    ids, positions = long_inputs(arch)
    hf_eager = model_rotation_error(model, ids, positions)
    with ropewkv.patch.transformers(model):
        ours = model_rotation_error(model, ids, positions)
    print(f"{arch} {scaling}: max error of the rotated q, k at positions ~2^20 (bf16 ulp at the pair norm): "
          f"HF eager {hf_eager:.2f}, ropewkv.patch.transformers {ours:.3f}")
    # fp32 tables of exact angles, fp32 math, one rounding to bf16: 0.5 ulp plus the fp32 error (2^-16 of a bf16 ulp
    # per rounding), bound 0.51.
    assert ours <= 0.51
    assert hf_eager > 1.0, "HF eager must be measurably worse here, or this test shows nothing"


@pytest.mark.parametrize("arch", ["llama", "qwen2_vl"])
def test_bf16_mode_keeps_hf_tables_at_long_positions(arch):
    """precision="bf16" leaves the rotary modules alone: every rotated q and k is bit-equal to HF eager's."""
    model = tiny_model(arch, dtype=torch.bfloat16)
    ids, positions = long_inputs(arch)
    with torch.no_grad():
        with recorded_rotations(model) as want:
            model(input_ids=ids, position_ids=positions, use_cache=False)
        with ropewkv.patch.transformers(model, precision="bf16"), recorded_rotations(model) as got:
            model(input_ids=ids, position_ids=positions, use_cache=False)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(g, w))


def test_generate_at_long_positions_uses_exact_angles():
    """generate() with a KV cache past 2^20 (the prompt placed there by position_ids): the cached decode steps
    rotate exactly too, and the greedy tokens of the fp32 model are HF's."""
    model = tiny_model("llama").eval()
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(9))
    kwargs = dict(max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    want = model.generate(prompt, position_ids=NEAR + torch.arange(6).view(1, 6), **kwargs)
    with ropewkv.patch.transformers(model), recorded_rotations(model) as calls:
        got = model.generate(prompt, position_ids=NEAR + torch.arange(6).view(1, 6), **kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(calls) == 2 * kwargs["max_new_tokens"]  # prefill + 3 decode steps, 2 layers
