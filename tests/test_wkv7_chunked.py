"""The chunked WKV7 (ropewkv.wkv7(..., algorithm="chunked"), derivation in python/ropewkv/ops/rwkv7/chunked.md)
against the fp64 reference, the sequential twin and FLA's chunk_rwkv7: forward, final state and every gradient,
the three decay conventions, T not a multiple of the 16-token chunk, varlen, fp64 gradcheck of the CPU twin."""
import math

import pytest
import torch

import ropewkv
from ropewkv.testing import poisoned_outputs, rms_ratio, seeded
from ropewkv.testing import rwkv7 as parity
from conftest import kernel_backends
from fla_cpu import fla  # noqa: F401  (the session fixture)

NAMES = ("r", "w", "k", "v", "a", "b")
# fp32: the chunk's products are sums of <= 16 N terms and each pair decay is one exp of a difference of chunk-local
# log sums; measured 1e-7 .. 4e-7 RMS against fp64 on the shapes below (the sequential twin: 1e-7 .. 3e-7).
FP32_RMS = 2e-6


def _run(backend, inputs, decay, precision, cot_y, cot_s, cu_seqlens=None, algorithm="chunked"):
    leaves = {n: inputs[n].detach().clone().requires_grad_() for n in NAMES}
    s0 = inputs["initial_state"]
    if s0 is not None:
        leaves["initial_state"] = s0.detach().clone().requires_grad_()
    with poisoned_outputs():
        y, state = ropewkv.wkv7(*(leaves[n] for n in NAMES), initial_state=leaves.get("initial_state"),
                                output_final_state=True, cu_seqlens=cu_seqlens, decay=decay, precision=precision,
                                backend=backend, algorithm=algorithm)
        grads = torch.autograd.grad([y, state], list(leaves.values()), [cot_y.to(y.dtype), cot_s])
    return y, state, dict(zip(leaves, grads))


def _check(result, reference, bound, what):
    y, state, grads = result
    ref_y, ref_state, ref_grads = reference
    errors = {"y": rms_ratio(y, ref_y), "final_state": rms_ratio(state, ref_state)}
    errors.update({"d" + n: rms_ratio(grads[n], ref_grads[n]) for n in ref_grads})
    for name, err in errors.items():
        assert err < bound, (what, name, err, errors)
    return errors


CASES = {
    # name: (batch, T, heads, N, cu_seqlens bounds or None, initial state)
    "T37-N32": (2, 37, 1, 32, None, True),
    "T16-N64-no-state": (1, 16, 1, 64, None, False),
    "varlen-N32": (1, 45, 1, 32, [0, 5, 5, 21, 45], True),
}


@pytest.mark.parametrize("decay", ("loglog", "raw", "log"))
@pytest.mark.parametrize("case", CASES)
def test_matches_fp64_reference(device, case, decay):
    batch, seqlen, heads, n, bounds, with_state = CASES[case]
    cu = None if bounds is None else torch.tensor(bounds, device=device)
    n_seqs = batch if cu is None else len(bounds) - 1
    gen = seeded(seqlen + n)
    inputs = parity.rwkv7_inputs(batch, seqlen, heads, n, torch.float32, decay, gen, device, with_state)
    if with_state and cu is not None:
        inputs["initial_state"] = torch.randn(n_seqs, heads, n, n, generator=gen).to(device)
    cot_y, cot_s = parity.cotangents(inputs, n_seqs, gen, device)
    reference = parity.oracle(inputs, decay, cot_y, cot_s, cu_seqlens=cu)
    if not with_state:
        reference[2].pop("initial_state", None)
    for backend in kernel_backends(device):
        if backend == "triton" and n > 32 and device.type == "cpu":
            continue  # the interpreter is slow: N = 32 covers the Triton kernel here
        _check(_run(backend, inputs, decay, "fp32", cot_y, cot_s, cu), reference, FP32_RMS, (backend, case, decay))


def test_decays_that_underflow_get_a_zero_gradient(device):
    """loglog w >= 4.7 gives a decay of 0 in fp32, and w's gradient d dL/dd d(log d)/dw is then 0. The chunked forms
    build dL/d(log d) from cumulative sums, exact only to ~1e-7 of their size, and d(log d)/dw = -e^w (-1e13 at
    w = 30) multiplied that up to ~1e7; they give 0 there, as the sequential forms do."""
    gen = seeded(43)
    inputs = parity.rwkv7_inputs(1, 24, 1, 32, torch.float32, "loglog", gen, device, True)
    inputs["w"][:, 2, :, :3] = 30.0
    inputs["w"][:, 17, :, 5] = 10.0
    cot_y, cot_s = parity.cotangents(inputs, 1, gen, device)
    reference = parity.oracle(inputs, "loglog", cot_y, cot_s)
    for backend in kernel_backends(device):
        result = _run(backend, inputs, "loglog", "fp32", cot_y, cot_s)
        assert (result[2]["w"][:, 2, :, :3] == 0).all() and (result[2]["w"][:, 17, :, 5] == 0).all(), backend
        _check(result, reference, FP32_RMS, backend)


def test_a_vanishing_decay_costs_no_precision(device):
    """A log decay of -100 on a chunk's first row (token 16 of 32: chunks are aligned to the sequence's end) and on
    four keys mid-chunk. Every later pair decay of the chunk is a difference of two cumulative sums that both hold
    the -100: in fp32 their rounding (ulp(100) = 7.6e-6) reached y at 2.3e-6 RMS and the final state at 4.6e-6 in
    the Triton twin, 20-40x the error elsewhere. w's gradient is looser in every chunked twin: its cotangent's
    cumulative sums' rounding times d(log d)/dw = -100 (see test_decays_that_underflow_get_a_zero_gradient)."""
    gen = seeded(7)
    inputs = parity.rwkv7_inputs(1, 32, 1, 32, torch.float32, "loglog", gen, device, True)
    inputs["w"][:, 16] = math.log(100.0)
    inputs["w"][:, 5, :, :4] = math.log(100.0)
    cot_y, cot_s = parity.cotangents(inputs, 1, gen, device)
    reference = parity.oracle(inputs, "loglog", cot_y, cot_s)
    dw_reference = reference[2].pop("w")
    for backend in kernel_backends(device):
        y, state, grads = _run(backend, inputs, "loglog", "fp32", cot_y, cot_s)
        assert rms_ratio(grads.pop("w"), dw_reference) < 5e-5, backend
        _check((y, state, grads), reference, 5e-7, backend)


@pytest.mark.parametrize("precision", ("fp32", "bf16"))
def test_triton_state_columns_split_over_programs(device, monkeypatch, precision):
    """The Triton forward's second kernel with a head's state columns over two programs (VALUE_BLOCK 16 at N = 32;
    the shipped blocks split only at N >= 128, which the interpreter is too slow for): packed sequences of 5, 0 and 19
    tokens (a gap slot, a short and a long last chunk) from initial states, against fp64, forward and backward."""
    if "triton" not in kernel_backends(device):
        pytest.skip(f"the triton backend cannot run on {device.type} here")
    from ropewkv.triton_kernels.rwkv7 import chunked

    monkeypatch.setitem(chunked.VALUE_BLOCK, 32, 16)
    bounds = [0, 5, 5, 24]
    gen = seeded(21)
    inputs = parity.rwkv7_inputs(1, 24, 2, 32, torch.float32, "loglog", gen, device)
    inputs["initial_state"] = torch.randn(3, 2, 32, 32, generator=gen).to(device)
    cu = torch.tensor(bounds, device=device)
    cot_y, cot_s = parity.cotangents(inputs, 3, gen, device)
    oracle_inputs = dict(inputs)
    if precision == "bf16":  # the kernel rounds every input through bf16 on load: so does the oracle's copy
        oracle_inputs.update({n: inputs[n].to(torch.bfloat16).float() for n in NAMES})
    reference = parity.oracle(oracle_inputs, "loglog", cot_y, cot_s, cu_seqlens=cu)
    bound = FP32_RMS if precision == "fp32" else parity.tolerance(torch.float32, "bf16", 24).rms
    _check(_run("triton", inputs, "loglog", precision, cot_y, cot_s, cu), reference, bound, precision)


def test_triton_twin_strided_cu_seqlens(device):
    """wkv7_chunked_triton: its kernels read cu_seqlens through its data pointer, so a strided one (each offset
    followed by garbage) is made dense first, not read as [0, 99, 3, 99]; forward and backward against fp64."""
    if "triton" not in kernel_backends(device):
        pytest.skip(f"the triton backend cannot run on {device.type} here")
    from ropewkv.ops.rwkv7.chunked import wkv7_chunked_triton

    gen = seeded(31)
    inputs = parity.rwkv7_inputs(1, 21, 1, 32, torch.float32, "loglog", gen, device)
    inputs["initial_state"] = torch.randn(3, 1, 32, 32, generator=gen).to(device)
    cu = torch.tensor([[0, 99], [3, 99], [10, 99], [21, 99]], device=device)[:, 0]
    cot_y, cot_s = parity.cotangents(inputs, 3, gen, device)
    reference = parity.oracle(inputs, "loglog", cot_y, cot_s, cu_seqlens=cu)
    leaves = {n: inputs[n].clone().requires_grad_() for n in (*NAMES, "initial_state")}
    with poisoned_outputs():
        y, state = wkv7_chunked_triton(*leaves.values(), True, cu, "loglog", "fp32")
        grads = torch.autograd.grad([y, state], list(leaves.values()), [cot_y, cot_s])
    _check((y, state, dict(zip(leaves, grads))), reference, FP32_RMS, "strided cu_seqlens")


def test_cpu_twin_long_sequence_matches_sequential_and_reference():
    """T = 250 (15 full chunks and a short last one): chunked and sequential CPU twins both near fp64."""
    gen = seeded(7)
    inputs = parity.rwkv7_inputs(1, 250, 1, 64, torch.float32, "raw", gen, "cpu", True)
    cot_y, cot_s = parity.cotangents(inputs, 1, gen)
    reference = parity.oracle(inputs, "raw", cot_y, cot_s)
    chunked = _check(_run("cpu", inputs, "raw", "fp32", cot_y, cot_s), reference, FP32_RMS, "chunked")
    sequential = _check(_run("cpu", inputs, "raw", "fp32", cot_y, cot_s, algorithm="sequential"), reference,
                        FP32_RMS, "sequential")
    assert max(chunked.values()) < 4 * max(sequential.values()) + 1e-7, (chunked, sequential)


@pytest.mark.parametrize("dtype,precision", [(torch.bfloat16, "fp32"), (torch.float16, "fp32"),
                                             (torch.float32, "bf16"), (torch.bfloat16, "bf16")])
def test_low_precision_io(device, dtype, precision):
    """Low-precision I/O and the bf16 mode: within the sequential form's tolerances of the oracle."""
    gen = seeded(3)
    inputs = parity.rwkv7_inputs(1, 40, 2, 32, dtype, "loglog", gen, device, True)
    cot_y, cot_s = parity.cotangents(inputs, 1, gen, device)
    oracle_inputs = dict(inputs)
    if precision == "bf16":  # the kernel rounds every input through bf16 on load: so does the oracle's copy
        oracle_inputs.update({n: inputs[n].to(torch.bfloat16).to(dtype) for n in NAMES})
    reference = parity.oracle(oracle_inputs, "loglog", cot_y, cot_s)
    bound = parity.tolerance(dtype, precision, 40).rms
    for backend in kernel_backends(device):
        y, state, grads = _run(backend, inputs, "loglog", precision, cot_y, cot_s)
        assert y.dtype == dtype and grads["w"].dtype == dtype
        _check((y, state, grads), reference, bound, (backend, dtype, precision))


def test_cpu_twin_fp64_gradcheck():
    """fp64 end to end on the CPU twin: autograd's numerical Jacobian, T = 19 (a full chunk and a short one)."""
    gen = seeded(11)
    x = parity.rwkv7_inputs(1, 19, 1, 32, torch.float64, "raw", gen, "cpu", False)
    s0 = torch.randn(1, 1, 32, 32, dtype=torch.float64, generator=gen)
    leaves = [x[n].clone().requires_grad_() for n in NAMES] + [s0.requires_grad_()]

    def f(*args):
        y, state = ropewkv.wkv7(*args[:6], initial_state=args[6], output_final_state=True, decay="raw",
                                backend="cpu", algorithm="chunked")
        return y, state

    assert torch.autograd.gradcheck(f, leaves, fast_mode=True)


def test_algorithm_argument():
    """"auto" on the cpu twin is the chunked form from CPU_CHUNKED_FROM_TOKENS tokens per sequence (their mean with
    cu_seqlens), the sequential one below."""
    from ropewkv.ops.rwkv7 import api

    x = parity.rwkv7_inputs(1, 8, 1, 32, torch.float32, "loglog", seeded(0), "cpu", False)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        ropewkv.wkv7(*(x[n] for n in NAMES), algorithm="parallel")
    least = api.CPU_CHUNKED_FROM_TOKENS
    for length, bounds, expected in ((least, None, "chunked"), (least - 1, None, "sequential"),
                                     (2 * least, [0, 3, 2 * least], "chunked"),
                                     (2 * least, [0, 1, 3, 2 * least], "sequential")):
        x = parity.rwkv7_inputs(1, length, 1, 32, torch.float32, "loglog", seeded(length), "cpu", False)
        cu = None if bounds is None else torch.tensor(bounds)
        y = {algorithm: ropewkv.wkv7(*(x[n] for n in NAMES), cu_seqlens=cu, backend="cpu", algorithm=algorithm)[0]
             for algorithm in ("auto", "chunked", "sequential")}
        assert not torch.equal(y["chunked"], y["sequential"])  # (so that the next line tells the two apart)
        assert torch.equal(y["auto"], y[expected]), (length, bounds, expected)


def test_chunked_is_routed_on_every_backend():
    """backend="cuda" runs the chunked C++ op too (its CUDA impl: csrc/wkv7/wkv7_chunked_kernels.cuh and
    wkv7_chunked_backward_kernels.cuh, run on the host by test_wkv7_chunked_cuda_on_host.py); "auto" picks it on the
    cpu backend only."""
    from ropewkv.ops.rwkv7 import api

    for backend in ("cpu", "triton", "cuda"):
        assert api._resolve_algorithm("chunked", backend, 1) == "chunked"
        assert api._resolve_algorithm("sequential", backend, 4096) == "sequential"
    assert api._resolve_algorithm("auto", "cpu", 4096) == "chunked"
    assert api._resolve_algorithm("auto", "triton", 4096) == "sequential"
    assert api._resolve_algorithm("auto", "cuda", 4096) == "sequential"


@pytest.mark.parametrize("bounds", [None, [0, 7, 20]])
def test_matches_fla_chunk_rwkv7(fla, device, bounds):
    """Against FLA 0.6.0's own chunk_rwkv7 (interpreted on CPU), in FLA's conventions (log decay, state [N, H, K,
    V]): both sides within their own error of fp64 and within the sum of those errors of each other."""
    import test_compat_fla as fla_harness

    cu = None if bounds is None else torch.tensor(bounds, device=device)
    n_states = 1 if cu is None else len(bounds) - 1
    x, _ = fla_harness.fla_case(1, 20, 2, 32, seed=5, n_states=n_states, device=device)
    cot = fla_harness.cotangents_for(x, n_states, seed=2)
    want = fla_harness.oracle_with_grads(x, 1.0, cot, cu)
    kwargs = dict(output_final_state=True, cu_seqlens=cu)
    theirs = fla_harness.run(fla.ops.chunk_rwkv7, x, kwargs, cot)
    for backend in kernel_backends(device):
        def ours(r, w, k, v, a, b, initial_state, output_final_state, cu_seqlens):
            y, state = ropewkv.wkv7(r, w, k, v, a, b, initial_state=initial_state.transpose(-1, -2),
                                    output_final_state=output_final_state, cu_seqlens=cu_seqlens, decay="log",
                                    backend=backend, algorithm="chunked")
            return y, state.transpose(-1, -2)

        fla_harness.compare(fla_harness.run(ours, x, kwargs, cot), theirs, want, FP32_RMS,
                            fla_harness.FLA_ERROR["default"], backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_invariant_to_left_padding_and_packing(device, dtype):
    """The cpu and triton twins align their chunks to each sequence's end, so neither left padding (frozen tokens)
    nor the tokens packed before a sequence move its tokens in their chunks: its outputs and final state stay the same
    bit for bit, as in the sequential form (with chunks aligned to the packed time axis or to each sequence's start,
    they differed in the last bits). Not the cuda twin: its chunked kernels keep the grid of the sequential
    ops' checkpoints (multiples of 16 in the packed time axis)."""
    heads, n = 2, 32
    for backend in (b for b in kernel_backends(device) if b != "cuda"):
        interpreted = backend == "triton" and device.type == "cpu"
        for length in (3, 21) if interpreted else (1, 3, 16, 21, 40):
            for before in (5, 16) if interpreted else (1, 5, 16, 23):
                x = parity.rwkv7_inputs(1, before + length, heads, n, dtype, "loglog", seeded(length * 100 + before),
                                        device)
                s0 = torch.randn(2, heads, n, n, generator=seeded(before)).to(device)
                alone = ropewkv.wkv7(*(x[name][:, before:] for name in NAMES), initial_state=s0[1:],
                                     output_final_state=True, algorithm="chunked", backend=backend)
                mask = torch.ones(1, before + length, device=device)
                mask[:, :before] = 0
                padded = ropewkv.wkv7(*(x[name] for name in NAMES), initial_state=s0[1:], output_final_state=True,
                                      mask=mask, algorithm="chunked", backend=backend)
                packed = ropewkv.wkv7(*(x[name] for name in NAMES), initial_state=s0, output_final_state=True,
                                      cu_seqlens=torch.tensor([0, before, before + length], device=device),
                                      algorithm="chunked", backend=backend)
                for name, (y, state) in {"padded": padded, "packed": packed}.items():
                    assert torch.equal(y[:, before:], alone[0]), (backend, name, length, before)
                    assert torch.equal(state[-1:], alone[1]), (backend, name, length, before)


def test_cpu_op_passes_opcheck():
    """Schema, fake kernel and autograd registration of the chunked C++ op agree (what torch.compile relies on)."""
    x = parity.rwkv7_inputs(1, 20, 1, 32, torch.float32, "loglog", seeded(0), "cpu", True)
    args = [x[n].requires_grad_() for n in NAMES] + [x["initial_state"].requires_grad_()]
    torch.library.opcheck(torch.ops.ropewkv.wkv7_chunked_forward.default, (*args, None, 0, 0, True))


@pytest.mark.parametrize("n", [8, 24])
def test_cpu_op_rejects_head_size_not_multiple_of_16(n):
    """The C++ op called directly (past api.wkv7's HEAD_SIZES check): a clear ValueError, not an out-of-bounds
    write by the 16-column blocked products."""
    x = parity.rwkv7_inputs(1, 20, 1, n, torch.float32, "loglog", seeded(0), "cpu", False)
    with pytest.raises(ValueError, match="multiple of 16"):
        torch.ops.ropewkv.wkv7_chunked_forward(*(x[name] for name in NAMES), None, None, 0, 0, True)
    gy = torch.zeros_like(x["r"])
    ckpt = torch.zeros(1, 2, 1, n, n)
    with pytest.raises(ValueError, match="multiple of 16"):
        torch.ops.ropewkv.wkv7_chunked_backward(gy, None, *(x[name] for name in NAMES), None, None, ckpt, 0, 0)


@pytest.mark.parametrize("n", [128, 256])
def test_cpu_twin_large_heads(n):
    """N = 128 and 256 (the interpreted Triton cases stop at 64 for time; the CPU twin shares their chunk math)."""
    gen = seeded(n)
    inputs = parity.rwkv7_inputs(1, 20, 1, n, torch.float32, "log", gen, "cpu", True)
    cot_y, cot_s = parity.cotangents(inputs, 1, gen)
    reference = parity.oracle(inputs, "log", cot_y, cot_s)
    _check(_run("cpu", inputs, "log", "fp32", cot_y, cot_s), reference, FP32_RMS, n)


@pytest.mark.parametrize("backward", [False, True])
def test_triton_kernels_refuse_rows_past_32_bit_offsets(backward):
    """The Triton kernels address a chunk's 16 token rows as 32-bit offsets from a 64-bit base: heads * N >= 2^27
    must be a ValueError before any launch (meta tensors: nothing is allocated or run)."""
    from ropewkv.triton_kernels.rwkv7 import chunked

    heads, n = 2**21, 64
    x = torch.empty(1, 16, heads, n, dtype=torch.bfloat16, device="meta")
    state = torch.empty(1, heads, n, n, device="meta")
    checkpoints = torch.empty(chunked.checkpoint_slots(16, 1), heads, n, n, device="meta")
    with pytest.raises(ValueError, match="heads \\* head size must be below"):
        if backward:
            chunked.wkv7_backward(x, x, x, x, x, x, None, checkpoints, x, state, [x] * 6, state, "loglog", False,
                                  False)
        else:
            chunked.wkv7_forward(x, x, x, x, x, x, None, None, x, state, checkpoints, "loglog", False, False)
