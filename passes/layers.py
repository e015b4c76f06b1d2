"""Layers: the matmul-like nodes the planner gives a style, their names, the planning
policies that are not op rules, and the report rows they become.

* ``layer_names``: stable names, the module FQN or the weight FQN (``plan=`` keys).
* Policies (passes/README.md, "Planning policies"): small tables stay replicated
  (``small-embedding``), renormalized tables too (``embedding-max-norm``), the user's
  ``plan=`` overrides, output heads.
* ``layer_decision``: one ``LayerDecision`` from the last propagation round.
* Output layouts (``refine_layout``, ``refine_uneven``, ``next_segments``): which segments and
  split unit a layer's output takes when a rule refuses its shard (below).
* ``RepeatedBlocks`` / ``mirror_blocks``: a step for a layer of a repeated block is taken for
  the same layer of the identical blocks after it (NOTE: [repeated blocks decided alike]).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from torch.fx import Graph, Node

from fxtp.core import local_ops
from fxtp.core.errors import FxtpPlanError
from fxtp.core.placement import Shard
from passes.propagate import PlannerState, Propagation, param_root
from passes.registry import LayerNote, module_of, shape_of
from passes.rules.matmul import layer_operands, layer_weight
from passes.sharding_plan import LayerDecision

__all__ = [
    "MAX_SEGMENTS",
    "layer_segments",
    "refine_layout",
    "refine_uneven",
    "next_segments",
    "RepeatedBlocks",
    "VOCAB_ROWS_PER_COLUMN",
    "apply_overrides",
    "check_forced",
    "is_output_head",
    "keep_renormed_tables",
    "keep_small_embeddings",
    "layer_decision",
    "layer_names",
    "mirror_blocks",
    "rowwise_feeds",
    "snapshot",
    "weight_numel",
    "weight_of",
    "weight_placeholder",
]

aten = torch.ops.aten


def layer_names(layers: list[Node], param_names: frozenset[str], param_fqns: Mapping[str, str]) -> dict[Node, str]:
    """Stable, unique layer names: the module FQN, or where several layers share a module
    (``nn.MultiheadAttention``'s functional projections) the weight's FQN, a split piece adding
    ``[start:end]``."""
    modules = {n: module_of(n) for n in layers}
    counts: dict[str, int] = {}
    for m in modules.values():
        counts[m] = counts.get(m, 0) + 1
    names: dict[Node, str] = {}
    for n in layers:
        if modules[n] and counts[modules[n]] == 1:
            names[n] = modules[n]
            continue
        weight = weight_of(n, param_names)
        piece = param_root(weight, param_names) if isinstance(weight, Node) else None
        if piece is None:
            names[n] = f"{modules[n] or 'model'}:{n.name}"
            continue
        fqn = param_fqns[piece.placeholder.name]
        if piece.dim is not None:
            names[n] = f"{fqn}[{piece.offset}:{piece.offset + piece.length}]"
        else:
            names[n] = fqn[: -len(".weight")] if fqn.endswith(".weight") else fqn
    taken = list(names.values())
    return {n: name if taken.count(name) == 1 else f"{name}:{n.name}" for n, name in names.items()}


def weight_of(node: Node, param_names: frozenset[str]) -> Optional[Node]:
    return layer_weight(node, lambda a: param_root(a, param_names) is not None)


def weight_placeholder(node: Node, param_names: frozenset[str]) -> Optional[Node]:
    weight = weight_of(node, param_names)
    piece = param_root(weight, param_names) if isinstance(weight, Node) else None
    return piece.placeholder if piece is not None else None


# A table with fewer rows than this many times its width (a position or token-type table) stays
# replicated: sharding it saves little memory and costs an all_reduce per lookup. Vocabularies
# are far taller than wide (GPT-2: 50257 x 768; Llama-2: 32000 x 4096). A share of the model's
# bytes would not do: Llama-2-70B's vocabulary is only 0.4% of its parameters.
VOCAB_ROWS_PER_COLUMN = 2


def keep_small_embeddings(layers: list[Node], state: PlannerState, param_names: frozenset[str]) -> None:
    weights = [weight_placeholder(n, param_names) for n in layers]
    for n in layers:
        if n.target is not aten.embedding.default or n.name in state.demoted or n.name in state.forced:
            continue
        if weights.count(weight_placeholder(n, param_names)) > 1:
            continue  # tied to a head: the table follows what its other uses allow
        rows, cols = shape_of(n.args[0])
        if rows < VOCAB_ROWS_PER_COLUMN * cols:
            state.demoted[n.name] = LayerNote(
                "replicate",
                f"a {rows}x{cols} table is not a vocabulary (fewer than {VOCAB_ROWS_PER_COLUMN}x as many rows as columns): "
                "a vocab-parallel lookup would add an all_reduce to save little memory",
                code="small-embedding",
                fix="none needed; plan={'{layer}': 'rowwise'} shards it anyway",
            )


def keep_renormed_tables(graph: Graph, layers: list[Node], state: PlannerState, param_names: frozenset[str]) -> None:
    """``nn.Embedding(max_norm=...)`` renormalizes the looked-up rows of its table in place
    (``embedding_renorm_`` on the table before the lookup). A vocab-parallel table would have
    to renormalize only its own rows with only the ids that fall in them; fxtp does not emit
    that, so such a table stays replicated, with that reason."""
    renormed = set()
    for node in graph.nodes:
        if node.target is aten.embedding_renorm_.default:
            table = node.args[0]
            while isinstance(table, Node) and table.target in (aten.detach.default, aten.alias.default):
                table = table.args[0]
            renormed.add(table)
    for n in layers:
        if n.target is aten.embedding.default and n.args[0] in renormed and n.name not in state.forced:
            state.demoted.setdefault(
                n.name,
                LayerNote(
                    "replicate",
                    "max_norm renormalizes the looked-up rows of the table in place (embedding_renorm_); "
                    "fxtp does not shard a renormalized table",
                    code="embedding-max-norm",
                    fix="drop max_norm (e.g. clip the rows after each optimizer step) to shard the table",
                ),
            )


def apply_overrides(overrides: Mapping[str, str], layers: list[Node], names, state: PlannerState) -> None:
    """Record the user's styles in ``state``; where two entries match a layer, the later one
    wins (``fxtp.compile(..., strategy=plan, plan=mine)`` puts the user's after the plan's)."""
    for pattern, style in overrides.items():
        hits = [n for n in layers if fnmatch.fnmatchcase(names[n], pattern) or fnmatch.fnmatchcase(module_of(n), pattern)]
        if not hits:
            known = ", ".join(sorted(names.values())) or "(none)"
            raise FxtpPlanError(f"plan key {pattern!r} matches no layer; layers are: {known}")
        for n in hits:
            if n.target is aten.embedding.default and style == "colwise":
                raise FxtpPlanError(f"plan asks embedding {names[n]} to be colwise; embeddings are 'rowwise' (vocab-parallel) or 'replicate'")
            if style == "replicate":
                state.forced.pop(n.name, None)
                state.demoted[n.name] = LayerNote(
                    "replicate", "kept replicated by the user's plan", code="user-plan", fix="drop the plan entry to let fxtp shard it"
                )
            else:
                if n.name in state.demoted and state.demoted[n.name].code == "user-plan":
                    del state.demoted[n.name]
                state.forced[n.name] = style


def is_output_head(layer: Node, param_names: frozenset[str]) -> bool:
    """An output head (an LM head): a layer that widens (out_features > in_features). Its
    logits are all_gathered at the model output rather than kept replicated: the gather moves
    activations once, the shard saves (ws - 1)/ws of the widest weight (Megatron-LM's parallel
    LM head, DTensor's ``ColwiseParallel`` output layer)."""
    ops = layer_operands(layer, lambda a: param_root(a, param_names) is not None)
    if ops is None:
        return False
    shape = shape_of(ops.weight)
    return shape[ops.out_dim] > shape[1 - ops.out_dim]


def weight_numel(layer: Node, param_names: frozenset[str]) -> int:
    weight = weight_placeholder(layer, param_names)
    return weight.meta["val"].numel() if weight is not None else 0


def rowwise_feeds(layers: list[Node], names: Mapping[Node, str], res: Propagation, param_names) -> dict[Node, list[str]]:
    """colwise layer -> names of the rowwise layers (or vocab-parallel losses) its shard reaches,
    and the reverse."""
    feeds: dict[Node, list[str]] = {}
    for node, dec in res.decisions.items():
        if dec.local_target is local_ops.vocab_parallel_cross_entropy:
            for origin in res.origins.get(node.args[0], frozenset()):
                feeds.setdefault(origin, []).append("a vocab-parallel cross_entropy (3 all_reduce of (N,), no logits gather)")
    for n in layers:
        note = res.layers.get(n)
        ops = layer_operands(n, lambda a: param_root(a, param_names) is not None)
        if note is not None and note.style == "rowwise" and ops is not None:
            for origin in sorted(res.origins.get(ops.x, frozenset()), key=lambda o: o.name):
                feeds.setdefault(origin, []).append(names[n])
                feeds.setdefault(n, []).append(names[origin])
    return feeds


def layer_decision(node: Node, name: str, res: Propagation, state: PlannerState, param_names, param_fqns, ws: int, feeds) -> LayerDecision:
    note = res.layers.get(node) or state.demoted.get(node.name) or LayerNote("replicate", "inputs replicated")
    partners = ", ".join(feeds.get(node, []))
    if note.style == "colwise" and node.name in state.heads:
        also = f"; its shard also feeds {partners}" if partners else ""
        note = dataclasses.replace(note, reason="output head: its logits are all_gathered at the model output" + also)
    if note.style == "colwise" and partners:
        note = dataclasses.replace(note, reason=note.reason.replace("a rowwise layer", partners))
    elif note.style == "rowwise" and partners:
        note = dataclasses.replace(note, reason=f"input sharded by {partners}; " + note.reason)
    weight = weight_of(node, param_names)
    piece = param_root(weight, param_names) if isinstance(weight, Node) else None
    if piece is not None and piece.transposed:
        weight = piece.placeholder  # show the parameter as stored, not its transpose
    wshape = shape_of(weight)
    local = list(wshape)
    wp = res.placements.get(weight)
    if isinstance(wp, Shard):
        local[wp.dim] = wp.local_size(ws, 0)  # rank 0's: the largest of an uneven shard (NOTE: [uneven shards])
    return LayerDecision(
        name=name,
        node=node.name,
        module=module_of(node),
        op=str(node.target.__name__).split(".")[0],
        weight=param_fqns[piece.placeholder.name] if piece is not None else weight.name,
        weight_shape=wshape,
        style=note.style,
        local_weight_shape=tuple(local),
        reason=note.reason,
        code=note.code,
        fix=note.fix.replace("{layer}", name) if note.fix else None,
        culprit=note.node,
        culprit_module=note.module,
        output_head=note.style == "colwise" and node.name in state.heads,
    )


def check_forced(decisions: tuple[LayerDecision, ...], state: PlannerState, names) -> None:
    by_node = {d.node: d for d in decisions}
    for node_name, style in state.forced.items():
        d = by_node[node_name]
        if d.style != style:
            raise FxtpPlanError(f"plan asks {d.name} to be {style}, but it can only be {d.style}: {d.reason}; drop the entry")


# Output layouts: the planner's choice of a layer's segments and split unit.
#
# A rule that refuses a layer's shard may say which layout would do (``Conflict.refine``: finer
# segments, NOTE: [segments]; ``Conflict.unit``: whole heads, NOTE: [uneven shards], both in
# ``fxtp/core/placement.py``). The planner (``passes.plan``) tries even layouts first: the rule's
# hint, then k equal segments. With none left it splits unevenly under the first unit hint, and
# from then on takes finer segments or a coarser unit from later rules (NOTE: [uneven
# refinement]). Each step refines the layout or is recorded as tried, so the rounds end.
# These read and update the PlannerState only.

MAX_SEGMENTS = 8  # fused projections have few parts (Q|K|V, gate|up, K|V)


def layer_segments(layer: Node, hint: Optional[tuple[int, ...]]) -> Optional[tuple[int, ...]]:
    """``hint`` if it is a segmentation of ``layer``'s output features (a rule's refinement is in
    the coordinates of the value it saw, which are the layer's only when the shard flowed 1:1)."""
    return hint if hint is not None and sum(hint) == shape_of(layer)[-1] else None


def refine_layout(demotable: list[Node], hint: Optional[tuple[int, ...]], state: PlannerState, ws: int, refined_now: set[Node]) -> bool:
    """Give the layers the next segment layout to try, or, with none left, whole heads split
    unevenly (NOTE: [uneven shards]); whether a layer got a new layout."""
    refined = {n: next_segments(n, state, hint, ws) for n in demotable}
    if any(seg is not None for seg in refined.values()):
        refined_now.update(demotable)
        for n, seg in refined.items():
            if seg is not None:
                state.segments[n.name] = seg
        return True
    hinted = [n for n in demotable if n.name in state.unit_hints and n.name not in state.units]
    for n in hinted:
        refined_now.add(n)
        segments, state.units[n.name] = state.unit_hints[n.name]
        if segments is None:
            state.segments.pop(n.name, None)
        else:
            state.segments[n.name] = segments
    return bool(hinted)


# NOTE: [uneven refinement]
# Once a layer is split unevenly, the rules downstream may each ask for more: Phi-3's three
# slices of ``qkv`` each cut one bound (``[0:64]`` asks for (64, 128), ``[64:128]`` for
# (64, 64, 64)), and the views after them want whole heads (unit 16) where the slices needed
# only unit 1. A rule's finer segments (every bound kept) or a coarser unit (a multiple of the
# current one that every segment holds, at least one unit per rank) replace the layer's layout;
# each step makes it strictly finer or coarser-grained, so they end.


def _cuts(segments: tuple[int, ...]) -> set[int]:
    return {0, *itertools.accumulate(segments)}


def refine_uneven(
    demotable: list[Node], hint: Optional[tuple[int, ...]], unit: Optional[int], state: PlannerState, refined_now: set[Node], ws: int
) -> bool:
    """NOTE: [uneven refinement]: the layers already split unevenly take ``hint``'s finer
    segments and ``unit``'s coarser unit where they fit; whether any layer changed."""
    changed = []
    for n in demotable:
        if n.name not in state.units:
            continue
        have = state.segments.get(n.name, (shape_of(n)[-1],))
        finer = layer_segments(n, hint)
        segments = finer if finer is not None and _cuts(have) < _cuts(finer) else have
        new_unit = unit if unit is not None and unit > state.units[n.name] and unit % state.units[n.name] == 0 else state.units[n.name]
        if (segments, new_unit) == (have, state.units[n.name]) or any(s % new_unit or s // new_unit < ws for s in segments):
            continue
        state.segments[n.name], state.units[n.name] = segments, new_unit
        changed.append(n)
    refined_now.update(changed)
    return bool(changed)


def next_segments(layer: Node, state: PlannerState, hint: Optional[tuple[int, ...]], ws: int) -> Optional[tuple[int, ...]]:
    """The next untried segment layout for ``layer``'s output: the rule's hint, then k equal
    segments for k = 2..8; ``None`` when all are tried."""
    out = shape_of(layer)[-1]
    tried = state.tried.setdefault(layer.name, {state.segments.get(layer.name, (out,))})
    candidates = [hint] if hint is not None and sum(hint) == out and all(s % ws == 0 for s in hint) else []
    candidates += [(out // k,) * k for k in range(2, MAX_SEGMENTS + 1) if out % k == 0 and (out // k) % ws == 0]
    for seg in candidates:
        if seg not in tried:
            tried.add(seg)
            return seg
    return None
# NOTE: [repeated blocks decided alike]
# A planning round acts only on rejections that are not downstream of an earlier rejection of the same round (the
# earlier one's stand-in placement may have caused them, passes/plan.py). In a stack of identical blocks every block
# is downstream of the first, so each block's layout refinements waited for every earlier block's, one round each:
# rounds grew with the layer count and each round propagates the whole graph, so planning was quadratic in the depth
# (a Llama whose kv heads do not divide the world size: 59 rounds at 8 layers, 115 at 16). Identical blocks that see
# identical inputs get identical decisions, so, as meta-pytorch/ autoparallel groups repeated blocks to solve them
# once, a step the planner takes for a layer of one block (a new segment layout, a demotion, a sliced input) is taken
# in the same round for the same layer of every later identical block that has had the same history so far; the copy's
# note names its own node. A block whose context differs still gets its own rejections in later rounds, acted on as
# before, and the last, clean round checks the whole plan. Identical: the same module list, and the same sequence of
# (op, output shape) over the block's nodes; a node's block is the first integer-indexed module on its
# ``nn_module_stack`` path. ``RepeatedBlocks.of`` reads ``node.meta["nn_module_stack"]`` and ``node.meta["val"]``.

_INDEXED = re.compile(r"(?:^|\.)(?P<index>\d+)(?:\.|$)")


def _block_of(node: Node) -> Optional[tuple[str, int]]:
    """``(prefix, index)`` of the first integer-indexed module on the node's module path
    (``model.layers.5.self_attn.k_proj`` -> ``("model.layers", 5)``), or None."""
    path = module_of(node)
    m = _INDEXED.search(path)
    return (path[: m.start()], int(m["index"])) if m else None


def _signature(node: Node) -> tuple:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return (node.target, None)
    return (node.target, tuple(d if isinstance(d, int) else str(d) for d in val.shape))  # a dynamic size by its symbol


@dataclass(frozen=True)
class RepeatedBlocks:
    """The identical blocks of one module list: ``blocks[b][i]`` is node ``i`` of block ``b``
    (in graph order); ``where[node] = (b, i)``."""

    blocks: tuple[tuple[Node, ...], ...]
    where: dict[Node, tuple[int, int]]

    @classmethod
    def of(cls, graph: Graph) -> "RepeatedBlocks":
        """The module list with the most identical blocks (NOTE: [repeated blocks decided
        alike]); no blocks when none repeats."""
        found: dict[tuple[str, int], list[Node]] = defaultdict(list)
        for node in graph.nodes:
            if node.op == "call_function" and (at := _block_of(node)) is not None:
                found[at].append(node)
        kinds: dict[tuple[str, tuple], list[tuple[Node, ...]]] = defaultdict(list)
        for (prefix, _), nodes in sorted(found.items(), key=lambda item: item[0]):
            kinds[(prefix, tuple(_signature(n) for n in nodes))].append(tuple(nodes))
        same = max(kinds.values(), key=len, default=[])
        if len(same) < 2:
            return cls((), {})
        return cls(tuple(same), {n: (b, i) for b, nodes in enumerate(same) for i, n in enumerate(nodes)})

    def later(self, node: Node) -> list[Node]:
        """The same node in each later block."""
        b, i = self.where[node]
        return [nodes[i] for nodes in self.blocks[b + 1:]]


# A layer's planning state, field by field (PlannerState's per-layer entries; ``forced`` and
# ``gathers`` come from the user's plan and are not mirrored).
_FIELDS = ("demoted", "segments", "units", "unit_hints", "tried", "first", "whole_input")
_SETS = ("slice_input", "heads")


def snapshot(state: PlannerState, name: str) -> tuple:
    """Layer ``name``'s state, notes compared by style and code (not by the node they name)."""
    def key(value: Any) -> Any:
        if isinstance(value, LayerNote):
            return (value.style, value.code)
        return frozenset(value) if isinstance(value, set) else value

    return tuple(key(getattr(state, f).get(name)) for f in _FIELDS) + tuple(name in getattr(state, s) for s in _SETS)


def mirror_blocks(state: PlannerState, before: dict[str, tuple], blocks: RepeatedBlocks, layers: list[Node]) -> None:
    """Take each layer's step of this round (its state against ``before``, its snapshot at
    the round's start) for the same layer of every later block with the same history
    (NOTE: [repeated blocks decided alike])."""
    for n in layers:
        if n not in blocks.where or snapshot(state, n.name) == before[n.name]:
            continue
        b, _ = blocks.where[n]
        for m in blocks.later(n):
            if before[m.name] != before[n.name] or snapshot(state, m.name) != before[m.name]:
                continue  # its own history, or its own step this round
            offset = blocks.where[m][0] - b
            for f in _FIELDS:
                value = getattr(state, f).get(n.name)
                table = getattr(state, f)
                if value is None:
                    table.pop(m.name, None)
                else:
                    table[m.name] = _moved(value, blocks, b, offset)
            for s in _SETS:
                (getattr(state, s).add if n.name in getattr(state, s) else getattr(state, s).discard)(m.name)


def _moved(value: Any, blocks: RepeatedBlocks, block: int, offset: int) -> Any:
    """``value`` for the layer ``offset`` blocks later: a note names that block's node."""
    if isinstance(value, set):
        return set(value)
    if not isinstance(value, LayerNote) or value.node is None:
        return value
    for node in blocks.blocks[block]:
        if node.format_node() == value.node:
            twin = blocks.blocks[block + offset][blocks.where[node][1]]
            return dataclasses.replace(value, node=twin.format_node(), module=module_of(twin))
    return value
