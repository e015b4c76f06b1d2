"""Tables sharded by columns where their consumers take the output sharded
(NOTE: [column-sharded embedding]): ``try_columns``, run by the planner on a clean round."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx import Node

from passes.propagate import PlannerState, Propagation, param_root
from passes.rules.matmul import layer_weight

__all__ = ["ColumnTrial", "try_columns"]

aten = torch.ops.aten


# NOTE: [column-sharded embedding]
# T5's relative-attention bias is an ``Embedding(num_buckets, n_heads)`` looked up with a
# replicated ``(q, k)`` bucket grid, permuted to ``(1, n_heads, q, k)`` and added to the scores,
# which are sharded by heads. Vocab-parallel (rows) it costs an all_reduce of the whole
# ``(q, k, n_heads)`` bias, of which each rank then keeps its heads; sharded by columns (its
# ``n_heads``), every rank looks up its heads' bias and nothing is communicated, as the heads of
# q/k/v are split. A lookup by columns is always local (each rank holds every row, a slice of
# each); its output is sharded on the embedding dim, which only consumers that take that shard
# can use.
#
# The planner tries it (:func:`try_columns`): on a clean round, a table whose looked-up rows
# reach, through non-layer ops, a value some consumer slices (an ``EdgeAction("slice")``: it
# wants the value sharded) is tried by columns from a copy of the planner state. The trial is
# kept if the planning converges clean with every other layer's style unchanged and no more
# gathers; else the copy is restored and that table is not tried again. So a token embedding,
# whose rows feed the layers, keeps its plan, and only tables whose columns the consumers shard
# anyway change.

_DEPTH = 8  # non-layer ops between a table's lookup and the sliced value (permute, unsqueeze, where, ...)


@dataclass
class ColumnTrial:
    """A table being tried by columns: the state to restore, and the round it must match."""

    table: str
    saved: PlannerState
    styles: dict[str, str]
    gathers: int


def try_columns(res: Propagation, state: PlannerState, param_names: frozenset[str]) -> bool:
    """On a clean, settled round: judge the running trial, or start one (NOTE: [column-sharded
    embedding]). Returns whether the state changed (another round is needed)."""
    trial: Optional[ColumnTrial] = state.column_trial
    if trial is not None:
        state.column_trial = None
        styles = {n.name: note.style for n, note in res.layers.items()}
        kept = styles.get(trial.table) == "colwise" and _gathers(res) <= trial.gathers and all(
            styles.get(name) == style for name, style in trial.styles.items() if name != trial.table
        )
        if not kept:
            tried = state.no_columns | {trial.table}
            for f in dataclasses.fields(state):
                setattr(state, f.name, getattr(trial.saved, f.name))
            state.no_columns = tried
            return True
    table = _candidate(res, state, param_names)
    if table is None:
        return False
    saved = copy.deepcopy(state)
    styles = {n.name: note.style for n, note in res.layers.items()}
    state.column_trial = ColumnTrial(table.name, saved, styles, _gathers(res))
    state.columns.add(table.name)
    note = state.demoted.get(table.name)
    if note is not None and note.code == "small-embedding":
        del state.demoted[table.name]  # by columns it needs no all_reduce: the policy's reason is gone
    return True


def _gathers(res: Propagation) -> int:
    return sum(1 for action in res.edges.values() if action.kind == "gather")


def _candidate(res: Propagation, state: PlannerState, param_names: frozenset[str]) -> Optional[Node]:
    """The first table, in graph order, whose lookup reaches a sliced value and that may be tried."""
    weights = [p.placeholder for p in (param_root(n.args[0], param_names) for n in res.placements if _is_lookup(n)) if p]
    found: list[Node] = []
    for (_, producer), action in res.edges.items():
        if action.kind != "slice":
            continue
        for table in _lookups_behind(producer, param_names):
            piece = param_root(table.args[0], param_names)
            if piece is None or weights.count(piece.placeholder) > 1:  # tied: its other uses decide
                continue
            note = state.demoted.get(table.name)
            if table.name in state.columns | state.no_columns or table.name in state.forced:
                continue
            if note is None or note.code == "small-embedding":
                found.append(table)
    order = {n: i for i, n in enumerate(res.placements)}
    return min(found, key=order.__getitem__, default=None)


def _is_lookup(node: Node) -> bool:
    return node.op == "call_function" and node.target is aten.embedding.default


def _lookups_behind(value: Node, param_names: frozenset[str]) -> list[Node]:
    """The lookups ``value`` is computed from through at most ``_DEPTH`` non-layer ops."""
    out, frontier, seen = [], [value], {value}
    for _ in range(_DEPTH):
        nxt = []
        for node in frontier:
            if _is_lookup(node):
                out.append(node)
                continue
            if node.op != "call_function" or layer_weight(node, lambda a: param_root(a, param_names) is not None) is not None:
                continue
            for a in node.all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    nxt.append(a)
        frontier = nxt
    return out + [n for n in frontier if _is_lookup(n)]
