"""Every kernel of both GPU twins, compiled for sm_90a and summarised: ptxas's resources and the SASS paths.

CUDA kernels are discovered (every __global__ function of every .cu under csrc/). Triton kernels are a registry,
TRITON: one entry per main specialisation, a function that calls a launcher once with small tensors whose dtypes,
head counts, head size and divisibility are those of the benchmark shape (Triton specialises on those, not on the
sequence length; an integer argument equal to 1 becomes a constant, so a launcher that passes its sequence count gets
the benchmark's batch). Another kernel joins with one entry.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from . import cuda, sass


@dataclass
class Loop:
    address: int
    instructions: int        # static, the whole body
    work: sass.Path          # one iteration storing the most (e.g. RoPE's rotation, not its pass-through copy)
    lean: sass.Path          # one iteration storing the least (e.g. without WKV7's every-16th-token checkpoint)
    inner: list[Loop] = field(default_factory=list)  # an outer loop's innermost loops (their bodies once in work/lean)


@dataclass
class Kernel:
    key: str                 # unique in the report: "<source>: <name>"
    twin: str                # "cuda" or "triton"
    source: str              # the .cu file, or the registry entry's launcher module
    name: str                # readable: template arguments (CUDA) or the registry entry (Triton)
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int
    shared: int              # static shared memory (CUDA; dynamic is set at launch), Triton's whole request
    threads: int | None      # per block: Triton's num_warps * 32; CUDA: known only at launch
    work: sass.Path          # entry to exit, every loop body taken once, storing the most
    loops: list[Loop] = field(default_factory=list)  # innermost loops only
    outer_loops: list[Loop] = field(default_factory=list)  # the others (e.g. the chunked WKV7 forward's chunk loop)
    tensor_core: int = 0     # static count of tensor-core instructions (sass.TENSOR_CORE)

    @property
    def hot_loop(self) -> Loop | None:
        """The innermost loop whose iteration stores the most global bytes (ties: the fewer instructions)."""
        storing = [loop for loop in self.loops if loop.work.stored > 0]
        return max(storing, key=lambda loop: (loop.work.stored, -loop.work.instructions), default=None)


def summarise(key, twin, source, name, resources, instructions, threads=None) -> Kernel:
    flow = sass.ControlFlow(instructions)
    summaries = {}
    for loop in flow.loops:
        paths = flow.paths(loop)
        size = sum(len(flow.blocks[b].instructions) for b in loop.blocks)
        summaries[loop.header] = Loop(loop.address, size, paths[max(paths)], paths[min(paths)])
    for loop in flow.loops:
        summaries[loop.header].inner = [summaries[other.header] for other in flow.loops
                                        if other.innermost and other is not loop and other.header in loop.blocks]
    paths = flow.paths()
    return Kernel(key, twin, source, name, resources["registers"], resources["stack"], resources["spill_stores"],
                  resources["spill_loads"], resources["shared"], threads, paths[max(paths)],
                  [summaries[loop.header] for loop in flow.loops if loop.innermost],
                  [summaries[loop.header] for loop in flow.loops if not loop.innermost],
                  sum(1 for instruction in instructions if instruction.mnemonic in sass.TENSOR_CORE))


def cuda_kernels(root: str, source: str) -> list[Kernel]:
    """Every __global__ function of one .cu (empty for a file without kernels)."""
    text, log = cuda.compile_cubin(root, source)
    functions = sass.parse(text)
    resources = sass.ptxas_resources(log)
    mangled = sorted(functions)
    names = cuda.readable_names(mangled, cuda.enum_names(root))
    return [summarise(f"{source}: {name}", "cuda", source, name, resources[m], functions[m])
            for m, name in zip(mangled, names)]


# ---------------------------------------------------------------------------------------------- Triton registry
@dataclass(frozen=True)
class TritonCase:
    launch: Callable[[], None]  # calls one launcher once (with torch imported and TRITON_INTERPRET unset)
    sixteen_byte: bool = False  # a RoPE kernel: its hot loop must move 16-byte vectors
    kernel: int = 0             # which of the launcher's kernel launches (in launch order) this entry is


def _rope(interleaved=False, tables=False, mrope=False):
    """RoPE at the benchmark's heads and head size (Hq 32, Hk 8, D 128, bf16), positions computed in the kernel
    (or read from HF's bf16 cos/sin tables [B, S, D]; or M-RoPE with Qwen2-VL's sections and [3, B, S] positions)."""
    import torch

    from ropewkv.triton_kernels import rope

    q, k = torch.empty(1, 16, 32, 128, dtype=torch.bfloat16), torch.empty(1, 16, 8, 128, dtype=torch.bfloat16)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if tables:
        table = torch.empty(1, 16, 128, dtype=torch.bfloat16)
        rope.rope_cos_sin_forward(q, k, q_out, k_out, table, table, interleaved, False, False)
    elif mrope:
        positions = torch.zeros(3, 1, 16, dtype=torch.int64)
        rope.rope_forward(q, k, q_out, k_out, torch.empty(64), positions, None, None, interleaved, False, 1.0, False,
                          mrope_section=(16, 24, 24))
    else:
        rope.rope_forward(q, k, q_out, k_out, torch.empty(64), None, None, None, interleaved, False, 1.0, False)


def _qk_norm_rope(backward):
    """Qwen3's fused q/k RMSNorm + RoPE at the RoPE benchmark's shape, angles computed in the kernel."""
    import torch

    from ropewkv.triton_kernels import qk_norm_rope

    q, k = torch.empty(1, 16, 32, 128, dtype=torch.bfloat16), torch.empty(1, 16, 8, 128, dtype=torch.bfloat16)
    weight, sources = torch.empty(128), (torch.empty(64), None, None, None, None, None, None)
    if backward:
        qk_norm_rope.backward(q, k, q, k, q, k, weight, weight, 1e-6, 0.0, *sources, 128, False, 1.0)
    else:
        qk_norm_rope.forward(q, k, q, k, weight, weight, 1e-6, 0.0, *sources, 128, False, 1.0, False)


def wkv7_launches(n, heads, *, backward=False, tokens=16, decay="loglog", low_precision=False, with_state=False,
                  varlen=False, save=True):
    """One WKV7 forward (or backward) launch, bf16 [1, tokens, heads, n]."""
    import torch

    from ropewkv.triton_kernels.rwkv7 import recurrent

    x = torch.empty(1, tokens, heads, n, dtype=torch.bfloat16)
    state = torch.empty(1, heads, n, n)
    cu = torch.tensor([0, tokens], dtype=torch.int32) if varlen else None
    checkpoints = torch.empty(recurrent.checkpoint_slots(tokens, 1), heads, n, n)
    s0 = state if with_state else None
    if backward:
        recurrent.wkv7_backward(x, x, x, x, x, x, cu, checkpoints, x, s0, [x] * 6, state, decay, low_precision)
    else:
        recurrent.wkv7_forward(x, x, x, x, x, x, s0, cu, x, state, checkpoints if save else None, decay,
                               low_precision)


def wkv7_chunked_launches(n, heads, *, backward=False, tokens=32, low_precision=False, batch=8):
    """One chunked WKV7 forward (or backward) launch, bf16 [batch, tokens, heads, n]; low_precision: precision="bf16"
    (its split bf16 tensor-core products). The prep and gradients kernels take the sequence count: at 1 (a constant
    for Triton) their search for a program's sequence compiles away, at the benchmark's 8 it is a loop."""
    import torch

    from ropewkv.triton_kernels.rwkv7 import chunked

    x = torch.empty(batch, tokens, heads, n, dtype=torch.bfloat16)
    state = torch.empty(batch, heads, n, n)
    checkpoints = torch.empty(chunked.checkpoint_slots(batch * tokens, batch), heads, n, n)
    if backward:
        chunked.wkv7_backward(x, x, x, x, x, x, None, checkpoints, x, state, [x] * 6, state, "loglog",
                              low_precision, low_precision)
    else:
        chunked.wkv7_forward(x, x, x, x, x, x, None, None, x, state, checkpoints, "loglog", low_precision,
                             low_precision)


def _log_decay(backward):
    import torch

    from ropewkv.triton_kernels import decay

    x, out = torch.empty(4096, dtype=torch.bfloat16), torch.empty(4096)
    if backward:
        decay.log_decay_backward(out, x, x)
    else:
        decay.log_decay_forward(x, out)


TRITON = {
    "rope neox bf16": TritonCase(_rope, sixteen_byte=True),
    "rope gptj bf16": TritonCase(lambda: _rope(interleaved=True), sixteen_byte=True),
    "rope hf-tables neox bf16": TritonCase(lambda: _rope(tables=True), sixteen_byte=True),
    "rope M-RoPE neox bf16": TritonCase(lambda: _rope(mrope=True)),
    "qk_norm_rope fwd bf16": TritonCase(lambda: _qk_norm_rope(False)),
    "qk_norm_rope bwd bf16": TritonCase(lambda: _qk_norm_rope(True)),
    "wkv7 fwd N64 bf16": TritonCase(lambda: wkv7_launches(64, 64)),
    "wkv7 bwd N64 bf16": TritonCase(lambda: wkv7_launches(64, 64, backward=True)),
    "wkv7 fwd N128 bf16": TritonCase(lambda: wkv7_launches(128, 32)),
    "wkv7 bwd N128 bf16": TritonCase(lambda: wkv7_launches(128, 32, backward=True)),
    "wkv7 fwd N256 bf16": TritonCase(lambda: wkv7_launches(256, 16)),
    "wkv7 bwd N256 bf16": TritonCase(lambda: wkv7_launches(256, 16, backward=True)),
    # The backward's second kernel at N = 256 (state rows split over programs): the key gradients' partial sums added.
    "wkv7 bwd N256 combine bf16": TritonCase(lambda: wkv7_launches(256, 16, backward=True), kernel=1),
    "wkv7 decode N64 bf16": TritonCase(lambda: wkv7_launches(64, 64, tokens=1, with_state=True, save=False)),
    # The chunked forward's two kernels: the state-independent part of every chunk, then the pass over the chunks.
    "wkv7 chunked fwd prep N64 bf16": TritonCase(lambda: wkv7_chunked_launches(64, 64)),
    "wkv7 chunked fwd state N64 bf16": TritonCase(lambda: wkv7_chunked_launches(64, 64), kernel=1),
    "wkv7 chunked fwd prep N128 bf16": TritonCase(lambda: wkv7_chunked_launches(128, 32)),
    "wkv7 chunked fwd state N128 bf16": TritonCase(lambda: wkv7_chunked_launches(128, 32), kernel=1),
    # The chunked backward's launches: the prep (as the forward's), the state cotangent in reverse, the gradients.
    "wkv7 chunked bwd state N64 bf16": TritonCase(lambda: wkv7_chunked_launches(64, 64, backward=True), kernel=1),
    "wkv7 chunked bwd state N128 bf16": TritonCase(lambda: wkv7_chunked_launches(128, 32, backward=True), kernel=1),
    "wkv7 chunked bwd N64 bf16": TritonCase(lambda: wkv7_chunked_launches(64, 64, backward=True), kernel=2),
    # N = 32 (8 warps) and 128 backward: spill-free since tritonbwd, guarded here.
    "wkv7 chunked bwd N32 bf16": TritonCase(lambda: wkv7_chunked_launches(32, 64, backward=True), kernel=2),
    "wkv7 chunked bwd N128 bf16": TritonCase(lambda: wkv7_chunked_launches(128, 32, backward=True), kernel=2),
    # precision="bf16": the split bf16 tensor-core products (the preps have none).
    "wkv7 chunked fwd state N64 bf16-dots": TritonCase(lambda: wkv7_chunked_launches(64, 64, low_precision=True),
                                                       kernel=1),
    "wkv7 chunked bwd state N64 bf16-dots": TritonCase(
        lambda: wkv7_chunked_launches(64, 64, backward=True, low_precision=True), kernel=1),
    "wkv7 chunked bwd N64 bf16-dots": TritonCase(
        lambda: wkv7_chunked_launches(64, 64, backward=True, low_precision=True), kernel=2),
    "log_decay fwd bf16": TritonCase(lambda: _log_decay(False)),
    "log_decay bwd bf16": TritonCase(lambda: _log_decay(True)),
}


# Kernels allowed to spill (keys or fnmatch patterns of keys), with the reason (the spill check skips them; the
# report still lists their spills). None since 2026-12-07.
# (The CUDA WKV7 N=64 backwards were here, 320-370 B at the 255-register cap, until the backward's shared-memory
# column dots were unrolled by 16 instead of fully; the CUDA chunked gradients kernel in precision="fp32", 16-24 B,
# and the Triton chunked gradients in precision="bf16", 16 B, until 2026-11-29: benchmarks/NOTES.md, "No spills in
# the chunked kernels"; the Triton sequential N = 128 backward, 8-40 B outside its token loops, until 2026-12-07:
# "dr's scalar sums inside warps".)
SPILL_ALLOWED: dict = {}


def triton_kernel(name: str) -> Kernel:
    from .triton_sm90 import captured_launches, compile_for_sm90

    case = TRITON[name]
    with captured_launches() as launches:
        case.launch()
    if len(launches) <= case.kernel:
        raise RuntimeError(f"Triton case {name!r} launched {len(launches)} kernels, not {case.kernel + 1} or more")
    kernel = launches[case.kernel][0]
    compiled, log = compile_for_sm90(*launches[case.kernel])
    functions = sass.parse(cuda.disassemble(compiled.asm["cubin"]))
    resources = sass.ptxas_resources(log)[compiled.metadata.name]
    resources["shared"] = compiled.metadata.shared
    return summarise(name, "triton", f"{kernel.fn.__module__}.{kernel.fn.__name__}", name, resources,
                     functions[compiled.metadata.name], threads=compiled.metadata.num_warps * 32)


def compile_task(root: str, task: tuple[str, str]) -> list[Kernel]:
    """("cuda", a .cu under root) or ("triton", a TRITON entry) -> its kernels (run in a worker process)."""
    twin, what = task
    return cuda_kernels(root, what) if twin == "cuda" else [triton_kernel(what)]
