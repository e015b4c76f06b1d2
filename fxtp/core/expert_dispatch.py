"""Expert parallelism's emitted ops: (token, expert) pairs to their experts' ranks and back.

NOTE: [expert parallelism]
Under ``expert_parallel=True`` rank ``r`` holds whole experts, :func:`expert_ranges` of them
(``E // ws``, one more on the first ``E % ws`` ranks: front-loaded, as Megatron-LM's and
vLLM's uneven partitions), i.e. the rows ``[first, first + count)`` of every expert parameter
(``Shard(0)``). The router, the attention and the dense layers keep their tensor-parallel plan,
so the MoE block's input ``hidden`` ``(T, H)`` and the routing ``top_k_index``/``top_k_weights``
``(T, k)`` are replicated. Per MoE block:

1. :func:`dispatch_to_experts`: rank ``r`` takes its block of the tokens (front-loaded, like
   the experts; ``T`` may be anything, 1 in a decode step), sorts its ``(token, expert)``
   pairs by expert, which orders them by destination rank, and sends each pair's row to the
   rank holding its expert: one ``all_to_all_single`` with variable splits. The split sizes
   come from the routing; since the routing is replicated, every rank computes every rank's
   splits (a ``(ws, ws)`` count matrix) itself, and no collective exchanges them. A rank
   sorts what it received by its local expert: ``rows`` ``(N, H)``, ``local_ids`` ``(N,)``,
   ``offsets`` ``(E_r,)``, the inputs of the experts' own computation (the captured
   ``grouped_mm``/``bmm`` ops, run unchanged on this rank's experts).
2. :func:`combine_from_experts`: the experts' rows go back the same way (the same all_to_all,
   splits swapped), each source rank puts them back in pair order, multiplies by its tokens'
   routing weights and sums the top-k, as the single device does (same products, same order).
   Its tokens' rows are written into a zero ``(T, H)``: a ``Partial`` value, all_reduced by
   fxtp's ``g`` after the ops linear in it (NOTE: [deferred reduction]), e.g. together with a
   tensor-parallel shared expert.

No token is dropped and there is no capacity factor. Backward: each all_to_all's is the
reverse all_to_all; the token block of the replicated ``hidden`` and ``top_k_weights`` is a
slice whose backward all_gathers the blocks' gradients, so every rank holds the full gradient
(a replicated value's gradient, as everywhere in fxtp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd import Function

from fxtp.core import collectives
from fxtp.core.placement import Shard, local_ranges

__all__ = ["Route", "expert_ranges", "dispatch_to_experts", "combine_from_experts"]


def expert_ranges(num_experts: int, world_size: int) -> tuple[tuple[int, int], ...]:
    """``(first, count)`` of the experts each rank holds, front-loaded: 6 experts on 4 ranks
    give ``((0, 2), (2, 2), (4, 1), (5, 1))``."""
    shard = Shard(0, (num_experts,))
    return tuple(local_ranges(shard, r, world_size)[0] for r in range(world_size))


@dataclass(frozen=True)
class Route:
    """Where this rank's pairs went and where its received rows came from (one MoE block, one call).

    ``start``, ``count``: this rank's tokens; ``order``: its ``count * top_k`` pairs sorted by
    expert (indices into the pairs ``t * top_k + j``); ``local_order``: the received rows
    sorted by local expert; ``send``/``recv``: rows per rank of the dispatch all_to_all.
    """

    start: int
    count: int
    top_k: int
    order: torch.Tensor
    local_order: torch.Tensor
    send: list[int]
    recv: list[int]
    world_size: int
    group_name: str


class _TokenBlock(Function):
    """Rows ``[start, start + count)`` of a replicated ``(T, ...)`` value; backward all_gathers
    every rank's block of the gradient (front-loaded blocks of ``T``)."""

    @staticmethod
    def forward(ctx, x, start, count, world_size, group_name):  # type: ignore[override]
        ctx.args = (x.shape[0], world_size, group_name)
        return x.narrow(0, start, count).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        total, world_size, group_name = ctx.args
        return collectives.all_gather(grad, 0, (total,), world_size, group_name), None, None, None, None


def _token_blocks(tokens: int, world_size: int) -> torch.Tensor:
    """``(ws + 1,)`` boundaries of the ranks' front-loaded token blocks."""
    sizes = [length for _, length in (local_ranges(Shard(0, (tokens,)), r, world_size)[0] for r in range(world_size))]
    return torch.tensor([0, *sizes]).cumsum(0)


def dispatch_to_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    num_experts: int,
    rank: int,
    world_size: int,
    group_name: str,
    ids_dtype: torch.dtype = torch.int64,
    offsets_dtype: torch.dtype = torch.int32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Route]:
    """Send this rank's (token, expert) pairs to their experts' ranks (NOTE: [expert parallelism]).

    Args:
        hidden: ``(T, H)``, replicated: the MoE block's tokens.
        top_k_index: ``(T, k)`` integer expert ids in ``[0, num_experts)``, replicated.
        num_experts: ``E``. rank, world_size, group_name: the expert-parallel group.
        ids_dtype, offsets_dtype: the dtypes the captured experts' computation reads.

    Returns:
        ``rows`` ``(N, H)``: the rows this rank's experts get, sorted by local expert;
        ``local_ids`` ``(N,)``: each row's expert, ``0 <= id < E_r``; ``offsets`` ``(E_r,)``: the
        cumulative rows per local expert (``grouped_mm``'s ``offs``); the :class:`Route` back.
    """
    tokens, top_k = top_k_index.shape
    bounds = _token_blocks(tokens, world_size).to(top_k_index.device)
    start, count = int(bounds[rank]), int(bounds[rank + 1] - bounds[rank])
    firsts = torch.tensor([first for first, _ in expert_ranges(num_experts, world_size)], device=top_k_index.device)
    ids = top_k_index.reshape(-1)
    owner = torch.searchsorted(firsts, ids, right=True) - 1  # the rank holding each pair's expert
    source = torch.searchsorted(bounds, torch.arange(tokens, device=ids.device).repeat_interleave(top_k), right=True) - 1
    counts = torch.bincount(source * world_size + owner, minlength=world_size * world_size).view(world_size, world_size)
    send, recv = counts[rank].tolist(), counts[:, rank].tolist()
    mine = ids[start * top_k:(start + count) * top_k]
    order = torch.argsort(mine, stable=True)  # by expert, hence by destination rank
    block = _TokenBlock.apply(hidden, start, count, world_size, group_name)
    rows = collectives.exchange_rows(block[order // top_k], recv, send, group_name)
    # The experts of the rows received, in arrival order (by source rank, then expert): known from the routing.
    here = owner == rank
    arrival = torch.argsort(source[here] * num_experts + ids[here], stable=True)
    local = ids[here][arrival] - firsts[rank]
    local_order = torch.argsort(local, stable=True)
    local_ids = local[local_order]
    held = expert_ranges(num_experts, world_size)[rank][1]
    offsets = torch.bincount(local_ids, minlength=held).cumsum(0).to(offsets_dtype)
    route = Route(start, count, top_k, order, local_order, send, recv, world_size, group_name)
    return rows[local_order], local_ids.to(ids_dtype), offsets, route


def combine_from_experts(rows: torch.Tensor, route: Route, top_k_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The experts' output rows back to their tokens, weighted and summed over the top-k
    (NOTE: [expert parallelism]).

    Args:
        rows: ``(N, H)``: the experts' output for the rows :func:`dispatch_to_experts` gave, same order.
        route: that dispatch's :class:`Route`.
        top_k_weights: ``(T, k)`` routing weights, replicated.
        dtype: the MoE block's output dtype.

    Returns:
        ``(T, H)`` in ``dtype``: this rank's tokens' combined output, zeros elsewhere; the sum
        over the ranks (``Partial``) is the single device's output.
    """
    arrived = torch.empty_like(route.local_order).scatter_(0, route.local_order, torch.arange(rows.shape[0], device=rows.device))
    back = collectives.exchange_rows(rows[arrived], route.send, route.recv, route.group_name)
    pairs = torch.empty_like(route.order).scatter_(0, route.order, torch.arange(back.shape[0], device=back.device))
    weights = _TokenBlock.apply(top_k_weights, route.start, route.count, route.world_size, route.group_name)
    hidden = back.shape[-1]
    combined = (back[pairs] * weights.reshape(-1, 1)).view(route.count, route.top_k, hidden).sum(dim=1).to(dtype)
    tokens = top_k_weights.shape[0]
    return torch.nn.functional.pad(combined, (0, 0, route.start, tokens - route.start - route.count))
