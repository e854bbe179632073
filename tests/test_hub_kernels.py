"""The third way in: HF transformers' own kernel mechanism (set_use_kernels / kernelize with the real `kernels`
library) picks ropewkv.hub's layer for `rotary_pos_emb` in a real (tiny) Llama. transformers applies its hub
decorators when imported, so every check runs in a fresh interpreter (ropewkv.testing.hub explains the kernels
version it accepts there)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("kernels")
pytest.importorskip("transformers")

TESTS = Path(__file__).resolve().parent
PRELUDE = '''
import sys
from ropewkv.testing.hub import accept_installed_kernels
note = accept_installed_kernels()
if note:
    print("note:", note)
import torch, transformers, kernels
import ropewkv.hub
from ropewkv.ops import rope as rope_ops
sys.path.insert(0, TESTS)
from test_patch_transformers import tiny_model, LAYERS
calls = []
original = rope_ops.apply_rotary_pos_emb
def counting(*args, **kwargs):
    calls.append(args[0].device.type)
    return original(*args, **kwargs)
rope_ops.apply_rotary_pos_emb = counting
'''


def run_fresh(body: str) -> str:
    """Run PRELUDE + body in a new interpreter (this environment, TRITON_INTERPRET included); return its stdout."""
    code = f"TESTS = {str(TESTS)!r}\n" + PRELUDE + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                            env=dict(os.environ))
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_layer_loads_through_kernels_and_passes_its_validation():
    """kernels' LocalLayerRepository imports the package under its own name and checks the layer is stateless with
    HF's forward signature (what kernelize does before it swaps a forward)."""
    run_fresh('''
        from kernels.layer.layer import _validate_layer
        from transformers.models.llama import modeling_llama
        layer = ropewkv.hub.kernel_mapping()["rotary_pos_emb"]["cpu"][kernels.Mode.INFERENCE].load()
        assert layer.__module__ != "ropewkv.hub.rotary.layers", "loaded by kernels, not imported by us"
        hf_function = modeling_llama.apply_rotary_pos_emb
        assert hf_function.kernel_layer_name == "rotary_pos_emb", "transformers registered it with kernels"
        _validate_layer(check_cls=type(hf_function), cls=layer, repo="ropewkv.hub")
        assert layer.can_torch_compile and layer.has_backward
    ''')


def test_set_use_kernels_picks_ropewkv_on_cpu():
    """model.set_use_kernels(True) (what from_pretrained(use_kernels=True) runs) with ropewkv's mapping registered:
    inference and training kernelize to ropewkv (one call per layer), logits and gradients as HF's, and
    torch.compile(fullgraph=True) traces it."""
    out = run_fresh('''
        model = tiny_model("llama").eval()
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
        def logits_and_grads():
            model.zero_grad(set_to_none=True)
            logits = model(ids).logits
            logits.square().mean().backward()
            return logits.detach(), [p.grad.clone() for p in model.parameters()]
        want, want_grads = logits_and_grads()
        kernels.register_kernel_mapping(ropewkv.hub.kernel_mapping())
        model.set_use_kernels(True)
        got, got_grads = logits_and_grads()
        assert calls == ["cpu"] * LAYERS, calls
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * want.abs().max())
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=0, atol=2e-6 * w.abs().max())
        model.train()
        model.set_use_kernels(True)  # kernelize again, in training mode
        calls.clear()
        logits_and_grads()
        assert calls == ["cpu"] * LAYERS, calls
        model.eval()
        with torch.no_grad():
            compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
            got = compiled(ids, use_cache=False).logits
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * want.abs().max())
        from transformers.models.llama import modeling_llama
        print("kernelized:", modeling_llama.apply_rotary_pos_emb.forward.__func__.__qualname__)
    ''')
    assert "kernelized: ApplyRotaryPosEmb.forward" in out  # HF's function object now runs ropewkv's layer


def test_registered_functions_other_than_hf_rope_keep_their_own():
    """transformers registers some 120 functions as rotary_pos_emb, not all of them HF's rotate_half RoPE: GPT-OSS's
    takes half-width tables and rotates both halves. Kernelized with ropewkv's mapping, a tiny GPT-OSS runs its own
    function through the layer (logits as unkernelized), while a Llama in the same process calls ropewkv."""
    run_fresh('''
        config = transformers.GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, head_dim=16,
                                           num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                           num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                                           sliding_window=8)
        torch.manual_seed(0)
        gpt_oss = transformers.GptOssForCausalLM(config).eval()
        llama = tiny_model("llama").eval()
        ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = gpt_oss(ids).logits, llama(ids).logits
            # ropewkv's mapping alone: GPT-OSS's MoE hub kernels would need the network
            with kernels.use_kernel_mapping(ropewkv.hub.kernel_mapping(), inherit_mapping=False):
                for model in (gpt_oss, llama):
                    kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
            from transformers.models.gpt_oss import modeling_gpt_oss
            assert modeling_gpt_oss.apply_rotary_pos_emb.forward.__func__.__qualname__ == "ApplyRotaryPosEmb.forward"
            got = gpt_oss(ids).logits
            torch.testing.assert_close(got, want[0], rtol=0, atol=1e-6 * want[0].abs().max())
            assert calls == [], calls
            got = llama(ids).logits
            assert calls == ["cpu"] * LAYERS, calls
            torch.testing.assert_close(got, want[1], rtol=0, atol=2e-6 * want[1].abs().max())
    ''')


def test_compiled_before_any_eager_call():
    """torch.compile(fullgraph=True) as the first call of a kernelized model: the layer's probe of HF's function runs
    while dynamo traces (a constant of the graph), not inside the graph, where it would break it."""
    run_fresh('''
        model = tiny_model("llama").eval()
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = model(ids, use_cache=False).logits
            with kernels.use_kernel_mapping(ropewkv.hub.kernel_mapping(), inherit_mapping=False):
                kernels.kernelize(model, mode=kernels.Mode.INFERENCE | kernels.Mode.TORCH_COMPILE, device="cpu")
            got = torch.compile(model, fullgraph=True, backend="aot_eager")(ids, use_cache=False).logits
        assert calls == ["cpu"] * LAYERS, calls
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * want.abs().max())
    ''')


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU machine runs it)")
def test_kernel_config_picks_ropewkv_on_cuda():
    """On CUDA, HF's KernelConfig (local repository) route, which replaces HF's default rotary kernel."""
    run_fresh('''
        model = tiny_model("llama", device="cuda").eval()
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1)).cuda()
        with torch.no_grad():
            want = model(ids).logits
            model.set_use_kernels(True, ropewkv.hub.kernel_config())
            got = model(ids).logits
        assert calls == ["cuda"] * LAYERS, calls
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * want.abs().max())
    ''')
