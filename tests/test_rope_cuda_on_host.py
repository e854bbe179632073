"""The CUDA RoPE kernel (csrc/rope/rope_kernel.cuh) run on the host, every thread of every block one after another,
against the CPU twin, bit for bit. CUDA cannot run here; this runs the kernel's own code: its thread map, head batches
and software pipeline, vector and element-wise paths, copy of the dims past rotary_dim.

g++ compiles the kernel header as it is, with the real ropewkv/cuda_common.cuh and host stand-ins for the CUDA pieces
they use (tests/data/host_cuda/cuda_prelude.h: __device__ and the thread indices, __isGlobal and __builtin_assume as
no-ops, the bit casts), built by tests/host_cuda.py with AddressSanitizer/UBSan on (an access past a buffer, or a
misaligned uint4, stops the run). Not covered: the device-only paths: the host compile of ropewkv/precision.h takes
the software round-to-nearest-even conversions, which equal the device's cvt.rn instructions for every value except
NaN payloads (none here: the inputs are finite), and Run::store's st.global.v4 is a plain uint4 store on the host.

Outputs start NaN-filled (out of place), so an element the kernel never writes fails; their padding and the input
buffers must come back untouched. Both precisions are bit-identical to the CPU twin: the twins share the math headers
(ropewkv/rope.h, ropewkv/precision.h) and both compile with -ffp-contract=off.
"""
import itertools
import os
import random
import subprocess

import pytest
import torch

import ropewkv  # noqa: F401  (registers torch.ops.ropewkv)
from host_cuda import ROOT, build_driver

DTYPES = {"fp32": (0, torch.float32, torch.int32), "bf16": (1, torch.bfloat16, torch.int16),
          "fp16": (2, torch.float16, torch.int16)}
PRECISIONS = {"fp32": 0, "bf16": 1}

# Shapes (small: every thread runs sequentially). groups: the head groups asked of the thread map (0: rope_launch's
# own map); 1 gives a thread all its token's heads, so that odd head counts leave lead heads before whole batches.
# vector: whether the 16-byte path is expected (the kernel's VECTOR instantiation).
CASES = [
    dict(name="gqa_batches", batch=2, seqlen=3, hq=13, hk=7, head_dim=64, rotary_dim=64, groups=1, offsets=True,
         vector=True),
    dict(name="q_only_partial_conjugate", batch=1, seqlen=4, hq=6, hk=None, head_dim=80, rotary_dim=32, groups=1,
         conjugate=True, vector=True),
    dict(name="decode_launch_map", batch=1, seqlen=1, hq=7, hk=3, head_dim=64, rotary_dim=64, groups=0, offsets=True,
         vector=True, expect_groups=7),
    dict(name="decode_two_groups", batch=1, seqlen=1, hq=9, hk=3, head_dim=128, rotary_dim=128, groups=2,
         offsets=True, vector=True),
    dict(name="padded_partial_scaled", batch=2, seqlen=2, hq=3, hk=5, head_dim=96, rotary_dim=64, head_pad=16,
         groups=3, attention_scaling=0.75, vector=True),
    dict(name="misaligned_padded_elementwise", batch=2, seqlen=2, hq=5, hk=1, head_dim=64, rotary_dim=48, head_pad=3,
         offset=1, groups=1, offsets=True, vector=False),
]


@pytest.fixture(scope="session")
def driver(tmp_path_factory) -> str:
    exe = str(tmp_path_factory.mktemp("rope_cuda_on_host") / "driver")
    return build_driver("rope_cuda_on_host.cpp", exe, [os.path.join(ROOT, "csrc", "rope")])


def _buffer(gen, dtype, offset, shape, head_dim, scale):
    """A flat buffer holding a [B, S, H, head_dim] view at element `offset`, its heads padded to shape[-1]."""
    numel = offset + shape[0] * shape[1] * shape[2] * shape[3]
    buf = (torch.randn(numel, generator=gen) * scale).to(dtype)
    return buf, buf[offset:].view(shape)[..., :head_dim]


def _read(path, int_dtype):
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=int_dtype)


def _first_mismatch(got, want):
    index = tuple(int(i) for i in (got != want).nonzero()[0])
    return f"{int((got != want).sum())} of {got.numel()} differ, first at {index}: {int(got[index]):#x} != " \
           f"{int(want[index]):#x}"


@pytest.mark.parametrize("dtype,precision,interleaved,in_place",
                         list(itertools.product(DTYPES, PRECISIONS, (False, True), (False, True))))
def test_cuda_kernel_on_host_matches_cpu_twin(driver, tmp_path, dtype, precision, interleaved, in_place):
    code, torch_dtype, int_dtype = DTYPES[dtype]
    seed = random.SystemRandom().randrange(2 ** 31)
    gen = torch.Generator().manual_seed(seed)
    dirs, inputs = [], []
    for case in CASES:
        c = dict(hk=None, offsets=False, conjugate=False, head_pad=0, offset=0, attention_scaling=1.0) | case
        d = tmp_path / c["name"]
        d.mkdir()
        head_stride = c["head_dim"] + c["head_pad"]
        tensors = {}
        for name, heads, scale in (("q", c["hq"], 2.0), ("k", c["hk"], 4.0)):
            if heads is None:
                continue
            shape = (c["batch"], c["seqlen"], heads, head_stride)
            tensors[name] = _buffer(gen, torch_dtype, c["offset"], shape, c["head_dim"], scale)
            tensors[name][0].view(int_dtype).numpy().tofile(d / f"{name}.bin")
        inv_freq = 10000.0 ** (-torch.arange(0, c["rotary_dim"], 2, dtype=torch.float64) / c["rotary_dim"])
        inv_freq = inv_freq.float()
        inv_freq.numpy().tofile(d / "inv_freq.bin")
        offsets = torch.randint(0, 50000, (c["batch"],), generator=gen) if c["offsets"] else None
        if offsets is not None:
            offsets.numpy().tofile(d / "offsets.bin")
        fields = (code, PRECISIONS[precision], int(interleaved), int(c["conjugate"]), int(in_place),
                  int(c["hk"] is not None), int(c["offsets"]), c["batch"], c["seqlen"], c["hq"], c["hk"] or 0,
                  c["head_dim"], c["rotary_dim"] // 2, head_stride, c["offset"], c["groups"], c["attention_scaling"])
        (d / "case.txt").write_text(" ".join(str(f) for f in fields) + "\n")
        q_view = tensors["q"][1]
        k_view = tensors["k"][1] if "k" in tensors else None
        want = torch.ops.ropewkv.rope(q_view, k_view, inv_freq, None, offsets, None, interleaved, c["conjugate"],
                                      c["attention_scaling"], PRECISIONS[precision], None, False)
        dirs.append(d)
        inputs.append((c, tensors, want))
    run = subprocess.run([driver, *map(str, dirs)], capture_output=True, text=True)
    assert run.returncode == 0, f"seed {seed}: {run.stderr[-4000:]}"

    for d, (c, tensors, want) in zip(dirs, inputs):
        where = f"{c['name']} (seed {seed})"
        vec, groups, threads = (int(v) for v in (d / "plan.txt").read_text().split())
        assert (vec > 0) == c["vector"], f"{where}: vector width {vec}"
        heads = max(c["hq"], c["hk"] or 0)
        assert groups == c.get("expect_groups", min(c["groups"], heads)), f"{where}: {groups} head groups"
        assert threads > 0
        for name, out in zip(("q", "k"), want):
            before = tensors[name][0].view(int_dtype)
            got = _read(d / f"{name}_out.bin", int_dtype)
            after = _read(d / f"{name}_after.bin", int_dtype)
            shape = tensors[name][1].shape[:3] + (c["head_dim"] + c["head_pad"],)
            got_heads = got[c["offset"]:].view(shape)
            want_bits = out.view(int_dtype)
            assert torch.equal(got_heads[..., :c["head_dim"]], want_bits), \
                f"{where} {name}: {_first_mismatch(got_heads[..., :c['head_dim']], want_bits)}"
            # Untouched: the padding past head_dim and the elements before the tensor (NaN out of place, the input in
            # place), and the input itself out of place.
            untouched = before if in_place else torch.full_like(before, -1)
            assert torch.equal(got[:c["offset"]], untouched[:c["offset"]]), f"{where} {name}: wrote before the tensor"
            pad = untouched[c["offset"]:].view(shape)[..., c["head_dim"]:]
            assert torch.equal(got_heads[..., c["head_dim"]:], pad), f"{where} {name}: wrote into the head padding"
            if not in_place:
                assert torch.equal(after, before), f"{where} {name}: the input changed"
