"""The README's Python examples run as written, and print what their comments say."""
import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
# transformers decides at import whether to use the `kernels` library, so the kernel-hub example runs in a fresh
# interpreter, after ropewkv.testing.hub lets transformers take the kernels version our package index has.
HUB_PRELUDE = "from ropewkv.testing.hub import accept_installed_kernels\naccept_installed_kernels()\n"



def _rotation_errors(printed: str) -> bool:  # "HF eager: 3-4 bf16 ulps" (3.06-3.84 over 12 seeds), "patched: 0.50"
    eager, patched = (float(re.search(rf"{who}: ([0-9.]+)", printed).group(1)) for who in ("HF eager", "patched"))
    return 2.5 <= eager <= 4.5 and patched <= 0.5 + 1e-3


# A line of a block -> a check of what the block printed: the values its comments promise.
PRINTED = {
    'print("HF eager:"': _rotation_errors,
    'print([p for p in handle.patched': lambda printed: "modeling_qwen3.Qwen3Attention.forward" in printed,
}


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 4  # "call an op", M-RoPE, "patch a model", the kernel hub


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index):
    if "ropewkv.hub" in BLOCKS[index]:
        pytest.importorskip("kernels")
        result = subprocess.run([sys.executable, "-c", HUB_PRELUDE + BLOCKS[index]], capture_output=True, text=True,
                                timeout=600, env=dict(os.environ))
        assert result.returncode == 0, result.stdout + result.stderr
        return
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {"__name__": "__readme__"})
    for line, check in PRINTED.items():
        if line in BLOCKS[index]:
            assert check(printed.getvalue()), f"{line}...: printed {printed.getvalue()!r}"


def test_every_printed_check_finds_its_block():
    assert all(any(line in block for block in BLOCKS) for line in PRINTED)
