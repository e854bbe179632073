"""ropewkv.patch.transformers on real HF models (tiny random-weight configs, nothing downloaded): Llama, GPT-NeoX
(partial rotary), Qwen3, and the M-RoPE text models of Qwen2-VL, Qwen2.5-VL and Qwen3-VL (interleaved)."""
import pytest
import torch

import ropewkv.patch
from ropewkv.ops import rope as rope_ops

from conftest import kernel_backends

transformers = pytest.importorskip("transformers")
from transformers.models.gpt_neox import modeling_gpt_neox  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

LAYERS = 2
ARCHS = ["llama", "gpt_neox", "qwen3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
MROPE = {"qwen2_vl": ([2, 3, 3], False), "qwen2_5_vl": ([2, 3, 3], False), "qwen3_vl": ([4, 2, 2], True)}
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_model(arch: str, dtype=torch.float32, device="cpu", rope_parameters=None):
    """hidden 64, 4 heads, vocab 128. Llama, OLMo, OLMo2, Qwen3 and the VL text models: GQA with 2 kv heads; GPT-NeoX:
    rotary_pct 0.25 (partial rotary); Qwen2-VL, Qwen2.5-VL (M-RoPE sections [2, 3, 3] of 8 frequencies) and Qwen3-VL
    (interleaved [4, 2, 2]) with a one-block vision tower that text-only inputs never run. rope_parameters: HF's
    dict (rope_theta 1e4 added), e.g. {"rope_type": "yarn", "factor": 4.0}."""
    torch.manual_seed(0)
    rope = {"rope_type": "default", "rope_theta": 10000.0, **(rope_parameters or {})}
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TEXT, rope_parameters=rope))
    elif arch in ("olmo", "olmo2"):
        config, cls = ((transformers.OlmoConfig, transformers.OlmoForCausalLM) if arch == "olmo" else
                       (transformers.Olmo2Config, transformers.Olmo2ForCausalLM))
        model = cls(config(**TEXT, rope_parameters=rope))
    elif arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TEXT, head_dim=16, rope_parameters=rope))
    elif arch == "gpt_neox":
        config = {k: v for k, v in TEXT.items() if k != "num_key_value_heads"}
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**config, rotary_pct=0.25,
                                                                           rope_parameters=rope))
    else:
        section, interleaved = MROPE[arch]
        rope.update(mrope_section=section, **({"mrope_interleaved": True} if interleaved else {}))
        text = dict(TEXT, head_dim=16, rope_parameters=rope)
        if arch == "qwen2_vl":
            vision = dict(depth=1, embed_dim=16, num_heads=2, hidden_size=64, mlp_ratio=1)
            config, cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
        else:
            vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64)
            config, cls = ((transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration)
                           if arch == "qwen2_5_vl" else
                           (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration))
        model = cls(config(text_config=text, vision_config=vision))
    return model.to(dtype=dtype, device=device)


def positions_for(arch: str, batch: int, seqlen: int, start: int = 0, spread: int = 40) -> torch.Tensor:
    """position_ids for a forward: [B, S] from `start`; for the M-RoPE models [3, B, S] with distinct rows (as
    image tokens have: temporal, height, width), each row non-decreasing from `start` within `spread`."""
    if arch not in MROPE:
        return (start + torch.arange(seqlen)).expand(batch, seqlen)
    steps = torch.randint(0, 3, (3, batch, seqlen), generator=torch.Generator().manual_seed(seqlen))
    return start + (steps.cumsum(-1) * spread // (3 * seqlen)).clamp_max(spread)


@pytest.fixture
def count_calls(monkeypatch):
    """A list that grows by one per call of ropewkv's apply_rotary_pos_emb (what the patched models call)."""
    calls, original = [], rope_ops.apply_rotary_pos_emb

    def counting(*args, **kwargs):
        calls.append(kwargs.get("precision"))
        return original(*args, **kwargs)

    monkeypatch.setattr(rope_ops, "apply_rotary_pos_emb", counting)
    return calls


def logits_and_grads(model, ids, position_ids=None):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=position_ids).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_logits_and_grads_match_unpatched(arch, device, count_calls):
    """The default precision swaps in exact fp32 tables too: HF's fp32 angle differs from the exact one by up to half
    an fp32 ulp of position * inv_freq (< 4e-6 rad at these positions < 48), so logits and gradients agree to a few
    1e-6 of their scale (two tiny layers amplify a per-element table difference by O(10))."""
    model = tiny_model(arch, device=device)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
    positions = positions_for(arch, 2, 24).to(device)
    want_logits, want_grads = logits_and_grads(model, ids, positions)
    for backend in kernel_backends(device):
        count_calls.clear()
        with ropewkv.patch.transformers(model, qk_norm=False, backend=backend):
            got_logits, got_grads = logits_and_grads(model, ids, positions)
        assert len(count_calls) == LAYERS, "the model did not call ropewkv once per layer"
        scale = want_logits.abs().max()
        torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-5 * scale)
        assert got_grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=1e-5 * grad.abs().max(), msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_tables_mode_is_bit_identical_in_fp32(arch, device, count_calls):
    """precision="bf16" keeps HF's tables and arithmetic: in an fp32 model each element is fl(fl(x1 c) - fl(x2 s)), as
    HF's q * cos + rotate_half(q) * sin, and its transpose in the backward, so logits and every gradient are
    bit-identical (the twins compute without fused multiply-adds). One exception: Qwen3's q_norm/k_norm weight
    gradients sum the RoPE input gradient over tokens and heads, and ours is laid out [B, S, H, D] in memory where
    HF's is [B, H, S, D]: the same values summed in another order, within a few fp32 ulps."""
    model = tiny_model(arch, device=device)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5)).to(device)
    positions = positions_for(arch, 2, 12).to(device)
    want_logits, want_grads = logits_and_grads(model, ids, positions)
    for backend in kernel_backends(device):
        count_calls.clear()
        with ropewkv.patch.transformers(model, precision="bf16", qk_norm=False, backend=backend):
            got_logits, got_grads = logits_and_grads(model, ids, positions)
        assert count_calls == ["bf16"] * LAYERS
        assert torch.equal(got_logits, want_logits), backend
        for name, grad in want_grads.items():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=1e-6 * grad.abs().max(), msg=name)
            else:
                assert torch.equal(got_grads[name], grad), (backend, name)


# OLMo's and OLMo2's rotary modules return fp32 tables in a bf16 model, and their apply_rotary_pos_emb computes in
# fp32 and rounds once to bf16: positions from 1000, where rounding the tables to bf16 first would show.
@pytest.mark.parametrize("arch, start", [(arch, 0) for arch in ARCHS] + [("olmo", 1000), ("olmo2", 1000)])
def test_bf16_mode_is_bit_equal_to_hf_eager_bf16(arch, start, count_calls):
    """HF: cos/sin in fp32, cast to bf16, then q*cos + rotate_half(q)*sin in bf16 arithmetic (each op rounded to
    bf16), or, where its function computes in its fp32 tables' dtype (OLMo), in fp32 rounded once; precision="bf16"
    performs the same roundings (a probe tells which), so every logit must be bit-equal."""
    model = tiny_model(arch, dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    positions = positions_for(arch, 2, 24, start=start)
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=positions).logits
        with ropewkv.patch.transformers(model, precision="bf16", qk_norm=False):
            got = model(input_ids=ids, position_ids=positions).logits
    assert count_calls == ["bf16"] * LAYERS
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_with_kv_cache_gives_the_same_greedy_tokens(arch, count_calls):
    model = tiny_model(arch).eval()
    prompt = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    want = model.generate(prompt, **kwargs)
    with ropewkv.patch.transformers(qk_norm=False):
        got = model.generate(prompt, **kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # one prefill plus a cached decode step per new token after the first, each calling RoPE once per layer
    assert len(count_calls) == LAYERS * kwargs["max_new_tokens"]


def test_dynamic_ntk_follows_the_length_during_generate():
    """Dynamic NTK regrows inv_freq once the sequence passes max_position_embeddings (16 here) and the patched rotary
    module keeps HF's dynamic_rope_update: generate() through the growth gives HF's greedy tokens and leaves the same
    inv_freq behind, and a short forward afterwards resets it as HF does."""
    rope = {"rope_type": "dynamic", "factor": 2.0}
    model = tiny_model("llama", rope_parameters=rope).eval()
    model.config.max_position_embeddings = 16
    rotary = model.model.rotary_emb
    rotary.max_seq_len_cached = rotary.original_max_seq_len = 16
    prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(6))
    kwargs = dict(max_new_tokens=10, do_sample=False, use_cache=True, pad_token_id=0)
    original = rotary.inv_freq.clone()
    want = model.generate(prompt, **kwargs)
    want_inv_freq = rotary.inv_freq.clone()
    assert not torch.equal(want_inv_freq, original), "the test must cross max_position_embeddings"
    model(prompt[:, :4])  # back below the original length: HF resets inv_freq
    assert torch.equal(rotary.inv_freq, original)
    with ropewkv.patch.transformers(model):
        got = model.generate(prompt, **kwargs)
        assert torch.equal(rotary.inv_freq, want_inv_freq)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_undo_restores_the_original_functions():
    originals = (modeling_llama.apply_rotary_pos_emb, modeling_gpt_neox.apply_rotary_pos_emb)
    with ropewkv.patch.transformers() as handle:
        assert modeling_llama.apply_rotary_pos_emb is not originals[0]
        assert modeling_gpt_neox.apply_rotary_pos_emb is not originals[1]
        assert "rwkv7" in handle.skipped  # transformers 5.x has no RWKV-7 model: reported, not silently ignored
    assert (modeling_llama.apply_rotary_pos_emb, modeling_gpt_neox.apply_rotary_pos_emb) == originals
    assert modeling_llama.apply_rotary_pos_emb is originals[0]
    handle.undo()  # idempotent
    assert modeling_llama.apply_rotary_pos_emb is originals[0]


def test_a_given_model_patches_only_its_own_modeling_module():
    original_neox = modeling_gpt_neox.apply_rotary_pos_emb
    handle = ropewkv.patch.transformers(tiny_model("llama"), rwkv7=False)
    try:
        assert handle.patched == ["transformers.models.llama.modeling_llama.apply_rotary_pos_emb",
                                  "transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.forward"]
        assert modeling_gpt_neox.apply_rotary_pos_emb is original_neox
    finally:
        handle.undo()


def test_incompatible_functions_are_probed_and_skipped():
    import types

    def interleaved(q, k, cos, sin, unsqueeze_dim=1):  # GPT-J pairs: not HF's rotate_half convention
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    module = types.ModuleType("modeling_fake")
    module.apply_rotary_pos_emb = interleaved
    handle = ropewkv.patch.transformers(module, rwkv7=False)
    assert handle.patched == [] and module.apply_rotary_pos_emb is interleaved
    assert "rotate_half" in handle.skipped["modeling_fake.apply_rotary_pos_emb"]


@pytest.mark.parametrize("arch", ["llama", "qwen2_vl"])
def test_patched_model_compiles_fullgraph(arch):
    """The swapped rotary module (exact tables) and apply_rotary_pos_emb trace without a graph break."""
    torch._dynamo.reset()
    model = tiny_model(arch).eval()
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(4))
    positions = positions_for(arch, 1, 8)
    with torch.no_grad(), ropewkv.patch.transformers(model):
        want = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
        got = compiled(input_ids=ids, position_ids=positions, use_cache=False).logits
    # aot_eager traces our fake kernels, then runs the same kernels: identical results.
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("first_undone", ["first", "second"])
def test_overlapping_handles_undo_in_any_order(first_undone):
    """A second patch of an attribute another handle holds leaves it to that handle (recorded, never re-wrapped), so
    undoing the two in either order ends with HF's originals."""
    from ropewkv.patch._handle import ALREADY_PATCHED

    originals = (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRotaryEmbedding.forward)
    first = ropewkv.patch.transformers(tiny_model("llama"), rwkv7=False)
    second = ropewkv.patch.transformers(tiny_model("llama"), precision="bf16", rwkv7=False)
    assert second.patched == []
    assert second.skipped["transformers.models.llama.modeling_llama.apply_rotary_pos_emb"] == ALREADY_PATCHED
    for handle in (first, second) if first_undone == "first" else (second, first):
        handle.undo()
    assert modeling_llama.apply_rotary_pos_emb is originals[0]
    assert modeling_llama.LlamaRotaryEmbedding.forward is originals[1]


def test_undo_leaves_an_attribute_rebound_since_and_warns():
    import types

    from ropewkv.reference.rope import hf_apply_rotary_pos_emb

    module = types.ModuleType("modeling_fake")
    module.apply_rotary_pos_emb = hf_apply_rotary_pos_emb
    handle = ropewkv.patch.transformers(module, rwkv7=False)
    assert handle.patched == ["modeling_fake.apply_rotary_pos_emb"]

    def someone_elses(q, k, cos, sin, unsqueeze_dim=1):
        return q, k

    module.apply_rotary_pos_emb = someone_elses
    with pytest.warns(RuntimeWarning, match="rebound"):
        handle.undo()
    assert module.apply_rotary_pos_emb is someone_elses


@pytest.mark.parametrize("rope_interleave", [True, False])
def test_tables_with_other_readers_stay_hf(rope_interleave, count_calls):
    """Youtu (MLA) rotates with its own apply_rotary_pos_emb_interleave (rope_interleave, its default) on the rotary
    module's tables, so they stay HF's (recorded): exact fp32 tables made its key fp32 beside a bf16 value, and
    attention raised. A bf16 Youtu patched at the default precision runs and matches HF within bf16 rounding."""
    torch.manual_seed(0)
    config = transformers.YoutuConfig(**dict(TEXT, num_key_value_heads=4), kv_lora_rank=16, q_lora_rank=32,
                                      qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                      rope_interleave=rope_interleave)
    model = transformers.YoutuForCausalLM(config).eval().to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits.float()
        with ropewkv.patch.transformers(model, rwkv7=False) as handle:
            got = model(ids).logits.float()
            assert "transformers.models.youtu.modeling_youtu.apply_rotary_pos_emb" in handle.patched
            assert "transformers.models.youtu.modeling_youtu.YoutuRotaryEmbedding" in handle.skipped
    assert len(count_calls) == (0 if rope_interleave else LAYERS)
    torch.testing.assert_close(got, want, rtol=0, atol=4 * 2**-8 * want.abs().max())


def test_exact_table_modules_hand_their_tables_to_apply_rotary_pos_emb_alone():
    """The allowlist's premise, checked on the installed transformers: no exact-table module calls another rotary
    function (as Youtu's apply_rotary_pos_emb_interleave) on its rotary module's tables. Qwen2-VL's and Qwen2.5-VL's
    vision rotation reads the vision tower's own tables (its rotary module's forward(seqlen) fails the probe)."""
    import importlib
    import inspect
    import re

    from ropewkv.patch._hf import EXACT_TABLE_MODULES

    vision = {"apply_rotary_pos_emb_vision"}
    for name in sorted(EXACT_TABLE_MODULES):
        source = inspect.getsource(importlib.import_module(name))
        others = set(re.findall(r"\b(apply_\w*rot\w*)\(", source)) - {"apply_rotary_pos_emb"}
        assert others <= vision, (name, others)
