"""The report (markdown and JSON) and its two checks: no new spills, and 16-byte accesses in the hot loops of RoPE
and of the decay op's vector kernels."""
from __future__ import annotations

import dataclasses
import fnmatch
import json

from . import model
from .kernels import SPILL_ALLOWED, TRITON, Kernel
from .sass import GLOBAL_LOADS, GLOBAL_STORES, Path

# RoPE kernels whose hot loop does not move 16-byte vectors yet (none since ropefast, issue 12). The check fails on a
# listed kernel that has become 16-byte, so the list cannot go stale.
NOT_YET_16_BYTE: set[str] = set()


def is_element_wise_fallback(kernel: Kernel) -> bool:
    """A CUDA RoPE instantiation rope_kernel<io_t, P, VECTOR = false, ...>: the host launches it only where a 16-byte
    access would be misaligned (ropewkv/rope.h: rope_vector_width), so it is narrow by design and not judged."""
    if kernel.twin != "cuda" or not kernel.name.startswith("rope_kernel<"):
        return False
    return kernel.name[len("rope_kernel<"):-1].split(", ")[2] == "false"


def is_rope(kernel: Kernel) -> bool:
    if kernel.twin == "cuda":
        return kernel.source.startswith("csrc/rope/") and not is_element_wise_fallback(kernel)
    return TRITON[kernel.name].sixteen_byte


def is_vector_decay(kernel: Kernel) -> bool:
    """A CUDA decay kernel log_decay_{forward,backward}_kernel<io_t, VECTOR = true> (VECTOR false: the element-wise
    fallback for pointers that are not 16-byte aligned, chosen on the host)."""
    return kernel.twin == "cuda" and kernel.source.startswith("csrc/decay/") and kernel.name.endswith(", true>")


def judged_16_byte(kernel: Kernel) -> bool:
    """The kernels whose hot loop must move 16-byte vectors: RoPE's and the decay op's vector instantiations."""
    return is_rope(kernel) or is_vector_decay(kernel)


def hot_region(kernel: Kernel) -> Path:
    """One iteration of the hot loop on its work path, or the whole kernel's work path if no loop stores."""
    hot = kernel.hot_loop
    return hot.work if hot else kernel.work


def moves_16_bytes(path: Path) -> bool:
    """Every global store is 16 bytes wide, and 16-byte loads bring in at least the bytes stored (a RoPE kernel reads
    each element it writes; narrower loads may remain for its positions, frequencies or tables)."""
    stores = {access: n for access, n in path.accesses.items() if access.split(".")[0] in GLOBAL_STORES}
    wide_loads = sum(16 * n for access, n in path.accesses.items()
                     if access.split(".")[0] in GLOBAL_LOADS and access.endswith(".128"))
    return bool(stores) and all(access.endswith(".128") for access in stores) and wide_loads >= path.stored


def only_16_bytes(path: Path) -> bool:
    """Every global load and store is 16 bytes wide (a streaming element-wise kernel such as the decay op's, whose
    fp32 output is wider than its bf16 input)."""
    accesses = [access for access in path.accesses if access.split(".")[0] in GLOBAL_LOADS | GLOBAL_STORES]
    return path.stored > 0 and all(access.endswith(".128") for access in accesses)


def sixteen_byte_failures(kernels: list[Kernel], not_yet=NOT_YET_16_BYTE) -> list[str]:
    """Judges every kernel given (those of judged_16_byte) against moves_16_bytes (the decay op's vector kernels:
    only_16_bytes); those in not_yet must fail it."""
    failures = []
    for kernel in kernels:
        wide = (only_16_bytes if is_vector_decay(kernel) else moves_16_bytes)(hot_region(kernel))
        if not wide and kernel.key not in not_yet:
            failures.append(f"{kernel.key}: the hot loop does not move 16-byte vectors "
                            f"({_accesses(hot_region(kernel))})")
        elif wide and kernel.key in not_yet:
            failures.append(f"{kernel.key}: now moves 16-byte vectors; remove it from NOT_YET_16_BYTE")
    known = {kernel.key for kernel in kernels}
    failures += [f"{key}: listed in NOT_YET_16_BYTE, but no such kernel" for key in sorted(not_yet - known)]
    return failures


COMPILERS = (("cuda", "nvcc"), ("triton", "triton"))  # each twin and the header field naming its compiler's version


def compared_twins(baseline: dict, header: dict) -> list[str]:
    """The twins whose compiler made the baseline too: another version allocates registers differently (Triton 3.6
    spills in two WKV7 kernels where 3.7.1 does not), so only those are compared."""
    return [twin for twin, tool in COMPILERS if baseline.get(tool) == header[tool]]


def spill_failures(kernels: list[Kernel], baseline: dict, twins: list[str]) -> list[str]:
    """Kernels of `twins` that spill now but did not in the baseline (a previous report's JSON), or are new and
    spill; kernels.SPILL_ALLOWED (each with its reason) aside."""
    before = {k["key"]: k["spill_stores"] + k["spill_loads"] for k in baseline["kernels"]}
    kernels = [k for k in kernels if not any(fnmatch.fnmatchcase(k.key, allowed) for allowed in SPILL_ALLOWED)]
    return [f"{k.key}: spills {k.spill_stores} B stores / {k.spill_loads} B loads"
            + (" (new kernel)" if k.key not in before else " (none in the baseline)")
            for k in kernels if k.twin in twins and k.spill_stores + k.spill_loads > 0 and before.get(k.key, 0) == 0]


# The static shared memory a block may declare (ptxas 13 accepts more for sm_90a; a launch gets more only as dynamic
# shared memory with cudaFuncAttributeMaxDynamicSharedMemorySize).
STATIC_SHARED_LIMIT = 48 * 1024


def static_shared_failures(kernels: list[Kernel]) -> list[str]:
    """CUDA kernels whose static shared memory (ptxas's smem) passes STATIC_SHARED_LIMIT: they would not launch."""
    return [f"{k.key}: {k.shared} B of static shared memory, over the {STATIC_SHARED_LIMIT} B a block may declare"
            for k in kernels if k.twin == "cuda" and k.shared > STATIC_SHARED_LIMIT]


def _accesses(path: Path) -> str:
    return " ".join(f"{access}x{n}" for access, n in sorted(path.accesses.items())) or "none"


def _storing_loops(kernel: Kernel) -> str:
    loops = [loop for loop in kernel.loops if loop.work.stored > 0]
    if not loops:
        return f"no loop stores; whole kernel {kernel.work.instructions} instr: {_accesses(kernel.work)}"
    hot = kernel.hot_loop
    return "<br>".join(f"{'**hot** ' if loop is hot else ''}@{loop.address:#x} {loop.work.instructions} instr"
                       f"{f', {loop.work.barriers} BAR.SYNC' if loop.work.barriers else ''}: {_accesses(loop.work)}"
                       for loop in loops)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}"


def _row(*cells) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def _prediction_row(p: model.Prediction, twin: str) -> str:
    chain = f"{_us(p.chain_s[0])}-{_us(p.chain_s[1])}" if p.chain_s else "-"
    return _row(p.workload, twin, p.kernel, f"{p.per_unit:,.{0 if p.per_unit >= 100 else 1}f}", p.per_token or "-",
                f"{p.blocks_per_sm} · {p.waves} · {p.warps_per_scheduler}",
                f"{p.bytes / 1e9:.2f} ({p.scratch / 1e9:.2f})", _us(p.memory_s), _us(p.issue_s), chain,
                f"**{_us(p.predicted_s)}**", f"{100 * p.copy_fraction:.0f}%")


def markdown(kernels: list[Kernel], predictions: list[model.Prediction], header: dict, checks: dict) -> str:
    twins = {k.key: k.twin for k in kernels}
    lines = [
        "# Static performance report, sm_90a: predictions, not measurements",
        "",
        f"Generated {header['date']} at commit {header['commit']} by `python -m tools.static_report` "
        f"(nvcc {header['nvcc']}; triton {header['triton']} with its ptxas {header['triton_ptxas']}). "
        "Every CUDA `__global__` function of every .cu under csrc/ (nvcc -cubin, the build's flags) and every "
        "entry of the Triton registry (tools/static_report/kernels.py, compiled with the specialisation a real "
        "launch at the benchmark's head counts and head size gets).",
        "",
        "## Model",
        "",
        model.__doc__.split("The model (stated in the report too):")[1].strip(),
        "",
        "## Predicted H100 times at the benchmark shapes",
        "",
        "Per unit: SASS instructions per element (RoPE) or per token-head (WKV7), all threads together. Per token: "
        "the instructions one thread executes per token (its critical path). Occupancy: the blocks an SM can hold, "
        "the waves of the grid, the warps per scheduler at this grid. Times in µs. % copy: the floor's bytes at "
        "3.0 TB/s over the prediction.",
        "",
        _row("workload", "twin", "kernel", "per unit", "per token", "blocks/SM · waves · warps/scheduler",
             "GB moved (scratch)", "memory", "issue", "chain low-high", "**predicted**", "% copy"),
        _row("---", "---", "---", *["--:"] * 9),
        *(_prediction_row(p, twins[p.kernel]) for p in predictions),
        "",
        "## Every kernel",
        "",
        "Registers, ptxas's spill bytes (stores/loads) and stack frame, shared memory (CUDA: static only, the "
        "dynamic part is set at launch; Triton: all of it), tensor-core instructions in the kernel (static count: "
        "HMMA, HGMMA and kin), and for each innermost loop that stores to global "
        "memory one iteration's instructions, block-wide barriers (BAR.SYNC, where any) and global (LDG/STG) and "
        "local (LDL/STL) accesses per thread, on the path that stores the most; **hot**: the loop that stores the "
        "most per iteration.",
        "",
        _row("twin", "kernel", "regs", "spill st/ld B", "stack B", "smem B", "mma",
             "loops that store: instructions and accesses per thread"),
        _row("---", "---", "--:", "--:", "--:", "--:", "--:", "---"),
        *(_row(k.twin, k.key, k.registers, f"{k.spill_stores}/{k.spill_loads}", k.stack, k.shared, k.tensor_core,
               _storing_loops(k)) for k in kernels),
        "",
        "## Checks",
        "",
        *(f"- {title}: " + ("pass" if not failures else "**FAIL**: " + "; ".join(failures))
          for title, failures in checks.items()),
        "- RoPE kernels whose hot loop moves 16-byte vectors: "
        + (", ".join(k.key for k in kernels if is_rope(k) and moves_16_bytes(hot_region(k))) or "none"),
        "- Decay kernels whose hot loop moves only 16-byte vectors: "
        + (", ".join(k.key for k in kernels if is_vector_decay(k) and only_16_bytes(hot_region(k))) or "none"),
        f"- RoPE kernels known not to yet (NOT_YET_16_BYTE): {', '.join(sorted(NOT_YET_16_BYTE)) or 'none'}",
    ]
    return "\n".join(lines) + "\n"


def _path_json(path: Path) -> dict:
    return {**{f.name: getattr(path, f.name) for f in dataclasses.fields(path) if f.name != "accesses"},
            "accesses": dict(sorted(path.accesses.items()))}


def to_json(kernels: list[Kernel], predictions: list[model.Prediction], header: dict, checks: dict) -> str:
    def kernel_json(k: Kernel) -> dict:
        fields = {f.name: getattr(k, f.name) for f in dataclasses.fields(k)
                  if f.name not in ("work", "loops", "outer_loops")}
        hot = k.hot_loop

        def loop_json(loop) -> dict:
            return {"address": loop.address, "instructions": loop.instructions, "work": _path_json(loop.work),
                    "lean": _path_json(loop.lean)}

        return {**fields, "work": _path_json(k.work), "hot_loop": hot.address if hot else None,
                "loops": [loop_json(loop) for loop in k.loops],
                "outer_loops": [loop_json(loop) | {"inner": [inner.address for inner in loop.inner]}
                                for loop in k.outer_loops]}

    return json.dumps({**header, "kernels": [kernel_json(k) for k in kernels],
                       "predictions": [dataclasses.asdict(p) | {"copy_fraction": p.copy_fraction}
                                       for p in predictions],
                       "checks": checks}, indent=1) + "\n"
