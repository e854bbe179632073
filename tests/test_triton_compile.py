"""Every Triton kernel compiles for sm_90 on this GPU-less machine (see triton_sm90.py), also in variants that the
static report (tools/static_report: the main specialisations) leaves out: every decay convention, varlen, an initial
state, an odd length. RoPE's PTX is inspected in test_triton_rope_kernel.py."""
import pytest

from ropewkv.triton_kernels import _common
from tools.static_report.kernels import TRITON, wkv7_launches
from triton_sm90 import captured_launches, ptx_for_sm90, run_without_interpreter


def wkv7_both(**variant):
    for backward in (False, True):
        wkv7_launches(64, 1, backward=backward, tokens=5, **variant)


CASES = {
    "decay": lambda: [TRITON[f"log_decay {d} bf16"].launch() for d in ("fwd", "bwd")],
    "wkv7 loglog fp32": lambda: wkv7_both(decay="loglog", with_state=True),
    "wkv7 raw bf16 varlen": lambda: wkv7_both(decay="raw", low_precision=True, varlen=True),
    "wkv7 log fp32 varlen": lambda: wkv7_both(decay="log", with_state=True, varlen=True),
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
