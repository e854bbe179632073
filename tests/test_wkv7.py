"""wkv7 / wkv7_step on every kernel twin against the fp64 reference (ropewkv.reference.rwkv7)."""
import pytest
import torch

import ropewkv.ops.rwkv7 as ops
from ropewkv.reference import rwkv7 as reference
from ropewkv.testing import assert_within, measure, poisoned_outputs, rms_ratio, seeded
from ropewkv.testing import rwkv7 as parity
from conftest import kernel_backends as _kernel_backends


def kernel_backends(device) -> list:
    """conftest's twins, asserted non-empty: a loop over no backend would pass the tests below vacuously."""
    backends = _kernel_backends(device)
    assert backends, f"no kernel twin runs on {device} here"
    return backends

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def shape_for(backend, batch, seqlen, heads, n):
    """Interpreted Triton runs ~5 ms per program instance: long and wide cases run on the compiled twins only."""
    if backend == "triton" and not torch.cuda.is_available():
        return 1, min(seqlen, 20), 1, 32
    return batch, seqlen, heads, n


def check_against_oracle(device, backend, shape, dtype, decay, precision, seed, initial_state=True, cu_seqlens=None):
    gen = seeded(seed)
    inputs = parity.rwkv7_inputs(*shape, dtype=dtype, decay=decay, generator=gen, device=device,
                                 initial_state=initial_state)
    n_seqs = shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    if initial_state and cu_seqlens is not None:
        inputs["initial_state"] = torch.randn(n_seqs, shape[2], shape[3], shape[3], generator=gen).to(device)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=device)
    result, rows = check_inputs(device, backend, inputs, decay, precision, parity.tolerance(dtype, precision, shape[1]),
                                gen, cu)
    assert result[0].dtype == dtype and result[1].dtype == torch.float32
    assert len(rows) == (9 if initial_state else 8)
    return rows


def check_inputs(device, backend, inputs, decay, precision, tol, generator, cu_seqlens=None, mask=None):
    """y, final state and gradients of `inputs` (rwkv7_inputs' dict) under random cotangents, within `tol` of the fp64
    oracle, outputs poisoned. Returns (the backend's (y, state, grads), the measurement rows)."""
    n_seqs = inputs["r"].shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    cot_y, cot_s = parity.cotangents(inputs, n_seqs, generator, device)
    reference_result = parity.oracle(inputs, decay, cot_y, cot_s, cu_seqlens, mask)
    with poisoned_outputs():
        result = parity.run_wkv7(backend, inputs, decay, precision, cot_y, cot_s, cu_seqlens, mask)
    rows = parity.measurements(backend, precision, result, reference_result, tol, inputs["r"].dtype)
    for row in rows:
        assert_within(row)
    return result, rows


@pytest.mark.parametrize("decay", reference.DECAYS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_backend_dtype_precision_decay(device, decay, dtype, precision):
    for backend in kernel_backends(device):
        check_against_oracle(device, backend, shape_for(backend, 2, 17, 2, 32), dtype, decay, precision, seed=1)


@pytest.mark.parametrize("seqlen", [1, 15, 16, 17, 100, 1000])
def test_sequence_lengths(device, seqlen):
    for backend in kernel_backends(device):
        check_against_oracle(device, backend, shape_for(backend, 1, seqlen, 2, 64), torch.float32, "loglog", "fp32",
                             seed=seqlen, initial_state=seqlen % 2 == 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_sequence_cpu_twin(dtype):
    """T = 4096 with near-1 decays: the fp32 state must not drift (bf16 I/O: bounded by the output rounding).
    Forward only: the fp64 autograd oracle at this length costs minutes; gradients are checked up to T = 1000."""
    inputs = parity.rwkv7_inputs(1, 4096, 2, 64, dtype=dtype, decay="raw", generator=seeded(40), initial_state=True)
    xs = [inputs[k] for k in parity.GRAD_NAMES[:6]]
    with torch.no_grad():
        ref_y, ref_state = reference.wkv7(*xs, initial_state=inputs["initial_state"], output_final_state=True,
                                          decay="raw")
        with poisoned_outputs():
            y, state = ops.wkv7(*xs, initial_state=inputs["initial_state"], output_final_state=True, decay="raw",
                                backend="cpu")
    tol = parity.tolerance(dtype, "fp32", 4096)
    assert_within(measure("wkv7 y", "cpu", "fp32", y, ref_y, tol))
    assert_within(measure("wkv7 final_state", "cpu", "fp32", state, ref_state, tol, dtype=dtype))


@pytest.mark.parametrize("initial_state", [True, False])
def test_varlen_uneven(device, initial_state):
    for backend in kernel_backends(device):
        small = backend == "triton" and not torch.cuda.is_available()
        bounds = [0, 3, 4, 4, 19] if small else [0, 5, 21, 22, 22, 70, 100]
        n = 32 if small else 64
        check_against_oracle(device, backend, (1, bounds[-1], 1 if small else 2, n), torch.float32, "log", "fp32",
                             seed=7, initial_state=initial_state, cu_seqlens=bounds)


@pytest.mark.parametrize("algorithm", ["sequential", "chunked"])
def test_strided_cu_seqlens(device, algorithm):
    """The Triton twins read cu_seqlens through its data pointer: a strided one (each offset followed by garbage)
    must reach them dense, not be read as [0, 99, 3, 99]."""
    cu = torch.tensor([[0, 99], [3, 99], [10, 99], [21, 99]], device=device)[:, 0]
    gen = seeded(30)
    inputs = parity.rwkv7_inputs(1, 21, 1, 32, generator=gen, device=device)
    inputs["initial_state"] = torch.randn(3, 1, 32, 32, generator=gen).to(device)
    cot_y, cot_s = parity.cotangents(inputs, 3, gen, device)
    reference_result = parity.oracle(inputs, "loglog", cot_y, cot_s, cu)
    for backend in kernel_backends(device):
        with poisoned_outputs():
            result = parity.run_wkv7(backend, inputs, "loglog", "fp32", cot_y, cot_s, cu, algorithm=algorithm)
        for row in parity.measurements(backend, "fp32", result, reference_result,
                                       parity.tolerance(torch.float32, "fp32", 21), torch.float32):
            assert_within(row)


@pytest.mark.parametrize("head_size", [32, 64, 128, 256])
def test_head_sizes(device, head_size):
    for backend in kernel_backends(device):
        if backend == "triton" and not torch.cuda.is_available() and head_size > 64:
            continue  # interpreted cost; the GPU run covers it
        if backend == "cuda" and head_size == 256:
            continue  # the CUDA twin stops at 128: test_head_size_256_on_cuda_routes_to_triton_or_says_why
        check_against_oracle(device, backend, (1, 18, 1, head_size), torch.bfloat16, "loglog", "fp32", seed=9)


def test_state_passing_matches_one_run(device):
    """[0:T1] then [T1:T] with the state handed over equals [0:T], for y, the state and every gradient."""
    for backend in kernel_backends(device):
        batch, seqlen, heads, n = shape_for(backend, 2, 50, 2, 64)
        split = seqlen // 2 + 3
        gen = seeded(21)
        inputs = parity.rwkv7_inputs(batch, seqlen, heads, n, generator=gen, device=device, initial_state=True)
        cot_y, cot_s = parity.cotangents(inputs, batch, gen, device)
        leaves = {k: inputs[k].clone().requires_grad_() for k in parity.GRAD_NAMES}
        xs = [leaves[k] for k in parity.GRAD_NAMES[:6]]
        with poisoned_outputs():
            whole = parity.run_wkv7(backend, inputs, "loglog", "fp32", cot_y, cot_s)
            y1, s1 = ops.wkv7(*(x[:, :split] for x in xs), initial_state=leaves["initial_state"],
                              output_final_state=True, backend=backend)
            y2, s2 = ops.wkv7(*(x[:, split:] for x in xs), initial_state=s1, output_final_state=True,
                              backend=backend)
            loss = (torch.cat([y1, y2], 1) * cot_y).sum() + (s2 * cot_s).sum()
            grads = torch.autograd.grad(loss, list(leaves.values()))
        # The same fp32 operations in the same order, only split at a different point: a few fp32 roundings apart.
        for name, got, expected in [("y", torch.cat([y1, y2], 1), whole[0]), ("state", s2, whole[1])] + \
                [(k, g, whole[2][k]) for k, g in zip(leaves, grads)]:
            assert rms_ratio(got, expected) < 1e-6, (backend, name)


def test_gradient_buffers_hold_garbage(device):
    """.grad pre-filled with garbage is accumulated into, never overwritten or read by the kernels."""
    for backend in kernel_backends(device):
        gen = seeded(22)
        inputs = parity.rwkv7_inputs(*shape_for(backend, 1, 33, 2, 32), generator=gen, device=device,
                                     initial_state=True)
        leaves = [inputs[k].clone().requires_grad_() for k in parity.GRAD_NAMES]

        def backward():
            y, s = ops.wkv7(*leaves[:6], initial_state=leaves[6], output_final_state=True, backend=backend)
            (y.sum() + s.square().sum()).backward()

        with poisoned_outputs():
            backward()
        first = [x.grad.clone() for x in leaves]
        garbage = [torch.randn(x.shape, generator=gen).to(device) * 1e3 for x in leaves]
        for x, g in zip(leaves, garbage):
            x.grad = g.clone()
        with poisoned_outputs():
            backward()
        for x, g, f in zip(leaves, garbage, first):
            assert torch.isfinite(f).all()
            torch.testing.assert_close(x.grad, g + f, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("decay", reference.DECAYS)
def test_step_equals_one_token_and_updates_in_place(device, decay):
    for backend in kernel_backends(device):
        batch, steps, heads, n = shape_for(backend, 2, 5, 2, 64)
        inputs = parity.rwkv7_inputs(batch, steps, heads, n, decay=decay, generator=seeded(23), device=device,
                                     initial_state=True)
        xs = [inputs[k] for k in parity.GRAD_NAMES[:6]]
        state = inputs["initial_state"].clone()
        pointer = state.data_ptr()
        ys = []
        with poisoned_outputs():
            for t in range(steps):
                ys.append(ops.wkv7_step(*(x[:, t] for x in xs), state, decay=decay, backend=backend))
            y1, s1 = ops.wkv7(*(x[:, :1] for x in xs), initial_state=inputs["initial_state"],
                              output_final_state=True, decay=decay, backend=backend)
            y_all, s_all = ops.wkv7(*xs, initial_state=inputs["initial_state"], output_final_state=True, decay=decay,
                                    backend=backend)
        assert state.data_ptr() == pointer
        first_state = inputs["initial_state"].clone()
        y_first = ops.wkv7_step(*(x[:, 0] for x in xs), first_state, decay=decay, backend=backend)
        # The step and the sequence kernel compute the same fp32 recurrence, but not in the same order on a GPU (the
        # decode kernel splits its dot products across lanes differently, compiled Triton reduces in trees): a few fp32
        # roundings apart, as test_state_passing_matches_one_run bounds them. Element-wise rtol/atol 1e-6 failed on the
        # H200 (2026-11-26) for every decay convention.
        for name, got, expected in [("y first", y_first, y1[:, 0]), ("state first", first_state, s1),
                                    ("y", torch.stack(ys, 1), y_all), ("state", state, s_all)]:
            assert rms_ratio(got, expected) < 1e-6, (backend, name)
        # Step and sequence kernel agreeing proves nothing if they share a bug (the cpu twin's are one header):
        # the steps against the fp64 oracle too.
        ref_y, ref_state = reference.wkv7(*xs, initial_state=inputs["initial_state"], output_final_state=True,
                                          decay=decay)
        tol = parity.tolerance(torch.float32, "fp32", steps)
        assert_within(measure("wkv7_step y", backend, "fp32", torch.stack(ys, 1), ref_y, tol))
        assert_within(measure("wkv7_step state", backend, "fp32", state, ref_state, tol))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_does_not_touch_the_math(device, dtype):
    for backend in kernel_backends(device):
        inputs = parity.rwkv7_inputs(*shape_for(backend, 1, 20, 2, 32), generator=seeded(24), device=device,
                                     initial_state=True)
        xs = [inputs[k] for k in parity.GRAD_NAMES[:6]]
        plain = ops.wkv7(*xs, initial_state=inputs["initial_state"], output_final_state=True, backend=backend)
        with torch.autocast(device.type, dtype=dtype):
            under = ops.wkv7(*xs, initial_state=inputs["initial_state"], output_final_state=True, backend=backend)
        assert under[0].dtype == torch.float32 and under[1].dtype == torch.float32
        assert torch.equal(plain[0], under[0]) and torch.equal(plain[1], under[1]), backend


def test_non_contiguous_inputs_are_copied(device):
    for backend in kernel_backends(device):
        batch, seqlen, heads, n = shape_for(backend, 1, 12, 2, 32)
        inputs = parity.rwkv7_inputs(batch, seqlen, heads, n, generator=seeded(25), device=device)
        xs = [inputs[k] for k in parity.GRAD_NAMES[:6]]
        strided = [torch.stack((x, torch.full_like(x, float('nan'))), dim=-1)[..., 0] for x in xs]  # stride 2
        assert not strided[0].is_contiguous()
        with poisoned_outputs():
            expected = ops.wkv7(*xs, output_final_state=True, backend=backend)
            got = ops.wkv7(*strided, output_final_state=True, backend=backend)
        assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])


def test_gradcheck_fp64_cpu_twin():
    gen = seeded(26)
    inputs = parity.rwkv7_inputs(1, 5, 1, 32, dtype=torch.float64, decay="raw", generator=gen)
    s0 = torch.randn(2, 1, 32, 32, dtype=torch.float64, generator=gen)
    cu = torch.tensor([0, 2, 5])
    leaves = [inputs[k].requires_grad_() for k in parity.GRAD_NAMES[:6]] + [s0.requires_grad_()]

    def f(*args):
        return ops.wkv7(*args[:6], initial_state=args[6], output_final_state=True, cu_seqlens=cu, decay="raw",
                        backend="cpu")

    assert torch.autograd.gradcheck(f, leaves, fast_mode=True)


def test_torch_compile_fullgraph(device):
    backend = kernel_backends(device)[0]
    inputs = parity.rwkv7_inputs(*shape_for(backend, 1, 20, 2, 32), generator=seeded(27), device=device,
                                 initial_state=True)
    xs = [inputs[k].clone().requires_grad_() for k in parity.GRAD_NAMES[:6]]

    def f(*args, state):
        y, s = ops.wkv7(*args, initial_state=inputs["initial_state"], output_final_state=True, backend=backend)
        y_step = ops.wkv7_step(*(x[:, -1].detach() for x in args), state, backend=backend)
        return (y.float() * y.float()).sum() + s.sum() + y_step.sum()

    state_compiled, state_eager = inputs["initial_state"].clone(), inputs["initial_state"].clone()
    torch.compile(f, fullgraph=True)(*xs, state=state_compiled).backward()
    compiled_grads = [x.grad for x in xs]
    for x in xs:
        x.grad = None
    f(*xs, state=state_eager).backward()
    for got, expected in zip(compiled_grads, [x.grad for x in xs]):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state_compiled, state_eager, rtol=0, atol=0)


@pytest.mark.parametrize("algorithm", ["sequential", "chunked"])
def test_malformed_cu_seqlens_under_compile_poison_the_outputs(device, algorithm):
    """Compiled, cu_seqlens' values go unchecked on the host. The cpu twin checks them in C++ (no sync to avoid);
    the device twins clamp them (tests/test_wkv7_triton_bounds.py) and their outputs become NaN, so tokens outside
    every sequence never come back as unwritten memory."""
    inputs = parity.rwkv7_inputs(1, 10, 1, 32, generator=seeded(31), device=device)
    xs = [inputs[k] for k in parity.GRAD_NAMES[:6]]

    def f(cu):
        return ops.wkv7(*xs, cu_seqlens=cu, output_final_state=True, backend=backend, algorithm=algorithm)

    for backend in kernel_backends(device):
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        good = torch.tensor([0, 4, 10], device=device)
        for got, expected in zip(compiled(good), f(good)):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        for bad in ([0, 4, 5], [2, 4, 10], [0, 7, 4, 10]):
            cu = torch.tensor(bad, device=device)
            if backend == "cpu":  # the values as a list (it printed a C++ tensor dump)
                with pytest.raises(ValueError, match=r"cu_seqlens must .*, got \[" + ", ".join(map(str, bad)) + r"\]$"):
                    compiled(cu)
                continue
            y, final_state = compiled(cu)
            assert y.isnan().all() and final_state.isnan().all(), (backend, bad)


def _ins(batch=1, seqlen=4, heads=1, n=32, dtype=torch.float32):
    inputs = parity.rwkv7_inputs(batch, seqlen, heads, n, dtype=dtype, generator=seeded(28))
    return [inputs[k] for k in parity.GRAD_NAMES[:6]]


def test_errors_name_the_argument():
    xs = _ins()
    with pytest.raises(ValueError, match="head size N = 48"):
        ops.wkv7(*_ins(n=48))
    with pytest.raises(ValueError, match="k has shape"):
        ops.wkv7(xs[0], xs[1], xs[2][:, :2], *xs[3:])
    with pytest.raises(TypeError, match="v has dtype"):
        ops.wkv7(*xs[:3], xs[3].half(), *xs[4:])
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        ops.wkv7(*xs[:4], 1.0, xs[5])
    with pytest.raises(ValueError, match="r must have shape"):
        ops.wkv7(*(x[0] for x in xs))
    with pytest.raises(ValueError, match="initial_state must have shape"):
        ops.wkv7(*xs, initial_state=torch.zeros(1, 1, 32, 31))
    with pytest.raises(TypeError, match="initial_state must be torch.float32"):
        ops.wkv7(*xs, initial_state=torch.zeros(1, 1, 32, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="decay must be one of"):
        ops.wkv7(*xs, decay="exp")
    with pytest.raises(ValueError, match="precision must be one of"):
        ops.wkv7(*xs, precision="fp8")
    with pytest.raises(ValueError, match="cu_seqlens needs packed sequences with batch size 1"):
        ops.wkv7(*_ins(batch=2), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing from 0 to T = 4"):
        ops.wkv7(*xs, cu_seqlens=torch.tensor([0, 3, 2, 4]))
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing from 0 to T = 4"):
        ops.wkv7(*xs, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(TypeError, match="cu_seqlens must be int32 or int64"):
        ops.wkv7(*xs, cu_seqlens=torch.tensor([0.0, 4.0]))
    with pytest.raises(ValueError, match=r"initial_state must have shape \[2, 1, 32, 32\]"):
        ops.wkv7(*xs, cu_seqlens=torch.tensor([0, 1, 4]), initial_state=torch.zeros(3, 1, 32, 32))
    with pytest.raises(TypeError, match="r must have dtype"):
        ops.wkv7(*(x.to(torch.int32) for x in xs))


def test_step_errors_name_the_argument():
    xs = [x[:, 0] for x in _ins()]
    with pytest.raises(ValueError, match="state must have shape"):
        ops.wkv7_step(*xs, torch.zeros(1, 1, 32, 16))
    with pytest.raises(TypeError, match="state must be torch.float32"):
        ops.wkv7_step(*xs, torch.zeros(1, 1, 32, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="state must be contiguous"):
        ops.wkv7_step(*xs, torch.zeros(1, 1, 32, 32).transpose(2, 3))
    with pytest.raises(ValueError, match="decay must be one of"):
        ops.wkv7_step(*xs, torch.zeros(1, 1, 32, 32), decay="sigmoid")


def test_step_bumps_the_state_version_so_a_saved_state_fails_autograd(device):
    """The state is updated in place: another op that saved it for backward must fail autograd's check rather than use
    the changed state silently (the C++ ops' declared mutation bumped no version counter outside autograd)."""
    inputs = parity.rwkv7_inputs(2, 1, 1, 32, generator=seeded(31), device=device, initial_state=True)
    xs = [inputs[k][:, 0] for k in parity.GRAD_NAMES[:6]]
    for backend in kernel_backends(device) + ["reference"]:
        for path in ("general", "fast"):  # the second call takes the decode fast path
            state = inputs["initial_state"].clone()
            weight = torch.ones_like(state, requires_grad=True)
            saved = (weight * state).sum()  # mul saves state for weight's gradient
            version = state._version
            ops.wkv7_step(*xs, state, backend=backend)
            assert state._version > version, (backend, path)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                saved.backward()


def test_step_refuses_gradients_except_on_the_reference(device):
    """The step ops have no autograd kernel: torch alone would only warn, and the cpu twin's backward silently dropped
    the step. So with grad mode on, an input or a state that requires grad is refused, also after the fast path has
    accepted the call; the reference backend differentiates."""
    inputs = parity.rwkv7_inputs(2, 1, 1, 32, generator=seeded(29), device=device, initial_state=True)
    xs = [inputs[k][:, 0] for k in parity.GRAD_NAMES[:6]]
    s0 = inputs["initial_state"]
    for backend in kernel_backends(device):
        ops.wkv7_step(*xs, s0.clone(), backend=backend)  # caches the fast path
        r = xs[0].clone().requires_grad_()
        with pytest.raises(RuntimeError, match="wkv7_step has no backward .* requires_grad is set on r: train with "
                                               "ropewkv.wkv7"):
            ops.wkv7_step(r, *xs[1:], s0.clone(), backend=backend)
        with pytest.raises(RuntimeError, match="requires_grad is set on state"):
            ops.wkv7_step(*xs, s0.clone().requires_grad_() * 1.0, backend=backend)
        with torch.no_grad():
            ops.wkv7_step(r, *xs[1:], s0.clone(), backend=backend)
    r = xs[0].clone().requires_grad_()
    cot = torch.randn(r.shape, generator=seeded(30)).to(device)
    grad, = torch.autograd.grad(ops.wkv7_step(r, *xs[1:], s0.clone(), backend="reference"), r, cot)
    r64 = xs[0].double().requires_grad_()
    y64, _ = reference.wkv7(r64[:, None], *(x[:, None].double() for x in xs[1:]), initial_state=s0.double())
    expected, = torch.autograd.grad(y64[:, 0], r64, cot.double())
    assert rms_ratio(grad, expected) < 1e-6


def test_cpp_guards_behind_python():
    """The C++ checks are a second guard: they reject what Python would, without crashing."""
    xs = _ins()
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        torch.ops.ropewkv.wkv7_forward(*xs, None, torch.tensor([0, 9]), 0, 0, False)
    with pytest.raises(ValueError, match="decay must be 0"):
        torch.ops.ropewkv.wkv7_forward(*xs, None, None, 7, 0, False)
    with pytest.raises(ValueError, match="initial_state must have shape"):
        torch.ops.ropewkv.wkv7_forward(*xs, torch.zeros(2, 1, 32, 32), None, 0, 0, False)


def test_parity_rows_cover_every_backend(device):
    rows = list(parity.parity_rows(device, seed=3))
    backends = set(kernel_backends(device))
    chunked = {f"{b} chunked" for b in backends}
    assert {r.backend for r in rows} == backends | chunked
    for row in rows:
        assert_within(row)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="routing of head size 256 for CUDA tensors")
def test_head_size_256_on_cuda_routes_to_triton_or_says_why():
    inputs = parity.rwkv7_inputs(1, 3, 1, 256, torch.float32, "loglog", seeded(99), "cuda")
    del inputs["initial_state"]
    y, _ = ops.wkv7(**inputs)  # auto: the CUDA twin stops at 128, so this runs the Triton twin
    expected, _ = reference.wkv7(**inputs)
    assert rms_ratio(y, expected) < 1e-5
    with pytest.raises(ValueError, match="not supported by the cuda backend"):
        ops.wkv7(**inputs, backend="cuda")
