"""rwkv7_log_decay on every twin against the fp64 reference."""
import pytest
import torch

import ropewkv
from ropewkv.reference import rwkv7 as reference
from ropewkv.testing import assert_within, poisoned_outputs, seeded
from ropewkv.testing import decay as decay_parity
from conftest import kernel_backends


def test_parity_every_backend_and_dtype(device):
    rows = list(decay_parity.parity_rows(device, seed=11))
    assert {r.backend for r in rows} == set(kernel_backends(device))
    for row in rows:
        assert_within(row)


@pytest.mark.parametrize("x", [-87.0, -60.0, -30.0, -17.0, 17.0, 30.0])
def test_precise_in_the_tails(device, x):
    """Naive 1/(1 + e^{-x}) in fp32 overflows to 0 below x = -88.7 and loses relative precision earlier."""
    xs = torch.tensor([x], dtype=torch.float32, device=device)
    expected = reference.rwkv7_log_decay(xs.double())
    for backend in kernel_backends(device):
        out = ropewkv.rwkv7_log_decay(xs, backend=backend).double()
        assert abs(float(out / expected) - 1) < 4 * 2.0**-23, backend


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_keeps_fp32(device, dtype):
    x = decay_parity.decay_input(256, dtype, seeded(12), device)
    for backend in kernel_backends(device):
        plain = ropewkv.rwkv7_log_decay(x, backend=backend)
        with torch.autocast(device.type, dtype=dtype):
            under_autocast = ropewkv.rwkv7_log_decay(x, backend=backend)
        assert under_autocast.dtype == torch.float32
        assert torch.equal(plain, under_autocast), backend


def test_gradcheck_fp64_cpu_twin():
    x = decay_parity.decay_input(64, torch.float64, seeded(13)).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: ropewkv.rwkv7_log_decay(t, backend="cpu"), (x,))


def test_non_contiguous_and_empty(device):
    x = decay_parity.decay_input(64, torch.float32, seeded(14), device)[:64].view(8, 8).t()
    for backend in kernel_backends(device):
        with poisoned_outputs():
            out = ropewkv.rwkv7_log_decay(x, backend=backend)
        torch.testing.assert_close(out, reference.rwkv7_log_decay(x), rtol=4e-7, atol=0)
        empty = ropewkv.rwkv7_log_decay(torch.empty(0, 3, device=device), backend=backend)
        assert empty.shape == (0, 3) and empty.dtype == torch.float32


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="x must have dtype"):
        ropewkv.rwkv7_log_decay(torch.ones(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        ropewkv.rwkv7_log_decay([1.0, 2.0])
    with pytest.raises(TypeError, match="for backend 'triton'"):
        ropewkv.rwkv7_log_decay(torch.ones(3, dtype=torch.float64), backend="triton")


def test_torch_compile_fullgraph(device):
    x = decay_parity.decay_input(128, torch.bfloat16, seeded(15), device).requires_grad_()
    compiled = torch.compile(lambda t: ropewkv.rwkv7_log_decay(t).sum(), fullgraph=True)
    compiled(x).backward()
    expected = torch.autograd.grad(ropewkv.rwkv7_log_decay(x).sum(), x)[0]
    assert torch.equal(x.grad, expected)
