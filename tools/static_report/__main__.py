"""python -m tools.static_report [--out DIR] [--baseline JSON] [--check] [--jobs N]   (from the repository root)

Compiles every CUDA and Triton kernel for sm_90a (nothing cached: each .cu and each Triton entry is compiled afresh,
in parallel), prints the report and writes it to --out (static-sm90a.md and .json). With --check it fails (exit 1) if
a kernel spills that did not in --baseline, or a RoPE or decay hot loop does not move 16-byte vectors (NOT_YET_16_BYTE aside).
Refresh the committed report with `python -m tools.static_report --out benchmarks/results`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from . import cuda, kernels, model, report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _version(tool: str) -> str:
    """13.0.88 for a CUDA tool that prints "Cuda compilation tools, release 13.0, V13.0.88"."""
    printed = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
    return printed.rsplit(", V", 1)[-1].split()[0]


def _header() -> dict:
    import triton
    from triton import knobs

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    edited = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "csrc", "triton_kernels", "tools"], cwd=ROOT)
    commit = commit.stdout.strip() + (" with uncommitted changes to the kernels or the tool" if edited.returncode else "")
    return {"date": datetime.date.today().isoformat(), "commit": commit, "nvcc": _version(cuda.nvcc()),
            "triton": triton.__version__, "triton_ptxas": _version(knobs.nvidia.ptxas.path)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.static_report", description=__doc__.split("\n\n")[1])
    parser.add_argument("--out", default=os.path.join(ROOT, "build", "static-report"))
    parser.add_argument("--baseline", default=os.path.join(RESULTS, "static-sm90a.json"))
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    args = parser.parse_args(argv)
    if cuda.nvcc() is None:
        print("static-report: nvcc not found", file=sys.stderr)
        return 2
    os.environ["TRITON_INTERPRET"] = "0"  # the workers compile @triton.jit kernels (inherited by spawn)
    start = time.time()
    # Longest first: the WKV7 .cu files (each instantiates 18 kernels), then the big Triton WKV7 specialisations.
    tasks = [("cuda", source) for source in sorted(cuda.sources(ROOT), key=lambda s: "wkv7" not in s)]
    tasks += [("triton", name) for name in sorted(kernels.TRITON, key=lambda n: ("N256" not in n, n))]
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        compiled = [k for result in pool.map(kernels.compile_task, [ROOT] * len(tasks), tasks) for k in result]
    compiled.sort(key=lambda k: (k.twin, k.key))
    predictions = [model.predict(kernel, workload) for workload in model.workloads(cuda.wkv7_constants(ROOT))
                   for kernel in model.kernels_of(workload, compiled)]
    header = _header()
    baseline = {"kernels": [], **{tool: header[tool] for tool in ("nvcc", "triton")}}
    if os.path.exists(args.baseline):
        with open(args.baseline) as f:
            baseline = json.load(f)
    else:
        print(f"static-report: no baseline at {args.baseline}: every spilling kernel counts as new", file=sys.stderr)
    twins = report.compared_twins(baseline, header)
    uncompared = [f"{twin} not compared: baseline built by {tool} {baseline.get(tool)}"
                  for twin, tool in report.COMPILERS if twin not in twins]
    spills = "no kernel spills that did not in the baseline" + (f" ({'; '.join(uncompared)})" if uncompared else "")
    checks = {spills: report.spill_failures(compiled, baseline, twins),
              "RoPE and decay hot loops move 16-byte vectors": report.sixteen_byte_failures(
                  [k for k in compiled if report.judged_16_byte(k)]),
              "CUDA kernels declare at most 48 KB of static shared memory": report.static_shared_failures(compiled)}
    text = report.markdown(compiled, predictions, header, checks)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "static-sm90a.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "static-sm90a.json"), "w") as f:
        f.write(report.to_json(compiled, predictions, header, checks))
    failures = [failure for found in checks.values() for failure in found]
    print(f"static-report: {len(compiled)} kernels, {len(predictions)} predictions in {time.time() - start:.0f} s, "
          f"written to {os.path.relpath(args.out, ROOT)}/static-sm90a.{{md,json}}")
    for failure in failures:
        print(f"static-report: FAIL {failure}")
    return 1 if args.check and failures else 0


if __name__ == "__main__":
    sys.exit(main())
