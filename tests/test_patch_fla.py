"""ropewkv.patch.fla with a fake `fla` package laid out as flash-linear-attention's (FLA's kernels need a GPU).

The fake implements FLA's documented semantics from our fp64 reference through the layout and decay conversions:
w is the log decay (d = exp(w)), r is multiplied by `scale`, states are [N, H, K, V] (the transpose of RWKV-LM's
S[v][k]). The patched names must then reach ropewkv.compat.fla and agree with it.
"""
import sys
import types

import pytest
import torch

import ropewkv.patch
from ropewkv.compat import fla as compat
from ropewkv.reference import rwkv7 as reference
from ropewkv.testing import rms_ratio, seeded
from ropewkv.testing.rwkv7 import rwkv7_inputs

from conftest import kernel_backends


def fla_semantics(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None):
    """FLA's chunk_rwkv7 / fused_recurrent_rwkv7 contract, computed by the fp64 reference."""
    s0 = None if initial_state is None else initial_state.transpose(-1, -2)
    y, final = reference.wkv7(r * scale, w, k, v, a, b, initial_state=s0, output_final_state=output_final_state,
                              cu_seqlens=cu_seqlens, decay="log")
    return y, (None if final is None else final.transpose(-1, -2))


def fake_fla_ops():
    """fla.ops.rwkv7 (re-exports), fla.ops.rwkv7.chunk / .fused_recurrent (definitions), fla.layers.rwkv7 (a user
    that did `from fla.ops.rwkv7 import chunk_rwkv7, fused_recurrent_rwkv7`)."""
    def chunk_rwkv7(*args, **kwargs):
        return fla_semantics(*args, **kwargs)

    def fused_recurrent_rwkv7(*args, **kwargs):
        return fla_semantics(*args, **kwargs)

    modules = {name: types.ModuleType(name) for name in
               ("fla", "fla.ops", "fla.ops.rwkv7", "fla.ops.rwkv7.chunk", "fla.ops.rwkv7.fused_recurrent",
                "fla.layers", "fla.layers.rwkv7")}
    modules["fla.ops.rwkv7.chunk"].chunk_rwkv7 = chunk_rwkv7
    modules["fla.ops.rwkv7.fused_recurrent"].fused_recurrent_rwkv7 = fused_recurrent_rwkv7
    for user in ("fla.ops.rwkv7", "fla.layers.rwkv7"):
        modules[user].chunk_rwkv7, modules[user].fused_recurrent_rwkv7 = chunk_rwkv7, fused_recurrent_rwkv7
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules


@pytest.fixture
def fake_fla(monkeypatch):
    modules = fake_fla_ops()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return modules


def fla_inputs(seed: int, device):
    x = rwkv7_inputs(2, 21, 2, 32, torch.float32, decay="log", generator=seeded(seed), device=device,
                     initial_state=True)
    state_fla = x.pop("initial_state").transpose(-1, -2).contiguous()  # FLA's [N, H, K, V]
    return [x[n] for n in "rwkvab"], state_fla


def test_patch_reroutes_every_holder_and_undo_restores(fake_fla):
    originals = {name: dict(vars(m)) for name, m in fake_fla.items()}
    with ropewkv.patch.fla() as handle:
        assert fake_fla["fla.layers.rwkv7"].chunk_rwkv7 is compat.chunk_rwkv7
        assert fake_fla["fla.layers.rwkv7"].fused_recurrent_rwkv7 is compat.fused_recurrent_rwkv7
        assert fake_fla["fla.ops.rwkv7"].chunk_rwkv7 is compat.chunk_rwkv7
        assert fake_fla["fla.ops.rwkv7.chunk"].chunk_rwkv7 is compat.chunk_rwkv7
        assert fake_fla["fla.ops.rwkv7.fused_recurrent"].fused_recurrent_rwkv7 is compat.fused_recurrent_rwkv7
        assert len(handle.patched) == 6
    for name, module in fake_fla.items():
        assert all(vars(module)[key] is value for key, value in originals[name].items()), name


@pytest.mark.parametrize("function", ["chunk_rwkv7", "fused_recurrent_rwkv7"])
def test_patched_users_get_fla_semantics(fake_fla, function, device):
    (r, w, k, v, a, b), state = fla_inputs(1, device)
    scale = 0.5  # not 1, so that a dropped scale shows
    want_y, want_state = fla_semantics(r, w, k, v, a, b, scale, state, True)
    user = fake_fla["fla.layers.rwkv7"]
    for backend in kernel_backends(device):
        with ropewkv.patch.fla():
            y, final = getattr(user, function)(r, w, k, v, a, b, scale=scale, initial_state=state,
                                               output_final_state=True, backend=backend)
        # fp32 I/O and fp32 state over T=21 steps: RMS error ~1e-7, 1e-5 leaves margin yet catches any layout slip.
        assert rms_ratio(y, want_y) < 1e-5 and rms_ratio(final, want_state) < 1e-5, backend
        assert y.dtype == r.dtype and final.shape == state.shape


def test_given_module_only(fake_fla):
    mine = types.ModuleType("my_model")
    mine.chunk_rwkv7 = fake_fla["fla.ops.rwkv7"].chunk_rwkv7
    with ropewkv.patch.fla(mine) as handle:
        assert mine.chunk_rwkv7 is compat.chunk_rwkv7
        assert fake_fla["fla.ops.rwkv7"].chunk_rwkv7 is not compat.chunk_rwkv7
        assert handle.patched == ["my_model.chunk_rwkv7"]


def test_without_fla_installed_the_error_is_clear(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # makes `import fla` raise ModuleNotFoundError
    with pytest.raises(ModuleNotFoundError):
        ropewkv.patch.fla()
