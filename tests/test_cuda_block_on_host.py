"""The host block emulator (tests/data/host_cuda/cuda_block_prelude.h) against torch: a small CUDA kernel with shared
memory, __syncthreads and the four warp shuffles (tests/data/cuda_block_on_host.cpp), run on the host over a 2-D grid
of 16 x 16-thread blocks, each block's threads concurrent. Built twice: with AddressSanitizer/UBSan (an access past
a buffer or a shared array aborts), and with ThreadSanitizer (a data race, such as one a missing barrier leaves
between the emulator's threads, aborts); both must run clean.

Inputs are fresh random values; the floats are multiples of 2^-10 in [-1, 1), so that every sum is exact in fp32 in
any order, and the expected outputs (torch, computed here) are compared bit for bit; but the one through the math
stand-ins (__expf, __fmaf_rn, __ldg, fmaxf, min, the bit casts), against fp64 within fp32 rounding.
"""
import random
import subprocess

import pytest
import torch

from host_cuda import build_driver

TILE = 16
THREADS = TILE * TILE
GRID = (3, 2)
SANITIZERS = {"asan_ubsan": "address,undefined", "tsan": "thread,undefined"}


@pytest.fixture(scope="session", params=list(SANITIZERS))
def driver(request, tmp_path_factory) -> str:
    exe = str(tmp_path_factory.mktemp("cuda_block_on_host") / f"driver_{request.param}")
    return build_driver("cuda_block_on_host.cpp", exe, [], sanitizers=SANITIZERS[request.param])


def _expected(x, ints):
    """Each output as the kernel lays it out: [blocks, THREADS], thread t = threadIdx.x + TILE * threadIdx.y."""
    warps = x.view(-1, THREADS // 32, 32)
    ints_warps = ints.view(-1, THREADS // 32, 32)
    group16 = ints_warps.view(-1, THREADS // 32, 2, 16)
    in_group = torch.arange(16)
    down = torch.where(in_group + 3 < 16, in_group + 3, in_group)
    return {
        "warp_sum": warps.sum(-1, keepdim=True).expand_as(warps).reshape(-1, THREADS),
        "block_sum": x.sum(-1, keepdim=True).expand_as(x),
        "transpose": x.view(-1, TILE, TILE).transpose(1, 2).reshape(-1, THREADS),
        "prefix": ints_warps.cumsum(-1, dtype=torch.int32).reshape(-1, THREADS),
        "rotate16": group16[..., (in_group + 1) % 16].reshape(-1, THREADS),
        "down16": group16[..., down].reshape(-1, THREADS),
    }


def test_block_kernel_on_host_matches_torch(driver, tmp_path):
    seed = random.SystemRandom().randrange(2 ** 31)
    gen = torch.Generator().manual_seed(seed)
    blocks = GRID[0] * GRID[1]
    x = torch.randint(-1024, 1024, (blocks, THREADS), generator=gen).float() / 1024
    ints = torch.randint(-1000, 1000, (blocks, THREADS), generator=gen, dtype=torch.int32)
    x.numpy().tofile(tmp_path / "x.bin")
    ints.numpy().tofile(tmp_path / "ints.bin")
    run = subprocess.run([driver, str(tmp_path), *map(str, GRID)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"seed {seed}: {run.stderr[-4000:]}"

    def read(name, dtype):
        return torch.frombuffer(bytearray((tmp_path / f"{name}.bin").read_bytes()), dtype=dtype).view(blocks, THREADS)

    for name, want in _expected(x, ints).items():
        got = read(name, want.dtype)
        assert torch.equal(got, want), f"{name} (seed {seed}): {int((got != want).sum())} of {got.numel()} differ"
    x64 = x.double()
    math = -(x64.exp() * x64.clamp(min=0.5) + x64.clamp(max=-0.5))
    torch.testing.assert_close(read("math", torch.float32).double(), math, rtol=1e-6, atol=1e-6,
                               msg=lambda m: f"math (seed {seed}): {m}")
