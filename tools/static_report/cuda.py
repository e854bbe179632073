"""The CUDA twin as nvcc builds it for sm_90a: every .cu under csrc/ compiled once to a cubin (ptxas -v's report
kept), every __global__ function in it disassembled, and its name made readable."""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import tempfile

# As setup.py builds the extension (and tools/check_cuda_compile.sh checks it), for sm_90a only.
NVCC_FLAGS = ["-std=c++20", "-O3", "--fmad=false", "--expt-relaxed-constexpr", "-lineinfo", "-Icsrc/include",
              "-gencode", "arch=compute_90a,code=sm_90a", "-cubin", "-Xptxas", "-v"]
_ENUM = re.compile(r"enum\s+class\s+(\w+)\s*(?::\s*\w+\s*)?\{([^}]*)\}")
_ENUM_CAST = re.compile(r"\((?:\w+::)*(\w+)\)(-?\d+)")
_NAMESPACES = re.compile(r"\b(?:\w+::|\(anonymous namespace\)::)+")


def nvcc() -> str | None:
    return shutil.which(os.environ.get("NVCC", "nvcc"))


def cuobjdump() -> str:
    """The toolkit's cuobjdump next to nvcc, else the one Triton ships."""
    found = nvcc() and os.path.join(os.path.dirname(os.path.realpath(nvcc())), "cuobjdump")
    if found and os.path.exists(found):
        return found
    from triton import knobs

    return knobs.nvidia.cuobjdump.path


def sources(root: str) -> list[str]:
    """Every .cu under csrc/, relative to the repository root."""
    return sorted(os.path.relpath(path, root) for path in glob.glob(os.path.join(root, "csrc", "**", "*.cu"),
                                                                     recursive=True))


def compile_cubin(root: str, source: str) -> tuple[str, str]:
    """(cuobjdump -sass of the cubin, ptxas -v's log) for one .cu; raises with nvcc's output if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        built = subprocess.run([nvcc(), *NVCC_FLAGS, source, "-o", cubin], cwd=root, capture_output=True, text=True)
        if built.returncode != 0:
            raise RuntimeError(f"nvcc failed on {source}:\n{built.stdout}{built.stderr}")
        with open(cubin, "rb") as f:
            return disassemble(f.read()), built.stderr


def disassemble(cubin: bytes) -> str:
    """cuobjdump -sass of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout


def enum_names(root: str) -> dict[tuple[str, int], str]:
    """{(enum, value): enumerator} for every `enum class` in csrc/include, to print (Precision)0 as kFP32."""
    names = {}
    for header in glob.glob(os.path.join(root, "csrc", "include", "**", "*.h*"), recursive=True):
        with open(header) as f:
            for enum, body in _ENUM.findall(f.read()):
                value = -1
                for item in filter(None, (part.strip() for part in body.split(","))):
                    name, _, explicit = (s.strip() for s in item.partition("="))
                    value = int(explicit, 0) if explicit else value + 1
                    names[(enum, value)] = name
    return names


def readable_names(mangled: list[str], enums: dict[tuple[str, int], str]) -> list[str]:
    """_ZN7ropewkv4cuda11wkv7_detail14forward_kernelILi64ENS_6bf16_tELNS_9PrecisionE0EEEv... ->
    forward_kernel<64, bf16_t, kFP32>: demangled, without namespaces, return type and parameters."""
    if not mangled:
        return []
    demangled = subprocess.run(["c++filt", *mangled], capture_output=True, text=True, check=True).stdout
    return [_readable(name, enums) for name in demangled.splitlines()]


def _readable(demangled: str, enums: dict[tuple[str, int], str]) -> str:
    name = demangled.removeprefix("void ")
    depth = 0
    for i, char in enumerate(name):  # cut the parameter list: the first "(" outside the template arguments
        depth += {"<": 1, ">": -1}.get(char, 0)
        if char == "(" and depth == 0 and not name[i:].startswith("(anonymous"):
            name = name[:i]
            break
    name = _ENUM_CAST.sub(lambda m: enums.get((m.group(1), int(m.group(2))), f"{m.group(1)}({m.group(2)})"), name)
    return _NAMESPACES.sub("", name)


def wkv7_constants(root: str) -> dict:
    """The WKV7 kernels' launch constants, as tools/static_report/constants.cu prints them (built and run here)."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = os.path.join(tmp, "constants")
        built = subprocess.run([nvcc(), "-std=c++20", "--expt-relaxed-constexpr", "-Icsrc/include", "-Icsrc",
                                "tools/static_report/constants.cu", "-o", probe], cwd=root, capture_output=True,
                               text=True)
        if built.returncode != 0:
            raise RuntimeError(f"nvcc failed on tools/static_report/constants.cu:\n{built.stdout}{built.stderr}")
        return json.loads(subprocess.run([probe], capture_output=True, text=True, check=True).stdout)
