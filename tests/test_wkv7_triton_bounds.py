"""The Triton WKV7 launchers (recurrent and chunked) stay in bounds whatever cu_seqlens holds, and fit any head count
in the grid (issue 12 item 7).

Under torch.compile the Python checks of cu_seqlens' values are skipped (they need a host sync), so the kernels clamp
the offsets as the CUDA twin does (wkv7::sequence_range: start into [0, T], end into [start, T]). Tested on the
launchers directly: every tensor is a window in a larger buffer whose margins hold sentinels, so a read outside a
window brings NaN in and a write outside one changes a sentinel; malformed offsets must give exactly what their
clamped values give. The grid: (sequence, head) pairs on axis 0, since axis 1 holds at most 65,535 programs.
"""
import pytest
import torch

from ropewkv.testing import seeded
from ropewkv.testing.rwkv7 import rwkv7_inputs
from ropewkv.triton_kernels.rwkv7 import chunked, recurrent
from conftest import kernel_backends

NAMES = ("r", "w", "k", "v", "a", "b")
SENTINEL = 12345.0
T, H, N = 24, 2, 32
MARGIN = 40  # tokens (or checkpoint slots, or states) of sentinels on each side of every window


@pytest.fixture(autouse=True)
def _needs_triton(device):
    if "triton" not in kernel_backends(device):
        pytest.skip(f"the triton backend cannot run on {device.type} here")


def windowed(shape, device, fill=float("nan"), value=None):
    """(buffer, window): a contiguous view of `shape` at offset MARGIN along dim 1 of a buffer filled with `fill`
    (NaN for inputs, SENTINEL for outputs), the view holding `value` if given."""
    buffer = torch.full((shape[0], shape[1] + 2 * MARGIN, *shape[2:]), fill, dtype=torch.float32, device=device)
    window = buffer[:, MARGIN:MARGIN + shape[1]]
    assert window.is_contiguous()
    if value is not None:
        window.copy_(value)
    return buffer, window


def margins_untouched(buffer, length):
    outside = torch.cat([buffer[:, :MARGIN], buffer[:, MARGIN + length:]], dim=1)
    return bool((outside == SENTINEL).all())


# The chunked launchers take one more argument (bf16_dots), off here.
LAUNCHERS = {"recurrent": (recurrent.wkv7_forward, recurrent.wkv7_backward, ()),
             "chunked": (chunked.wkv7_forward, chunked.wkv7_backward, (False,))}


def run(device, cu_seqlens, n_seqs, backward, algorithm):
    """Forward (and backward) through windowed tensors: the outputs, and whether every margin kept its sentinel."""
    forward_launcher, backward_launcher, extra = LAUNCHERS[algorithm]
    inputs = rwkv7_inputs(1, T, H, N, torch.float32, "loglog", seeded(7), device)
    xs = [windowed((1, T, H, N), device, value=inputs[name])[1] for name in NAMES]
    cu = cu_seqlens.to(device)
    y_buf, y = windowed((1, T, H, N), device, SENTINEL)
    final_buf, final = windowed((1, n_seqs, H, N, N), device, SENTINEL)
    slots = recurrent.checkpoint_slots(T, n_seqs)
    ckpt_buf, ckpt = windowed((1, slots, H, N, N), device, SENTINEL)
    forward_launcher(*xs, None, cu, y, final[0], ckpt[0], "loglog", False, *extra)
    outputs = [y, final, ckpt]
    in_bounds = [margins_untouched(y_buf, T), margins_untouched(final_buf, n_seqs), margins_untouched(ckpt_buf, slots)]
    if backward:
        gy = windowed((1, T, H, N), device, value=torch.randn(1, T, H, N, generator=seeded(8)))[1]
        grad_bufs, grads = zip(*(windowed((1, T, H, N), device, SENTINEL) for _ in NAMES))
        gs0_buf, gs0 = windowed((1, n_seqs, H, N, N), device, SENTINEL)
        backward_launcher(*xs, cu, ckpt[0], gy, None, list(grads), gs0[0], "loglog", False, *extra)
        outputs += [*grads, gs0]
        in_bounds += [margins_untouched(g, T) for g in grad_bufs] + [margins_untouched(gs0_buf, n_seqs)]
    return outputs, in_bounds


# (malformed, what the kernels must read it as): starts below 0, ends past T, decreasing offsets.
CASES = [([-20, 10, 30, 5], [0, 10, 24, 24]), ([-(2**31), 2**31 - 1], [0, 24]), ([0, 30, 28, 24], [0, 24, 24, 24])]


@pytest.mark.parametrize("algorithm", LAUNCHERS)
@pytest.mark.parametrize("malformed, clamped", CASES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_malformed_cu_seqlens_read_as_clamped(device, malformed, clamped, index_dtype, algorithm):
    n_seqs = len(malformed) - 1
    got, in_bounds = run(device, torch.tensor(malformed, dtype=index_dtype), n_seqs, True, algorithm)
    want, _ = run(device, torch.tensor(clamped, dtype=index_dtype), n_seqs, True, algorithm)
    assert all(in_bounds)
    # Checkpoint slots and tokens that no (clamped) sequence covers keep their sentinel in both runs.
    for g, w in zip(got, want):
        assert torch.equal(g, w)
        assert not g.isnan().any()


@pytest.mark.parametrize("algorithm", LAUNCHERS)
@pytest.mark.parametrize("malformed", [[3, 3, -5, 24], [7, -(2**40), 2**40, -1], [2**40, 0]])
def test_overlapping_garbage_stays_in_bounds(device, malformed, algorithm):
    """Offsets whose clamped sequences overlap have no meaning, but reach no memory outside the tensors."""
    outputs, in_bounds = run(device, torch.tensor(malformed), len(malformed) - 1, True, algorithm)
    assert all(in_bounds)
    assert not any(x.isnan().any() for x in outputs)


def test_grid_fits_any_head_count(monkeypatch):
    """The launch grid for 70,000 heads keeps axes 1 and 2 within CUDA's 65,535 (not run: the grid is recorded)."""
    launched = []

    class Recorder:
        def __getitem__(self, grid):
            launched.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(recurrent, "_wkv7_fwd_kernel", Recorder())
    monkeypatch.setattr(recurrent, "_wkv7_bwd_kernel", Recorder())
    heads, n_seqs = 70_000, 3
    x = torch.zeros(1, 1, heads, N, device="meta")  # shapes only: nothing is allocated or launched
    state = torch.zeros(n_seqs, heads, N, N, device="meta")
    cu = torch.zeros(n_seqs + 1, dtype=torch.int64, device="meta")
    recurrent.wkv7_forward(x, x, x, x, x, x, None, cu, x, state, None, "loglog", False)
    recurrent.wkv7_backward(x, x, x, x, x, x, cu, state, x, None, [x] * 6, state, "loglog", False)
    assert len(launched) == 2
    for grid in launched:
        grid = tuple(grid) + (1,) * (3 - len(grid))
        assert grid[0] * grid[1] * grid[2] == n_seqs * heads
        assert grid[0] < 2**31 and grid[1] <= 65535 and grid[2] <= 65535
