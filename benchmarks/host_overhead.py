"""Host overhead per eager call at decode (B=64, one token): what a launch-bound GPU step costs the CPU.

    python benchmarks/host_overhead.py [--device cpu|cuda] [--quick] [--out DIR]

At decode the GPU work of rope, apply_rotary_pos_emb and wkv7_step is shorter than a launch, so the host time per
call is the speed. Measured on tiny shapes (one head, head size 8 for RoPE, 32 for WKV7: the smallest it takes) so the
compute is small, and split into:
  - total: the public call (under no_grad, as in decoding);
  - op: the torch.ops call alone, with the arguments the public call builds, below the Autograd key as the dispatcher
    reaches the kernel when no gradient is needed (dispatcher + C++ glue + kernel);
  - python: total - op: ropewkv's Python (argument checks, views, backend resolution) and, where it runs, the Python
    autograd kernel that torch.library registers;
  - dispatcher: the same op on zero-size inputs (dispatcher + glue, no kernel work);
  - kernel: op - dispatcher (on a CUDA device: the launch and the queueing, not the GPU time).
On a GPU both kernel twins are measured: the CUDA one and the Triton one (whose "op" is its custom op, so the custom
op's Python dispatch counts there, while the public call's fast path skips it); on the CPU the C++ twin.
The floor beside them: one eager aten op on a 1-element tensor (torch.add), measured in the same run. Each figure is
the calling thread's CPU time (time.thread_time: a loaded machine's other processes do not count), the best of 7
batches of back-to-back calls, single-threaded (torch.set_num_threads(1)).
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common  # noqa: E402

import ropewkv  # noqa: E402
from ropewkv import _backend  # noqa: E402
from ropewkv.reference import rope as ref  # noqa: E402

BATCH = 64
REPEATS = 7


def per_call_us(calls, device: torch.device, quick: bool) -> list:
    """CPU µs of this thread per call of each of `calls`: the best of REPEATS batches of back-to-back calls
    (synchronised only at the batch ends), interleaved. Thread CPU time, not wall time: what a call costs the host,
    which other processes on a shared machine do not inflate."""
    n = 200 if quick else 2000
    best = [float("inf")] * len(calls)
    with torch.no_grad():
        for call in calls:
            for _ in range(20):
                call()
        for _ in range(REPEATS):
            for i, call in enumerate(calls):
                common.sync(device)
                start = time.thread_time()
                for _ in range(n):
                    call()
                common.sync(device)
                best[i] = min(best[i], (time.thread_time() - start) / n)
    return [b * 1e6 for b in best]


def below_autograd(op):
    """`op` called as the dispatcher reaches a CPU/CUDA kernel when no gradient is needed (below the Autograd key):
    the dispatcher, the C++ glue and the kernel, without ropewkv's Python nor torch.library's Python autograd kernel."""
    def call(*args):
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)
    return call


def rope_cases(device: torch.device, backend: str) -> list:
    """(name, public call, op call, op call on empty inputs) for rope and apply_rotary_pos_emb."""
    gen = torch.Generator().manual_seed(0)
    head_dim, empty = 8, (0, 1, 1, 8)
    q, k = (torch.randn(BATCH, 1, 1, head_dim, generator=gen).to(device) for _ in range(2))
    inv_freq = ref.default_inv_freq(head_dim).to(device)
    offsets = torch.randint(0, 4096, (BATCH,), generator=gen).to(device)
    functional = below_autograd(ropewkv.ops.rope._ops(backend)[0])
    cos_sin_op = below_autograd(ropewkv.ops.rope._ops(backend)[2])
    op_args = (inv_freq, None, offsets, None, False, False, 1.0, 0, None, False)
    cos, sin = (t.to(device) for t in ref.cos_sin(offsets.view(BATCH, 1).cpu(), inv_freq.cpu(), dtype=torch.float32))
    cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # HF's [B, 1, D]
    qh, kh = q.transpose(1, 2), k.transpose(1, 2)  # HF's [B, H, S, D]
    eq, e_offsets, e_cos, e_sin = torch.empty(empty, device=device), offsets[:0], cos[:0], sin[:0]
    return [
        ("rope", lambda: ropewkv.rope(q, k, inv_freq=inv_freq, seqlen_offsets=offsets, backend=backend),
         lambda: functional(q, k, *op_args), lambda: functional(eq, eq, inv_freq, None, e_offsets, *op_args[3:])),
        ("apply_rotary_pos_emb", lambda: ropewkv.apply_rotary_pos_emb(qh, kh, cos, sin, backend=backend),
         lambda: cos_sin_op(q, k, cos, sin, False, False, 0), lambda: cos_sin_op(eq, eq, e_cos, e_sin, False, False, 0)),
    ]


def wkv7_step_case(device: torch.device, backend: str) -> tuple:
    gen = torch.Generator().manual_seed(0)
    heads, n = 1, 32
    r, w, k, v, a, b = (torch.randn(BATCH, heads, n, generator=gen).to(device) for _ in range(6))
    w = -torch.rand(BATCH, heads, n, generator=gen).to(device) - 1.0
    state = torch.zeros(BATCH, heads, n, n, device=device)
    e = torch.empty(0, heads, n, device=device)
    e_state = torch.empty(0, heads, n, n, device=device)
    if backend == "triton":
        step, flags = below_autograd(torch.ops.ropewkv.wkv7_triton_step), ("loglog", "fp32")
    else:
        step, flags = below_autograd(torch.ops.ropewkv.wkv7_step), (0, 0)
    return ("wkv7_step", lambda: ropewkv.wkv7_step(r, w, k, v, a, b, state, backend=backend),
            lambda: step(r, w, k, v, a, b, state, *flags), lambda: step(e, e, e, e, e, e, e_state, *flags))


def main(argv=None) -> int:
    session = common.Session("host_overhead", "Host overhead per eager call at decode", __doc__.splitlines()[0],
                             argv)
    device, quick = session.device, session.args.quick
    # On a GPU both kernel twins (the Triton one through its custom op: its dispatch is part of "op"); on the CPU the
    # C++ twin (Triton there is the interpreter).
    backends = ([b for b in ("cuda", "triton") if b in ropewkv.available_backends(device)] if device.type == "cuda"
                else ["cpu"])
    torch.set_num_threads(1)  # the host path, not the CPU kernels' threading (on a loaded machine OpenMP stalls)
    one = torch.ones(1, device=device)
    cases = [(backend, case) for backend in backends
             for case in (*rope_cases(device, backend), wkv7_step_case(device, backend))]
    for backend, (name, public, op, op_empty) in cases:
        if not common.selected(session.args, name):
            continue
        row = {"shape": f"B{BATCH} one token", "impl": f"ropewkv.{name}[{backend}]"}
        try:  # a broken case is a row with its reason, not the end of the run
            total, op_us, dispatch, floor = per_call_us([public, op, op_empty, lambda: torch.add(one, one)], device,
                                                        quick)
            row.update(total_us=total, python_us=total - op_us, op_us=op_us, dispatch_us=dispatch,
                       kernel_us=op_us - dispatch, floor_us=floor)
        except Exception as error:
            row["total_us"] = common.describe_failure(error)
        session.rows.append(row)
        print("  " + ", ".join(f"{k}={common.fmt(v, '.4g')}" for k, v in row.items()), file=sys.stderr, flush=True)
        if session.args.out:  # the rows so far, so that a run cut short by its step's time limit keeps them
            common.write_json(session.args.out, session.name, session.env, session.rows, complete=False)
    columns = [("total_us", "total µs", ".1f"), ("python_us", "python µs", ".1f"), ("op_us", "op µs", ".1f"),
               ("dispatch_us", "dispatcher µs", ".1f"), ("kernel_us", "kernel µs", ".1f"),
               ("floor_us", "aten add µs", ".1f")]
    notes = [f"Tiny decode shapes: RoPE q and k [{BATCH}, 1, 1, 8] fp32, offsets a [{BATCH}] tensor; "
             f"wkv7_step r..b [{BATCH}, 1, 32] fp32, state [{BATCH}, 1, 32, 32]. Under no_grad; best of {REPEATS} "
             "batches.",
             "python = total - op; dispatcher = the op on zero-size inputs; kernel = op - dispatcher. aten add: one "
             "eager torch.add of 1-element tensors in the same run (the floor of any eager op call).",
             "Goal (reported, not asserted): total <= 15 µs per call."]
    return session.finish(columns, notes)


if __name__ == "__main__":
    sys.exit(main())
