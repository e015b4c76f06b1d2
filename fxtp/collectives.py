"""The communication fxtp inserts: Megatron-LM's ``f`` and ``g`` operators and a gather.

Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models
Using Model Parallelism", section 3) pairs two conjugate operators around a tensor-parallel
region:

* ``f`` (:func:`copy_to_tp`): identity forward, all_reduce of the gradient backward. Placed
  where a replicated value enters sharded computation: each rank's gradient is only the part
  its shard contributes.
* ``g`` (:func:`reduce_from_tp`): all_reduce forward, identity backward. Placed after a
  rowwise layer's partial sums: the summed output is replicated, so is its gradient.

:func:`gather_from_tp` (all_gather forward, local slice backward) is used only where a user
plan forces a shard into a consumer that needs the whole tensor.

Every function takes plain arguments (a group *name*, ints, tuples) so the emitted FX graph
holds only plain tensors and literals and prints as readable code.

NOTE: [private torch API] The collectives are torch's functional collectives,
``torch.ops._c10d_functional`` (what ``torch.distributed._functional_collectives``, DTensor and
torch.compile use). They are the only collectives that work in eager mode, under autograd and
traced by dynamo alike, and they address a process group by name. The namespace is private, so
it is used in this module only.
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from fxtp.placement import Shard, local_ranges

__all__ = ["copy_to_tp", "reduce_from_tp", "gather_from_tp", "all_reduce", "all_gather"]

_c10d = torch.ops._c10d_functional


def all_reduce(t: torch.Tensor, group_name: str, op: str = "sum") -> torch.Tensor:
    """``op`` (``"sum"``, ``"max"``) of ``t`` over the group's ranks (a new tensor, no autograd)."""
    return _c10d.wait_tensor(_c10d.all_reduce(t.contiguous(), op, group_name))


def all_gather(
    t: torch.Tensor, dim: int, segments: tuple[int, ...], world_size: int, group_name: str, unit: int = 1
) -> torch.Tensor:
    """The full tensor from every rank's shard along ``dim`` (layout: NOTE: [segments]).

    Uneven shards (NOTE: [uneven shards]): each rank pads its piece to rank 0's size (the
    largest), the padded pieces are all_gathered, and each rank's real rows are narrowed out.
    """
    shard = Shard(dim, tuple(segments), unit)
    moved = t.movedim(dim, 0)
    longest = shard.local_size(world_size, 0)
    if moved.shape[0] < longest:
        moved = torch.cat([moved, moved.new_zeros((longest - moved.shape[0], *moved.shape[1:]))])
    flat = _c10d.wait_tensor(_c10d.all_gather_into_tensor(moved.contiguous(), world_size, group_name))
    per_rank = flat.chunk(world_size, dim=0)
    ranges = [local_ranges(shard, r, world_size) for r in range(world_size)]
    pieces = []
    for i in range(len(segments)):
        for r in range(world_size):
            offset = sum(length for _, length in ranges[r][:i])
            pieces.append(per_rank[r].narrow(0, offset, ranges[r][i][1]))
    return torch.cat(pieces, dim=0).movedim(0, dim)


def _local(t: torch.Tensor, dim: int, segments: tuple[int, ...], rank: int, world_size: int, unit: int) -> torch.Tensor:
    pieces = [t.narrow(dim, start, length) for start, length in local_ranges(Shard(dim, tuple(segments), unit), rank, world_size)]
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0].contiguous()


class _CopyToTP(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:  # type: ignore[override]
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return all_reduce(grad, ctx.group_name), None


class _ReduceFromTP(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:  # type: ignore[override]
        return all_reduce(x, group_name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


class _GatherFromTP(Function):
    @staticmethod
    def forward(ctx, x, dim, segments, rank, world_size, group_name, unit):  # type: ignore[override]
        ctx.args = (dim, segments, rank, world_size, unit)
        return all_gather(x, dim, segments, world_size, group_name, unit)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _local(grad, *ctx.args), None, None, None, None, None, None


def copy_to_tp(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Megatron's ``f``: identity forward, all_reduce backward. Same shape and dtype as ``x``."""
    return _CopyToTP.apply(x, group_name)


def reduce_from_tp(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Megatron's ``g``: all_reduce (sum) forward, identity backward. Same shape and dtype."""
    return _ReduceFromTP.apply(x, group_name)


def gather_from_tp(
    x: torch.Tensor, dim: int, segments: tuple[int, ...], rank: int, world_size: int, group_name: str, unit: int = 1
) -> torch.Tensor:
    """All_gather of a shard along ``dim`` (global size ``sum(segments)``, split in units of
    ``unit``, even or not: NOTE: [uneven shards]); backward keeps this rank's slice of the gradient."""
    return _GatherFromTP.apply(x, dim, segments, rank, world_size, group_name, unit)
