"""`python -m ropewkv demo`: swap the fused kernels into a small Llama (HF) and a small RWKV-7 model (trained in fp32
and under bf16 autocast with the decay kept fp32), on the best device present, and report parity against fp64, speed
against the eager code, and the RoPE precision story."""
from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from . import patch
from ._backend import best_device, resolve_backend
from .nn import RWKV7TimeMix
from .ops.rope import apply_rotary_pos_emb, rope
from .ops.rwkv7 import wkv7
from .reference import rope as rope_reference
from .reference import rwkv7 as rwkv7_reference
from .testing import DTYPE_NAMES, MEASUREMENT_COLUMNS, Measurement, Tolerance, measure, seeded
from .testing.hf import model_rotation_error
from .testing.rope import LOW_MATH, rotation_measure, rope_input, tolerance as rope_tolerance
from .testing.rwkv7 import rwkv7_inputs, tolerance as wkv7_tolerance

# Whole-model logits of an fp32 model vs the same model in fp64: every layer's fp32 matmuls and norms (6e-8 each,
# accumulated over a few layers and the softmax): 1e-5 for Llama; the RWKV-7 recurrence and GroupNorm: 1e-4.
MODEL_TOLERANCE = {"llama": Tolerance(None, 1e-5, "fp32 model: a few layers of fp32 rounding"),
                   "rwkv7": Tolerance(None, 1e-4, "fp32 model with the fp32 WKV7 recurrence")}
# The same RWKV-7 model under torch.autocast(bf16): every matmul rounds its operands to bf16 (2^-9), the decay path and
# the WKV7 state stay fp32. Measured on CPU (--quick): 3.0e-3 (logits), 4.6e-3 (gradients); RWKV7TimeMix alone, over
# 24 random draws, up to 9.3e-3 and 2.9e-2 (tests/test_nn_rwkv7.py).
AMP_TOLERANCE = Tolerance(None, 3e-2, "bf16 autocast: bf16 matmul operands, fp32 decay and state")
# Every claim below is about fp32 math, so every call names it: precision=None is the build default, bf16 in a
# ROPEWKV_ACCUM=bf16 build, where the rows labelled fp32 would show bf16 errors (and fail fp32 bounds).
PRECISION = "fp32"


@dataclass
class Sizes:
    batch: int
    seqlen: int
    hidden: int
    heads: int
    kv_heads: int
    layers: int
    rwkv_head: int
    reps: int


def sizes_for(device: torch.device, quick: bool) -> Sizes:
    """Small on CPU (the 3-minute budget on 2 cores), model-like on a GPU."""
    if device.type == "cuda":
        return Sizes(4, 256 if quick else 1024, 1024, 16, 4, 2 if quick else 4, 64, 3 if quick else 10)
    return Sizes(2, 16 if quick else 64, 128, 4, 2, 1 if quick else 2, 32, 2 if quick else 5)


def progress(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Best-of-`reps` wall time of fn() in ms, after one warm-up call (the minimum resists other processes' load)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def hf_apply_rotary_pos_emb():
    """HF's own (unpatched) Llama apply_rotary_pos_emb: the eager code we compare against."""
    from transformers.models.llama import modeling_llama

    return modeling_llama.apply_rotary_pos_emb


# ---- models ------------------------------------------------------------------------------------------------------


def llama(s: Sizes, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=s.hidden, intermediate_size=2 * s.hidden,
                         num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                         max_position_embeddings=4 * s.seqlen, attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device)


class ChannelMix(nn.Module):
    """RWKV's channel mix (token shift, squared-ReLU MLP), as in RWKV-LM's demo FFN."""

    def __init__(self, hidden: int):
        super().__init__()
        self.x_k = nn.Parameter(torch.full((1, 1, hidden), 0.5))
        self.key = nn.Linear(hidden, 4 * hidden, bias=False)
        self.value = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x):
        shifted = nn.functional.pad(x, (0, 0, 1, -1))
        return self.value(torch.relu(self.key(x + (shifted - x) * self.x_k)) ** 2)


class RWKV7Model(nn.Module):
    """Embedding, n x (LayerNorm + RWKV7TimeMix, LayerNorm + ChannelMix), LayerNorm, head."""

    def __init__(self, vocab: int, hidden: int, head_size: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(2 * layers + 1))
        self.time_mix = nn.ModuleList(RWKV7TimeMix(hidden, head_size, i, layers, precision=PRECISION)
                                      for i in range(layers))
        self.channel_mix = nn.ModuleList(ChannelMix(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():  # trained-like weights: RWKV-LM initialises LoRAs and output projections to zero
            for name, p in self.time_mix.named_parameters():
                if name.endswith(("1", "2", "output.weight")):
                    p.normal_(0, 0.5 / hidden**0.5)

    def set_backend(self, backend: str) -> None:
        for block in self.time_mix:
            block.backend = backend

    def forward(self, ids):
        x, v_first = self.embed(ids), None
        for i, (tmix, cmix) in enumerate(zip(self.time_mix, self.channel_mix)):
            out, v_first = tmix(self.norms[2 * i](x), v_first)
            x = x + out
            x = x + cmix(self.norms[2 * i + 1](x))
        return self.head(self.norms[-1](x))


def training_step(model, ids, autocast: bool = False):
    """One training step (loss: the mean square of the logits), under bf16 autocast if asked: the logits and every
    parameter gradient, flattened into one vector."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(ids)
    logits = getattr(logits, "logits", logits)
    logits.float().square().mean().backward()
    return logits.detach(), torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])


# ---- parity ------------------------------------------------------------------------------------------------------


def rope_rows(s: Sizes, device, backend: str):
    """apply_rotary_pos_emb on Llama-shaped q/k with HF's cos/sin tables, ours and HF eager, vs fp64."""
    rows = []
    head_dim = s.hidden // s.heads
    positions = torch.arange(s.seqlen, device=device).expand(s.batch, -1)
    inv_freq = rope_reference.default_inv_freq(head_dim).to(device)
    for dtype in (torch.float32, torch.bfloat16):
        gen = seeded(1)
        q = rope_input(s.batch, s.seqlen, s.heads, head_dim, dtype, "bhsd", gen, device)
        k = rope_input(s.batch, s.seqlen, s.kv_heads, head_dim, dtype, "bhsd", gen, device)
        freqs = positions[..., None].float() * inv_freq  # HF's table: fp32 angle, cos/sin cast to the model dtype
        cos, sin = (torch.cat((f, f), -1).to(dtype) for f in (freqs.cos(), freqs.sin()))
        want = rope_reference.hf_apply_rotary_pos_emb(*(t.double() for t in (q, k, cos, sin)))
        hf = hf_apply_rotary_pos_emb()(q, k, cos, sin)
        ours = apply_rotary_pos_emb(q, k, cos, sin, backend=backend, precision=PRECISION)
        for who, got, tol in (("ours", ours, rope_tolerance(dtype, PRECISION, backend, device)),
                              ("HF eager", hf, LOW_MATH.get(dtype, rope_tolerance(dtype, "fp32", backend, device)))):
            rows.append(rotation_measure(f"apply_rotary_pos_emb q ({who})", backend if who == "ours" else "eager",
                                         PRECISION if who == "ours" else DTYPE_NAMES[dtype], got[0], want[0], tol,
                                         head_dim, False))
    return rows


def wkv7_rows(s: Sizes, device, backend: str):
    rows = []
    heads = s.hidden // s.rwkv_head
    for dtype in (torch.float32, torch.bfloat16):
        x = rwkv7_inputs(s.batch, s.seqlen, heads, s.rwkv_head, dtype, "raw", seeded(2), device, initial_state=True)
        args = [x[n] for n in "rwkvab"]
        y, state = wkv7(*args, initial_state=x["initial_state"], output_final_state=True, decay="raw",
                        precision=PRECISION, backend=backend)
        y64, state64 = rwkv7_reference.wkv7(*args, initial_state=x["initial_state"], output_final_state=True,
                                            decay="raw")
        tol = wkv7_tolerance(dtype, PRECISION, s.seqlen)
        rows.append(measure("wkv7 y", backend, PRECISION, y, y64, tol))
        rows.append(measure("wkv7 final state", backend, PRECISION, state, state64, tol, dtype))
        y, state = wkv7(*args, initial_state=x["initial_state"], output_final_state=True, decay="raw",
                        precision=PRECISION, backend=backend, algorithm="chunked")
        rows.append(measure("wkv7 y (chunked)", backend, PRECISION, y, y64, tol))
        rows.append(measure("wkv7 final state (chunked)", backend, PRECISION, state, state64, tol, dtype))
    return rows


# ---- the RoPE precision story --------------------------------------------------------------------------------------


def rope_error_vs_position(device, head_dim: int = 128, per_octave: int = 3):
    """Max |error| of the rotated unit pair (i.e. of cos and sin of position * inv_freq) over all frequencies, at
    positions 2^x - 1 for x = 1 .. 20 (not powers of two, whose products with inv_freq are exact): ours (in-kernel
    angle), HF fp32 eager (fp32 angle and cos/sin), HF with a bf16 cos/sin cache."""
    exponents = torch.linspace(1, 20, 19 * per_octave + 1, dtype=torch.float64)
    positions = torch.unique((2.0**exponents).round().to(torch.int64) - 1)
    inv_freq = rope_reference.default_inv_freq(head_dim)
    exact_cos, exact_sin = rope_reference.cos_sin(positions, inv_freq, dtype=torch.float64)
    unit = torch.zeros(1, len(positions), 1, head_dim)
    unit[..., : head_dim // 2] = 1.0  # pair (1, 0) rotates to (cos, sin)
    ours = rope(unit.to(device), inv_freq=inv_freq.to(device), positions=positions.view(1, -1).to(device),
                precision=PRECISION).cpu()
    angle32 = positions.float()[:, None] * inv_freq
    curves = {"ropewkv (fp32, in-kernel angle)": (ours[0, :, 0, : head_dim // 2], ours[0, :, 0, head_dim // 2:]),
              "HF eager fp32": (angle32.cos(), angle32.sin()),
              "HF bf16 cos/sin cache": (angle32.cos().bfloat16(), angle32.sin().bfloat16())}
    return positions, {name: torch.maximum((c.double() - exact_cos).abs().amax(-1),
                                           (s.double() - exact_sin).abs().amax(-1))
                       for name, (c, s) in curves.items()}


def patched_model_story(model, ids, device) -> str:
    """The rotated q and k inside the bf16 Llama at positions 2^20 - S .. 2^20 - 1, against the exact rotation of what
    attention handed RoPE: HF eager, ropewkv.patch.transformers at precision="fp32" (exact fp32 tables, the default of
    an fp32 build) and its bit-equal-to-HF precision="bf16" mode."""
    model = copy.deepcopy(model).to(torch.bfloat16)
    seqlen = ids.shape[1]
    position_ids = (2**20 - seqlen + torch.arange(seqlen, device=device)).expand(ids.shape[0], seqlen)
    rows = [("HF eager (fp32 angle, bf16 cos/sin, bf16 math)", model_rotation_error(model, ids, position_ids))]
    with patch.transformers(model, precision=PRECISION):
        rows.append(('ropewkv.patch.transformers(precision="fp32"): exact fp32 tables',
                     model_rotation_error(model, ids, position_ids)))
    with patch.transformers(model, precision="bf16"):
        rows.append(('ropewkv.patch.transformers(precision="bf16"), bit-equal to HF',
                     model_rotation_error(model, ids, position_ids)))
    return markdown_table(("bf16 Llama, positions near 2^20", "max error of rotated q, k (bf16 ulp at the pair norm)"),
                          [(name, f"{err:.2f}") for name, err in rows])


def plot(positions, errors, path: Path) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, err in errors.items():
        ax.loglog(positions.numpy(), err.clamp_min(1e-12).numpy(), marker=".", label=name)
    ax.set_xlabel("position")
    ax.set_ylabel("max |error| of cos, sin (vs fp64)")
    ax.set_title("RoPE error vs position (head dim 128, base 1e4)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- report ------------------------------------------------------------------------------------------------------


def markdown_table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def parity_table(rows: list[Measurement]) -> str:
    return markdown_table(MEASUREMENT_COLUMNS, [m.cells() for m in rows])


def main(device: Optional[str] = None, quick: bool = False, out: Optional[str] = None) -> int:
    """Run the demo; print the tables; write demo-report.md (and demo-rope-error.png) to `out` (default: cwd).
    Returns the exit code: 1 if any parity row fails."""
    dev = best_device(device)
    backend = resolve_backend("auto", dev)
    s = sizes_for(dev, quick)
    out_dir = Path(out or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    progress(f"device {dev}, backend {backend}; parity of the ops against fp64")
    rows = rope_rows(s, dev, backend) + wkv7_rows(s, dev, backend)

    progress(f"Llama ({s.layers} layers, hidden {s.hidden}, GQA {s.heads}/{s.kv_heads}), HF eager vs patched")
    model = llama(s, dev)
    ids = torch.randint(0, 256, (s.batch, s.seqlen), generator=seeded(3)).to(dev)
    with torch.no_grad():
        want = copy.deepcopy(model).double()(ids).logits
        eager_logits = model(ids).logits
        with patch.transformers(model, precision=PRECISION):
            patched_logits = model(ids).logits
    rows.append(measure("Llama logits (HF eager)", "eager", "fp32", eager_logits, want, MODEL_TOLERANCE["llama"]))
    rows.append(measure("Llama logits (patched)", backend, PRECISION, patched_logits, want, MODEL_TOLERANCE["llama"]))

    progress(f"RWKV-7 ({s.layers} layers, hidden {s.hidden}, head {s.rwkv_head}): a training step in fp32 and in "
             "bf16 autocast (the decay in fp32), against fp64")
    torch.manual_seed(0)
    rwkv = RWKV7Model(256, s.hidden, s.rwkv_head, s.layers).to(dev)
    reference_model = copy.deepcopy(rwkv).double()
    reference_model.set_backend("reference")
    want_logits, want_grads = training_step(reference_model, ids)
    for label, autocast, tol in (("fused", False, MODEL_TOLERANCE["rwkv7"]),
                                 ("fused, bf16 autocast", True, AMP_TOLERANCE)):
        logits, grads = training_step(rwkv, ids, autocast)
        rows.append(measure(f"RWKV-7 logits ({label})", backend, PRECISION, logits, want_logits, tol))
        rows.append(measure(f"RWKV-7 gradients ({label})", backend, PRECISION, grads, want_grads, tol,
                            dtype=logits.dtype))

    progress("timing (best of several runs)")
    speed = []
    head_dim = s.hidden // s.heads
    q = torch.randn(s.batch, s.heads, s.seqlen, head_dim, device=dev)
    k = torch.randn(s.batch, s.kv_heads, s.seqlen, head_dim, device=dev)
    cos, sin = (torch.randn(s.batch, s.seqlen, head_dim, device=dev) for _ in range(2))
    hf_rope = hf_apply_rotary_pos_emb()
    speed.append(("apply_rotary_pos_emb fwd", timed(lambda: hf_rope(q, k, cos, sin), dev, s.reps * 10),
                  timed(lambda: apply_rotary_pos_emb(q, k, cos, sin, backend=backend, precision=PRECISION), dev,
                        s.reps * 10)))
    x = rwkv7_inputs(s.batch, s.seqlen, s.hidden // s.rwkv_head, s.rwkv_head, torch.float32, "raw", seeded(4), dev)
    args = [x[n] for n in "rwkvab"]
    eager_ms = timed(lambda: wkv7(*args, decay="raw", precision=PRECISION, backend="reference"), dev, s.reps)
    speed.append(("wkv7 fwd", eager_ms, timed(lambda: wkv7(*args, decay="raw", precision=PRECISION, backend=backend),
                                              dev, s.reps)))
    speed.append(("wkv7 fwd (chunked)", eager_ms, timed(
        lambda: wkv7(*args, decay="raw", precision=PRECISION, backend=backend, algorithm="chunked"), dev, s.reps)))
    eager_ms = timed(lambda: training_step(model, ids), dev, s.reps)
    with patch.transformers(model, precision=PRECISION):
        speed.append(("Llama fwd+bwd", eager_ms, timed(lambda: training_step(model, ids), dev, s.reps)))
    rwkv.set_backend("reference")
    eager_ms = timed(lambda: training_step(rwkv, ids), dev, s.reps)
    rwkv.set_backend(backend)
    speed.append(("RWKV-7 fwd+bwd", eager_ms, timed(lambda: training_step(rwkv, ids), dev, s.reps)))
    speed_table = markdown_table(("what", "eager ms", "ropewkv ms", "speed-up", "backend"),
                                 [(name, f"{e:.3g}", f"{o:.3g}", f"{e / o:.2f}x", backend) for name, e, o in speed])

    progress("RoPE error vs position up to 2^20")
    positions, errors = rope_error_vs_position(dev)
    story = markdown_table(("position", *errors), [
        (int(p), *(f"{float(err[i]):.2e}" for err in errors.values()))
        for i, p in enumerate(positions) if int(p) in (15, 1023, 32767, 2**20 - 1)])
    png = plot(positions, errors, out_dir / "demo-rope-error.png")
    progress("RoPE inside the patched bf16 Llama at positions near 2^20")
    in_model = patched_model_story(model, ids, dev)

    failed = [m for m in rows if not m.passed]
    sizes = (f"batch {s.batch}, sequence {s.seqlen}, hidden {s.hidden}, {s.layers} layer(s)")
    report = "\n\n".join([
        f"# ropewkv demo on {dev} (backend {backend}; {sizes})",
        "## Parity against fp64\n\n" + parity_table(rows),
        "## Speed (best-of-n wall time)\n\n" + speed_table,
        "## RoPE: max error of cos/sin vs position\n\n" + story
        + (f"\n\n![RoPE error vs position]({png.name})" if png else "\n\n(matplotlib not installed: no plot)"),
        "## RoPE inside a patched model\n\n" + in_model,
        f"{len(rows) - len(failed)} parity rows passed, {len(failed)} failed; "
        f"{time.perf_counter() - started:.1f} s.",
    ]) + "\n"
    print(report)
    (out_dir / "demo-report.md").write_text(report)
    progress(f"wrote {out_dir / 'demo-report.md'}" + (f" and {png}" if png else ""))
    return 1 if failed else 0
