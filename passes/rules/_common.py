"""Helpers shared by the rule modules."""

from __future__ import annotations

from typing import Any

from torch.fx import Node
from torch.fx.node import map_aggregate

from fxtp.core.placement import REPLICATE, Shard
from passes.registry import LocalSize, RuleContext, is_tensor_node, shape_of

__all__ = ["tensor_inputs", "activation_placement", "norm_dim", "local_sizes", "local_size", "ndim"]


def tensor_inputs(node: Node) -> list[Node]:
    """The node's tensor-valued input nodes, in argument order, without repeats."""
    seen: dict[Node, None] = {}

    def visit(a: Any) -> Any:
        if is_tensor_node(a):
            seen.setdefault(a, None)
        return a

    map_aggregate((node.args, node.kwargs), visit)
    return list(seen)


def activation_placement(ctx: RuleContext, node: Node):
    """``node``'s placement, but a parameter counts as replicated: parameters are sharded because
    the activations they meet are, never on their own (a shard kept from an earlier planning round
    would otherwise sustain itself). The rule then *wants* the parameter sharded if it must be."""
    return REPLICATE if ctx.is_param(node) else ctx.placement(node)


def ndim(node: Node) -> int:
    return len(shape_of(node))


def norm_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def local_sizes(sizes: Any, index: int, local: int) -> list[Any]:
    """The node's own size list with entry ``index`` (the sharded dim) set to its ``local``
    size. The other entries stay as captured: ints, ``-1``, or the ``sym_size`` nodes of a
    dynamic capture, so the emitted graph runs at every batch and sequence length."""
    out = list(sizes)
    out[index] = local
    return out


def local_size(shard: Shard, world_size: int) -> Any:
    """The local size of ``shard``'s dim for a shape literal: a number when even, else a
    :class:`LocalSize` the rewrite fills in per rank (NOTE: [uneven shards])."""
    return shard.local_size(world_size) if shard.divisible(world_size) else LocalSize(shard)
