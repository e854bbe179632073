"""ropewkv.patch.transformers on real HF models (tiny random-weight configs, nothing downloaded)."""
import pytest
import torch

import ropewkv.patch
from ropewkv.ops import rope as rope_ops

from conftest import kernel_backends

transformers = pytest.importorskip("transformers")
from transformers.models.gpt_neox import modeling_gpt_neox  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

LAYERS = 2


def tiny_model(arch: str, dtype=torch.float32, device="cpu"):
    """hidden 64, 4 heads (Llama: GQA with 2 kv heads; GPT-NeoX: rotary_pct 0.25, i.e. partial rotary), vocab 128."""
    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=256)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=LAYERS, num_attention_heads=4, rotary_pct=0.25,
                                            max_position_embeddings=256)
        model = transformers.GPTNeoXForCausalLM(config)
    return model.to(dtype=dtype, device=device)


@pytest.fixture
def count_calls(monkeypatch):
    """A list that grows by one per call of ropewkv's apply_rotary_pos_emb (what the patched models call)."""
    calls, original = [], rope_ops.apply_rotary_pos_emb

    def counting(*args, **kwargs):
        calls.append(kwargs.get("precision"))
        return original(*args, **kwargs)

    monkeypatch.setattr(rope_ops, "apply_rotary_pos_emb", counting)
    return calls


def logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_fp32_logits_and_grads_match_unpatched(arch, device, count_calls):
    model = tiny_model(arch, device=device)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
    want_logits, want_grads = logits_and_grads(model, ids)
    for backend in kernel_backends(device):
        count_calls.clear()
        with ropewkv.patch.transformers(model, backend=backend):
            got_logits, got_grads = logits_and_grads(model, ids)
        assert len(count_calls) == LAYERS, "the model did not call ropewkv once per layer"
        # HF computes each rotated element as fl(fl(x1 c) - fl(x2 s)) in fp32; ours computes it in fp32 too, possibly
        # with a fused multiply-add: at most 1 fp32 ulp (6e-8 relative) per RoPE output. Two tiny layers amplify
        # that by the attention/MLP condition numbers (O(10)); 2e-6 relative to each tensor's scale leaves margin.
        scale = want_logits.abs().max()
        torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=2e-6 * scale)
        assert got_grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=2e-6 * grad.abs().max(), msg=name)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_bf16_mode_is_bit_equal_to_hf_eager_bf16(arch, count_calls):
    """HF: cos/sin in fp32, cast to bf16, then q*cos + rotate_half(q)*sin in bf16 arithmetic (each op rounded to
    bf16); precision="bf16" performs the same roundings, so every logit must be bit-equal."""
    model = tiny_model(arch, dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
        with ropewkv.patch.transformers(model, precision="bf16"):
            got = model(ids).logits
    assert count_calls == ["bf16"] * LAYERS
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_generate_with_kv_cache_gives_the_same_greedy_tokens(arch, count_calls):
    model = tiny_model(arch).eval()
    prompt = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    want = model.generate(prompt, **kwargs)
    with ropewkv.patch.transformers():
        got = model.generate(prompt, **kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # one prefill plus a cached decode step per new token after the first, each calling RoPE once per layer
    assert len(count_calls) == LAYERS * kwargs["max_new_tokens"]


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
        assert handle.patched == ["transformers.models.llama.modeling_llama.apply_rotary_pos_emb"]
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


def test_patched_llama_compiles_fullgraph():
    torch._dynamo.reset()
    model = tiny_model("llama").eval()
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), ropewkv.patch.transformers(model):
        want = model(ids, use_cache=False).logits
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
        got = compiled(ids, use_cache=False).logits
    # aot_eager traces our fake kernels, then runs the same kernels: identical results.
    torch.testing.assert_close(got, want, rtol=0, atol=0)
