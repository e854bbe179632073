"""Shared benchmark machinery: timing, copy bandwidth, host overhead, environment, JSON/markdown/plot writers.

Timing method (no numbers are asserted anywhere; they are reported):
  - CUDA: CUDA events around a batch of calls (batched so each timed interval is >= ~0.5 ms and event overhead is
    negligible), median over repeats after warm-up. Inputs rotate over enough independent sets that the data
    touched between two uses of one set exceeds 4x the L2 cache, so small shapes are not timed from cache.
  - CPU: time.perf_counter around each call, median over repeats after warm-up; same rotation (4x a 32 MB LLC).
  - Host overhead (decode shapes): CPU-side seconds per eager call, each call timed alone on an idle device (the
    device synchronised between calls, outside the timing, so a full launch queue cannot make the host wait), and,
    where capture works, device time per call of a CUDA-graph replay (the launch-free floor).
  - Copy bandwidth: a large device-to-device copy (a large memcpy on CPU), counting bytes read plus written, the
    ceiling every memory-bound figure is divided by.
Failures never abort a run: a missing op or backend becomes "n/a (reason)", any other exception "error (...)".
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

# Reasons an implementation cannot run here (as opposed to a bug in it).
UNAVAILABLE = (AttributeError, ImportError, NotImplementedError)
CPU_CACHE_BYTES = 32 << 20
MODES = ("fwd", "bwd", "fwd+bwd")
PEERS = ("liger-kernel", "flash-attn", "flash-linear-attention", "fla-core")  # distributions, for the versions


# ----------------------------------------------------------------------------------------------------------- CLI
def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--quick", action="store_true", help="smaller shapes and fewer repeats (a smoke run)")
    p.add_argument("--out", default=None, help="directory for <name>.json and <name>.md (and <name>.png)")
    p.add_argument("--plot", action="store_true", help="also draw <name>.png (needs matplotlib)")
    p.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="time the torch.compile baselines (default: on CUDA only; compiling on a CPU takes minutes)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile baselines")
    p.add_argument("--only", default=None, help="comma-separated substrings: run only implementations matching one")
    p.add_argument("--shapes", default=None, help="comma-separated substrings: run only shapes whose label matches one")
    p.add_argument("--append", action="store_true",
                   help="keep the rows already in <out>/<name>.json and measure only the (shape, impl) pairs it "
                        "lacks: one report from several runs (benchmarks/gpu_session.sh orders rows by priority)")
    return p


def resolve_device(name: Optional[str]) -> torch.device:
    from ropewkv._backend import best_device

    return best_device(name)


def want_compile(args, device: torch.device) -> bool:
    return device.type == "cuda" if args.compile is None else args.compile


def kernel_backends(device: torch.device) -> list:
    """ropewkv's kernel twins that run on `device`: not the eager "reference" (timed as the eager baseline), and not
    Triton on a CPU (the interpreter is no benchmark)."""
    import ropewkv
    return [b for b in ropewkv.available_backends(device)
            if b != "reference" and not (b == "triton" and device.type == "cpu")]


def matches(substrings: Optional[str], name: str) -> bool:
    """Whether `name` contains one of the comma-separated `substrings` (None: everything matches)."""
    return substrings is None or any(s and s in name for s in substrings.split(","))


def selected(args, impl_name: str) -> bool:
    return matches(args.only, impl_name)


# --------------------------------------------------------------------------------------------------- errors
def describe_failure(error: BaseException) -> str:
    """'n/a (why)' for an implementation that cannot run here, 'error (what)' for one that broke."""
    kind = "n/a" if isinstance(error, UNAVAILABLE) or type(error).__name__ == "BackendUnavailableError" else "error"
    if kind == "error":
        traceback.print_exception(error, file=sys.stderr)
    message = " ".join(str(error).split()) or type(error).__name__
    return f"{kind} ({type(error).__name__}: {message[:120]})"


def peer(module: str, attr: str, device: torch.device) -> Callable:
    """A peer's function imported now, or a stand-in that raises the import failure when called (so the table
    shows n/a and the import is not timed). The peers are Triton GPU kernels: n/a on other devices."""
    try:
        if device.type != "cuda":
            raise NotImplementedError(f"a Triton GPU kernel; not run on {device.type}")
        return getattr(importlib.import_module(module), attr)
    except Exception as error:  # a broken peer install is an n/a row, not a crash
        failure = error

        def unavailable(*args, **kwargs):
            raise failure.with_traceback(None)
        return unavailable


# --------------------------------------------------------------------------------------------------- timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))
    return CPU_CACHE_BYTES


def rotation_count(set_bytes: int, device: torch.device, max_sets: int = 512) -> int:
    """How many independent input sets to rotate over so a set is evicted before its next use."""
    return max(1, min(max_sets, math.ceil(4 * cache_bytes(device) / max(set_bytes, 1))))


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o) for o in obj)
    return 0


def _seconds(call: Callable[[], object], device: torch.device) -> float:
    start = time.perf_counter()
    call()
    sync(device)
    return time.perf_counter() - start


TIMING = {False: (5, 25, 2.0), True: (2, 5, 0.3)}  # --quick: warm-up calls, most timed repeats, seconds budget


def time_calls(calls: Sequence[Callable[[], object]], device: torch.device, quick: bool = False,
               host_per_call: Optional[list] = None) -> float:
    """Median seconds per call, cycling over `calls` (one closure per rotated input set). Repeats: 25 (quick: 5),
    fewer (down to 5) when they would take more than ~2 s (quick: 0.3 s), e.g. the eager loops.
    On a GPU, host_per_call (a list) gets the host's seconds per call while issuing the timed calls: where it comes
    close to the returned time, the GPU waited for the host and the figure measures the host, not the kernels."""
    n = len(calls)
    warmup, max_repeats, budget = TIMING[quick]
    for i in range(warmup):
        calls[i % n]()
    per_call = statistics.median(_seconds(calls[i % n], device) for i in range(3))
    if device.type == "cpu":
        repeats = max(5, min(max_repeats, int(budget / per_call)))
        return statistics.median(_seconds(calls[i % n], device) for i in range(repeats))
    batch = max(1, min(1000, math.ceil(5e-4 / max(per_call, 1e-7))))  # each event-timed interval >= 0.5 ms
    repeats = max(5, min(max_repeats, int(budget / (per_call * batch))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    k = 0
    issue_start = time.perf_counter()
    for begin, end in events:
        begin.record()
        for _ in range(batch):
            calls[k % n]()
            k += 1
        end.record()
    if host_per_call is not None:
        host_per_call.append((time.perf_counter() - issue_start) / k)
    sync(device)
    return statistics.median(b.elapsed_time(e) / 1e3 / batch for b, e in events)


def host_overhead(call: Callable[[], object], device: torch.device, quick: bool = False) -> dict:
    """CPU seconds per eager call ('host_s'), and on CUDA the device seconds per CUDA-graph replay ('graph_s')."""
    n = 50 if quick else 500
    for _ in range(10):
        call()
    sync(device)
    # Each call timed alone and the device drained after it, untimed: back to back, a call whose GPU work outlasts
    # its launch fills the launch queue and the host then waits for free slots (H100, eager wkv7 step at B256: 1520
    # µs "host" per call against 200 µs while issuing 25 calls), so the figure was the GPU's time.
    host = 0.0
    for _ in range(n):
        start = time.perf_counter()
        call()
        host += time.perf_counter() - start
        sync(device)
    result = {"host_s": host / n}
    if device.type != "cuda":
        return result
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up on a side stream, as CUDA-graph capture requires
            for _ in range(3):
                call()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        result["graph_s"] = time_calls([graph.replay], device, quick)
    except Exception as error:  # a capture failure is a finding to report, not a crash
        result["graph_error"] = describe_failure(error)
    return result


def copy_bandwidth(device: torch.device, quick: bool = False) -> float:
    """Bytes/s of a large copy, counting bytes read plus bytes written."""
    nbytes = (256 << 20) if device.type == "cpu" else (1 << 30)  # several times the last-level cache
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    seconds = time_calls([lambda: dst.copy_(src)], device, quick)
    return 2 * nbytes / seconds


# ------------------------------------------------------------------------------- fwd / bwd / fwd+bwd harness
@dataclass
class Work:
    """One implementation's calls at one shape.

    make_set() -> (args, grad_inputs): a fresh input set; `args` are passed to fn, `grad_inputs` are the tensors
    (already requiring grad) that the backward differentiates to (empty: no backward). fn(*args) -> tensor or
    tuple of tensors/None; every floating output gets a random cotangent."""
    fn: Callable
    make_set: Callable[[], tuple]
    modes: Sequence[str] = MODES
    reference: Optional[Callable] = None  # reference(args) -> the expected fwd output(s), for the sanity check


def _outputs(out) -> list:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in items if isinstance(o, torch.Tensor) and o.requires_grad]


def _backward_call(fn, args, grad_inputs, with_forward: bool):
    outs = _outputs(fn(*args))
    if not outs:
        raise NotImplementedError("no output requires grad: the implementation has no backward")
    cotangents = [torch.randn_like(o) for o in outs]
    if with_forward:
        del outs  # drop the probe's graph; each call builds its own

        def call():
            return torch.autograd.grad(_outputs(fn(*args)), grad_inputs, cotangents)
        return call
    return lambda: torch.autograd.grad(outs, grad_inputs, cotangents, retain_graph=True)


def time_modes(work: Work, device: torch.device, quick: bool) -> dict:
    """{mode: seconds or failure string} for each requested mode (fwd runs under no_grad), plus "rel_err" when
    work.reference is given. A failure of the first fwd call fails every mode with the same reason.
    Input sets rotate only for calls under 1 ms: a longer call streams far more than the cache by itself."""
    results, expected = {}, None
    try:
        first_args, first_grads = work.make_set()
        with torch.no_grad():
            try:  # the reference before fn: some peers rotate their inputs in place
                expected = work.reference(first_args) if work.reference is not None else None
            except Exception as error:  # a broken reference costs the check, not the timing
                results["rel_err"] = describe_failure(error)
            out = work.fn(*first_args)  # the first call also compiles / autotunes
            if expected is not None:
                results["rel_err"] = rel_error(out, expected)
            del out, expected
            probe = _seconds(lambda: work.fn(*first_args), device)
        n_sets = 1 if probe > 1e-3 else rotation_count(tensor_bytes(first_args), device)
        if device.type == "cpu":  # time_calls uses sets 0..max_repeats-1 there: more would be made and never used
            n_sets = min(n_sets, TIMING[quick][1])
        sets = [(first_args, first_grads)] + [work.make_set() for _ in range(n_sets - 1)]
    except Exception as error:
        failure = describe_failure(error)
        return {"rel_err": failure, **{mode: failure for mode in work.modes}}
    for mode in work.modes:
        try:
            if mode == "fwd":
                def make(args, _):
                    def call():
                        with torch.no_grad():
                            return work.fn(*args)
                    return call
            else:
                if not first_grads:
                    raise NotImplementedError("no backward for this implementation")

                def make(args, grads, with_forward=(mode == "fwd+bwd")):
                    return _backward_call(work.fn, args, grads, with_forward)
            host = []
            results[mode] = time_calls([make(a, g) for a, g in sets], device, quick, host)
            if host:
                results[f"{mode} host"] = host[0]
        except Exception as error:
            results[mode] = describe_failure(error)
        sync(device)
    del sets
    return results


def rel_error(out, ref) -> Optional[float]:
    """max over outputs of ||out - ref|| / ||ref||, in fp32 on the device: a sanity check that the timed thing
    computes the right function (the precise error figures come from `python -m ropewkv parity`)."""
    pairs = zip(*(x if isinstance(x, (tuple, list)) else (x,) for x in (out, ref)))
    errors = [float(torch.linalg.vector_norm(o.detach().float() - r.detach().float())
                    / torch.linalg.vector_norm(r.detach().float())) for o, r in pairs if r is not None]
    return max(errors, default=None)


KEY = {"fwd": "fwd", "bwd": "bwd", "fwd+bwd": "fb"}


def measure(session: "Session", *, shape: str, impl: str, work: Work, bytes_per_mode: Optional[dict] = None,
            tokens: Optional[int] = None, host_call: Optional[Callable[[tuple], Callable]] = None) -> dict:
    """Time `work` in each mode and add a row: <k>_us, <k>_GBps (bytes_per_mode[mode] / time), <k>_pct (of the
    copy bandwidth), <k>_tok_s (tokens per second), for k in fwd/bwd/fb (modes fwd/bwd/fwd+bwd); with
    host_call(args) -> call, also host_us and graph_us (see host_overhead). A mode that cannot run holds its
    reason in <k>_us; when every mode fails the same way the reason is shown once."""
    device, quick, copy_bps = session.device, session.args.quick, session.copy_bps
    timings = time_modes(work, device, quick)
    row = {"shape": shape, "impl": impl, "rel_err": timings.pop("rel_err", None)}
    for mode in work.modes:  # host seconds per call while the timed calls were issued (GPU only; see time_calls)
        if f"{mode} host" in timings:
            row[f"{KEY[mode]}_host_us"] = timings.pop(f"{mode} host") * 1e6
    for mode, value in timings.items():
        k = KEY[mode]
        if not isinstance(value, float):
            row[f"{k}_us"] = value
            continue
        row[f"{k}_us"] = value * 1e6
        if bytes_per_mode and mode in bytes_per_mode:
            row[f"{k}_GBps"] = bytes_per_mode[mode] / value / 1e9
            row[f"{k}_pct"] = 100 * bytes_per_mode[mode] / value / copy_bps
        if tokens:
            row[f"{k}_tok_s"] = tokens / value
    failures = [v for v in timings.values() if not isinstance(v, float)]
    if len(failures) == len(timings) and len(set(failures)) == 1:
        for mode in list(timings)[1:]:
            row[f"{KEY[mode]}_us"] = "(same)"
        if row["rel_err"] == failures[0]:
            row["rel_err"] = None
    if host_call is not None and all(isinstance(v, float) for v in timings.values()):
        try:
            args, _ = work.make_set()
            with torch.no_grad():
                overhead = host_overhead(host_call(args), device, quick)
            row["host_us"] = overhead["host_s"] * 1e6
            row["graph_us"] = overhead["graph_s"] * 1e6 if "graph_s" in overhead else overhead.get("graph_error")
        except Exception as error:
            row["host_us"] = describe_failure(error)
    sync(device)
    session.rows.append(row)
    print("  " + ", ".join(f"{k}={fmt(v, '.4g')}" for k, v in row.items()), file=sys.stderr, flush=True)
    return row


def pass_bytes(fwd: float, bwd: Optional[float] = None) -> dict:
    """Bytes per mode when a fwd pass moves `fwd` bytes and a bwd pass `bwd` (default: the same)."""
    bwd = fwd if bwd is None else bwd
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}


def speedups(rows: list, shape: str, key: str, ours: str, baselines: Sequence[str]) -> list:
    """Notes 'best <ours*> vs <baseline>: x.xx x' at `shape` for time column `key` (only where both ran)."""
    def best(prefix):
        times = [(r[key], r["impl"]) for r in rows
                 if r["shape"] == shape and r["impl"].startswith(prefix) and isinstance(r.get(key), float)]
        return min(times) if times else None
    mine = best(ours)
    notes = []
    for name in baselines:
        theirs = best(name)
        if mine and theirs:
            notes.append(f"{shape}, {key[:-3]}: {mine[1]} is {theirs[0] / mine[0]:.2f}x {theirs[1]}")
    return notes


# ------------------------------------------------------------------------------------------------ environment
def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _git_commit() -> str:
    """ROPEWKV_COMMIT if set (the device machine's copy of the tree may have no .git), else git's HEAD."""
    if os.environ.get("ROPEWKV_COMMIT"):
        return os.environ["ROPEWKV_COMMIT"]
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        model = None
    return f"CPU {model or platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def environment(device: torch.device, copy_bytes_per_s: float) -> dict:
    try:
        import ropewkv
        ropewkv_version = ropewkv.__version__
    except ImportError:
        ropewkv_version = "absent"
    return {
        "device": device_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable), *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "triton": _version("triton"),
        "ropewkv": f"{ropewkv_version} ({_git_commit()})",
        "peers": {name: _version(name) for name in PEERS},
        "copy_GBps": copy_bytes_per_s / 1e9,
    }


# -------------------------------------------------------------------------------------------------- writers
def fmt(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else ("" if value is None else str(value))


def markdown(title: str, env: dict, columns: Sequence[tuple], rows: Sequence[dict], notes: Sequence[str]) -> str:
    """columns: (key, header, format spec). Rows may hold strings (n/a, error) where numbers are expected."""
    peers = ", ".join(f"{k} {v}" for k, v in env["peers"].items())
    lines = [f"## {title}", "",
             f"- device: {env['device']}; copy bandwidth (same run, read+write): {env['copy_GBps']:.1f} GB/s",
             f"- torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, python {env['python']}, "
             f"ropewkv {env['ropewkv']}; peers: {peers}",
             f"- date: {env['date']}; command: `{env['command']}`", "",
             "| " + " | ".join(h for _, h, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(fmt(row.get(k), spec) for k, _, spec in columns) + " |" for row in rows]
    lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def write_json(out: str, name: str, env: dict, rows: list, complete: bool) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump({"environment": env, "complete": complete, "rows": rows}, f, indent=1, default=str)


def write_outputs(args, name: str, env: dict, rows: list, text: str, plot: Optional[Callable] = None) -> None:
    if args.out:
        write_json(args.out, name, env, rows, complete=True)
        with open(os.path.join(args.out, f"{name}.md"), "w") as f:
            f.write(text)
    if args.plot and plot is not None:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as error:
            print(f"--plot: matplotlib unavailable ({error}); no plot drawn", file=sys.stderr)
        else:
            path = os.path.join(args.out or ".", f"{name}.png")
            plot(plt, path)
            print(f"plot written to {path}", file=sys.stderr)
    print(text)


def bar_plot(plt, path: str, rows: list, group_key: str, label_key: str, value_key: str, ylabel: str,
             title: str) -> None:
    """Grouped bars: one group per `group_key` value, one bar per `label_key`; non-numeric values are skipped."""
    groups = list(dict.fromkeys(r[group_key] for r in rows))
    labels = list(dict.fromkeys(r[label_key] for r in rows if isinstance(r.get(value_key), (int, float))))
    width = 0.8 / max(len(labels), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(groups) * max(1, len(labels) / 4)), 4.5))
    for i, label in enumerate(labels):
        xs, ys = [], []
        for g, group in enumerate(groups):
            match = [r for r in rows if r[group_key] == group and r[label_key] == label]
            if match and isinstance(match[0].get(value_key), (int, float)):
                xs.append(g + i * width)
                ys.append(match[0][value_key])
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


MODE_TITLES = (("fwd", "fwd"), ("bwd", "bwd"), ("fb", "fwd+bwd"))


class Session:
    """One benchmark run: parsed args, device, the copy bandwidth and environment measured first, the rows."""

    def __init__(self, name: str, title: str, description: str, argv=None):
        self.name, self.title = name, title
        self.args = parser(description).parse_args(argv)
        self.device = resolve_device(self.args.device)
        torch.manual_seed(0)
        # Each shape and grad mode is a recompile of the same code: past the limit dynamo would silently run eager.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
        self.copy_bps = copy_bandwidth(self.device, self.args.quick)
        self.env = environment(self.device, self.copy_bps)
        self.rows: list = []
        previous = os.path.join(self.args.out or "", f"{self.name}.json")
        if self.args.append and self.args.out and os.path.exists(previous):
            with open(previous) as f:
                self.rows = json.load(f)["rows"]

    def measure(self, **kwargs) -> Optional[dict]:
        """common.measure, then the rows so far to <name>.json ("complete": false), so a run cut short by a
        timeout still leaves its numbers. Shapes not selected by --shapes, and rows already there (--append),
        are skipped."""
        if not matches(self.args.shapes, kwargs["shape"]):
            return None
        done = [r for r in self.rows if (r["shape"], r["impl"]) == (kwargs["shape"], kwargs["impl"])]
        if done:
            return done[0]
        row = measure(self, **kwargs)
        if self.args.out:
            write_json(self.args.out, self.name, self.env, self.rows, complete=False)
        return row

    def finish(self, columns: Sequence[tuple], notes: Sequence[str], plot: Optional[Callable] = None) -> int:
        """Write <name>.json/.md (and .png with --plot), print the markdown table last."""
        columns = [("shape", "shape", ""), ("impl", "impl", ""), ("rel_err", "rel err", ".1e"), *columns]
        text = markdown(self.title, self.env, columns, self.rows, notes)
        write_outputs(self.args, self.name, self.env, self.rows, text, plot)
        return 0


def tile(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """x repeated along each dim up to `shape` (cheap large inputs from the project's small fp64-drawn generators;
    the values repeat, the memory does not, which is what the timing needs)."""
    reps = [math.ceil(s / max(d, 1)) for s, d in zip(shape, x.shape)]
    return x.repeat(*reps)[tuple(slice(0, s) for s in shape)].contiguous()
