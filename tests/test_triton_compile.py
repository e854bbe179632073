"""Every Triton kernel compiles for sm_90 on this GPU-less machine (see triton_sm90.py), also in variants that the
static report (tools/static_report: the main specialisations) leaves out: every decay convention, varlen, an initial
state, an odd length. RoPE's PTX is inspected in test_triton_rope_kernel.py."""
import pytest
import torch

from ropewkv.triton_kernels import _common
from ropewkv.triton_kernels import qk_norm_rope as qk_kernels
from tools.static_report.kernels import TRITON, wkv7_launches
from triton_sm90 import captured_launches, ptx_for_sm90, run_without_interpreter


def wkv7_both(n=64, tokens=5, **variant):
    for backward in (False, True):
        wkv7_launches(n, 1, backward=backward, tokens=tokens, **variant)


def qk_norm_rope_launches(source, interleaved, low_precision, head_dim=80):
    """Forward and backward of the fused QK-norm + RoPE with one cos/sin source (weights: Gemma-3's offset), rotary
    dim 64 of head_dim (80: a pass-through rest; 64: full rotary, where the head block is 2048 // 65 heads at most)."""
    q, k = torch.empty(1, 3, 32, head_dim, dtype=torch.bfloat16), torch.empty(1, 3, 2, head_dim, dtype=torch.bfloat16)
    w = torch.empty(head_dim)
    positions = torch.zeros(1, 3, dtype=torch.int64)
    sources = {"angle": dict(inv_freq=torch.empty(32)),
               "table": dict(cos=torch.empty(1, 3, 64), sin=torch.empty(1, 3, 64)),
               "cache": dict(cache=torch.empty(10, 64), positions=positions)}[source]
    args = dict(inv_freq=None, cos=None, sin=None, cache=None, positions=None, seqlen_offsets=None, cu_seqlens=None)
    args.update(sources)
    qk_kernels.forward(q, k, q, k, w, w, 1e-6, 1.0, *args.values(), 64, interleaved, 1.0, low_precision)
    qk_kernels.backward(q, k, q, k, q, k, w, w, 1e-6, 1.0, *args.values(), 64, interleaved, 1.0)


CASES = {
    "qk_norm_rope angle bf16-mode": lambda: qk_norm_rope_launches("angle", False, True),
    "qk_norm_rope table interleaved": lambda: qk_norm_rope_launches("table", True, False),
    "qk_norm_rope cache": lambda: qk_norm_rope_launches("cache", False, False),
    "qk_norm_rope full rotary": lambda: qk_norm_rope_launches("angle", False, False, head_dim=64),
    "decay": lambda: [TRITON[f"log_decay {d} bf16"].launch() for d in ("fwd", "bwd")],
    "wkv7 loglog fp32": lambda: wkv7_both(decay="loglog", with_state=True),
    "wkv7 raw bf16 varlen": lambda: wkv7_both(decay="raw", low_precision=True, varlen=True),
    "wkv7 log fp32 varlen": lambda: wkv7_both(decay="log", with_state=True, varlen=True),
    # A chunk's tokens or more: the forward's decays computed once per chunk (STAGED).
    "wkv7 staged raw bf16 varlen": lambda: wkv7_both(tokens=16, decay="raw", low_precision=True, varlen=True),
    "wkv7 N32 staged log fp32": lambda: wkv7_both(32, tokens=16, decay="log", with_state=True),
    # N = 128: the forward's rows split over one-warp programs; N = 256: the backward's too, and the kernel that adds
    # their partial sums.
    "wkv7 N128 raw bf16 varlen": lambda: wkv7_both(128, decay="raw", low_precision=True, varlen=True),
    "wkv7 N256 log fp32": lambda: wkv7_both(256, decay="log", with_state=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernels_compile_for_sm90(case):
    if _common.INTERPRETING:
        run_without_interpreter(__file__, f"test_kernels_compile_for_sm90[{case}]")
        return
    with captured_launches() as launches:
        CASES[case]()
    assert launches, "the launcher launched nothing"
    for launch in launches:
        assert ".entry" in ptx_for_sm90(*launch)


def test_log_decay_has_no_approximate_exp_or_division():
    """Compiled, tl.exp is ex2.approx(x * log2 e) (18 ulps at x = -87 on the H200) and `/` is div.full.f32 (2 ulps):
    the log decay takes the shared exp polynomial and div_rn instead (triton_kernels/decay.py)."""
    if _common.INTERPRETING:
        run_without_interpreter(__file__, "test_log_decay_has_no_approximate_exp_or_division")
        return
    with captured_launches() as launches:
        CASES["decay"]()
    assert len(launches) == 2
    for launch in launches:
        ptx = ptx_for_sm90(*launch)
        assert "div.rn.f32" in ptx
        for approximate in ("ex2.approx", "div.full", "div.approx", "rcp.approx"):
            assert approximate not in ptx, (launch[0].fn.__name__, approximate)


def test_wkv7_forward_state_layout_ignores_the_initial_state():
    """The sequential forward carries its state in r's register layout with or without an fp32 initial state
    (_wkv7_fwd_kernel): given one, the state once took the fp32 load's layout, whose row sums cross more lanes (at
    N = 64, bf16 I/O: 64 instead of 24 shuffles and 475 instead of 434 instructions per token)."""
    if _common.INTERPRETING:
        run_without_interpreter(__file__, "test_wkv7_forward_state_layout_ignores_the_initial_state")
        return
    shuffles = []
    for with_state in (False, True):
        with captured_launches() as launches:
            wkv7_launches(64, 1, tokens=5, with_state=with_state)
        shuffles.append(ptx_for_sm90(*launches[0]).count("shfl.sync"))
    assert shuffles[0] == shuffles[1], shuffles
