"""ropewkv.compat.fla against the real flash-linear-attention: FLA 0.6.0's own kernels (run by the Triton interpreter
on CPU, see tests/fla_cpu.py) and the fp64 reference written in FLA's conventions (log decay, state [N, H, K, V] =
the transpose of RWKV-LM's S[v][k], r times scale). Outputs, final states and gradients of both sides are measured
against fp64; each must stay within its own error, and the two must agree within the sum of those errors."""
import inspect

import pytest
import torch
import torch.nn.functional as F

from ropewkv.compat import fla as compat
from ropewkv.reference import rwkv7 as reference
from ropewkv.testing import rms_ratio, seeded
from ropewkv.testing import rwkv7 as parity
from conftest import kernel_backends
from fla_cpu import fla  # noqa: F401  (the session fixture)

FUNCTIONS = ("chunk_rwkv7", "fused_recurrent_rwkv7", "fused_mul_recurrent_rwkv7")
LOWER_BOUND = -0.6065306597126334  # -e^-0.5: RWKV7Attention's bound on its log decay
# FLA's RWKV7Attention trains with these (its tensor-core chunk scheme).
LAYER_HINTS = dict(safe_gate=True, chunk_size=64, lower_bound=LOWER_BOUND)
# RMS error vs fp64 that FLA itself reaches on these cases under the interpreter (fp32; IEEE fp32 dots there, and on a
# GPU too, where the fla fixture makes FLA's dots IEEE rather than its shipped TF32: tests/fla_cpu.py): its default
# chunk form 1.2e-7 forward, 2.3e-7 in gradients; its safe_gate form 1.2e-5 forward and 5.7e-5 in gradients.
# ropewkv: 1.1e-7 forward, 2.0e-7 in gradients.
FLA_ERROR = {"default": 1e-6, "safe_gate": 1e-4}


def fla_case(batch, seqlen, heads, n, seed, n_states=None, initial_state=True, device="cpu"):
    """FLA-convention inputs {r, w, k, v, a, b, initial_state} (state [N, H, K, V]) and the gate form {kk, a_gate}."""
    gen = seeded(seed)
    x = parity.rwkv7_inputs(batch, seqlen, heads, n, decay="log", generator=gen)
    del x["initial_state"]
    if initial_state:
        x["initial_state"] = torch.randn(n_states or batch, heads, n, n, generator=gen)
    kk = F.normalize(torch.randn(batch, seqlen, heads, n, generator=gen, dtype=torch.float64), dim=-1).float()
    a_gate = torch.rand(batch, seqlen, heads, n, generator=gen)
    return ({name: t.to(device) for name, t in x.items()},
            {name: t.to(device) for name, t in (("kk", kk), ("a", a_gate))})


def fla_oracle(x: dict, scale: float, cu_seqlens=None, reverse=False):
    """FLA's contract in fp64: (o, final state [N, H, K, V]) of leaves x (any of them may require grad)."""
    r, w, k, v, a, b = (x[n].double() for n in "rwkvab")
    s0 = x.get("initial_state")
    s0 = None if s0 is None else s0.double().transpose(-1, -2)
    if not reverse:
        y, s = reference.wkv7(r * scale, w, k, v, a, b, initial_state=s0, output_final_state=True,
                              cu_seqlens=cu_seqlens, decay="log")
        return y, s.transpose(-1, -2)
    bounds = [0, r.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    ys, states = [], []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        piece = [t[:, start:end].flip(1) for t in (r * scale, w, k, v, a, b)]
        y, s = reference.wkv7(*piece, initial_state=None if s0 is None else s0[i:i + 1] if cu_seqlens is not None
                              else s0, output_final_state=True, decay="log")
        ys.append(y.flip(1))
        states.append(s)
    return torch.cat(ys, 1), torch.cat(states).transpose(-1, -2)


def run(function, x: dict, kwargs: dict, cotangents=None):
    """(o, final state, {name: gradient} or None) of function(**x, **kwargs); gradients of <o, cot_o> + <s, cot_s>."""
    leaves = {n: t.detach().clone().requires_grad_(cotangents is not None) for n, t in x.items()}
    o, state = function(**leaves, **kwargs)
    if cotangents is None:
        return o.detach(), state.detach(), None
    loss = (o.double() * cotangents[0]).sum() + (state.double() * cotangents[1]).sum()
    return o, state, dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def compare(ours, theirs, want, our_bound, their_bound, what):
    """Both sides within their own error of fp64, and within the sum of those errors of each other."""
    for name, got, other, expected in zip(("o", "final_state"), ours[:2], theirs[:2], want[:2]):
        assert rms_ratio(got, expected) < our_bound, (what, name, "ropewkv", rms_ratio(got, expected))
        assert rms_ratio(other, expected) < their_bound, (what, name, "FLA", rms_ratio(other, expected))
        assert rms_ratio(got, other) < our_bound + their_bound, (what, name)
    if theirs[2] is None:
        return
    for name in ours[2]:
        got, other, expected = ours[2][name], theirs[2][name], want[2][name]
        assert rms_ratio(got, expected) < our_bound, (what, "d" + name, "ropewkv", rms_ratio(got, expected))
        assert rms_ratio(other, expected) < their_bound, (what, "d" + name, "FLA", rms_ratio(other, expected))
        assert rms_ratio(got, other) < our_bound + their_bound, (what, "d" + name)


def oracle_with_grads(x, scale, cotangents, cu_seqlens=None, reverse=False, gate_form=None):
    leaves = {n: t.detach().double().requires_grad_() for n, t in (gate_form or x).items()}
    inputs = dict(leaves)
    if gate_form is not None:
        inputs = {**leaves, "a": -leaves["kk"], "b": leaves["kk"] * leaves["a"]}
    o, state = fla_oracle(inputs, scale, cu_seqlens, reverse)
    loss = (o * cotangents[0]).sum() + (state * cotangents[1]).sum()
    return o, state, dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def cotangents_for(x, n_states, seed):
    gen = seeded(seed)
    batch, seqlen, heads, n = x["r"].shape
    return (torch.randn(batch, seqlen, heads, n, generator=gen, dtype=torch.float64).to(x["r"].device),
            torch.randn(n_states, heads, n, n, generator=gen, dtype=torch.float64).to(x["r"].device))


def test_signatures_are_fla_s(fla):
    """Every parameter of FLA's three functions, in order, with FLA's kinds and defaults; ours adds keyword-only
    `precision` and `backend` after them."""
    for name in FUNCTIONS:
        theirs = list(inspect.signature(getattr(fla.ops, name)).parameters.values())
        ours = list(inspect.signature(getattr(compat, name)).parameters.values())
        assert [(p.name, p.kind, p.default) for p in ours[:len(theirs)]] == \
               [(p.name, p.kind, p.default) for p in theirs], name
        assert [(p.name, p.kind) for p in ours[len(theirs):]] == \
               [("precision", inspect.Parameter.KEYWORD_ONLY), ("backend", inspect.Parameter.KEYWORD_ONLY)], name


CHUNK_CASES = {
    # name: (batch, T, cu_seqlens, initial state, FLA's hints); H = 2 heads of N = 32. FLA's default form (chunks of
    # 16) and its RWKV7Attention form (safe_gate, chunks of 64); T is never a multiple of 16.
    "varlen-T20-state": (1, 20, [0, 7, 20], True, {}),
    "batch2-T18-layer-hints": (2, 18, None, False, LAYER_HINTS),
}


@pytest.mark.parametrize("case", CHUNK_CASES)
def test_chunk_rwkv7_matches_fla(fla, device, case):
    """Ours on the default twin (the others equal it within fp32 error: tests/test_wkv7*.py)."""
    batch, seqlen, bounds, initial_state, hints = CHUNK_CASES[case]
    cu = None if bounds is None else torch.tensor(bounds, device=device)
    n_states = batch if cu is None else len(bounds) - 1
    x, _ = fla_case(batch, seqlen, 2, 32, seed=seqlen, n_states=n_states, initial_state=initial_state,
                    device=device)
    cot = cotangents_for(x, n_states, seed=1)
    kwargs = dict(output_final_state=True, cu_seqlens=cu, **hints)
    want = oracle_with_grads(x, 1.0, cot, cu)
    theirs = run(fla.ops.chunk_rwkv7, x, kwargs, cot)
    ours = run(compat.chunk_rwkv7, x, kwargs, cot)
    compare(ours, theirs, want, parity.tolerance(torch.float32, "fp32", seqlen).rms,
            FLA_ERROR["safe_gate" if hints else "default"], case)


def test_fused_recurrent_rwkv7_matches_fla_with_its_defaults(fla, device):
    """scale=None means K^-0.5 in FLA's fused_recurrent_rwkv7; FLA has no backward there, ours does."""
    bounds = [0, 5, 5, 19]
    x, _ = fla_case(1, bounds[-1], 2, 32, seed=3, n_states=3, device=device)
    cu = torch.tensor(bounds, device=device)
    cot = cotangents_for(x, 3, seed=2)
    want = oracle_with_grads(x, 32**-0.5, cot, cu)
    theirs = run(fla.ops.fused_recurrent_rwkv7, x, dict(cu_seqlens=cu))
    ours = run(compat.fused_recurrent_rwkv7, x, dict(cu_seqlens=cu), cot)
    compare(ours, theirs, want, parity.tolerance(torch.float32, "fp32", 19).rms, FLA_ERROR["default"], "fused")
    for name, got in ours[2].items():
        assert rms_ratio(got, want[2][name]) < parity.tolerance(torch.float32, "fp32", 19).rms, name


MUL_CASES = {
    # name: (batch, T, cu_seqlens, reverse): T = 1 is FLA's decode branch (IS_DECODE), ours the decode kernel.
    "decode-T1": (2, 1, None, False),
    "T20": (2, 20, None, False),
    "varlen-reverse": (1, 20, [0, 6, 20], True),
}


@pytest.mark.parametrize("case", MUL_CASES)
def test_fused_mul_recurrent_rwkv7_matches_fla(fla, device, case):
    """RWKV7Attention's inference form (a = -kk, b = kk * a), forward against FLA; our gradients against fp64."""
    batch, seqlen, bounds, reverse = MUL_CASES[case]
    cu = None if bounds is None else torch.tensor(bounds, device=device)
    n_states = batch if cu is None else len(bounds) - 1
    x, gate = fla_case(batch, seqlen, 2, 32, seed=4, n_states=n_states, device=device)
    x_mul = {"r": x["r"], "w": x["w"], "k": x["k"], "v": x["v"], **gate, "initial_state": x["initial_state"]}
    kwargs = dict(output_final_state=True, reverse=reverse, cu_seqlens=cu)
    cot = cotangents_for(x, n_states, seed=5)
    want = oracle_with_grads(x, 1.0, cot, cu, reverse, gate_form=x_mul)
    with torch.no_grad():
        theirs = run(fla.ops.fused_mul_recurrent_rwkv7, x_mul, kwargs)
        ours_no_grad = run(compat.fused_mul_recurrent_rwkv7, x_mul, kwargs)
    ours = run(compat.fused_mul_recurrent_rwkv7, x_mul, kwargs, cot)
    bound = parity.tolerance(torch.float32, "fp32", seqlen).rms
    compare(ours_no_grad, theirs, want, bound, FLA_ERROR["default"], case)
    compare(ours, ours_no_grad, want, bound, bound, case)
    for name, got in ours[2].items():
        assert rms_ratio(got, want[2][name]) < bound, (case, "d" + name)


@pytest.mark.parametrize("seqlen", [1, 6])
def test_fused_mul_recurrent_rwkv7_in_bf16_keeps_the_state_fp32(fla, device, seqlen):
    """bf16 inputs, as a patched bf16 model without autocast decodes: b = kk * a is taken in fp32, as FLA's kernel does
    (rounded to bf16 first, the final state was 1.2e-4 .. 2.7e-4 from fp64 against FLA's 4e-8 .. 7e-8)."""
    x, gate = fla_case(2, seqlen, 2, 32, seed=6, device=device)
    x_mul = {"r": x["r"], "w": x["w"], "k": x["k"], "v": x["v"], **gate}
    x_mul = {n: t.to(torch.bfloat16) for n, t in x_mul.items()}
    x_mul["initial_state"] = x["initial_state"]
    want = oracle_with_grads({}, 1.0, cotangents_for(x, 2, seed=7), gate_form=x_mul)
    kwargs = dict(output_final_state=True)
    with torch.no_grad():
        theirs = run(fla.ops.fused_mul_recurrent_rwkv7, x_mul, kwargs)
        ours = run(compat.fused_mul_recurrent_rwkv7, x_mul, kwargs)
    assert ours[0].dtype == torch.bfloat16 and ours[1].dtype == torch.float32
    bound = parity.tolerance(torch.float32, "fp32", seqlen).rms  # the state: fp32 accuracy
    assert rms_ratio(ours[1], want[1]) < bound and rms_ratio(theirs[1], want[1]) < bound
    assert rms_ratio(ours[0], want[0]) < parity.tolerance(torch.bfloat16, "fp32", seqlen).rms


def test_lower_bound_is_checked_against_the_decays(fla):
    x, _ = fla_case(1, 6, 1, 32, seed=6)
    x["w"] = LOWER_BOUND * torch.ones_like(x["w"])  # FLA's layer at a saturated sigmoid: rounds below -e^-0.5
    assert x["w"].min().item() < LOWER_BOUND
    compat.chunk_rwkv7(**x, lower_bound=LOWER_BOUND)  # the bound rounded to w's dtype, as FLA's layer computes it
    x["w"][0, 3, 0, 5] = -0.7
    with pytest.raises(ValueError, match=r"w must lie in \[lower_bound, 0\]"):
        compat.chunk_rwkv7(**x, lower_bound=LOWER_BOUND)
    x["w"][0, 3, 0, 5] = 0.01  # a decay above 1
    with pytest.raises(ValueError, match=r"w must lie in \[lower_bound, 0\]"):
        compat.chunk_rwkv7(**x, lower_bound=LOWER_BOUND)
    with pytest.raises(ValueError, match="lower_bound must be negative"):
        compat.chunk_rwkv7(**x, lower_bound=0.0)


def test_context_parallel_and_cpu_offsets_hints(fla):
    from fla.ops.cp import FLACPContext

    x, _ = fla_case(1, 6, 1, 32, seed=7, initial_state=False)
    with pytest.raises(NotImplementedError, match="wkv7_sequence_parallel"):
        compat.chunk_rwkv7(**x, cp_context=FLACPContext(cu_seqlens=torch.tensor([0, 6])))
    with pytest.raises(ValueError, match="cu_seqlens_cpu must be the CPU copy of cu_seqlens"):
        compat.chunk_rwkv7(**x, cu_seqlens_cpu=torch.tensor([0, 6]))
    o, _ = compat.chunk_rwkv7(**x, cu_seqlens=torch.tensor([0, 2, 6]), cu_seqlens_cpu=torch.tensor([0, 2, 6]),
                              safe_gate=True, chunk_size=16, disable_recompute=True)
    torch.testing.assert_close(o, compat.chunk_rwkv7(**x, cu_seqlens=torch.tensor([0, 2, 6]))[0], rtol=0, atol=0)


def test_fla_layer_dtypes_under_autocast(device):
    """FLA's RWKV7Attention under autocast passes bf16 r, w, k, v and fp32 a, b (kk normalised in fp32): FLA's kernels
    read each at its own precision, and so does the drop-in (r..b widened to fp32 exactly, o in r's dtype)."""
    x, _ = fla_case(1, 12, 2, 32, seed=8, device=device)
    mixed = {n: (t.bfloat16() if n in "rwkv" else t) for n, t in x.items()}
    for backend in kernel_backends(device):
        o, state = compat.chunk_rwkv7(**mixed, output_final_state=True, backend=backend)
        want_o, want_state = fla_oracle(mixed, 1.0)
        assert o.dtype == torch.bfloat16 and state.dtype == torch.float32
        assert rms_ratio(o, want_o) < parity.tolerance(torch.bfloat16, "fp32", 12).rms, backend
        assert rms_ratio(state, want_state) < parity.tolerance(torch.float32, "fp32", 12).rms, backend


def test_defaults_follow_fla():
    x, _ = fla_case(1, 6, 1, 32, seed=9, initial_state=False)
    o, s = compat.chunk_rwkv7(**x)
    assert s is None  # chunk_rwkv7: output_final_state=False, scale=1.0
    want, _ = fla_oracle(x, 1.0)
    assert rms_ratio(o, want) < 1e-6
    o2, s2 = compat.fused_recurrent_rwkv7(**x)  # FLA's defaults: scale K^-0.5, final state returned
    assert s2 is not None and rms_ratio(o2, want * 32**-0.5) < 1e-6
