"""M-RoPE (Qwen2-VL / Qwen2.5-VL chunked sections, Qwen3-VL interleaved): every twin against the fp64 reference,
forward and backward; the reference's row assignment against HF's own rotary modules; bad input."""
import pytest
import torch

from ropewkv.ops.rope import rope
from ropewkv.reference import rope as reference
from ropewkv.testing import assert_within, poisoned_outputs, seeded
from ropewkv.testing import rope as rp
from conftest import kernel_backends as _kernel_backends


def kernel_backends(device) -> list:
    """conftest's twins, asserted non-empty: a loop over no backend would pass the tests below vacuously."""
    backends = _kernel_backends(device)
    assert backends, f"no kernel twin runs on {device} here"
    return backends

# rotary_dim 16 (8 frequencies) in a head of 24: partial rotary too. (section, interleaved)
LAYOUTS = {"chunked": ([2, 3, 3], False), "interleaved": ([4, 2, 2], True)}


def mrope_positions(batch: int, seqlen: int, generator, high: int = 2**20) -> torch.Tensor:
    """[3, B, S] positions with distinct rows (temporal, height, width), up to 2^20."""
    return torch.randint(0, high, (3, batch, seqlen), generator=generator)


def reference_and_grads(x, cotangent, inv, positions, section, interleaved, layout="bshd"):
    x64 = x.detach().double().cpu().requires_grad_()
    out = reference.rope(x64, inv.cpu(), positions, layout=layout, mrope_section=section,
                         mrope_interleaved=interleaved)
    (grad,) = torch.autograd.grad(out, x64, cotangent.double().cpu())
    return out.detach(), grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_forward_and_backward_match_fp64(device, dtype, kind):
    section, interleaved = LAYOUTS[kind]
    gen = seeded(11)
    batch, seqlen, dim, rot = 2, 5, 24, 16
    q = rp.rope_input(batch, seqlen, 3, dim, dtype, "bshd", gen, device)
    k = rp.rope_input(batch, seqlen, 1, dim, dtype, "bshd", gen, device)
    cot_q, cot_k = (torch.randn(x.shape, generator=gen).to(dtype).to(device) for x in (q, k))
    inv = rp.rope_inv_freq(rot, device=device)
    offsets = torch.tensor([0, 1000])
    positions = mrope_positions(batch, seqlen, gen)
    absolute = positions + offsets.view(1, batch, 1)
    want = [reference_and_grads(x, c, inv, absolute, section, interleaved) for x, c in ((q, cot_q), (k, cot_k))]
    for backend in kernel_backends(device):
        qb, kb = (x.detach().clone().requires_grad_() for x in (q, k))
        with poisoned_outputs():
            oq, ok = rope(qb, kb, inv_freq=inv, positions=positions.to(device), seqlen_offsets=offsets.to(device),
                          mrope_section=section, mrope_interleaved=interleaved, backend=backend)
            grads = torch.autograd.grad((oq, ok), (qb, kb), (cot_q, cot_k))
        tol = rp.tolerance(dtype, "fp32", backend, device)
        for name, got, ref in (("fwd q", oq, want[0][0]), ("fwd k", ok, want[1][0]), ("bwd q", grads[0], want[0][1]),
                               ("bwd k", grads[1], want[1][1])):
            assert_within(rp.rotation_measure(f"mrope {kind} {name}", backend, "fp32", got, ref, tol, rot, False))
        assert torch.equal(oq[..., rot:], q[..., rot:]), "dims past rotary_dim pass through"


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_varlen_inplace_and_gptj_pairs(device, kind):
    """Packed varlen ([3, T] positions, offsets per sequence), rotated in place, GPT-J interleaved pairs."""
    section, interleaved = LAYOUTS[kind]
    gen = seeded(12)
    total, dim = 7, 16
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    q = rp.rope_input(1, total, 2, dim, torch.float32, "thd", gen, device)
    positions = mrope_positions(1, total, gen).view(3, total)
    offsets = torch.tensor([5, 70000])
    absolute = positions + offsets[torch.tensor([0, 0, 0, 1, 1, 1, 1])]
    inv = rp.rope_inv_freq(dim, device=device)
    want = reference.rope(q.double().cpu(), inv.cpu(), absolute, layout="thd", interleaved=True,
                          mrope_section=section, mrope_interleaved=interleaved)
    for backend in kernel_backends(device):
        got = q.clone()
        rope(got, inv_freq=inv, positions=positions.to(device), seqlen_offsets=offsets.to(device),
             cu_seqlens=cu.to(device), layout="thd", interleaved=True, inplace=True, mrope_section=section,
             mrope_interleaved=interleaved, backend=backend)
        tol = rp.tolerance(torch.float32, "fp32", backend, device)
        assert_within(rp.rotation_measure(f"mrope {kind} varlen", backend, "fp32", got, want, tol, dim, True))


def test_equal_rows_are_plain_rope(device):
    """Text-only tokens carry the same position in all three rows: M-RoPE must then be plain RoPE, bit for bit."""
    gen = seeded(13)
    q = rp.rope_input(1, 6, 2, 16, torch.bfloat16, "bshd", gen, device)
    positions = torch.randint(0, 2**20, (1, 6), generator=gen).to(device)
    inv = rp.rope_inv_freq(16, device=device)
    ref = rp.rope_reference64(q, inv, positions.cpu())
    for backend in kernel_backends(device):
        with poisoned_outputs():
            plain = rope(q, inv_freq=inv, positions=positions, backend=backend)
            # plain RoPE itself against fp64: otherwise a bug shared by both paths would pass
            assert_within(rp.rotation_measure("rope plain", backend, "fp32", plain, ref,
                                              rp.tolerance(torch.bfloat16, "fp32", backend, device), 16, False))
            for section, interleaved in LAYOUTS.values():
                mrope = rope(q, inv_freq=inv, positions=positions.expand(3, 1, 6), mrope_section=section,
                             mrope_interleaved=interleaved, backend=backend)
                assert torch.equal(mrope, plain), backend


HF_ROTARY = {  # modeling module, rotary class, config class, (mrope_section, interleaved)
    "qwen2_vl": ("Qwen2VLRotaryEmbedding", "Qwen2VLTextConfig", ([2, 3, 3], False)),
    "qwen2_5_vl": ("Qwen2_5_VLRotaryEmbedding", "Qwen2_5_VLTextConfig", ([2, 3, 3], False)),
    "qwen3_vl": ("Qwen3VLTextRotaryEmbedding", "Qwen3VLTextConfig", ([4, 2, 2], True)),
}


@pytest.mark.parametrize("model", sorted(HF_ROTARY))
def test_rows_match_hf_rotary_modules(model):
    """HF composes the three rows' cos/sin inside its rotary module; our row assignment (reference.mrope_rows, which
    the kernels' mrope_row mirrors) must give the same tables. Small positions keep HF's fp32 angle within 4e-6."""
    transformers = pytest.importorskip("transformers")
    import importlib

    module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    rotary_name, config_name, (section, interleaved) = HF_ROTARY[model]
    config_class = getattr(importlib.import_module(f"transformers.models.{model}.configuration_{model}"), config_name)
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    if interleaved:
        rope_parameters["mrope_interleaved"] = True
    config = config_class(hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=rope_parameters)
    rotary = getattr(module, rotary_name)(config)
    positions = mrope_positions(2, 5, seeded(14), high=50)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    rows = reference.mrope_rows(8, section, interleaved)
    want_cos, want_sin = reference.cos_sin(positions, rotary.inv_freq, 1.0, torch.float64, rows)
    for got, want in ((cos, want_cos), (sin, want_sin)):
        torch.testing.assert_close(got.double(), torch.cat((want, want), -1), rtol=0, atol=1e-5)
    assert len(set(rows.tolist())) == 3, "the test positions must exercise all three rows"


BAD = [
    (dict(mrope_section=[2, 3]), ValueError, "mrope_section must be 3 non-negative ints"),
    (dict(mrope_section=[2, 3, 4]), ValueError, "summing to rotary_dim / 2 = 8"),
    (dict(mrope_section=[2, -1, 7]), ValueError, "mrope_section must be 3 non-negative ints"),
    (dict(mrope_section=[0, 6, 2], mrope_interleaved=True), ValueError, "does not fit interleaved"),
    (dict(mrope_interleaved=True), ValueError, "mrope_interleaved=True needs mrope_section"),
    (dict(mrope_section=[2, 3, 3], positions=None), ValueError, "mrope_section needs positions"),
    (dict(mrope_section=[2, 3, 3], positions=torch.zeros(2, 5, dtype=torch.int64)), ValueError,
     "positions for M-RoPE must have shape \\(3, 2, 5\\)"),
    (dict(mrope_section=[2, 3, 3], positions=torch.zeros(3, 1, 4, dtype=torch.int64)), ValueError,
     "do not broadcast to \\(3, 2, 5\\)"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_is_named(device, kwargs, error, message):
    q = torch.randn(2, 5, 2, 16, device=device)
    call = {"positions": torch.zeros(3, 2, 5, dtype=torch.int64), **kwargs}
    if call["positions"] is not None:
        call["positions"] = call["positions"].to(device)
    for backend in kernel_backends(device):
        with pytest.raises(error, match=message):
            rope(q, inv_freq=rp.rope_inv_freq(16, device=device), backend=backend, **call)


def test_cpp_glue_checks_the_section_too():
    """The second guard behind the Python checks: the op itself rejects a section that does not cover rotary_dim."""
    q = torch.randn(1, 2, 1, 16)
    with pytest.raises(ValueError, match="mrope_section must be 3 non-negative ints summing to rotary_dim / 2 = 8"):
        torch.ops.ropewkv.rope(q, None, rp.rope_inv_freq(16), torch.zeros(3, 1, 2, dtype=torch.int64), None, None,
                               False, False, 1.0, 0, [1, 1, 1], False)
    with pytest.raises(ValueError, match=r"positions must be a \[3, batch, seq\] view"):
        torch.ops.ropewkv.rope(q, None, rp.rope_inv_freq(16), torch.zeros(1, 2, dtype=torch.int64), None, None,
                               False, False, 1.0, 0, [2, 3, 3], False)


@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_mrope_compiles_for_sm90(interleaved):
    """Without a GPU: the M-RoPE variants of the Triton kernel compile for sm_90 (bshd and packed varlen)."""
    from ropewkv.triton_kernels import rope as kernels
    from triton_sm90 import captured_launches, ptx_for_sm90, run_without_interpreter

    if kernels.INTERPRETING:
        run_without_interpreter(__file__, f"test_triton_mrope_compiles_for_sm90[{interleaved}]")
        return
    q = torch.empty(1, 2, 4, 128, dtype=torch.bfloat16)
    positions = torch.zeros(3, 1, 2, dtype=torch.int64)
    inv_freq = rp.rope_inv_freq(128)
    with captured_launches() as launches:
        kernels.rope_forward(q, q, q, q, inv_freq, positions, None, None, False, False, 1.0, False, [16, 24, 24],
                             interleaved)
        kernels.rope_forward(q, None, q, None, inv_freq, positions, positions[0, 0], torch.tensor([0, 2]), False,
                             False, 1.0, False, [16, 24, 24], interleaved)
    assert len(launches) == 2
    for launch in launches:
        assert ".entry" in ptx_for_sm90(*launch)
