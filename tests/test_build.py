"""The build: extensions import, ops are registered, conversions are exact, backends resolve or explain."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import ropewkv
from ropewkv import _backend


def test_cpu_extension_imports_with_build_precision():
    assert _backend._C is not None, _backend._C_error
    assert _backend._C.build_precision == os.environ.get("ROPEWKV_ACCUM", "fp32")
    assert ropewkv.build_precision() == _backend._C.build_precision


@pytest.mark.skipif(torch.version.cuda is None, reason="CPU build of torch: _C_cuda cannot be built")
def test_cuda_extension_imports_with_same_precision():
    assert _backend._C_cuda is not None, _backend._C_cuda_error
    assert _backend._C_cuda.build_precision == _backend._C.build_precision


def test_ops_are_registered():
    for name in ("log_decay", "log_decay_backward", "log_decay_triton", "_narrow_to", "_widen"):
        assert hasattr(torch.ops.ropewkv, name), name
    assert torch._C._dispatch_has_kernel_for_dispatch_key("ropewkv::log_decay", "CPU")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_widen_is_exact_for_every_bit_pattern(dtype):
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype)
    ours, theirs = torch.ops.ropewkv._widen(x), x.to(torch.float32)
    assert torch.equal(ours.isnan(), theirs.isnan())
    finite = ~theirs.isnan()
    assert torch.equal(ours[finite].view(torch.int32), theirs[finite].view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_narrow_rounds_like_torch(dtype):
    gen = torch.Generator().manual_seed(0)
    # Random bit patterns cover every exponent, incl. subnormals, overflow, inf and NaN; the rest are ties and
    # near-ties around the target's rounding points, where round-half-even matters.
    random_bits = torch.randint(-(2**31), 2**31 - 1, (2_000_000,), generator=gen, dtype=torch.int64)
    x = random_bits.to(torch.int32).view(torch.float32)
    ties = torch.arange(0, 2**16, dtype=torch.float32) * 2.0**-10 + 2.0**-14
    edges = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, 65536.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26,
                          float("inf"), -float("inf"), 3.3895e38, 3.4e38], dtype=torch.float32)
    x = torch.cat([x, ties, edges, -ties])
    ours, theirs = torch.ops.ropewkv._narrow_to(x, dtype), x.to(dtype)
    assert torch.equal(ours.isnan(), theirs.isnan())
    finite = ~theirs.isnan()
    mismatch = (ours[finite].view(torch.int16) != theirs[finite].view(torch.int16)).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.numel()} values round differently, e.g. {x[finite][mismatch[:5, 0]]}"


def test_backend_resolution():
    cpu = torch.device("cpu")
    assert _backend.resolve_backend("auto", cpu) == "cpu"
    assert _backend.resolve_backend("reference", cpu) == "reference"
    with pytest.raises(ValueError, match="backend must be one of"):
        _backend.resolve_backend("fast", cpu)
    with pytest.raises(ropewkv.BackendUnavailableError, match="needs CUDA tensors"):
        _backend.resolve_backend("cuda", cpu)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ropewkv.BackendUnavailableError, match="TRITON_INTERPRET=1"):
        _backend.resolve_backend("triton", torch.device("cpu"))


_TRITON_ON_CPU = """
import sys, torch, ropewkv
from ropewkv.testing import seeded
from ropewkv.testing import rwkv7 as parity
gen = seeded(5)
q = torch.randn(1, 64, 2, 64, generator=gen)
inv_freq = (1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)).float()
rotated = ropewkv.rope(q, inv_freq=inv_freq, positions=torch.randint(0, 10**5, (1, 64), generator=gen),
                       precision="fp32", backend="triton")
x = parity.rwkv7_inputs(1, 20, 1, 32, torch.bfloat16, "loglog", gen, "cpu", True)
y, _ = ropewkv.wkv7(*(x[n] for n in "rwkvab"), initial_state=x["initial_state"], precision="bf16", backend="triton",
                    algorithm="chunked")
torch.save((rotated, y), sys.argv[1])
"""


def test_triton_interpret_is_read_as_triton_reads_it(tmp_path):
    """Triton interprets under TRITON_INTERPRET=true (or on, yes) as under 1; ropewkv read only "1", so it refused
    Triton on CPU tensors there, and on a GPU the kernels would have taken their compiled paths inside the
    interpreter (its tl.fma rounds the product: RoPE's exact rotation differed in 7,623 of 8,192 elements). RoPE
    fp32 and the chunked WKV7's bf16 dots under "true" equal their runs under "1", bit for bit."""
    outputs = {}
    for value in ("1", "true"):
        out = tmp_path / f"{value}.pt"
        env = dict(os.environ, TRITON_INTERPRET=value)
        subprocess.run([sys.executable, "-c", _TRITON_ON_CPU, str(out)], env=env, check=True, timeout=300)
        outputs[value] = torch.load(out)
    for a, b in zip(outputs["1"], outputs["true"]):
        assert torch.equal(a, b)


def test_triton_interprets_agrees_with_triton(monkeypatch):
    from triton import knobs

    for value in ("1", "true", "TRUE", "On", "yes", "Y", "0", "2", "t", "false", " 1", ""):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert _backend.triton_interprets() == knobs.runtime.interpret, value


def test_precision_resolution():
    assert _backend.resolve_precision(None) == ropewkv.build_precision()
    assert _backend.resolve_precision("bf16") == "bf16"
    with pytest.raises(ValueError, match="precision must be one of"):
        _backend.resolve_precision("fp16")


def ulp_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|out - ref| in fp32 ulps at |ref| (subnormal results: in units of the smallest subnormal)."""
    from ropewkv.testing import ulp

    return (out.double() - ref).abs() / ulp(torch.float32, ref)


def fp32_samples(low: float, high: float, n: int) -> torch.Tensor:
    """A uniform grid plus random bit patterns (every binade, incl. tiny magnitudes) within [low, high]."""
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(0, 2**31 - 1, (n,), generator=gen, dtype=torch.int64).to(torch.int32).view(torch.float32)
    signs = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    random = (bits * signs)[(bits * signs >= low) & (bits * signs <= high)]
    return torch.cat([torch.linspace(low, high, n, dtype=torch.float32), random])


def test_host_exp_is_faithful():
    """The CPU twin's branch-free e^x (exp_poly, used by the raw decay and wkv7 on the host): <= 1.5 ulp (measured
    1.02; glibc's expf 0.5) over its whole range, gradual underflow, and the specials."""
    x = fp32_samples(-103.9, 88.7, 2_000_000)
    assert float(ulp_errors(torch.ops.ropewkv._host_exp(x)[0], torch.exp(x.double())).max()) <= 1.5
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 89.0, -104.0, 0.0])
    out = torch.ops.ropewkv._host_exp(specials)[0]
    assert out[0].isnan() and out[1:].tolist() == [float("inf"), 0.0, float("inf"), 0.0, 1.0]


def test_host_sincos_is_faithful():
    """The CPU twin's sincos of the reduced angle |r| <= pi (sincos_poly): <= 1 ulp each (measured 0.85)."""
    r = fp32_samples(-3.25, 3.25, 2_000_000)
    sin, cos = torch.ops.ropewkv._host_sincos(r)
    assert float(ulp_errors(sin, torch.sin(r.double())).max()) <= 1.0
    assert float(ulp_errors(cos, torch.cos(r.double())).max()) <= 1.0
    assert torch.ops.ropewkv._host_sincos(torch.tensor([float("nan")])).isnan().all()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The rotations that are plain products and a sum: HF's eager fp32 arithmetic (RoPE precision="bf16" at fp32 I/O) and
# qk_norm_rope's fp32 rotation.
_CONTRACTION_PROBE = r"""
#include "ropewkv/qk_norm_rope.h"
#include "ropewkv/rope.h"
__global__ void probe(const float* x, float* out) {
  ropewkv::rope::rotate_values<ropewkv::Rounded<float>>(x[0], x[1], x[2], x[3], x[4], x[5], &out[0], &out[1]);
  ropewkv::qk_norm_rope::rotate_values<float>(x[0], x[1], x[2], x[3], x[4], x[5], &out[2], &out[3]);
}
"""


def _probe_ptx(tmp_path, nvcc, flags):
    source, ptx = tmp_path / "probe.cu", tmp_path / "probe.ptx"
    source.write_text(_CONTRACTION_PROBE)
    subprocess.run([nvcc, "-std=c++20", "-O3", *flags, "--expt-relaxed-constexpr", "-Icsrc/include",
                    "-arch=sm_90a", "-ptx", str(source), "-o", str(ptx)], cwd=ROOT, check=True)
    return ptx.read_text()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: the CUDA build's flags are not checked")
def test_nvcc_fuses_no_multiply_add(tmp_path):
    """nvcc fuses a*b + c*d into a multiply and an fma by default: the CUDA twin then differed from HF's eager fp32
    rotation and from the CPU twin (g++ -ffp-contract=off) in the last bit of ~25% of pairs. Every nvcc command of
    the build, the compile check and the static report passes --fmad=false (explicit fmaf calls still fuse)."""
    nvcc = shutil.which("nvcc")
    assert "fma.rn.f32" in _probe_ptx(tmp_path, nvcc, [])  # the probe sees a contraction where there is one
    assert "fma.rn.f32" not in _probe_ptx(tmp_path, nvcc, ["--fmad=false"])
    for path in ("setup.py", "tools/check_cuda_compile.sh", "tools/static_report/cuda.py"):
        with open(os.path.join(ROOT, path)) as f:
            assert "--fmad=false" in f.read(), path
