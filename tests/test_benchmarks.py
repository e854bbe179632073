"""Smoke tests of the benchmark scripts at their quick CPU shapes: they run end to end and write their JSON and
markdown, with every ropewkv row timed and checked against the eager reference (no timing is asserted). rope.py's run
includes the qk_norm_rope and serving tables; on a loaded 2-core machine it took over 10 minutes, hence the timeout.
One thread, as gpu_session.sh's dry run: on CI's 2 cores (pytest beside the compile checks) OpenMP's waiting threads
made the eager rows ~10x slower, and the smoke test is about the rows, not the threading (the op tests cover that)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("script, only", [("rope.py", "[cpu,eager"), ("rwkv7.py", "[cpu")])
def test_benchmark_runs_and_writes_results(tmp_path, script, only):
    name = script.removesuffix(".py")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--device", "cpu", "--quick",
                             "--no-compile", "--only", only, "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=1800, env=ENV)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
    ours = [row for row in rows if row["impl"].startswith("ropewkv")]
    assert ours, rows
    for row in ours:
        assert row.get("fwd_us", 0) > 0 and row.get("rel_err") is not None and row["rel_err"] < 1e-2, row
    assert "| shape |" in (tmp_path / f"{name}.md").read_text()


def test_host_overhead_benchmark_splits_every_call(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "host_overhead.py"), "--device", "cpu",
                             "--quick", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env=ENV)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "host_overhead.json").read_text())["rows"]
    assert [row["impl"] for row in rows] == ["ropewkv.rope[cpu]", "ropewkv.apply_rotary_pos_emb[cpu]",
                                            "ropewkv.wkv7_step[cpu]"]
    for row in rows:
        assert row["total_us"] > 0 and row["op_us"] > 0 and row["dispatch_us"] > 0, row
        assert row["python_us"] == pytest.approx(row["total_us"] - row["op_us"]), row
