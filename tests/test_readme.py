"""The README's Python examples run as written."""
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
    exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {"__name__": "__readme__"})
