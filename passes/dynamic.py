"""Which dynamic sizes a sharding plan depends on (NOTE: [dynamic shapes] in fxtp/capture/frontends.py).

Rules reason on the example's sizes (``registry.shape_of``). That is sound for any size of a
dynamic dim only if no decision reads one: a sharded dim must be static (its segments, local
size and split sizes are numbers in the plan), and a view that regroups the sharded dim must
group it with static dims only (its placement is computed from their sizes). ``plan_symbols``
finds the symbols that break this; the caller specializes them (captures again with those
dims static) and says so in the report.

Reads ``node.meta["val"]`` and the plan; writes nothing.
"""

from __future__ import annotations

import math

import sympy
import torch
from torch.fx import Graph, Node

from fxtp.core.placement import Shard
from fxtp.core.rng import ELEMENTWISE, is_random
from passes.plan import ShardingPlan
from passes.registry import is_tensor_node, shape_of
from passes.rules.shape import group_dims

__all__ = ["plan_symbols"]

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int, aten.flatten.using_ints)


def _symbols(size) -> set[str]:
    return {str(s) for s in size.node.expr.free_symbols} if isinstance(size, torch.SymInt) else set()


def plan_symbols(graph: Graph, plan: ShardingPlan) -> dict[str, str]:
    """``{symbol: why}`` for every dynamic size a decision of ``plan`` depends on (empty when
    the plan holds at every size the capture allows)."""
    nodes = {n.name: n for n in graph.nodes}
    found: dict[str, str] = {}

    def check(node: Node, val, shard: Shard, what: str) -> None:
        for sym in _symbols(val.shape[shard.dim]):
            found.setdefault(sym, f"{what} {node.name} is sharded on dim {shard.dim} of size {val.shape[shard.dim]}")

    for name, placement in plan.placements.items():
        node, val = nodes[name], nodes[name].meta.get("val")
        if _any_token_count(node, plan):
            continue
        pieces = placement if isinstance(placement, tuple) else (placement,)
        vals = val if isinstance(val, (tuple, list)) else (val,)
        for p, v in zip(pieces, vals):
            if isinstance(p, Shard) and isinstance(v, torch.Tensor):
                check(node, v, p, "value")
        if node.target in _VIEWS and is_tensor_node(node.args[0]):
            source = plan.placements.get(node.args[0].name)
            if isinstance(source, Shard) and not _gathered(plan, node, node.args[0]):
                _check_view(node, source, found)
    for (consumer, producer), action in plan.edges.items():
        if action.kind == "sp_gather" or action.kind == "sp_scatter" and action.enter:
            continue  # sized at run time (fxtp.core.collectives), NOTE: [sequence parallelism]
        if action.placement is not None:
            check(nodes[consumer], nodes[producer].meta["val"], action.placement, f"input {producer} of")
    return found


def _gathered(plan: ShardingPlan, consumer: Node, producer: Node) -> bool:
    """Does ``consumer`` take ``producer`` all_gathered (a forced plan's gather, or where a
    token-sharded region ends, e.g. the ``view(-1, H)`` that flattens an MoE block's tokens with
    the batch)? Then it reads the whole value, and its sizes need not be static."""
    action = plan.edges.get((consumer.name, producer.name))
    return action is not None and action.kind in ("gather", "sp_gather")


def _any_token_count(node: Node, plan: ShardingPlan) -> bool:
    """A value sharded on tokens whose op reads no size (no local shape literal; a random op
    draws its mask sized at run time, ``fxtp.core.rng.token_random``): it runs at any token count
    the collectives accept (NOTE: [sequence parallelism] in passes/sequence.py)."""
    random = is_random(node.target, node.args, node.kwargs)
    return (node.name in plan.tokens and node.name not in plan.local_args and node.name not in plan.local_targets
            and (not random or node.target in ELEMENTWISE))


def _check_view(node: Node, shard: Shard, found: dict[str, str]) -> None:
    """The dims a view groups with the sharded one, and everything before them, must be static
    in size (or their products equal whatever the sizes): then the grouping read on the
    example's sizes holds at every size."""
    src, out = node.args[0].meta["val"].shape, node.meta["val"].shape
    ins, outs = next(g for g in group_dims(shape_of(node.args[0]), shape_of(node)) if shard.dim in g[0])
    syms = set().union(*(_symbols(src[i]) for i in ins), *(_symbols(out[o]) for o in outs))
    before_in = math.prod(_expr(s) for s in src[: ins[0]])
    before_out = math.prod(_expr(s) for s in out[: outs[0]]) if outs else before_in
    if sympy.expand(before_in - before_out) != 0:
        syms |= set().union(*(_symbols(s) for s in (*src[: ins[0]], *out[: outs[0]])))
    for sym in syms:
        found.setdefault(sym, f"view {node.name} regroups the sharded dim {shard.dim} with a dim of dynamic size")


def _expr(size) -> sympy.Expr:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))
