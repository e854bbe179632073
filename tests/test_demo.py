"""Smoke tests of `python -m ropewkv demo --quick` (the `make demo` job at tiny sizes)."""
import os
import subprocess
import sys

import pytest

from ropewkv import demo
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
