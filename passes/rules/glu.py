"""``glu``: a gated linear unit on a fused projection (Dauphin et al. 2017; torchtitan's w12).

``glu(x, dim)`` splits ``dim`` into halves ``a | b`` and returns ``a * sigmoid(b)``: element
``i`` of the output pairs ``x[i]`` with ``x[i + n/2]``. On another dim a shard flows through.
On the halved dim the rank's local ``glu`` pairs the first half of its local block with the
second half, which is right exactly when the segments (NOTE: [segments]) are the same in both
halves: a fused ``w12`` projection sharded with segments ``(h, h)`` gives each rank
``[w1_r | w2_r]``, and the output is sharded with segments ``(h,)``. Any other layout raises a
Conflict whose ``refine`` proposes the common refinement of the segments and their mirror
image across the middle, so the planner re-cuts the producing layer.
"""

from __future__ import annotations

import torch

from fxtp.core.placement import REPLICATE, Shard
from passes.registry import Conflict, Decision, RuleContext, register_rule, shape_of
from passes.rules._common import ndim, norm_dim

__all__ = ["glu_segments"]

aten = torch.ops.aten


def glu_segments(segments: tuple[int, ...]) -> tuple[int, ...]:
    """The coarsest refinement of ``segments`` whose first half equals its second half.

    Example: ``(256,)`` -> ``(128, 128)``; ``(64, 192)`` -> ``(64, 64, 64, 64)``.
    """
    total = sum(segments)
    half = total // 2
    bounds, acc = {0, half, total}, 0
    for seg in segments:
        acc += seg
        bounds.add(acc)
    bounds |= {b + half for b in bounds if b < half} | {b - half for b in bounds if b > half}
    cuts = sorted(bounds)
    return tuple(b - a for a, b in zip(cuts, cuts[1:]))


@register_rule(aten.glu.default)
def glu_rule(ctx: RuleContext) -> Decision:
    x = ctx.node.args[0]
    dim = ctx.node.args[1] if len(ctx.node.args) > 1 else ctx.node.kwargs.get("dim", -1)
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    if norm_dim(dim, ndim(x)) != p.dim:
        return Decision(p)
    k = len(p.segments)
    if k % 2 == 0 and p.segments[: k // 2] == p.segments[k // 2 :]:
        return Decision(Shard(p.dim, p.segments[: k // 2]))
    refined = glu_segments(p.segments)
    ok = all(s % ctx.world_size == 0 for s in refined)
    raise Conflict(
        "split-crosses-shard" if ok else "not-divisible",
        f"glu halves dim {p.dim} of size {shape_of(x)[p.dim]}, which crosses the shard of segments {list(p.segments)} "
        f"at world_size {ctx.world_size}",
        "use a world_size that divides both halves",
        refine=refined if ok else None,
    )
