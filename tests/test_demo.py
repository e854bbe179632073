"""Smoke tests of `python -m ropewkv demo --quick` (the `make demo` job at tiny sizes)."""
import os
import subprocess
import sys

import pytest
import torch

import ropewkv
from ropewkv import __main__ as cli
from ropewkv import _backend, demo
from ropewkv.testing import Tolerance

pytest.importorskip("transformers")


def test_demo_cli_passes_and_writes_the_report(tmp_path):
    result = subprocess.run([sys.executable, "-m", "ropewkv", "demo", "--quick", "--out", str(tmp_path)],
                            capture_output=True, text=True, env=os.environ.copy(), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = (tmp_path / "demo-report.md").read_text()
    assert result.stdout.strip() == report.strip()  # the printed tables are the report
    for section in ("## Parity against fp64", "## Speed", "## RoPE: max error of cos/sin vs position"):
        assert section in report
    for op in ("apply_rotary_pos_emb q (ours)", "wkv7 y", "Llama logits (patched)", "RWKV-7 logits (fused)",
               "RWKV-7 gradients (fused)", "RWKV-7 logits (fused, bf16 autocast)",
               "RWKV-7 gradients (fused, bf16 autocast)"):
        assert f"| {op} |" in report
    assert "| FAIL |" not in report and "0 failed" in report
    assert "[demo] timing" in result.stderr  # progress goes to stderr


def test_demo_exits_nonzero_when_parity_fails(tmp_path, monkeypatch, capsys):
    impossible = Tolerance(None, 0.0, "forces a failure")
    monkeypatch.setitem(demo.MODEL_TOLERANCE, "rwkv7", impossible)
    assert demo.main("cpu", quick=True, out=str(tmp_path)) == 1
    assert "| RWKV-7 logits (fused) | cpu | fp32 | fp32 |" in capsys.readouterr().out
    assert "| FAIL |" in (tmp_path / "demo-report.md").read_text()


def test_demo_computes_in_fp32_in_a_bf16_default_build(tmp_path, monkeypatch):
    """A ROPEWKV_ACCUM=bf16 build makes precision=None mean bf16 (_C.build_precision): the demo's rows, labelled
    fp32 and held to fp32 bounds, must still be computed in fp32."""
    monkeypatch.setattr(_backend, "build_precision", lambda: "bf16")
    assert demo.main("cpu", quick=True, out=str(tmp_path)) == 0
    report = (tmp_path / "demo-report.md").read_text()
    assert "| FAIL |" not in report and "0 failed" in report
    assert '| ropewkv.patch.transformers(precision="fp32"): exact fp32 tables | 0.50 |' in report


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no CUDA device")
@pytest.mark.parametrize("command", ["demo", "parity"])
def test_cli_refuses_a_cuda_device_torch_cannot_reach(command, capsys):
    """--device cuda without a CUDA device: argparse's error naming the argument and why, not a traceback (the demo
    printed "backend triton" first)."""
    with pytest.raises(SystemExit) as exited:
        cli.main([command, "--device", "cuda"])
    assert exited.value.code == 2
    assert "argument --device: 'cuda':" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no CUDA device")
def test_no_kernel_backend_for_a_cuda_device_torch_cannot_reach():
    """Without a CUDA device no twin runs CUDA tensors: available_backends says so, and auto names why."""
    cuda = torch.device("cuda")
    assert ropewkv.available_backends(cuda) == ["reference"]
    with pytest.raises(ropewkv.BackendUnavailableError, match="triton: torch .* sees no CUDA device"):
        _backend.resolve_backend("auto", cuda)


def test_cuda_backend_reason_names_a_rocm_torch():
    """A ROCm torch (torch.version.hip set, torch.version.cuda None) is not a CPU build: backend="cuda" says which."""
    code = ("import torch; torch.version.cuda, torch.version.hip = None, '6.4'\n"
            "from ropewkv import _backend; print(_backend.unavailable_reason('cuda', torch.device('cuda')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "ROCm build" in result.stdout and "CPU build" not in result.stdout
