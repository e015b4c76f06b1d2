"""Dependency analysis: propagate placements through the graph once, under a planner state.

``propagate(graph, state, world_size) -> Propagation`` walks the nodes in topological order and
asks each op's rule (``passes.registry``) how the placements of its inputs flow to its output.
It reads ``node.meta["val"]`` (static shapes from capture) and writes nothing into the graph:
the result is plain data the planner (``passes.plan``) inspects and the rewrite consumes.

Besides placements it derives, per (consumer, producer) edge, the local work the rewrite must
insert:

* ``enter``: a replicated float value feeding an op whose output is sharded. Its gradient on
  each rank is only the local part, so it is wrapped in Megatron-LM's ``f`` operator (identity
  forward, all_reduce backward). One ``f`` per producer is shared by all such consumers.
* ``slice``: a replicated value a rule wants sharded (not a parameter): sliced locally.
* ``gather``: a sharded value a forced plan keeps sharded into a consumer that needs it whole.

Parameter placements are *requested* by consumers (a colwise linear wants its weight
``Shard(0)``) and become the parameter's placement in the planner's next round.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.fx import Graph, Node

from fxtp.core.placement import REPLICATE, Partial, Placement, Replicate, Shard, is_sharded
from passes.registry import (
    GATHER_INSTEAD,
    Conflict,
    Decision,
    LayerNote,
    LayerState,
    RuleContext,
    is_tensor_node,
    takes_overlap,
    takes_uneven,
)
from passes.rules._common import norm_dim, tensor_inputs
from passes.rules.matmul import layer_weight
from passes.rules.variants import rule_for

__all__ = ["EdgeAction", "PlannerState", "Propagation", "Rejection", "ParamPiece", "propagate", "param_root"]

aten = torch.ops.aten
_SPLITS = (aten.split_with_sizes.default, aten.split.Tensor)
_TRANSPOSES = (aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default)


@dataclass(frozen=True)
class EdgeAction:
    """Local work on one (consumer, producer) edge; see the module docstring."""

    kind: str  # "enter" | "slice" | "gather" | "sp_gather" | "sp_scatter" (NOTE: [sequence parallelism])
    placement: Optional[Shard] = None  # slice, sp_scatter: the wanted shard; gather, sp_gather: the producer's shard
    enter: bool = False  # slice/gather: also wrap in f (float value into a sharded op); sp_gather: the
    # gradient is a partial sum (reduce_scatter it); sp_scatter: a float value (all_gather its gradient)
    then: Optional["EdgeAction"] = None  # sp_gather: the tensor-parallel work on the gathered value
    regather: bool = False  # sp_gather: layers save the value as its shard (NOTE: [regathered activations])


@dataclass(frozen=True)
class ParamPiece:
    """A parameter, or the piece of it a ``split`` hands to a layer (MultiheadAttention)."""

    placeholder: Node
    dim: Optional[int] = None  # split dim; None for the whole parameter
    offset: int = 0
    length: int = 0
    transposed: bool = False  # the parameter with its last two dims swapped (``W.T``; 3-D experts), whole
    # a 3-D experts parameter's rows gathered by expert, ``W[expert_ids]`` (NOTE: [gathered experts]); a want on
    # its dims 1 and 2 is the parameter's
    gathered: bool = False

    def placement_of_param(self, want: Placement) -> Placement:
        """What a want on this piece asks of the parameter itself."""
        if self.transposed and isinstance(want, Shard):
            nd = self.placeholder.meta["val"].dim()
            swap = {nd - 2: nd - 1, nd - 1: nd - 2}
            return want.with_dim(swap.get(want.dim, want.dim))
        return want


@dataclass
class PlannerState:
    """What the planner has decided so far; ``propagate`` reads it, the planner updates it.

    Keys are node names of the captured graph.
    """

    demoted: dict[str, LayerNote] = field(default_factory=dict)
    forced: dict[str, str] = field(default_factory=dict)
    segments: dict[str, tuple[int, ...]] = field(default_factory=dict)
    units: dict[str, int] = field(default_factory=dict)  # split granularity of a layer's output, NOTE: [uneven shards]
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per output segment, its kv group, NOTE: [grouped shards]
    unit_hints: dict[str, tuple[Optional[tuple[int, ...]], int]] = field(default_factory=dict)  # (segments, unit) a view asked for
    params: dict[str, Placement] = field(default_factory=dict)
    param_owners: dict[str, frozenset[str]] = field(default_factory=dict)
    gathers: set[tuple[str, str]] = field(default_factory=set)
    tried: dict[str, set[tuple[int, ...]]] = field(default_factory=dict)  # segment layouts tried per layer
    first: dict[str, LayerNote] = field(default_factory=dict)  # first layout rejection per layer
    heads: set[str] = field(default_factory=set)  # colwise output heads whose logits are gathered
    slice_input: set[str] = field(default_factory=set)  # rowwise on a sliced replicated input, NOTE: [rowwise fallback]
    whole_input: dict[str, LayerNote] = field(default_factory=dict)  # input kept replicated, NOTE: [tied uses]
    columns: set[str] = field(default_factory=set)  # tables sharded by columns, NOTE: [column-sharded embedding]
    features: dict[str, int] = field(default_factory=dict)  # output features held on a dim not the last (a bmm of experts)
    no_columns: set[str] = field(default_factory=set)  # tables tried by columns and kept as they were
    column_trial: Optional[Any] = None  # passes.layers.ColumnTrial while one runs


@dataclass(frozen=True)
class Rejection:
    """A rule that refused its inputs: the node, why, the layers whose shard reached it, and
    the sharded inputs (what a gather would fix)."""

    node: Node
    conflict: Conflict
    culprits: frozenset[Node]
    inputs: tuple[Node, ...]
    tainted: bool = False  # downstream of an earlier rejection this round: maybe an artifact of it


@dataclass
class Propagation:
    """The result of one propagation round."""

    placements: dict[Node, Any] = field(default_factory=dict)
    decisions: dict[Node, Decision] = field(default_factory=dict)
    edges: dict[tuple[Node, Node], EdgeAction] = field(default_factory=dict)
    layers: dict[Node, LayerNote] = field(default_factory=dict)
    conflicts: list[Rejection] = field(default_factory=list)
    requests: dict[Node, list[tuple[ParamPiece, Placement, frozenset[Node]]]] = field(default_factory=dict)
    origins: dict[Node, frozenset[Node]] = field(default_factory=dict)
    tainted: set[Node] = field(default_factory=set)  # nodes downstream of a rejection

    def reject(self, node: Node, conflict: Conflict, culprits: frozenset[Node], inputs: tuple[Node, ...]) -> None:
        tainted = any(a in self.tainted for a in node.all_input_nodes)
        self.conflicts.append(Rejection(node, conflict, culprits, inputs, tainted))
        self.tainted.add(node)


def param_root(node: Node, param_names: frozenset[str]) -> Optional[ParamPiece]:
    """The parameter ``node`` is, a ``split`` piece of one, a 2-D one's transpose, or a 3-D
    experts one's transpose or rows gathered by expert; ``None`` for computed values."""
    if node.op == "placeholder":
        return ParamPiece(node) if node.name in param_names else None
    if node.target is aten.index.Tensor and _gathers_experts(node):
        base = node.args[0]
        return ParamPiece(base, gathered=True) if base.op == "placeholder" and base.name in param_names else None
    if node.target in _TRANSPOSES and _is_matrix_transpose(node):
        base = node.args[0]
        if isinstance(base, Node) and base.op == "placeholder" and base.name in param_names:
            return ParamPiece(base, transposed=True)
        return None
    if node.target is operator.getitem:
        src, index = node.args
        if isinstance(src, Node) and src.target in _SPLITS and isinstance(src.args[0], Node):
            base = src.args[0]
            if base.op == "placeholder" and base.name in param_names:
                dim = norm_dim(src.args[2] if len(src.args) > 2 else 0, base.meta["val"].dim())
                sizes = [int(v.shape[dim]) for v in src.meta["val"]]
                return ParamPiece(base, dim, sum(sizes[:index]), sizes[index])
    return None


# NOTE: [gathered experts]
# Hugging Face's ``batched_mm`` experts (``transformers/integrations/moe.py``) gather each (token,
# expert) pair's matrices, ``gate_up_proj[expert_ids]`` ``(S, 2I, H)`` from ``(E, 2I, H)``, and
# multiply them by ``bmm``. A gather of whole experts by a replicated index keeps every expert's
# shard on dims 1 and 2 (``rules/indexing.py``), so the planner treats the gathered value as the
# parameter (as it does ``W.T``): the ``bmm`` is a layer (``rules/experts.py``) and its wants are the
# parameter's, which each rank stores sharded; the gather runs on the local shard, its backward
# (an ``index_put`` with accumulation) sums each expert's rows there. Its dim 0 is the pairs, not
# the experts: a want on it slices the gathered value, as any replicated value's.


def _gathers_experts(node: Node) -> bool:
    """``W[ids]``: a 3-D value indexed on dim 0 only, by one 1-D integer tensor."""
    base, indices = node.args[:2]
    if not isinstance(base, Node) or base.meta["val"].dim() != 3 or len(indices) != 1:
        return False
    ids = indices[0]
    val = ids.meta.get("val") if isinstance(ids, Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 1 and not val.is_floating_point() and val.dtype is not torch.bool


def _is_matrix_transpose(node: Node) -> bool:
    base = node.args[0]
    if isinstance(base, Node) and base.meta["val"].dim() == 3 and node.target is not aten.t.default:
        return _swaps_last_two(node)  # 3-D expert weights (E, out, in) seen as (E, in, out)
    if not isinstance(base, Node) or base.meta["val"].dim() != 2:
        return False
    if node.target is aten.transpose.int:
        return {norm_dim(d, 2) for d in node.args[1:3]} == {0, 1}
    if node.target is aten.permute.default:
        return [norm_dim(d, 2) for d in node.args[1]] == [1, 0]
    return True


def _swaps_last_two(node: Node) -> bool:
    """A ``transpose``/``permute`` of a 3-D value that swaps its last two dims only."""
    if node.target is aten.transpose.int:
        return {norm_dim(d, 3) for d in node.args[1:3]} == {1, 2}
    if node.target is aten.permute.default:
        return [norm_dim(d, 3) for d in node.args[1]] == [0, 2, 1]
    return False


def _is_float(node: Node) -> bool:
    return node.meta["val"].is_floating_point()


def _replicated_like(node: Node) -> Any:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return (REPLICATE,) * len(val)
    return REPLICATE


def propagate(graph: Graph, state: PlannerState, world_size: int, param_names: frozenset[str]) -> Propagation:
    """One round of placement propagation under ``state``; see the module docstring."""
    res = Propagation()
    by_name = {n.name: n for n in graph.nodes}

    def effective(inp: Node, consumer: Node) -> Any:
        if (consumer.name, inp.name) in state.gathers:
            return REPLICATE
        p = res.placements[inp]
        return REPLICATE if isinstance(p, Partial) else p  # Partial is all_reduced right away

    def sharded_origins(node: Node, among: "tuple[Node, ...] | None" = None) -> frozenset[Node]:
        out: set[Node] = set()
        for a in among if among is not None else node.all_input_nodes:
            if is_sharded(effective(a, node)):
                out |= res.origins.get(a, frozenset())
        return frozenset(out)

    def is_param(a: Node) -> bool:
        return param_root(a, param_names) is not None

    def layer_state(node: Node) -> LayerState:
        return LayerState(
            state.demoted.get(node.name), state.forced.get(node.name), state.segments.get(node.name), node.name in state.slice_input,
            state.whole_input.get(node.name), state.units.get(node.name, 1), state.groups.get(node.name, ()),
            node.name in state.columns,
        )

    for node in graph.nodes:
        if node.op == "placeholder":
            res.placements[node] = state.params.get(node.name, REPLICATE)
            owners = state.param_owners.get(node.name, frozenset())
            res.origins[node] = frozenset(by_name[o] for o in owners)
            continue
        if node.op == "get_attr":
            res.placements[node] = REPLICATE
            continue
        if node.op == "output":
            _check_outputs(node, res, effective, state)
            continue
        assert node.op == "call_function", node.format_node()
        if any(a in res.tainted for a in node.all_input_nodes):
            res.tainted.add(node)
        inputs = tensor_inputs(node)
        is_layer = layer_weight(node, is_param) is not None
        any_sharded = any(not isinstance(effective(a, node), Replicate) for a in inputs)
        if node.target is operator.getitem:
            any_sharded = not all(isinstance(p, Replicate) for p in res.placements[node.args[0]])
        if not is_layer and not any_sharded:
            res.placements[node] = _replicated_like(node)
            _mark_gathers(node, res, state, sharded_out=False)
            continue
        rule = rule_for(node.target)  # own, functional's (in-place, out=), or DTensor's
        ctx = RuleContext(
            node,
            world_size,
            lambda a, _n=node: effective(a, _n) if is_tensor_node(a) else res.placements[a],
            layer_state,
            is_param,
        )
        try:
            if rule is None:
                raise Conflict(
                    "unsupported-op",
                    f"op {node.target} has no sharding rule and consumes a sharded value",
                    f"{GATHER_INSTEAD}; or file an issue for the op",
                )
            _refuse_uneven(node, rule, [effective(a, node) for a in inputs], world_size)
            dec = rule(ctx)
        except Conflict as c:
            culprits = frozenset(c.culprits) if c.culprits is not None else sharded_origins(node, c.blame)
            sharded = tuple(a for a in c.blame or inputs if isinstance(effective(a, node), Shard))
            res.reject(node, c, culprits, sharded)
            res.placements[node] = _replicated_like(node)
            continue
        res.decisions[node] = dec
        res.placements[node] = dec.out
        if dec.layer is not None:
            res.layers[node] = dec.layer
        if dec.layer is not None and dec.layer.style == "colwise":
            origins = frozenset({node})  # its weight's shard comes from it, not the other way round
        else:
            origins = sharded_origins(node)
        outs = dec.out if isinstance(dec.out, tuple) else (dec.out,)
        sharded_out = any(isinstance(p, (Shard, Partial)) for p in outs)
        res.origins[node] = origins if any(isinstance(p, Shard) for p in outs) else frozenset()
        _apply_wants(node, dec, res, effective, origins, param_names, sharded_out)
        _mark_gathers(node, res, state, sharded_out)
        if sharded_out:
            _mark_entries(node, dec, res, effective, param_names)
    return res


def _refuse_uneven(node: Node, rule: Any, placements: list, world_size: int) -> None:
    """NOTE: [uneven shards]: only rules marked ``uneven_ok`` see an uneven shard; NOTE: [grouped
    shards]: only rules marked ``overlap_ok`` see a grouped one."""
    if takes_overlap(rule):
        return
    for p in placements:
        for q in p if isinstance(p, tuple) else (p,):
            if isinstance(q, Shard) and q.overlaps:
                raise Conflict(
                    "not-divisible",
                    f"{node.target} gets kv heads held by the ranks whose query heads read them ({q}) and is not "
                    "taught grouped shards",
                    f"use a world_size that divides the kv head count {q.size // q.unit}",
                )
            if isinstance(q, Shard) and not q.divisible(world_size) and not takes_uneven(rule):
                raise Conflict(
                    "not-divisible",
                    f"{node.target} gets a shard uneven at world_size {world_size} ({q}, dim of size {q.size}) "
                    "and is not taught uneven shards",
                    f"use a world_size that divides {q.size}",
                )


def _apply_wants(node, dec, res, effective, origins, param_names, sharded_out: bool) -> None:
    if param_root(node, param_names) is not None:
        return  # a view of a parameter (W.T, a split piece): its consumers request through it
    requesters = origins | {node} if dec.layer is not None else origins
    wants = dict(dec.wants)
    if not sharded_out and is_tensor_node(node):  # a replicated result used its parameters whole
        for a in tensor_inputs(node):
            if a not in wants and isinstance(effective(a, node), Shard) and param_root(a, param_names) is not None:
                wants[a] = REPLICATE
    for inp, want in wants.items():
        if not is_tensor_node(inp):
            continue
        piece = param_root(inp, param_names)
        if piece is not None and piece.gathered and isinstance(want, Shard) and want.dim == 0:
            piece = None  # rows of (token, expert) pairs, no dim of the parameter: sliced as a value (NOTE: [gathered experts])
        if piece is not None:
            # The planner stores the parameter as wanted, every round (also when it already is),
            # so a parameter nobody wants sharded is replicated next round, and one wanted both
            # whole and sharded is a conflict the planner sees.
            res.requests.setdefault(piece.placeholder, []).append((piece, piece.placement_of_param(want), requesters))
            continue
        cur = effective(inp, node)
        if cur == want:
            continue
        if isinstance(cur, Replicate) and isinstance(want, Shard):
            res.edges[(node, inp)] = EdgeAction("slice", want, enter=_is_float(inp))
            continue
        code = "needs-gather" if isinstance(want, Replicate) else "layout-mismatch"
        conflict = Conflict(code, f"{node.target} needs input {inp.name} as {want}, it is {cur}", GATHER_INSTEAD)
        res.reject(node, conflict, res.origins.get(inp, frozenset()), (inp,))


def _mark_gathers(node, res, state, sharded_out: bool) -> None:
    for inp in tensor_inputs(node):
        # Only a value still sharded is gathered: a later round may have replicated its producer.
        if (node.name, inp.name) in state.gathers and isinstance(res.placements[inp], Shard):
            res.edges[(node, inp)] = EdgeAction("gather", res.placements[inp], enter=sharded_out and _is_float(inp))


def _mark_entries(node, dec, res, effective, param_names) -> None:
    for inp in tensor_inputs(node):
        if inp is dec.after_reduce or (node, inp) in res.edges:
            continue
        if not isinstance(effective(inp, node), Replicate) or not _is_float(inp):
            continue
        if isinstance(dec.wants.get(inp), Shard) and param_root(inp, param_names) is not None:
            continue  # becomes a sharded parameter next round
        # NOTE: [replicated parameter in a sharded region] A parameter used whole by an op whose
        # output is sharded (a Linear shared by every head, a norm's weight on head-sharded
        # values, a table looked up with sharded ids) gets only its shard's part of the gradient
        # on each rank: it enters through f like any replicated value, so the parts are summed.
        res.edges[(node, inp)] = EdgeAction("enter")


def _check_outputs(node: Node, res: Propagation, effective, state: PlannerState) -> None:
    _mark_gathers(node, res, state, sharded_out=False)
    for a in tensor_inputs(node):
        if isinstance(effective(a, node), Shard):
            conflict = Conflict(
                "needs-gather",
                f"model output {a.name} would be sharded; returning it whole needs an all_gather",
                "none needed: fxtp keeps the layer replicated; plan={'{layer}': 'colwise'} all_gathers its output instead",
            )
            res.reject(node, conflict, res.origins.get(a, frozenset()), (a,))
