"""``scaled_dot_product_attention``: shards on batch or head dims only.

q, k, v are ``(..., heads, seq, head_dim)``. Any dim before the last two may be sharded, the
same one in q, k and v, so every rank attends with whole heads. Sharding seq or head_dim is
refused: it would split inside an attention head. The keywords ``scale`` and ``is_causal`` act
within a head and pass through unchanged.

NOTE: [enable_gqa]
With ``enable_gqa=True`` and ``Hkv`` kv heads for ``Hq`` query heads, query head ``h`` attends
with kv head ``h // (Hq / Hkv)`` (``repeat_interleave`` semantics). When both head counts are
sharded in the same number of segments with the same ratio, every rank's local call pairs its
query heads with its own kv heads. When ``Hkv`` does not divide by world_size, k and v stay
whole (replicated) and each rank gathers the kv heads its query heads use
(``fxtp.core.local_ops.grouped_query_attention``): at 8 query heads, 2 kv heads and world_size 4,
ranks 0 and 1 use kv head 0, ranks 2 and 3 kv head 1, as the ``expand`` form of GQA does by
slicing the repeated heads.

With the kv heads as a grouped shard (NOTE: [grouped shards] in ``fxtp/core/placement.py``:
each rank holds the kv heads its query heads read), the query sharded on its heads in whole
heads (even or front-loaded), each rank pairs them locally
(``fxtp.core.local_ops.grouped_query_attention_local_kv``): 28 query heads, 4 kv heads at
world_size 8 attend on every rank with 1 or 2 kv heads of its own.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from fxtp.core import local_ops
from fxtp.core.placement import Shard
from passes.registry import Conflict, Decision, RuleContext, ShardStart, overlap_ok, register_rule, shape_of, uneven_ok
from passes.rules._common import ndim

__all__: list[str] = []

aten = torch.ops.aten


@register_rule(aten.scaled_dot_product_attention.default)
@overlap_ok
@uneven_ok
def sdpa_rule(ctx: RuleContext) -> Decision:
    q, k, v = ctx.node.args[:3]
    mask = ctx.node.args[3] if len(ctx.node.args) > 3 else ctx.node.kwargs.get("attn_mask")
    gqa = bool(ctx.node.kwargs.get("enable_gqa", False))
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
    group = shape_of(q)[dim] // shape_of(k)[dim] if gqa and dim == nd - 3 else 1
    if any(p.overlaps for p in shards.values()):
        return _grouped_kv_heads(ctx, q, k, v, shards, group, mask, dim, nd)
    if group > 1 and q in shards and k not in shards and v not in shards and not _heads_divide(k, dim, nseg, ctx.world_size):
        return _gathered_kv_heads(ctx, q, placements[q], group, mask, dim, nd)
    uneven = [p for p in shards.values() if not p.divisible(ctx.world_size)]
    if uneven and (len(shards) != 3 or len(set(shards.values())) != 1 or group != 1):
        raise Conflict(  # NOTE: [uneven shards]: q, k and v must hold the same heads
            "not-divisible",
            f"attention with heads split unevenly ({uneven[0]}) at world_size {ctx.world_size} needs q, k and v sharded alike",
            "use a world_size that divides the head count, or keep the producers replicated",
        )
    if group > 1 and q in shards and any(
        t in shards and [s * group for s in shards[t].segments] != list(shards[q].segments) for t in (k, v)
    ):
        raise Conflict(
            "layout-mismatch",
            f"q and k/v heads sharded in different groups (enable_gqa, {group} q heads per kv head)",
            "keep the producers replicated",
        )
    wants: dict = dict(shards)
    for t in (q, k, v):
        if t not in shards:
            size = shape_of(t)[dim]
            if size == 1 and not gqa:
                continue  # broadcast over the heads (or batch): used whole
            if q in shards and t is not q and size == shape_of(q)[dim]:
                wants[t] = shards[q]  # repeated kv heads, sliced to the query's heads (even or not)
                continue
            if size % nseg or (size // nseg) % ctx.world_size:
                raise Conflict("not-divisible", f"{size} heads of an unsharded attention input at world_size {ctx.world_size}", "keep the producers replicated")
            wants[t] = Shard(dim, (size // nseg,) * nseg)
    _want_mask(ctx, mask, dim, nd, placements[q] if q in shards else wants[q], wants)
    out = placements[q] if q in shards else wants[q]
    return Decision(out, wants)


def _heads_divide(t: Node, dim: int, nseg: int, ws: int) -> bool:
    size = shape_of(t)[dim]
    return size % nseg == 0 and (size // nseg) % ws == 0


def _want_mask(ctx: RuleContext, mask, dim: int, nd: int, q_shard: Shard, wants: dict) -> None:
    if mask is None:
        return
    mdim = dim - (nd - ndim(mask))
    if isinstance(ctx.placement(mask), Shard):
        raise Conflict("layout-mismatch", "sharded attention mask", "keep the mask's producer replicated")
    if mdim >= 0 and shape_of(mask)[mdim] != 1:
        wants[mask] = q_shard.with_dim(mdim)


def _gathered_kv_heads(ctx: RuleContext, q: Node, pq: Shard, group: int, mask, dim: int, nd: int) -> Decision:
    """NOTE: [enable_gqa]: k and v whole, each rank gathers the kv heads its query heads use."""
    if len(pq.segments) != 1:
        raise Conflict("layout-mismatch", "enable_gqa with fused query segments and whole k/v", "keep the producers replicated")
    wants: dict = {q: pq}
    _want_mask(ctx, mask, dim, nd, pq, wants)
    args = (ShardStart(q), group, *ctx.node.args)
    return Decision(pq, wants, local_args=args, local_target=local_ops.grouped_query_attention)


def _grouped_kv_heads(ctx: RuleContext, q: Node, k: Node, v: Node, shards: dict, group: int, mask, dim: int, nd: int) -> Decision:
    """NOTE: [enable_gqa] with k and v as grouped shards: each rank attends with its own kv heads."""
    pq, pk = shards.get(q), shards.get(k)
    fits = (
        isinstance(pq, Shard) and not pq.overlaps and len(pq.segments) == 1 and pq.unit == 1 and pq.dim == dim == nd - 3
        and isinstance(pk, Shard) and shards.get(v) == pk and pk.groups == (group,) and pk.unit == 1 and pk.dim == dim
        and pk.size * group == pq.size
    )
    if not fits:
        raise Conflict(
            "layout-mismatch",
            f"attention with kv heads held by the ranks that read them needs enable_gqa, q sharded on its heads and "
            f"k, v alike (q {pq}, k {pk}, v {shards.get(v)})",
            "keep the kv projections replicated",
        )
    wants: dict = {q: pq, k: pk, v: pk}
    _want_mask(ctx, mask, dim, nd, pq, wants)
    args = (ShardStart(q), group, *ctx.node.args)
    return Decision(pq, wants, local_args=args, local_target=local_ops.grouped_query_attention_local_kv)
