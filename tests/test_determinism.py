"""Gradients (fp64 gradcheck on the CPU twin), bitwise determinism on every twin, and no memory growth.

gradcheck cases already in test_rope.py (functional rope: bshd, offsets, interleaved; apply_rotary_pos_emb) and
test_decay.py (rwkv7_log_decay) are not repeated. wkv7_step is inference-only (no backward).
"""
import resource

import pytest
import torch

import ropewkv
from ropewkv.ops.rope import apply_rotary_pos_emb, rope
from ropewkv.ops.rwkv7 import wkv7, wkv7_step
from ropewkv.testing import seeded
from ropewkv.testing.rope import rope_input, rope_inv_freq
from ropewkv.testing.rwkv7 import rwkv7_inputs
from conftest import kernel_backends as _kernel_backends


def kernel_backends(device) -> list:
    """conftest's twins, asserted non-empty: a loop over no backend would pass the tests below vacuously."""
    backends = _kernel_backends(device)
    assert backends, f"no kernel twin runs on {device} here"
    return backends

NAMES = ("r", "w", "k", "v", "a", "b")

# ---------------------------------------------------------------------------------------------------------------------
# gradcheck, fp64, CPU twin


def test_gradcheck_inplace_rope():
    """The in-place op's autograd (mark_dirty + the conjugate rotation), bhsd views, partial rotary."""
    gen = seeded(20)
    q = rope_input(1, 3, 2, 12, torch.float64, "bhsd", gen).requires_grad_()
    k = rope_input(1, 3, 1, 12, torch.float64, "bhsd", gen).requires_grad_()
    inv = rope_inv_freq(8)

    def inplace(a, b):
        return rope(a.clone(), b.clone(), inv_freq=inv, layout="bhsd", inplace=True, backend="cpu",
                    positions=torch.tensor([5, 0, 77]))

    assert torch.autograd.gradcheck(inplace, (q, k))


def test_gradcheck_rope_varlen_positions():
    gen = seeded(21)
    q = rope_input(1, 5, 2, 8, torch.float64, "thd", gen).requires_grad_()
    cu, positions = torch.tensor([0, 2, 5]), torch.tensor([3, 9, 1, 4, 100000])
    assert torch.autograd.gradcheck(
        lambda a: rope(a, inv_freq=rope_inv_freq(8), layout="thd", cu_seqlens=cu, positions=positions,
                       seqlen_offsets=torch.tensor([1, 2]), backend="cpu"), (q,))


@pytest.mark.parametrize("decay", ["loglog", "raw", "log"])
def test_gradcheck_wkv7_initial_and_final_state_varlen(decay):
    """Every input and initial_state, through y and final_state, two packed sequences. fast_mode (random
    projections of the Jacobian) keeps it to ~1 s; the full Jacobian of these 2.8k inputs takes ~40 s."""
    x = rwkv7_inputs(1, 4, 1, 32, torch.float64, decay, seeded(22))
    leaves = [x[n].requires_grad_() for n in NAMES]
    s0 = torch.randn(2, 1, 32, 32, dtype=torch.float64, generator=seeded(23)).requires_grad_()
    cu = torch.tensor([0, 1, 4])
    assert torch.autograd.gradcheck(
        lambda *t: wkv7(*t[:6], initial_state=t[6], output_final_state=True, cu_seqlens=cu, decay=decay,
                        backend="cpu"), (*leaves, s0), fast_mode=True)


# ---------------------------------------------------------------------------------------------------------------------
# Bitwise determinism: 10 runs, same bits (no order-dependent atomics in any twin).

RUNS = 10


def _rope_case(device, backend):
    big = backend != "triton" or device.type == "cuda"  # the interpreter is slow: small there
    gen = seeded(24)
    q = rope_input(2, 64 if big else 4, 4, 64, torch.bfloat16, "bshd", gen, device).requires_grad_()
    k = rope_input(2, 64 if big else 4, 2, 64, torch.bfloat16, "bshd", gen, device).requires_grad_()
    cos = torch.randn(2, q.shape[1], 64, generator=gen).to(device)

    def run():
        oq, ok = rope(q, k, inv_freq=rope_inv_freq(64, device=device), seqlen_offsets=1000, backend=backend)
        grads = torch.autograd.grad((oq, ok), (q, k), (torch.ones_like(oq), ok))
        hq, hk = apply_rotary_pos_emb(q.detach(), k.detach(), cos, cos.flip(-1), 2, backend=backend)
        return oq, ok, *grads, hq, hk

    return run


def _wkv7_case(device, backend):
    big = backend != "triton" or device.type == "cuda"
    x = rwkv7_inputs(2, 33 if big else 5, 4 if big else 1, 64 if big else 32, torch.bfloat16, "raw", seeded(25),
                     device, initial_state=True)
    leaves = [x[n].requires_grad_() for n in NAMES] + [x["initial_state"].requires_grad_()]

    def run():
        y, final = wkv7(*leaves[:6], initial_state=leaves[6], output_final_state=True, decay="raw", backend=backend)
        grads = torch.autograd.grad((y, final), leaves, (y, final))
        state = x["initial_state"].detach().clone()  # the step has no backward: it refuses inputs that need one
        y_step = wkv7_step(*(t.detach()[:, 0] for t in leaves[:6]), state, decay="raw", backend=backend)
        return y, final, *grads, y_step, state, ropewkv.rwkv7_log_decay(x["w"], backend=backend)

    return run


@pytest.mark.parametrize("make", [_rope_case, _wkv7_case], ids=["rope", "wkv7"])
def test_bitwise_deterministic(device, make):
    for backend in kernel_backends(device):
        run = make(device, backend)
        first = [t.detach().clone() for t in run()]
        for _ in range(RUNS - 1):
            again = run()
            for i, (a, b) in enumerate(zip(first, again)):
                assert torch.equal(a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b), \
                    f"{backend}: output {i} differs between runs"


# ---------------------------------------------------------------------------------------------------------------------
# No memory growth over 10,000 calls.

CALLS = 10_000


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _calls(device):
    """(name, call) pairs, each allocating outputs of >= 2 KiB, so that a leak of one output per call would grow by
    >= 20 MiB, far above the allocator noise bound below."""
    q = rope_input(1, 4, 2, 64, torch.float32, "bshd", seeded(26), device).requires_grad_()
    inv = rope_inv_freq(64, device=device)
    x = rwkv7_inputs(1, 3, 1, 32, torch.float32, "loglog", seeded(27), device, initial_state=True)
    leaves = [x[n].requires_grad_() for n in NAMES]
    state = x["initial_state"]

    def rope_fwd_bwd():
        rope(q, inv_freq=inv, seqlen_offsets=3).sum().backward()

    def wkv7_fwd_bwd():
        y, final = wkv7(*leaves, initial_state=state, output_final_state=True)
        (y.sum() + final.sum()).backward()

    def step():
        wkv7_step(*(t.detach()[:, 0] for t in leaves), state.clone())

    return [("rope", rope_fwd_bwd), ("wkv7", wkv7_fwd_bwd), ("wkv7_step", step)]


@pytest.mark.parametrize("index", range(3), ids=["rope", "wkv7", "wkv7_step"])
def test_no_memory_growth(device, index):
    name, call = _calls(device)[index]
    if device.type == "cpu" and "cpu" not in kernel_backends(device):
        pytest.skip("the CPU twin is not built")
    for _ in range(200):  # warm-up: allocator caches, lazy imports, autograd graph pools
        call()
    measure = torch.cuda.memory_allocated if device.type == "cuda" else _rss_bytes
    before = measure()
    for _ in range(CALLS):
        call()
    growth = measure() - before
    # CUDA: the caching allocator returns every block, so allocated memory is back to the same byte count.
    # CPU: RSS moves with malloc's arenas and page reuse; 4 MiB is far below the 20 MiB one leaked output would cost.
    bound = 0 if device.type == "cuda" else 4 << 20
    assert growth <= bound, f"{name}: memory grew by {growth} bytes over {CALLS} calls"
