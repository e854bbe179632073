"""csrc/include/ropewkv/mma_bf16.cuh on the host (tests/data/mma_bf16_on_host.cpp, one warp of the block emulator).

The CUDA chunked kernels' bf16 mode builds its mma.sync fragments by that header's layout table, and on the host the
header forms each product from those fragments (test_wkv7_chunked_cuda_on_host.py runs it): through the emulator's
warp_gather, or through warp shuffles as on GPUs before sm_80 (ROPEWKV_MMA_SHUFFLES); both forms are built here.
Here the fragments are built independently, from whole matrices by the PTX ISA's table for mma.m16n8k16 .bf16
("Matrix Fragments for mma.m16n8k16"), so that the emulated product is held to the documented layout, not only to the
kernel's own use of it: D = C + A B bit for bit (entries multiples of 1/4 in [-2, 2): every product and sum exact in
fp32). The hi/lo split: hi and lo are round-to-nearest-even bf16 of x and of x - hi (torch's own conversion), and
x - hi - lo is within 2^-16 |x| (bf16's unit roundoff squared).
"""
import random
import subprocess

import pytest
import torch

from host_cuda import build_driver


@pytest.fixture(scope="session", params=["warp_gather", "shuffles"])
def driver(tmp_path_factory, request) -> str:
    defines = ("ROPEWKV_MMA_SHUFFLES",) if request.param == "shuffles" else ()
    return build_driver("mma_bf16_on_host.cpp", str(tmp_path_factory.mktemp("mma_bf16") / "driver"), [],
                        defines=defines)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """bf16 values' 16-bit patterns as int64."""
    return x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def _pack(low: torch.Tensor, high: torch.Tensor) -> int:
    return int(_bits(low) | _bits(high) << 16)


def _lanes():
    for lane in range(32):
        yield lane, lane // 4, lane % 4  # lane, groupID, threadID_in_group


def a_registers(a: torch.Tensor) -> torch.Tensor:
    """A (16 x 16, row-major): a0,a1 (g, 2t..2t+1), a2,a3 (g+8, ...), a4,a5 (g, 2t+8..), a6,a7 (g+8, 2t+8..)."""
    regs = torch.zeros(32, 4, dtype=torch.int64)
    for lane, g, t in _lanes():
        for i, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            regs[lane, i] = _pack(a[row, col], a[row, col + 1])
    return regs


def b_registers(b: torch.Tensor) -> torch.Tensor:
    """B (16 x 8): b0,b1 (rows 2t..2t+1, column g), b2,b3 (rows 2t+8..2t+9, column g)."""
    regs = torch.zeros(32, 2, dtype=torch.int64)
    for lane, g, t in _lanes():
        for i, row in enumerate([2 * t, 2 * t + 8]):
            regs[lane, i] = _pack(b[row, g], b[row + 1, g])
    return regs


def c_layout(m: torch.Tensor) -> torch.Tensor:
    """C/D (16 x 8, fp32): c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1)."""
    out = torch.empty(32, 4)
    for lane, g, t in _lanes():
        out[lane] = torch.stack([m[g, 2 * t], m[g, 2 * t + 1], m[g + 8, 2 * t], m[g + 8, 2 * t + 1]])
    return out


def _raw(t: torch.Tensor, path):
    (t.to(torch.int64).to(torch.int32) if t.dtype == torch.int64 else t).contiguous().numpy().tofile(path)


def test_mma_and_split_follow_the_ptx_layout(driver, tmp_path):
    seed = random.SystemRandom().randrange(2 ** 31)
    gen = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randint(-8, 8, shape, generator=gen).float() / 4 for shape in ((16, 16), (16, 8), (16, 8)))
    x = torch.randn(2 * 500, generator=gen) * torch.logspace(-30, 30, 2 * 500)
    x[:6] = torch.tensor([0.0, -0.0, 1.0, 3.0e38, -1.5e-40, 1 + 2.0 ** -9])  # zeros, exact, huge, subnormal, tie
    for name, tensor in (("a", a_registers(a)), ("b", b_registers(b)), ("c", c_layout(c)), ("x", x)):
        _raw(tensor, tmp_path / f"{name}.bin")
    run = subprocess.run([driver, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"seed {seed}: {run.stderr[-4000:]}"

    d = torch.frombuffer(bytearray((tmp_path / "d.bin").read_bytes()), dtype=torch.float32).view(32, 4)
    assert torch.equal(d, c_layout(c + a @ b)), f"seed {seed}"

    split = torch.frombuffer(bytearray((tmp_path / "split.bin").read_bytes()), dtype=torch.int32).view(-1, 2)
    halves = torch.stack([split & 0xFFFF, (split >> 16) & 0xFFFF], -1)  # [pair, hi/lo, element]
    values = (halves.to(torch.int32) << 16).view(torch.float32)
    hi, lo = values[:, 0].reshape(-1), values[:, 1].reshape(-1)
    assert torch.equal(hi, x.to(torch.bfloat16).float()), f"seed {seed}"
    assert torch.equal(lo, (x - hi).to(torch.bfloat16).float()), f"seed {seed}"
    normal = x.abs() > 2.0 ** -100  # the bound is relative: far from bf16's underflow
    assert ((x - hi - lo).abs() <= 2.0 ** -16 * x.abs())[normal].all(), f"seed {seed}"
