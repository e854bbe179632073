"""ropewkv.patch.transformers swaps the fused qk_norm_rope into HF's Qwen3 / Qwen3-MoE attention (tiny random-weight
configs, nothing downloaded): logits, gradients and greedy generation unchanged within the stated tolerances."""
import pytest
import torch

import ropewkv.patch
from ropewkv.ops import qk_norm_rope as qk_ops

from conftest import kernel_backends

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

LAYERS = 2


def tiny_model(arch: str, dtype=torch.float32, device="cpu"):
    """hidden 64, 4 q heads, 2 kv heads (GQA), head_dim 16, vocab 128; norm weights drawn around 1 (HF initialises them
    to exactly 1, which would hide a weight that is not applied)."""
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    if arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.3)
    return model.to(dtype=dtype, device=device)


@pytest.fixture
def count_calls(monkeypatch):
    """A list that grows by one per call of ropewkv's qk_norm_rope (what the patched attention calls)."""
    calls, original = [], qk_ops.qk_norm_rope

    def counting(*args, **kwargs):
        calls.append(kwargs.get("precision"))
        return original(*args, **kwargs)

    monkeypatch.setattr(qk_ops, "qk_norm_rope", counting)
    return calls


def logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_fp32_logits_and_grads_match_unpatched(arch, device, count_calls):
    model = tiny_model(arch, device=device)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
    want_logits, want_grads = logits_and_grads(model, ids)
    for backend in kernel_backends(device):
        with ropewkv.patch.transformers(model, backend=backend) as handle:
            assert any(p.endswith("Attention.forward") for p in handle.patched), handle.skipped
            count_calls.clear()
            got_logits, got_grads = logits_and_grads(model, ids)
        assert len(count_calls) == LAYERS, "the model did not call qk_norm_rope once per layer"
        # HF rounds each fp32 step (norm, weight product, two rope products and a sum); ours does the same steps in
        # fp32 with fewer roundings: <= a few fp32 ulp per q/k element. Two layers amplify that by O(10): 2e-6 of each
        # tensor's scale leaves margin. The q_norm/k_norm weight gradients come from our fused backward.
        torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=2e-6 * want_logits.abs().max())
        assert got_grads.keys() == want_grads.keys()
        assert any("q_norm" in name for name in got_grads)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=2e-5 * grad.abs().max(), msg=name)


def test_bf16_mode_tracks_hf_eager_bf16(count_calls):
    """precision="bf16" repeats HF's eager bf16 roundings (norm output rounded, times the bf16 weight, bf16 RoPE); the
    fp32 statistics are summed in another order, so a q/k element can differ by one bf16 ulp where that crosses a
    rounding boundary. Logits of the tiny model stay within a few bf16 ulps of HF's, and far closer than the default
    fp32 mode (which is *more* accurate than HF eager bf16, hence further from it)."""
    model = tiny_model("qwen3", dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits.float()
        with ropewkv.patch.transformers(model, precision="bf16"):
            count_calls.clear()
            low = model(ids).logits.float()
            assert count_calls == ["bf16"] * LAYERS
        with ropewkv.patch.transformers(model):
            fp32 = model(ids).logits.float()
    scale = want.abs().max()
    assert float((low - want).abs().max()) <= 4 * 2**-8 * scale
    assert float((low - want).abs().mean()) < float((fp32 - want).abs().mean())


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_generate_with_kv_cache_gives_the_same_greedy_tokens(arch, count_calls):
    model = tiny_model(arch).eval()
    prompt = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    want = model.generate(prompt, **kwargs)
    with ropewkv.patch.transformers(model):
        count_calls.clear()
        got = model.generate(prompt, **kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(count_calls) == LAYERS * kwargs["max_new_tokens"]  # prefill + cached decode steps


def test_undo_restores_the_attention_classes():
    originals = (modeling_qwen3.Qwen3Attention.forward, modeling_qwen3_moe.Qwen3MoeAttention.forward)
    with ropewkv.patch.transformers() as handle:
        assert modeling_qwen3.Qwen3Attention.forward is not originals[0]
        assert modeling_qwen3_moe.Qwen3MoeAttention.forward is not originals[1]
        assert "transformers.models.qwen3.modeling_qwen3.Qwen3Attention.forward" in handle.patched
    assert (modeling_qwen3.Qwen3Attention.forward, modeling_qwen3_moe.Qwen3MoeAttention.forward) == originals


def test_qk_norm_false_leaves_the_attention_to_hf():
    original = modeling_qwen3.Qwen3Attention.forward
    with ropewkv.patch.transformers(qk_norm=False) as handle:
        assert modeling_qwen3.Qwen3Attention.forward is original
        assert "transformers.models.qwen3.modeling_qwen3.apply_rotary_pos_emb" in handle.patched


def test_a_llama_model_leaves_qwen3_alone():
    original = modeling_qwen3.Qwen3Attention.forward
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    with ropewkv.patch.transformers(llama, rwkv7=False) as handle:
        assert modeling_qwen3.Qwen3Attention.forward is original
        assert not any("Attention" in p for p in handle.patched)


def test_an_incompatible_attention_is_probed_and_skipped(monkeypatch):
    """A Qwen3Attention whose forward does something else (here: no k_norm) is left alone and reported."""
    def other_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        return self.o_proj(self.v_proj(hidden_states).repeat(1, 1, 2)), None

    monkeypatch.setattr(modeling_qwen3.Qwen3Attention, "forward", other_forward)
    with ropewkv.patch.transformers(modeling_qwen3, rwkv7=False) as handle:
        assert modeling_qwen3.Qwen3Attention.forward is other_forward
        assert "something other" in handle.skipped[
            "transformers.models.qwen3.modeling_qwen3.Qwen3Attention.forward"]


def test_patched_qwen3_compiles_fullgraph():
    torch._dynamo.reset()
    model = tiny_model("qwen3").eval()
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), ropewkv.patch.transformers(model):
        want = model(ids, use_cache=False).logits
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("first_undone", ["first", "second"])
def test_a_second_patch_leaves_the_attention_to_the_first_and_says_so(first_undone, count_calls):
    """A second patch with other settings while one is active: the attention keeps the first's fused forward, the
    second handle records why, and undoing the two in either order restores HF's forward."""
    from ropewkv.patch._handle import ALREADY_PATCHED

    original = modeling_qwen3.Qwen3Attention.forward
    model = tiny_model("qwen3", dtype=torch.bfloat16)
    first = ropewkv.patch.transformers(model, rwkv7=False)
    second = ropewkv.patch.transformers(model, precision="bf16", backend="reference", rwkv7=False)
    assert second.skipped["transformers.models.qwen3.modeling_qwen3.Qwen3Attention.forward"] == ALREADY_PATCHED
    assert second.patched == []
    count_calls.clear()  # the first patch's probe called it too
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(7)))
    assert count_calls == [None] * LAYERS  # the first handle's precision (the build default)
    for handle in (first, second) if first_undone == "first" else (second, first):
        handle.undo()
    assert modeling_qwen3.Qwen3Attention.forward is original
