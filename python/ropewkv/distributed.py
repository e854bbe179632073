"""Distributed helpers on torch.distributed: context-parallel RoPE and sequence-parallel RWKV-7.

Context-parallel RoPE. Each rank holds a shard of the sequence dimension and must rotate token i with its global
position. Two splits of a length-S sequence over W ranks (S divisible by W, or by 2W for zig-zag):
  - "contiguous": rank r holds tokens [r*S/W, (r+1)*S/W) -- a plain offset, `seqlen_offsets=r*S/W`;
  - "zigzag": the load-balanced split of TransformerEngine / Megatron context parallelism for causal attention:
    the sequence is cut into 2W equal chunks and rank r holds chunks r and 2W-1-r, so every rank gets the same
    amount of causal attention work.
`shard_positions` gives a rank's global positions (pass them as `ropewkv.rope(..., positions=...)`),
`shard_sequence` cuts a full tensor into a rank's shard, `unshard_sequence` reassembles shards in global order and
`all_gather_sequence` does that across a process group (differentiably).

Sequence-parallel RWKV-7. `wkv7_sequence_parallel` runs the WKV7 recurrence over a sequence split into contiguous
time slices, rank r holding slice r: rank r receives the state at the start of its slice from rank r-1, runs
`ropewkv.wkv7` from it, and sends its final state to rank r+1. The backward runs the chain in reverse: rank r
receives the gradient of its final state from rank r+1 and sends the gradient of its initial state to rank r-1.
The ranks run one after the other (a pipeline of one micro-batch); the result equals the single-process one.

Example (each rank, after torch.distributed.init_process_group)::

    pos = ropewkv.distributed.shard_positions(S, world, rank, split="zigzag", device=q.device)
    q_local, k_local = ropewkv.rope(q_local, k_local, inv_freq=inv_freq, positions=pos)
    y_local, _ = ropewkv.distributed.wkv7_sequence_parallel(r, w, k, v, a, b)   # [B, T/world, H, N] slices
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import _backend

SPLITS = ("contiguous", "zigzag")


def _chunks(seqlen: int, world_size: int, rank: int, split: str) -> list[tuple[int, int]]:
    """The [start, end) token ranges rank `rank` holds, in its local order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    pieces = world_size if split == "contiguous" else 2 * world_size
    if seqlen % pieces:
        raise ValueError(f"seqlen={seqlen} must be divisible by {pieces} for split={split!r} over {world_size} ranks")
    size = seqlen // pieces
    indices = (rank,) if split == "contiguous" else (rank, 2 * world_size - 1 - rank)
    return [(i * size, (i + 1) * size) for i in indices]


def shard_positions(seqlen: int, world_size: int, rank: int, *, split: str = "contiguous",
                    device=None) -> torch.Tensor:
    """The global positions (int64 [seqlen / world_size]) of the tokens rank `rank` holds, in its local order.

    Pass them to `ropewkv.rope(..., positions=...)` (they broadcast over the batch) or `RotaryEmbedding.forward`.
    For split="contiguous" they are `arange(S/W) + rank*S/W`, so `seqlen_offsets=rank * seqlen // world_size` is
    equivalent. For split="zigzag" they are the two chunks r and 2W-1-r concatenated.
    """
    return torch.cat([torch.arange(start, end, dtype=torch.int64, device=device)
                      for start, end in _chunks(seqlen, world_size, rank, split)])


def shard_sequence(x: torch.Tensor, world_size: int, rank: int, *, split: str = "contiguous",
                   seq_dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s shard of the full tensor x along `seq_dim` (1 for bshd, 2 for bhsd, 0 for sbhd/thd).
    A view for "contiguous", a copy for "zigzag"."""
    pieces = [x.narrow(seq_dim, start, end - start)
              for start, end in _chunks(x.shape[seq_dim], world_size, rank, split)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=seq_dim)


def unshard_sequence(shards: Sequence[torch.Tensor], *, split: str = "contiguous", seq_dim: int = 1) -> torch.Tensor:
    """The inverse of shard_sequence: shards[r] is rank r's shard; returns the full tensor in global order.
    "contiguous" shards may differ in length (the time slices of wkv7_sequence_parallel); "zigzag" ones may not."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    world_size = len(shards)
    if split == "contiguous":
        return torch.cat(list(shards), dim=seq_dim)
    lengths = [shard.shape[seq_dim] for shard in shards]
    if len(set(lengths)) != 1 or lengths[0] % 2:
        raise ValueError(f"split='zigzag' needs shards of one even length along seq_dim={seq_dim}, got {lengths}")
    halves = [shard.chunk(2, dim=seq_dim) for shard in shards]
    # Chunks 0..W-1 are the first halves of ranks 0..W-1; chunks W..2W-1 the second halves of ranks W-1..0.
    return torch.cat([h[0] for h in halves] + [halves[r][1] for r in reversed(range(world_size))], dim=seq_dim)


class _AllGather(torch.autograd.Function):
    """Every rank's tensor stacked on a new dim 0; backward: each rank's slice of the summed cotangents (all_reduce,
    which every backend has, unlike reduce_scatter on gloo)."""

    @staticmethod
    def forward(ctx, local, group):
        ctx.group = group
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        return torch.stack(gathered)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def all_gather_sequence(local: torch.Tensor, *, split: str = "contiguous", seq_dim: int = 1,
                        group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Gather every rank's shard of `group` and return the full tensor in global order, on every rank.
    "contiguous" shards may differ in length along seq_dim (the time slices of wkv7_sequence_parallel).
    Differentiable: the gradient of a shard is the sum over the ranks of their cotangents for it."""
    group = group or dist.group.WORLD
    seq_dim = seq_dim % local.dim()
    # all_gather needs one shape on every rank (another one aborts the process or reads garbage): exchange the shapes
    # first, then pad every shard to the longest.
    shape = torch.tensor(local.shape, dtype=torch.int64, device=local.device)
    shapes = [torch.empty_like(shape) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shapes, shape, group=group)
    shapes = [s.tolist() for s in shapes]
    if any(s[:seq_dim] + s[seq_dim + 1:] != shapes[0][:seq_dim] + shapes[0][seq_dim + 1:] for s in shapes):
        raise ValueError(f"local must have one shape on every rank outside seq_dim={seq_dim}, got {shapes}")
    lengths = [s[seq_dim] for s in shapes]
    padded = local
    if local.shape[seq_dim] < max(lengths):
        pad = list(local.shape)
        pad[seq_dim] = max(lengths) - local.shape[seq_dim]
        padded = torch.cat([local, local.new_zeros(pad)], dim=seq_dim)
    shards = _AllGather.apply(padded.contiguous(), group).unbind(0)
    return unshard_sequence([s.narrow(seq_dim, 0, n) for s, n in zip(shards, lengths)], split=split, seq_dim=seq_dim)


class _ReceiveState(torch.autograd.Function):
    """Forward: the state from rank-1. Backward: send its gradient back to rank-1. `anchor` is any input that
    requires grad, so that the received state joins the autograd graph."""

    @staticmethod
    def forward(ctx, anchor, shape, dtype, group, rank):
        ctx.group, ctx.rank = group, rank
        state = torch.empty(shape, dtype=dtype, device=anchor.device)
        dist.recv(state, group_src=rank - 1, group=group)
        return state

    @staticmethod
    def backward(ctx, grad_state):
        dist.send(grad_state.contiguous(), group_dst=ctx.rank - 1, group=ctx.group)
        return None, None, None, None, None


class _SendState(torch.autograd.Function):
    """Forward: send the final state to rank+1, return (y, final_state) unchanged. Backward: receive the gradient of
    the final state from rank+1 and add it to the local cotangent (tied to y so that the backward runs whenever y
    is used by the loss)."""

    @staticmethod
    def forward(ctx, y, final_state, group, rank):
        ctx.group, ctx.rank = group, rank
        dist.send(final_state.detach().contiguous(), group_dst=rank + 1, group=group)
        return y.view_as(y), final_state.view_as(final_state)

    @staticmethod
    def backward(ctx, grad_y, grad_final):
        # grad_final is materialised (zeros when the caller does not use the returned state).
        received = torch.empty_like(grad_final)
        dist.recv(received, group_src=ctx.rank + 1, group=ctx.group)
        return grad_y, received + grad_final, None, None


def wkv7_sequence_parallel(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                           b: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None,
                           initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                           decay: str = "loglog", precision: Optional[str] = None, backend: str = "auto",
                           algorithm: str = "auto"):
    """`ropewkv.wkv7` over a sequence split in time across the ranks of `group` (default: the world).

    Args:
        r, w, k, v, a, b: this rank's time slice, [B, T_local, H, N] (rank r holds the r-th contiguous slice; the
            slices may differ in length). Same conventions as ropewkv.wkv7; no cu_seqlens.
        initial_state: the state before the whole sequence, fp32 [B, H, N, N] (S[v][k]) or None (zeros). Read on
            rank 0 only; the other ranks receive theirs from rank-1.
        output_final_state: also return the state at the end of this rank's slice (on the last rank: the final
            state of the whole sequence). Its cotangent is included in the backward.
        decay, precision, backend, algorithm: as for ropewkv.wkv7.
    Returns:
        (y [B, T_local, H, N] in r's dtype, the state at the end of this rank's slice, fp32, or None).

    Every rank must call this (and later its backward) in the same order: rank r's forward waits for rank r-1's,
    and its backward for rank r+1's. The backward of rank r runs when its loss depends on y or on the returned
    state. Equal to one process running wkv7 on the concatenated sequence (fp32 state is handed over exactly): bit for
    bit with algorithm="sequential", to fp32 rounding with the chunked form ("auto"'s choice on the cpu backend from 8
    tokens), whose chunks each slice aligns to its own end.
    """
    from .ops.rwkv7 import wkv7

    group = group or dist.group.WORLD
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    state = initial_state
    if rank > 0:
        anchor = next((x for x in (r, w, k, v, a, b) if x.requires_grad), r)
        state = _ReceiveState.apply(anchor, (r.shape[0], r.shape[2], r.shape[3], r.shape[3]),
                                    _backend.compute_dtype(r.dtype), group, rank)
    need_final = output_final_state or rank < world_size - 1
    y, final_state = wkv7(r, w, k, v, a, b, initial_state=state, output_final_state=need_final, decay=decay,
                          precision=precision, backend=backend, algorithm=algorithm)
    if rank < world_size - 1:
        y, final_state = _SendState.apply(y, final_state, group, rank)
    return y, (final_state if output_final_state else None)
