"""Sequence parallelism: the regions between a rowwise layer and the next colwise one, sharded on tokens.

NOTE: [sequence parallelism]
Megatron-LM's sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", section 4.2.2). Under tensor parallelism alone the values between
a rowwise layer and the next colwise one (the residual stream, norms, dropout) are replicated:
every rank computes and keeps all of them. Their ops act on each token alone, so they can run
on 1/world_size of the tokens instead:

* a rowwise layer's ``Partial`` output is reduce_scattered on a token dim (the second-to-last:
  ``(B, T, H)`` -> dim 1, ``T`` divisible by world_size) instead of all_reduced: same bytes;
  a replicated embedding's output (a table too small to be vocab-parallel) is sliced to this
  rank's tokens (backward: all_gather), as Megatron-LM scatters the embeddings' output;
* the shard flows on through every op whose rule keeps it (the same rule registry as tensor
  parallelism: pointwise ops, norms over the hidden dim, dropout drawing its slice of one mask);
* a replicated value meeting the shard (the embedding output in the first residual add) is
  sliced: forward keeps this rank's tokens, backward all_gathers the gradient (Megatron's
  ``scatter_to_sequence_parallel_region``);
* a replicated float value used whole by the shard's ops (a norm's weight, the rowwise bias
  added after the reduce_scatter) enters through ``f``: each rank's gradient covers its tokens
  only, the ``f`` sums them over the ranks;
* where the region ends (a colwise layer, an op the shard cannot flow through, the model
  output) the value is all_gathered: backward reduce_scatters the gradient into a sharded
  consumer (it replaces that consumer's ``f``: same bytes), or keeps this rank's slice of the
  gradient of a replicated consumer;
* a layer that saves its all_gathered input for backward saves the shard instead and gathers
  it again in backward (NOTE: [regathered activations] in fxtp/core/activations.py);
* a size query of a token shard reads the global size without a gather
  (NOTE: [size of a token shard]).

NOTE: [size of a token shard]
Under dynamic shapes the capture reads sizes with ``sym_size`` nodes, and one may read a value
the region shards (``sym_size(q, 1)`` for a rotary embedding's ``reshape``). Gathering the value
for its size alone (as at any op the region ends at) planned an all_gather the run never
issues: the consumers in the region take local shape literals instead (``local_args``), so the
rewrite's dead-code elimination dropped the size query and its gather, while the report,
counting from the plan, still counted it (tests/test_fuzz_regressions.py
"sp-dynamic-report-counts-a-gather-not-run"). A size query never gathers: the size of another
dim is the shard's own, and the token dim's is this rank's block times world_size
(``fxtp.core.local_ops.token_count``; the blocks are equal), so any consumer outside the region
still reads the global size, at any token count.

NOTE: [a reduce site fed by the region]
A reduce_scatter site can itself take a token-sharded value: a SwiGLU's ``act(w1(x)) * w3(x)``
with both layers rowwise is ``Partial`` (a replicated gate times a partial sum), so the
``mul`` is the site, and the gate ``act(w1(x))`` is in the region (w1's own reduce_scatter).
Such an input leaves the region at the site and is all_gathered, as at any op the region ends
at. Skipping the site (it is in the region as its output's shard) left the tensor-parallel
``f`` on that input: one token a rank (seq 4 at world size 4) broadcast against the whole
partial sum, silently wrong (tests/test_fuzz_regressions.py "sp-einsum-ff-swiglu").

Layer styles are those of the tensor-parallel plan; this pass changes only where values are
sharded and how they are reduced and gathered. A GPT-2 ``Conv1D`` computes on ``(B*T, H)``
rows and views the result back to ``(B, T, H)``: its reduce_scatter (and bias) moves past that
view. A ``Partial`` value without a token dim that divides world_size keeps its all_reduce.

``sequence_parallel(graph, plan, param_names)`` reads ``node.meta["val"]`` and the plan and
returns the updated plan; it does not modify the graph.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping, Optional

import torch
from torch.fx import Graph, Node

from fxtp.core import local_ops
from fxtp.core.errors import FxtpPlanError
from fxtp.core.placement import REPLICATE, Partial, Replicate, Shard, is_sharded
from passes.plan import ShardingPlan
from passes.propagate import EdgeAction, param_root
from passes.registry import Conflict, Decision, LayerState, RuleContext, is_tensor_node, module_of, shape_of
from passes.rules._common import ndim, norm_dim, tensor_inputs
from passes.rules.matmul import layer_weight
from passes.rules.variants import rule_for

__all__ = ["sequence_parallel", "saving_layers", "reduce_scatters"]

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_NO_LAYER = LayerState(None, None, None)


def sequence_parallel(graph: Graph, plan: ShardingPlan, param_names: frozenset[str]) -> ShardingPlan:
    """``plan`` with its token-local regions sharded on tokens (NOTE: [sequence parallelism])."""
    ws = plan.world_size
    if ws == 1:
        return plan
    nodes = {n.name: n for n in graph.nodes}
    placements = dict(plan.placements)
    edges = dict(plan.edges)
    reduces = dict(plan.reduces)
    local_args, local_targets = dict(plan.local_args), dict(plan.local_targets)
    scatters: dict[str, Shard] = {}
    region: dict[Node, Any] = {}  # value -> its sequence placement
    # nodes with tensor-parallel edge work on an input (a set: one lookup per node keeps the pass
    # linear in the graph, tests/test_passes_linear.py)
    with_edges = frozenset(c for c, _ in plan.edges)

    for node in graph.nodes:  # a replicated lookup starts a region too: sliced to this rank's tokens
        if node.target is aten.embedding.default and _replicated(placements.get(node.name, REPLICATE)):
            shard = _token_shard(node, ws)
            if shard is not None and node.name not in with_edges:
                scatters[node.name] = shard
                region[node] = shard
    for name in list(plan.reduces):
        node, bias = nodes[name], plan.reduces[name]
        if _statistics(node, plan, param_names):
            continue  # a norm's statistics over the features (NOTE: [distributed norm]): all_reduced
        site = _past_view(node)
        shard = _token_shard(site, ws)
        if shard is None:
            continue
        if site is not node:  # GPT-2's Conv1D: reduce_scatter (and add the bias) after the view
            del reduces[name]
            reduces[site.name] = bias
            placements[site.name] = Partial()
        scatters[site.name] = shard
        region[site] = shard

    def is_param(a: Node) -> bool:
        return param_root(a, param_names) is not None

    def tp_placement(a: Node) -> Any:
        p = placements.get(a.name, REPLICATE)
        return REPLICATE if isinstance(p, Partial) else p  # reduced right away (or a scatter, in region)

    def placement(a: Node) -> Any:
        return region[a] if a in region else tp_placement(a)

    for node in graph.nodes:
        if node.op == "output":
            for a in tensor_inputs(node):
                if a in region:
                    edges[(node.name, a.name)] = _gather(region[a], plan.edges.get((node.name, a.name)), node, a)
            continue
        if node.op != "call_function" or node in region and node.name not in scatters:
            continue  # a scatter site still gathers its token-sharded inputs: NOTE: [a reduce site fed by the region]
        ins = [a for a in node.all_input_nodes if a in region]
        if not ins:
            continue
        if node.target is aten.sym_size.int and isinstance(region[node.args[0]], Shard):
            x, dim = node.args  # NOTE: [size of a token shard]: read without a gather
            if norm_dim(dim, ndim(x)) == region[x].dim:
                local_args[node.name], local_targets[node.name] = (x, dim, ws), local_ops.token_count
            continue
        dec = _joins(node, plan, placement, is_param, region, ws, with_edges)
        if dec is None:  # the region ends here: gather what reaches the node
            for a in ins:
                edges[(node.name, a.name)] = _gather(region[a], plan.edges.get((node.name, a.name)), node, a)
            continue
        region[node] = placements[node.name] = dec.out
        if dec.local_args is not None:
            local_args[node.name] = dec.local_args
        if dec.local_target is not None:
            local_targets[node.name] = dec.local_target
        for a in tensor_inputs(node):
            if a in region:
                continue
            want = dec.wants.get(a)
            if isinstance(want, Shard):
                edges[(node.name, a.name)] = EdgeAction("sp_scatter", want, enter=_is_float(a))
            elif _is_float(a):
                edges[(node.name, a.name)] = EdgeAction("enter")
    if not scatters:
        return plan
    edges = _mark_regathers(graph, edges, is_param)
    return dataclasses.replace(
        plan, placements=placements, edges=edges, reduces=reduces, local_args=local_args, local_targets=local_targets,
        scatters=scatters, tokens=frozenset(n.name for n in region), layers=_reasons(plan, nodes, scatters),
    )


def _statistics(node: Node, plan: ShardingPlan, param_names: frozenset[str]) -> bool:
    """A ``Partial`` sum over a sharded dim (NOTE: [distributed norm] in fxtp/core/norms.py), not
    a layer's: each rank uses the whole sum on its features, so it is all_reduced, not scattered."""
    if layer_weight(node, lambda a: param_root(a, param_names) is not None) is not None:
        return False
    return any(isinstance(plan.placements.get(a.name), Shard) for a in node.all_input_nodes)


def reduce_scatters(layer: Node, scatters: Mapping[str, Shard]) -> bool:
    """Does the reduction of rowwise ``layer``'s output reduce_scatter (at the layer, or after
    the view of GPT-2's ``Conv1D``)?"""
    return bool(({layer.name} | {u.name for u in layer.users}) & set(scatters))


def _reasons(plan: ShardingPlan, nodes: dict[str, Node], scatters: dict[str, Shard]) -> tuple:
    """The layers' report rows, a reduce_scatter named where it replaced a rowwise all_reduce."""
    out = []
    for layer in plan.layers:
        if layer.style == "rowwise" and reduce_scatters(nodes[layer.node], scatters):
            layer = dataclasses.replace(layer, reason=layer.reason.replace(
                "all_reduce after it", "reduce_scatter on its tokens after it (sequence parallelism)"))
        out.append(layer)
    return tuple(out)


def _joins(node: Node, plan: ShardingPlan, placement, is_param, region: dict[Node, Any], ws: int,
           with_edges: frozenset[str]) -> Optional[Decision]:
    """The rule's decision if ``node`` can run on the token shards that reach it, else ``None``
    (``with_edges``: the nodes ``plan`` has edge work for)."""
    if not _replicated(plan.placements.get(node.name, REPLICATE)) or node.name in plan.reduces:
        return None  # a tensor-parallel op (a colwise layer...): it takes the value whole
    if layer_weight(node, is_param) is not None or node.name in with_edges:
        return None
    if not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list)):
        return None  # a metadata read other than sym_size (NOTE: [size of a token shard]): it takes the value whole
    rule = rule_for(node.target)
    if rule is None:
        return None
    ctx = RuleContext(node, ws, placement, lambda n: _NO_LAYER, is_param)
    try:
        dec = rule(ctx)
    except Conflict:
        return None
    if isinstance(dec.out, tuple) and any(u.target is not operator.getitem for u in node.users):
        return None  # a tuple leaves the region only through its items
    outs = dec.out if isinstance(dec.out, tuple) else (dec.out,)
    if not is_sharded(dec.out) or any(isinstance(p, Partial) for p in outs) or dec.layer is not None or dec.after_reduce is not None:
        return None
    for a, want in dec.wants.items():
        if not is_tensor_node(a):
            continue
        have = region.get(a, REPLICATE)
        if a in region and want != have or isinstance(want, Shard) and is_param(a):
            return None  # would reshard a token shard, or shard a parameter: not this pass's work
        if not isinstance(want, (Shard, Replicate)) or isinstance(want, Shard) and not _plain(want, ws):
            return None
    if not all(_plain(s, ws) for s in outs if isinstance(s, Shard)):
        return None  # a view merging the tokens with the batch: gather before it, the token blocks stay plain
    return dec


def _plain(shard: Shard, ws: int) -> bool:
    """One segment split in equal blocks: what reduce_scatter, the token gathers and slices handle."""
    return len(shard.segments) == 1 and shard.unit == 1 and shard.divisible(ws)


def _gather(shard: Any, tp: Optional[EdgeAction], consumer: Node, value: Node) -> EdgeAction:
    """The all_gather where a token shard leaves the region; ``tp`` is the tensor-parallel edge
    work the consumer had (an ``f`` into a colwise layer becomes the gather's reduce_scatter
    backward; other work runs on the gathered value).

    Raises:
        FxtpPlanError: ``value`` is not one token-sharded tensor (a tuple of them).
    """
    if not isinstance(shard, Shard):
        raise FxtpPlanError(
            f"sequence_parallel=True: {consumer.format_node()} (module {module_of(consumer) or 'top level'}) takes "
            f"{value.name}, a token-sharded {shard}, whole, and fxtp gathers only single tensors. fix: compile "
            "with sequence_parallel=False, or please report this model"
        )
    if tp is not None and tp.kind == "enter":
        return EdgeAction("sp_gather", shard, enter=True)
    return EdgeAction("sp_gather", shard, enter=False, then=tp)


def _mark_regathers(graph: Graph, edges: dict, is_param) -> dict:
    """Set ``regather`` on the gathers whose every consumer is a layer, directly or through
    views: those layers save the gathered value as its shard (NOTE: [regathered activations]).
    A gather that another op takes keeps its value whole: that op might save it."""
    nodes = {n.name: n for n in graph.nodes}
    groups: dict[tuple[str, bool], list[tuple[tuple[str, str], EdgeAction]]] = {}
    for key, action in edges.items():
        if action.kind == "sp_gather":
            groups.setdefault((key[1], action.enter), []).append((key, action))
    out = dict(edges)
    for members in groups.values():
        if all(a.then is None and saving_layers(nodes[c], is_param) is not None for (c, _), a in members):
            for key, action in members:
                out[key] = dataclasses.replace(action, regather=True)
    return out


def saving_layers(consumer: Node, is_param) -> Optional[set[Node]]:
    """The layers that take ``consumer``'s input, ``consumer`` being a layer or a view op whose
    users are (recursively); ``None`` if another op takes it."""
    if layer_weight(consumer, is_param) is not None:
        return {consumer}
    if not _is_alias(consumer):
        return None
    found: set[Node] = set()
    for user in consumer.users:
        if user.target is aten.sym_size.int:
            continue
        layers = saving_layers(user, is_param)
        if layers is None:
            return None
        found |= layers
    return found


def _is_alias(node: Node) -> bool:
    """A view op: its output aliases its input (the schema's return is ``Tensor(a)``)."""
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _past_view(node: Node) -> Node:
    """The node a ``(B*T, H)`` partial value is viewed to as ``(B, T, H)`` (its only use), or itself."""
    val = node.meta["val"]
    users = list(node.users)
    if isinstance(val, torch.Tensor) and val.dim() == 2 and len(users) == 1 and users[0].target in _VIEWS:
        viewed = users[0].meta["val"]
        if viewed.dim() >= 3 and shape_of(users[0])[-1] == shape_of(node)[-1]:
            return users[0]
    return node


def _token_shard(node: Node, ws: int) -> Optional[Shard]:
    """A token dim to reduce_scatter ``node`` on: the second-to-last, if its size divides ``ws``."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 3 or not val.is_floating_point():
        return None
    dim = val.dim() - 2
    size = shape_of(node)[dim]
    return Shard(dim, (size,)) if size % ws == 0 and size >= ws else None


def _replicated(p: Any) -> bool:
    return all(isinstance(q, Replicate) for q in (p if isinstance(p, tuple) else (p,)))


def _is_float(node: Node) -> bool:
    val = node.meta["val"]
    return isinstance(val, torch.Tensor) and val.is_floating_point()

