"""``index_copy(self, dim, index, source)``: the rows of ``source`` written into ``self`` at
``index`` along ``dim`` (a static KV cache: ``cache.index_copy_(2, cache_position, k)``).

Sharded on another dim than ``dim`` (the cache's heads), each rank writes its slice: ``self``
and ``source`` take the same shard (a replicated one is sliced; a cache state is stored so,
NOTE: [sharded state] in ``passes/rules/variants.py``), ``index`` stays whole. Uneven shards
(heads split 2/2/1/1) and grouped ones (kv heads kept by every rank that reads them, NOTE: [grouped
shards]) pass as they are: nothing is computed along the sharded dim. Written
along its sharded dim, the positions would land on other ranks: refused.
"""

from __future__ import annotations

import torch

from fxtp.core.placement import REPLICATE, Replicate, Shard
from passes.registry import Conflict, Decision, RuleContext, overlap_ok, register_rule, uneven_ok
from passes.rules._common import ndim, norm_dim

__all__: list[str] = []

aten = torch.ops.aten


@register_rule(aten.index_copy.default)
@overlap_ok
@uneven_ok
def index_copy_rule(ctx: RuleContext) -> Decision:
    target, dim, index, source = ctx.node.args[:4]
    dim = norm_dim(dim, ndim(target))
    placements = [ctx.placement(target), ctx.placement(source)]
    shards = [p for p in placements if isinstance(p, Shard)]
    if not shards:
        return Decision(REPLICATE)
    shard = shards[0]
    if any(not isinstance(p, Replicate) and p != shard for p in placements):
        raise Conflict("layout-mismatch", f"index_copy of {placements[1]} into {placements[0]}", "keep the producers replicated")
    if isinstance(ctx.placement(index), Shard):
        raise Conflict("unsupported-op", "index_copy with a sharded index", "keep the index's producer replicated")
    if shard.dim == dim:
        raise Conflict(
            "unsupported-op",
            f"index_copy along dim {dim}, the sharded dim: the written rows belong to other ranks",
            "keep the producing layer replicated",
        )
    return Decision(shard, wants={target: shard, source: shard})
