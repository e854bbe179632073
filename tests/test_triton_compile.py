"""Every Triton kernel compiles for sm_90 on this GPU-less machine (see triton_sm90.py); RoPE's PTX is inspected in
test_triton_rope_kernel.py."""
import pytest
import torch

from ropewkv.triton_kernels import _common
from ropewkv.triton_kernels import decay as decay_kernels
from ropewkv.triton_kernels import qk_norm_rope as qk_kernels
from ropewkv.triton_kernels.rwkv7 import recurrent as rwkv7_kernels
from triton_sm90 import captured_launches, ptx_for_sm90, run_without_interpreter


def decay_launches():
    x = torch.empty(4, dtype=torch.bfloat16)
    out = torch.empty(4)
    decay_kernels.log_decay_forward(x, out)
    decay_kernels.log_decay_backward(out, x, x)


def wkv7_launches(decay, low_precision, with_state, varlen):
    shape = (1, 5, 1, 64)
    r = torch.empty(shape, dtype=torch.bfloat16)
    state = torch.empty(1, 1, 64, 64)
    cu = torch.tensor([0, 5], dtype=torch.int32) if varlen else None
    s0 = state if with_state else None
    checkpoints = torch.empty(rwkv7_kernels.checkpoint_slots(5, 1), 1, 64, 64)
    rwkv7_kernels.wkv7_forward(r, r, r, r, r, r, s0, cu, r, state, checkpoints, decay, low_precision)
    rwkv7_kernels.wkv7_backward(r, r, r, r, r, r, cu, checkpoints, r, s0, [r] * 6, state, decay, low_precision)


def qk_norm_rope_launches(source, interleaved, low_precision):
    """Forward and backward of the fused QK-norm + RoPE with one cos/sin source (weights: Gemma-3's offset)."""
    q, k = torch.empty(1, 3, 4, 80, dtype=torch.bfloat16), torch.empty(1, 3, 2, 80, dtype=torch.bfloat16)
    w = torch.empty(80)
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
    "decay": decay_launches,
    "wkv7 loglog fp32": lambda: wkv7_launches("loglog", False, True, False),
    "wkv7 raw bf16 varlen": lambda: wkv7_launches("raw", True, False, True),
    "wkv7 log fp32 varlen": lambda: wkv7_launches("log", False, True, True),
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
