"""The CUDA decode step's lane map and reduction order, replayed on the host (no GPU here).

step_kernel (csrc/wkv7/wkv7_kernels.cuh) moves the state in lane-contiguous float4s and sums each row over its lanes
with an xor-butterfly of warp shuffles. tests/data/wkv7_step_lanes.cpp replays that with the kernel's own lane map and
per-lane math (csrc/include/ropewkv/wkv7_step_lanes.h), every lane of a warp in lockstep, and fails if the map misses
or repeats a state element; its y and new state are compared here with the fp64 reference and the CPU twin.
"""
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

import ropewkv.ops.rwkv7 as ops
from ropewkv.reference import rwkv7 as reference
from ropewkv.testing import rms_ratio, seeded
from ropewkv.testing.rwkv7 import rwkv7_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ("r", "w", "k", "v", "a", "b")
DECAYS = {"loglog": 0, "raw": 1, "log": 2}
# One fp32 step: each output is a sum of N products plus a few roundings; the butterfly's order differs from the
# sequential sums of the CPU twin only by rounding, so both stay within a few ulps (2^-24 = 6e-8) in rms.
FP32_RMS = 1e-6


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ not found (the CPU extension's build needs it anyway)")
    binary = tmp_path_factory.mktemp("lanes") / "wkv7_step_lanes"
    subprocess.run(["g++", "-std=c++20", "-O2", "-I", os.path.join(ROOT, "csrc", "include"),
                    os.path.join(ROOT, "tests", "data", "wkv7_step_lanes.cpp"), "-o", str(binary)], check=True)
    return str(binary)


def run_replay(binary, tmp_path, xs, state, decay):
    batch, heads, n = xs[0].shape
    tasks = batch * heads
    with open(tmp_path / "in.bin", "wb") as f:
        for x in [*xs, state]:
            x.to(torch.float32).contiguous().numpy().tofile(f)
    subprocess.run([binary, str(n), str(DECAYS[decay]), str(tasks), str(tmp_path / "in.bin"),
                    str(tmp_path / "out.bin")], check=True)
    out = np.fromfile(tmp_path / "out.bin", dtype=np.float32)
    return (torch.from_numpy(out[:tasks * n].copy()).view(batch, heads, n),
            torch.from_numpy(out[tasks * n:].copy()).view(batch, heads, n, n))


@pytest.mark.parametrize("n", [32, 64, 128])
@pytest.mark.parametrize("decay", ["loglog", "raw", "log"])
def test_replay_matches_reference_and_cpu_twin(replay, tmp_path, n, decay):
    inputs = rwkv7_inputs(3, 1, 2, n, torch.float32, decay, seeded(n + DECAYS[decay]))
    xs = [inputs[name][:, 0] for name in NAMES]
    state = torch.randn(3, 2, n, n, generator=seeded(99))
    y, new_state = run_replay(replay, tmp_path, xs, state, decay)

    y64, state64 = reference.wkv7_step(*(x.double() for x in xs), state.double(), decay=decay)
    assert rms_ratio(y, y64) < FP32_RMS
    assert rms_ratio(new_state, state64) < FP32_RMS

    state_cpu = state.clone()
    y_cpu = ops.wkv7_step(*xs, state_cpu, decay=decay, backend="cpu")
    assert rms_ratio(y, y_cpu) < FP32_RMS
    assert rms_ratio(new_state, state_cpu) < FP32_RMS


def test_replay_catches_a_wrong_lane_order(replay, tmp_path):
    """The comparison can fail: a state whose rows are permuted gives a different y."""
    inputs = rwkv7_inputs(1, 1, 1, 64, torch.float32, "loglog", seeded(5))
    xs = [inputs[name][:, 0] for name in NAMES]
    state = torch.randn(1, 1, 64, 64, generator=seeded(6))
    y, _ = run_replay(replay, tmp_path, xs, state, "loglog")
    y_permuted, _ = reference.wkv7_step(*(x.double() for x in xs), state.double()[:, :, :, torch.randperm(64)])
    assert rms_ratio(y, y_permuted) > 0.1
