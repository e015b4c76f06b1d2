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
plan forces a shard into a consumer that needs the whole tensor. :func:`copy_to_holders` is
``f`` for a parameter whose units several ranks hold (NOTE: [grouped shards] in
``fxtp/core/placement.py``). :func:`sum_statistics` (``g`` then ``f``: all_reduce forward and
backward) sums the per-rank statistics of a norm over a sharded dim (NOTE: [distributed norm] in
``fxtp/core/norms.py``).

Sequence parallelism (Korthikanti et al. 2022, section 4.2.2; NOTE: [sequence parallelism] in
passes/sequence.py) replaces ``g`` by :func:`reduce_scatter_to_sp` (reduce_scatter forward,
all_gather backward) and ``f`` by :func:`gather_from_sp` (all_gather forward, reduce_scatter
backward); :func:`scatter_to_sp` (slice forward, all_gather backward) brings a replicated value
into the token-sharded region.

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

from fxtp.core import activations
from fxtp.core.errors import FxtpInputError
from fxtp.core.placement import Shard, local_ranges, owned_ranges

__all__ = [
    "copy_to_tp",
    "copy_to_holders",
    "reduce_from_tp",
    "gather_from_tp",
    "reduce_scatter_to_sp",
    "gather_from_sp",
    "scatter_to_sp",
    "sum_statistics",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "exchange_rows",
    "release",
]

_c10d = torch.ops._c10d_functional

# NOTE: [gloo frees] A tensor handed to a gloo collective (its contiguous input, the flat output)
# is also held by gloo's finished work until gloo's worker thread drops it, a moment after the
# caller's wait returns. If the caller lets go first, the worker thread frees the block, outside
# any profiler state: torch.profiler then records the allocation and never the free, and the
# allocator seems to hold a gathered tensor that is gone (NOTE: [allocator bytes on the calling
# thread] in fxtp/runtime/memory.py). The caller keeps the last collective's CPU buffers until the
# next collective or the end of the forward (``release``): by then gloo has dropped its
# references and the free is the caller's. The cost: one collective's buffers live a little longer.
_HANDED: list[torch.Tensor] = []


def _handed(*tensors: torch.Tensor) -> None:
    if tensors[0].device.type == "cpu" and not torch.compiler.is_compiling():
        _HANDED[:] = tensors


def release() -> None:
    """Drop the buffers kept for NOTE: [gloo frees]; ``ParallelModule.forward`` calls it last."""
    _HANDED.clear()


def all_reduce(t: torch.Tensor, group_name: str, op: str = "sum") -> torch.Tensor:
    """``op`` (``"sum"``, ``"max"``) of ``t`` over the group's ranks (a new tensor, no autograd),
    laid out as ``t`` (NOTE: [sum in the partial's layout])."""
    # NOTE: [sum in the partial's layout] A rank's partial sum is laid out as the single device's
    # whole value (nn.MultiheadAttention's batch_first output is a transpose), and a consumer can
    # take another path on another layout: F.linear with a bias flattens a contiguous 3-d input and
    # returns a view of addmm's output, but a new tensor for the transposed one. So the sum keeps
    # ``t``'s layout: the collective runs on ``t``'s dims in memory order (contiguous, as the
    # collectives need, with no copy where ``t`` is dense: the collective's own copy is the only
    # one) and its output is permuted back. ``detach`` makes that permutation a tensor of its own,
    # not a view (an in-place op on a custom Function's output is then allowed; see reduce_scatter).
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))  # outermost in memory first
    moved = t.permute(order).contiguous()
    out = _c10d.wait_tensor(_c10d.all_reduce(moved, op, group_name))
    _handed(moved, out)
    return out.permute([order.index(d) for d in range(t.dim())]).detach()


def all_gather(
    t: torch.Tensor, dim: int, segments: tuple[int, ...], world_size: int, group_name: str, unit: int = 1,
    groups: tuple[int, ...] = (),
) -> torch.Tensor:
    """The full tensor from every rank's shard along ``dim`` (layout: NOTE: [segments]).

    Uneven shards (NOTE: [uneven shards]): each rank pads its piece to the largest, the padded
    pieces are all_gathered, and each rank's real rows are narrowed out. Grouped shards (NOTE:
    [grouped shards]): ``t`` is the part the rank owns (``placement.owned_part``).
    """
    shard = Shard(dim, tuple(segments), unit, tuple(groups))
    held = owned_ranges if shard.overlaps else local_ranges
    moved = t.movedim(dim, 0)
    ranges = [held(shard, r, world_size) for r in range(world_size)]
    longest = max(sum(length for _, length in r) for r in ranges)
    if moved.shape[0] < longest:
        moved = torch.cat([moved, moved.new_zeros((longest - moved.shape[0], *moved.shape[1:]))])
    moved = moved.contiguous()
    flat = _c10d.wait_tensor(_c10d.all_gather_into_tensor(moved, world_size, group_name))
    _handed(moved, flat)
    per_rank = flat.chunk(world_size, dim=0)
    pieces = []
    for i in range(len(segments)):
        for r in range(world_size):
            offset = sum(length for _, length in ranges[r][:i])
            pieces.append(per_rank[r].narrow(0, offset, ranges[r][i][1]))
    # joined along ``dim`` itself: one copy, contiguous and no view, as the unsharded op's output
    # (a user's ``logits.view(-1, vocab)`` works; FSDP2 warns of a view returned by its module)
    return torch.cat([p.movedim(0, dim) for p in pieces], dim=dim)


def reduce_scatter(t: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    """This rank's block of the sum over the ranks of ``t``, split evenly along ``dim`` (whose
    size must divide ``world_size``): the inverse layout of :func:`all_gather` with one segment."""
    # the blocks laid out one after another along dim 0, (world_size * t.shape[0], ..., block, ...),
    # so that the collective's own output is the result: contiguous and no view (an in-place op on
    # it, ``y += x``, is then allowed inside a custom Function's output)
    blocks = (t if dim == 0 else t.unflatten(dim, (world_size, -1)).movedim(dim, 0).flatten(0, 1)).contiguous()
    out = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(blocks, "sum", world_size, group_name))
    _handed(blocks, out)
    return out


def all_to_all(t: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str) -> torch.Tensor:
    """Rows ``t[sum(in_splits[:r]):][:in_splits[r]]`` go to rank ``r``; the result stacks the
    ``out_splits[r]`` rows each rank ``r`` sent here, in rank order (``all_to_all_single`` with
    split lists; no autograd). ``t``: ``(sum(in_splits), ...)``; returns ``(sum(out_splits), ...)``."""
    t = t.contiguous()
    out = _c10d.wait_tensor(_c10d.all_to_all_single(t, out_splits, in_splits, group_name))
    _handed(t, out)
    return out


class _ExchangeRows(Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group_name):  # type: ignore[override]
        ctx.args = (in_splits, out_splits, group_name)
        return all_to_all(x, out_splits, in_splits, group_name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return all_to_all(grad, *ctx.args), None, None, None


def exchange_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str) -> torch.Tensor:
    """:func:`all_to_all` with autograd: backward sends every row's gradient back where the row
    came from (the same all_to_all, splits swapped)."""
    return _ExchangeRows.apply(x, out_splits, in_splits, group_name)


def _gather_tokens(t: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    """All_gather of equal blocks along ``dim``, contiguous: a layer's ``reshape`` of it is then a
    view, which NOTE: [regathered activations] recognizes."""
    moved = t.movedim(dim, 0).contiguous()
    flat = _c10d.wait_tensor(_c10d.all_gather_into_tensor(moved, world_size, group_name))
    _handed(moved, flat)
    if dim == 0:
        return flat
    # joined along ``dim``: a copy, never a view (see reduce_scatter), even where ``movedim`` of a
    # batch of 1 is already contiguous and ``.contiguous()`` would hand the view back
    return torch.cat([piece.movedim(0, dim) for piece in flat.chunk(world_size, dim=0)], dim=dim)


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


class _CopyToHolders(Function):
    @staticmethod
    def forward(ctx, layout, group_name, *tensors):  # type: ignore[override]
        ctx.layout, ctx.group_name = layout, group_name
        ctx.meta = [(t.shape, t.dtype, t.device) for t in tensors]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        grads = tuple(torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                      for g, (shape, dtype, device) in zip(grads, ctx.meta))
        fulls = []
        for grad, (dim, ranges, size) in zip(grads, ctx.layout):
            full = grad.new_zeros((*grad.shape[:dim], size, *grad.shape[dim + 1:]))
            pos = 0
            for start, length in ranges:
                if start >= 0:
                    full.narrow(dim, start, length).copy_(grad.narrow(dim, pos, length))
                pos += length
            fulls.append(full)
        flat = all_reduce(torch.cat([f.reshape(-1).to(fulls[0].dtype) for f in fulls]), ctx.group_name)
        out, offset = [], 0
        for grad, full, (dim, ranges, _) in zip(grads, fulls, ctx.layout):
            summed = flat[offset:offset + full.numel()].view(full.shape).to(full.dtype)
            offset += full.numel()
            pieces, pos = [], 0
            for start, length in ranges:  # a range of a plain segment (start -1) is this rank's alone
                pieces.append(summed.narrow(dim, start, length) if start >= 0 else grad.narrow(dim, pos, length))
                pos += length
            out.append(torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0].contiguous())
        return (None, None, *out)


class _ReduceFromTP(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:  # type: ignore[override]
        return all_reduce(x, group_name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


class _SumStatistics(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:  # type: ignore[override]
        ctx.group_name = group_name
        return all_reduce(x, group_name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return all_reduce(grad, ctx.group_name), None


class _GatherFromTP(Function):
    @staticmethod
    def forward(ctx, x, dim, segments, rank, world_size, group_name, unit):  # type: ignore[override]
        ctx.args = (dim, segments, rank, world_size, unit)
        return all_gather(x, dim, segments, world_size, group_name, unit)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _local(grad, *ctx.args), None, None, None, None, None, None


class _ReduceScatterToSP(Function):
    @staticmethod
    def forward(ctx, x, dim, world_size, group_name):  # type: ignore[override]
        ctx.args = (dim, world_size, group_name)
        return reduce_scatter(x, dim, world_size, group_name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _gather_tokens(grad, *ctx.args), None, None, None


class _GatherFromSP(Function):
    @staticmethod
    def forward(ctx, x, dim, rank, world_size, group_name, sum_grad, regather):  # type: ignore[override]
        ctx.args, ctx.rank, ctx.sum_grad = (dim, world_size, group_name), rank, sum_grad
        full = _gather_tokens(x, dim, world_size, group_name)
        if regather:
            activations.gathered(full, x, lambda shard: _gather_tokens(shard, dim, world_size, group_name))
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        dim, world_size, group_name = ctx.args
        if ctx.sum_grad:
            return reduce_scatter(grad, dim, world_size, group_name), None, None, None, None, None, None
        return grad.chunk(world_size, dim)[ctx.rank].contiguous(), None, None, None, None, None, None


class _ScatterToSP(Function):
    @staticmethod
    def forward(ctx, x, dim, rank, world_size, group_name):  # type: ignore[override]
        ctx.args = (dim, world_size, group_name)
        return x.chunk(world_size, dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _gather_tokens(grad, *ctx.args), None, None, None, None


def copy_to_tp(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Megatron's ``f``: identity forward, all_reduce backward. Same shape and dtype as ``x``."""
    return _CopyToTP.apply(x, group_name)


def copy_to_holders(
    tensors: list[torch.Tensor], layout: tuple[tuple[int, tuple[tuple[int, int], ...], int], ...], group_name: str
) -> tuple[torch.Tensor, ...]:
    """``f`` on parameters held as grouped shards (NOTE: [grouped shards] in
    ``fxtp/core/placement.py``): identity forward; backward, each unit's gradient summed over the
    ranks that hold it. Each rank holds in its gradient the part its own query heads give.

    The sum is one all_reduce over the whole tensor-parallel group, for all of ``tensors`` (an
    attention's k and v projections), of zero tensors of their grouped segments' global sizes into
    which each rank puts its rows (a rank that does not hold a unit adds zeros; the query rows of
    a fused projection are one rank's alone and stay out of it): exact, no sub-groups to create
    (they would need every rank of the job), and the parameters' global bytes once per backward
    (the holders' sub-group reductions would move about as much when, as here, the kv heads are
    shared by most ranks or each by a few ranks of a ring).

    Args:
        tensors: this rank's rows of each parameter (its ``local_ranges``, concatenated).
        layout: per tensor ``(dim, ranges, size)``: the grouped dim, per local range in order
            ``(start, length)``, ``start`` its offset among the grouped segments' rows (``-1``:
            a plain segment's rows, not summed), and the grouped segments' global size on ``dim``
            (:func:`fxtp.core.placement.holder_layout`).
        group_name: the tensor-parallel process group.

    Returns:
        ``tensors`` (views), whose gradients are the sums over the holders.
    """
    return _CopyToHolders.apply(layout, group_name, *tensors)


def reduce_from_tp(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Megatron's ``g``: all_reduce (sum) forward, identity backward. Same shape and dtype."""
    return _ReduceFromTP.apply(x, group_name)


def sum_statistics(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum over the ranks of per-rank partial statistics ``x`` (sums of squares over a
    shard) that every rank then uses on its own shard: ``g`` then ``f``, all_reduce forward and
    all_reduce backward (each rank's gradient of the sum covers its shard's use only). Same
    shape and dtype as ``x``."""
    return _SumStatistics.apply(x, group_name)


def gather_from_tp(
    x: torch.Tensor, dim: int, segments: tuple[int, ...], rank: int, world_size: int, group_name: str, unit: int = 1
) -> torch.Tensor:
    """All_gather of a shard along ``dim`` (global size ``sum(segments)``, split in units of
    ``unit``, even or not: NOTE: [uneven shards]); backward keeps this rank's slice of the gradient."""
    return _GatherFromTP.apply(x, dim, segments, rank, world_size, group_name, unit)


def reduce_scatter_to_sp(x: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    """Sequence parallelism's ``g``: this rank's block along ``dim`` of the sum over the ranks
    (reduce_scatter; ``x.shape[dim]`` must divide ``world_size``), all_gather backward. Shape:
    ``x``'s with ``dim`` divided by ``world_size``."""
    _check_tokens(x, dim, world_size)
    return _ReduceScatterToSP.apply(x, dim, world_size, group_name)


def gather_from_sp(
    x: torch.Tensor, dim: int, rank: int, world_size: int, group_name: str, sum_grad: bool, regather: bool = False
) -> torch.Tensor:
    """Sequence parallelism's ``f``: all_gather of every rank's block along ``dim``; backward
    reduce_scatters the gradient when it is a partial sum (``sum_grad``: a sharded op consumes
    the value), else keeps this rank's block of it. ``regather``: a layer that saves the result
    for backward saves ``x`` instead (NOTE: [regathered activations] in fxtp/core/activations.py)."""
    return _GatherFromSP.apply(x, dim, rank, world_size, group_name, sum_grad, regather)


def scatter_to_sp(x: torch.Tensor, dim: int, rank: int, world_size: int, group_name: str) -> torch.Tensor:
    """This rank's block of a replicated ``x`` along ``dim`` (Megatron-LM's
    ``scatter_to_sequence_parallel_region``): slice forward, all_gather backward."""
    _check_tokens(x, dim, world_size)
    return _ScatterToSP.apply(x, dim, rank, world_size, group_name)


def _check_tokens(x: torch.Tensor, dim: int, world_size: int) -> None:
    if x.shape[dim] % world_size:
        raise FxtpInputError(
            f"sequence_parallel=True shards dim {dim} of a value of shape {tuple(x.shape)} (its tokens) over "
            f"world_size {world_size}, and {x.shape[dim]} does not divide by it. fix: pad the sequence to a multiple "
            f"of {world_size}, or compile with sequence_parallel=False"
        )
