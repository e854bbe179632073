"""The in-kernel angle at large positions: error < 1e-6 rad up to 2^20, against fp64 of pos * inv_freq (fp32)."""
import math

import torch

from ropewkv.ops.rope import rope
from ropewkv.testing import poisoned_outputs
from ropewkv.testing import rope as rp
from conftest import kernel_backends as _kernel_backends


def kernel_backends(device) -> list:
    """conftest's twins, asserted non-empty: a loop over no backend would pass the tests below vacuously."""
    backends = _kernel_backends(device)
    assert backends, f"no kernel twin runs on {device} here"
    return backends

POSITIONS = torch.cat([torch.arange(0, 64), torch.randint(0, 2**20 + 1, (448,), generator=torch.Generator().manual_seed(0)),
                       torch.tensor([2**20 - 1, 2**20])])


def angle_errors(cos: torch.Tensor, sin: torch.Tensor, positions, inv_freq) -> float:
    """Max |atan2(sin, cos) - pos * inv_freq| mod 2*pi, in rad, against fp64 of the fp32 inv_freq."""
    exact = positions.double()[:, None] * inv_freq.double()[None, :]
    got = torch.atan2(sin.double().cpu(), cos.double().cpu())
    diff = torch.remainder(got - exact + math.pi, 2 * math.pi) - math.pi
    return float(diff.abs().max())


def kernel_angle_error(backend, device) -> float:
    """Rotate the unit pair (1, 0): the output is (cos, sin) of the angle the kernel used (rounded to fp32)."""
    inv = rp.rope_inv_freq(64)
    x = torch.zeros(1, len(POSITIONS), 1, 64)
    x[..., :32] = 1.0
    with poisoned_outputs():
        out = rope(x.to(device), inv_freq=inv.to(device), positions=POSITIONS.to(device), backend=backend)
    return angle_errors(out[0, :, 0, :32], out[0, :, 0, 32:], POSITIONS, inv)


def test_angle_error_below_1e6_rad_up_to_2_pow_20(device):
    inv = rp.rope_inv_freq(64)
    naive = (POSITIONS.float()[:, None] * inv[None, :])  # HF fp32 eager: the product rounded, then cos/sin
    naive_err = angle_errors(naive.cos(), naive.sin(), POSITIONS, inv)
    bf16_err = angle_errors(naive.cos().bfloat16(), naive.sin().bfloat16(), POSITIONS, inv)
    assert naive_err > 1e-3 and bf16_err > naive_err, "the baselines this test is meant to beat"
    for backend in kernel_backends(device):
        err = kernel_angle_error(backend, device)
        print(f"angle error up to 2^20: {backend} {err:.3g} rad, HF fp32 eager {naive_err:.3g}, bf16 cache "
              f"{bf16_err:.3g}")
        assert err < 1e-6, backend  # measured 2.6e-7 rad (both twins), ~ the fp32 rounding of cos and sin
