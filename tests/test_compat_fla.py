"""ropewkv.compat.fla against the fp64 reference after FLA's layout (state [N, H, K, V]) and decay (log) conversions."""
import pytest
import torch

from ropewkv.compat import fla
from ropewkv.reference import rwkv7 as reference
from ropewkv.testing import rms_ratio, seeded
from ropewkv.testing import rwkv7 as parity
from conftest import kernel_backends


@pytest.mark.parametrize("name,scale", [("chunk_rwkv7", 1.0), ("fused_recurrent_rwkv7", None)])
def test_matches_reference_after_conversions(device, name, scale):
    for backend in kernel_backends(device):
        small = backend == "triton" and not torch.cuda.is_available()
        bounds = [0, 7, 19] if small else [0, 9, 40, 41]
        n = 32 if small else 64
        gen = seeded(31)
        inputs = parity.rwkv7_inputs(1, bounds[-1], 2, n, decay="log", generator=gen, device=device)
        xs = [inputs[k].clone().requires_grad_() for k in parity.GRAD_NAMES[:6]]
        s0_fla = torch.randn(len(bounds) - 1, 2, n, n, generator=gen).to(device).requires_grad_()  # [N, H, K, V]
        cu = torch.tensor(bounds, device=device)
        y, s = getattr(fla, name)(*xs, scale=scale, initial_state=s0_fla, output_final_state=True, cu_seqlens=cu,
                                  backend=backend)
        cot_y, cot_s = torch.randn(y.shape, generator=gen).to(device), torch.randn(s.shape, generator=gen).to(device)
        grads = torch.autograd.grad((y * cot_y).sum() + (s * cot_s).sum(), xs + [s0_fla])

        xs64 = [x.detach().double().requires_grad_() for x in xs]
        s0_64 = s0_fla.detach().double().requires_grad_()
        factor = 1.0 if scale is not None else n**-0.5
        # The reference in RWKV-LM layout: S[v][k] = transpose of FLA's [K, V]; r scaled; w log decay.
        y_ref, s_ref = reference.wkv7(xs64[0] * factor, *xs64[1:], initial_state=s0_64.transpose(-1, -2),
                                      output_final_state=True, cu_seqlens=cu, decay="log")
        s_ref = s_ref.transpose(-1, -2)
        ref_grads = torch.autograd.grad((y_ref * cot_y.double()).sum() + (s_ref * cot_s.double()).sum(),
                                        xs64 + [s0_64])
        tol = parity.tolerance(torch.float32, "fp32", bounds[-1]).rms
        assert rms_ratio(y, y_ref) < tol and rms_ratio(s, s_ref) < tol, backend
        for got, expected in zip(grads, ref_grads):
            assert rms_ratio(got, expected) < tol, backend


def test_defaults_follow_fla():
    inputs = parity.rwkv7_inputs(1, 6, 1, 32, decay="log", generator=seeded(32))
    xs = [inputs[k] for k in parity.GRAD_NAMES[:6]]
    y, s = fla.chunk_rwkv7(*xs)
    assert s is None  # chunk_rwkv7: output_final_state=False, scale=1.0
    y_ref, _ = reference.wkv7(*xs, decay="log")
    assert rms_ratio(y, y_ref) < 1e-6
    y2, s2 = fla.fused_recurrent_rwkv7(*xs)  # FLA's defaults: scale K^-0.5, final state returned
    assert s2 is not None and rms_ratio(y2, y_ref * 32**-0.5) < 1e-6
