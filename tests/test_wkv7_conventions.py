"""What users bring from other packages, on every kernel twin against the fp64 reference: a decay input w in its own
dtype (fp32 beside bf16 r..b: autocast, FLA #181), and wkv7_step's precision switch."""
import pytest
import torch

import ropewkv.ops.rwkv7 as ops
from ropewkv.reference import rwkv7 as reference
from ropewkv.testing import assert_within, poisoned_outputs, rms_ratio, seeded
from ropewkv.testing import rwkv7 as parity
from conftest import kernel_backends
from test_wkv7 import shape_for

NAMES = parity.GRAD_NAMES[:6]


def mixed_inputs(shape, device, seed, io_dtype=torch.bfloat16, decay="raw", initial_state=True):
    """r, k, v, a, b in io_dtype, w in fp32 (as RWKV7TimeMix hands them to the kernel under autocast)."""
    inputs = parity.rwkv7_inputs(*shape, dtype=torch.float32, decay=decay, generator=seeded(seed), device=device,
                                 initial_state=initial_state)
    return {n: (x if n in ("w", "initial_state") or x is None else x.to(io_dtype)) for n, x in inputs.items()}


def check(device, backend, inputs, decay, tol, cu_seqlens=None, mask=None, precision="fp32"):
    gen = seeded(7)
    n_seqs = inputs["r"].shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    cot_y, cot_s = parity.cotangents(inputs, n_seqs, gen, device)
    want = parity.oracle(inputs, decay, cot_y, cot_s, cu_seqlens, mask)
    with poisoned_outputs():
        got = parity.run_wkv7(backend, inputs, decay, precision, cot_y, cot_s, cu_seqlens, mask)
    for row in parity.measurements(backend, precision, got, want, tol, inputs["r"].dtype):
        assert_within(row)
    return got, want


@pytest.mark.parametrize("decay", reference.DECAYS)
def test_fp32_decay_beside_bf16_inputs(device, decay):
    for backend in kernel_backends(device):
        shape = shape_for(backend, 2, 40, 2, 64)
        inputs = mixed_inputs(shape, device, seed=1, decay=decay)
        (y, state, grads), _ = check(device, backend, inputs, decay,
                                     parity.tolerance(torch.bfloat16, "fp32", shape[1]))
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


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_step_precision_and_mixed_w_equal_one_token_of_wkv7(device, precision):
    for backend in kernel_backends(device):
        for inputs in (parity.rwkv7_inputs(2, 1, 2, 32, generator=seeded(13), device=device, initial_state=True),
                       mixed_inputs((2, 1, 2, 32), device, seed=14, decay="loglog")):
            xs = [inputs[n] for n in NAMES]
            state = inputs["initial_state"].clone()
            y = ops.wkv7_step(*(x[:, 0] for x in xs), state, precision=precision, backend=backend)
            y1, s1 = ops.wkv7(*xs, initial_state=inputs["initial_state"], output_final_state=True,
                              precision=precision, backend=backend)
            # The step and the sequence kernel do the same fp32 operations for one token.
            torch.testing.assert_close(y, y1[:, 0], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(state, s1, rtol=1e-6, atol=1e-6)


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
