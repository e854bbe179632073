"""flash-linear-attention (FLA) in the tests: its own kernels, layers and models, ready to run on the test device.

Use the session fixture `fla` (import it into the test module: `from fla_cpu import fla  # noqa: F401`):

    def test_something(fla, device):
        o, state = fla.ops.chunk_rwkv7(r, w, k, v, a, b, output_final_state=True)   # fla.ops.rwkv7
        layer = fla.layers.RWKV7Attention(hidden_size=64, head_dim=32, layer_idx=0)  # fla.layers
        model = fla.models.RWKV7ForCausalLM(fla.models.RWKV7Config(...))              # fla.models
        fla.version                                                                   # "0.6.0"

The fixture skips (saying why) when FLA is not installed; `make test` installs the supported version. Any other fla
module may be imported inside a test that uses the fixture. On a GPU FLA runs as shipped, except that its fp32 dots
are IEEE fp32 (TRITON_F32_DEFAULT=ieee; shipped, they are TF32), as under the interpreter. On CPU its Triton
kernels run under TRITON_INTERPRET=1 (conftest sets it), which needs four things handled outside FLA (found on
FLA 0.6.0 with Triton 3.7.1):
  1. `triton.autotune` benchmarks its configs on a GPU (and caches the timings with the GPU's driver): here every
     config is ranked without running it, biggest blocks first, since the interpreter's cost is per program;
  2. `fla.ops.utils.op` binds `gather = tl.gather`, an alias the interpreter does not patch: FLA's modules get a
     @triton.jit wrapper of tl.gather instead;
  3. compiled Triton makes a `for i in range(n)` variable a tensor (FLA calls `i.to(tl.int64)`), the interpreter
     leaves it an int: FLA's kernels are rewritten to rebind it as a tensor at the top of the loop body;
  4. FLA torch.compiles two small backward helpers of RWKV7Attention (~20 s of inductor on CPU per process, nothing
     this harness tests): FLA_USE_COMPILE=0 keeps them eager.
Expect an interpreted chunk_rwkv7 forward + backward at B1 T20 H2 N32 to take a few seconds; keep shapes tiny.
"""
import ast
import contextlib
import importlib.util
import math
import os
import sys
import types

import pytest
import triton
import triton.language as tl

from ropewkv.testing import environment_variable

SUPPORTED_VERSIONS = ("0.6.0",)


@triton.jit
def _gather(src, index, axis):
    return tl.gather(src, index, axis)


class _LoopVariablesAsTensors(ast.NodeTransformer):
    def visit_For(self, node):
        self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            name = node.target.id
            node.body.insert(0, ast.parse(f"{name} = interpreter_semantic.to_tensor({name}, False)").body[0])
        return node


def _is_fla(module_name: str) -> bool:
    return module_name.split(".")[0] == "fla"


@contextlib.contextmanager
def _interpreter_runs_fla():
    """Adaptations 1 and 3 of the module doc, undone on exit."""
    from triton.runtime import autotuner, interpreter

    def rank_without_running(self, *args, config, **meta):
        block = math.prod(v for v in config.kwargs.values() if isinstance(v, int))
        return [1.0 / block] * 3

    def no_disk_cache(self, tuning_key, configs, bench_fn):
        bench_fn()
        return False

    transform_ast = interpreter.FunctionRewriter._transform_ast

    def transform_fla_loops(self, src):
        tree = transform_ast(self, src)
        if _is_fla(self.fn.__module__):
            tree = ast.fix_missing_locations(_LoopVariablesAsTensors().visit(tree))
        return tree

    saved = [(autotuner.Autotuner, "_bench"), (autotuner.Autotuner, "check_disk_cache"),
             (interpreter.FunctionRewriter, "_transform_ast")]
    originals = [vars(owner)[name] for owner, name in saved]
    autotuner.Autotuner._bench = rank_without_running
    autotuner.Autotuner.check_disk_cache = no_disk_cache
    interpreter.FunctionRewriter._transform_ast = transform_fla_loops
    try:
        yield
    finally:
        for (owner, name), original in zip(saved, originals):
            setattr(owner, name, original)


def _load() -> types.SimpleNamespace:
    if os.environ.get("TRITON_INTERPRET") == "1":
        os.environ["FLA_USE_COMPILE"] = "0"  # read when fla imports
    import fla
    import fla.layers
    import fla.models
    import fla.ops.rwkv7

    if os.environ.get("TRITON_INTERPRET") == "1":
        for name, module in list(sys.modules.items()):
            if _is_fla(name) and vars(module).get("gather") is tl.gather:
                module.gather = _gather
    return types.SimpleNamespace(ops=fla.ops.rwkv7, layers=fla.layers, models=fla.models, version=fla.__version__)


def _ieee_fp32_dots():
    """Compiled Triton makes an fp32 tl.dot without a stated precision a TF32 one (10-bit mantissa), and most of FLA's
    chunk_rwkv7 dots state none: on a GPU every operand would be rounded to 2^-11, while the tests' bounds on FLA's
    error (FLA_ERROR: 1e-6 for its default form; tests/test_patch_fla.py) are the 1.2e-7 .. 5.7e-5 measured under the
    interpreter, whose dots are IEEE fp32. TRITON_F32_DEFAULT=ieee (read when a kernel compiles, and part of Triton's
    cache key) gives FLA's kernels IEEE dots there too. ropewkv's fp32 dots state their precision (ieee) already."""
    return environment_variable("TRITON_F32_DEFAULT", "ieee")


@pytest.fixture(scope="session")
def fla():
    """FLA's modules (see the module doc), its kernels runnable on the test device."""
    if importlib.util.find_spec("fla") is None:
        pytest.skip(f"flash-linear-attention is not installed (make test installs {SUPPORTED_VERSIONS[-1]})")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with _ieee_fp32_dots():
            yield _load()
        return
    with _interpreter_runs_fla():
        yield _load()
