"""Bad input to every public op, on every kernel twin: a specific exception naming the argument, raised before any
kernel runs; zero-size inputs work; NaN/Inf propagate exactly as in the fp64 reference.

"Before any kernel" is checked with a dispatch mode that records every ropewkv:: operator call (the C++ twins and the
opaque Triton custom ops all go through the dispatcher). A meta-device tensor stands in for "another device".
"""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ropewkv
from ropewkv.nn import RotaryEmbedding
from ropewkv.ops.rope import apply_rotary_pos_emb, rope
from ropewkv.ops.rwkv7 import wkv7, wkv7_step
from ropewkv.reference import rope as rope_ref
from ropewkv.reference import rwkv7 as rwkv7_ref
from ropewkv.testing import poisoned_outputs, rms_ratio, seeded
from ropewkv.testing.rope import rope_input, rope_inv_freq
from ropewkv.testing.rwkv7 import rwkv7_inputs
from conftest import kernel_backends

META = torch.device("meta")


class KernelCalls(TorchDispatchMode):
    """Records the ropewkv:: operators dispatched while active."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "ropewkv":
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------------------------------
# Valid baselines; each case changes one argument.


def _rope(dev, backend, **changes):
    q = rope_input(2, 4, 2, 8, torch.float32, generator=seeded(0), device=dev)
    k = rope_input(2, 4, 1, 8, torch.float32, generator=seeded(1), device=dev)
    kwargs = dict(inv_freq=rope_inv_freq(8, device=dev), backend=backend)
    q, k = changes.pop("q", q), changes.pop("k", k)
    kwargs.update(changes)
    return lambda: rope(q, k, **kwargs)


def _rope_inplace_aliased(dev, backend, k_of_q):
    """rope in place with k a view of q's memory."""
    q = _t(2, 4, 2, 8, dev=dev)
    return _rope(dev, backend, q=q, k=k_of_q(q), inplace=True)


def _rope_shifted_by_a_token(dev, backend):
    """rope in place with q and k views of one buffer, k one token later: token t + 1 of q is token t of k."""
    tokens = _t(2, 5, 2, 8, dev=dev)
    return _rope(dev, backend, q=tokens[:, :-1], k=tokens[:, 1:], inplace=True)


def _rope_thd(dev, backend, **changes):
    q = rope_input(1, 6, 2, 8, torch.float32, layout="thd", generator=seeded(0), device=dev)
    kwargs = dict(inv_freq=rope_inv_freq(8, device=dev), layout="thd", backend=backend,
                  cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.int32, device=dev))
    kwargs.update(changes)
    return lambda: rope(q, **kwargs)


def _hf(dev, backend, **changes):
    q = rope_input(2, 4, 2, 8, torch.float32, layout="bhsd", generator=seeded(0), device=dev)
    args = dict(q=q, k=q[:, :1], cos=torch.ones(2, 4, 8, device=dev), sin=torch.zeros(2, 4, 8, device=dev))
    args.update(changes)
    return lambda: apply_rotary_pos_emb(args["q"], args["k"], args["cos"], args["sin"], args.get("unsqueeze_dim", 1),
                                        backend=backend)


def _wkv(dev, backend, n=32, batch=1, **changes):
    x = rwkv7_inputs(batch, 5, 2, n, generator=seeded(2), device=dev)
    tensors = {name: changes.pop(name, x[name]) for name in ("r", "w", "k", "v", "a", "b")}
    return lambda: wkv7(*tensors.values(), backend=backend, **changes)


def _step(dev, backend, **changes):
    x = {name: t[:, 0] for name, t in rwkv7_inputs(2, 1, 2, 32, generator=seeded(3), device=dev).items()
         if t is not None}
    state = changes.pop("state", torch.zeros(2, 2, 32, 32, device=dev))
    tensors = {name: changes.pop(name, x[name]) for name in ("r", "w", "k", "v", "a", "b")}
    return lambda: wkv7_step(*tensors.values(), state, backend=backend, **changes)


def _t(*shape, dtype=torch.float32, dev="cpu"):
    return torch.ones(shape, dtype=dtype, device=dev)


def _idx(values, dev, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=dev)


# (id, make(dev, backend) -> call, exception, message pattern naming the argument, applies(backend, dev) or None)
KERNEL_ONLY_FP32 = lambda backend, dev: backend not in ("cpu", "reference")  # noqa: E731 (fp64 runs on cpu twin)
HOST_CHECKED = lambda backend, dev: dev.type == "cpu"  # noqa: E731 (rope trusts CUDA index values: no sync)
POSITIONS_INEXACT = r"positions plus seqlen_offsets must be within \(-2\^24, 2\^24\)"
CASES = [
    # --- ropewkv.rope
    ("rope-q-not-tensor", lambda d, b: _rope(d, b, q=[1.0]), TypeError, "q must be a torch.Tensor", None),
    ("rope-q-int", lambda d, b: _rope(d, b, q=_t(2, 4, 2, 8, dtype=torch.int32, dev=d)), TypeError,
     "q must have dtype", None),
    ("rope-q-fp64", lambda d, b: _rope(d, b, q=_t(2, 4, 2, 8, dtype=torch.float64, dev=d)), TypeError,
     "q must have dtype", KERNEL_ONLY_FP32),
    ("rope-k-mixed-dtype", lambda d, b: _rope(d, b, k=_t(2, 4, 1, 8, dtype=torch.bfloat16, dev=d)), TypeError,
     "k must have q's dtype", None),
    ("rope-k-device", lambda d, b: _rope(d, b, k=_t(2, 4, 1, 8, dev=META)), ValueError, "k is on meta", None),
    ("rope-inv-freq-device", lambda d, b: _rope(d, b, inv_freq=_t(4, dev=META)), ValueError, "inv_freq is on meta",
     None),
    ("rope-positions-device", lambda d, b: _rope(d, b, positions=_idx([0, 1, 2, 3], META)), ValueError,
     "positions is on meta", None),
    ("rope-q-rank", lambda d, b: _rope(d, b, q=_t(2, 4, 8, dev=d), k=None), ValueError, "q must have 4 dims", None),
    ("rope-k-shape", lambda d, b: _rope(d, b, k=_t(2, 5, 1, 8, dev=d)), ValueError, "k .* must match q", None),
    ("rope-odd-rotary-dim", lambda d, b: _rope(d, b, rotary_dim=3), ValueError, "rotary_dim", None),
    ("rope-rotary-dim-too-big", lambda d, b: _rope(d, b, inv_freq=rope_inv_freq(16, device=d)), ValueError,
     "rotary_dim 16 .* exceeds head_dim 8", None),
    ("rope-inv-freq-int", lambda d, b: _rope(d, b, inv_freq=_idx([1, 2, 3, 4], d)), TypeError, "inv_freq must be",
     None),
    ("rope-layout", lambda d, b: _rope(d, b, layout="bsdh"), ValueError, "layout must be one of", None),
    ("rope-precision", lambda d, b: _rope(d, b, precision="fp8"), ValueError, "precision must be one of", None),
    ("rope-backend", lambda d, b: _rope(d, "gpu"), ValueError, "backend must be one of", None),
    ("rope-positions-float", lambda d, b: _rope(d, b, positions=_t(4, dev=d)), TypeError,
     "positions must have dtype int32 or int64", None),
    ("rope-positions-shape", lambda d, b: _rope(d, b, positions=_idx([0, 1, 2], d)), ValueError,
     "positions of shape", None),
    ("rope-positions-past-int32", lambda d, b: _rope(d, b, positions=_idx([0, 1, 2, 2**40], d, torch.int64)),
     ValueError, POSITIONS_INEXACT, HOST_CHECKED),
    # (-2^63's abs() is -2^63: a check of abs().max() let it through, and the rotation came out as inf.)
    ("rope-positions-int64-min", lambda d, b: _rope(d, b, positions=_idx([0, 1, 2, -2**63], d, torch.int64)),
     ValueError, POSITIONS_INEXACT, HOST_CHECKED),
    ("rope-positions-plus-offset", lambda d, b: _rope(d, b, positions=_idx([0, 1, 2, 2**24 - 1], d),
                                                      seqlen_offsets=1), ValueError, POSITIONS_INEXACT, HOST_CHECKED),
    ("rope-offset-tensor-past", lambda d, b: _rope(d, b, seqlen_offsets=_idx([0, 2**40], d, torch.int64)),
     ValueError, POSITIONS_INEXACT, HOST_CHECKED),
    ("rope-thd-offset-tensor-past",
     lambda d, b: _rope_thd(d, b, seqlen_offsets=_idx([0, 2**24 - 3], d, torch.int64)), ValueError, POSITIONS_INEXACT,
     HOST_CHECKED),
    ("rope-offset-negative", lambda d, b: _rope(d, b, seqlen_offsets=-1), ValueError, "seqlen_offsets must be >= 0",
     None),
    ("rope-offset-past-int32", lambda d, b: _rope(d, b, seqlen_offsets=2**33), ValueError, POSITIONS_INEXACT, None),
    ("rope-offset-plus-tokens", lambda d, b: _rope(d, b, seqlen_offsets=2**24 - 3), ValueError, POSITIONS_INEXACT,
     None),
    # (with positions on a GPU, whose values go unchecked, the int offset alone is still checked)
    ("rope-positions-and-offset-past", lambda d, b: _rope(d, b, positions=_idx([0, 1, 2, 3], d), seqlen_offsets=2**24),
     ValueError, POSITIONS_INEXACT, None),
    ("rope-offset-float", lambda d, b: _rope(d, b, seqlen_offsets=1.5), TypeError, "seqlen_offsets must be an int",
     None),
    ("rope-offset-shape", lambda d, b: _rope(d, b, seqlen_offsets=_idx([1, 2, 3], d)), ValueError,
     "seqlen_offsets must be an int or a \\[2\\] tensor", None),
    ("rope-inplace-strided", lambda d, b: _rope(d, b, q=_t(2, 4, 2, 16, dev=d)[..., ::2], k=None, inplace=True),
     ValueError, "inplace=True needs q", None),
    ("rope-inplace-expanded-k", lambda d, b: _rope(d, b, k=_t(2, 4, 1, 8, dev=d).expand(2, 4, 3, 8), inplace=True),
     ValueError, "inplace=True needs k whose elements do not share memory", None),
    ("rope-inplace-k-is-q", lambda d, b: _rope_inplace_aliased(d, b, lambda q: q), ValueError,
     "inplace=True needs q and k in separate memory", None),
    ("rope-inplace-k-a-head-of-q", lambda d, b: _rope_inplace_aliased(d, b, lambda q: q[:, :, 1:]), ValueError,
     "inplace=True needs q and k in separate memory", None),
    ("rope-inplace-k-q-shifted-by-a-token", _rope_shifted_by_a_token, ValueError,
     "inplace=True needs q and k in separate memory", None),
    ("rope-inv-freq-requires-grad", lambda d, b: _rope(d, b, inv_freq=rope_inv_freq(8, device=d).requires_grad_()),
     NotImplementedError, "inv_freq gets no gradient", None),
    ("rope-cu-not-thd", lambda d, b: _rope(d, b, cu_seqlens=_idx([0, 4], d)), ValueError,
     "cu_seqlens needs layout='thd'", None),
    ("rope-cu-decreasing", lambda d, b: _rope_thd(d, b, cu_seqlens=_idx([0, 4, 2, 6], d)), ValueError,
     "cu_seqlens must start at 0 and be non-decreasing", HOST_CHECKED),
    ("rope-cu-end", lambda d, b: _rope_thd(d, b, cu_seqlens=_idx([0, 2, 5], d)), ValueError,
     "cu_seqlens\\[-1\\] = 5 does not match .* T = 6", HOST_CHECKED),
    ("rope-cu-dtype", lambda d, b: _rope_thd(d, b, cu_seqlens=_t(3, dev=d)), TypeError,
     "cu_seqlens must have dtype int32 or int64", None),
    ("rope-cu-device", lambda d, b: _rope_thd(d, b, cu_seqlens=_idx([0, 2, 6], META)), ValueError,
     "cu_seqlens is on meta", None),
    ("rope-cu-rank", lambda d, b: _rope_thd(d, b, cu_seqlens=_idx([[0, 6]], d)), ValueError,
     "cu_seqlens must be 1-D", None),
    # --- ropewkv.apply_rotary_pos_emb
    ("hf-q-int", lambda d, b: _hf(d, b, q=_t(2, 2, 4, 8, dtype=torch.int64, dev=d)), TypeError, "q must have dtype",
     None),
    ("hf-cos-int", lambda d, b: _hf(d, b, cos=_t(2, 4, 8, dtype=torch.int32, dev=d)), TypeError,
     "cos must be a float tensor", None),
    ("hf-sin-device", lambda d, b: _hf(d, b, sin=_t(2, 4, 8, dev=META)), ValueError, "sin is on meta", None),
    ("hf-cos-sin-shapes", lambda d, b: _hf(d, b, sin=_t(2, 4, 6, dev=d)), ValueError,
     "cos .* and sin .* must have the same shape", None),
    ("hf-odd-rotary", lambda d, b: _hf(d, b, cos=_t(2, 4, 3, dev=d), sin=_t(2, 4, 3, dev=d)), ValueError,
     "rotary_dim\\) must be even", None),
    ("hf-cos-too-wide", lambda d, b: _hf(d, b, cos=_t(2, 4, 10, dev=d), sin=_t(2, 4, 10, dev=d)), ValueError,
     "<= head_dim 8", None),
    ("hf-q-rank", lambda d, b: _hf(d, b, q=_t(2, 4, 8, dev=d)), ValueError, "q and k must be 4-D", None),
    ("hf-k-head-dim", lambda d, b: _hf(d, b, k=_t(2, 1, 4, 16, dev=d)), ValueError,
     "k's head_dim 16 must equal q's 8", None),
    ("hf-no-broadcast", lambda d, b: _hf(d, b, cos=_t(2, 5, 8, dev=d), sin=_t(2, 5, 8, dev=d)), ValueError,
     "do not broadcast to q", None),
    ("hf-unsqueeze-dim", lambda d, b: _hf(d, b, unsqueeze_dim=3), ValueError, "unsqueeze_dim=3", None),
    # --- ropewkv.wkv7
    ("wkv7-r-int", lambda d, b: _wkv(d, b, r=_t(1, 5, 2, 32, dtype=torch.int32, dev=d)), TypeError,
     "r must have dtype", None),
    ("wkv7-fp64", lambda d, b: _wkv(d, b, **{n: _t(1, 5, 2, 32, dtype=torch.float64, dev=d) for n in "rwkvab"}),
     TypeError, "r must have dtype", KERNEL_ONLY_FP32),
    ("wkv7-mixed-dtype", lambda d, b: _wkv(d, b, b=_t(1, 5, 2, 32, dtype=torch.bfloat16, dev=d)), TypeError,
     "b has dtype torch.bfloat16 but r has torch.float32", None),
    ("wkv7-w-int", lambda d, b: _wkv(d, b, w=_t(1, 5, 2, 32, dtype=torch.int32, dev=d)), TypeError,
     "w must have dtype", None),
    ("wkv7-mask-shape", lambda d, b: _wkv(d, b, mask=_t(1, 4, dev=d)), ValueError, "mask must have shape", None),
    ("wkv7-mask-device", lambda d, b: _wkv(d, b, mask=_t(1, 5, dev=META)), ValueError, "mask is on meta", None),
    ("wkv7-state-broadcast-shape", lambda d, b: _wkv(d, b, batch=3, initial_state=_t(2, 2, 32, 32, dev=d)),
     ValueError, "initial_state must have shape \\[3, 2, 32, 32\\] or \\[1, 2, 32, 32\\]", None),
    ("wkv7-device", lambda d, b: _wkv(d, b, a=_t(1, 5, 2, 32, dev=META)), ValueError, "a is on meta", None),
    ("wkv7-rank", lambda d, b: _wkv(d, b, **{n: _t(5, 2, 32, dev=d) for n in "rwkvab"}), ValueError,
     "r must have shape \\[B, T, H, N\\]", None),
    ("wkv7-shape", lambda d, b: _wkv(d, b, v=_t(1, 4, 2, 32, dev=d)), ValueError, "v has shape", None),
    ("wkv7-head-size", lambda d, b: _wkv(d, b, n=48), ValueError, "head size N = 48", None),
    ("wkv7-decay", lambda d, b: _wkv(d, b, decay="exp"), ValueError, "decay must be one of", None),
    ("wkv7-precision", lambda d, b: _wkv(d, b, precision="tf32"), ValueError, "precision must be one of", None),
    ("wkv7-state-shape", lambda d, b: _wkv(d, b, initial_state=_t(1, 2, 32, 16, dev=d)), ValueError,
     "initial_state must have shape", None),
    ("wkv7-state-dtype", lambda d, b: _wkv(d, b, initial_state=_t(1, 2, 32, 32, dtype=torch.bfloat16, dev=d)),
     TypeError, "initial_state must be torch.float32", None),
    ("wkv7-state-device", lambda d, b: _wkv(d, b, initial_state=_t(1, 2, 32, 32, dev=META)), ValueError,
     "initial_state is on meta", None),
    ("wkv7-cu-batch", lambda d, b: _wkv(d, b, batch=2, cu_seqlens=_idx([0, 5], d)), ValueError,
     "cu_seqlens needs packed sequences with batch size 1", None),
    ("wkv7-cu-decreasing", lambda d, b: _wkv(d, b, cu_seqlens=_idx([0, 3, 1, 5], d)), ValueError,
     "cu_seqlens must be non-decreasing", None),
    ("wkv7-cu-end", lambda d, b: _wkv(d, b, cu_seqlens=_idx([0, 3, 4], d)), ValueError,
     "cu_seqlens must be non-decreasing from 0 to T = 5", None),
    ("wkv7-cu-dtype", lambda d, b: _wkv(d, b, cu_seqlens=_t(3, dev=d)), TypeError, "cu_seqlens must be int32",
     None),
    ("wkv7-cu-device", lambda d, b: _wkv(d, b, cu_seqlens=_idx([0, 5], META)), ValueError, "cu_seqlens is on meta",
     None),
    ("wkv7-cu-state-count", lambda d, b: _wkv(d, b, cu_seqlens=_idx([0, 2, 5], d),
                                              initial_state=_t(3, 2, 32, 32, dev=d)), ValueError,
     "initial_state must have shape \\[2, 2, 32, 32\\]", None),
    # --- ropewkv.wkv7_step
    ("step-rank", lambda d, b: _step(d, b, **{n: _t(2, 1, 2, 32, dev=d) for n in "rwkvab"}), ValueError,
     "r must have shape \\[B, H, N\\]", None),
    ("step-mixed-dtype", lambda d, b: _step(d, b, k=_t(2, 2, 32, dtype=torch.float16, dev=d)), TypeError,
     "k has dtype", None),
    ("step-state-shape", lambda d, b: _step(d, b, state=_t(2, 2, 32, dev=d)), ValueError, "state must have shape",
     None),
    ("step-precision", lambda d, b: _step(d, b, precision="fp16"), ValueError, "precision must be one of", None),
    ("step-state-dtype", lambda d, b: _step(d, b, state=_t(2, 2, 32, 32, dtype=torch.bfloat16, dev=d)), TypeError,
     "state must be torch.float32", None),
    ("step-state-strided", lambda d, b: _step(d, b, state=_t(2, 2, 32, 32, dev=d).transpose(2, 3)), ValueError,
     "state must be contiguous", None),
    ("step-state-device", lambda d, b: _step(d, b, state=_t(2, 2, 32, 32, dev=META)), ValueError,
     "state is on meta", None),
    ("step-head-size", lambda d, b: _step(d, b, **{n: _t(2, 2, 24, dev=d) for n in "rwkvab"},
                                          state=_t(2, 2, 24, 24, dev=d)), ValueError, "head size N = 24", None),
    # --- ropewkv.rwkv7_log_decay (int / non-tensor / fp64-on-triton are in test_decay.py)
    ("decay-backend", lambda d, b: (lambda: ropewkv.rwkv7_log_decay(_t(3, dev=d), backend="tpu")), ValueError,
     "backend must be one of", None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_bad_input_raises_before_any_kernel(device, case, warm):
    """warm: valid calls of rope, apply_rotary_pos_emb and wkv7_step first, so that their decode fast paths have
    accepted the backend (ropewkv/ops/rope.py): the bad call must still raise the general path's error."""
    _, make, exception, pattern, applies = case
    ran = 0
    for backend in kernel_backends(device):
        if applies is not None and not applies(backend, device):
            continue
        if warm and not (backend == "triton" and device.type == "cpu"):  # that one has no fast path
            for valid in (_rope, _hf, _step):
                valid(device, backend)()
        call = make(device, backend)
        with KernelCalls() as mode, pytest.raises(exception, match=pattern):
            call()
        assert mode.calls == [], f"{backend}: a kernel ran before the error: {mode.calls}"
        ran += 1
    if not ran:
        pytest.skip(f"case does not apply to {device.type} backends {kernel_backends(device)} (see its condition)")


def test_kernel_call_recorder_sees_kernels(device):
    """The no-kernel assertion above can fail: valid calls are recorded on every twin."""
    for backend in kernel_backends(device):
        for make in (_rope, _hf, _wkv, _step):
            with KernelCalls() as mode:
                make(device, backend)()
            assert mode.calls, (backend, make.__name__)


def test_rotary_embedding_bad_dim():
    with pytest.raises(ValueError, match="dim"):
        RotaryEmbedding(7)


# ---------------------------------------------------------------------------------------------------------------------
# Zero-size inputs work and return empty results.


def test_rope_zero_heads(device):
    """Zero heads (B = 0 and S = 0 are in test_rope.py)."""
    shape = (2, 4, 0, 8)
    q = torch.empty(shape, device=device, dtype=torch.bfloat16)
    inv_freq = rope_inv_freq(8, device=device)
    for backend in kernel_backends(device):
        out_q, out_k = rope(q, q.clone(), inv_freq=inv_freq, backend=backend)
        assert out_q.shape == shape and out_k.shape == shape and out_q.dtype == torch.bfloat16
        assert rope(q, inv_freq=inv_freq, inplace=True, backend=backend) is q
        cos = torch.ones(shape[0], shape[1], 8, device=device)
        out_q, _ = apply_rotary_pos_emb(q, q, cos, cos, unsqueeze_dim=2, backend=backend)
        assert out_q.shape == shape


def test_rope_positions_just_under_2_24_are_taken(device):
    """The largest offset belongs to the shorter sequence: the longest sequence's length plus the largest offset
    passes 2^24, but no position does (the host check computes them exactly there instead of refusing)."""
    q = rope_input(1, 10, 1, 16, torch.float32, layout="thd", generator=seeded(5), device=device)
    cu = torch.tensor([0, 4, 10], device=device)
    offsets = torch.tensor([2**24 - 4, 2**24 - 6], device=device)
    positions = rope_ref.token_positions(1, 10, None, offsets, cu)
    assert int(positions.max()) == 2**24 - 1
    expected = rope_ref.rope(q.double(), rope_inv_freq(16), positions, layout="thd")
    for backend in kernel_backends(device):
        with poisoned_outputs():
            out = rope(q, inv_freq=rope_inv_freq(16, device=device), cu_seqlens=cu, seqlen_offsets=offsets,
                       layout="thd", backend=backend)
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6)  # measured 4.3e-7 (cpu twin)
        # M-RoPE with three equal rows of positions is plain RoPE: the same exact check per row (it raised a
        # RuntimeError for [3, T] positions near the limit), then one past it refused.
        rows = (torch.arange(10) - torch.tensor([0] * 4 + [4] * 6)).expand(3, 10).to(device)
        mrope = dict(inv_freq=rope_inv_freq(16, device=device), cu_seqlens=cu, seqlen_offsets=offsets,
                     mrope_section=[4, 2, 2], layout="thd", backend=backend)
        torch.testing.assert_close(rope(q, positions=rows, **mrope), out, rtol=0, atol=0)
        with pytest.raises(ValueError, match=POSITIONS_INEXACT):
            rope(q, positions=rows + torch.tensor([[0], [1], [0]], device=device), **mrope)


def test_rope_thd_with_empty_sequences(device):
    q = rope_input(1, 5, 2, 8, torch.float32, layout="thd", generator=seeded(4), device=device)
    cu = torch.tensor([0, 0, 3, 3, 5], dtype=torch.int32, device=device)
    expected = rope_ref.rope(q.double(), rope_inv_freq(8), rope_ref.token_positions(1, 5, cu_seqlens=cu), layout="thd")
    for backend in kernel_backends(device):
        with poisoned_outputs():
            out = rope(q, inv_freq=rope_inv_freq(8, device=device), cu_seqlens=cu, layout="thd", backend=backend)
        # fp32 output of an fp32-exact angle: a few ulps (the parity tests bound this precisely).
        torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("batch,seqlen", [(0, 3), (2, 0)])
def test_wkv7_zero_size(device, batch, seqlen):
    x = rwkv7_inputs(batch, seqlen, 2, 32, torch.bfloat16, device=device, initial_state=True)
    tensors = [x[n] for n in ("r", "w", "k", "v", "a", "b")]
    for backend in kernel_backends(device):
        y, final = wkv7(*tensors, initial_state=x["initial_state"], output_final_state=True, backend=backend)
        assert y.shape == (batch, seqlen, 2, 32) and y.dtype == torch.bfloat16
        assert torch.equal(final, x["initial_state"])  # no token: the state is unchanged
        if batch == 0:  # the decode step of an empty batch
            y = wkv7_step(*(t[:, 0] for t in tensors), torch.zeros(0, 2, 32, 32, device=device), backend=backend)
            assert y.shape == (0, 2, 32)


def test_wkv7_varlen_with_empty_sequences(device):
    x = rwkv7_inputs(1, 7, 2, 32, device=device, initial_state=False)
    tensors = [x[n] for n in ("r", "w", "k", "v", "a", "b")]
    s0 = torch.randn(4, 2, 32, 32, generator=seeded(5)).to(device)
    cu = torch.tensor([0, 0, 4, 4, 7], dtype=torch.int64, device=device)
    y_ref, s_ref = rwkv7_ref.wkv7(*tensors, initial_state=s0.double(), output_final_state=True, cu_seqlens=cu)
    for backend in kernel_backends(device):
        with poisoned_outputs():
            y, final = wkv7(*tensors, initial_state=s0, output_final_state=True, cu_seqlens=cu, backend=backend)
        assert torch.equal(final[0], s0[0]) and torch.equal(final[2], s0[2])  # empty sequences keep their state
        # fp32 over <= 4 tokens: relative error a few 1e-7 (the parity tests bound it per dtype).
        torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final.double(), s_ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# NaN / Inf: the kernels propagate them exactly where the fp64 reference does (documented: no clamping, no masking).


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_rope_nonfinite_propagates_like_reference(device, bad):
    q = rope_input(2, 4, 2, 8, torch.float32, generator=seeded(6), device=device)
    q[1, 2, 0, 1] = bad  # one pair is (1, 5) in NeoX style, (0, 1) interleaved
    inv_freq = rope_inv_freq(6, device=device)  # rotary_dim 6: dims 6, 7 pass through
    q[0, 1, 1, 7] = bad
    positions = rope_ref.token_positions(2, 4)
    for interleaved in (False, True):
        expected = rope_ref.rope(q.double(), inv_freq, positions, interleaved=interleaved)
        for backend in kernel_backends(device):
            out = rope(q, inv_freq=inv_freq, interleaved=interleaved, backend=backend)
            assert torch.equal(out.isnan(), expected.isnan().to(out.device)), (backend, interleaved)
            assert torch.equal(out.isinf(), expected.isinf().to(out.device)), (backend, interleaved)


def test_wkv7_nan_propagates_like_reference(device):
    x = rwkv7_inputs(2, 6, 2, 32, device=device)
    tensors = [x[n] for n in ("r", "w", "k", "v", "a", "b")]
    tensors[3][1, 3, 0, 5] = math.nan  # v of batch 1, token 3, head 0: poisons that head's state from token 3 on
    expected, expected_final = rwkv7_ref.wkv7(*tensors, output_final_state=True)
    assert expected.isnan().any() and not expected.isnan().all()
    for backend in kernel_backends(device):
        y, final = wkv7(*tensors, output_final_state=True, backend=backend)
        assert torch.equal(y.isnan(), expected.isnan().to(y.device)), backend
        assert torch.equal(final.isnan(), expected_final.isnan().to(final.device)), backend


@pytest.mark.parametrize("position", [0, 5, 19])
@pytest.mark.parametrize("name", ["r", "w", "k", "v", "a", "b"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_wkv7_cpu_chunked_nonfinite_reaches_what_it_reaches_sequentially(name, position, bad):
    """The cpu twin's chunked form takes only the triangles of its in-chunk products (gemm_lower), so a non-finite
    input (at a chunk's first, a middle or a later token) makes exactly the reference's outputs and final state
    non-finite (NaN where the reference's are NaN, for a NaN input; an Inf input's NaN/Inf mix follows the summation
    order), as in the sequential form."""
    x = rwkv7_inputs(2, 40, 2, 32)
    tensors = [x[n].clone() for n in ("r", "w", "k", "v", "a", "b")]
    tensors[("r", "w", "k", "v", "a", "b").index(name)][1, position, 0, 5] = bad
    expected, expected_final = rwkv7_ref.wkv7(*tensors, output_final_state=True)
    y, final = wkv7(*tensors, output_final_state=True, backend="cpu", algorithm="chunked")
    assert torch.equal(y.isfinite(), expected.isfinite()) and torch.equal(final.isfinite(), expected_final.isfinite())
    if bad != bad:
        assert torch.equal(y.isnan(), expected.isnan())


@pytest.mark.parametrize("decay, zero", [("loglog", math.inf), ("log", -math.inf)])
def test_wkv7_chunked_zero_decay_matches_reference(device, decay, zero):
    """A decay of exactly 0 (log d = -inf) is a valid input that empties the state's column: every chunked twin gives
    the reference's finite outputs (the Triton kernels' cumulative log sums would give -inf - -inf = NaN without
    their floor, LOG_D_FLOOR)."""
    x = rwkv7_inputs(2, 40, 2, 32, decay=decay, generator=seeded(3), device=device)
    tensors = [x[n].clone() for n in ("r", "w", "k", "v", "a", "b")]
    tensors[1][1, 19, 0, 5] = zero  # one key column of one token
    tensors[1][0, 3, 1, :] = zero   # every column: the state restarts from v k^T
    expected, expected_final = rwkv7_ref.wkv7(*tensors, output_final_state=True, decay=decay)
    for backend in kernel_backends(device):
        with poisoned_outputs():
            y, final = wkv7(*tensors, output_final_state=True, decay=decay, backend=backend, algorithm="chunked")
        assert y.isfinite().all() and final.isfinite().all(), backend
        assert rms_ratio(y, expected.to(y.device)) < 2e-6, backend
        assert rms_ratio(final, expected_final.to(final.device)) < 2e-6, backend


@pytest.mark.parametrize("backend, precision, chunk_start", [("triton", None, 8), ("cuda", "bf16", 16)])
def test_wkv7_chunked_nan_stays_in_its_chunk_and_after(device, backend, precision, chunk_start):
    """The chunked kernels whose in-chunk products are whole 16-row tiles (the Triton twin's dots; the CUDA forward's
    mma in precision="bf16") multiply the zeros above their diagonal by every token, so a NaN input also reaches the
    earlier tokens of its chunk (Triton's chunks are aligned to each sequence's end: tokens 8..23; CUDA's to multiples
    of 16: 16..31), but never an earlier chunk, another head or another sequence."""
    if backend not in kernel_backends(device):
        pytest.skip(f"the {backend} backend cannot run on {device.type} here")
    x = rwkv7_inputs(2, 40, 2, 32, device=device)
    tensors = [x[n] for n in ("r", "w", "k", "v", "a", "b")]
    tensors[3][1, 19, 0, 5] = math.nan  # v of batch 1, token 19, head 0
    expected, expected_final = rwkv7_ref.wkv7(*tensors, output_final_state=True)
    expected = expected.isnan().to(device)
    allowed = expected.clone()
    allowed[1, chunk_start:19, 0] = True  # the poisoned chunk's earlier tokens, that head
    y, final = wkv7(*tensors, output_final_state=True, backend=backend, algorithm="chunked", precision=precision)
    assert (y.isnan() >= expected).all() and (y.isnan() <= allowed).all() and (y.isnan() > expected).any()
    assert torch.equal(final.isnan(), expected_final.isnan().to(final.device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a cotangent on another device than CUDA inputs: no GPU")
def test_cuda_backwards_refuse_cotangents_on_another_device():
    """Autograd gives cotangents the outputs' device; a direct op call may not. The CUDA glue checks them as it checks
    every input, instead of handing a kernel a host pointer."""
    from ropewkv.ops import qk_norm_rope as qk_ops

    cuda = torch.device("cuda")
    x = rwkv7_inputs(1, 16, 1, 32, generator=seeded(40), device=cuda)
    xs = [x[name] for name in ("r", "w", "k", "v", "a", "b")]
    y, final_state, checkpoints = torch.ops.ropewkv.wkv7_forward(*xs, None, None, 0, 0, True)
    with pytest.raises(RuntimeError, match="grad_final_state is on cpu but r is on cuda"):
        torch.ops.ropewkv.wkv7_backward(torch.ones_like(y), final_state.cpu(), *xs, None, None, checkpoints, 0, 0)
    q = rope_input(1, 4, 2, 64, torch.float32, generator=seeded(41), device=cuda)
    k = rope_input(1, 4, 1, 64, torch.float32, generator=seeded(42), device=cuda)
    n = qk_ops._normalise(q, k, None, None, 1e-6, 0.0, rope_inv_freq(64, device=cuda), None, None, None, None, 0,
                          None, "bshd", False, None, 1.0, None, "cuda")
    with pytest.raises(RuntimeError, match="grad_q is on cpu but q is on cuda"):
        torch.ops.ropewkv.qk_norm_rope_backward(torch.ones_like(q).cpu(), torch.ones_like(k), n.q4, n.k4, *n.args)
    with pytest.raises(RuntimeError, match="grad_k is on cpu but q is on cuda"):
        torch.ops.ropewkv.qk_norm_rope_backward(torch.ones_like(q), torch.ones_like(k).cpu(), n.q4, n.k4, *n.args)


# ---------------------------------------------------------------------------------------------------------------------
# The C++ ops called directly (torch.compile or an external caller bypasses the Python checks): the glue's own checks.


def _cpp_inplace(name, device):
    """(call(q, k), args) for the C++ in-place op `name` (rope_ or qk_norm_rope_) on fp32 [B, S, H, 8] views."""
    inv_freq = rope_inv_freq(8, device=device)
    if name == "rope_":
        args = (inv_freq, None, None, None, False, False, 1.0, 0, None, False)
        return lambda q, k: torch.ops.ropewkv.rope_(q, k, *args), lambda q, k: torch.ops.ropewkv.rope(q, k, *args)
    args = (None, None, 1e-6, 0.0, inv_freq, None, None, None, None, None, None, 8, False, 1.0, 0)
    return (lambda q, k: torch.ops.ropewkv.qk_norm_rope_(q, k, *args),
            lambda q, k: torch.ops.ropewkv.qk_norm_rope(q, k, *args))


@pytest.mark.parametrize("op", ["rope_", "qk_norm_rope_"])
@pytest.mark.parametrize("target", ["k-is-q", "k-a-head-of-q", "k-q-shifted-by-a-token", "expanded-q", "expanded-k"])
def test_cpp_inplace_refuses_targets_sharing_memory(device, op, target):
    """Each element is rotated once in place: k = q, k overlapping q or an expanded tensor rotated some elements two or
    more times (and raced on them across the CPU twin's threads), silently. (q and k shifted by whole tokens passed:
    the check compared their spans within one token.)"""
    inplace, _ = _cpp_inplace(op, device)
    q = torch.randn(2, 4, 3, 8, device=device)
    tokens = torch.randn(2, 5, 3, 8, device=device)
    k = {"k-is-q": q, "k-a-head-of-q": q[:, :, 1:2], "k-q-shifted-by-a-token": tokens[:, 1:],
         "expanded-q": torch.randn(2, 4, 1, 8, device=device),
         "expanded-k": torch.randn(2, 4, 1, 8, device=device).expand(2, 4, 2, 8)}[target]
    if target == "expanded-q":
        q, k = torch.randn(2, 1, 3, 8, device=device).expand(2, 4, 3, 8), k
    if target == "k-q-shifted-by-a-token":
        q = tokens[:, :-1]
    who = {"expanded-q": "q", "expanded-k": "k"}.get(target, "q and k")
    before = q.clone(), k.clone()
    with pytest.raises(ValueError, match=f"in place, {who} must not"):
        inplace(q, k)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


@pytest.mark.parametrize("op", ["rope_", "qk_norm_rope_"])
def test_cpp_inplace_takes_slices_of_a_fused_qkv(device, op):
    """Heads of one [B, S, Hq + 2 Hk, D] projection: spans that interleave across tokens but share no element."""
    inplace, functional = _cpp_inplace(op, device)
    qkv = torch.randn(2, 4, 3 + 2, 8, device=device)
    q, k = qkv[:, :, :3], qkv[:, :, 3:4]
    expected = functional(q, k)
    inplace(q, k)
    assert torch.equal(q, expected[0]) and torch.equal(k, expected[1])


def test_cpp_rotary_dim_error_names_its_source():
    """rope and rope_cos_sin take no rotary_dim: their errors name what it comes from."""
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"2 \* inv_freq.numel\(\) \(the rotary dim\) must be even and <= head_dim 8"):
        torch.ops.ropewkv.rope(q, None, torch.rand(5), None, None, None, False, False, 1.0, 0, None, False)
    with pytest.raises(ValueError, match=r"cos.size\(-1\) \(the rotary dim\) must be even and <= head_dim 8, got 3"):
        torch.ops.ropewkv.rope_cos_sin(q, None, torch.randn(1, 4, 3), torch.randn(1, 4, 3), False, False, 0)


@pytest.mark.parametrize("case", ["cache-offsets", "cache-cu", "cache-scaling", "table-positions", "table-offsets",
                                  "table-scaling"])
def test_qk_norm_rope_ops_refuse_what_their_table_source_ignores(case):
    """The C++ twin ignored these, the Triton twin applied seqlen_offsets and cu_seqlens to a cache's positions and
    ignored the rest: the twins disagreed on one call. The Python layer refuses them, and so do both ops."""
    q = torch.randn(1, 4, 2, 8)
    source, extra = case.split("-")
    cache = torch.randn(16, 8) if source == "cache" else None
    cos, sin = (torch.randn(1, 4, 8), torch.randn(1, 4, 8)) if source == "table" else (None, None)
    positions = torch.arange(4).view(1, 4) if source == "cache" or extra == "positions" else None
    offsets = torch.tensor([5]) if extra == "offsets" else None
    cu = torch.tensor([0, 1, 4]) if extra == "cu" else None
    scaling = 2.0 if extra == "scaling" else 1.0
    for op in (torch.ops.ropewkv.qk_norm_rope, torch.ops.ropewkv.qk_norm_rope_triton):
        with pytest.raises(ValueError, match="apply to the inv_freq"):
            op(q, None, None, None, 1e-6, 0.0, None, cos, sin, cache, positions, offsets, cu, 8, False, scaling, 0)


@pytest.mark.parametrize("op", ["wkv7_backward", "wkv7_chunked_backward"])
def test_cpp_wkv7_backward_grad_state_error_says_the_shape_expected(op):
    x = rwkv7_inputs(1, 5, 2, 16, generator=seeded(43))
    xs = [x[name] for name in ("r", "w", "k", "v", "a", "b")]
    y, final_state, checkpoints = torch.ops.ropewkv.wkv7_forward(*xs, None, None, 0, 0, True)
    with pytest.raises(ValueError, match=r"grad_final_state must have shape \[1, 2, 16, 16\] .*got \[1, 1, 16, 16\]"):
        getattr(torch.ops.ropewkv, op)(torch.ones_like(y), final_state[:, :1], *xs, None, None, checkpoints, 0, 0)


def _triton_op_calls(device):
    """Direct calls of the Triton twin's ops with a tensor of another shape than the kernels index by: (call, error)."""
    ops = torch.ops.ropewkv
    q, inv, none3 = torch.randn(4, 3, 2, 8, device=device), torch.rand(4, device=device), (None, None, None)
    positions = torch.zeros(4, 3, dtype=torch.int64, device=device)

    def rope(q=q, inv=inv, positions=None, offsets=None, cu=None, section=None):
        offsets, cu = (None if x is None else torch.tensor(x, device=device) for x in (offsets, cu))
        return ops.rope_triton(q, None, inv, positions, offsets, cu, False, False, 1.0, 0, section, False)

    def qk(weight=None, inv=None, cache=None, positions=None):
        return ops.qk_norm_rope_triton(q, None, weight, None, 1e-6, 0.0, inv, None, None, cache, positions, None, None,
                                       8, False, 1.0, 0)

    def grad_q():
        return ops.qk_norm_rope_backward_triton(q[..., :4], None, q, None, None, None, 1e-6, 0.0, inv, *none3, None,
                                                None, None, 8, False, 1.0, 0)

    table = torch.ones(1, 3, 8, device=device)
    return {
        "seqlen_offsets": (lambda: rope(offsets=[5]), r"seqlen_offsets must be contiguous \[4\]"),
        "positions": (lambda: rope(positions=positions[:1]), r"positions must be a \[batch, seq\] view"),
        "mrope positions": (lambda: rope(section=[1, 1, 2]), r"positions must be a \[3, batch, seq\] view"),
        "cu_seqlens": (lambda: rope(cu=[0, 12]), "cu_seqlens must be contiguous 1-D"),
        "rotary_dim": (lambda: rope(inv=torch.rand(8, device=device)), "rotary_dim must be even and <= head_dim 8"),
        "q stride": (lambda: rope(q=torch.randn(4, 3, 2, 16, device=device)[..., ::2]), "q must have stride 1"),
        "cos": (lambda: ops.rope_cos_sin_triton(q, None, table, table, False, False, 0),
                r"cos must be a \[batch, seq, rotary_dim\] view"),
        "inv_freq": (lambda: qk(inv=torch.rand(2, device=device)), "inv_freq must have rotary_dim / 2 = 4 entries"),
        "cos_sin_cache": (lambda: qk(cache=torch.randn(16, 6, device=device), positions=positions),
                          "cos_sin_cache must be a"),
        "q_weight": (lambda: qk(weight=torch.randn(6, device=device), inv=inv), r"q_weight must be contiguous \[head_"),
        "grad_q": (grad_q, "grad_q must have the shape of q"),
    }


@pytest.mark.parametrize("case", sorted(_triton_op_calls("cpu")))
def test_triton_ops_check_what_their_kernels_index_by(device, case):
    """The Triton twin's ops called directly (torch.ops.ropewkv.*_triton) with an index tensor, table, weight or grad
    of another shape than the kernels index by read out of bounds (the C++ glue refuses them): a ValueError names it."""
    if "triton" not in kernel_backends(device):
        pytest.skip("no Triton twin on this device")
    call, message = _triton_op_calls(device)[case]
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("op", ["wkv7 sequential", "wkv7 chunked", "qk_norm_rope"])
def test_double_backward_raises_on_kernel_backends_and_runs_on_the_reference(device, op):
    """The kernels' backwards have no derivative: the C++ twins' second derivatives came out as zeros (PyTorch only
    warned), the Triton twins raised PyTorch's generic error. The reference backend's autograd gives them."""
    def first_grad(backend):
        if op == "qk_norm_rope":
            q = torch.randn(1, 3, 2, 16, generator=seeded(6)).to(device).requires_grad_()
            weight = (torch.rand(16, generator=seeded(7)) + 0.5).to(device).requires_grad_()
            out = ropewkv.qk_norm_rope(q, None, weight, None, inv_freq=rope_inv_freq(16, device=device),
                                       backend=backend)
            return torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)[0], weight
        x = rwkv7_inputs(1, 3, 1, 32, generator=seeded(8), device=device)
        leaves = {n: x[n].requires_grad_() for n in "rwk"}
        y, _ = wkv7(*(x[n] for n in "rwkvab"), backend=backend, algorithm=op.split()[1])
        return torch.autograd.grad(y.pow(2).sum(), leaves["r"], create_graph=True)[0], leaves["k"]

    grad, other = first_grad("reference")
    assert torch.autograd.grad(grad.sum(), other)[0].abs().max() > 0
    for backend in kernel_backends(device):
        grad, other = first_grad(backend)
        with pytest.raises(NotImplementedError, match="has no double backward"):
            torch.autograd.grad(grad.sum(), other)
