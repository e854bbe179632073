"""Host overhead per eager call at decode (B=64, one token): what a launch-bound GPU step costs the CPU.

    python benchmarks/host_overhead.py [--device cpu|cuda] [--quick] [--out DIR]

At decode the GPU work of rope, apply_rotary_pos_emb and wkv7_step is shorter than a launch, so the host time per
call is the speed. Measured on tiny shapes (one head, head size 8 for RoPE, 32 for WKV7: the smallest it takes) so the
compute is small, and split into:
  - total: the public call (under no_grad, as in decoding);
  - op: the dispatched torch.ops call alone, with the arguments the public call builds (dispatcher + C++ glue + kernel);
  - python: total - op, ropewkv's Python (argument checks, views, backend resolution);
  - dispatcher: the same op on zero-size inputs (dispatcher + glue, no kernel work);
  - kernel: op - dispatcher (on a CUDA device: the launch and the queueing, not the GPU time).
The floor beside them: one eager aten op on a 1-element tensor (torch.add), measured in the same run. Each figure is
the best of 7 batches of back-to-back calls (other processes only add time).
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


def per_call_us(call, device: torch.device, quick: bool) -> float:
    """Best of REPEATS batches of back-to-back calls, in µs per call (synchronised only at the batch ends)."""
    n = 200 if quick else 2000
    with torch.no_grad():
        for _ in range(20):
            call()
        best = float("inf")
        for _ in range(REPEATS):
            common.sync(device)
            start = time.perf_counter()
            for _ in range(n):
                call()
            common.sync(device)
            best = min(best, (time.perf_counter() - start) / n)
    return best * 1e6


def rope_cases(device: torch.device, backend: str) -> list:
    """(name, public call, op call, op call on empty inputs) for rope and apply_rotary_pos_emb."""
    gen = torch.Generator().manual_seed(0)
    head_dim, empty = 8, (0, 1, 1, 8)
    q, k = (torch.randn(BATCH, 1, 1, head_dim, generator=gen).to(device) for _ in range(2))
    inv_freq = ref.default_inv_freq(head_dim).to(device)
    offsets = torch.randint(0, 4096, (BATCH,), generator=gen).to(device)
    functional = ropewkv.ops.rope._ops(backend)[0]
    cos_sin_op = ropewkv.ops.rope._ops(backend)[2]
    op_args = (inv_freq, None, offsets, None, False, False, 1.0, 0)
    eq = torch.empty(empty, device=device)
    cos, sin = (t.to(device) for t in ref.cos_sin(offsets.view(BATCH, 1).cpu(), inv_freq.cpu(), dtype=torch.float32))
    cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # HF's [B, 1, D]
    qh, kh = q.transpose(1, 2), k.transpose(1, 2)  # HF's [B, H, S, D]
    return [
        ("rope", lambda: ropewkv.rope(q, k, inv_freq=inv_freq, seqlen_offsets=offsets, backend=backend),
         lambda: functional(q, k, *op_args), lambda: functional(eq, eq, inv_freq, None, offsets[:0], *op_args[3:])),
        ("apply_rotary_pos_emb", lambda: ropewkv.apply_rotary_pos_emb(qh, kh, cos, sin, backend=backend),
         lambda: cos_sin_op(q, k, cos, sin, False, False, 0),
         lambda: cos_sin_op(eq, eq, cos[:0], sin[:0], False, False, 0)),
    ]


def wkv7_step_case(device: torch.device, backend: str) -> tuple:
    gen = torch.Generator().manual_seed(0)
    heads, n = 1, 32
    r, w, k, v, a, b = (torch.randn(BATCH, heads, n, generator=gen).to(device) for _ in range(6))
    w = -torch.rand(BATCH, heads, n, generator=gen).to(device) - 1.0
    state = torch.zeros(BATCH, heads, n, n, device=device)
    e = torch.empty(0, heads, n, device=device)
    e_state = torch.empty(0, heads, n, n, device=device)
    step = torch.ops.ropewkv.wkv7_step
    return ("wkv7_step", lambda: ropewkv.wkv7_step(r, w, k, v, a, b, state, backend=backend),
            lambda: step(r, w, k, v, a, b, state, 0, 0), lambda: step(e, e, e, e, e, e, e_state, 0, 0))


def main(argv=None) -> int:
    session = common.Session("host_overhead", "Host overhead per eager call at decode", __doc__.splitlines()[0],
                             argv)
    device, quick = session.device, session.args.quick
    backend = "cuda" if device.type == "cuda" and "cuda" in ropewkv.available_backends(device) else "cpu"
    one = torch.ones(1, device=device)
    floor = per_call_us(lambda: torch.add(one, one), device, quick)
    for name, public, op, op_empty in [*rope_cases(device, backend), wkv7_step_case(device, backend)]:
        if not common.selected(session.args, name):
            continue
        total, op_us, dispatch = (per_call_us(call, device, quick) for call in (public, op, op_empty))
        row = {"shape": f"B{BATCH} one token", "impl": f"ropewkv.{name}[{backend}]", "total_us": total,
               "python_us": total - op_us, "op_us": op_us, "dispatch_us": dispatch, "kernel_us": op_us - dispatch,
               "floor_us": floor}
        session.rows.append(row)
        print("  " + ", ".join(f"{k}={common.fmt(v, '.4g')}" for k, v in row.items()), file=sys.stderr, flush=True)
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
