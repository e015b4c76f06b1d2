"""Helpers shared by the rule modules."""

from __future__ import annotations

from typing import Any

from torch.fx import Node
from torch.fx.node import map_aggregate

from fxtp.placement import REPLICATE, Shard
from passes.registry import RuleContext, is_tensor_node, shape_of

__all__ = ["tensor_inputs", "activation_placement", "norm_dim", "local_shape", "ndim"]


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


def local_shape(shape: tuple[int, ...], shard: Shard, world_size: int) -> list[int]:
    out = list(shape)
    out[shard.dim] = shard.local_size(world_size)
    return out
