"""torch.library.opcheck (schema, autograd registration, fake kernel, AOT dispatch) on every ropewkv op that no other
test opchecks with all four utils, over the main argument combinations of each (and on wkv7_triton_fwd, whose
opcheck elsewhere misses the varlen case that fails here).

The arguments are what the public functions hand the ops: the wrappers' own normalisation builds them (views in
[B, S, H, D], index tensors, the cos/sin source). The differentiable inputs require grad, since opcheck only runs the
autograd registration check and the AOT gradient check then. The backward ops (but log_decay_backward, which has a
double backward) refuse to be differentiated, and the decode step has no backward: they get plain tensors, as
autograd's backward and the decode path give them. The C++ ops run on their CPU twin; the Triton ops on `device`
(CUDA on a GPU, the interpreter here), hence the tiny shapes.
"""
import pytest
import torch

import ropewkv
from ropewkv.ops import qk_norm_rope as qk_ops
from ropewkv.ops import rope as rope_ops
from ropewkv.testing import poisoned_outputs, seeded
from ropewkv.testing.rope import rope_input, rope_inv_freq
from ropewkv.testing.rwkv7 import rwkv7_inputs
from conftest import kernel_backends

NAMES = ("r", "w", "k", "v", "a", "b")
DECAYS = ("loglog", "raw", "log")  # the C++ ops' decay codes
PRECISIONS = ("fp32", "bf16")  # the C++ ops' precision codes

# Opchecked with all four utils elsewhere: test_wkv7_triton.py::test_opcheck, ::test_decode_step_op_updates_the_state_
# in_place and test_wkv7_chunked.py::test_cpu_op_passes_opcheck.
CHECKED_ELSEWHERE = {"wkv7_triton_fwd", "wkv7_triton_step", "wkv7_chunked_forward"}

# backend -> the ops of each family on that twin
ROPE_OPS = {"cpu": ("rope", "rope_", "rope_cos_sin"), "triton": ("rope_triton", "rope_triton_", "rope_cos_sin_triton")}
QK_OPS = {"cpu": ("qk_norm_rope", "qk_norm_rope_", "qk_norm_rope_backward"),
          "triton": ("qk_norm_rope_triton", "qk_norm_rope_triton_", "qk_norm_rope_backward_triton")}
DECAY_OPS = {"cpu": ("log_decay", "log_decay_backward"), "triton": ("log_decay_triton", "log_decay_backward_triton")}
WKV7_CPP_OPS = ("wkv7_forward", "wkv7_backward", "wkv7_chunked_backward", "wkv7_step")
WKV7_TRITON_OPS = ("wkv7_triton_fwd", "wkv7_triton_bwd", "wkv7_chunked_triton_fwd", "wkv7_chunked_triton_bwd")
# The host-side test hooks of csrc/common/library_cpu.cpp (the shared math run on the host by the tests): no one
# traces them, so they have no fake kernels.
TEST_HOOKS = {"_narrow_to", "_widen", "_host_exp", "_host_sincos"}
CHECKED_HERE = {*WKV7_CPP_OPS, *WKV7_TRITON_OPS,
                *(op for family in (ROPE_OPS, QK_OPS, DECAY_OPS) for ops in family.values() for op in ops)}


def opcheck(name, args):
    with poisoned_outputs():  # an output element the op leaves unwritten is NaN, so that eager and AOT runs differ
        torch.library.opcheck(getattr(torch.ops.ropewkv, name).default, args)


def _device_for(backend, device):
    """The C++ ops on their CPU twin, the Triton ops on `device`; skipped where that twin cannot run."""
    where = torch.device("cpu") if backend == "cpu" else device
    if backend not in kernel_backends(where):
        pytest.skip(f"the {backend} backend cannot run on {where.type} here")
    return where


def _grad(t):
    return None if t is None else t.detach().clone().requires_grad_()


def test_every_op_is_opchecked():
    registered = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("ropewkv::")}
    assert registered - CHECKED_HERE - CHECKED_ELSEWHERE - TEST_HOOKS == set()


# ---- rwkv7_log_decay ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, dtype", [(backend, dtype) for backend in ("cpu", "triton")
                                            for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
                                            if backend == "cpu" or dtype != torch.float64], ids=str)  # fp64: cpu only
def test_log_decay(backend, dtype, device):
    where = _device_for(backend, device)
    forward, backward = DECAY_OPS[backend]
    gen = seeded(1)
    x = torch.randn(4, 6, dtype=torch.float64, generator=gen).to(dtype).to(where)
    for x_in in (x, x.t()):  # a transposed x: the outputs are contiguous all the same
        grad = torch.randn(x_in.shape, generator=gen).to(where)  # the fp32 output's cotangent
        opcheck(forward, (_grad(x_in),))
        # the backward has a double backward (create_graph=True), so its inputs require grad too
        opcheck(backward, (_grad(grad), _grad(x_in)))


# ---- RoPE --------------------------------------------------------------------------------------------------------

# name -> (dtype, layout, rope keyword arguments); q is [2, 3, 2, 32] in the layout ([5, 2, 32] for thd), k has 1 head.
POSITIONS = [[0, 5, 9], [3, 4, 7]]
ROPE_CASES = {
    "fp32": (torch.float32, "bshd", {}),
    "bf16-positions-offsets-int32": (torch.bfloat16, "bshd", {"positions": POSITIONS, "seqlen_offsets": [1, 2],
                                                              "int32": True}),
    "bf16-no-k-interleaved-partial-scaled-lowprec": (torch.bfloat16, "bshd", {
        "no_k": True, "interleaved": True, "rotary_dim": 16, "attention_scaling": 0.5, "precision": "bf16"}),
    "fp32-bhsd": (torch.float32, "bhsd", {}),
    "fp32-qkv-slices": (torch.float32, "qkv", {}),
    "bf16-thd-varlen-offsets-int32": (torch.bfloat16, "thd", {"cu_seqlens": [0, 2, 5], "seqlen_offsets": [0, 4],
                                                               "int32": True}),
    "fp32-mrope": (torch.float32, "bshd", {"mrope_section": [4, 6, 6]}),
    "bf16-mrope-interleaved": (torch.bfloat16, "bshd", {"mrope_section": [6, 5, 5], "mrope_interleaved": True}),
}


def _q_k(dtype, layout, no_k, where, seed):
    """Fresh q and k (None if no_k) and the layout rope reads them in; "qkv": bshd slices of one fused projection."""
    gen = seeded(seed)
    if layout == "qkv":
        qkv = rope_input(2, 3, 4, 32, dtype, "bshd", gen, where)
        return qkv[:, :, :2], None if no_k else qkv[:, :, 2:3], "bshd"
    batch, seqlen = (1, 5) if layout == "thd" else (2, 3)
    q = rope_input(batch, seqlen, 2, 32, dtype, layout, gen, where)
    return q, None if no_k else rope_input(batch, seqlen, 1, 32, dtype, layout, gen, where), layout


def _index_tensors(kwargs, where):
    """The list-valued index arguments as tensors on `where` (M-RoPE's positions: 3 rows)."""
    out = {}
    for key in ("positions", "seqlen_offsets", "cu_seqlens"):
        if key in kwargs:
            out[key] = torch.tensor(kwargs[key], dtype=torch.int32 if kwargs.get("int32") else torch.int64,
                                    device=where)
    if "mrope_section" in kwargs:
        out["positions"] = torch.tensor([[0, 1, 2], [1, 1, 1], [0, 2, 4]], device=where).unsqueeze(1).expand(3, 2, 3)
    return out


def _rope_args(case, backend, where, seed):
    """(q4, k4, *rest): the arguments rope() hands the backend's ops for the case."""
    dtype, layout, kwargs = ROPE_CASES[case]
    q, k, layout = _q_k(dtype, layout, kwargs.get("no_k", False), where, seed)
    index = _index_tensors(kwargs, where)
    n = rope_ops._normalise_rope(
        q, k, rope_inv_freq(32, device=where), index.get("positions"), index.get("seqlen_offsets", 0),
        index.get("cu_seqlens"), layout, kwargs.get("interleaved", False), kwargs.get("rotary_dim"),
        kwargs.get("attention_scaling", 1.0), kwargs.get("precision"), backend, kwargs.get("mrope_section"),
        kwargs.get("mrope_interleaved", False))
    return n.q4, n.k4, *n.args


@pytest.mark.parametrize("case", list(ROPE_CASES))
@pytest.mark.parametrize("inplace", [False, True], ids=["functional", "inplace"])
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_rope(backend, inplace, case, device):
    where = _device_for(backend, device)
    q4, k4, *rest = _rope_args(case, backend, where, seed=2)
    if inplace:  # fresh q and k, in their own layout
        opcheck(ROPE_OPS[backend][1], (q4, k4, *rest))
    else:
        opcheck(ROPE_OPS[backend][0], (_grad(q4), _grad(k4), *rest))


# name -> (dtype, table dtype, with k, rotary dim, table batch, interleaved, conjugate, precision):
# apply_rotary_pos_emb's call (HF's [1, S, R] tables broadcast over the batch, partial rotary), its backward's
# (conjugate).
COS_SIN_CASES = {
    "fp32": (torch.float32, torch.float32, True, 32, 2, False, False, "fp32"),
    "bf16-broadcast-partial-lowprec": (torch.bfloat16, torch.bfloat16, True, 16, 1, False, False, "bf16"),
    "bf16-no-k-fp32-tables-interleaved-conjugate": (torch.bfloat16, torch.float32, False, 32, 2, True, True, "fp32"),
}


@pytest.mark.parametrize("case", list(COS_SIN_CASES))
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_rope_cos_sin(backend, case, device):
    where = _device_for(backend, device)
    op = ROPE_OPS[backend][2]
    dtype, table_dtype, with_k, rot, table_batch, interleaved, conjugate, precision = COS_SIN_CASES[case]
    gen = seeded(3)
    q = rope_input(2, 3, 2, 32, dtype, "bshd", gen, where)
    k = rope_input(2, 3, 1, 32, dtype, "bshd", gen, where) if with_k else None
    cos, sin = (torch.randn(table_batch, 3, rot, generator=gen).to(table_dtype).to(where).expand(2, 3, rot)
                for _ in range(2))
    opcheck(op, (_grad(q), _grad(k), cos, sin, interleaved, conjugate, PRECISIONS.index(precision)))


# ---- qk_norm_rope ------------------------------------------------------------------------------------------------

# name -> (dtype, layout, keyword arguments); shapes as ROPE_CASES; "source" picks the cos/sin source.
QK_CASES = {
    "fp32-inv_freq-weights": (torch.float32, "bshd", {"source": "inv_freq", "weights": True}),
    "bf16-no-norm-positions-offsets": (torch.bfloat16, "bshd", {
        "source": "inv_freq", "positions": POSITIONS, "seqlen_offsets": [1, 2]}),
    "bf16-tables-gemma-interleaved": (torch.bfloat16, "bshd", {
        "source": "tables", "weights": True, "weight_offset": 1.0, "interleaved": True}),
    "fp32-cache-partial-qkv-slices": (torch.float32, "qkv", {"source": "cache", "weights": True,
                                                             "positions": POSITIONS}),
    "bf16-lowprec-scaled-bhsd": (torch.bfloat16, "bhsd", {"source": "inv_freq", "weights": True,
                                                          "attention_scaling": 0.5, "precision": "bf16"}),
    "fp32-thd-varlen-q-only": (torch.float32, "thd", {"source": "inv_freq", "no_k": True, "weights": True,
                                                      "cu_seqlens": [0, 2, 5], "seqlen_offsets": [0, 4]}),
}


def _qk_args(case, backend, where, seed):
    """(q4, k4, *rest): the arguments qk_norm_rope() hands the backend's ops for the case."""
    dtype, layout, kwargs = QK_CASES[case]
    no_k = kwargs.get("no_k", False)
    q, k, layout = _q_k(dtype, layout, no_k, where, seed)
    gen = seeded(seed + 100)
    index = _index_tensors(kwargs, where)
    weights = [torch.randn(32, generator=gen).to(where) if kwargs.get("weights") and not (no_k and i) else None
               for i in range(2)]
    source = {"inv_freq": None, "cos": None, "sin": None, "cos_sin_cache": None}
    if kwargs["source"] == "inv_freq":
        source["inv_freq"] = rope_inv_freq(32, device=where)
    elif kwargs["source"] == "tables":
        source["cos"], source["sin"] = (torch.randn(1, 3, 32, generator=gen).to(dtype).to(where) for _ in range(2))
    else:
        source["cos_sin_cache"] = torch.randn(16, 16, generator=gen).to(where)  # 16 of the 32 dims rotated
    n = qk_ops._normalise(
        q, k, *weights, 1e-6, kwargs.get("weight_offset", 0.0), source["inv_freq"], source["cos"], source["sin"],
        source["cos_sin_cache"], index.get("positions"), index.get("seqlen_offsets", 0), index.get("cu_seqlens"),
        layout, kwargs.get("interleaved", False), None, kwargs.get("attention_scaling", 1.0), kwargs.get("precision"),
        backend)
    return n.q4, n.k4, *n.args


@pytest.mark.parametrize("case", list(QK_CASES))
@pytest.mark.parametrize("which", ["functional", "inplace", "backward"])
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_qk_norm_rope(backend, which, case, device):
    where = _device_for(backend, device)
    functional, inplace, backward = QK_OPS[backend]
    q4, k4, q_weight, k_weight, *rest = _qk_args(case, backend, where, seed=4)
    if which == "functional":
        opcheck(functional, (_grad(q4), _grad(k4), _grad(q_weight), _grad(k_weight), *rest))
    elif which == "inplace":  # fresh q and k, in their own layout
        opcheck(inplace, (q4, k4, q_weight, k_weight, *rest))
    else:
        grads = [None if x is None else torch.randn(x.shape, generator=seeded(5)).to(x) for x in (q4, k4)]
        opcheck(backward, (*grads, q4, k4, q_weight, k_weight, *rest))


# ---- wkv7 --------------------------------------------------------------------------------------------------------

# name -> (dtype, decay, precision, initial state, cu_seqlens or None (then B = 2), T); bf16 r..b come with an fp32 w
# (autocast's call). T = 20 crosses a 16-token checkpoint boundary; packed as [0, 7, 20], it leaves a slot of the
# Triton twins' checkpoint buffer to no chunk (a gap: the buffer has T // 16 + n_seqs slots), which their forwards
# zero (it held uninitialised memory: the AOT check's eager and traced checkpoints differed there).
WKV7_CASES = {
    "fp32-loglog-state": (torch.float32, "loglog", "fp32", True, None, 5),
    "bf16-raw-lowprec-varlen": (torch.bfloat16, "raw", "bf16", False, [0, 2, 5], 5),
    "fp32-log-state-varlen-T20": (torch.float32, "log", "fp32", True, [0, 7, 20], 20),
}
WKV7_CPP_CASES = {**WKV7_CASES, "fp64-loglog-state": (torch.float64, "loglog", "fp32", True, None, 5)}


def _state(n_seqs, r, seed):
    """A random state for n_seqs sequences of r: fp32 (fp64 for fp64 r), on r's device."""
    return torch.randn(n_seqs, 1, 32, 32, generator=seeded(seed)).to(r.device, ropewkv._backend.compute_dtype(r.dtype))


def _wkv7_inputs(case, where):
    """(r..b, initial state or None, cu_seqlens or None, decay, precision)."""
    dtype, decay, precision, with_state, cu, seqlen = WKV7_CPP_CASES[case]
    x = rwkv7_inputs(1 if cu else 2, seqlen, 1, 32, dtype, decay, seeded(6), where)
    if dtype == torch.bfloat16:
        x["w"] = x["w"].float()
    state = _state(2, x["r"], seed=7) if with_state else None  # 2 sequences: the batch, or cu_seqlens'
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32 if dtype == torch.bfloat16 else torch.int64,
                                              device=where)
    return [x[n] for n in NAMES], state, cu, decay, precision


def _cotangents(y, final_state):
    gen = seeded(8)
    return [torch.randn(t.shape, dtype=torch.float64, generator=gen).to(t) for t in (y, final_state)]


@pytest.mark.parametrize("case", list(WKV7_CPP_CASES))
def test_wkv7_cpp_forward(case):
    _device_for("cpu", None)
    xs, state, cu, decay, precision = _wkv7_inputs(case, torch.device("cpu"))
    codes = DECAYS.index(decay), PRECISIONS.index(precision)
    opcheck("wkv7_forward", (*map(_grad, xs), _grad(state), cu, *codes, True))
    opcheck("wkv7_forward", (*xs, state, cu, *codes, False))  # inference: no checkpoints


@pytest.mark.parametrize("case", list(WKV7_CPP_CASES))
@pytest.mark.parametrize("forward, backward", [("wkv7_forward", "wkv7_backward"),
                                               ("wkv7_chunked_forward", "wkv7_chunked_backward")])
def test_wkv7_cpp_backward(forward, backward, case):
    _device_for("cpu", None)
    xs, state, cu, decay, precision = _wkv7_inputs(case, torch.device("cpu"))
    codes = DECAYS.index(decay), PRECISIONS.index(precision)
    y, final_state, checkpoints = getattr(torch.ops.ropewkv, forward)(*xs, state, cu, *codes, True)
    grad_y, grad_final = _cotangents(y, final_state)
    for grad_final_state in (grad_final, None):  # None: the final state unused
        opcheck(backward, (grad_y, grad_final_state, *xs, state, cu, checkpoints, *codes))


@pytest.mark.parametrize("case", list(WKV7_CPP_CASES))
def test_wkv7_step(case):
    """The decode step on the first token of each batch row, from a fresh state."""
    _device_for("cpu", None)
    xs, _, _, decay, precision = _wkv7_inputs(case, torch.device("cpu"))
    args = (*(x[:, 0] for x in xs), _state(xs[0].shape[0], xs[0], seed=9), DECAYS.index(decay),
            PRECISIONS.index(precision))
    opcheck("wkv7_step", args)


@pytest.mark.parametrize("case", list(WKV7_CASES))
@pytest.mark.parametrize("forward", ["wkv7_triton_fwd", "wkv7_chunked_triton_fwd"])
def test_wkv7_triton_forward(forward, case, device):
    where = _device_for("triton", device)
    xs, state, cu, decay, precision = _wkv7_inputs(case, where)
    opcheck(forward, (*map(_grad, xs), _grad(state), cu, decay, precision, True))


@pytest.mark.parametrize("case", list(WKV7_CASES))
@pytest.mark.parametrize("forward, backward", [("wkv7_triton_fwd", "wkv7_triton_bwd"),
                                               ("wkv7_chunked_triton_fwd", "wkv7_chunked_triton_bwd")])
def test_wkv7_triton_backward(forward, backward, case, device):
    where = _device_for("triton", device)
    xs, state, cu, decay, precision = _wkv7_inputs(case, where)
    y, final_state, checkpoints = getattr(torch.ops.ropewkv, forward)(*xs, state, cu, decay, precision, True)
    grad_y, grad_final = _cotangents(y, final_state)
    for grad_final_state in (grad_final, None):  # None: the final state unused
        opcheck(backward, (*xs, cu, checkpoints, grad_y, grad_final_state, decay, precision))
