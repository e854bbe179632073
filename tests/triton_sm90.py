"""Compile Triton launches for an H100 (sm_90) without a GPU, with Triton's bundled NVIDIA backend.

The interpreter never runs the compiler, so kernels that pass every interpreted test can still fail to compile
(a plain Python global inside @triton.jit) or compile to something else than intended (fp contraction, approximate
sin/cos). Launches are captured instead of run, then compiled; this needs @triton.jit functions, i.e. a process
without TRITON_INTERPRET=1 (see run_without_interpreter).
"""
import contextlib
import os
import subprocess
import sys

import torch

TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
                torch.int64: "i64"}


@contextlib.contextmanager
def captured_launches():
    """Within the block, `kernel[grid](...)` records (kernel, args, kwargs) instead of launching."""
    from triton.runtime.jit import JITFunction

    launches = []
    original = JITFunction.run
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append((self, args, kwargs))
    try:
        yield launches
    finally:
        JITFunction.run = original


def ptx_for_sm90(kernel, args, kwargs) -> str:
    """The PTX of one captured launch, compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    values = dict(zip(kernel.arg_names, args))
    values.update((name, value) for name, value in kwargs.items() if name in kernel.arg_names)
    options = {name: value for name, value in kwargs.items() if name not in kernel.arg_names}
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = values[param.name]
        if param.is_constexpr or value is None:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i64"
        else:
            signature[param.name] = "fp32"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def run_without_interpreter(test_file: str, test_name: str) -> None:
    """Re-run one test in a fresh process with TRITON_INTERPRET=0 and fail with its output if it fails."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             f"{test_file}::{test_name}"],
                            env=dict(os.environ, TRITON_INTERPRET="0"), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
