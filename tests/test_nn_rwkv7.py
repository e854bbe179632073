"""RWKV7TimeMix against an fp64 literal transcription of RWKV-LM's RWKV_Tmix_x070.forward (loglog w)."""
import pytest
import torch
import torch.nn.functional as F

from ropewkv.nn import RWKV7TimeMix
from ropewkv.nn import rwkv7 as rwkv7_module
from ropewkv.ops.rwkv7 import wkv7
from ropewkv.reference import rwkv7 as reference
from ropewkv.testing import rms_ratio, seeded

from conftest import kernel_backends

C, N, B, T = 64, 32, 2, 19  # H = 2 heads of 32; T not a multiple of 16

# RWKV-LM's RWKV_Tmix_x070 parameters; its LoRA ranks max(32, round(f * sqrt(C) / 32) * 32) are all 32 at C=64.
RWKV_LM_SHAPES = {
    **{f"x_{n}": (1, 1, C) for n in "rwkvag"},
    "w0": (1, 1, C), "w1": (C, 32), "w2": (32, C),
    "a0": (1, 1, C), "a1": (C, 32), "a2": (32, C),
    "v0": (1, 1, C), "v1": (C, 32), "v2": (32, C),
    "g1": (C, 32), "g2": (32, C),
    "k_k": (1, 1, C), "k_a": (1, 1, C), "r_k": (C // N, N),
    "receptance.weight": (C, C), "key.weight": (C, C), "value.weight": (C, C), "output.weight": (C, C),
    "ln_x.weight": (C,), "ln_x.bias": (C,),
}


def rwkv_lm_forward(p: dict, x, v_first, layer_id: int):
    """RWKV-LM's formula written out in fp64, with RWKV-LM's own decay w = -softplus(-(...)) - 0.5 (loglog)."""
    p = {name: t.double() for name, t in p.items()}
    x = x.double()
    Bx, Tx, Cx = x.shape
    H = p["r_k"].shape[0]
    xx = F.pad(x, (0, 0, 1, -1)) - x
    xr, xw, xk, xv, xa, xg = (x + xx * p[f"x_{n}"] for n in "rwkvag")
    r = xr @ p["receptance.weight"].T
    w = -F.softplus(-(p["w0"] + torch.tanh(xw @ p["w1"]) @ p["w2"])) - 0.5
    k = xk @ p["key.weight"].T
    v = xv @ p["value.weight"].T
    if layer_id == 0:
        v_first = v
    else:
        v = v + (v_first.double() - v) * torch.sigmoid(p["v0"] + (xv @ p["v1"]) @ p["v2"])
    a = torch.sigmoid(p["a0"] + (xa @ p["a1"]) @ p["a2"])
    g = torch.sigmoid(xg @ p["g1"]) @ p["g2"]
    kk = F.normalize((k * p["k_k"]).view(Bx, Tx, H, -1), dim=-1, p=2.0).view(Bx, Tx, Cx)
    k = k * (1 + (a - 1) * p["k_a"])
    y, _ = reference.wkv7(*(t.view(Bx, Tx, H, -1) for t in (r, w, k, v, -kk, kk * a)), decay="loglog")
    y = F.group_norm(y.reshape(Bx * Tx, Cx), H, p["ln_x.weight"], p["ln_x.bias"], eps=64e-5).view(Bx, Tx, Cx)
    y = y + ((r.view(Bx, Tx, H, -1) * k.view(Bx, Tx, H, -1) * p["r_k"]).sum(-1, keepdim=True)
             * v.view(Bx, Tx, H, -1)).view(Bx, Tx, Cx)
    return (y * g) @ p["output.weight"].T, v_first


def trained_like(layer_id: int, seed: int) -> RWKV7TimeMix:
    """A block whose LoRAs and output are non-zero (RWKV-LM initialises them to zero), as after some training."""
    module = RWKV7TimeMix(C, N, layer_id=layer_id, n_layer=2)
    generator = seeded(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.5 / C**0.5 if p.dim() == 2 else 0.1
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return module


def inputs(seed: int):
    generator = seeded(seed)
    return torch.randn(B, T, C, generator=generator), torch.randn(B, T, C, generator=generator)


def test_state_dict_has_rwkv_lm_names_and_shapes():
    module = RWKV7TimeMix(C, N, layer_id=0, n_layer=2)
    assert {n: tuple(t.shape) for n, t in module.state_dict().items()} == RWKV_LM_SHAPES
    assert module.ln_x.eps == 64e-5 and module.ln_x.num_groups == C // N
    module.load_state_dict({n: torch.randn(s) for n, s in RWKV_LM_SHAPES.items()}, strict=True)


@pytest.mark.parametrize("layer_id", [0, 1])
def test_fp64_reference_backend_equals_the_rwkv_lm_transcription(layer_id):
    """Same arithmetic in fp64 except the decay form (fused raw vs loglog): they agree to fp64 rounding."""
    module = trained_like(layer_id, seed=layer_id).double()
    module.backend = "reference"
    x, v_first = (t.double() for t in inputs(10 + layer_id))
    out, v_out = module(x, v_first)
    want, want_v = rwkv_lm_forward(module.state_dict(), x, v_first, layer_id)
    assert rms_ratio(out, want) < 1e-13  # ~100 fp64 ulps (1e-16 each) through a T=19 recurrence
    assert rms_ratio(v_out, want_v) < 1e-14


@pytest.mark.parametrize("layer_id", [0, 1])
def test_kernels_fp32_forward_and_gradients_vs_fp64(layer_id, device):
    x, v_first = inputs(20 + layer_id)
    module = trained_like(layer_id, seed=layer_id)
    params64 = {n: p.detach().double().requires_grad_() for n, p in module.named_parameters()}
    x64 = x.double().requires_grad_()
    want, _ = rwkv_lm_forward(params64, x64, v_first, layer_id)
    cotangent = torch.randn(want.shape, generator=seeded(30), dtype=torch.float64)
    want_grads = torch.autograd.grad(want, [x64, *params64.values()], cotangent, allow_unused=True)
    module = module.to(device)
    for backend in kernel_backends(device):
        module.backend = backend
        module.zero_grad(set_to_none=True)
        xd = x.to(device).clone().requires_grad_()  # a fresh leaf per backend: no gradient accumulates across them
        out, _ = module(xd, v_first.to(device))
        out.backward(cotangent.float().to(device))
        # fp32 everywhere: each matmul/norm/sum rounds at 6e-8 relative, the T=19 recurrence and the GroupNorm
        # (which divides by a per-head std) amplify by O(10-100); 1e-5 is ~100x eps, well below any wrong formula.
        assert rms_ratio(out, want) < 1e-5, backend
        grads = [xd.grad] + [p.grad for p in module.parameters()]
        names = ["x"] + [n for n, _ in module.named_parameters()]
        for name, got, expected in zip(names, grads, want_grads):
            if expected is None:  # layer 0 has no value residual: v0, v1, v2 are unused, as in RWKV-LM
                assert got is None, name
                continue
            # gradients chain one more pass of the same ops (and the recurrence's backward): 3e-5.
            assert rms_ratio(got, expected) < 3e-5, (backend, name)


def test_decode_with_state_equals_the_full_sequence(device):
    """Prefill T1 tokens, then decode one token at a time (wkv7_step): the outputs equal one full forward."""
    module = trained_like(1, seed=5).to(device)
    x, v_first = (t.to(device) for t in inputs(40))
    with torch.no_grad():
        want, _ = module(x, v_first)
        state = module.initial_state(B)
        t1 = 7
        pieces = [module(x[:, :t1], v_first[:, :t1], state)[0]]
        for t in range(t1, T):
            pieces.append(module(x[:, t:t + 1], v_first[:, t:t + 1], state)[0])
    got = torch.cat(pieces, dim=1)
    # Same fp32 ops in another grouping (state handed over, step kernel): a few fp32 ulps of the output.
    assert rms_ratio(got, want) < 1e-6
    assert state.wkv.dtype == torch.float32 and torch.equal(state.x_prev, x[:, -1])


@pytest.mark.parametrize("layer_id", [0, 1])
def test_autocast_keeps_the_decay_fp32_within_bf16_matmul_error(layer_id, device, monkeypatch):
    """torch.autocast(bf16) on the device's default twin (the op's mixed dtypes on every twin:
    tests/test_wkv7_conventions.py), forward and backward: the kernel gets r, k, v, a, b in bf16 and the decay
    pre-activation in fp32, bit-equal to the fp32 run's (its LoRA runs with autocast off); the output and gradients
    stay within bf16 matmul error of fp32. Over 24 random modules at this size (CPU twin): output 7.3e-3 median
    (9.3e-3 max), all parameter and input gradients together 1.1e-2 median (2.9e-2 max)."""
    calls = []

    def recording(*args, **kwargs):
        calls.append(args)
        return wkv7(*args, **kwargs)

    monkeypatch.setattr(rwkv7_module, "wkv7", recording)
    torch.manual_seed(layer_id)  # RWKV7TimeMix's orthogonal init draws from the global generator
    module = trained_like(layer_id, seed=layer_id).to(device)
    x, v_first = (t.to(device) for t in inputs(60 + layer_id))
    cotangent = torch.randn(B, T, C, generator=seeded(61)).to(device)
    runs = []
    for autocast in (False, True):
        module.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out, _ = module(leaf, v_first)
        out.float().backward(cotangent)
        grads = [leaf.grad] + [p.grad for p in module.parameters() if p.grad is not None]
        runs.append((out, torch.cat([g.flatten().float() for g in grads])))
    (out32, grads32), (out_amp, grads_amp) = runs
    plain, mixed = calls
    assert out_amp.dtype == torch.bfloat16 and out32.dtype == torch.float32
    assert [t.dtype for t in mixed] == [torch.bfloat16, torch.float32] + [torch.bfloat16] * 4
    assert torch.equal(mixed[1], plain[1])  # the decay path is fp32 under autocast
    assert rms_ratio(out_amp, out32) < 2e-2
    assert rms_ratio(grads_amp, grads32) < 5e-2


def test_later_layers_name_a_missing_v_first():
    layer = RWKV7TimeMix(64, head_size=32, layer_id=1, n_layer=2)
    with pytest.raises(ValueError, match="v_first is required by layer 1"):
        layer(torch.randn(1, 3, 64))


@pytest.mark.parametrize("case", ["x-int", "x-2d", "x-channels", "state-batch", "v_first-shape"])
def test_bad_input_names_the_argument(case):
    """Each raised a torch error from deep inside (an unpack, a matmul, a cat) that named no argument, or (an integer
    x) was accepted."""
    layer = RWKV7TimeMix(64, head_size=32, layer_id=1, n_layer=2)
    x, v_first = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    call, pattern = {
        "x-int": (lambda: layer(x.long(), v_first), r"x must be a float tensor \[B, T, C = 64\], got torch.int64"),
        "x-2d": (lambda: layer(x[0], v_first), r"x must be a float tensor .* of shape \(3, 64\)"),
        "x-channels": (lambda: layer(x[..., :32], v_first), r"x must be a float tensor .* of shape \(2, 3, 32\)"),
        "state-batch": (lambda: layer(x, v_first, state=layer.initial_state(3)), r"state must hold .* \[2, 64\]"),
        "v_first-shape": (lambda: layer(x, v_first[:, :2]), r"v_first must have x's shape \(2, 3, 64\)"),
    }[case]
    with pytest.raises(ValueError, match=pattern):
        call()
