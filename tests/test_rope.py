"""ropewkv.rope / apply_rotary_pos_emb / RotaryEmbedding on every twin against the fp64 reference."""
import pytest
import torch

import ropewkv.nn
from ropewkv.ops.qk_norm_rope import qk_norm_rope
from ropewkv.ops.rope import apply_rotary_pos_emb, rope
from ropewkv.reference import rope as reference
from ropewkv.testing import assert_within, poisoned_outputs, seeded
from ropewkv.testing import rope as rp
from conftest import kernel_backends as _kernel_backends


def kernel_backends(device) -> list:
    """conftest's twins, asserted non-empty: a loop over no backend would pass every test below vacuously."""
    backends = _kernel_backends(device)
    assert backends, f"no kernel twin runs on {device} here"
    return backends


def check(out, ref, dtype, precision, backend, device, rot, interleaved):
    assert out.dtype == dtype
    assert_within(rp.rotation_measure("rope", backend, precision, out, ref, rp.tolerance(dtype, precision, backend,
                                                                                        device), rot, interleaved))


def test_parity_rows(device):
    rows = list(rp.parity_rows(device, seed=21))
    assert {r.backend for r in rows} == set(kernel_backends(device))
    for row in rows:
        assert_within(row)


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_layouts_styles_views_without_copy(device, layout, interleaved):
    gen = seeded(1)
    batch, seqlen, dim, rot = 2, 6, 72, 72
    q = rp.rope_input(batch, seqlen, 3, dim, torch.bfloat16, layout, gen, device)
    k = rp.rope_input(batch, seqlen, 1, dim, torch.bfloat16, layout, gen, device)
    inv = rp.rope_inv_freq(rot, device=device)
    pos = rp.reference_positions(batch, seqlen, None, 5, None, layout)
    for backend in kernel_backends(device):
        with poisoned_outputs():
            oq, ok = rope(q, k, inv_freq=inv, layout=layout, interleaved=interleaved, seqlen_offsets=5,
                          backend=backend)
        assert oq.shape == q.shape and oq.stride() == q.stride(), "output keeps the input's memory layout"
        for out, x in ((oq, q), (ok, k)):
            check(out, rp.rope_reference64(x, inv, pos, layout, interleaved), torch.bfloat16, "fp32", backend,
                  device, rot, interleaved)


@pytest.mark.parametrize("dim,rot,interleaved", [(64, 64, False), (72, 64, True), (80, 32, False), (96, 96, True),
                                                 (160, 160, True), (256, 128, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_head_dims_and_partial_rotary(device, dim, rot, interleaved, dtype):
    gen = seeded(dim + rot)
    q = rp.rope_input(1, 4, 2, dim, dtype, "bshd", gen, device)
    inv = rp.rope_inv_freq(rot, device=device)
    pos = rp.reference_positions(1, 4)
    for backend in kernel_backends(device):
        with poisoned_outputs():
            out = rope(q, inv_freq=inv, interleaved=interleaved, backend=backend)
        check(out, rp.rope_reference64(q, inv, pos, interleaved=interleaved), dtype, "fp32", backend, device, rot,
              interleaved)
        assert torch.equal(out[..., rot:], q[..., rot:]), "dims past rotary_dim are copied bit-exactly"


@pytest.mark.parametrize("kind", ["positions_int32_broadcast", "positions_int64_batch", "offsets_tensor",
                                  "varlen", "varlen_positions_offsets", "thd_single", "scaling_and_rotary_dim"])
def test_positions_offsets_varlen(device, kind):
    gen = seeded(7)
    batch, seqlen, dim = 2, 5, 32
    layout, kwargs, ref_kwargs = "bshd", {}, {}
    inv = rp.rope_inv_freq(dim, device=device)
    if kind == "positions_int32_broadcast":
        p = torch.tensor([9, 3, 70000, 2, 1], dtype=torch.int32)
        kwargs = ref_kwargs = dict(positions=p)
    elif kind == "positions_int64_batch":
        p = torch.randint(0, 1 << 20, (batch, seqlen), generator=gen)
        kwargs = ref_kwargs = dict(positions=p, seqlen_offsets=11)
    elif kind == "offsets_tensor":
        o = torch.tensor([0, 123456])
        kwargs = ref_kwargs = dict(seqlen_offsets=o)
    elif kind.startswith("varlen"):
        layout = "thd"
        cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
        kwargs = ref_kwargs = dict(cu_seqlens=cu)
        if kind == "varlen_positions_offsets":
            p = torch.arange(10, dtype=torch.int64) * 7
            kwargs = ref_kwargs = dict(cu_seqlens=cu, positions=p, seqlen_offsets=torch.tensor([1, 2, 300]))
    elif kind == "thd_single":
        layout, kwargs, ref_kwargs = "thd", dict(seqlen_offsets=4), dict(seqlen_offsets=4)
    q = rp.rope_input(batch, seqlen, 2, dim, torch.float32, layout, gen, device)
    k = rp.rope_input(batch, seqlen, 1, dim, torch.float32, layout, gen, device)
    scaling, rot = 1.0, dim
    if kind == "scaling_and_rotary_dim":
        scaling, rot = 1.25, dim // 2
        kwargs = dict(attention_scaling=scaling, rotary_dim=rot)
    pos = rp.reference_positions(batch, seqlen, layout=layout, **ref_kwargs)
    dev_kwargs = {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in kwargs.items()}
    for backend in kernel_backends(device):
        with poisoned_outputs():
            oq, ok = rope(q, k, inv_freq=inv, layout=layout, backend=backend, **dev_kwargs)
        for out, x in ((oq, q), (ok, k)):
            ref = rp.rope_reference64(x, inv[: rot // 2], pos, layout, attention_scaling=scaling)
            check(out, ref, torch.float32, "fp32", backend, device, rot, False)


def test_gqa_mqa_and_q_only_match_separate_calls(device):
    gen = seeded(8)
    q = rp.rope_input(2, 4, 8, 64, torch.bfloat16, "bshd", gen, device)
    k = rp.rope_input(2, 4, 1, 64, torch.bfloat16, "bshd", gen, device)
    inv = rp.rope_inv_freq(64, device=device)
    pos = rp.reference_positions(2, 4)
    for backend in kernel_backends(device):
        with poisoned_outputs():
            oq, ok = rope(q, k, inv_freq=inv, backend=backend)
            assert torch.equal(oq, rope(q, inv_freq=inv, backend=backend))
            assert torch.equal(ok, rope(k, inv_freq=inv, backend=backend))
        # equal calls could share a bug: the joint call is also judged against the fp64 oracle
        for out, x in ((oq, q), (ok, k)):
            check(out, rp.rope_reference64(x, inv, pos), torch.bfloat16, "fp32", backend, device, 64, False)


@pytest.mark.parametrize("dtype,precision", [(torch.bfloat16, "fp32"), (torch.float16, "bf16"), (torch.float32, "fp32")])
def test_inplace_matches_and_backprops(device, dtype, precision):
    gen = seeded(9)
    base_q = rp.rope_input(2, 4, 4, 48, dtype, "bhsd", gen, device).requires_grad_()
    base_k = rp.rope_input(2, 4, 2, 48, dtype, "bhsd", gen, device).requires_grad_()
    inv = rp.rope_inv_freq(32, device=device)
    cot = torch.randn(base_q.shape, generator=gen).to(dtype).to(device)
    # the out-of-place result the in-place one must equal is itself judged against fp64 (forward and backward)
    pos = rp.reference_positions(2, 4)
    x64 = [t.detach().double().cpu().requires_grad_() for t in (base_q, base_k)]
    ref = [reference.rope(t, inv.cpu(), pos, layout="bhsd") for t in x64]
    ref_grads = torch.autograd.grad((ref[0] * cot.double().cpu()).sum() + ref[1].sum(), x64)
    for backend in kernel_backends(device):
        with poisoned_outputs():
            expected_q, expected_k = rope(base_q, base_k, inv_freq=inv, layout="bhsd", precision=precision,
                                          backend=backend)
            eg_q, eg_k = torch.autograd.grad((expected_q * cot).sum() + expected_k.sum(), (base_q, base_k))
        for out, want in zip((expected_q, expected_k, eg_q, eg_k), (*ref, *ref_grads)):
            check(out, want, dtype, precision, backend, device, 32, False)
        q, k = base_q * 1, base_k * 1
        ptr = q.data_ptr()
        out_q, out_k = rope(q, k, inv_freq=inv, layout="bhsd", inplace=True, precision=precision, backend=backend)
        assert out_q is q and out_k is k and q.data_ptr() == ptr
        assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
        g_q, g_k = torch.autograd.grad((out_q * cot).sum() + out_k.sum(), (base_q, base_k))
        assert torch.equal(g_q, eg_q) and torch.equal(g_k, eg_k)


def test_inplace_never_corrupts_saved_tensors(device):
    inv = rp.rope_inv_freq(16, device=device)
    for backend in kernel_backends(device):
        for requires_grad in (True, False):
            w = torch.randn(1, 3, 2, 16, device=device, requires_grad=True)
            q = torch.randn(1, 3, 2, 16, device=device, requires_grad=requires_grad) * 1
            y = q * w  # saves q for w's gradient
            rope(q, inv_freq=inv, inplace=True, backend=backend)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.sum().backward()


def test_inplace_on_a_fused_qkv_slice(device):
    """q and k as slices of one qkv projection: rotated in place in the shared buffer, v untouched."""
    gen = seeded(10)
    qkv = rp.rope_input(2, 5, 6, 32, torch.float32, "bshd", gen, device)
    inv = rp.rope_inv_freq(32, device=device)
    for backend in kernel_backends(device):
        buf = qkv.clone()
        with poisoned_outputs():
            expected = rope(qkv[:, :, :4], qkv[:, :, 4:5], inv_freq=inv, backend=backend)
        for out, x in zip(expected, (qkv[:, :, :4], qkv[:, :, 4:5])):
            check(out, rp.rope_reference64(x, inv, rp.reference_positions(2, 5)), torch.float32, "fp32", backend,
                  device, 32, False)
        rope(buf[:, :, :4], buf[:, :, 4:5], inv_freq=inv, inplace=True, backend=backend)
        assert torch.equal(buf[:, :, :4], expected[0]) and torch.equal(buf[:, :, 4:5], expected[1])
        assert torch.equal(buf[:, :, 5:], qkv[:, :, 5:])


@pytest.mark.parametrize("shape", [(0, 4, 2, 16), (2, 0, 2, 16)])
def test_empty(device, shape):
    inv = rp.rope_inv_freq(16, device=device)
    for backend in kernel_backends(device):
        q = torch.randn(shape, device=device, dtype=torch.bfloat16)
        oq, ok = rope(q, q, inv_freq=inv, backend=backend)
        assert oq.shape == shape and ok.dtype == torch.bfloat16
        assert rope(q, inv_freq=inv, inplace=True, backend=backend) is q
        cos, sin = torch.ones(shape[0], 2, 16, device=device), torch.zeros(shape[0], 2, 16, device=device)
        hq, _ = apply_rotary_pos_emb(q, q, cos, sin, backend=backend)
        assert hq.shape == shape


def test_gradcheck_fp64_cpu_twin():
    gen = seeded(12)
    q = rp.rope_input(1, 3, 2, 12, torch.float64, "bshd", gen).requires_grad_()
    k = rp.rope_input(1, 3, 1, 12, torch.float64, "bshd", gen).requires_grad_()
    inv = rp.rope_inv_freq(8)
    assert torch.autograd.gradcheck(lambda a, b: rope(a, b, inv_freq=inv, backend="cpu", seqlen_offsets=3,
                                                      interleaved=True, attention_scaling=0.7), (q, k))
    cos, sin = torch.randn(1, 3, 8, dtype=torch.float64, generator=gen), torch.randn(1, 3, 8, dtype=torch.float64,
                                                                                  generator=gen)
    # cos/sin with unequal halves: the backward must be the exact transpose, not just sin -> -sin.
    assert torch.autograd.gradcheck(lambda a, b: apply_rotary_pos_emb(a, b, cos, sin, 2, backend="cpu"), (q, k))


def test_cos_sin_backward_is_the_transpose_on_every_twin(device):
    """Arbitrary tables (unequal halves): the gradient must be the transpose of the rotation, not sin -> -sin."""
    gen = seeded(13)
    q = rp.rope_input(1, 3, 2, 12, torch.float32, "bhsd", gen).to(device)  # HF's [B, H, S, D]
    k = rp.rope_input(1, 3, 1, 12, torch.float32, "bhsd", gen).to(device)
    cos, sin = (torch.randn(1, 3, 8, generator=gen).to(device) for _ in range(2))
    grads = [torch.randn(t.shape, generator=gen).to(device) for t in (q, k)]
    q64, k64 = (t.double().requires_grad_() for t in (q, k))
    want = torch.autograd.grad(reference.hf_apply_rotary_pos_emb(q64, k64, cos.double(), sin.double()),
                               (q64, k64), [g.double() for g in grads])
    for backend in kernel_backends(device):
        qb, kb = (t.detach().clone().requires_grad_() for t in (q, k))
        with poisoned_outputs():
            got = torch.autograd.grad(apply_rotary_pos_emb(qb, kb, cos, sin, backend=backend), (qb, kb), grads)
        for g, w in zip(got, want):
            # fp32 math, |terms| < 10: measured max |error| 1.1e-7 .. 2.0e-7 (seeds 1, 2, 3, 13, both twins)
            torch.testing.assert_close(g.double(), w, rtol=0, atol=1e-6, msg=backend)


def test_bad_input_is_named():
    q, inv = torch.randn(1, 2, 2, 8), rp.rope_inv_freq(8)
    cases = [
        (TypeError, "q must have dtype", dict(q=q.to(torch.int32))),
        (ValueError, "rotary_dim must be a non-negative even", dict(rotary_dim=5)),
        (ValueError, "exceeds head_dim", dict(inv_freq=rp.rope_inv_freq(16))),
        (ValueError, "exceeds head_dim", dict(rotary_dim=10, inv_freq=rp.rope_inv_freq(16))),
        (TypeError, "positions must have dtype int32 or int64", dict(positions=torch.zeros(2))),
        (ValueError, "do not broadcast", dict(positions=torch.zeros(3, dtype=torch.long))),
        (ValueError, "seqlen_offsets must be >= 0", dict(seqlen_offsets=-1)),
        (ValueError, "seqlen_offsets must be >= 0", dict(seqlen_offsets=torch.tensor([-2]))),
        (ValueError, "layout must be one of", dict(layout="bsdh")),
        (ValueError, "cu_seqlens needs layout='thd'", dict(cu_seqlens=torch.tensor([0, 2]))),
        (ValueError, "non-decreasing", dict(q=q[0], layout="thd", cu_seqlens=torch.tensor([0, 2, 1, 2]))),
        (ValueError, "does not match the total token count", dict(q=q[0], layout="thd", cu_seqlens=torch.tensor([0, 3]))),
        (TypeError, "cu_seqlens must have dtype", dict(q=q[0], layout="thd", cu_seqlens=torch.tensor([0.0, 2.0]))),
        (ValueError, "must have 4 dims", dict(q=q[0])),
        (TypeError, "k must have q's dtype", dict(k=q.half())),
        (ValueError, "must match q", dict(k=torch.randn(1, 3, 1, 8))),
    ]
    if torch.cuda.is_available():
        cases.append((ValueError, "is on", dict(k=q.cuda())))
    else:
        cases.append((ValueError, "is on", dict(k=q.to("meta"))))
    for error, match, override in cases:
        args = {**dict(q=q, inv_freq=inv), **override}
        with pytest.raises(error, match=match):
            rope(args.pop("q"), args.pop("k", None), **args)
    cos = torch.ones(1, 2, 8)
    with pytest.raises(ValueError, match="same shape"):
        apply_rotary_pos_emb(q, q, cos, torch.ones(1, 2, 6))
    with pytest.raises(ValueError, match="must be even"):
        apply_rotary_pos_emb(q, q, cos[..., :5], cos[..., :5])
    with pytest.raises(ValueError, match="do not broadcast"):
        apply_rotary_pos_emb(q, q, torch.ones(1, 3, 8), torch.ones(1, 3, 8), unsqueeze_dim=2)
    with pytest.raises(TypeError, match="cos must be a float"):
        apply_rotary_pos_emb(q, q, cos.long(), cos.long())


def test_triton_launch_checks_k_against_q(device):
    """The Triton twin sizes k from q: its ops reject another k, as the C++ glue does (set_io), before any launch."""
    if "triton" not in kernel_backends(device):
        pytest.skip("no Triton twin on this device")
    q, k = torch.randn(1, 3, 2, 8, device=device), torch.randn(1, 3, 1, 16, device=device)
    inv, table = rp.rope_inv_freq(8, device=device), torch.ones(1, 3, 8, device=device)
    ops = torch.ops.ropewkv
    calls = [lambda: ops.rope_triton(q, k, inv, None, None, None, False, False, 1.0, 0, None, False),
             lambda: ops.rope_cos_sin_triton(q, k, table, table, False, False, 0),
             lambda: ops.qk_norm_rope_triton(q, k, None, None, 1e-6, 0.0, inv, None, None, None, None, None, None, 8,
                                             False, 1.0, 0)]
    for call in calls:
        with pytest.raises(ValueError, match=r"k must be \[batch, seq, kv_heads, head_dim\] matching q"):
            call()


def test_learnable_inv_freq(device):
    """The kernels do not differentiate inv_freq: one that requires grad is refused (it would silently get no
    gradient); the reference differentiates it."""
    q = torch.randn(1, 3, 2, 8, device=device, requires_grad=True)
    positions = torch.tensor([[10, 11, 12]], device=device)
    inv = rp.rope_inv_freq(8, device=device).requires_grad_()
    for backend in kernel_backends(device):
        rope(q, inv_freq=inv.detach(), backend=backend)  # the decode fast path has accepted the backend
        for call in (lambda: rope(q, inv_freq=inv, backend=backend),
                     lambda: rope(q, inv_freq=inv, positions=positions, backend=backend),
                     lambda: qk_norm_rope(q, inv_freq=inv, positions=positions, backend=backend)):
            with pytest.raises(NotImplementedError, match="inv_freq gets no gradient"):
                call()
        with torch.no_grad():
            assert torch.equal(rope(q, inv_freq=inv, backend=backend), rope(q, inv_freq=inv.detach(), backend=backend))
    got = torch.autograd.grad(rope(q, inv_freq=inv, positions=positions, backend="reference").sum(), inv)[0]
    inv64 = inv.detach().cpu().double().requires_grad_()
    want = torch.autograd.grad(reference.rope(q.detach().cpu().double(), inv64, positions.cpu()).sum(), inv64)[0]
    # fp32 autograd of sums of terms ~ position * |q| ~ 40 that cancel: measured max |error| 6.7e-6 over 300 random q
    # (|want| from 0.1 to 60); the bound was rtol 1e-4 + atol 1e-5 (6e-3 at |want| = 60, 900x the error)
    torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=2e-5)


def test_reference_keeps_fp64_tables():
    """backend="reference" computes fp64 input in fp64: fp64 cos/sin are not rounded to fp32 on the way."""
    gen = seeded(18)
    q, k = (torch.randn(1, 2, 5, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    angle = torch.rand(1, 5, 4, dtype=torch.float64, generator=gen) * 100
    cos, sin = torch.cat((angle.cos(),) * 2, -1), torch.cat((angle.sin(),) * 2, -1)
    got = apply_rotary_pos_emb(q, k, cos, sin, backend="reference")
    for out, want in zip(got, reference.hf_apply_rotary_pos_emb(q, k, cos, sin)):
        torch.testing.assert_close(out, want, rtol=0, atol=1e-14)


def test_hf_apply_rotary_pos_emb_bit_exact_and_precise(device):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf

    gen = seeded(13)
    q = rp.rope_input(2, 6, 4, 64, torch.bfloat16, "bhsd", gen, device)
    k = rp.rope_input(2, 6, 2, 64, torch.bfloat16, "bhsd", gen, device)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [100, 5000, 70000, 3, 9, 1]])
    cos, sin = reference.cos_sin(pos, rp.rope_inv_freq(64), 1.0, torch.float32)
    cos, sin = (torch.cat((t, t), -1).to(device) for t in (cos, sin))
    for backend in kernel_backends(device):
        expected = hf(q, k, cos.bfloat16(), sin.bfloat16())
        got = apply_rotary_pos_emb(q, k, cos.bfloat16(), sin.bfloat16(), precision="bf16", backend=backend,
                                   position_ids=pos)
        # (the interpreted Triton twin too: its bf16 mode rounds like HF's eager ops; measured bit-exact, seeds
        # 1, 2, 13, where it used to be exempted here and so checked by nothing)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), backend
        # fp32 math from fp32 tables: within one rounding of the fp64 result, HF's eager bf16 is not.
        ref = hf(q.double(), k.double(), cos.double(), sin.double())
        fp32 = apply_rotary_pos_emb(q, k, cos, sin, backend=backend, precision="fp32")
        for out, r in zip(fp32, ref):
            check(out, r, torch.bfloat16, "fp32", backend, device, 64, False)
        # partial rotary with [B, S, H, D] (unsqueeze_dim=2): dims past 32 untouched.
        qs, ks = q.transpose(1, 2), k.transpose(1, 2)
        part = apply_rotary_pos_emb(qs, ks, cos[..., :32], sin[..., :32], unsqueeze_dim=2, backend=backend,
                                    precision="bf16")
        # (transformers 5.23's own function rejects partial tables; the reference keeps HF's formula with NeoX's
        # pass-through)
        exp_part = reference.hf_apply_rotary_pos_emb(qs, ks, cos[..., :32].bfloat16(), sin[..., :32].bfloat16(), 2)
        assert torch.equal(part[0][..., 32:], qs[..., 32:])
        assert torch.equal(part[0], exp_part[0]) and torch.equal(part[1], exp_part[1]), backend


def test_torch_compile_fullgraph(device):
    gen = seeded(14)
    q = rp.rope_input(1, 4, 2, 32, torch.bfloat16, "bshd", gen, device).requires_grad_()
    k = rp.rope_input(1, 4, 1, 32, torch.bfloat16, "bshd", gen, device).requires_grad_()
    inv = rp.rope_inv_freq(32, device=device)

    def f(a, b):
        oq, ok = rope(a, b, inv_freq=inv, seqlen_offsets=2)
        return (oq.float() * 2).sum() + ok.float().sum()

    compiled = torch.compile(f, fullgraph=True)
    compiled(q, k).backward()
    expected = torch.autograd.grad(f(q, k), (q, k))
    assert torch.equal(q.grad, expected[0]) and torch.equal(k.grad, expected[1])


def test_torch_compile_fullgraph_index_tensors(device):
    """positions, a seqlen_offsets tensor and cu_seqlens trace: their values are checked on the host in eager mode
    only (a data-dependent check cannot be traced; no kernel indexes memory with them unchecked)."""
    q = rp.rope_input(2, 3, 2, 8, torch.float32, "bshd", seeded(17), device)
    inv = rp.rope_inv_freq(8, device=device)
    positions = torch.tensor([[5, 6, 7], [0, 90, 3]], device=device)
    offsets, cu = torch.tensor([1, 2], device=device), torch.tensor([0, 2, 6], device=device)
    for backend in kernel_backends(device):
        def f(x):
            a = rope(x, inv_freq=inv, positions=positions, seqlen_offsets=offsets, backend=backend)
            return a, rope(x.view(6, 2, 8), inv_freq=inv, layout="thd", cu_seqlens=cu, backend=backend)

        torch._dynamo.reset()
        got, want = torch.compile(f, fullgraph=True, backend="aot_eager")(q), f(q)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), backend


def test_int64_indexing_cpu_twin():
    """A view whose second batch starts 2^31 elements in: int32 offsets would wrap. The storage is allocated but
    only the touched pages become resident."""
    big = torch.empty(2**31 + 4096, dtype=torch.float16)
    q = big.as_strided((2, 4, 2, 64), (2**31, 128, 64, 1))
    q.copy_(torch.randn(2, 4, 2, 64, generator=seeded(15)).half())
    inv = rp.rope_inv_freq(64)
    with poisoned_outputs():
        expected = rope(q.clone(), inv_freq=inv, backend="cpu")
    ref = rp.rope_reference64(q, inv, rp.reference_positions(2, 4))
    check(expected, ref, torch.float16, "fp32", "cpu", "cpu", 64, False)
    rope(q, inv_freq=inv, inplace=True, backend="cpu")
    assert torch.equal(q, expected)
    del big


def test_rotary_embedding_module_matches_hf(device):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scalings = [None, {"rope_type": "linear", "factor": 4.0}, {"rope_type": "dynamic", "factor": 2.0},
                {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
                {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "mscale": 0.707,
                 "mscale_all_dim": 1.0, "beta_fast": 16},
                {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192},
                {"rope_type": "longrope", "long_factor": [1 + 0.1 * i for i in range(16)],
                 "short_factor": [1 + 0.01 * i for i in range(16)], "original_max_position_embeddings": 4096}]
    for scaling in scalings:
        params = {"rope_theta": 500000.0, "rope_type": "default", **(scaling or {})}
        cfg = LlamaConfig(hidden_size=256, num_attention_heads=8, head_dim=32, max_position_embeddings=16384,
                          rope_parameters=params)
        module = ropewkv.nn.RotaryEmbedding(32, 500000.0, scaling, max_position_embeddings=16384).to(device)
        if scaling is None:
            ref, att = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
        else:
            ref, att = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
        assert torch.equal(module.inv_freq.cpu(), ref) and module.attention_scaling == att, params["rope_type"]
        q = rp.rope_input(1, 3, 2, 32, torch.float32, "bshd", seeded(16), device)
        if scaling and scaling["rope_type"] in ("dynamic", "longrope"):  # the sequence-length-dependent variants
            long_ref, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu", seq_len=40001)
            positions = torch.tensor([0, 1, 40000])
            with poisoned_outputs():
                out, _ = module(q, q, positions=positions.to(device))
            assert torch.equal(module.inv_freq.cpu(), long_ref)
            # the output too, with the regrown frequencies (it was not checked at all for these two variants)
            pos = rp.reference_positions(1, 3, positions)
            ref_out = rp.rope_reference64(q, long_ref, pos, attention_scaling=module.attention_scaling)
            check(out, ref_out, torch.float32, "fp32", "cpu", device, 32, False)
        else:
            with poisoned_outputs():
                out, _ = module(q, q, seqlen_offsets=7)
            pos = rp.reference_positions(1, 3, None, 7)
            ref_out = rp.rope_reference64(q, ref, pos, attention_scaling=att)
            check(out, ref_out, torch.float32, "fp32", "cpu", device, 32, False)
