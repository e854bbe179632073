"""The static performance report (tools/static_report) reads what it should from SASS, and its checks can fail.

The SASS reader is tested on hand-written cuobjdump text (no toolkit needed); the checks on kernels compiled here:
tests/data/static_report_kernels.cu with nvcc (2-byte accesses and forced spills, against a 16-byte copy), and the
Triton RoPE kernels (Triton's own ptxas, no nvcc needed).
"""
import dataclasses
import os
import re
import subprocess
import tempfile
from collections import Counter

import pytest

from ropewkv.triton_kernels import _common
from tools.static_report import cuda, kernels, model, report, sass
from triton_sm90 import run_without_interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_nvcc = pytest.mark.skipif(cuda.nvcc() is None, reason="nvcc not found: the CUDA half of the static "
                                "report cannot run here (CI and the GPU machine have it)")

# One loop (0x40-0x100) whose iteration makes or skips a 2-byte copy beside its 16-byte accesses, with a 64-bit
# division whose slow path is a CALL to out-of-line code after EXIT, and a barrier; a trailing self-branch, as nvcc
# pads every function.
SASS = """
        Function : kernel
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;
        /*0020*/               @P0 EXIT ;
        /*0030*/                   MOV R2, RZ ;
        /*0040*/                   ISETP.NE.AND P1, PT, R2, RZ, PT ;
        /*0050*/              @!P1 BRA 0x80 ;
        /*0060*/                   CALL.REL.NOINC 0x120 ;
        /*0070*/                   BRA 0x90 ;
        /*0080*/                   IMAD R3, R2, R2, RZ ;
        /*0090*/               @P1 BRA 0xc0 ;
        /*00a0*/                   LDG.E.U16 R4, desc[UR4][R6.64] ;
        /*00b0*/                   STG.E.U16 desc[UR4][R8.64], R4 ;
        /*00c0*/                   LDG.E.128 R4, desc[UR4][R6.64] ;
        /*00d0*/                   LDG.E.128 R8, desc[UR4][R6.64+0x10] ;
        /*00e0*/                   STG.E.128 desc[UR4][R6.64], R4 ;
        /*00f0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0100*/               @P2 BRA 0x40 ;
        /*0110*/                   EXIT ;
        /*0120*/                   IADD3 R10, R10, 0x1, RZ ;
        /*0130*/                   IADD3 R10, R10, 0x1, RZ ;
        /*0140*/                   IADD3 R10, R10, 0x1, RZ ;
        /*0150*/                   RET.REL.NODEC R20 0x0 ;
        /*0160*/                   BRA 0x160;
"""


def test_sass_loops_and_paths():
    flow = sass.ControlFlow(sass.parse(SASS)["kernel"])
    assert [(loop.address, loop.innermost) for loop in flow.loops] == [(0x40, True)]  # not the padding self-branch
    paths = flow.paths(flow.loops[0])
    # Fewest instructions per stored total: the division's inline path (1 IMAD) beats the CALL (1 + 4 + BRA).
    assert sorted(paths) == [16, 18]
    assert paths[16].instructions == 9 and paths[16].accesses == {"LDG.128": 2, "STG.128": 1}
    assert paths[18].instructions == 11 and paths[18].accesses == {"LDG.U16": 1, "STG.U16": 1, "LDG.128": 2,
                                                                     "STG.128": 1}
    assert paths[16].barriers == paths[18].barriers == 1
    assert not report.moves_16_bytes(paths[18]) and report.moves_16_bytes(paths[16])
    whole = flow.paths()
    assert min(whole) == 0 and whole[0].instructions == 3 and whole[0].barriers == 0  # the early EXIT


@pytest.fixture(scope="module")
def test_kernels():
    return {k.name: k for k in kernels.cuda_kernels(ROOT, "tests/data/static_report_kernels.cu")}


@needs_nvcc
def test_reports_spills_and_narrow_accesses(test_kernels):
    narrow, wide = test_kernels["narrow_and_spilling"], test_kernels["wide_copy"]
    assert narrow.registers <= 32 and narrow.spill_stores > 0 and narrow.spill_loads > 0
    hot = narrow.hot_loop.work.accesses
    assert hot["LDG.U16"] > 0 and hot["STG.U16"] > 0 and hot["STL.32"] > 0 and hot["LDL.32"] > 0
    assert wide.spill_stores == wide.spill_loads == 0
    assert dict(wide.hot_loop.work.accesses) == {"LDG.128": 1, "STG.128": 1}


@needs_nvcc
def test_sixteen_byte_check_fails_on_narrow_accesses(test_kernels):
    narrow, wide = test_kernels["narrow_and_spilling"], test_kernels["wide_copy"]
    failures = report.sixteen_byte_failures([narrow, wide], not_yet=set())
    assert len(failures) == 1 and failures[0].startswith(narrow.key) and "LDG.U16" in failures[0]
    assert report.sixteen_byte_failures([narrow], not_yet={narrow.key}) == []
    stale = report.sixteen_byte_failures([wide], not_yet={wide.key, "gone: kernel<>"})
    assert len(stale) == 2 and "remove it from NOT_YET_16_BYTE" in stale[0] and "no such kernel" in stale[1]


@needs_nvcc
def test_only_the_vector_cuda_rope_instantiations_are_judged(test_kernels):
    """rope_kernel<io_t, P, VECTOR, INTERLEAVED>: the element-wise fallback (VECTOR false, for misaligned inputs) is
    narrow by design; every vector instantiation must be 16-byte."""
    wide = test_kernels["wide_copy"]

    def as_rope(name):
        return dataclasses.replace(wide, source="csrc/rope/rope_bf16.cu", name=name)

    assert report.is_rope(as_rope("rope_kernel<bf16_t, kFP32, true, false>"))
    assert report.is_rope(as_rope("rope_kernel<float, kBF16, true, true>"))
    assert not report.is_rope(as_rope("rope_kernel<bf16_t, kFP32, false, true>"))


def test_vector_decay_kernels_must_move_only_16_byte_vectors():
    """The decay op's vector kernels (bf16 in, fp32 out: they store twice the bytes they load, which RoPE's criterion
    rejects) are judged on every global access being 16 bytes wide; its element-wise fallback is not judged."""
    def decay(name, accesses):
        loaded = sum(16 * n for access, n in accesses.items() if access.startswith("LDG"))
        stored = sum(16 * n for access, n in accesses.items() if access.startswith("STG"))
        path = sass.Path(10, loaded, stored, stored, Counter(accesses))
        return kernels.Kernel(f"csrc/decay/decay.cu: {name}", "cuda", "csrc/decay/decay.cu", name, 32, 0, 0, 0, 0,
                              None, path, [kernels.Loop(0x100, 10, path, path)])

    wide = decay("log_decay_forward_kernel<bf16_t, true>", {"LDG.128": 1, "STG.128": 2})
    assert report.judged_16_byte(wide) and not report.is_rope(wide) and not report.moves_16_bytes(wide.work)
    assert report.sixteen_byte_failures([wide], not_yet=set()) == []
    narrow = decay("log_decay_forward_kernel<bf16_t, true>", {"LDG.U16": 8, "STG.128": 2})
    assert report.sixteen_byte_failures([narrow], not_yet=set())[0].startswith(narrow.key)
    assert not report.judged_16_byte(decay("log_decay_forward_kernel<bf16_t, false>", {"LDG.U16": 1}))


@needs_nvcc
def test_spill_check_fails_on_new_spills(test_kernels):
    narrow, wide = test_kernels["narrow_and_spilling"], test_kernels["wide_copy"]
    toolchain = {"nvcc": "13.0.88", "triton": "3.7.1"}
    clean = {**toolchain, "kernels": [{"key": k.key, "spill_stores": 0, "spill_loads": 0} for k in (narrow, wide)]}
    twins = report.compared_twins(clean, toolchain)
    assert twins == ["cuda", "triton"]
    failures = report.spill_failures([narrow, wide], clean, twins)
    assert len(failures) == 1 and failures[0].startswith(narrow.key) and "none in the baseline" in failures[0]
    assert "new kernel" in report.spill_failures([narrow], {"kernels": []}, twins)[0]
    known = {"kernels": [{"key": narrow.key, "spill_stores": 8, "spill_loads": 8}]}
    assert report.spill_failures([narrow, wide], known, twins) == []
    # A baseline from another nvcc is not compared with (its register allocation differs).
    assert report.compared_twins(dict(clean, nvcc="12.8.93"), toolchain) == ["triton"]


@needs_nvcc
def test_static_shared_check_fails_over_48_kb(test_kernels):
    wide = test_kernels["wide_copy"]
    assert report.static_shared_failures([wide]) == []
    at_limit = dataclasses.replace(wide, shared=report.STATIC_SHARED_LIMIT)
    over = dataclasses.replace(wide, shared=report.STATIC_SHARED_LIMIT + 16)
    assert report.static_shared_failures([at_limit]) == []
    failures = report.static_shared_failures([over])
    assert len(failures) == 1 and failures[0].startswith(wide.key) and "static shared memory" in failures[0]
    # Triton's figure is its whole request, dynamic shared memory included: not judged.
    assert report.static_shared_failures([dataclasses.replace(over, twin="triton")]) == []


def test_readable_cuda_names():
    names = cuda.readable_names(["_ZN7ropewkv4cuda11wkv7_detail14forward_kernelILi64ENS_6bf16_tELNS_9PrecisionE0EEEv"
                                 "NS0_17Wkv7ForwardParamsE"], cuda.enum_names(ROOT))
    assert names == ["forward_kernel<64, bf16_t, kFP32>"]


def test_triton_rope_neox_and_gptj_are_16_byte():
    """The 16-byte check is live for both Triton pair styles (GPT-J loads its pairs as one block and splits them)."""
    if _common.INTERPRETING:
        run_without_interpreter(__file__, "test_triton_rope_neox_and_gptj_are_16_byte")
        return
    neox, gptj = (kernels.triton_kernel(name) for name in ("rope neox bf16", "rope gptj bf16"))
    assert report.sixteen_byte_failures([neox, gptj], not_yet=set()) == []
    # ... and it can fail: a kernel listed as not yet 16-byte that is, is reported.
    assert report.sixteen_byte_failures([gptj], not_yet={gptj.key})


def test_fp32_chunked_wkv7_products_never_use_tensor_cores():
    """precision="fp32" promises exact fp32 products: the chunked Triton kernels' dots take input_precision="ieee"
    (FMA units). A dot left at the GPU default would run on TF32 tensor cores (operands rounded to 10 bits), which the
    interpreter cannot show; the SASS can. The bf16 mode's split products are tensor-core ones by design."""
    if _common.INTERPRETING:
        run_without_interpreter(__file__, "test_fp32_chunked_wkv7_products_never_use_tensor_cores")
        return
    for name in ("wkv7 chunked fwd prep N64 bf16", "wkv7 chunked fwd state N64 bf16", "wkv7 chunked bwd state N64 bf16",
                 "wkv7 chunked bwd N64 bf16"):
        assert kernels.triton_kernel(name).tensor_core == 0, name
    for name in ("wkv7 chunked fwd state N64 bf16-dots", "wkv7 chunked bwd state N64 bf16-dots",
                 "wkv7 chunked bwd N64 bf16-dots"):
        assert kernels.triton_kernel(name).tensor_core > 0, name


@needs_nvcc
def test_cuda_chunked_wkv7_uses_tensor_cores_in_the_bf16_mode_only():
    """The CUDA chunked kernels' precision="bf16" instantiations run their v-dependent products as mma.sync (HMMA):
    the forward's, the backward's state step, and its gradients kernel's row products and contractions. Those of
    precision="fp32" use fp32 FMAs (no tensor-core instruction at all). Checked for every I/O type, at the head sizes
    whose value slices differ from the whole head (N = 32: two of the four warps idle; N = 128: two slices). No spills
    (the gradients kernel's went on 2026-11-29)."""
    for n in (32, 128):
        for source, per_mode in ((f"csrc/wkv7/wkv7_chunked_n{n}.cu", 5),
                                 (f"csrc/wkv7/wkv7_chunked_backward_n{n}.cu", 10)):
            found = kernels.cuda_kernels(ROOT, source)
            modes = {mode: [k for k in found if k.name.endswith(f"{mode}>")] for mode in ("kFP32", "kBF16")}
            assert len(modes["kFP32"]) == len(modes["kBF16"]) == per_mode, [k.name for k in found]  # I/O x w storage
            assert all(k.tensor_core == 0 for k in modes["kFP32"]), source
            assert all(k.tensor_core > 0 for k in modes["kBF16"]), source
            assert all(k.spill_stores == 0 for k in found), source


@needs_nvcc
def test_device_conversions_are_single_instructions():
    """On the device, precision.h rounds fp32 to bf16 / fp16 and widens fp16 with one hardware conversion each (the
    host's integer versions cost 6-15 instructions apiece): precision="bf16"'s arithmetic, rounded after every
    operation, would otherwise be issue-bound."""
    text, _ = cuda.compile_cubin(ROOT, "tests/data/precision_conversions.cu")
    opcodes = {name: [i.opcode for i in instructions] for name, instructions in sass.parse(text).items()}
    bf16 = next(ops for name, ops in opcodes.items() if "rounded_bf16" in name)
    fp16 = next(ops for name, ops in opcodes.items() if "fp16_round_trip" in name)
    assert "F2FP.BF16.F32.PACK_AB" in bf16 and "F2F.BF16.F32" not in bf16  # the ALU's packing conversion
    assert "F2FP.F16.F32.PACK_AB" in fp16 and "HADD2.F32" in fp16
    for ops in (bf16, fp16):  # the integer versions' masks, compares and rounding adds
        assert not [op for op in ops if op.split(".")[0] in ("LOP3", "ISETP", "IADD3", "SEL")], ops


def test_cuda_token_loop_with_a_nested_loop_counts_its_trips():
    """The CUDA WKV7 N = 128 backward's adjoint loop holds its column-sum loop: the model counts the adjoint loop's
    body once per token and the nested loop Workload.inner_trips times, beside the recompute loop's named trips, and
    the staging branch in the share of warps that run it."""
    from tools.static_report import model

    def loop(address, work, lean, inner=()):
        return kernels.Loop(address, work, sass.Path(work), sass.Path(lean), list(inner))

    recompute, column = loop(0x100, 10, 8), loop(0x300, 5, 5)
    adjoint = loop(0x200, 40, 40, [column])  # its paths take the column loop once
    chunks = loop(0x80, 100, 100, [recompute, column])
    kernel = kernels.Kernel("k", "cuda", "k.cu", "k", 128, 0, 0, 0, 0, 512, sass.Path(), [recompute, column],
                            [chunks, adjoint])
    workload = model.Workload("w", "token-head", 1, 0, 0, 1, tokens=16, cuda_token_loops=((1.5, 1.0), (1, 0)),
                              inner_trips=2)
    assert model.token_iteration(kernel, workload).instructions == 1.5 * 10 + 1.0 * 8 + (40 + 5)
    # The staging branch no path takes (a body of 16 static instructions, 10 on the work path), in half the warps.
    recompute.instructions = 16
    staged = dataclasses.replace(workload, cuda_staging_share=0.5)
    assert model.token_iteration(kernel, staged).instructions == 1.5 * 10 + 1.0 * 8 + (40 + 5) + 2.5 * 6 * 0.5
    with pytest.raises(LookupError, match="inner_trips"):
        model.token_iteration(kernel, dataclasses.replace(workload, inner_trips=0))
    with pytest.raises(LookupError, match="2 token loops, the model names 1"):
        model.token_iteration(kernel, dataclasses.replace(workload, cuda_token_loops=((1, 0),)))


def test_program_with_one_trip_count_takes_it_per_loop():
    """The chunked Triton backward's gradient kernel: a program is one chunk, its k-slice loops run N / 16 times, and
    the v-slice loop nested in the last one N / 16 times per k slice: (N / 16)^2 in all. The CUDA gradients kernel
    names each loop's trips instead."""
    from tools.static_report import model

    def loop(address, static, work, inner=()):
        return kernels.Loop(address, static, sass.Path(work), sass.Path(work), list(inner))

    first, second, nested = loop(0x100, 10, 10), loop(0x200, 6, 6), loop(0x400, 5, 5)
    last = loop(0x300, 40, 30, [nested])  # its work path takes the nested loop once: an own body of 25
    kernel = kernels.Kernel("k", "triton", "m", "k", 128, 0, 0, 0, 0, 256, sass.Path(100), [first, second, nested],
                            [last])
    # The work path (100) takes every body once; 4 trips add 3 more of each and 15 more of the nested body.
    assert model.program_with_loop_trips(kernel, 4).instructions == 100 + 3 * (10 + 6 + 25) + 15 * 5
    assert model.program_with_loop_trips(kernel, 1).instructions == 100
    # Trips per loop in address order: the nested loop's 4 per iteration of `last` (3 trips) make 12 in all.
    assert model.program_with_loop_trips(kernel, (1, 2, 3, 4)).instructions == 100 + 1 * 6 + 2 * 25 + 11 * 5
    with pytest.raises(LookupError, match="4 loops, the model names trips for 3"):
        model.program_with_loop_trips(kernel, (1, 2, 3))


def test_program_with_loop_trips_counts_each_body_once_per_level():
    """The CUDA gradients kernel's loops three deep: the window's chunk loop holds the masked products' loop and the
    pass loop, which holds the contraction's. Each loop's own body (its paths take the loops in it once) is counted
    its trips times those of every loop around it, a middle loop's without the loops in it."""
    from tools.static_report import model

    def loop(address, static, work, inner=()):
        return kernels.Loop(address, static, sass.Path(work), sass.Path(work), list(inner))

    masked, contraction = loop(0x180, 10, 10), loop(0x400, 5, 5)
    passes = loop(0x300, 60, 40, [contraction])  # its own body: 35
    chunk = loop(0x100, 200, 150, [masked, contraction])
    kernel = kernels.Kernel("k", "cuda", "k.cu", "k", 128, 0, 0, 0, 0, 128, sass.Path(300), [masked, contraction],
                            [chunk, passes])
    # 1 chunk, 3 masked trips, 4 passes of 6 contraction trips each (24 in all).
    assert model.program_with_loop_trips(kernel, (1, 3, 4, 6)).instructions == 300 + 2 * 10 + 3 * 35 + 23 * 5


def _declared_threads(source: str) -> dict:
    """{kernel name: the threads each instantiation's __launch_bounds__ declares (PTX .maxntid)} for one .cu."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernels.ptx")
        subprocess.run([cuda.nvcc(), "-std=c++20", "--expt-relaxed-constexpr", "-Icsrc/include", "-gencode",
                        "arch=compute_90a,code=sm_90a", "-ptx", source, "-o", ptx], cwd=ROOT, check=True)
        with open(ptx) as f:
            entries = f.read().split(".entry ")[1:]
    declared = {}
    for entry in entries:
        header = entry.split("{", 1)[0]
        # Mangled names carry each identifier's length: 14forward_kernelI is not 22chunked_forward_kernelI.
        name = next(k for k in ("forward_kernel", "backward_kernel", "chunked_forward_kernel", "step_kernel")
                    if f"{len(k)}{k}I" in header)
        threads = re.search(r"\.maxntid (\d+)", header)
        declared.setdefault(name, set()).add(int(threads.group(1)) if threads else None)
    return declared


@needs_nvcc
def test_wkv7_constants_are_the_kernels():
    """The model reads the WKV7 CUDA kernels' launch constants from tools/static_report/constants.cu: the threads it
    prints are those each kernel declares in __launch_bounds__, the backward's columns per thread are its lanes'
    share of a row, and the N = 128 backward's column sum is the loop nested in its adjoint loop."""
    constants = cuda.wkv7_constants(ROOT)
    assert set(constants["head_sizes"]) == {"32", "64", "128"}
    for n, sizes in constants["head_sizes"].items():
        declared = _declared_threads(f"csrc/wkv7/wkv7_n{n}.cu")
        assert declared["forward_kernel"] == {sizes["forward_threads"]}, n
        assert declared["backward_kernel"] == {sizes["backward_threads"]}, n
        assert sizes["backward_cols"] == int(n) ** 2 // sizes["backward_threads"], n
    chunked = _declared_threads("csrc/wkv7/wkv7_chunked_n64.cu")["chunked_forward_kernel"]
    assert chunked == {constants["chunked_threads"]}
    backward = {n: model._wkv7(True, 32, n, constants) for n in (64, 128)}
    assert backward[64].inner_trips == 0 and backward[128].inner_trips == 2


def test_program_search_loop_takes_its_own_trips():
    """The chunked Triton one-chunk programs first search for their sequence (log2 of the sequences: 3 trips at the
    benchmark's 8), then run their slice loops N / 16 times each."""
    from tools.static_report import model

    def loop(address, work):
        return kernels.Loop(address, work, sass.Path(work), sass.Path(work))

    kernel = kernels.Kernel("k", "triton", "m", "k", 128, 0, 0, 0, 0, 128, sass.Path(100),
                            [loop(0x100, 28), loop(0x200, 10), loop(0x300, 6)])
    assert model.program_with_loop_trips(kernel, 4, search_trips=3).instructions == 100 + 2 * 28 + 3 * (10 + 6)
    assert model.program_with_loop_trips(kernel, 4).instructions == 100 + 3 * (28 + 10 + 6)


def test_triton_chunked_wkv7_entries_specialise_as_the_benchmark():
    """Triton compiles an integer argument equal to 1 as a constant: the chunked kernels' sequence count must not be
    1 in the registry's launches when it is 8 at the benchmark (the prep and gradients kernels' search for their
    sequence compiled away)."""
    if _common.INTERPRETING:
        run_without_interpreter(__file__, "test_triton_chunked_wkv7_entries_specialise_as_the_benchmark")
        return
    import torch

    from ropewkv.triton_kernels.rwkv7 import chunked
    from tools.static_report.triton_sm90 import captured_launches

    def specialisation(launches):  # what Triton's binder keys an integer argument on
        return [[(arg == 1, arg % 16 == 0) for arg in args if type(arg) is int] for _, args, _ in launches]

    for n, heads in ((64, 64), (128, 32)):
        b, t = 8, 4096  # the benchmark's shape, on the meta device (nothing allocated)
        x = torch.empty(b, t, heads, n, dtype=torch.bfloat16, device="meta")
        state = torch.empty(b, heads, n, n, device="meta")
        checkpoints = torch.empty(chunked.checkpoint_slots(b * t, b), heads, n, n, device="meta")
        with captured_launches() as benchmark:
            chunked.wkv7_forward(x, x, x, x, x, x, None, None, x, state, checkpoints, "loglog", False, False)
            chunked.wkv7_backward(x, x, x, x, x, x, None, checkpoints, x, state, [x] * 6, state, "loglog", False,
                                  False)
        with captured_launches() as registry:
            kernels.wkv7_chunked_launches(n, heads)
            kernels.wkv7_chunked_launches(n, heads, backward=True)
        assert specialisation(registry) == specialisation(benchmark), n
