"""ropewkv under torch.distributed: DDP / FSDP2, sequence-parallel RWKV-7 and context-parallel RoPE.

Two gloo processes on 127.0.0.1 (CPU twin), spawned per test. Each worker compares its distributed result with the
single-process computation of the same op on the same backend (this file tests the distribution; single-process
accuracy against the fp64 oracle is tested elsewhere). fp64 where sums are reordered, so that the tolerance is
only fp64 reassociation.
"""
import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ropewkv import distributed as rd
from ropewkv.nn import RotaryEmbedding
from ropewkv.ops.rope import rope
from ropewkv.ops.rwkv7 import wkv7
from ropewkv.testing import seeded
from ropewkv.testing.rope import rope_input, rope_inv_freq
from ropewkv.testing.rwkv7 import rwkv7_inputs

WORLD = 2
# fp64 results of one computation with the sums (allreduce / reduce-scatter of gradients, a state handed over)
# reassociated: a few fp64 ulps of the largest terms.
FP64 = dict(rtol=1e-11, atol=1e-12)


def _worker(rank: int, store: str, check, configs) -> None:
    # A file store (no TCP store server whose teardown races the other rank's); gloo itself on loopback only.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        for args in configs:
            check(rank, *args)
        dist.barrier()  # nobody tears down gloo while the other rank still communicates
    finally:
        dist.destroy_process_group()


def _run(check, configs) -> None:
    """Run check(rank, *args) for each args in configs, in WORLD gloo processes (one spawn: ~5 s of imports); a
    failed assertion in any of them fails the test."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), check, configs), nprocs=WORLD, join=True)


# ---------------------------------------------------------------------------------------------------------------------
# (a) A tiny model using the ops (RotaryEmbedding, wkv7 with the fused raw decay) under DDP and FSDP2.


class TinyRWKVRope(torch.nn.Module):
    def __init__(self, dim: int = 64, head_size: int = 32):
        super().__init__()
        self.heads, self.head_size = dim // head_size, head_size
        self.proj = torch.nn.Linear(dim, 5 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.rotary = RotaryEmbedding(head_size)

    def forward(self, x):
        batch, seqlen, _ = x.shape
        r, k, v, w, gate = self.proj(x).view(batch, seqlen, 5, self.heads, self.head_size).unbind(2)
        r, k = self.rotary(r, k)
        kk = F.normalize(k, dim=-1)
        y, _ = wkv7(r, w, k, v, -kk, kk * torch.sigmoid(gate), decay="raw", backend="cpu")
        return self.out(y.reshape(batch, seqlen, -1))


def _model_and_data():
    torch.manual_seed(0)
    model = TinyRWKVRope().double()
    x = torch.randn(2 * WORLD, 12, 64, dtype=torch.float64, generator=seeded(1))
    return model, x


def _single_process(model, x):
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _check_data_parallel(rank: int, wrap: str) -> None:
    model, x = _model_and_data()
    expected_loss, expected_grads = _single_process(copy.deepcopy(model), x)
    if wrap == "ddp":
        parallel = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        parallel = fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    local = x.chunk(WORLD)[rank]
    loss = parallel(local).square().mean()
    loss.backward()
    losses = [torch.empty_like(loss) for _ in range(WORLD)]
    dist.all_gather(losses, loss.detach())
    torch.testing.assert_close(torch.stack(losses).mean(), expected_loss, **FP64)
    for name, p in model.named_parameters():
        assert hasattr(p.grad, "full_tensor") == (wrap == "fsdp2")  # FSDP2 shards parameters as DTensors
        grad = p.grad.full_tensor() if wrap == "fsdp2" else p.grad
        torch.testing.assert_close(grad, expected_grads[name], **FP64, msg=f"{wrap} grad of {name}")


def test_ddp_and_fsdp2_match_single_process():
    _run(_check_data_parallel, [("ddp",), ("fsdp2",)])


# ---------------------------------------------------------------------------------------------------------------------
# (b) Sequence-parallel RWKV-7: time slices chained by send/recv of the state, forward and backward.


def _check_sequence_parallel(rank: int, dtype, slices, with_initial_state: bool, algorithm: str) -> None:
    seqlen = sum(slices)
    inputs = rwkv7_inputs(2, seqlen, 2, 32, dtype, generator=seeded(2), initial_state=with_initial_state)
    names = ("r", "w", "k", "v", "a", "b")
    full = [inputs[n].requires_grad_() for n in names]
    s0 = inputs["initial_state"]
    if s0 is not None:
        s0 = s0.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
    grad_y = torch.randn(full[0].shape, dtype=torch.float64, generator=seeded(3)).to(dtype)
    grad_final = torch.randn(2, 2, 32, 32, dtype=torch.float64, generator=seeded(4)).to(s0.dtype if s0 is not None
                                                                                          else torch.float32)
    y, final = wkv7(*full, initial_state=s0, output_final_state=True, backend="cpu", algorithm=algorithm)
    expected = torch.autograd.grad((y * grad_y).sum() + (final * grad_final).sum(), full + ([s0] if s0 is not None
                                                                                            else []))
    start, end = sum(slices[:rank]), sum(slices[: rank + 1])
    local = [x.detach()[:, start:end].clone().requires_grad_() for x in full]
    local_s0 = s0.detach().clone().requires_grad_() if s0 is not None and rank == 0 else None
    y_local, final_local = rd.wkv7_sequence_parallel(*local, initial_state=local_s0, output_final_state=True,
                                                     backend="cpu", algorithm=algorithm)
    # Every rank's loss sees its y; only the last rank's local final state is the sequence's final state.
    loss = (y_local * grad_y[:, start:end]).sum()
    if rank == WORLD - 1:
        loss = loss + (final_local * grad_final).sum()
    loss.backward()
    # The state is handed over exactly. The sequential form runs the same per-token arithmetic on every rank: bitwise
    # equal. The chunked form starts its chunks over in each slice: equal to rounding (fp64 here).
    tol = dict(rtol=0, atol=0) if algorithm == "sequential" else FP64
    torch.testing.assert_close(y_local, y.detach()[:, start:end], **tol)
    if rank == WORLD - 1:
        torch.testing.assert_close(final_local, final.detach(), **tol)
    for name, x, g in zip(names, local, expected):
        torch.testing.assert_close(x.grad, g[:, start:end], **tol, msg=f"grad of {name}")
    if local_s0 is not None:
        torch.testing.assert_close(local_s0.grad, expected[-1], **tol, msg="grad of initial_state")


def test_sequence_parallel_wkv7_matches_single_process():
    _run(_check_sequence_parallel, [
        (torch.float64, (8, 8), True, "sequential"),
        (torch.bfloat16, (5, 12), False, "sequential"),  # uneven slices, low-precision I/O, zero initial state
        (torch.float64, (8, 27), True, "chunked"),  # the second slice's chunks start over
    ])


# ---------------------------------------------------------------------------------------------------------------------
# (c) Context-parallel RoPE: each rank rotates its shard at its global positions.


def _check_context_parallel(rank: int, split: str) -> None:
    seqlen, dim = 16, 32
    q = rope_input(2, seqlen, 4, dim, torch.float32, generator=seeded(5)).requires_grad_()
    k = rope_input(2, seqlen, 1, dim, torch.float32, generator=seeded(6)).requires_grad_()
    inv_freq = rope_inv_freq(dim)
    grad_q = torch.randn(q.shape, generator=seeded(7))
    q_full, k_full = rope(q, k, inv_freq=inv_freq, backend="cpu")
    expected_grad = torch.autograd.grad((q_full * grad_q).sum(), q)[0]
    q_local = rd.shard_sequence(q.detach(), WORLD, rank, split=split).requires_grad_()
    k_local = rd.shard_sequence(k.detach(), WORLD, rank, split=split)
    positions = rd.shard_positions(seqlen, WORLD, rank, split=split)
    q_rot, k_rot = rope(q_local, k_local, inv_freq=inv_freq, positions=positions, backend="cpu")
    # Elementwise op at the same positions: bitwise equal to the unsharded result, gathered in global order.
    assert torch.equal(rd.all_gather_sequence(q_rot.detach(), split=split), q_full.detach())
    assert torch.equal(rd.all_gather_sequence(k_rot, split=split), k_full.detach())
    (q_rot * rd.shard_sequence(grad_q, WORLD, rank, split=split)).sum().backward()
    assert torch.equal(q_local.grad, rd.shard_sequence(expected_grad, WORLD, rank, split=split))
    if split == "contiguous":
        by_offset = rope(q_local.detach(), inv_freq=inv_freq, seqlen_offsets=rank * seqlen // WORLD, backend="cpu")
        assert torch.equal(by_offset, q_rot.detach())


def test_context_parallel_rope_matches_unsharded():
    _run(_check_context_parallel, [(split,) for split in rd.SPLITS])


def _check_uneven_gather(rank: int) -> None:
    """wkv7_sequence_parallel's slices may differ in length: all_gather_sequence reassembles them, differentiably
    (each shard's gradient: the sum of every rank's cotangent for it). Shapes that cannot be gathered raise on
    every rank (the gloo all_gather aborted the process on one and read garbage on the other)."""
    lengths = (3, 6)
    full = torch.randn(2, sum(lengths), 5, dtype=torch.float64, generator=seeded(8))
    start = sum(lengths[:rank])
    local = full[:, start:start + lengths[rank]].clone().requires_grad_()
    cotangents = [torch.randn(full.shape, dtype=torch.float64, generator=seeded(9 + r)) for r in range(WORLD)]
    gathered = rd.all_gather_sequence(local)
    assert torch.equal(gathered, full)
    (gathered * cotangents[rank]).sum().backward()
    torch.testing.assert_close(local.grad, sum(cotangents)[:, start:start + lengths[rank]], **FP64)
    with pytest.raises(ValueError, match="split='zigzag' needs shards of one even length"):
        rd.all_gather_sequence(local.detach(), split="zigzag")
    with pytest.raises(ValueError, match="local must have one shape on every rank outside seq_dim=1"):
        rd.all_gather_sequence(full[:, :4, : 4 + rank])


def test_all_gather_sequence_with_uneven_slices():
    _run(_check_uneven_gather, [()])


def test_shard_layouts_without_a_process_group():
    """Zig-zag (TE): 2W chunks, rank r holds chunks r and 2W-1-r; shard/unshard round-trips on any sequence dim."""
    assert rd.shard_positions(16, 2, 0, split="zigzag").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert rd.shard_positions(16, 2, 1, split="zigzag").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert rd.shard_positions(12, 3, 2).tolist() == [8, 9, 10, 11]
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    for split in rd.SPLITS:
        for world in (1, 2, 3):
            shards = [rd.shard_sequence(x, world, r, split=split) for r in range(world)]
            for r, shard in enumerate(shards):
                assert torch.equal(shard[0, :, 0] // 3, rd.shard_positions(24, world, r, split=split))
            assert torch.equal(rd.unshard_sequence(shards, split=split), x)
    with pytest.raises(ValueError, match="seqlen=10 must be divisible by 4"):
        rd.shard_positions(10, 2, 0, split="zigzag")
    with pytest.raises(ValueError, match="split must be one of"):
        rd.shard_positions(8, 2, 0, split="ring")
    with pytest.raises(ValueError, match="rank must be in"):
        rd.shard_positions(8, 2, 2)


def test_unshard_rejects_what_it_cannot_reassemble():
    """An unknown split name used to be read as "zigzag", and zig-zag shards of odd or unequal lengths were cut
    into unequal halves: the wrong tensor, silently."""
    shards = [torch.arange(6).view(1, 6), torch.arange(6, 12).view(1, 6)]
    with pytest.raises(ValueError, match="split must be one of"):
        rd.unshard_sequence(shards, split="Contiguous")
    with pytest.raises(ValueError, match=r"one even length along seq_dim=1, got \[3, 3\]"):
        rd.unshard_sequence([s[:, :3] for s in shards], split="zigzag")
    with pytest.raises(ValueError, match=r"one even length along seq_dim=1, got \[6, 4\]"):
        rd.unshard_sequence([shards[0], shards[1][:, :4]], split="zigzag")
