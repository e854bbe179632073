"""What users bring from other packages, on every kernel twin against the fp64 reference: a decay input w in its own
dtype (fp32 beside bf16 r..b: autocast, FLA #181), rwkv-ops' [1, H, N, N] initial state broadcast over the batch and
its [B, T] mask (0 freezes the state: left padding), and wkv7_step's precision switch."""
import pytest
import torch

import ropewkv.ops.rwkv7 as ops
from ropewkv.reference import rwkv7 as reference
from ropewkv.testing import max_ulp_error, poisoned_outputs, rms_ratio, seeded
from ropewkv.testing import rwkv7 as parity
from conftest import kernel_backends as _kernel_backends


def kernel_backends(device) -> list:
    """conftest's twins, asserted non-empty: a loop over no backend would pass the tests below vacuously."""
    backends = _kernel_backends(device)
    assert backends, f"no kernel twin runs on {device} here"
    return backends
from test_wkv7 import check_inputs, shape_for

NAMES = parity.GRAD_NAMES[:6]


def mixed_inputs(shape, device, seed, io_dtype=torch.bfloat16, decay="raw", initial_state=True):
    """r, k, v, a, b in io_dtype, w in fp32 (as RWKV7TimeMix hands them to the kernel under autocast)."""
    inputs = parity.rwkv7_inputs(*shape, dtype=torch.float32, decay=decay, generator=seeded(seed), device=device,
                                 initial_state=initial_state)
    return {n: (x if n in ("w", "initial_state") or x is None else x.to(io_dtype)) for n, x in inputs.items()}


def check(device, backend, inputs, decay, tol, cu_seqlens=None, mask=None):
    """The backend's (y, final state, gradients), checked against the fp64 oracle (fp32 mode)."""
    return check_inputs(device, backend, inputs, decay, "fp32", tol, seeded(7), cu_seqlens, mask)[0]


@pytest.mark.parametrize("decay", reference.DECAYS)
def test_fp32_decay_beside_bf16_inputs(device, decay):
    for backend in kernel_backends(device):
        shape = shape_for(backend, 2, 40, 2, 64)
        inputs = mixed_inputs(shape, device, seed=1, decay=decay)
        y, _, grads = check(device, backend, inputs, decay, parity.tolerance(torch.bfloat16, "fp32", shape[1]))
        assert y.dtype == torch.bfloat16 and grads["w"].dtype == torch.float32 and grads["r"].dtype == torch.bfloat16


def test_fp32_decay_keeps_the_state_at_fp32_accuracy():
    """The seed's point (FLA #181): with near-1 decays over T = 1000 the final state of bf16 r..b with an fp32 w stays
    at fp32 accuracy (nothing in it is rounded to bf16: 9.2e-8 measured), while the same call with w rounded to bf16
    lands 2.7e-4 away from it: the kernel must read w at its own precision."""
    inputs = mixed_inputs((1, 1000, 2, 64), "cpu", seed=2)
    xs = [inputs[n] for n in NAMES]
    with torch.no_grad():
        _, want = reference.wkv7(*xs, initial_state=inputs["initial_state"], output_final_state=True, decay="raw")
        _, got = ops.wkv7(*xs, initial_state=inputs["initial_state"], output_final_state=True, decay="raw")
        xs[1] = xs[1].bfloat16()
        _, rounded = ops.wkv7(*xs, initial_state=inputs["initial_state"], output_final_state=True, decay="raw")
    assert rms_ratio(got, want) < 1e-6
    assert rms_ratio(rounded, want) > 1e-4


@pytest.mark.parametrize("io_dtype", [torch.float16, torch.bfloat16])
def test_bf16_mode_rounds_w_too(device, io_dtype):
    """precision="bf16" emulates RWKV-LM's bf16 kernels, which take a bf16 w: an fp32 w is rounded like every input."""
    for backend in kernel_backends(device):
        inputs = mixed_inputs(shape_for(backend, 1, 20, 2, 32), device, seed=3, io_dtype=io_dtype)
        xs = [inputs[n] for n in NAMES]
        mixed = ops.wkv7(*xs, output_final_state=True, decay="raw", precision="bf16", backend=backend)
        xs[1] = xs[1].bfloat16().to(io_dtype) if io_dtype == torch.bfloat16 else xs[1].bfloat16().float()
        rounded = ops.wkv7(*xs, output_final_state=True, decay="raw", precision="bf16", backend=backend)
        assert torch.equal(mixed[0], rounded[0]) and torch.equal(mixed[1], rounded[1]), backend


@pytest.mark.parametrize("algorithm", ["sequential", "chunked"])
@pytest.mark.parametrize("io_dtype", [torch.float32, torch.float16])
def test_bf16_mode_rounds_grad_y_too(device, algorithm, io_dtype):
    """precision="bf16" rounds every I/O value on load, grad_y of a wider dtype too: the gradients equal those of
    grad_y rounded to bf16 first. (Both Triton twins read it unrounded: 2.4e-3 relative RMS from the CPU twin in
    every gradient at fp32 I/O, found 2026-11-29.)"""
    for backend in kernel_backends(device):
        shape = shape_for(backend, 1, 20, 2, 32)
        inputs = parity.rwkv7_inputs(*shape, dtype=io_dtype, decay="loglog", generator=seeded(8), device=device,
                                     initial_state=True)
        xs = [inputs[n].requires_grad_() for n in NAMES]
        grad_y = torch.randn(shape, generator=seeded(9)).to(device=device, dtype=io_dtype)
        # (no value below fp16's normal range: bf16 values there need not be fp16 values)
        grad_y = torch.where(grad_y.abs() < 1e-3, 1e-3, grad_y)
        y, _ = ops.wkv7(*xs, initial_state=inputs["initial_state"], precision="bf16", backend=backend,
                        algorithm=algorithm)
        got = torch.autograd.grad(y, xs, grad_y, retain_graph=True)
        rounded = torch.autograd.grad(y, xs, grad_y.bfloat16().to(io_dtype))
        assert all(torch.equal(g, r) for g, r in zip(got, rounded)), backend


def test_any_float_w_is_read_exactly(device):
    """w of a third dtype (fp16 beside bf16 r..b) is widened to fp32 exactly: the same numbers as an fp32 w."""
    for backend in kernel_backends(device):
        inputs = mixed_inputs(shape_for(backend, 1, 12, 2, 32), device, seed=4)
        xs = [inputs[n] for n in NAMES]
        xs[1] = xs[1].half().requires_grad_()
        y, s = ops.wkv7(*xs, output_final_state=True, decay="raw", backend=backend)
        (grad_w,) = torch.autograd.grad(y.float().sum() + s.sum(), xs[1])
        xs[1] = xs[1].detach().float().requires_grad_()
        y32, s32 = ops.wkv7(*xs, output_final_state=True, decay="raw", backend=backend)
        (grad_w32,) = torch.autograd.grad(y32.float().sum() + s32.sum(), xs[1])
        assert torch.equal(y, y32) and torch.equal(s, s32)
        assert grad_w.dtype == torch.float16 and torch.equal(grad_w, grad_w32.half())


def test_other_mixes_are_refused_by_name():
    xs = [mixed_inputs((1, 4, 1, 32), "cpu", seed=5)[n] for n in NAMES]
    for i, name in enumerate(NAMES):
        if name in ("r", "w"):
            continue
        bad = list(xs)
        bad[i] = bad[i].float()
        with pytest.raises(TypeError, match=f"{name} has dtype torch.float32 but r has torch.bfloat16"):
            ops.wkv7(*bad)
        with pytest.raises(TypeError, match=f"{name} has dtype torch.float32 but r has torch.bfloat16"):
            ops.wkv7_step(*(x[:, 0] for x in bad), torch.zeros(1, 1, 32, 32))


def left_padded_mask(batch, seqlen, device):
    """Row 0 left-padded by 3 tokens, row 1 unpadded with one frozen token in the middle, further rows unpadded."""
    mask = torch.ones(batch, seqlen, dtype=torch.bool, device=device)
    mask[0, :3] = False
    if batch > 1:
        mask[1, seqlen // 2] = False
    return mask


@pytest.mark.parametrize("decay", reference.DECAYS)
def test_mask_freezes_the_state(device, decay):
    for backend in kernel_backends(device):
        shape = shape_for(backend, 2, 19, 2, 32)
        inputs = parity.rwkv7_inputs(*shape, decay=decay, generator=seeded(6), device=device, initial_state=True)
        mask = left_padded_mask(shape[0], shape[1], device)
        _, state, grads = check(device, backend, inputs, decay, parity.tolerance(torch.float32, "fp32", shape[1]),
                                mask=mask)
        masked = ~mask[..., None, None].expand_as(inputs["w"])
        for name in NAMES[1:]:  # inputs of frozen tokens do not reach the state
            assert torch.all(grads[name][masked] == 0), (backend, name)
        # A frozen token is an exact no-op: row 0 ends in the state its unpadded tokens reach, bit for bit.
        xs = [inputs[n][:1, 3:] for n in NAMES]
        _, unpadded = ops.wkv7(*xs, initial_state=inputs["initial_state"][:1], output_final_state=True,
                               decay=decay, backend=backend)
        assert torch.equal(state[:1].detach(), unpadded), backend


def test_mask_freezes_the_state_whatever_the_padding_holds(device):
    """inf or NaN in a masked token's v or a must not reach the state through inf * 0: y and the final state stay
    those of the fp64 reference, and y, the state and every gradient those of the same call with finite padding."""
    for backend in kernel_backends(device):
        shape = shape_for(backend, 2, 10, 1, 32)
        inputs = parity.rwkv7_inputs(*shape, generator=seeded(16), device=device, initial_state=True)
        mask = left_padded_mask(shape[0], shape[1], device)
        padded = dict(inputs, v=inputs["v"].clone(), a=inputs["a"].clone())
        padded["v"][0, 0] = padded["a"][0, 1] = float("inf")
        padded["v"][0, 2] = padded["a"][0, 2] = float("nan")
        cot_y, cot_s = parity.cotangents(inputs, shape[0], seeded(17), device)
        ref_y, ref_state = reference.wkv7(*(padded[n] for n in NAMES), initial_state=inputs["initial_state"],
                                          output_final_state=True, mask=mask)
        tol = parity.tolerance(torch.float32, "fp32", shape[1]).rms
        for algorithm in ("sequential", "chunked"):
            with poisoned_outputs():
                y, state, grads = parity.run_wkv7(backend, padded, "loglog", "fp32", cot_y, cot_s, mask=mask,
                                                  algorithm=algorithm)
                finite = parity.run_wkv7(backend, inputs, "loglog", "fp32", cot_y, cot_s, mask=mask,
                                         algorithm=algorithm)
            assert rms_ratio(y, ref_y) < tol and rms_ratio(state, ref_state) < tol, (backend, algorithm)
            assert torch.equal(y, finite[0]) and torch.equal(state, finite[1]), (backend, algorithm)
            for name, grad in grads.items():
                assert torch.equal(grad, finite[2][name]), (backend, algorithm, name)


def test_mask_of_ones_changes_nothing_and_accepts_any_real_dtype(device):
    for backend in kernel_backends(device):
        inputs = parity.rwkv7_inputs(*shape_for(backend, 1, 9, 2, 32), generator=seeded(8), device=device)
        xs = [inputs[n] for n in NAMES]
        plain = ops.wkv7(*xs, output_final_state=True, backend=backend)
        for mask in (torch.ones(1, 9, device=device), torch.ones(1, 9, dtype=torch.int64, device=device)):
            masked = ops.wkv7(*xs, output_final_state=True, mask=mask, backend=backend)
            assert torch.equal(plain[0], masked[0]) and torch.equal(plain[1], masked[1])


def test_mask_with_varlen(device):
    for backend in kernel_backends(device):
        small = backend == "triton" and not torch.cuda.is_available()
        bounds = [0, 5, 12] if small else [0, 9, 30, 41]
        inputs = parity.rwkv7_inputs(1, bounds[-1], 1 if small else 2, 32, decay="log", generator=seeded(9),
                                     device=device)
        inputs["initial_state"] = torch.randn(len(bounds) - 1, *inputs["r"].shape[2:], 32,
                                              generator=seeded(10)).to(device)
        mask = torch.ones(1, bounds[-1], dtype=torch.bool, device=device)
        mask[0, bounds[1]:bounds[1] + 2] = False  # the first two tokens of the second sequence
        check(device, backend, inputs, "log", parity.tolerance(torch.float32, "fp32", bounds[-1]),
              cu_seqlens=torch.tensor(bounds, device=device), mask=mask)


@pytest.mark.parametrize("varlen", [False, True])
def test_initial_state_broadcast_over_the_batch(device, varlen):
    """rwkv-ops' [1, H, N, N] initial state: every sequence starts from it; its gradient sums over them."""
    for backend in kernel_backends(device):
        batch, seqlen, heads, n = shape_for(backend, 3, 17, 2, 32)
        cu = None
        if varlen:
            cu = torch.tensor([0, 4, 4, seqlen], device=device)
            batch = 1
        inputs = parity.rwkv7_inputs(batch, seqlen, heads, n, generator=seeded(11), device=device,
                                     initial_state=True)
        inputs["initial_state"] = inputs["initial_state"][:1]
        _, state, grads = check(device, backend, inputs, "loglog", parity.tolerance(torch.float32, "fp32", seqlen),
                                cu_seqlens=cu)
        assert state.shape[0] == (3 if varlen else batch) and grads["initial_state"].shape == (1, heads, n, n)


def test_broadcast_and_mask_refusals_name_the_argument():
    xs = [parity.rwkv7_inputs(2, 4, 1, 32, generator=seeded(12))[n] for n in NAMES]
    with pytest.raises(ValueError, match=r"mask must have shape \[B, T\] = \[2, 4\]"):
        ops.wkv7(*xs, mask=torch.ones(2, 5))
    with pytest.raises(TypeError, match="mask must be a torch.Tensor"):
        ops.wkv7(*xs, mask=[[1, 1, 1, 1]] * 2)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[2, 1, 32, 32\] or \[1, 1, 32, 32\]"):
        ops.wkv7(*xs, initial_state=torch.zeros(3, 1, 32, 32))
    with pytest.raises(ValueError, match=r"state must have shape \[2, 1, 32, 32\]"):  # decode updates it in place
        ops.wkv7_step(*(x[:, 0] for x in xs), torch.zeros(1, 1, 32, 32))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_step_precision_and_mixed_w_equal_one_token_of_wkv7(device, precision):
    for backend in kernel_backends(device):
        for inputs in (parity.rwkv7_inputs(2, 1, 2, 32, generator=seeded(13), device=device, initial_state=True),
                       mixed_inputs((2, 1, 2, 32), device, seed=14, decay="loglog")):
            xs = [inputs[n] for n in NAMES]
            state = inputs["initial_state"].clone()
            with poisoned_outputs():
                y = ops.wkv7_step(*(x[:, 0] for x in xs), state, precision=precision, backend=backend)
                y1, s1 = ops.wkv7(*xs, initial_state=inputs["initial_state"], output_final_state=True,
                                  precision=precision, backend=backend)
            # the two could share a bug: the step against the fp64 oracle as well
            ref_y, ref_state = reference.wkv7(*xs, initial_state=inputs["initial_state"], output_final_state=True)
            tol = parity.tolerance(xs[0].dtype, precision, 1).rms
            assert rms_ratio(y, ref_y[:, 0]) <= tol and rms_ratio(state, ref_state) <= tol, (backend, precision)
            # The step and the sequence kernel do the same fp32 operations for one token, but not in the same order
            # on a GPU (the CUDA decode kernel splits its dot products across lanes differently): a few fp32
            # roundings apart, as test_wkv7.py::test_step_equals_one_token_and_updates_in_place bounds them (its
            # element-wise rtol/atol 1e-6 failed on the H200). A y rounded to bf16/fp16 (bf16 I/O, or the bf16 mode)
            # can then land one ulp of that type away where the fp32 value sits at a rounding boundary: rarely.
            rounded_to = torch.bfloat16 if precision == "bf16" else y.dtype
            if rounded_to == torch.float32:
                assert rms_ratio(y, y1[:, 0]) < 1e-6, (backend, precision, "y")
            else:
                assert max_ulp_error(y.to(rounded_to), y1[:, 0]) <= 1, (backend, precision, "y")
                assert float((y != y1[:, 0]).float().mean()) < 0.05, (backend, precision, "y")
            assert rms_ratio(state, s1) < 1e-6, (backend, precision, "state")


def test_step_bf16_mode_is_fp32_math_on_bf16_rounded_io(device):
    """wkv7_step(precision="bf16") on fp32 tensors = the fp32 mode fed bf16-rounded inputs, y rounded to bf16."""
    for backend in kernel_backends(device):
        inputs = parity.rwkv7_inputs(2, 1, 2, 32, generator=seeded(15), device=device, initial_state=True)
        xs = [inputs[n][:, 0] for n in NAMES]
        state, state_rounded_io = inputs["initial_state"].clone(), inputs["initial_state"].clone()
        y = ops.wkv7_step(*xs, state, precision="bf16", backend=backend)
        y_rounded_io = ops.wkv7_step(*(x.bfloat16().float() for x in xs), state_rounded_io, precision="fp32",
                                     backend=backend)
        assert torch.equal(y, y_rounded_io.bfloat16().float()) and torch.equal(state, state_rounded_io), backend
        assert not torch.equal(y, ops.wkv7_step(*xs, inputs["initial_state"].clone(), backend=backend))
