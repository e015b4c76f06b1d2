"""Rewrite: apply a :class:`~passes.plan.ShardingPlan` to the captured graph for one rank.

Reads ``plan`` only; writes ``node.meta["fxtp_placement"]`` (the global placement, as text) on
every node it knows and on the nodes it inserts. Parameters stay placeholders: the runtime feeds
their local shards.

For each node, in order:

* shape literals become local (``view(x, [2, 16, 4, 8])`` -> ``view(x, [2, 16, 2, 8])``);
* inputs get the edge's local work: ``f`` for a replicated float value entering sharded
  computation (one per producer), a local slice, or a gather;
* a random op on a sharded value (a train-mode dropout, ``bernoulli``, an attention's
  ``dropout_p``) draws this rank's slice of one global mask (``fxtp.core.rng.sharded_call``,
  NOTE: [dropout across ranks]);
* an expert-parallel block's rows come from ``dispatch_to_experts`` and its output from
  ``combine_from_experts`` (``passes/moe/parallel.py``, NOTE: [expert parallelism]);
* a parameter held as a grouped shard (NOTE: [grouped shards]) is used through
  ``copy_to_holders``, which sums its gradient over the ranks that hold it;
* a ``Partial`` output gets ``g`` (all_reduce) right after it and the bias added after that
  (under sequence parallelism a reduce_scatter, NOTE: [sequence parallelism])::

      linear = aten.linear.default(reshape, p_wo_weight, p_wo_bias)
  becomes
      linear = aten.linear.default(reshape, p_wo_weight)
      reduce_from_tp = fxtp.core.collectives.reduce_from_tp(linear, '0')
      type_as = aten.type_as.default(p_wo_bias, reduce_from_tp)  # autocast: the linear's dtype
      add = aten.add.Tensor(reduce_from_tp, type_as)
"""

from __future__ import annotations

import copy
import operator

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from fxtp.core import collectives, local_ops, rng
from fxtp.core.placement import Shard, holder_layout, local_ranges
from passes.moe.parallel import dispatch_experts
from passes.plan import ShardingPlan
from passes.propagate import EdgeAction
from passes.registry import GroupName, LocalSize, ShardStart

__all__ = ["rewrite"]

aten = torch.ops.aten


def rewrite(gm: GraphModule, plan: ShardingPlan, *, rank: int, group_name: str) -> GraphModule:
    """Return a new GraphModule computing rank ``rank``'s part; ``gm`` is not modified."""
    graph, nodes = _copy_graph(gm.graph)
    old_name = {new: old for old, new in nodes.items()}
    dispatch_experts(graph, nodes, old_name, plan, rank, group_name)  # NOTE: [expert parallelism]
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    ws = plan.world_size
    cache: dict[tuple, Node] = {}
    # what consumers read for each original name: the node, or what replaced it (its reduction, its
    # token slice, its bias share). A rule's local args name the original: they must read this
    # (a token-sharded view right after a rowwise layer's reduce_scatter, "sp-bmm-heads-batch1")
    current: dict[str, Node] = {}

    def after(node: Node):
        return graph.inserting_after(last_placeholder if node.op == "placeholder" else node)

    def enter(value: Node, consumer: Node | None = None) -> Node:
        key = ("enter", value)
        if key not in cache:
            # NOTE: [f of a value written in place]: a buffer filled by in-place writes into its views
            # (DeepSeek-V2's key_states = new_empty(...); key_states[..., :d] = k) enters after the
            # writes, just before its first consumer: an autograd view taken before an in-place write
            # of its base is an error.
            where = graph.inserting_before(consumer) if consumer is not None and _written_in_place(value) else after(value)
            with where:
                cache[key] = graph.call_function(collectives.copy_to_tp, (value, group_name))
            cache[key].meta["fxtp_placement"] = "R"
        return cache[key]

    def local_slice(value: Node, shard: Shard) -> Node:
        key = ("slice", value, shard)
        if key not in cache:
            anchor = last_placeholder if value.op == "placeholder" else value
            pieces = []
            for start, length in local_ranges(shard, rank, ws):  # one slice per segment, in order
                with graph.inserting_after(anchor):
                    anchor = graph.call_function(aten.slice.Tensor, (value, shard.dim, start, start + length))
                pieces.append(anchor)
            if len(pieces) > 1:
                with graph.inserting_after(anchor):
                    anchor = graph.call_function(aten.cat.default, (pieces, shard.dim))
            anchor.meta["fxtp_placement"] = str(shard)
            cache[key] = anchor
        return cache[key]

    def gather(value: Node, shard: Shard) -> Node:
        key = ("gather", value)
        if key not in cache:
            with after(value):
                cache[key] = graph.call_function(
                    collectives.gather_from_tp,
                    (value, shard.dim, shard.segments, rank, ws, group_name, *((shard.unit,) if shard.unit != 1 else ())),
                )
            cache[key].meta["fxtp_placement"] = "R"
        return cache[key]

    def gather_sequence(value: Node, shard: Shard, sum_grad: bool, regather: bool) -> Node:
        key = ("sp_gather", value, sum_grad)
        if key not in cache:
            with after(value):
                cache[key] = graph.call_function(
                    collectives.gather_from_sp, (value, shard.dim, rank, ws, group_name, sum_grad, regather)
                )
            cache[key].meta["fxtp_placement"] = "R"
        return cache[key]

    def scatter_sequence(value: Node, shard: Shard) -> Node:
        key = ("sp_scatter", value, shard)
        if key not in cache:
            with after(value):
                cache[key] = graph.call_function(collectives.scatter_to_sp, (value, shard.dim, rank, ws, group_name))
            cache[key].meta["fxtp_placement"] = str(shard)
        return cache[key]

    def materialize(value: Node, action: EdgeAction, consumer: Node) -> Node:
        if action.kind == "sp_gather":  # NOTE: [sequence parallelism]
            assert action.placement is not None
            gathered = gather_sequence(value, action.placement, action.enter, action.regather)
            return gathered if action.then is None else materialize(gathered, action.then, consumer)
        if action.kind == "sp_scatter":
            assert action.placement is not None
            return scatter_sequence(value, action.placement) if action.enter else local_slice(value, action.placement)
        if action.kind == "enter":
            return enter(value, consumer)
        if action.kind == "slice":
            assert action.placement is not None
            return local_slice(enter(value, consumer) if action.enter else value, action.placement)
        assert action.kind == "gather" and action.placement is not None
        gathered = gather(value, action.placement)
        return enter(gathered) if action.enter else gathered

    anchor = last_placeholder
    for names in plan.holders:  # NOTE: [grouped shards]: gradients summed over the holders, one all_reduce per group
        held = [nodes[n] for n in names if getattr(nodes[n].meta.get("val"), "requires_grad", False)]
        if held:
            shards = [plan.params[old_name[p]] for p in held]
            layout = tuple((s.dim, *holder_layout(s, rank, ws)) for s in shards)
            with graph.inserting_after(anchor):
                summed = anchor = graph.call_function(collectives.copy_to_holders, (held, layout, group_name))
            for i, (p, shard) in enumerate(zip(held, shards)):
                with graph.inserting_after(anchor):
                    anchor = graph.call_function(operator.getitem, (summed, i))
                p.replace_all_uses_with(anchor, delete_user_cb=lambda user: user is not summed)
                anchor.meta["fxtp_placement"] = str(shard)
    for node in list(old_name):
        name = old_name[node]
        placement = plan.placements.get(name)
        if placement is not None:
            node.meta["fxtp_placement"] = str(placement) if not isinstance(placement, tuple) else ", ".join(map(str, placement))
        shard = placement[0] if isinstance(placement, tuple) else placement
        random_on_shard = isinstance(shard, Shard) and rng.is_random(node.target, node.args, node.kwargs)
        if name in plan.local_args:
            node.args = _fill_rank_values(map_arg(plan.local_args[name], lambda n: current.get(n.name, nodes[n.name])),
                                          plan, rank, group_name)
        if name in plan.local_targets:
            node.target = plan.local_targets[name]
        for inp in list(node.all_input_nodes):
            action = plan.edges.get((name, old_name.get(inp, "")))
            if action is not None:
                node.replace_input_with(inp, materialize(inp, action, node))
        local = (rng.sharded_call(node.target, node.args, node.kwargs, shard, rank, ws, tokens=name in plan.tokens)
                 if isinstance(shard, Shard) else None)
        if local is not None:  # NOTE: [dropout across ranks] in fxtp/core/rng.py
            node.target, node.args, node.kwargs = local
        elif random_on_shard and name in plan.local_targets:
            # A rule's local op wraps a random op that rng cannot draw as one global mask: the report
            # promised "dropout-on-shard", so an independent per-rank draw would be silently wrong.
            raise AssertionError(f"fxtp internal error: {plan.local_targets[name]} at {name} wraps a random op; "
                                 "teach fxtp.core.rng.sharded_call its global-mask form")
        if name in plan.scatters and name not in plan.reduces:  # a replicated value starts a token-sharded region
            with graph.inserting_after(node):
                sliced = graph.call_function(collectives.scatter_to_sp, (node, plan.scatters[name].dim, rank, ws, group_name))
            node.replace_all_uses_with(sliced, delete_user_cb=lambda user: user is not sliced)
            old_name[sliced] = name
            current[name] = sliced
            sliced.meta["fxtp_placement"] = str(plan.scatters[name])
        if name in plan.bias_shares:  # NOTE: [bias share] in passes/moe/reductions.py
            with graph.inserting_after(node):
                shared = graph.call_function(local_ops.add_bias_share, (node, nodes[plan.bias_shares[name]], ws))
            node.replace_all_uses_with(shared, delete_user_cb=lambda user: user is not shared)
            old_name[shared], current[name] = name, shared
            shared.meta["fxtp_placement"] = node.meta.get("fxtp_placement", "P(sum)")
        if name in plan.reduces:
            scatter = plan.scatters.get(name)  # NOTE: [sequence parallelism]
            with graph.inserting_after(node):
                if scatter is None:
                    reduced = graph.call_function(collectives.reduce_from_tp, (node, group_name))
                else:
                    reduced = graph.call_function(collectives.reduce_scatter_to_sp, (node, scatter.dim, ws, group_name))
            final = reduced
            bias = plan.reduces[name]
            if bias is not None:
                # on a token shard the bias meets this rank's tokens only: its gradient is summed (f)
                bias_node = nodes[bias] if scatter is None else enter(nodes[bias])
                with graph.inserting_after(reduced):
                    # NOTE: [autocast policy of replaced ops]: the linear's dtype (under autocast its
                    # lower precision, as one device's linear casts its bias), not bias-promoted fp32
                    cast = graph.call_function(aten.type_as.default, (bias_node, reduced))
                cast.meta["fxtp_placement"] = "R"
                with graph.inserting_after(cast):
                    final = graph.call_function(aten.add.Tensor, (reduced, cast))
            node.replace_all_uses_with(final, delete_user_cb=lambda user: user is not reduced)
            old_name[final], current[name] = name, final  # consumers' edges (an f into a colwise layer) name the original
            reduced.meta["fxtp_placement"] = final.meta["fxtp_placement"] = "R" if scatter is None else str(scatter)
    graph.eliminate_dead_code()
    graph.lint()
    return GraphModule(gm, graph)


def _written_in_place(value: Node) -> bool:
    """Does an in-place op write ``value`` or a view of it (seen through view ops)?"""
    todo, seen = [value], set()
    while todo:
        node = todo.pop()
        for user in node.users:
            schema = getattr(user.target, "_schema", None)
            if schema is None or user in seen:
                continue
            seen.add(user)
            if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
                return True
            if schema.returns and schema.returns[0].alias_info is not None:  # a view of it
                todo.append(user)
    return False


def _fill_rank_values(args: tuple, plan: ShardingPlan, rank: int, group_name: str) -> tuple:
    """Replace each :class:`ShardStart` with this rank's first index of that value's shard, each
    :class:`LocalSize` (also inside a size list) with this rank's size of its shard (NOTE:
    [uneven shards]), and each :class:`GroupName` with the process group's name."""

    def fill(a):
        if isinstance(a, ShardStart):
            placement = plan.placements[a.value.name]
            return local_ranges(placement, rank, plan.world_size)[0][0]
        if isinstance(a, LocalSize):
            return a.shard.local_size(plan.world_size, rank)
        if isinstance(a, GroupName):
            return group_name
        if isinstance(a, (list, tuple)) and not isinstance(a, Node):
            return type(a)(fill(b) for b in a)
        return a

    return tuple(fill(a) for a in args)


def _copy_graph(source: Graph) -> tuple[Graph, dict[str, Node]]:
    """A copy of ``source`` and a map from its node names to the copies (copying may rename)."""
    graph = Graph()
    graph._codegen = copy.deepcopy(source._codegen)
    val_map: dict[Node, Node] = {}
    out = graph.graph_copy(source, val_map)
    old_output = next(n for n in reversed(source.nodes) if n.op == "output")
    val_map[old_output] = graph.output(out)
    return graph, {old.name: new for old, new in val_map.items()}
