"""GPU edge shapes for the CUDA and Triton twins (run by benchmarks/gpu_checks.sh; skipped without a GPU).

- RoPE head dims 72 and 160 (not powers of two), interleaved and NeoX, partial rotary;
- WKV7 with T not a multiple of any chunk (checkpoints every 16 tokens, Triton CHUNK 16, any block), sequential and
  (CUDA) chunked;
- B*H larger than SMs * 32 (grids past one wave, for RoPE, wkv7 sequential and chunked, and wkv7_step);
- tensors past 2^31 elements ("huge": int64 indexing), built as copies of one small block so that every block's
  output must equal the small block's, bit for bit, and match the fp64 oracle.
The past_2_31 tests need ~35 GB of GPU memory and are left out of the sanitizer runs.
"""
import pytest
import torch

from ropewkv.ops.rope import rope
from ropewkv.ops.rwkv7 import wkv7, wkv7_step
from ropewkv.reference import rwkv7 as rwkv7_ref
from ropewkv.testing import assert_within, poisoned_outputs, rms_ratio, seeded
from ropewkv.testing import rope as rp
from ropewkv.testing.rwkv7 import rwkv7_inputs
from conftest import kernel_backends

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU edge cases: no CUDA device here")
DEV = torch.device("cuda")
BACKENDS = ["cuda", "triton"]
# The WKV7 kernels the edge shapes run: both twins' sequential ones and the CUDA chunked ones (the Triton chunked
# kernels' JIT would take most of the step's budget).
WKV7_KERNELS = [("cuda", "sequential"), ("triton", "sequential"), ("cuda", "chunked")]
NAMES = ("r", "w", "k", "v", "a", "b")
# As in tests/test_fuzz.py: fp32 arithmetic over <= ~100 contractive steps is a few fp32 roundings times sqrt(steps);
# a final bf16 rounding adds at most 2^-9 relative (2^-8 here, generous).
FP32_RMS, BF16_RMS = 4e-6, 2.0**-8 + 4e-6


def _backend(name):
    if name not in kernel_backends(DEV):
        pytest.fail(f"backend {name} unavailable on the GPU machine (the build should provide it)")
    return name


def _sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


def _check_rope(q, out, inv, positions, interleaved, backend, dtype):
    ref = rp.rope_reference64(q, inv, positions, interleaved=interleaved)
    tol = rp.tolerance(dtype, "fp32", backend, DEV)
    assert_within(rp.rotation_measure("rope edge", backend, "fp32", out, ref, tol, 2 * inv.numel(), interleaved))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim,rotary_dim", [(72, 72), (72, 40), (160, 160), (160, 96)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_odd_head_dims(backend, head_dim, rotary_dim, interleaved):
    q = rp.rope_input(3, 37, 5, head_dim, torch.bfloat16, "bshd", seeded(1), DEV)
    inv = rp.rope_inv_freq(rotary_dim, device=DEV)
    with poisoned_outputs():
        out = rope(q, inv_freq=inv, interleaved=interleaved, seqlen_offsets=70000, backend=_backend(backend))
    _check_rope(q, out, inv, rp.reference_positions(3, 37, None, 70000), interleaved, backend, torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_more_heads_than_sms_x32(backend):
    heads = _sms() * 32 + 7
    q = rp.rope_input(1, 3, heads, 64, torch.float16, "bhsd", seeded(2), DEV)
    inv = rp.rope_inv_freq(64, device=DEV)
    with poisoned_outputs():
        out = rope(q, inv_freq=inv, layout="bhsd", backend=_backend(backend))
    ref = rp.rope_reference64(q, inv, rp.reference_positions(1, 3), layout="bhsd")
    tol = rp.tolerance(torch.float16, "fp32", backend, DEV)
    assert_within(rp.rotation_measure("rope B*H>SMs*32", backend, "fp32", out, ref, tol, 64, False))


def _wkv7_check(inputs, backend, seqlen_note, with_grad=True, algorithm="auto"):
    leaves = [inputs[n].clone().requires_grad_(with_grad) for n in NAMES]
    s0 = inputs["initial_state"]
    with poisoned_outputs():
        y, final = wkv7(*leaves, initial_state=s0, output_final_state=True, backend=_backend(backend),
                        algorithm=algorithm)
        grads = torch.autograd.grad((y, final), leaves, (y.detach(), final.detach())) if with_grad else []
    ref_leaves = [inputs[n].double().requires_grad_(with_grad) for n in NAMES]
    y_ref, final_ref = rwkv7_ref.wkv7(*ref_leaves, initial_state=None if s0 is None else s0.double(),
                                      output_final_state=True)
    ref_grads = torch.autograd.grad((y_ref, final_ref), ref_leaves, (y.detach().double(), final.detach().double())) \
        if with_grad else []
    for name, out, ref in zip(["y", "final"] + [f"d{n}" for n in NAMES], [y, final, *grads],
                              [y_ref, final_ref, *ref_grads]):
        tol = FP32_RMS if name == "final" or out.dtype == torch.float32 else BF16_RMS
        assert rms_ratio(out, ref) <= tol, \
            f"{backend} {algorithm} {seqlen_note} {name}: {rms_ratio(out, ref):.3g} > {tol}"


@pytest.mark.parametrize("backend, algorithm", WKV7_KERNELS)
@pytest.mark.parametrize("seqlen", [1, 15, 17, 67, 127])
def test_wkv7_t_not_a_multiple_of_any_chunk(backend, seqlen, algorithm):
    _wkv7_check(rwkv7_inputs(2, seqlen, 3, 64, torch.bfloat16, "loglog", seeded(3), DEV, initial_state=True),
                backend, f"T={seqlen}", algorithm=algorithm)


@pytest.mark.parametrize("backend, algorithm", WKV7_KERNELS)
def test_wkv7_inputs_one_element_off_alignment(backend, algorithm):
    """r..b as contiguous views one element past their allocation's start: the CUDA chunked kernels load 4 values per
    access, and the glue gives such views aligned copies. Outputs and gradients equal the aligned inputs', bit for
    bit."""
    inputs = rwkv7_inputs(1, 37, 2, 64, torch.bfloat16, "loglog", seeded(5), DEV, initial_state=True)

    def run(tensors):
        leaves = [x.detach().requires_grad_() for x in tensors]
        with poisoned_outputs():
            y, final = wkv7(*leaves, initial_state=inputs["initial_state"], output_final_state=True,
                            backend=_backend(backend), algorithm=algorithm)
            return (y, final, *torch.autograd.grad((y, final), leaves, (torch.ones_like(y), torch.ones_like(final))))

    def off_by_one(x):
        view = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view_as(x)
        return view.copy_(x)

    shifted = [off_by_one(inputs[n]) for n in NAMES]
    assert all(x.storage_offset() == 1 and x.is_contiguous() for x in shifted)
    for name, got, want in zip(["y", "final"] + [f"d{n}" for n in NAMES], run(shifted),
                               run([inputs[n] for n in NAMES])):
        assert torch.equal(got, want), f"{backend} {algorithm} {name}: differs with inputs off alignment"


@pytest.mark.parametrize("backend, algorithm", WKV7_KERNELS)
def test_wkv7_more_heads_than_sms_x32(backend, algorithm):
    heads = _sms() * 32 + 3
    inputs = rwkv7_inputs(1, 3, heads, 32, torch.float32, "raw", seeded(4), DEV, initial_state=True)
    _wkv7_check(inputs, backend, f"H={heads}", algorithm=algorithm)
    state = inputs["initial_state"].clone()
    y = wkv7_step(*(inputs[n][:, 0] for n in NAMES), state, decay="raw", backend=backend)
    y_ref, s_ref = rwkv7_ref.wkv7_step(*(inputs[n][:, 0].double() for n in NAMES), inputs["initial_state"].double(),
                                       "raw")
    assert rms_ratio(y, y_ref) <= FP32_RMS and rms_ratio(state, s_ref) <= FP32_RMS


def _huge_copies(small: torch.Tensor, elements_past: int = 2**31) -> torch.Tensor:
    """small [1, ...] repeated along dim 0 into a contiguous tensor of more than `elements_past` elements."""
    copies = elements_past // small.numel() + 1
    return small.expand(copies, *small.shape[1:]).contiguous()


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_past_2_31_elements(backend):
    small = rp.rope_input(1, 64, 8, 128, torch.bfloat16, "bshd", seeded(5), DEV)
    q = _huge_copies(small)
    assert q.numel() > 2**31
    inv = rp.rope_inv_freq(128, device=DEV)
    out = rope(q, inv_freq=inv, interleaved=True, backend=_backend(backend))
    assert torch.equal(out[-1], out[0])  # the same input block gives the same bits, also past 2^31
    _check_rope(small, out[-1:], inv, rp.reference_positions(1, 64), True, backend, torch.bfloat16)
    del q, out
    torch.cuda.empty_cache()


@pytest.mark.parametrize("backend", BACKENDS)
def test_wkv7_past_2_31_elements(backend):
    # T = 1024 >= N keeps the state (B*H*N*N) smaller than the inputs (B*T*H*N): 6 x 4.3 GB bf16 inputs.
    small = rwkv7_inputs(1, 1024, 1, 64, torch.bfloat16, "loglog", seeded(6), DEV)
    big = [_huge_copies(small[n]) for n in NAMES]
    assert big[0].numel() > 2**31
    with torch.no_grad():
        y, final = wkv7(*big, output_final_state=True, backend=_backend(backend))
    assert torch.equal(y[-1], y[0]) and torch.equal(final[-1], final[0])
    del big
    y_ref, final_ref = rwkv7_ref.wkv7(*(small[n] for n in NAMES), output_final_state=True)
    assert rms_ratio(y[-1:], y_ref) <= BF16_RMS and rms_ratio(final[-1:], final_ref) <= FP32_RMS
    del y, final
    torch.cuda.empty_cache()
