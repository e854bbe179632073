"""The references agree with independent formulations in fp64."""
import pytest
import torch

from ropewkv.reference import rope as rope_ref
from ropewkv.reference import rwkv7 as rwkv_ref
from ropewkv.testing import seeded
from ropewkv.testing.rwkv7 import rwkv7_inputs

F64 = torch.float64


def rope_as_complex(x, positions, inv_freq, interleaved, scaling):
    """RoPE as complex multiplication of (x1 + i x2) by scaling * e^{i theta}, pairs per style."""
    half = inv_freq.shape[0]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    if interleaved:
        z = torch.view_as_complex(rot.reshape(*rot.shape[:-1], half, 2).contiguous())
    else:
        z = torch.complex(rot[..., :half], rot[..., half:])
    theta = positions.to(F64)[..., None, None] * inv_freq.to(F64)  # [B, S, 1, half]
    z = z * torch.polar(torch.full_like(theta, scaling), theta)
    if interleaved:
        out = torch.view_as_real(z).flatten(-2)
    else:
        out = torch.cat([z.real, z.imag], dim=-1)
    return torch.cat([out, rest], dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [64, 24])
def test_rope_matches_complex_multiplication(interleaved, rotary_dim):
    gen = seeded(1)
    x = torch.randn(2, 7, 3, 64, dtype=F64, generator=gen)
    inv_freq = rope_ref.default_inv_freq(rotary_dim)
    positions = rope_ref.token_positions(2, 7, seqlen_offsets=torch.tensor([5, 1000]))
    ours = rope_ref.rope(x, inv_freq, positions, interleaved=interleaved, attention_scaling=0.7)
    expected = rope_as_complex(x, positions, inv_freq, interleaved, 0.7)
    torch.testing.assert_close(ours, expected, rtol=1e-13, atol=1e-13)
    assert torch.equal(ours[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("layout", ["bhsd", "sbhd"])
def test_rope_layouts_are_views_of_bshd(layout):
    x = torch.randn(2, 5, 3, 16, dtype=F64, generator=seeded(2))
    inv_freq = rope_ref.default_inv_freq(16)
    positions = rope_ref.token_positions(2, 5)
    expected = rope_ref.rope(x, inv_freq, positions)
    moved = x.transpose(1, 2) if layout == "bhsd" else x.transpose(0, 1)
    out = rope_ref.rope(moved.contiguous(), inv_freq, positions, layout=layout)
    assert out.shape == moved.shape  # same shape as the input (was an assert_close with atol=inf)
    torch.testing.assert_close(out.transpose(1, 2) if layout == "bhsd" else out.transpose(0, 1), expected)


def test_token_positions_offsets_and_varlen():
    pos = rope_ref.token_positions(2, 3, seqlen_offsets=torch.tensor([0, 10]))
    assert pos.tolist() == [[0, 1, 2], [10, 11, 12]]
    assert rope_ref.token_positions(2, 3, positions=torch.tensor([4, 6, 9]), seqlen_offsets=1).tolist() == [
        [5, 7, 10], [5, 7, 10]]
    cu = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    assert rope_ref.token_positions(1, 6, cu_seqlens=cu).tolist() == [0, 1, 0, 1, 2, 0]
    assert rope_ref.token_positions(1, 6, cu_seqlens=cu, seqlen_offsets=torch.tensor([3, 0, 7])).tolist() == [
        3, 4, 0, 1, 2, 7]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offsets on a second device (the GPU machine's decode shapes)")
def test_token_positions_takes_offsets_on_the_gpu():
    """The decode benchmark and the reference backend pass CUDA offsets; the positions are built on the CPU."""
    pos = rope_ref.token_positions(2, 3, seqlen_offsets=torch.tensor([0, 10], device="cuda"))
    assert pos.tolist() == [[0, 1, 2], [10, 11, 12]]


def test_thd_reference_equals_per_sequence_bshd():
    cu = torch.tensor([0, 3, 8])
    x = torch.randn(8, 2, 16, dtype=F64, generator=seeded(3))
    inv_freq = rope_ref.default_inv_freq(16)
    packed = rope_ref.rope(x, inv_freq, rope_ref.token_positions(1, 8, cu_seqlens=cu), layout="thd")
    for start, end in ((0, 3), (3, 8)):
        alone = rope_ref.rope(x[None, start:end], inv_freq, rope_ref.token_positions(1, end - start))
        torch.testing.assert_close(packed[start:end], alone[0])


def test_hf_formula_equals_reference():
    x = torch.randn(2, 3, 5, 32, dtype=F64, generator=seeded(4))  # [B, H, S, D], HF's layout
    inv_freq = rope_ref.default_inv_freq(32)
    positions = rope_ref.token_positions(2, 5)
    cos, sin = rope_ref.cos_sin(positions, inv_freq)
    q, _ = rope_ref.hf_apply_rotary_pos_emb(x, x, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
    torch.testing.assert_close(q, rope_ref.rope(x, inv_freq, positions, layout="bhsd"))


def wkv7_as_matrices(r, w, k, v, a, b, s0, decay):
    """S_t = S_{t-1} (diag(d_t) + a_t b_t^T) + v_t k_t^T, y_t = S_t r_t, one explicit N x N matrix per step."""
    batch, seqlen, heads, n = r.shape
    d = torch.exp(rwkv_ref.log_decay(w.to(F64), decay))
    ys = torch.zeros(batch, seqlen, heads, n, dtype=F64)
    states = s0.to(F64).clone()
    for bi in range(batch):
        for h in range(heads):
            state = states[bi, h]
            for t in range(seqlen):
                col = lambda x: x[bi, t, h].to(F64)[:, None]  # noqa: E731
                transition = torch.diag(d[bi, t, h]) + col(a) @ col(b).T
                state = state @ transition + col(v) @ col(k).T
                ys[bi, t, h] = (state @ col(r))[:, 0]
            states[bi, h] = state
    return ys, states


@pytest.mark.parametrize("decay", rwkv_ref.DECAYS)
def test_wkv7_matches_explicit_matrices(decay):
    inputs = rwkv7_inputs(2, 9, 2, 8, torch.float64, decay, seeded(5), initial_state=True)
    s0 = inputs.pop("initial_state")
    y, final = rwkv_ref.wkv7(**inputs, initial_state=s0, output_final_state=True, decay=decay)
    y_m, final_m = wkv7_as_matrices(*inputs.values(), s0, decay)
    torch.testing.assert_close(y, y_m, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, final_m, rtol=1e-12, atol=1e-12)


def test_wkv7_varlen_equals_separate_sequences():
    cu = torch.tensor([0, 4, 5, 11])
    inputs = rwkv7_inputs(1, 11, 2, 8, torch.float64, "loglog", seeded(6))
    s0 = torch.randn(3, 2, 8, 8, dtype=F64, generator=seeded(7))
    del inputs["initial_state"]
    y, final = rwkv_ref.wkv7(**inputs, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    for n, (start, end) in enumerate(((0, 4), (4, 5), (5, 11))):
        piece = {name: t[:, start:end] for name, t in inputs.items()}
        y_n, final_n = rwkv_ref.wkv7(**piece, initial_state=s0[n : n + 1], output_final_state=True)
        torch.testing.assert_close(y[:, start:end], y_n)
        torch.testing.assert_close(final[n : n + 1], final_n)


def test_decay_conventions_agree():
    x = torch.linspace(-8, 4, 101, dtype=F64)
    log_w = rwkv_ref.log_decay(x, "raw")
    for convention in ("loglog", "log"):
        w = rwkv_ref.convert_w(x, "raw", convention)
        torch.testing.assert_close(rwkv_ref.log_decay(w, convention), log_w, rtol=1e-14, atol=0)
    # The note's identity: w_loglog = -softplus(-x) - 0.5 gives the same decay as raw x.
    w_loglog = -torch.nn.functional.softplus(-x) - 0.5
    torch.testing.assert_close(rwkv_ref.log_decay(w_loglog, "loglog"), log_w, rtol=1e-14, atol=0)
    assert bool(((log_w > -0.6066) & (log_w < 0)).all())


def test_step_equals_one_token_recurrence():
    inputs = rwkv7_inputs(2, 1, 3, 8, torch.float64, "log", seeded(8), initial_state=True)
    s0 = inputs.pop("initial_state").to(F64)
    y, final = rwkv_ref.wkv7(**inputs, initial_state=s0, output_final_state=True, decay="log")
    y_step, state = rwkv_ref.wkv7_step(*(t[:, 0] for t in inputs.values()), s0, decay="log")
    torch.testing.assert_close(y[:, 0], y_step, rtol=0, atol=0)
    torch.testing.assert_close(final, state, rtol=0, atol=0)
