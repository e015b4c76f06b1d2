"""Output layouts: the planner's choice of a layer's segments and split unit.

A rule that refuses a layer's shard may say which layout would do (``Conflict.refine``: finer
segments, NOTE: [segments]; ``Conflict.unit``: whole heads, NOTE: [uneven shards], both in
``fxtp/core/placement.py``). The planner (``passes.plan``) tries even layouts first: the rule's
hint, then k equal segments. With none left it splits unevenly under the first unit hint, and
from then on takes finer segments or a coarser unit from later rules (NOTE: [uneven
refinement]). Each step refines the layout or is recorded as tried, so the rounds end.
These read and update the PlannerState only.
"""

from __future__ import annotations

import itertools
from typing import Optional

from torch.fx import Node

from passes.propagate import PlannerState
from passes.registry import shape_of

__all__ = ["MAX_SEGMENTS", "layer_segments", "out_features", "refine_layout", "refine_uneven", "next_segments"]

MAX_SEGMENTS = 8  # fused projections have few parts (Q|K|V, gate|up, K|V)


def out_features(layer: Node, state: PlannerState) -> int:
    """The size of ``layer``'s output features: its last dim, or where a batched experts matmul
    holds them elsewhere (``(S, 2I, 1)``, ``rules/experts.py``) the planner's record of it."""
    return state.features.get(layer.name) or shape_of(layer)[-1]


def layer_segments(layer: Node, hint: Optional[tuple[int, ...]], state: PlannerState) -> Optional[tuple[int, ...]]:
    """``hint`` if it is a segmentation of ``layer``'s output features (a rule's refinement is in
    the coordinates of the value it saw, which are the layer's only when the shard flowed 1:1)."""
    return hint if hint is not None and sum(hint) == out_features(layer, state) else None


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
        have = state.segments.get(n.name, (out_features(n, state),))
        finer = layer_segments(n, hint, state)
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
    out = out_features(layer, state)
    tried = state.tried.setdefault(layer.name, {state.segments.get(layer.name, (out,))})
    candidates = [hint] if hint is not None and sum(hint) == out and all(s % ws == 0 for s in hint) else []
    candidates += [(out // k,) * k for k in range(2, MAX_SEGMENTS + 1) if out % k == 0 and (out // k) % ws == 0]
    for seg in candidates:
        if seg not in tried:
            tried.add(seg)
            return seg
    return None
