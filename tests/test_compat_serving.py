"""ropewkv.compat.vllm and ropewkv.compat.flashinfer against fp64 transcriptions of vLLM's and FlashInfer's formulas.

The real libraries do not run on this CPU-only CI: vLLM's wheel pins a CUDA build of torch and its ops live in its
compiled `_C` extension; FlashInfer's RoPE functions JIT-compile CUDA kernels. So the oracles below transcribe, in
fp64, what their sources and docs specify (vLLM csrc/pos_encoding_kernels.cu and RotaryEmbedding._compute_cos_sin_cache;
FlashInfer flashinfer/rope.py and include/flashinfer/pos_enc.cuh), written here independently of ropewkv's references.
Where a library imports (a GPU machine with it installed), test_real_* compares against it directly.
"""
import math

import pytest
import torch

from ropewkv.compat import flashinfer, vllm
from ropewkv.testing import poisoned_outputs, seeded
from ropewkv.testing.rope import rope_input, rotation_ulp_error
from conftest import kernel_backends


def bound(dtype, backend, device):
    """Max ulps at the pair norm for fp32 math on given cos/sin: fp32 products and a sum (~1.5 ulp), or one rounding
    to bf16/fp16 (0.5 + a sliver; the Triton interpreter truncates: +1)."""
    if dtype == torch.float32:
        return 2.0
    return 1.51 if backend == "triton" and device.type == "cpu" else 0.51


def rotate64(x, cos, sin, rot, neox):
    """x [..., H, D] in fp64; cos/sin [..., rot/2] per token: vLLM's apply_token_rotary_embedding / FlashInfer's
    pos_enc, pair by pair."""
    x, out = x.double(), x.double().clone()
    cos, sin = cos.double().unsqueeze(-2), sin.double().unsqueeze(-2)
    half = rot // 2
    a, b = (slice(0, half), slice(half, rot)) if neox else (slice(0, rot, 2), slice(1, rot, 2))
    out[..., a] = x[..., a] * cos - x[..., b] * sin
    out[..., b] = x[..., b] * cos + x[..., a] * sin
    return out


def vllm_cache(rot, max_position, base=10000.0, dtype=torch.float32):
    """vLLM's _compute_cos_sin_cache: inv_freq = 1 / base^(arange(0, rot, 2) / rot) in fp32, t * inv_freq in fp32,
    cat(cos, sin), cast to the model dtype."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
    freqs = torch.einsum("i,j->ij", torch.arange(max_position, dtype=torch.float), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype), inv_freq


def vllm_oracle(positions, x, head_size, cache, neox):
    rows = cache.double()[positions.long()]
    rot = cache.shape[1]
    x4 = x.unflatten(-1, (-1, head_size)) if x.dim() == positions.dim() + 1 else x
    return rotate64(x4.cpu(), rows[..., : rot // 2], rows[..., rot // 2 :], rot, neox).reshape(x.shape)


def pair_error(out, ref, head_size, rot, neox):
    return rotation_ulp_error(out.unflatten(-1, (-1, head_size)) if out.shape[-1] != head_size else out,
                              ref.unflatten(-1, (-1, head_size)) if ref.shape[-1] != head_size else ref, rot,
                              not neox)


@pytest.mark.parametrize("shape", ["flat", "heads", "batched_flat", "batched_heads"])
@pytest.mark.parametrize("neox", [True, False])
def test_vllm_rotary_embedding(device, shape, neox):
    gen = seeded(1)
    head_size, rot, hq, hk, max_pos = 80, 64, 4, 2, 300
    batched = shape.startswith("batched")
    lead = (2, 3) if batched else (6,)
    positions = torch.randint(0, max_pos, lead, generator=gen)
    cache, _ = vllm_cache(rot, max_pos, dtype=torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(*lead, hq, head_size, generator=gen).to(dtype)
        k = torch.randn(*lead, hk, head_size, generator=gen).to(dtype)
        if shape.endswith("flat"):
            q, k = q.flatten(-2), k.flatten(-2)
        for backend in kernel_backends(device):
            for key in (k, None):
                qd, kd = q.clone().to(device), None if key is None else key.clone().to(device)
                assert vllm.rotary_embedding(positions.to(device), qd, kd, head_size, cache.to(device), neox,
                                             backend=backend) is None
                for out, x in ((qd, q), (kd, key)):
                    if x is None:
                        continue
                    ref = vllm_oracle(positions, x, head_size, cache, neox)
                    assert pair_error(out, ref, head_size, rot, neox) <= bound(dtype, backend, device), backend
                    tail = out.unflatten(-1, (-1, head_size))[..., rot:] if out.shape[-1] != head_size else \
                        out[..., rot:]
                    src = x.unflatten(-1, (-1, head_size))[..., rot:] if x.shape[-1] != head_size else x[..., rot:]
                    assert torch.equal(tail.cpu(), src), "dims past rot_dim pass through"


def test_vllm_in_place_on_a_fused_qkv_slice_and_bad_positions(device):
    gen = seeded(2)
    head_size, max_pos = 64, 50
    qkv = torch.randn(5, 8 * head_size, generator=gen).to(device)  # q: 4 heads, k: 2, v: 2
    cache, _ = vllm_cache(head_size, max_pos)
    positions = torch.tensor([0, 7, 49, 3, 3], device=device)
    for backend in kernel_backends(device):
        buf = qkv.clone()
        vllm.rotary_embedding(positions, buf[:, : 4 * head_size], buf[:, 4 * head_size : 6 * head_size], head_size,
                              cache.to(device), True, backend=backend)
        ref = vllm_oracle(positions.cpu(), qkv[:, : 4 * head_size].cpu(), head_size, cache, True)
        assert pair_error(buf[:, : 4 * head_size], ref, head_size, head_size, True) <= 2
        assert torch.equal(buf[:, 6 * head_size :], qkv[:, 6 * head_size :]), "v untouched"
    if device.type == "cpu":
        with pytest.raises(ValueError, match=r"positions must lie in \[0, 50\)"):
            vllm.rotary_embedding(positions + 1, qkv[:, :64].clone(), None, head_size, cache, True)
    with pytest.raises(ValueError, match="not a multiple of head_size"):
        vllm.rotary_embedding(positions, qkv[:, :100].clone(), None, head_size, cache, True)
    with pytest.raises(ValueError, match="query heads 4 must be a multiple of the key heads 3"):
        vllm.rotary_embedding(positions, qkv[:, :256].clone(), qkv[:, :192].clone(), head_size, cache, True)
    # A key of no heads (flat [T, 0] or [T, 0, head_size]) has nothing to rotate (it raised ZeroDivisionError).
    for empty_key in (qkv[:, :0].clone(), qkv[:, :0].clone().unflatten(-1, (0, head_size))):
        query = qkv[:, : 4 * head_size].clone()
        vllm.rotary_embedding(positions, query, empty_key, head_size, cache.to(device), True)
        assert torch.equal(query, buf[:, : 4 * head_size]), "query rotated as with a key"


def test_vllm_inv_freq_variant_fixes_the_bf16_cache(device):
    """vLLM's model-dtype (bf16) cache rounds cos/sin; the in-kernel angle does not. At positions up to 2^17 the
    bf16 cache costs more than one bf16 ulp at the pair norm (measured ~1.6), the exact angle stays correctly rounded."""
    gen = seeded(3)
    head_size, max_pos = 64, 1 << 17
    positions = torch.randint(0, max_pos, (64,), generator=gen)
    positions[:4] = torch.tensor([0, 1, max_pos - 1, 100000])
    cache, inv_freq = vllm_cache(head_size, max_pos, dtype=torch.bfloat16)
    q = torch.randn(64, 4, head_size, generator=gen).to(torch.bfloat16)
    angle = positions.double().unsqueeze(-1) * inv_freq.double()  # fp32 inv_freq, the angle itself exact
    exact = rotate64(q, angle.cos(), angle.sin(), head_size, True)
    for backend in kernel_backends(device):
        with_cache, with_angle = q.clone().to(device), q.clone().to(device)
        vllm.rotary_embedding(positions.to(device), with_cache, None, head_size, cache.to(device), True,
                              backend=backend)
        vllm.rotary_embedding_inv_freq(positions.to(device), with_angle, None, head_size, inv_freq.to(device), True,
                                       backend=backend)
        cache_err = rotation_ulp_error(with_cache, exact, head_size, False)
        angle_err = rotation_ulp_error(with_angle, exact, head_size, False)
        assert angle_err <= bound(torch.bfloat16, backend, device), backend
        assert cache_err > 1.0 > (angle_err if backend != "triton" or device.type != "cpu" else 0.0), backend


def test_vllm_fused_qk_norm_rope(device):
    """Qwen3's per-head RMSNorm (weight times x / rms(x), fp32 statistics) of the q and k heads of a packed qkv, then
    RoPE from the cache, in place; v untouched."""
    gen = seeded(4)
    tokens, hq, hk, hv, d, eps = 5, 4, 2, 2, 64, 1e-6
    qkv = (torch.randn(tokens, (hq + hk + hv) * d, generator=gen) * 3).to(torch.bfloat16)
    wq, wk = (1 + 0.2 * torch.randn(d, generator=gen)).to(torch.bfloat16), (1 + 0.2 * torch.randn(d, generator=gen))
    cache, _ = vllm_cache(d, 100)
    positions = torch.tensor([0, 99, 5, 6, 7])
    heads = qkv.unflatten(-1, (-1, d)).double()

    def norm64(x, w):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()

    rows = cache.double()[positions]
    ref_q = rotate64(norm64(heads[:, :hq], wq), rows[:, : d // 2], rows[:, d // 2 :], d, True)
    ref_k = rotate64(norm64(heads[:, hq : hq + hk], wk), rows[:, : d // 2], rows[:, d // 2 :], d, True)
    for backend in kernel_backends(device):
        buf = qkv.clone().to(device)
        assert vllm.fused_qk_norm_rope(buf, hq, hk, hv, d, eps, wq.to(device), wk.to(device), cache.to(device), True,
                                       positions.to(device), backend=backend) is None
        out = buf.cpu().unflatten(-1, (-1, d))
        assert rotation_ulp_error(out[:, :hq], ref_q, d, False) <= bound(torch.bfloat16, backend, device)
        assert rotation_ulp_error(out[:, hq : hq + hk], ref_k, d, False) <= bound(torch.bfloat16, backend, device)
        assert torch.equal(out[:, hq + hk :], qkv.unflatten(-1, (-1, d))[:, hq + hk :])


def test_in_place_entry_points_bump_version_counters(device):
    """The in-place entry points overwrite query/key: a copy that autograd saved must then fail the backward's check
    instead of being used silently."""
    head_size = 8
    cache, inv_freq = (t.to(device) for t in vllm_cache(head_size, 8))
    positions, ones = torch.arange(3, device=device), torch.ones(head_size, device=device)
    calls = {  # x: [3 tokens, 2 heads * head_size]
        "rotary_embedding": lambda x, b: vllm.rotary_embedding(positions, x, None, head_size, cache, True, backend=b),
        "rotary_embedding_inv_freq": lambda x, b: vllm.rotary_embedding_inv_freq(positions, x, None, head_size,
                                                                                 inv_freq, True, backend=b),
        "fused_qk_norm_rope": lambda x, b: vllm.fused_qk_norm_rope(x, 1, 1, 0, head_size, 1e-6, ones, ones, cache,
                                                                   True, positions, backend=b),
        "apply_rope_with_cos_sin_cache_inplace": lambda x, b: flashinfer.apply_rope_with_cos_sin_cache_inplace(
            positions, x, None, head_size, cache, backend=b),
    }
    for backend in kernel_backends(device):
        for name, call in calls.items():
            w = torch.randn(3, 2 * head_size, device=device, requires_grad=True)
            x = torch.randn(3, 2 * head_size, device=device)
            y = x * w  # saves x for w's gradient
            with torch.no_grad():
                call(x, backend)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.sum().backward()


def test_vllm_rotary_embedding_compiles_fullgraph(device):
    """vLLM compiles its models with this in-place op: the positions' host check (data-dependent) is skipped under
    torch.compile, where the kernels clamp them into the cache."""
    head_size = 16
    cache, _ = vllm_cache(head_size, 8)
    positions = torch.tensor([0, 7, 3], device=device)
    qkv = torch.randn(3, 3 * head_size, generator=seeded(6)).to(device)
    for backend in kernel_backends(device):
        def f(buf):
            vllm.rotary_embedding(positions, buf[:, :head_size], buf[:, head_size:2 * head_size], head_size,
                                  cache.to(device), True, backend=backend)

        want, got = qkv.clone(), qkv.clone()
        f(want)
        torch._dynamo.reset()
        torch.compile(f, fullgraph=True, backend="aot_eager")(got)
        assert torch.equal(got, want), backend


def flashinfer_freq(rot, rope_scale, rope_theta):
    """pos_enc.cuh: freq[i] = rope_rcp_scale * rope_rcp_theta^(2i / rotary_dim), in fp64 here."""
    return (1.0 / rope_scale) * (1.0 / rope_theta) ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)


def flashinfer_llama31_freq(rot, rope_scale, rope_theta, low, high, old_context_len):
    """pos_enc.cuh's llama31 branch: smooth = clamp(freq * old_context_len / (2pi (high - low)) - low / (high - low),
    0, 1); freq = (1 - smooth) * freq * rope_rcp_scale + smooth * freq."""
    freq = flashinfer_freq(rot, 1.0, rope_theta)
    smooth = (freq * old_context_len / (2 * math.pi * (high - low)) - low / (high - low)).clamp(0, 1)
    return (1 - smooth) * freq / rope_scale + smooth * freq


@pytest.mark.parametrize("interleave", [False, True])
def test_flashinfer_pos_ids_and_ragged(device, interleave):
    gen = seeded(5)
    nnz, hq, hk, d, rot = 7, 4, 2, 64, 32
    q = rope_input(1, nnz, hq, d, torch.float16, "thd", gen)
    k = rope_input(1, nnz, hk, d, torch.float16, "thd", gen)
    pos_ids = torch.randint(0, 5000, (nnz,), generator=gen, dtype=torch.int32)
    indptr, offsets = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([10, 400], dtype=torch.int32)
    ragged_pos = torch.tensor([10, 11, 12, 400, 401, 402, 403])
    cases = [
        ("pos_ids", lambda x, y, b, **kw: flashinfer.apply_rope_pos_ids(x, y, pos_ids.to(device), rot, interleave,
                                                                        2.0, 5e5, backend=b),
         pos_ids, flashinfer_freq(rot, 2.0, 5e5)),
        ("pos_ids_inplace", lambda x, y, b: flashinfer.apply_rope_pos_ids_inplace(
            x, y, pos_ids.to(device), rot, interleave, 2.0, 5e5, backend=b), pos_ids, flashinfer_freq(rot, 2.0, 5e5)),
        ("ragged", lambda x, y, b: flashinfer.apply_rope(x, y, indptr.to(device), offsets.to(device), rot, interleave,
                                                         backend=b), ragged_pos, flashinfer_freq(rot, 1.0, 1e4)),
        ("ragged_inplace", lambda x, y, b: flashinfer.apply_rope_inplace(
            x, y, indptr.to(device), offsets.to(device), rot, interleave, backend=b), ragged_pos,
         flashinfer_freq(rot, 1.0, 1e4)),
        ("llama31_pos_ids", lambda x, y, b: flashinfer.apply_llama31_rope_pos_ids(
            x, y, pos_ids.to(device), rot, interleave, backend=b), pos_ids,
         flashinfer_llama31_freq(rot, 8.0, 5e5, 1.0, 4.0, 8192)),
        ("llama31_ragged_inplace", lambda x, y, b: flashinfer.apply_llama31_rope_inplace(
            x, y, indptr.to(device), offsets.to(device), rot, interleave, backend=b), ragged_pos,
         flashinfer_llama31_freq(rot, 8.0, 5e5, 1.0, 4.0, 8192)),
    ]
    for name, call, positions, freq in cases:
        angle = positions.double().unsqueeze(-1) * freq.float().double()  # freq reaches the kernel in fp32
        for backend in kernel_backends(device):
            qd, kd = q.clone().to(device), k.clone().to(device)
            with poisoned_outputs():
                result = call(qd, kd, backend)
            if name.endswith("inplace"):
                assert result is None
                out_q, out_k = qd, kd
            else:
                out_q, out_k = result
                assert torch.equal(qd.cpu(), q), "the out-of-place variant leaves q alone"
            for out, x in ((out_q, q), (out_k, k)):
                ref = rotate64(x, angle.cos(), angle.sin(), rot, not interleave)
                assert rotation_ulp_error(out, ref, rot, interleave) <= bound(torch.float16, backend, device), \
                    (name, backend)


@pytest.mark.parametrize("rotary_dim", [31, -2])
def test_flashinfer_rejects_a_rotary_dim_that_is_not_even(rotary_dim):
    """rotary_dim 31 used to rotate 32 dims (16 frequencies of theta^(2i/31)), -2 none: wrong q/k, silently."""
    q, k = torch.randn(3, 2, 64), torch.randn(3, 1, 64)
    indptr, offsets, pos = torch.tensor([0, 3]), torch.tensor([5]), torch.arange(3)
    calls = [lambda: flashinfer.apply_rope(q, k, indptr, offsets, rotary_dim),
             lambda: flashinfer.apply_rope_inplace(q.clone(), k.clone(), indptr, offsets, rotary_dim),
             lambda: flashinfer.apply_rope_pos_ids(q, k, pos, rotary_dim),
             lambda: flashinfer.apply_rope_pos_ids_inplace(q.clone(), k.clone(), pos, rotary_dim),
             lambda: flashinfer.apply_llama31_rope(q, k, indptr, offsets, rotary_dim),
             lambda: flashinfer.apply_llama31_rope_inplace(q.clone(), k.clone(), indptr, offsets, rotary_dim),
             lambda: flashinfer.apply_llama31_rope_pos_ids(q, k, pos, rotary_dim),
             lambda: flashinfer.apply_llama31_rope_pos_ids_inplace(q.clone(), k.clone(), pos, rotary_dim)]
    for call in calls:
        with pytest.raises(ValueError, match=f"rotary_dim must be a non-negative even int, got {rotary_dim}"):
            call()


def test_flashinfer_llama31_frequencies_match_hf_llama3():
    """The llama31 frequencies equal transformers' own llama3 rope_init (code we did not write), to fp32 rounding."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=131072,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})
    hf, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = flashinfer._llama31_inv_freq(128, 8.0, 5e5, 1.0, 4.0, 8192, "cpu")
    torch.testing.assert_close(ours, hf.float(), rtol=4e-7, atol=0)


def test_flashinfer_cos_sin_cache(device):
    gen = seeded(6)
    head_size, rot, max_pos = 64, 64, 128
    positions = torch.randint(0, max_pos, (6,), generator=gen)
    cache, _ = vllm_cache(rot, max_pos)
    query = torch.randn(6, 3 * head_size, generator=gen).to(torch.bfloat16)
    key = torch.randn(6, 1 * head_size, generator=gen).to(torch.bfloat16)
    for is_neox in (True, False):
        for backend in kernel_backends(device):
            qd, kd = query.to(device), key.to(device)
            q_out, k_out = flashinfer.apply_rope_with_cos_sin_cache(positions.to(device), qd, kd, head_size,
                                                                    cache.to(device), is_neox, backend=backend)
            assert q_out.shape == query.shape and torch.equal(qd.cpu(), query)
            for out, x in ((q_out, query), (k_out, key)):
                ref = vllm_oracle(positions, x, head_size, cache, is_neox)
                assert pair_error(out, ref, head_size, rot, is_neox) <= bound(torch.bfloat16, backend, device)
            qi, ki = query.clone().to(device), key.clone().to(device)
            assert flashinfer.apply_rope_with_cos_sin_cache_inplace(positions.to(device), qi, ki, head_size,
                                                                    cache.to(device), is_neox, backend=backend) is None
            assert torch.equal(qi, q_out) and torch.equal(ki, k_out)
    with pytest.raises(ValueError, match="cos_sin_cache should be float32"):
        flashinfer.apply_rope_with_cos_sin_cache(positions, query, key, head_size, cache.half())


def _real(module: str):
    if not torch.cuda.is_available():
        pytest.skip(f"{module} runs on CUDA only; compared against its fp64 transcription above")
    return pytest.importorskip(module, reason=f"{module} is not installed here")


def test_flashinfer_rope_under_cuda_graph_capture():
    """Serving engines capture their decode steps in CUDA graphs after warm-up calls: the frequencies of the inv_freq
    variants were copied from host memory on every call, which capture does not allow. Replayed on new q, k and
    positions, the graph equals eager calls."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA device")
    gen = seeded(10)

    def fill(q, k, pos):
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        k.copy_(torch.randn(k.shape, generator=gen).to(k.dtype))
        pos.copy_(torch.randint(0, 4000, pos.shape, generator=gen))

    q = torch.empty(8, 4, 64, dtype=torch.bfloat16, device="cuda")
    k = torch.empty(8, 2, 64, dtype=torch.bfloat16, device="cuda")
    pos = torch.empty(8, dtype=torch.int64, device="cuda")
    step = lambda: (flashinfer.apply_rope_pos_ids_inplace(q, k, pos),  # noqa: E731
                    flashinfer.apply_llama31_rope_pos_ids_inplace(q, k, pos))
    fill(q, k, pos)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up, as engines do before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    fill(q, k, pos)
    q_eager, k_eager = q.clone(), k.clone()
    flashinfer.apply_rope_pos_ids_inplace(q_eager, k_eager, pos)
    flashinfer.apply_llama31_rope_pos_ids_inplace(q_eager, k_eager, pos)
    graph.replay()
    assert torch.equal(q, q_eager) and torch.equal(k, k_eager)


def test_real_vllm_rotary_embedding_matches():
    ops = _real("vllm._custom_ops")
    gen = seeded(7)
    positions = torch.randint(0, 200, (9,), generator=gen).cuda()
    cache, _ = vllm_cache(64, 200)
    q = torch.randn(9, 4 * 80, generator=gen).to(torch.bfloat16).cuda()
    theirs, ours = q.clone(), q.clone()
    ops.rotary_embedding(positions, theirs, None, 80, cache.cuda(), True)
    vllm.rotary_embedding(positions, ours, None, 80, cache.cuda(), True)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)  # both: fp32 math on the same cache, one rounding


def test_real_flashinfer_pos_ids_matches():
    fi = _real("flashinfer")
    gen = seeded(8)
    q = torch.randn(9, 4, 64, generator=gen).to(torch.float16).cuda()
    pos = torch.randint(0, 2000, (9,), generator=gen, dtype=torch.int32).cuda()
    theirs = fi.apply_rope_pos_ids(q, q, pos)[0]
    ours = flashinfer.apply_rope_pos_ids(q, q, pos)[0]
    # FlashInfer's __sincosf of an fp32 angle against our exactly reduced one: at positions < 2000 within an ulp
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=0, atol=2e-3 * q.abs().max().item())
