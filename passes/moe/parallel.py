"""Expert parallelism: whole experts per rank, (token, expert) pairs moved by all_to_all.

NOTE: [expert parallelism] in ``fxtp/core/expert_dispatch.py`` says what runs. Here:

* :func:`select_blocks`: the experts blocks (``passes/moe/blocks.py``) to run expert parallel,
  every block under ``expert_parallel=True``, or those a ``plan=`` entry names ``"expert"``;
  and the plan for the tensor-parallel planner, in which those blocks' layers stay whole.
* :func:`expert_parallel`: the plan update: every parameter of such a block ``Shard(0)`` on
  its experts (front-loaded where ``world_size`` does not divide ``E``), the block's output
  ``Partial`` (its reduction then moves as any, NOTE: [deferred reduction]), a report row
  per expert weight saying which experts each rank holds, and the blocks for the rewrite.
* :func:`check_sequence_parallel`: the blocks' inputs stay replicated under sequence
  parallelism (NOTE: [expert parallelism with sequence parallelism]).
* :func:`dispatch_experts`: the rank graph's edit, from ``passes/rewrite.py``::

      %index_4 = aten.index.Tensor(%view_3, [%floor_divide])          # rows, one per pair
      ... region: grouped_mm_fallback(to(%index_4), W1, %cumsum_1) ... -> %grouped_mm_fallback_1
      ... weights, pair order, top-k sum ... -> %to_14                # the block's output
  becomes
      %dispatch = fxtp.core.expert_dispatch.dispatch_to_experts(%view_3, %getitem_1, 4, 0, 2, '0', ...)
      ... region: grouped_mm_fallback(to(%dispatch[0]), W1_local, %dispatch[2]) ... -> %grouped_mm_fallback_1
      %combine = fxtp.core.expert_dispatch.combine_from_experts(%grouped_mm_fallback_1, %dispatch[3], %div_, torch.float32)

Reads and writes no ``node.meta`` key of the captured graph; the rank graph's new nodes get
``fxtp_placement``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import operator
from typing import Mapping

import torch
from torch.fx import Graph, Node

from fxtp.core.errors import FxtpConfigError, FxtpPlanError
from fxtp.core.expert_dispatch import combine_from_experts, dispatch_to_experts, expert_ranges
from fxtp.core.placement import Partial, Shard
from passes.layers import weight_of
from passes.moe.blocks import ExpertBlock, find_expert_blocks
from passes.registry import module_of, shape_of
from passes.sharding_plan import LayerDecision, ShardingPlan

__all__ = ["EXPERT", "select_blocks", "expert_parallel", "check_sequence_parallel", "dispatch_experts"]

EXPERT = "expert"  # the layer style of an expert-parallel block's weights (a plan= value)


def select_blocks(
    graph: Graph, param_fqns: Mapping[str, str], overrides: Mapping[str, str], enabled: bool, world_size: int
) -> tuple[tuple[ExpertBlock, ...], dict[str, str]]:
    """The blocks to run expert parallel and the overrides for the tensor-parallel planner.

    Args:
        graph, param_fqns: the normalized captured graph and its parameters' FQNs.
        overrides: the user's ``plan=``; an ``"expert"`` entry names a block's module or one of
            its parameters (a glob, as any plan key).
        enabled: ``expert_parallel=True``: every block.
        world_size: the degree; at 1 nothing is parallel.

    Raises:
        FxtpPlanError: an ``"expert"`` entry names no experts block, or a block is not one
            fxtp can dispatch (``find_expert_blocks``).
    """
    wanted = [key for key, style in overrides.items() if style == EXPERT]
    rest = {key: style for key, style in overrides.items() if style != EXPERT}
    if world_size == 1 or not (enabled or wanted):
        return (), rest
    blocks = find_expert_blocks(graph, param_fqns)

    def names(block: ExpertBlock) -> list[str]:
        return [block.module, *(param_fqns[p] for p in block.params)]

    for key in wanted:
        if not any(fnmatch.fnmatchcase(name, key) for b in blocks for name in names(b)):
            known = ", ".join(b.module for b in blocks) or "(none)"
            raise FxtpPlanError(f"plan key {key!r} = 'expert' names no experts module; experts modules are: {known}")
    chosen = tuple(b for b in blocks if enabled or any(fnmatch.fnmatchcase(n, k) for k in wanted for n in names(b)))
    nodes = {n.name: n for n in graph.nodes}
    param_names = frozenset(param_fqns)
    for block in chosen:  # its grouped_mm layers stay whole for the tensor-parallel planner
        if any(weight_of(nodes[n], param_names) is not None for n in block.region):
            rest[block.module] = "replicate"
    return chosen, rest


def expert_parallel(graph: Graph, plan: ShardingPlan, blocks: tuple[ExpertBlock, ...], param_fqns: Mapping[str, str]) -> ShardingPlan:
    """The plan with ``blocks`` expert parallel (the module docstring); the graph is not modified.

    Raises:
        FxtpConfigError: a block has fewer experts than ranks.
    """
    if not blocks:
        return plan
    ws = plan.world_size
    nodes = {n.name: n for n in graph.nodes}
    placements, params, reduces = dict(plan.placements), dict(plan.params), dict(plan.reduces)
    layers = {layer.weight: layer for layer in plan.layers}
    for block in blocks:
        if block.num_experts < ws:
            raise FxtpConfigError(
                f"expert_parallel: {block.module} has {block.num_experts} experts, fewer than world_size {ws}, so some rank "
                f"would hold none. fix: use a world_size <= {block.num_experts}, or compile without expert_parallel"
            )
        ranges = expert_ranges(block.num_experts, ws)
        held = "; ".join(f"rank {r}: experts {first}-{first + count - 1}" if count > 1 else f"rank {r}: expert {first}"
                         for r, (first, count) in enumerate(ranges))
        reason = (f"expert parallel, whole experts per rank ({held}); each rank's tokens go to their experts' ranks by "
                  "all_to_all and come back the same way (NOTE: [expert parallelism] in fxtp/core/expert_dispatch.py)")
        for p in block.params:
            params[p] = placements[p] = Shard(0, (block.num_experts,))
            if nodes[p].meta["val"].dim() != 3:
                continue  # a bias: in the report's other parameters, sharded as S(0)
            fqn = param_fqns[p]
            shape = shape_of(nodes[p])
            use = next((u for u in nodes[p].users if u.name in block.region), next(iter(nodes[p].users)))
            old = layers.get(fqn)
            layers[fqn] = LayerDecision(
                name=old.name if old is not None else fqn, node=old.node if old is not None else use.name,
                module=module_of(use), op=old.op if old is not None else str(use.target.__name__).split(".")[0], weight=fqn,
                weight_shape=shape, style=EXPERT, local_weight_shape=(ranges[0][1], *shape[1:]), reason=reason,
            )
        placements[block.output] = Partial()
        reduces[block.output] = None
    order = {layer.weight: i for i, layer in enumerate(plan.layers)}
    rows = tuple(sorted(layers.values(), key=lambda layer: order.get(layer.weight, len(order))))
    return dataclasses.replace(plan, placements=placements, params=params, reduces=reduces, layers=rows, experts=blocks)


# NOTE: [expert parallelism with sequence parallelism]
# ``sequence_parallel=True`` runs after this pass, on the plan it returns, and needs nothing of
# its own for the experts. Hugging Face's MoE blocks flatten ``(B, T/ws, H)`` to ``(B*T/ws, H)``
# before the router; that view merges the token shard with the batch, so the sequence region
# ends there with an all_gather (backward: a reduce_scatter) and the router and
# ``dispatch_to_experts`` read the whole, replicated tokens, as without sequence parallelism.
# The combined output is ``Partial`` as ever; viewed back to ``(B, T, H)`` it is
# reduce_scattered on its tokens instead of all_reduced (same bytes), and a tensor-parallel
# shared expert is summed into it first. Per MoE block forward: 1 all_gather, 2 all_to_all,
# 1 reduce_scatter, no all_reduce. Not done: routing and dispatching from the local tokens,
# which would save the all_gather but needs the split sizes exchanged.


def check_sequence_parallel(plan: ShardingPlan) -> None:
    """Raise if a token shard of sequence parallelism reaches an expert-parallel block's input.

    Raises:
        FxtpPlanError: a block's ``hidden`` or routing is token-sharded (a MoE block that does
            not flatten its tokens first), which ``dispatch_to_experts`` cannot read.
    """
    for block in plan.experts:
        for name in (block.hidden, block.top_k_index, block.top_k_weights):
            if name in plan.tokens:
                raise FxtpPlanError(
                    f"expert_parallel with sequence_parallel=True: {block.module}'s input {name} is sharded on tokens, "
                    "and the experts' dispatch reads it replicated. fix: compile without one of the two"
                )


def dispatch_experts(graph: Graph, nodes: dict[str, Node], old_name: dict[Node, str], plan: ShardingPlan, rank: int,
                     group_name: str) -> None:
    """Edit the rank graph (a copy of the captured one; ``nodes``: captured name -> copy,
    ``old_name`` its inverse, both updated) for the expert-parallel blocks of ``plan``."""
    for block in plan.experts:
        rows, result, output = nodes[block.rows], nodes[block.result], nodes[block.output]
        region = [nodes[name] for name in block.region]
        ids = [nodes[name] for name in block.row_ids]
        offsets = [nodes[name] for name in block.offsets]
        ids_dtype = ids[0].meta["val"].dtype if ids else torch.int64
        offsets_dtype = offsets[0].meta["val"].dtype if offsets else torch.int32
        with graph.inserting_before(rows):
            dispatch = graph.call_function(dispatch_to_experts, (
                nodes[block.hidden], nodes[block.top_k_index], block.num_experts, rank, plan.world_size, group_name,
                ids_dtype, offsets_dtype,
            ))
            parts = [graph.call_function(operator.getitem, (dispatch, i)) for i in range(4)]
        for part in parts:
            part.meta["fxtp_placement"] = "local"
        for node in region:
            for old, new in [(rows, parts[0]), *((i, parts[1]) for i in ids), *((o, parts[2]) for o in offsets)]:
                node.replace_input_with(old, new)
        with graph.inserting_before(output):
            combine = graph.call_function(combine_from_experts, (result, parts[3], nodes[block.top_k_weights], output.meta["val"].dtype))
        combine.meta = dict(output.meta)
        output.replace_all_uses_with(combine)
        old_name[combine] = old_name.pop(output)
        nodes[block.output] = combine

