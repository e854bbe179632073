"""The decode fast paths of rope, apply_rotary_pos_emb and wkv7_step (host overhead, benchmarks/host_overhead.py):
the common call skips the general argument normalisation once the general path has accepted its Python-level
arguments. Each test checks that the fast path is really taken (the general path is made to raise) and gives what the
general path gives, bit for bit, with the same strides and gradients. That bad input still raises the general path's
errors after a warm-up call is in tests/test_bad_input.py (the warm cases)."""
import pytest
import torch

from ropewkv import _backend, _checks
from ropewkv.ops import rope as rope_ops
from ropewkv.ops.rwkv7 import decode
from ropewkv.testing import seeded
from ropewkv.testing.rope import rope_input, rope_inv_freq
from ropewkv.testing.rwkv7 import rwkv7_inputs
from conftest import kernel_backends


@pytest.fixture(autouse=True)
def fast_paths_serve_interpreted_triton(monkeypatch):
    """The fast paths never cache Triton on CPU tensors (TRITON_INTERPRET, which tests toggle, decides it): here, where
    the interpreter stays on, they may, so that CI runs the Triton fast paths too. What they cached is forgotten
    afterwards, so that no later test meets a cached Triton-on-CPU entry."""
    monkeypatch.setattr(_backend, "fast_path_cacheable", lambda resolved, t: resolved != "reference")
    yield
    rope_ops._ACCEPTED.clear()
    decode._ACCEPTED.clear()


def _general_only(monkeypatch):
    """Make every fast path decline, so that the general path answers."""
    monkeypatch.setattr(rope_ops, "_rope_fast", lambda *args: None)
    monkeypatch.setattr(rope_ops, "_apply_rotary_pos_emb_fast", lambda *args: None)
    monkeypatch.setattr(decode, "_step_fast", lambda *args: None)


def _boom(*args, **kwargs):
    raise AssertionError("the general path ran where the fast path should have answered")


def _fast_only(monkeypatch):
    """Make the general paths raise, so that a result can only come from a fast path."""
    monkeypatch.setattr(rope_ops, "_normalise_rope", _boom)
    monkeypatch.setattr(_checks, "check_tensor", _boom)  # apply_rotary_pos_emb's general path starts with it
    monkeypatch.setattr(decode, "_check_inputs", _boom)


def _same(got, want):
    got, want = (got,) if isinstance(got, torch.Tensor) else got, (want,) if isinstance(want, torch.Tensor) else want
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride()
        assert torch.equal(g, w)


def _both_paths(call):
    """(general path's result, fast path's result) of call(), each with fresh inputs from call."""
    with pytest.MonkeyPatch.context() as patch:
        _general_only(patch)
        want = call()
    call()  # warms the fast path: the general path accepts the arguments
    with pytest.MonkeyPatch.context() as patch:
        _fast_only(patch)
        got = call()
    return want, got


ROPE_CASES = {
    "bshd-gqa-offsets": dict(layout="bshd", kv_heads=1, offsets="tensor"),
    "bhsd-no-k": dict(layout="bhsd", kv_heads=None, offsets=0),
    "sbhd-interleaved-scaled": dict(layout="sbhd", kv_heads=2, offsets="tensor", interleaved=True,
                                    attention_scaling=0.5),
    "bshd-partial-bf16": dict(layout="bshd", kv_heads=2, offsets=0, rotary_dim=4, dtype=torch.bfloat16),
    "bshd-strided-last-dim": dict(layout="bshd", kv_heads=2, offsets="tensor", strided=True),
}


@pytest.mark.parametrize("case", ROPE_CASES, ids=list(ROPE_CASES))
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_rope_fast_path_equals_general_path(device, case, grad):
    spec = ROPE_CASES[case]
    batch, seqlen, heads, head_dim, dtype = 3, 2, 2, 8, spec.get("dtype", torch.float32)
    layout = spec["layout"]
    gen = seeded(5)
    q0 = rope_input(batch, seqlen, heads, 2 * head_dim if spec.get("strided") else head_dim, dtype, layout, gen,
                    device)
    k0 = None if spec["kv_heads"] is None else rope_input(batch, seqlen, spec["kv_heads"], q0.shape[-1], dtype, layout,
                                                          gen, device)
    if spec.get("strided"):
        q0, k0 = q0[..., ::2], k0[..., ::2]
    rotary_dim = spec.get("rotary_dim")
    inv_freq = rope_inv_freq(rotary_dim or head_dim, device=device)
    offsets = torch.randint(0, 5000, (batch,), generator=gen).to(device) if spec["offsets"] == "tensor" else 0
    grads = [torch.randn(x.shape, generator=gen).to(dtype).to(device) for x in (q0, k0) if x is not None]
    for backend in kernel_backends(device):
        def call():
            q, k = (None if x is None else x.detach().clone().requires_grad_(grad) for x in (q0, k0))
            with torch.set_grad_enabled(grad):
                out = rope_ops.rope(q, k, inv_freq=inv_freq, seqlen_offsets=offsets, layout=layout,
                                    interleaved=spec.get("interleaved", False), rotary_dim=rotary_dim,
                                    attention_scaling=spec.get("attention_scaling", 1.0), backend=backend)
            outs = [out] if k is None else list(out)
            if grad:
                outs += torch.autograd.grad(outs, [x for x in (q, k) if x is not None], grads)
            return tuple(outs)

        want, got = _both_paths(call)
        _same(got, want)


@pytest.mark.parametrize("table_shape", [(2, 3), (1, 3), (2, 1)], ids=["BS", "1S", "B1"])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_apply_rotary_pos_emb_fast_path_equals_general_path(device, unsqueeze_dim, grad, table_shape):
    batch, seqlen, head_dim = 2, 3, 8
    gen = seeded(6)
    layout = "bhsd" if unsqueeze_dim == 1 else "bshd"
    q0 = rope_input(batch, seqlen, 4, head_dim, torch.float32, layout, gen, device)
    k0 = rope_input(batch, seqlen, 2, head_dim, torch.float32, layout, gen, device)
    cos, sin = (torch.randn(*table_shape, 6, generator=gen).to(torch.bfloat16).to(device) for _ in range(2))
    grads = [torch.randn(x.shape, generator=gen).to(device) for x in (q0, k0)]
    for backend in kernel_backends(device):
        def call():
            q, k = (x.detach().clone().requires_grad_(grad) for x in (q0, k0))
            with torch.set_grad_enabled(grad):
                outs = rope_ops.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, backend=backend)
            return tuple(outs) + (torch.autograd.grad(outs, (q, k), grads) if grad else ())

        want, got = _both_paths(call)
        _same(got, want)


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_wkv7_step_fast_path_equals_general_path(device, w_dtype):
    inputs = rwkv7_inputs(2, 1, 2, 32, torch.bfloat16, generator=seeded(7), device=device, initial_state=True)
    state0 = inputs.pop("initial_state")
    x = {name: t[:, 0] for name, t in inputs.items()}
    x["w"] = x["w"].to(w_dtype)
    for backend in kernel_backends(device):
        def call():
            state = state0.clone()
            y = decode.wkv7_step(*x.values(), state, decay="raw", backend=backend)
            return y, state

        want, got = _both_paths(call)
        _same(got, want)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_wkv7_step_triton_runner_equals_the_op(device, precision):
    """The fast path's Triton runner (the kernel without the custom op's dispatch; cached for CUDA tensors) gives the
    op's result bit for bit and bumps the state's version counter, as the op's declared mutation does."""
    if "triton" not in kernel_backends(device):
        pytest.skip(f"no Triton twin for {device} tensors")
    inputs = rwkv7_inputs(2, 1, 2, 32, torch.bfloat16, generator=seeded(8), device=device, initial_state=True)
    state0 = inputs.pop("initial_state")
    x = [t[:, 0].contiguous() for t in inputs.values()]
    want_state = state0.clone()
    want = torch.ops.ropewkv.wkv7_triton_step(*x, want_state, "raw", precision)
    got_state = state0.clone()
    version = got_state._version
    got = decode._triton_runner("raw", precision)(*x, got_state)
    _same(got, want)
    assert torch.equal(got_state, want_state) and not torch.equal(got_state, state0)
    assert got_state._version > version
