"""The Triton wkv7 twin (ropewkv.ops.rwkv7.recurrent.wkv7_triton) against the fp64 reference, forward and backward.

Device-agnostic: CUDA tensors on a GPU, CPU tensors under TRITON_INTERPRET=1 here (so the shapes are tiny).
"""
import pytest
import torch

from ropewkv.ops.rwkv7.recurrent import wkv7_triton
from ropewkv.reference import rwkv7 as reference
from ropewkv.testing import poisoned_outputs, rms_ratio, seeded
from ropewkv.testing.rwkv7 import rwkv7_inputs
from conftest import kernel_backends

NAMES = ("r", "w", "k", "v", "a", "b")

# fp32 arithmetic: every output is a sum of N products carried through at most 40 contractive steps, so its rms
# error is a few fp32 roundings (2^-24 = 6e-8) times sqrt(steps); measured <= 4e-7 for all shapes here (1.4e-7 ..
# 2.3e-7 over every decay x dtype x precision at T = 17, seeds 1 and 3). The bound was 2e-6 (5-15x the measurement).
FP32_RMS = 1e-6
# A final rounding to nearest moves each element by at most half an ulp, i.e. 2^-(p+1) relative for p mantissa
# bits, so the rms ratio of a rounded output cannot exceed that (bf16 2^-8, fp16 2^-11), plus the fp32 error.
ROUNDING = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@pytest.fixture(autouse=True)
def _needs_triton(device):
    if "triton" not in kernel_backends(device):
        pytest.skip(f"the triton backend cannot run on {device.type} here")


def _io_tolerance(dtype, precision):
    """Outputs stored in the I/O dtype (y and the input gradients); bf16 mode rounds them to bf16 first."""
    return FP32_RMS + (ROUNDING[torch.bfloat16] if precision == "bf16" else ROUNDING[dtype])


def _inputs(device, batch, seqlen, heads, n, dtype, decay, seed, initial_state):
    return rwkv7_inputs(batch, seqlen, heads, n, dtype, decay, seeded(seed), device, initial_state)


def _run_triton(inputs, decay, precision, cu_seqlens, cotangents):
    """y, final state and every gradient (initial_state's too, when given) from the Triton twin."""
    leaves = [inputs[name].clone().requires_grad_() for name in NAMES]
    s0 = inputs["initial_state"]
    if s0 is not None:
        s0 = s0.clone().requires_grad_()
        leaves.append(s0)
    with poisoned_outputs():
        y, final = wkv7_triton(*leaves[:6], s0, True, cu_seqlens, decay, precision)
        grads = torch.autograd.grad([y, final], leaves, cotangents)
    return [y, final, *grads]


def _run_reference(inputs, decay, precision, cu_seqlens, cotangents):
    """The fp64 oracle on the inputs the kernel computes with: bf16 mode rounds them (grad_y too: every I/O value)
    to bf16 on load."""
    def as_computed(x):
        return (x.to(torch.bfloat16) if precision == "bf16" else x).to(torch.float64)

    leaves = [as_computed(inputs[name]).requires_grad_() for name in NAMES]
    s0 = inputs["initial_state"]
    if s0 is not None:
        s0 = s0.to(torch.float64).requires_grad_()
        leaves.append(s0)
    y, final = reference.wkv7(*leaves[:6], initial_state=s0, output_final_state=True, cu_seqlens=cu_seqlens,
                              decay=decay)
    # With T = 0, y is a constant empty tensor: only the final state carries gradient.
    pairs = [(out, c) for out, c in zip([y, final], [as_computed(cotangents[0]), cotangents[1].to(torch.float64)])
             if out.requires_grad]
    outputs, grad_outputs = zip(*pairs)
    grads = torch.autograd.grad(outputs, leaves, grad_outputs, allow_unused=True, materialize_grads=True)
    return [y, final, *grads]


def _cotangents(inputs, cu_seqlens, seed):
    r = inputs["r"]
    n_seqs = r.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    gen = seeded(seed)
    grad_y = torch.randn(r.shape, generator=gen, dtype=torch.float64).to(r.dtype).to(r.device)
    grad_final = torch.randn((n_seqs, r.shape[2], r.shape[3], r.shape[3]), generator=gen, dtype=torch.float64)
    return [grad_y, grad_final.to(torch.float32).to(r.device)]


def check_against_reference(inputs, decay="loglog", precision="fp32", cu_seqlens=None, seed=0):
    """Assert every output within its tolerance; returns {name: rms ratio}."""
    cotangents = _cotangents(inputs, cu_seqlens, seed)
    outs = _run_triton(inputs, decay, precision, cu_seqlens, cotangents)
    refs = _run_reference(inputs, decay, precision, cu_seqlens, cotangents)
    dtype = inputs["r"].dtype
    names = ["y", "final_state", *(f"d{n}" for n in NAMES), "d_initial_state"][: len(outs)]
    errors = {}
    for name, out, ref in zip(names, outs, refs):
        fp32_state = name in ("final_state", "d_initial_state")
        assert out.dtype == (torch.float32 if fp32_state else dtype), name
        assert out.shape == ref.shape, name
        errors[name] = rms_ratio(out, ref)
        tolerance = FP32_RMS if fp32_state else _io_tolerance(dtype, precision)
        assert errors[name] <= tolerance, f"{name}: rms ratio {errors[name]:.3g} > {tolerance:.3g}"
    return errors


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decay", reference.DECAYS)
def test_decays_dtypes_precisions(device, decay, dtype, precision):
    inputs = _inputs(device, 1, 17, 2, 32, dtype, decay, seed=1, initial_state=True)
    check_against_reference(inputs, decay, precision, seed=2)


@pytest.mark.parametrize("seqlen, initial_state", [(1, False), (15, True), (16, False), (17, True), (40, True)])
def test_sequence_lengths(device, seqlen, initial_state):
    inputs = _inputs(device, 2, seqlen, 1, 32, torch.float32, "loglog", seed=3 + seqlen, initial_state=initial_state)
    check_against_reference(inputs, seed=4)


@pytest.mark.parametrize("n", [64, 128, 256])
def test_head_sizes(device, n):
    inputs = _inputs(device, 1, 5, 1, n, torch.bfloat16, "raw", seed=5, initial_state=True)
    check_against_reference(inputs, "raw", seed=6)


@pytest.mark.parametrize("n, heads, precision", [(128, 2, "fp32"), (256, 1, "bf16")])
def test_state_rows_split_over_programs(device, n, heads, precision):
    """At N >= 128 a forward program holds a few of the state's rows, and at N = 256 a backward program too, its
    key-indexed gradients summed over the blocks afterwards: packed sequences (one empty, one crossing sub-chunks and
    a chunk) and two heads check that every block reads and writes its own rows of its own head and token, and bf16
    mode the sums' final rounding."""
    lengths = [5, 0, 17]
    cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(device)
    inputs = _inputs(device, 1, sum(lengths), heads, n, torch.float32, "loglog", seed=40, initial_state=False)
    inputs["initial_state"] = torch.randn(len(lengths), heads, n, n, generator=seeded(41)).to(device)
    check_against_reference(inputs, "loglog", precision, cu_seqlens=cu_seqlens, seed=42)


@pytest.mark.parametrize("index_dtype, initial_state", [(torch.int32, True), (torch.int64, False)])
def test_varlen_uneven(device, index_dtype, initial_state):
    lengths = [5, 1, 0, 17, 16]  # a length-1 and an empty sequence, chunk boundaries crossed and hit exactly
    cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(index_dtype).to(device)
    inputs = _inputs(device, 1, sum(lengths), 1, 32, torch.float32, "log", seed=7, initial_state=False)
    if initial_state:
        inputs["initial_state"] = torch.randn(len(lengths), 1, 32, 32, generator=seeded(8)).to(device)
    check_against_reference(inputs, "log", cu_seqlens=cu_seqlens, seed=9)


@pytest.mark.parametrize("n, decay, precision", [(32, "loglog", "fp32"), (64, "raw", "bf16")])
def test_decays_staged_per_chunk(device, n, decay, precision):
    """At N <= 64, with sequences of a chunk (16 tokens) or more on average, the forward computes each chunk's decays
    once and every token reads its row back (_wkv7_fwd_kernel, STAGED): packed sequences whose chunks start off the
    16-token grid and end mid-chunk, one of a single token, with initial states."""
    lengths = [17, 30, 1]
    cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(device)
    inputs = _inputs(device, 1, sum(lengths), 2, n, torch.bfloat16, decay, seed=53, initial_state=False)
    inputs["initial_state"] = torch.randn(len(lengths), 2, n, n, generator=seeded(54)).to(device)
    check_against_reference(inputs, decay, precision, cu_seqlens=cu_seqlens, seed=55)


def test_strided_cu_seqlens(device):
    """The kernel reads cu_seqlens through its data pointer: a strided one (each offset followed by garbage) is made
    dense first, not read as [0, 99, 3, 99]."""
    cu_seqlens = torch.tensor([[0, 99], [3, 99], [10, 99], [21, 99]], device=device)[:, 0]
    inputs = _inputs(device, 1, 21, 1, 32, torch.float32, "loglog", seed=50, initial_state=False)
    inputs["initial_state"] = torch.randn(3, 1, 32, 32, generator=seeded(51)).to(device)
    check_against_reference(inputs, cu_seqlens=cu_seqlens, seed=52)


def test_empty_sequence_passes_the_state_through(device):
    inputs = _inputs(device, 2, 0, 1, 32, torch.float32, "loglog", seed=10, initial_state=True)
    errors = check_against_reference(inputs, seed=11)
    assert errors["final_state"] == 0.0 and errors["d_initial_state"] == 0.0
    # bit for bit, the sign of zero included (the forward selects the initial state beside zeros loaded from r)
    s0 = inputs["initial_state"].clone()
    s0[:, :, 0, :2] = torch.tensor([-0.0, 0.0])
    _, final = wkv7_triton(*(inputs[name] for name in NAMES), s0, True, None, "loglog", "fp32")
    assert torch.equal(final.view(torch.int32), s0.view(torch.int32))


def test_state_passing(device):
    """[0:T1] then [T1:T] with the state handed over equals one run over [0:T], gradients included."""
    inputs = _inputs(device, 1, 21, 1, 32, torch.float32, "loglog", seed=12, initial_state=True)
    cotangents = _cotangents(inputs, None, seed=13)
    whole = _run_triton(inputs, "loglog", "fp32", None, cotangents)
    leaves = [inputs[name].clone().requires_grad_() for name in NAMES]
    s0 = inputs["initial_state"].clone().requires_grad_()
    split = 7
    with poisoned_outputs():
        y1, s1 = wkv7_triton(*(x[:, :split] for x in leaves), s0, True, None, "loglog", "fp32")
        y2, s2 = wkv7_triton(*(x[:, split:] for x in leaves), s1, True, None, "loglog", "fp32")
    y = torch.cat([y1, y2], dim=1)
    with poisoned_outputs():
        grads = torch.autograd.grad([y, s2], [*leaves, s0], cotangents)
    # The same fp32 operations in the same order; allow only a few fp32 roundings of reassociation.
    for name, pieced, full in zip(["y", "final_state", *NAMES, "initial_state"], [y, s2, *grads], whole):
        assert rms_ratio(pieced, full) <= 1e-6, name


def test_garbage_in_freed_gradient_buffers(device):
    """A second call must not depend on stale memory: the first call's gradients are overwritten with garbage and
    freed (the caching allocator may hand the memory back), then the second call must reproduce them."""
    inputs = _inputs(device, 1, 18, 1, 32, torch.bfloat16, "raw", seed=14, initial_state=True)
    cotangents = _cotangents(inputs, None, seed=15)
    first = [t.clone() for t in _run_triton(inputs, "raw", "bf16", None, cotangents)]
    garbage = _run_triton(inputs, "raw", "bf16", None, cotangents)
    for t in garbage:
        t.fill_(float("nan"))
    del garbage
    second = _run_triton(inputs, "raw", "bf16", None, cotangents)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_no_grad_forward_matches(device):
    inputs = _inputs(device, 1, 9, 1, 32, torch.float16, "loglog", seed=16, initial_state=True)
    args = [inputs[name] for name in NAMES]
    with torch.no_grad(), poisoned_outputs():
        y, final = wkv7_triton(*args, inputs["initial_state"], True, None, "loglog", "fp32")
        y_only, none = wkv7_triton(*args, inputs["initial_state"], False, None, "loglog", "fp32")
    ref_y, ref_final = reference.wkv7(*args, initial_state=inputs["initial_state"], output_final_state=True)
    assert none is None and torch.equal(y, y_only)
    assert rms_ratio(y, ref_y) <= _io_tolerance(torch.float16, "fp32")
    assert rms_ratio(final, ref_final) <= FP32_RMS


def test_torch_compile_fullgraph(device):
    inputs = _inputs(device, 1, 3, 1, 32, torch.bfloat16, "log", seed=17, initial_state=True)
    leaves = [inputs[name].clone().requires_grad_() for name in NAMES]
    s0 = inputs["initial_state"].clone().requires_grad_()

    def loss(*xs):
        y, final = wkv7_triton(*xs[:6], xs[6], True, None, "log", "bf16")
        return y.float().square().sum() + final.sum()

    compiled = torch.compile(loss, fullgraph=True)
    got = torch.autograd.grad(compiled(*leaves, s0), [*leaves, s0])
    expected = torch.autograd.grad(loss(*leaves, s0), [*leaves, s0])
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_bad_input_is_named(device):
    inputs = _inputs(device, 2, 3, 1, 32, torch.float32, "loglog", seed=18, initial_state=False)
    args = [inputs[name] for name in NAMES]

    def call(*xs, initial_state=None, cu_seqlens=None, decay="loglog", precision="fp32"):
        return wkv7_triton(*xs, initial_state, False, cu_seqlens, decay, precision)

    with pytest.raises(ValueError, match="head size"):
        call(*(x[..., :16].contiguous() for x in args))
    with pytest.raises(ValueError, match="k must match r's shape"):
        call(args[0], args[1], args[2][:, :2], *args[3:])
    with pytest.raises(ValueError, match="v must match r's shape .* and dtype"):
        call(*args[:3], args[3].half(), *args[4:])
    with pytest.raises(TypeError, match="a must have dtype"):
        call(*args[:4], args[4].to(torch.int32), args[5])
    with pytest.raises(ValueError, match="decay must be one of"):
        call(*args, decay="exp")
    with pytest.raises(ValueError, match="precision must be one of"):
        call(*args, precision="tf32")
    with pytest.raises(ValueError, match="B must be 1"):
        call(*args, cu_seqlens=torch.tensor([0, 3], device=device))
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D int32/int64"):
        call(*(x[:1] for x in args), cu_seqlens=torch.tensor([0.0, 3.0], device=device))
    with pytest.raises(ValueError, match=r"initial_state must be fp32 of shape \(2, 1, 32, 32\)"):
        call(*args, initial_state=torch.zeros(1, 1, 32, 32, device=device))
    with pytest.raises(ValueError, match="initial_state must be fp32"):
        call(*args, initial_state=torch.zeros(2, 1, 32, 32, dtype=torch.float64, device=device))


def test_opcheck(device):
    """Schema, fake kernel (incl. the checkpoint buffer's shape for varlen), autograd registration, AOT dispatch."""
    inputs = _inputs(device, 1, 5, 1, 32, torch.float32, "raw", seed=19, initial_state=False)
    args = [inputs[name].requires_grad_() for name in NAMES]
    s0 = torch.randn(2, 1, 32, 32, generator=seeded(20)).to(device).requires_grad_()
    cu_seqlens = torch.tensor([0, 2, 5], device=device)
    torch.library.opcheck(torch.ops.ropewkv.wkv7_triton_fwd.default, (*args, s0, cu_seqlens, "raw", "fp32", True))


def test_decode_step_op_updates_the_state_in_place(device):
    """ropewkv::wkv7_triton_step (wkv7_step on the Triton twin) hands the state to the kernel as its initial and its
    final state at once: it equals the sequence kernel at T = 1 run into separate buffers, bit for bit, in eager and
    under torch.compile (which must keep the declared mutation), and passes opcheck (schema, fake kernel)."""
    inputs = _inputs(device, 2, 1, 2, 32, torch.float32, "raw", seed=21, initial_state=True)
    xs = [inputs[name][:, 0] for name in NAMES]
    s0 = inputs["initial_state"]
    expected_y, expected_state = wkv7_triton(*(x.unsqueeze(1) for x in xs), s0, True, None, "raw", "fp32")
    # the sequence kernel it must equal, against the fp64 oracle (a bug the two share would otherwise pass)
    ref_y, ref_state = reference.wkv7(*(x.unsqueeze(1) for x in xs), initial_state=s0, output_final_state=True,
                                      decay="raw")
    assert rms_ratio(expected_y, ref_y) <= FP32_RMS and rms_ratio(expected_state, ref_state) <= FP32_RMS
    state, compiled_state = s0.clone(), s0.clone()
    with poisoned_outputs():
        y = torch.ops.ropewkv.wkv7_triton_step(*xs, state, "raw", "fp32")
        step = torch.compile(lambda *x: torch.ops.ropewkv.wkv7_triton_step(*x, "raw", "fp32"), fullgraph=True,
                             backend="aot_eager")
        compiled_y = step(*xs, compiled_state)
    assert torch.equal(y, expected_y[:, 0]) and torch.equal(state, expected_state)
    assert torch.equal(compiled_y, y) and torch.equal(compiled_state, state)
    torch.library.opcheck(torch.ops.ropewkv.wkv7_triton_step.default, (*xs, s0.clone(), "raw", "fp32"))
