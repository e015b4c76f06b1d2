"""``scaled_dot_product_attention``: shards on batch or head dims only.

q, k, v are ``(..., heads, seq, head_dim)``. Any dim before the last two may be sharded, the
same one in q, k and v, so every rank attends with whole heads. Grouped-query attention
(fewer kv heads) works when both head counts are sharded in the same number of segments.
Sharding seq or head_dim is refused: it would split inside an attention head.
"""

from __future__ import annotations

import torch

from fxtp.placement import Shard
from passes.registry import Conflict, Decision, RuleContext, register_rule, shape_of
from passes.rules._common import ndim

__all__: list[str] = []

aten = torch.ops.aten


@register_rule(aten.scaled_dot_product_attention.default)
def sdpa_rule(ctx: RuleContext) -> Decision:
    q, k, v = ctx.node.args[:3]
    mask = ctx.node.args[3] if len(ctx.node.args) > 3 else ctx.node.kwargs.get("attn_mask")
    nd = ndim(q)
    placements = {t: ctx.placement(t) for t in (q, k, v)}
    shards = {t: p for t, p in placements.items() if isinstance(p, Shard)}
    if not shards:
        if mask is not None and isinstance(ctx.placement(mask), Shard):
            raise Conflict("layout-mismatch", "attention mask sharded but q/k/v replicated", "keep the mask's producer replicated")
        return Decision(placements[q])
    dims = {p.dim for p in shards.values()}
    first = next(iter(shards.values()))
    if len(dims) > 1 or first.dim >= nd - 2:
        heads = shape_of(q)[nd - 3] if nd >= 3 else 1
        inside = [t for t, p in shards.items() if p.dim >= nd - 2]
        raise Conflict(
            "splits-head",
            f"attention inputs are sharded inside a head or differently ({', '.join(map(str, shards.values()))}); "
            f"q has {heads} heads and world_size is {ctx.world_size}",
            f"use a world_size that divides the head count {heads}",
            blame=inside or None,
        )
    dim = first.dim
    nseg = len(first.segments)
    if any(len(p.segments) != nseg for p in shards.values()):
        raise Conflict("layout-mismatch", "q, k, v sharded with different segment counts", "keep the producers replicated")
    wants: dict = dict(shards)
    for t in (q, k, v):
        if t not in shards:
            size = shape_of(t)[dim]
            if size % nseg or (size // nseg) % ctx.world_size:
                raise Conflict("not-divisible", f"{size} heads of an unsharded attention input at world_size {ctx.world_size}", "keep the producers replicated")
            wants[t] = Shard(dim, (size // nseg,) * nseg)
    if mask is not None:
        mdim = dim - (nd - ndim(mask))
        if isinstance(ctx.placement(mask), Shard):
            raise Conflict("layout-mismatch", "sharded attention mask", "keep the mask's producer replicated")
        if mdim >= 0 and shape_of(mask)[mdim] != 1:
            wants[mask] = Shard(mdim, placements[q].segments if q in shards else wants[q].segments)
    out = placements[q] if q in shards else wants[q]
    return Decision(out, wants)
