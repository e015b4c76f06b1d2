"""Layers' names, the planning policies that are not op rules, and the report rows.

* ``layer_names``: stable names, the module FQN or the weight FQN (``plan=`` keys).
* Policies (passes/README.md, "Planning policies"): small tables stay replicated
  (``small-embedding``), renormalized tables too (``embedding-max-norm``), the user's
  ``plan=`` overrides, output heads.
* ``layer_decision``: one ``LayerDecision`` from the last propagation round.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Mapping, Optional

import torch
from torch.fx import Graph, Node

from fxtp.core import losses
from fxtp.core.errors import FxtpPlanError
from fxtp.core.placement import Shard
from passes.propagate import PlannerState, Propagation, param_root
from passes.registry import LayerNote, module_of, shape_of
from passes.rules.matmul import layer_operands, layer_weight
from passes.sharding_plan import LayerDecision

__all__ = [
    "VOCAB_ROWS_PER_COLUMN",
    "apply_overrides",
    "check_forced",
    "is_output_head",
    "keep_renormed_tables",
    "keep_small_embeddings",
    "layer_decision",
    "layer_names",
    "rowwise_feeds",
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
    return len(shape) == 2 and shape[ops.out_dim] > shape[1 - ops.out_dim]  # MoE experts (3-D) are no heads


def weight_numel(layer: Node, param_names: frozenset[str]) -> int:
    weight = weight_placeholder(layer, param_names)
    return weight.meta["val"].numel() if weight is not None else 0


def rowwise_feeds(layers: list[Node], names: Mapping[Node, str], res: Propagation, param_names) -> dict[Node, list[str]]:
    """colwise layer -> names of the rowwise layers (or vocab-parallel losses) its shard reaches,
    and the reverse."""
    feeds: dict[Node, list[str]] = {}
    for node, dec in res.decisions.items():
        if dec.local_target is losses.vocab_parallel_cross_entropy:
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
    if piece is not None and (piece.transposed or piece.gathered):
        weight = piece.placeholder  # show the parameter as stored, not its transpose or gathered rows
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
