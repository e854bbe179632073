"""RoPE benchmark: fwd, bwd and fwd+bwd GB/s against the copy bandwidth measured in the same run.

    python benchmarks/rope.py [--device cuda|cpu] [--quick] [--out DIR] [--plot] [--[no-]compile] [--only SUBSTR,..]
                              [--shapes SUBSTR,..] [--append]

Bytes counted (the floor): q and k read once and written once, 2 * (numel(q) + numel(k)) * itemsize per fwd or bwd
pass (cos/sin tables of the peers are not counted: they are S*D, small against B*S*H*D). Memory layout is the one a
projection produces, [B, S, H, D] (bshd); the HF-style implementations get the [B, H, S, D] transposed views, as HF's
attention passes them. Every implementation is checked against the fp32 eager reference (rel err column).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common  # noqa: E402

import ropewkv  # noqa: E402
from ropewkv.reference import rope as ref  # noqa: E402
from ropewkv.testing.rope import rope_input  # noqa: E402

DECODE_CONTEXT = 4096  # decode positions are drawn from [0, DECODE_CONTEXT)
MROPE_SECTION = [16, 24, 24]  # Qwen2-VL's split of head_dim 128's 64 frequencies (temporal, height, width)


@dataclass
class Shape:
    name: str
    batch: int
    seqlen: int
    q_heads: int
    k_heads: int
    head_dim: int

    @property
    def decode(self) -> bool:
        return self.seqlen == 1


def shapes(device: torch.device, quick: bool) -> list:
    if device.type == "cuda":
        if quick:
            return [Shape("train B8 S1024", 8, 1024, 32, 8, 128), Shape("decode B64", 64, 1, 32, 8, 128)]
        return [Shape("train B8 S4096", 8, 4096, 32, 8, 128), Shape("long B1 S32k", 1, 32768, 32, 8, 128),
                Shape("decode B64", 64, 1, 32, 8, 128)]
    if quick:
        return [Shape("train B1 S256", 1, 256, 8, 2, 128), Shape("decode B64", 64, 1, 8, 2, 128)]
    return [Shape("train B1 S1024", 1, 1024, 32, 8, 128), Shape("decode B64", 64, 1, 32, 8, 128)]


class Inputs:
    """Per-shape constants: inv_freq, positions (offsets at decode), HF's cos/sin (fp32-computed, cast to dtype)."""

    def __init__(self, shape: Shape, dtype: torch.dtype, device: torch.device, generator: torch.Generator):
        self.shape, self.dtype, self.device, self.generator = shape, dtype, device, generator
        self.inv_freq = ref.default_inv_freq(shape.head_dim).to(device)
        if shape.decode:
            self.offsets = torch.randint(0, DECODE_CONTEXT, (shape.batch,), generator=generator).to(device)
        else:
            self.offsets = 0
        self.positions = ref.token_positions(shape.batch, shape.seqlen, seqlen_offsets=self.offsets).to(device)
        cos, sin = ref.cos_sin(self.positions, self.inv_freq, dtype=torch.float32)  # [B, S, D/2] fp32, as HF
        self.cos, self.sin = (torch.cat((c, c), dim=-1).to(dtype) for c in (cos, sin))  # HF's [B, S, D] in bf16
        # flash-attn reads a [seqlen_ro, D/2] table at offset + s: at decode it spans the whole context.
        table = torch.arange(DECODE_CONTEXT if shape.decode else shape.seqlen, device=device)
        self.flash_tables = tuple(t.to(dtype) for t in ref.cos_sin(table, self.inv_freq, dtype=torch.float32))
        # M-RoPE: three rows as an image grid gives them (temporal, then height and width within 32 x 32 tiles), and
        # HF's Qwen2-VL tables of them (fp32 angles, composed per section, cast to dtype).
        self.mrope_positions = torch.stack([self.positions // 1024, self.positions // 32 % 32, self.positions % 32])
        rows = ref.mrope_rows(shape.head_dim // 2, MROPE_SECTION)
        cos, sin = ref.cos_sin(self.mrope_positions, self.inv_freq, dtype=torch.float32, rows=rows)
        self.mrope_cos, self.mrope_sin = (torch.cat((c, c), dim=-1).to(dtype) for c in (cos, sin))

    def make_set(self):
        """Fresh q, k in bshd, requiring grad: N(0,1) from the project's generator, tiled to the full shape."""
        s = self.shape
        base = min(s.batch, 4), min(s.seqlen, 256)
        q, k = (common.tile(rope_input(*base, h, s.head_dim, self.dtype, generator=self.generator, device=self.device),
                            (s.batch, s.seqlen, h, s.head_dim)).requires_grad_()
                for h in (s.q_heads, s.k_heads))
        return (q, k), [q, k]

    def reference(self, args):
        return tuple(ref.rope(x, self.inv_freq, self.positions, dtype=torch.float32) for x in args)

    def mrope_reference(self, args):
        return tuple(ref.rope(x, self.inv_freq, self.mrope_positions, dtype=torch.float32, mrope_section=MROPE_SECTION)
                     for x in args)


def _hf_style(fn):
    """Call an HF-signature function (q, k as [B, H, S, D] views) on bshd q, k; return bshd views."""
    def call(q, k, cos, sin):
        q_out, k_out = fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    return call


class _FlashRotary(torch.autograd.Function):
    """flash-attn's Triton apply_rotary is a plain function; its backward is the same kernel with conjugate=True
    (what flash_attn.layers.rotary's autograd does), wrapped here so bwd can be timed too."""

    @staticmethod
    def forward(ctx, x, cos, sin, offsets, apply_rotary):
        ctx.save_for_backward(cos, sin)
        ctx.offsets, ctx.apply_rotary = offsets, apply_rotary
        return apply_rotary(x, cos, sin, seqlen_offsets=offsets)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return ctx.apply_rotary(grad, cos, sin, seqlen_offsets=ctx.offsets, conjugate=True), None, None, None, None


def mrope_implementations(inputs: Inputs, device: torch.device, args) -> list:
    """M-RoPE (Qwen2-VL sections): ropewkv's in-kernel angle from [3, B, S] positions against HF's eager apply on
    the tables its Qwen2VLRotaryEmbedding composes (vLLM's MRotaryEmbedding would join as a peer where installed)."""
    impls = [(f"ropewkv.rope[{backend},mrope]",
              lambda q, k, b=backend: ropewkv.rope(q, k, inv_freq=inputs.inv_freq, positions=inputs.mrope_positions,
                                                   mrope_section=MROPE_SECTION, backend=b))
             for backend in common.kernel_backends(device)]
    eager = _hf_style(ref.hf_apply_rotary_pos_emb)
    impls.append(("eager HF M-RoPE", lambda q, k: eager(q, k, inputs.mrope_cos, inputs.mrope_sin)))
    return [(n, f) for n, f in impls if common.selected(args, n)]


def implementations(inputs: Inputs, device: torch.device, args) -> list:
    """(name, fn(q, k) -> (q_out, k_out) in bshd) for every implementation to compare."""
    impls = []
    for backend in common.kernel_backends(device):
        for precision in ("fp32", "bf16"):
            impls.append((f"ropewkv.rope[{backend},{precision}]",
                          lambda q, k, b=backend, p=precision: ropewkv.rope(
                              q, k, inv_freq=inputs.inv_freq, seqlen_offsets=inputs.offsets, precision=p,
                              backend=b)))
        impls.append((f"ropewkv.apply_rotary_pos_emb[{backend}]",
                      lambda q, k, b=backend: _hf_style(lambda *a: ropewkv.apply_rotary_pos_emb(*a, backend=b))(
                          q, k, inputs.cos, inputs.sin)))
    eager = _hf_style(ref.hf_apply_rotary_pos_emb)
    impls.append(("eager HF", lambda q, k: eager(q, k, inputs.cos, inputs.sin)))
    if common.want_compile(args, device):
        compiled = torch.compile(eager, dynamic=False)
        impls.append(("torch.compile(eager HF)", lambda q, k: compiled(q, k, inputs.cos, inputs.sin)))

    liger = common.peer("liger_kernel.transformers.rope", "liger_rotary_pos_emb", device)
    impls.append(("Liger-Kernel", lambda q, k: _hf_style(liger)(q, k, inputs.cos, inputs.sin)))  # rotates in place
    flash = common.peer("flash_attn.ops.triton.rotary", "apply_rotary", device)
    impls.append(("flash-attn triton", lambda q, k: tuple(
        _FlashRotary.apply(x, *inputs.flash_tables, inputs.offsets, flash) for x in (q, k))))
    return [(n, f) for n, f in impls if common.selected(args, n)]


def main(argv=None) -> int:
    session = common.Session("rope", "RoPE", __doc__.splitlines()[0], argv)
    device, args = session.device, session.args
    dtype = torch.bfloat16
    for shape in shapes(device, args.quick):
        inputs = Inputs(shape, dtype, device, torch.Generator().manual_seed(0))
        numel = shape.batch * shape.seqlen * (shape.q_heads + shape.k_heads) * shape.head_dim
        label = f"{shape.name} Hq{shape.q_heads} Hk{shape.k_heads} D{shape.head_dim}"
        runs = [(label, inputs.reference, implementations(inputs, device, args)),
                (label + " M-RoPE", inputs.mrope_reference, mrope_implementations(inputs, device, args))]
        for shape_label, reference, impls in runs:
            for name, fn in impls:
                host = (lambda a, f=fn: (lambda: f(*a))) if shape.decode else None
                work = common.Work(fn, inputs.make_set, reference=reference)
                session.measure(shape=shape_label, impl=name, work=work,
                                bytes_per_mode=common.pass_bytes(2 * numel * dtype.itemsize), host_call=host)
    rows, copy_bps, env = session.rows, session.copy_bps, session.env
    columns = [c for k, title in common.MODE_TITLES for c in (
        (f"{k}_us", f"{title} µs", ".1f"), (f"{k}_GBps", f"{title} GB/s", ".0f"), (f"{k}_pct", "% copy", ".0f"))]
    columns += [("host_us", "host µs/call", ".1f"), ("graph_us", "graph µs/call", ".1f")]
    notes = [f"bf16 q and k; bytes per pass = 2*(numel q + numel k)*2; fwd+bwd counts two passes. % copy is of the "
             f"{copy_bps / 1e9:.1f} GB/s measured above.",
             "rel err: ||out - ref|| / ||ref|| of the fwd output against the fp32 eager reference (a sanity check; "
             "`python -m ropewkv parity` has the precise figures).",
             "host µs/call: CPU time per eager call at decode (on CPU this includes the compute); graph µs/call: "
             "device time per CUDA-graph replay. At decode the µs columns time back-to-back eager calls, so they are "
             "host-bound wherever the host is slower than the GPU.",
             "Goals (reported, not asserted): >= 90% of copy at the training shapes; >= 1.2x the best peer; "
             "<= 15 µs host per call at decode; CPU twin >= 3x eager."]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for key in ("fwd_us", "fb_us"):
            notes += common.speedups(rows, shape, key, "ropewkv.rope[", ["eager HF", "torch.compile", "Liger",
                                                                         "flash-attn"])

    def plot(plt, path):
        common.bar_plot(plt, path, rows, "shape", "impl", "fb_pct", "fwd+bwd, % of copy bandwidth",
                        f"RoPE on {env['device']}")
    return session.finish(columns, notes, plot)


if __name__ == "__main__":
    sys.exit(main())
