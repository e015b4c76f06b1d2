"""Repeated blocks decided alike (NOTE: [repeated blocks decided alike]): a step the planner
takes for a layer of one block is taken for the same layer of the identical blocks after it."""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.fx import Graph, Node

from passes.propagate import PlannerState
from passes.registry import LayerNote, module_of

__all__ = ["RepeatedBlocks", "mirror_blocks", "snapshot"]


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
