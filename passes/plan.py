"""Planning: choose every layer's style by propagating placements to a fixpoint.

The planner starts optimistic: every ``linear`` with a replicated input is colwise, every
``linear`` fed a feature-sharded value is rowwise. Each round runs ``propagate`` and resolves
what it reports:

* a rule that refuses a shard (a norm over the sharded dim, a view that cuts a head, a model
  output) keeps the colwise layers whose shard reached it replicated ("a replicated producer":
  no communication), or, where the user forced those layers, gathers the value instead;
* a ``view``/``split`` that would be local under a finer layout refines the producing layer's
  segments (NOTE: [segments]), e.g. the Q|K|V blocks of a fused projection;
* consumers' wants on parameters become the parameters' placements.

Demotions and refinements only grow, so the rounds end; the last, clean round is the plan.
``plan_sharding`` reads ``node.meta["val"]`` and ``node.meta["nn_module_stack"]``; it does not
modify the graph.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch.fx import Graph, Node

import passes.rules  # noqa: F401  (registers the op rules)
from fxtp.core.errors import FxtpError, FxtpPlanError
from fxtp.core.placement import REPLICATE, Partial, Placement, Replicate, Shard
from passes.layers import (
    MAX_SEGMENTS,
    RepeatedBlocks,
    apply_overrides,
    check_forced,
    is_output_head,
    keep_renormed_tables,
    keep_small_embeddings,
    layer_decision,
    layer_names,
    layer_segments,
    refine_layout,
    refine_uneven,
    mirror_blocks,
    rowwise_feeds,
    snapshot,
    try_columns,
    weight_numel,
    weight_of,
    weight_placeholder,
)
from passes.kv_heads import grouped_kv_layers, held_together
from passes.propagate import ParamPiece, PlannerState, Propagation, param_root, propagate
from passes.registry import Conflict, LayerNote, located, module_of, shape_of
from passes.rules.matmul import layer_operands
from passes.sharding_plan import LayerDecision, ShardingPlan

__all__ = ["LayerDecision", "ShardingPlan", "plan_sharding", "module_of", "STYLES"]

STYLES = ("colwise", "rowwise", "replicate", "expert")  # "expert": passes/moe/parallel.py
aten = torch.ops.aten


def plan_sharding(
    graph: Graph,
    param_fqns: Mapping[str, str],
    world_size: int,
    overrides: Optional[Mapping[str, str]] = None,
) -> ShardingPlan:
    """Choose placements for every value of ``graph`` (a captured ATen graph).

    Args:
        graph: the graph, parameters as placeholders, ``meta["val"]`` on every node.
        param_fqns: parameter placeholder name -> parameter FQN.
        world_size: the tensor-parallel degree, >= 1.
        overrides: ``{fqn_or_glob: "colwise" | "rowwise" | "replicate"}`` matched against the
            layer names (``LayerDecision.name``) and module FQNs.

    Raises:
        FxtpPlanError: an override names no layer or cannot be honoured.
    """
    param_names = frozenset(param_fqns)
    layers = [n for n in graph.nodes if weight_of(n, param_names) is not None]
    names = layer_names(layers, param_names, param_fqns)
    state = PlannerState()
    for n in layers:  # a bmm of MoE experts holds its output features on dim 1 or 2 (rules/experts.py)
        ops = layer_operands(n, lambda a: param_root(a, param_names) is not None)
        if n.target is aten.bmm.default and ops is not None:
            state.features[n.name] = shape_of(n)[ops.out_dim]
    if world_size == 1:
        for n in layers:
            state.demoted[n.name] = LayerNote("replicate", "world_size is 1: nothing to shard")
    apply_overrides(overrides or {}, layers, names, state)
    keep_small_embeddings(layers, state, param_names)
    keep_renormed_tables(graph, layers, state, param_names)
    if world_size > 1:  # NOTE: [grouped shards]: the k/v projections hold the kv heads their ranks read
        for name, layout in grouped_kv_layers(graph, layers, world_size).items():
            if state.forced.get(name) in (None, "colwise") and name not in state.demoted:
                state.units[name], state.groups[name] = layout.unit, layout.groups
                if len(layout.segments) > 1:  # a fused projection: its kv segments grouped, the others plain
                    state.segments[name] = layout.segments
    terminal = _terminal_layers(graph, layers)
    max_rounds = (MAX_SEGMENTS + 5) * len(layers) + 8
    max_rounds *= 1 + sum(n.target is aten.embedding.default for n in layers)  # a trial by columns may replan
    blocks = RepeatedBlocks.of(graph)  # NOTE: [repeated blocks decided alike] in passes/layers/blocks.py
    for rounds in range(1, max_rounds + 1):
        res = propagate(graph, state, world_size, param_names)
        before = {n.name: snapshot(state, n.name) for n in layers}
        if not _resolve(res, state, world_size, param_names, {n.name: names[n] for n in layers}, param_fqns, terminal):
            break
        mirror_blocks(state, before, blocks, layers)
    else:  # pragma: no cover - demotions and refinements only grow
        raise FxtpError(f"internal: planning did not converge in {max_rounds} rounds; please report this model")
    feeds = rowwise_feeds(layers, names, res, param_names)
    decisions = tuple(layer_decision(n, names[n], res, state, param_names, param_fqns, world_size, feeds) for n in layers)
    check_forced(decisions, state, names)
    return ShardingPlan(
        world_size=world_size,
        placements={n.name: p for n, p in res.placements.items()},
        params={k: v for k, v in state.params.items() if isinstance(v, Shard)},
        local_args={n.name: d.local_args for n, d in res.decisions.items() if d.local_args is not None},
        local_targets={n.name: d.local_target for n, d in res.decisions.items() if d.local_target is not None},
        edges={(c.name, p.name): a for (c, p), a in res.edges.items()},
        reduces={
            n.name: (d.after_reduce.name if isinstance(d.after_reduce, Node) else None)
            for n, d in res.decisions.items()
            if isinstance(d.out, Partial)
        },
        layers=decisions,
        rounds=rounds,
        holders=held_together(state.params, state.param_owners, {n.name: n for n in layers}),
    )


# Rejections a finer segment layout of the producing layer may cure (NOTE: [segments]).
_LAYOUT_CODES = frozenset(
    {
        "view-crosses-shard",
        "not-divisible",
        "split-crosses-shard",
        "indexes-sharded-dim",
        "splits-head",
        "contracts-sharded-dim",
        "layout-mismatch",
    }
)


def _resolve(
    res: Propagation,
    state: PlannerState,
    ws: int,
    param_names: frozenset[str],
    names: Mapping[str, str],
    param_fqns: Mapping[str, str],
    terminal: frozenset[Node],
) -> bool:
    """Apply one round's findings to ``state``; return whether anything changed.

    Only rejections not downstream of an earlier one this round are acted on: a node after a
    rejection saw a stand-in placement, so its own rejection may be an artifact.
    """
    changed = _slice_inputs(res, state, ws, param_names, terminal)
    if not res.conflicts:
        changed |= _replicate_cheaper_side(res, state, param_names)
    changed |= _act_on_conflicts(res, state, ws, param_names, terminal)
    changed |= _place_parameters(res, state, param_names, names, param_fqns)
    if not changed and not res.conflicts:
        changed = try_columns(res, state, param_names)  # NOTE: [column-sharded embedding]
    return changed


def _act_on_conflicts(res: Propagation, state: PlannerState, ws: int, param_names: frozenset[str], terminal: frozenset[Node]) -> bool:
    """For each untainted rejection: refine the producing layers' layout, gather, or demote them."""
    changed = False
    refined_now: set[Node] = set()  # one new layout per layer per round
    for rej in res.conflicts:
        if rej.tainted:
            continue
        c = rej.conflict
        if not rej.culprits:
            raise FxtpError(f"internal: {c} at {rej.node.format_node()} with no layer to keep replicated; please report")
        note = LayerNote(
            "replicate", c.message, code=c.code, fix=located(c.fix, rej.node), node=rej.node.format_node(), module=module_of(rej.node)
        )
        demotable = [n for n in rej.culprits if state.forced.get(n.name) is None]
        if c.code in _LAYOUT_CODES:
            for n in demotable:  # the first layout rejection explains best why no layout fits,
                first = state.first.get(n.name)  # unless a later one names a size ws must divide
                if first is None or first.code != "not-divisible" and c.code == "not-divisible":
                    state.first[n.name] = note
            if c.unit is not None:  # the first layout under which whole heads would fit
                for n in demotable:
                    state.unit_hints.setdefault(n.name, (layer_segments(n, c.unit_segments, state) or state.segments.get(n.name), c.unit))
            if refined_now & set(demotable):
                continue
            if refine_uneven(demotable, c.unit_segments or c.refine, c.unit, state, refined_now, ws) or refine_layout(demotable, c.refine, state, ws, refined_now):
                changed = True
                continue
        heads = c.code == "needs-gather" and rej.node.op == "output" and demotable
        if heads and all(is_output_head(n, param_names) and n.name not in state.demoted for n in demotable):
            state.heads.update(n.name for n in demotable)
            demotable = []  # gather the logits at the output instead
        if not demotable:
            for inp in rej.inputs:
                key = (rej.node.name, inp.name)
                if key not in state.gathers:
                    state.gathers.add(key)
                    changed = True
            continue
        for n in demotable:
            if n.name in state.demoted:
                continue
            if c.code == "needs-gather" and rej.node.op == "output" and _may_slice_input(n, state, ws, param_names, terminal):
                state.slice_input.add(n.name)  # NOTE: [rowwise fallback]
            else:
                state.demoted[n.name] = state.first.get(n.name, note) if c.code in _LAYOUT_CODES else note
            changed = True
    return changed


def _place_parameters(
    res: Propagation, state: PlannerState, param_names: frozenset[str], names: Mapping[str, str], param_fqns: Mapping[str, str]
) -> bool:
    """One placement per parameter from its consumers' wants; a want that cannot be met
    replicates the layers that asked (a tied weight first tries keeping its input whole)."""
    changed = False
    params: dict[str, Placement] = {}
    owners: dict[str, frozenset[str]] = {}
    for placeholder, requests in res.requests.items():
        requesters = frozenset(o for _, _, origins in requests for o in origins)
        try:
            params[placeholder.name] = _combine(requests, param_fqns[placeholder.name])
            owners[placeholder.name] = frozenset(o.name for o in requesters)
        except Conflict as c:
            if res.conflicts:
                continue  # may be an artifact of this round's rejections; decide on a clean round
            if c.code == "tied" and _take_tied_input_whole(placeholder, requests, res, state, param_names, names, param_fqns):
                changed = True
                continue
            sharded_by = [
                n for n in requesters if n.name not in state.demoted and getattr(res.layers.get(n), "style", None) != "replicate"
            ]
            # Replicate the layers whose own weight this is; the layers that fed them follow next round
            # (their consumer keeps its input whole), with that reason.
            weight_of = [n for n in sharded_by if weight_placeholder(n, param_names) is placeholder]
            sharded_by = weight_of or sharded_by
            forced = [n for n in sharded_by if state.forced.get(n.name) is not None]
            if forced:
                raise FxtpPlanError(f"plan cannot be honoured for {', '.join(names[n.name] for n in forced)}: {c.message}; drop the entry")
            for n in sharded_by:
                state.demoted[n.name] = LayerNote("replicate", c.message, code=c.code, fix=c.fix, node=placeholder.format_node())
                changed = True
    if params != state.params:
        state.params, state.param_owners = params, owners
        changed = True
    return changed


# NOTE: [tied uses]
# A weight tied between a vocab-parallel embedding (rows sharded: Shard(0)) and an output head
# wants one shard for both uses. The head is colwise (also Shard(0)) when its input is
# replicated, rowwise (Shard(1): the two uses disagree) when a colwise producer feeds it a
# sharded input. Rather than replicate the tied table and head (the vocabulary: the biggest
# tensor of a language model), the head takes its input whole: its producer stays replicated,
# with that reason (``whole_input``; Megatron-LM's tied ``word_embeddings`` and output layer
# are sharded the same way, its final layer norm feeding the head replicated). Where the other
# uses want something else too, or the head's input stays sharded anyway, both uses stay
# replicated (code ``tied``).


def _take_tied_input_whole(
    placeholder: Node,
    requests: list,
    res: Propagation,
    state: PlannerState,
    param_names: frozenset[str],
    names: Mapping[str, str],
    param_fqns: Mapping[str, str],
) -> bool:
    """NOTE: [tied uses]: mark the rowwise uses of a tied weight whose colwise form agrees with
    its other uses as taking their input whole; returns whether any was marked."""
    fqn = param_fqns[placeholder.name]
    marked = False
    for piece, want, origins in requests:
        for n in origins:
            note = res.layers.get(n)
            ops = layer_operands(n, lambda a: param_root(a, param_names) is not None)
            if (
                piece.dim is not None or ops is None or weight_placeholder(n, param_names) is not placeholder
                or getattr(note, "style", None) != "rowwise" or n.name in state.slice_input
                or n.name in state.whole_input or state.forced.get(n.name) is not None
            ):
                continue
            others = [w for p, w, o in requests if n not in o]
            if not others or any(not isinstance(w, Shard) or w.dim != ops.out_dim for w in others):
                continue
            state.whole_input[n.name] = LayerNote(
                "replicate",
                f"its consumer {names[n.name]} takes its input replicated: {names[n.name]}'s weight {fqn} is tied to a "
                f"use sharded as {others[0]}, and colwise keeps both uses on that one shard (NOTE: [tied uses])",
                code="tied",
                fix=f"none needed (the tied {fqn} is sharded); untie it to shard this layer too",
            )
            marked = True
    return marked


# NOTE: [rowwise fallback]
# A layer fed a replicated value whose colwise form cannot hold (its out_features do not divide
# world_size, or its shard would have to be gathered at the model output) can still go rowwise:
# each rank slices its block of the input locally and the partial outputs are all_reduced
# (Megatron-LM's RowParallelLinear with input_is_parallel=False). fxtp does this only for a
# *terminal* layer (no other layer is reachable from it) fed straight by a model input: the
# seed's ``nn.Linear(100, 10)``, a linear classifier or head on given features. Inside a
# network the extra all_reduce would lift the block above Megatron's floor, while a replicated
# layer there costs no communication.


def _terminal_layers(graph: Graph, layers: list[Node]) -> frozenset[Node]:
    """The layers from which no other layer is reachable (NOTE: [rowwise fallback])."""
    layer_set = set(layers)
    feeds_layer: set[Node] = set()  # nodes with a layer among their descendants
    for node in reversed(graph.nodes):
        if any(u in layer_set or u in feeds_layer for u in node.users):
            feeds_layer.add(node)
    return frozenset(n for n in layers if n not in feeds_layer)


def _may_slice_input(layer: Node, state: PlannerState, ws: int, param_names: frozenset[str], terminal: frozenset[Node]) -> bool:
    ops = layer_operands(layer, lambda a: param_root(a, param_names) is not None)
    if ops is None or layer not in terminal or layer.name in state.slice_input or layer.name in state.forced:
        return False
    if ops.x.op != "placeholder" or ops.x.name in param_names:
        return False  # not a model input
    return shape_of(ops.weight)[1 - ops.out_dim] % ws == 0


def _slice_inputs(res: Propagation, state: PlannerState, ws: int, param_names: frozenset[str], terminal: frozenset[Node]) -> bool:
    """Terminal layers whose out_features do not divide ``ws`` go rowwise on a sliced input."""
    changed = False
    for n, note in res.layers.items():
        if note.code == "not-divisible" and n.name not in state.demoted and _may_slice_input(n, state, ws, param_names, terminal):
            state.slice_input.add(n.name)
            changed = True
    return changed


# NOTE: [cheaper side of a merge]
# A rowwise layer's output is all_reduced (replicated); where it then meets a colwise shard
# (``base(x) + B(A(x))`` of a LoRA pair, a bypass added to an attention output) the replicated
# sum is sliced back to the shard: an all_reduce whose result is thrown away in part. Either
# side can be replicated to avoid it: the colwise layers whose shard reaches the merge, or the
# colwise layers that fed the rowwise one (then it is no longer rowwise, and the value is
# computed whole). fxtp replicates the side with fewer weight bytes: the LoRA adapters, not
# the base layers (Megatron-style plan for LoRA: A replicated beside a colwise base, B
# replicated beside a rowwise base).


# Ops that carry a reduced value to the merge unchanged but for a replicated factor (PEFT's
# ``lora_B(lora_A(x)) * scaling``), a view or a no-op cast: the value sliced there is still the
# all_reduced output of the layer before them.
_CARRIERS = frozenset(
    {aten.mul.Tensor, aten.div.Tensor, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
     aten.clone.default, aten.to.dtype, aten.neg.default, aten.unsqueeze.default}
)


def _reduced_source(value: Node, res: Propagation) -> Optional[Node]:
    """The ``Partial`` node whose all_reduced value reaches ``value`` through single-use
    ``_CARRIERS`` taking it as their only non-replicated-constant tensor; ``None`` if none."""
    while not isinstance(res.placements.get(value), Partial):
        if value.op != "call_function" or value.target not in _CARRIERS or not value.args or not isinstance(value.args[0], Node):
            return None
        first = value.args[0]
        others = [a for a in value.all_input_nodes if a is not first]
        if len(first.users) != 1 or any(not isinstance(res.placements.get(a), Replicate) or res.origins.get(a) for a in others):
            return None
        value = first
    return value


def _replicate_cheaper_side(res: Propagation, state: PlannerState, param_names: frozenset[str]) -> bool:
    changed = False
    for (consumer, sliced), action in res.edges.items():
        producer = _reduced_source(sliced, res) if action.kind == "slice" else None
        if producer is None:
            continue
        ops = layer_operands(producer, lambda a: param_root(a, param_names) is not None)
        fed_by = res.origins.get(ops.x, frozenset()) if ops is not None else frozenset()
        meets = frozenset(o for a in consumer.all_input_nodes if a is not sliced for o in res.origins.get(a, frozenset()))
        sides = [side for side in (meets, fed_by) if side and not any(n.name in state.forced for n in side)]
        if not sides:
            continue
        cheaper = min(sides, key=lambda side: sum(weight_numel(n, param_names) for n in side))
        for n in cheaper:
            if n.name not in state.demoted:
                state.demoted[n.name] = LayerNote(
                    "replicate",
                    f"its shard would meet the all_reduced output of {module_of(producer) or producer.name} at {consumer.name}; replicating this "
                    "side moves fewer weight bytes than slicing that value (NOTE: [cheaper side of a merge])",
                    code="cheaper-replicated",
                    fix="none needed; plan={'{layer}': 'colwise'} shards it anyway",
                    node=consumer.format_node(),
                    module=module_of(consumer),
                )
                changed = True
    return changed


def _combine(requests: list[tuple[ParamPiece, Placement, Any]], name: str) -> Placement:
    """One placement for parameter ``name`` (its FQN) from its consumers' wants (pieces of a
    split tile it; tied uses must agree)."""
    whole_uses = [want for _, want, _ in requests if not isinstance(want, Shard)]
    if len(whole_uses) == len(requests):
        return REPLICATE
    if whole_uses:
        raise Conflict("tied", f"parameter {name} is tied: used whole by one layer and sharded by another", "untie the weights to shard them")
    wants = {(piece.dim, piece.offset, piece.length, want) for piece, want, _ in requests}
    whole = {w for d, _, _, w in wants if d is None}
    if whole:
        if len(whole) > 1 or len(wants) > len(whole):
            raise Conflict("tied", f"parameter {name} is wanted as {', '.join(sorted(map(str, whole)))} by different layers", "untie the weights (one nn.Parameter per use) to shard them")
        return next(iter(whole))
    dims = {d for d, _, _, _ in wants}
    pieces = sorted(wants, key=lambda t: t[1])
    shards = {w for *_, w in pieces}
    if len(dims) == 1 and len(shards) == 1 and next(iter(shards)).dim != next(iter(dims)):
        return next(iter(shards))  # every piece wants the same shard across the split
    if len(dims) != 1 or any(w.dim not in dims for w in shards):
        raise Conflict("layout-mismatch", f"pieces of parameter {name} are wanted on different dims", "none needed (those layers stay replicated); give each layer its own parameter to shard them")
    (dim,) = dims
    total = requests[0][0].placeholder.meta["val"].shape[dim]
    if len({w.unit for *_, w in pieces}) > 1:
        raise Conflict("layout-mismatch", f"pieces of parameter {name} are split in different units", "none needed (those layers stay replicated); give each layer its own parameter to shard them")
    offset, segments = 0, []
    for _, off, length, want in pieces:
        if off != offset or want.size != length:
            break
        segments.extend(want.segments)
        offset += length
    if offset != total:
        raise Conflict(
            "layout-mismatch",
            f"only part of parameter {name} (split along dim {dim}) can be sharded",
            "none needed (those layers stay replicated); give each layer its own parameter to shard them",
        )
    return Shard(dim, tuple(segments), pieces[0][3].unit)


