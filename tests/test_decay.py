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


@pytest.mark.parametrize("x", [-80.0, -30.0, -17.0, 17.0, 30.0, 60.0])
def test_gradient_precise_in_the_tails(device, x):
    """The parity rows' ulp floor hides gradients this small, and the reference's autograd, s * (1 - s), is not
    relative-precise for x >> 0 even in fp64: the oracle here is -e^{-1/2} sigmoid(x) sigmoid(-x) in fp64."""
    x64 = torch.tensor([x], dtype=torch.float64)
    expected = -reference.EXP_MINUS_HALF * torch.sigmoid(x64) * torch.sigmoid(-x64)
    for backend in kernel_backends(device):
        leaf = x64.float().to(device).requires_grad_()
        ropewkv.rwkv7_log_decay(leaf, backend=backend).backward()
        assert abs(float(leaf.grad.double().cpu() / expected) - 1) < 6 * 2.0**-23, backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_twin_is_bit_identical_to_the_cpu_twin(device, dtype):
    """One exp polynomial, correctly rounded divisions and the same order of products in both (ropewkv/decay.h,
    mirrored in Triton): the same fp32 bits, forward and backward, over the model's range and the tails (also NaN and
    +-inf). Each twin gets its own leaf (x.to("cpu") is x itself, so a shared leaf would sum both gradients). The
    Triton backward rounds a bf16 gradient to nearest even itself under the interpreter, whose bf16 store truncates
    (it came out one bf16 ulp off in half the values); its store still converts an fp32 subnormal otherwise
    (-5.9e-39 from -2.2e-39 at x = 88.5), so those few are left out there. The interpreter's fma emulation can differ
    from a true fma by one ulp in rare ties (~1 in 2^29 per fma; 7 per value here)."""
    if "triton" not in ropewkv.available_backends(device):
        pytest.skip(f"no Triton twin for {device} tensors")
    x = torch.cat([decay_parity.decay_input(20000, torch.float64, seeded(16)) * 3,
                   torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 88.5, -103.5])]).to(dtype)
    grad = torch.randn(x.shape, generator=seeded(17))

    def forward_and_backward(backend, x_in, on):
        leaf = x_in.to(on).detach().requires_grad_()
        out = ropewkv.rwkv7_log_decay(leaf, backend=backend)
        out.backward(grad.to(on))
        return out.detach().cpu(), leaf.grad.cpu()

    expected = forward_and_backward("cpu", x, "cpu")
    triton_outputs = forward_and_backward("triton", x, device)
    checked = torch.ones(x.shape, dtype=torch.bool)
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16:
        grad32 = forward_and_backward("cpu", x.float(), "cpu")[1]
        checked = ~((grad32 != 0) & (grad32.abs() < torch.finfo(torch.float32).tiny))
        assert (~checked).sum() <= 2  # x = 88.5, and one of the 20,000 at most
    for name, want, triton in zip(("forward", "backward"), expected, triton_outputs):
        want, triton = want[checked], triton[checked]
        assert torch.equal(want.isnan(), triton.isnan()), name
        same = want.isnan() | (want == triton)
        assert same.all(), (name, x[checked][~same][:5], want[~same][:5], triton[~same][:5])


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


def test_double_backward_vs_fp64(device):
    """create_graph=True through the backward (Hessian-vector products, gradient penalties): both second derivatives,
    wrt x and wrt the incoming gradient. The C++ twins dropped f'' with only a warning, the Triton twin raised."""
    x64 = (-6.0 + 8.0 * torch.rand(256, dtype=torch.float64, generator=seeded(18))).float().double()
    cotangent, probe = torch.randn(2, 256, dtype=torch.float64, generator=seeded(19))

    def second_derivatives(backend, dtype):
        x = x64.to(dtype).to(device).requires_grad_()
        weight = cotangent.to(dtype).to(device).requires_grad_()
        (grad_x,) = torch.autograd.grad(ropewkv.rwkv7_log_decay(x, backend=backend), x, weight, create_graph=True)
        return torch.autograd.grad(grad_x, (x, weight), probe.to(dtype).to(device))

    want = second_derivatives("reference", torch.float64)
    for backend in kernel_backends(device):
        for got, expected in zip(second_derivatives(backend, torch.float32), want):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double().cpu(), expected.cpu(), rtol=1e-6, atol=0)
    x = x64[:32].clone().requires_grad_()
    assert torch.autograd.gradgradcheck(lambda t: ropewkv.rwkv7_log_decay(t, backend="cpu"), (x,))


def test_non_contiguous_and_empty(device):
    x = decay_parity.decay_input(64, torch.float32, seeded(14), device)[:64].view(8, 8).t()
    for backend in kernel_backends(device):
        with poisoned_outputs():
            out = ropewkv.rwkv7_log_decay(x, backend=backend)
        torch.testing.assert_close(out, reference.rwkv7_log_decay(x), rtol=4e-7, atol=0)
        empty = ropewkv.rwkv7_log_decay(torch.empty(0, 3, device=device), backend=backend)
        assert empty.shape == (0, 3) and empty.dtype == torch.float32


def test_fakes_match_for_a_non_contiguous_input(device):
    """The twins return contiguous outputs whatever x's strides, and so must their fakes: inductor checks the strides
    (the compiled backward of a transposed x failed)."""
    x = decay_parity.decay_input(17, torch.float32, seeded(16), device)[:24].view(4, 6).t()
    for backend in kernel_backends(device):
        suffix = "_triton" if backend == "triton" else ""
        for name, args in (("log_decay", (x,)), ("log_decay_backward", (torch.randn(x.shape, device=device), x))):
            torch.library.opcheck(getattr(torch.ops.ropewkv, name + suffix).default, args,
                                  test_utils=("test_faketensor",))
    base = x.t().contiguous().requires_grad_()
    weights = torch.arange(24.0, device=device).view(6, 4)

    def f(b):
        return (ropewkv.rwkv7_log_decay(b.t()) * weights).sum()

    want = torch.autograd.grad(f(base), base)[0]
    with torch._inductor.utils.fresh_inductor_cache():  # a cached graph would keep the old fake's strides
        got = torch.autograd.grad(torch.compile(f, fullgraph=True)(base), base)[0]
    assert torch.equal(got, want)


def test_bad_input_is_named(device):
    with pytest.raises(TypeError, match="x must have dtype"):
        ropewkv.rwkv7_log_decay(torch.ones(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        ropewkv.rwkv7_log_decay([1.0, 2.0])
    # On the device where Triton runs (the GPU, or the CPU under the interpreter): on a GPU machine, Triton takes no
    # CPU tensors at all, and says so before any dtype check.
    with pytest.raises(TypeError, match="for backend 'triton'"):
        ropewkv.rwkv7_log_decay(torch.ones(3, dtype=torch.float64, device=device), backend="triton")


def test_torch_compile_fullgraph(device):
    x = decay_parity.decay_input(128, torch.bfloat16, seeded(15), device).requires_grad_()
    compiled = torch.compile(lambda t: ropewkv.rwkv7_log_decay(t).sum(), fullgraph=True)
    compiled(x).backward()
    expected = torch.autograd.grad(ropewkv.rwkv7_log_decay(x).sum(), x)[0]
    assert torch.equal(x.grad, expected)
