"""Compile Triton launches for an H100 (sm_90a) without a GPU, with Triton's bundled NVIDIA backend.

Launches are captured instead of run, then compiled with the specialisation the JIT would give them on a GPU (its
own binder: 16-byte-aligned pointers and integers divisible by 16 marked so, integers equal to 1 made constants), so
the code is what a real launch with the same arguments gets. The interpreter never runs the compiler, so this needs
@triton.jit functions, i.e. kernel modules imported in a process without TRITON_INTERPRET=1.
"""
from __future__ import annotations

import contextlib
import io
import os

SM90 = ("cuda", 90, 32)  # GPUTarget(backend, capability, warp size): Triton builds sm_90a code for capability 90


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


@contextlib.contextmanager
def _environment(**values):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def compile_for_sm90(kernel, args, kwargs):
    """(the CompiledKernel, ptxas -v's log) of one captured launch, always compiled afresh (never from Triton's
    cache, which could stand in for an older source)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget(*SM90)
    backend = make_backend(target)
    kwargs = dict(kwargs, debug=kwargs.get("debug", kernel.debug) or False)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    log = io.StringIO()
    # Triton reads its settings from the environment when it compiles; the backend prints ptxas's log to stdout.
    with _environment(TRITON_ALWAYS_COMPILE="1", TRITON_DUMP_PTXAS_LOG="1"), contextlib.redirect_stdout(log):
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
    return compiled, log.getvalue()


def ptx_for_sm90(kernel, args, kwargs) -> str:
    """The PTX of one captured launch."""
    return compile_for_sm90(kernel, args, kwargs)[0].asm["ptx"]
