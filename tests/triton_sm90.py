"""Test helpers for compiled Triton. The capture and compile code lives in tools/static_report/triton_sm90.py (the
static report compiles every Triton kernel with it); the tests import it from here, beside run_without_interpreter.
"""
import os
import subprocess
import sys

from tools.static_report.triton_sm90 import captured_launches, compile_for_sm90, ptx_for_sm90  # noqa: F401


def run_without_interpreter(test_file: str, test_name: str) -> None:
    """Re-run one test in a fresh process with TRITON_INTERPRET=0 and fail with its output if it fails."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             f"{test_file}::{test_name}"],
                            env=dict(os.environ, TRITON_INTERPRET="0"), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
