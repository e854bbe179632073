"""ropewkv.qk_norm_rope on every twin: against the fp64 oracle, against HF transformers' own Qwen3RMSNorm /
Gemma3RMSNorm + apply_rotary_pos_emb, every layout and cos/sin source, in place, gradients, determinism, bad input."""
import pytest
import torch

from ropewkv.ops.qk_norm_rope import qk_norm_rope
from ropewkv.reference import qk_norm_rope as reference
from ropewkv.reference import rope as rope_reference
from ropewkv.testing import assert_within, poisoned_outputs, rms_ratio, seeded
from ropewkv.testing import qk_norm_rope as qt
from ropewkv.testing.rope import PHYSICAL_SHAPE, rope_input, rope_inv_freq, rotation_measure
from ropewkv.testing.rope import tolerance as rope_tolerance
from conftest import kernel_backends as _kernel_backends


def kernel_backends(device) -> list:
    """conftest's twins, asserted non-empty: a loop over no backend would pass the tests below vacuously."""
    backends = _kernel_backends(device)
    assert backends, f"no kernel twin runs on {device} here"
    return backends
from test_bad_input import KernelCalls

EPS = 1e-6


def check_forward(out, ref, dtype, precision, backend, device, rot, interleaved):
    assert out.dtype == dtype
    assert_within(rotation_measure("qk_norm_rope", backend, precision, out, ref,
                                   qt.tolerance(dtype, precision, backend, device), rot, interleaved))


def test_parity_rows(device):
    rows = list(qt.parity_rows(device, seed=5))
    assert {r.backend for r in rows} == set(kernel_backends(device))
    for row in rows:
        assert_within(row)


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_layouts_styles_gqa_partial_rotary(device, layout, interleaved):
    """GQA (3 q heads, 1 kv head), head_dim 72 with rotary_dim 48, varlen for thd; outputs keep the input's layout."""
    gen = seeded(2)
    batch, seqlen, dim, rot = 2, 5, 72, 48
    q = rope_input(batch, seqlen, 3, dim, torch.bfloat16, layout, gen, device)
    k = rope_input(batch, seqlen, 1, dim, torch.bfloat16, layout, gen, device)
    wq, wk = qt.norm_weight(dim, 0.0, gen, device), qt.norm_weight(dim, 0.0, gen, device)
    inv = rope_inv_freq(rot, device=device)
    cu = torch.tensor([0, 4, 10], device=device) if layout == "thd" else None
    positions = rope_reference.token_positions(1, batch * seqlen, None, 9, cu) if layout == "thd" else \
        rope_reference.token_positions(batch, seqlen, None, 9)
    cos, sin = qt.angle_tables(positions.view(1, -1) if layout == "thd" else positions, inv, interleaved)
    for backend in kernel_backends(device):
        with poisoned_outputs():
            oq, ok = qk_norm_rope(q, k, wq, wk, EPS, inv_freq=inv, seqlen_offsets=9, cu_seqlens=cu, layout=layout,
                                  interleaved=interleaved, backend=backend)
        assert oq.shape == q.shape and oq.stride() == q.stride()
        for out, x, w in ((oq, q, wq), (ok, k, wk)):
            ref = qt.oracle(rope_reference.to_bshd(x, layout), w, EPS, cos, sin, interleaved=interleaved)
            check_forward(rope_reference.to_bshd(out, layout), ref, torch.bfloat16, "fp32", backend, device, rot,
                          interleaved)


@pytest.mark.parametrize("source", ["table", "cache", "table_fp64"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_table_and_cache_sources(device, source, interleaved):
    """HF's cos/sin tables (broadcast over the batch) and a vLLM cos_sin_cache read at given positions."""
    gen = seeded(3)
    batch, seqlen, dim = 2, 4, 32
    q = rope_input(batch, seqlen, 2, dim, torch.float32, "bshd", gen, device)
    k = rope_input(batch, seqlen, 2, dim, torch.float32, "bshd", gen, device)
    wq, wk = qt.norm_weight(dim, 1.0, gen, device), qt.norm_weight(dim, 1.0, gen, device)
    inv = rope_inv_freq(dim)
    positions = torch.randint(0, 100, (batch, seqlen), generator=gen)
    if source == "cache":
        cache = reference.cos_sin_cache(inv, 100)
        half_cos, half_sin = reference.cache_cos_sin(cache.double(), positions)
        cos, sin = reference.full_table(half_cos, interleaved), reference.full_table(half_sin, interleaved)
        kwargs = dict(cos_sin_cache=cache.to(device), positions=positions.to(device))
    else:
        cos = torch.randn(1, seqlen, dim, dtype=torch.float64, generator=gen)  # arbitrary: unequal halves
        sin = torch.randn(1, seqlen, dim, dtype=torch.float64, generator=gen)
        dtype = torch.float64 if source == "table_fp64" else torch.float32
        cos, sin = cos.to(dtype), sin.to(dtype)
        kwargs = dict(cos=cos.to(device), sin=sin.to(device))
    backends = [b for b in kernel_backends(device) if source != "table_fp64" or b != "triton"] + ["reference"]
    for backend in backends:
        with poisoned_outputs():
            oq, ok = qk_norm_rope(q, k, wq, wk, EPS, weight_offset=1.0, interleaved=interleaved, backend=backend,
                                  **kwargs)
        for out, x, w in ((oq, q, wq), (ok, k, wk)):
            ref = qt.oracle(x, w, EPS, cos.double().expand(batch, seqlen, dim), sin.double().expand(batch, seqlen, dim),
                            1.0, interleaved)
            # arbitrary tables are no rotation: judge the error against the output's scale (fp32 math: ~1e-7)
            assert rms_ratio(out, ref) < 5e-7, (backend, source)


def test_no_weights_is_plain_rope(device):
    """Without weights the op is RoPE: equal to ropewkv.rope on every twin (same angle, same arithmetic)."""
    import ropewkv

    gen = seeded(4)
    q = rope_input(2, 5, 4, 64, torch.bfloat16, "bshd", gen, device)
    k = rope_input(2, 5, 2, 64, torch.bfloat16, "bshd", gen, device)
    inv = rope_inv_freq(64, device=device)
    pos = rope_reference.token_positions(2, 5, None, 77)
    refs = [rope_reference.rope(x.double().cpu(), inv.cpu(), pos) for x in (q, k)]
    for backend in kernel_backends(device):
        for precision in ("fp32", "bf16"):
            with poisoned_outputs():
                got = qk_norm_rope(q, k, inv_freq=inv, seqlen_offsets=77, precision=precision, backend=backend)
                want = ropewkv.rope(q, k, inv_freq=inv, seqlen_offsets=77, precision=precision, backend=backend)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (backend, precision)
            # equal to a rope that could share its bug: judged against the fp64 rotation as well
            for out, ref in zip(got, refs):
                assert_within(rotation_measure("qk_norm_rope no weights", backend, precision, out, ref,
                                               rope_tolerance(torch.bfloat16, precision, backend, device), 64, False))


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_matches_hf_modules(device, arch):
    """HF's own q_norm/k_norm modules and apply_rotary_pos_emb (not our transcription). fp32: within the fp32 budget
    of fp64; precision="bf16" on bf16 reproduces HF's eager bf16 result except where the statistics' summation order
    crosses a rounding boundary (<= 1 ulp, on a small fraction of the elements)."""
    if arch == "qwen3":
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm as Norm
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb
        offset = 0.0
    else:
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm as Norm
        from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb
        offset = 1.0
    gen = seeded(5)
    batch, seqlen, dim = 2, 6, 64
    norms = [Norm(dim, eps=EPS) for _ in range(2)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(qt.norm_weight(dim, offset, gen))
    inv = rope_inv_freq(dim)
    positions = rope_reference.token_positions(batch, seqlen, None, 1000)
    cos32, sin32 = (torch.cat((t, t), -1) for t in rope_reference.cos_sin(positions, inv, 1.0, torch.float32))
    for dtype in (torch.float32, torch.bfloat16):
        q = rope_input(batch, seqlen, 4, dim, dtype, "bshd", gen) * 4
        k = rope_input(batch, seqlen, 2, dim, dtype, "bshd", gen) * 4
        hf_norms = [n.to(dtype) for n in norms]
        with torch.no_grad():
            hq, hk = apply_rotary_pos_emb(hf_norms[0](q).transpose(1, 2), hf_norms[1](k).transpose(1, 2),
                                          cos32.to(dtype), sin32.to(dtype))
        weights = [n.weight.detach().to(device) for n in hf_norms]
        for backend in kernel_backends(device):
            if dtype == torch.float32:
                oq, ok = qk_norm_rope(q.to(device), k.to(device), *weights, EPS, weight_offset=offset,
                                      cos=cos32.to(device), sin=sin32.to(device), backend=backend)
                for out, x, w in ((oq, q, weights[0]), (ok, k, weights[1])):
                    ref = qt.oracle(x, w, EPS, cos32, sin32, offset)
                    check_forward(out, ref, dtype, "fp32", backend, device, dim, False)
                    # and HF's own fp32 eager result, which rounds every step: a few fp32 ulp apart
                for out, h in ((oq, hq), (ok, hk)):
                    torch.testing.assert_close(out.cpu(), h.transpose(1, 2), rtol=0, atol=2e-6 * h.abs().max())
                continue
            oq, ok = qk_norm_rope(q.to(device), k.to(device), *weights, EPS, weight_offset=offset,
                                  cos=cos32.to(dtype).to(device), sin=sin32.to(dtype).to(device), precision="bf16",
                                  backend=backend)
            for out, h in ((oq, hq.transpose(1, 2)), (ok, hk.transpose(1, 2))):
                diff = (out.cpu().float() - h.float()).abs()
                ulp = torch.finfo(torch.bfloat16).eps * h.float().abs().clamp_min(2**-126)
                # The interpreted Triton twin was exempted (2 ulp, no fraction check) for truncating stores; its bf16
                # mode rounds like HF's eager ops: measured bit-exact (0 ulp, 0 elements differ) like the cpu twin.
                assert float((diff / ulp).max()) <= 1, backend
                assert float((diff != 0).float().mean()) < 0.02, backend


def test_inplace(device):
    gen = seeded(6)
    qkv = rope_input(2, 4, 7, 32, torch.float16, "bshd", gen, device)  # q: 4 heads, k: 2, v: 1 of one projection
    w = [qt.norm_weight(32, 0.0, gen, device) for _ in range(2)]
    inv = rope_inv_freq(32, device=device)
    cos, sin = qt.angle_tables(rope_reference.token_positions(2, 4), inv)
    refs = [qt.oracle(x, wx, EPS, cos, sin) for x, wx in ((qkv[:, :, :4], w[0]), (qkv[:, :, 4:6], w[1]))]
    for backend in kernel_backends(device):
        with poisoned_outputs():
            want = qk_norm_rope(qkv[:, :, :4], qkv[:, :, 4:6], *w, EPS, inv_freq=inv, backend=backend)
        for out, ref in zip(want, refs):  # what the in-place result must equal is itself right
            check_forward(out, ref, torch.float16, "fp32", backend, device, 32, False)
        buf = qkv.clone()
        out = qk_norm_rope(buf[:, :, :4], buf[:, :, 4:6], *w, EPS, inv_freq=inv, inplace=True, backend=backend)
        assert out[0].data_ptr() == buf.data_ptr()
        assert torch.equal(buf[:, :, :4], want[0]) and torch.equal(buf[:, :, 4:6], want[1])
        assert torch.equal(buf[:, :, 6:], qkv[:, :, 6:]), "v untouched"
    with pytest.raises(ValueError, match="inplace=True is for inference"):
        qk_norm_rope(qkv.clone().requires_grad_(), None, w[0], None, inv_freq=inv, inplace=True)


def test_inplace_rejects_shared_memory(device):
    """In place, each element is rotated once: an expanded k, or q and k sharing memory, is refused before any
    kernel (the kernels would rotate such elements twice)."""
    w, inv = torch.ones(8, device=device), rope_inv_freq(8, device=device)
    q = torch.randn(1, 3, 2, 8, device=device)
    cases = [(torch.randn(1, 3, 1, 8, device=device).expand(1, 3, 2, 8), "needs k whose elements do not share memory"),
             (q, "needs q and k in separate memory"), (q[:, :, 1:], "needs q and k in separate memory")]
    for backend in kernel_backends(device):
        for k, match in cases:
            with KernelCalls() as mode, pytest.raises(ValueError, match=match):
                qk_norm_rope(q, k, w, w, inv_freq=inv, inplace=True, backend=backend)
            assert mode.calls == [], backend


def test_inplace_bumps_version_counters(device):
    """A tensor that autograd saved and qk_norm_rope then overwrote in place fails the backward's check instead of
    being used silently (the C++ op's mutation bumps no version counter by itself)."""
    inv = rope_inv_freq(8, device=device)
    for backend in kernel_backends(device):
        w = torch.randn(1, 3, 2, 8, device=device, requires_grad=True)
        q = torch.randn(1, 3, 2, 8, device=device)
        y = q * w  # saves q for w's gradient
        with torch.no_grad():
            qk_norm_rope(q, None, torch.ones(8, device=device), None, inv_freq=inv, inplace=True, backend=backend)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_backward_without_weights(device):
    """Plain RoPE through qk_norm_rope (no weights, as the serving compat layer calls it) backpropagates on every
    twin, and the absent weight gradients are what the C++ op returns (empty, compute dtype), in the fake and Triton
    ops too."""
    gen = seeded(11)
    q = rope_input(2, 3, 4, 8, torch.float32, "bshd", gen, device).requires_grad_()
    k = rope_input(2, 3, 2, 8, torch.float32, "bshd", gen, device).requires_grad_()
    inv = rope_inv_freq(8, device=device)
    cot = [torch.randn(t.shape, generator=gen).to(device) for t in (q, k)]
    x64 = [t.detach().cpu().double().requires_grad_() for t in (q, k)]
    positions = torch.arange(3).expand(2, 3)
    want = torch.autograd.grad([rope_reference.rope(x, inv.cpu(), positions) for x in x64], x64,
                               [c.cpu().double() for c in cot])
    for backend in kernel_backends(device):
        with poisoned_outputs():
            got = torch.autograd.grad(qk_norm_rope(q, k, inv_freq=inv, backend=backend), (q, k), cot)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.cpu().double(), w, rtol=0, atol=1e-6, msg=backend)
        op = getattr(torch.ops.ropewkv, "qk_norm_rope_backward" + ("_triton" if backend == "triton" else ""))
        x = torch.randn(2, 3, 2, 8, dtype=torch.bfloat16, device=device)
        for q_weight, kx in ((None, x[:, :, :1].clone()), (torch.ones(8, device=device), None)):  # no norm; q's only
            args = (torch.randn_like(x), None if kx is None else torch.randn_like(kx), x, kx, q_weight, None, EPS, 0.0,
                    inv, None, None, None, None, None, None, 8, False, 1.0, 0)
            torch.library.opcheck(op.default, args, test_utils=("test_faketensor",))


@pytest.mark.parametrize("source", ["angle", "table", "cache"])
def test_gradcheck_fp64_cpu_twin(source):
    gen = seeded(7)
    q = rope_input(1, 3, 2, 12, torch.float64, "bshd", gen).requires_grad_()
    k = rope_input(1, 3, 1, 12, torch.float64, "bshd", gen).requires_grad_()
    wq = qt.norm_weight(12, 1.0, gen).double().requires_grad_()
    wk = qt.norm_weight(12, 1.0, gen).double().requires_grad_()
    if source == "angle":
        kwargs = dict(inv_freq=rope_inv_freq(8), seqlen_offsets=5, attention_scaling=0.8)
    elif source == "table":
        kwargs = dict(cos=torch.randn(1, 3, 8, dtype=torch.float64, generator=gen),
                      sin=torch.randn(1, 3, 8, dtype=torch.float64, generator=gen))
    else:
        kwargs = dict(cos_sin_cache=torch.randn(10, 8, dtype=torch.float64, generator=gen),
                      positions=torch.tensor([[9, 0, 4]]))
    for interleaved in (False, True):
        assert torch.autograd.gradcheck(
            lambda *t: qk_norm_rope(*t, 1e-5, weight_offset=1.0, interleaved=interleaved, backend="cpu", **kwargs),
            (q, k, wq, wk))


def test_weight_gradients_are_deterministic_and_thread_independent(device):
    """The weight gradients reduce over tokens through fixed 16-token chunks added in chunk order: the same bits on
    every run, and on the CPU for any thread count. 2 x 20 tokens: three chunks, one across the two sequences, the
    last one partial (the interpreted Triton twin costs per token)."""
    gen = seeded(8)
    q = rope_input(2, 20, 4, 64, torch.bfloat16, "bshd", gen, device).requires_grad_()
    k = rope_input(2, 20, 2, 64, torch.bfloat16, "bshd", gen, device).requires_grad_()
    w = [qt.norm_weight(64, 0.0, gen, device).requires_grad_() for _ in range(2)]
    inv = rope_inv_freq(64, device=device)

    def grads(backend):
        out = qk_norm_rope(q, k, *w, inv_freq=inv, backend=backend)
        return torch.autograd.grad(out, [q, k, *w], [torch.ones_like(out[0]), out[1].detach()])

    for backend in kernel_backends(device):
        first = grads(backend)
        for _ in range(3):
            assert all(torch.equal(a, b) for a, b in zip(first, grads(backend))), backend
        if backend == "cpu":
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                assert all(torch.equal(a, b) for a, b in zip(first, grads(backend)))
            finally:
                torch.set_num_threads(threads)


def test_compiles_fullgraph(device):
    torch._dynamo.reset()
    gen = seeded(9)
    q = rope_input(1, 4, 2, 32, torch.float32, "bshd", gen, device).requires_grad_()
    k = rope_input(1, 4, 1, 32, torch.float32, "bshd", gen, device).requires_grad_()
    w = [qt.norm_weight(32, 0.0, gen, device).requires_grad_() for _ in range(2)]
    inv = rope_inv_freq(32, device=device)
    for backend in kernel_backends(device):
        def f(a, b, c, d):
            oq, ok = qk_norm_rope(a, b, c, d, inv_freq=inv, backend=backend)
            return (oq * oq).sum() + ok.sum()

        want = torch.autograd.grad(f(q, k, *w), [q, k, *w])
        got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, *w), [q, k, *w])
        assert all(torch.equal(a, b) for a, b in zip(got, want)), backend


def test_compiles_fullgraph_with_cache_positions(device):
    """Under torch.compile the host check of the positions (data-dependent) is skipped and the kernels clamp them
    into the cache, as they do on CUDA: no read outside it."""
    q = rope_input(1, 3, 2, 8, torch.float32, "bshd", seeded(10), device)
    cache = reference.cos_sin_cache(rope_inv_freq(8), 4).to(device)
    for backend in kernel_backends(device):
        def f(positions):
            return qk_norm_rope(q, cos_sin_cache=cache, positions=positions, backend=backend)

        torch._dynamo.reset()
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(torch.tensor([[0, 9, -5]], device=device))
        assert torch.equal(got, f(torch.tensor([[0, 3, 0]], device=device))), backend


def test_reference_keeps_fp64_tables():
    """backend="reference" computes fp64 input in fp64: fp64 cos/sin tables and caches are not rounded to fp32."""
    gen = seeded(12)
    q = torch.randn(1, 5, 2, 8, dtype=torch.float64, generator=gen)
    angle = torch.rand(1, 5, 4, dtype=torch.float64, generator=gen) * 100
    cos, sin = torch.cat((angle.cos(),) * 2, -1), torch.cat((angle.sin(),) * 2, -1)
    want = qt.oracle(q, None, EPS, cos, sin)
    cache = torch.cat((angle[0].cos(), angle[0].sin()), -1)  # row p: the cos half, then the sin half
    for kwargs in (dict(cos=cos, sin=sin), dict(cos_sin_cache=cache, positions=torch.arange(5))):
        torch.testing.assert_close(qk_norm_rope(q, backend="reference", **kwargs), want, rtol=0, atol=1e-14)


def test_cache_positions_out_of_range():
    """Checked on the CPU with a clear error; below the Python check the C++ kernel clamps (never reads outside)."""
    q = torch.randn(1, 3, 2, 8)
    cache = reference.cos_sin_cache(rope_inv_freq(8), 4)
    for bad in ([0, 4, 1], [-1, 0, 1]):
        with pytest.raises(ValueError, match=r"positions must lie in \[0, 4\)"):
            qk_norm_rope(q, cos_sin_cache=cache, positions=torch.tensor([bad]))
    positions = torch.tensor([[0, 1 << 40, -5]])
    out = torch.ops.ropewkv.qk_norm_rope(q, None, None, None, 1e-6, 0.0, None, None, None, cache, positions, None,
                                         None, 8, False, 1.0, 0)[0]
    clamped = qk_norm_rope(q, cos_sin_cache=cache, positions=torch.tensor([[0, 3, 0]]))
    assert torch.equal(out, clamped)


def _call(dev, backend, **changes):
    q = rope_input(2, 4, 2, 8, torch.float32, generator=seeded(0), device=dev)
    k = rope_input(2, 4, 1, 8, torch.float32, generator=seeded(1), device=dev)
    args = dict(q=q, k=k, q_weight=torch.ones(8, device=dev), k_weight=torch.ones(8, device=dev),
                inv_freq=rope_inv_freq(8, device=dev), backend=backend)
    args.update(changes)
    return lambda: qk_norm_rope(args.pop("q"), args.pop("k"), args.pop("q_weight"), args.pop("k_weight"), **args)


META = torch.device("meta")
BAD = [
    ("two-sources", dict(cos=torch.ones(2, 4, 8)), ValueError, "exactly one cos/sin source"),
    ("no-source", dict(inv_freq=None), ValueError, "exactly one cos/sin source"),
    ("weight-shape", dict(q_weight=torch.ones(6)), ValueError, r"q_weight must be a float tensor of shape \[head_dim = 8\]"),
    ("weight-int", dict(k_weight=torch.ones(8, dtype=torch.int32)), ValueError, "k_weight must be a float tensor"),
    ("weight-alone", dict(k_weight=None), ValueError, "q_weight and k_weight must be given together"),
    ("weight-device", dict(q_weight=torch.ones(8, device=META)), ValueError, "q_weight is on meta"),
    ("eps", dict(eps=-1.0), ValueError, "eps must be a float >= 0"),
    ("offset", dict(weight_offset="1"), TypeError, "weight_offset must be a float"),
    ("cos-alone", dict(inv_freq=None, cos=torch.ones(2, 4, 8)), ValueError, "cos and sin must be given together"),
    ("sin-alone", dict(inv_freq=None, sin=torch.ones(2, 4, 8)), ValueError, "cos and sin must be given together"),
    ("inv-freq-requires-grad", dict(inv_freq=rope_inv_freq(8).requires_grad_()), NotImplementedError,
     "inv_freq gets no gradient"),
    ("cos-shape", dict(inv_freq=None, cos=torch.ones(3, 4, 8), sin=torch.ones(3, 4, 8)), ValueError,
     "cos of shape .* does not broadcast"),
    ("cos-int", dict(inv_freq=None, cos=torch.ones(2, 4, 8).long(), sin=torch.ones(2, 4, 8).long()), TypeError,
     "cos must be a float tensor"),
    # A 0-d table was read as rotating no dims (q came back unrotated), an odd width blamed rotary_dim.
    ("cos-0d", dict(inv_freq=None, cos=torch.tensor(0.5), sin=torch.tensor(0.0)), ValueError,
     r"cos and sin must be \[\.\.\., R\] tables with an even rotated width R, got cos of shape \(\)"),
    ("cos-odd-width", dict(inv_freq=None, cos=torch.ones(2, 4, 1), sin=torch.ones(2, 4, 1)), ValueError,
     "an even rotated width R"),
    ("cache-no-positions", dict(inv_freq=None, cos_sin_cache=torch.ones(5, 8)), ValueError,
     "cos_sin_cache needs positions"),
    ("cache-shape", dict(inv_freq=None, cos_sin_cache=torch.ones(5, 7), positions=torch.zeros(4, dtype=torch.long)),
     ValueError, "cos_sin_cache must be a float"),
    ("cache-offsets", dict(inv_freq=None, cos_sin_cache=torch.ones(5, 8), positions=torch.zeros(4, dtype=torch.long),
                           seqlen_offsets=2), ValueError, "explicit positions only"),
    ("rotary-dim-vs-table", dict(inv_freq=None, cos_sin_cache=torch.ones(5, 8), rotary_dim=4,
                                 positions=torch.zeros(4, dtype=torch.long)), ValueError, "must equal the table's"),
    ("table-with-positions", dict(inv_freq=None, cos=torch.ones(2, 4, 8), sin=torch.ones(2, 4, 8),
                                  positions=torch.zeros(4, dtype=torch.long)), ValueError, "cos/sin tables are read"),
    ("cache-scaling", dict(inv_freq=None, cos_sin_cache=torch.ones(5, 8), positions=torch.zeros(4, dtype=torch.long),
                           attention_scaling=2.0), ValueError, "attention_scaling applies to the inv_freq"),
    ("q-int", dict(q=torch.ones(2, 4, 2, 8, dtype=torch.int32)), TypeError, "q must have dtype"),
    ("k-shape", dict(k=torch.ones(2, 5, 1, 8)), ValueError, "must match q"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises_before_any_kernel(device, case):
    _, changes, error, pattern = case
    for backend in kernel_backends(device):
        moved = {n: v.to(device) if isinstance(v, torch.Tensor) and v.device != META else v for n, v in changes.items()}
        call = _call(device, backend, **moved)
        with KernelCalls() as mode, pytest.raises(error, match=pattern):
            call()
        assert mode.calls == [], f"{backend}: a kernel ran before the error: {mode.calls}"


def test_zero_size(device):
    inv = rope_inv_freq(16, device=device)
    for backend in kernel_backends(device):
        for shape in ((0, 4, 2, 16), (2, 0, 2, 16), (2, 4, 0, 16)):
            q = torch.randn(shape, device=device, dtype=torch.bfloat16)
            oq, ok = qk_norm_rope(q, q, torch.ones(16, device=device), torch.ones(16, device=device), inv_freq=inv,
                                  backend=backend)
            assert oq.shape == shape and ok.dtype == torch.bfloat16


def test_physical_shapes_cover_the_layouts():
    assert set(PHYSICAL_SHAPE) | {"thd"} == set(rope_reference.LAYOUTS)
