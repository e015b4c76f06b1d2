"""Writes into a tensor. ``index_copy(self, dim, index, source)``: the rows of ``source`` written into ``self`` at
``index`` along ``dim`` (a static KV cache: ``cache.index_copy_(2, cache_position, k)``).

Sharded on another dim than ``dim`` (the cache's heads), each rank writes its slice: ``self``
and ``source`` take the same shard (a replicated one is sliced; a cache state is stored so,
NOTE: [sharded state] in ``passes/rules/variants.py``), ``index`` stays whole. Uneven shards
(heads split 2/2/1/1) and grouped ones (kv heads kept by every rank that reads them, NOTE: [grouped
shards]) pass as they are: nothing is computed along the sharded dim. Written
along its sharded dim, the positions would land on other ranks: refused.

Also here, the other writes into a fresh tensor: ``new_empty``/``new_zeros``/``new_ones``/``new_full`` and
``copy`` (the functional op of ``copy_``).

NOTE: [filled buffers]
Hugging Face's MLA attention (DeepSeek-V2/V3 ``expand_kv``) builds the key as a fresh tensor
filled by slices::

    key_states = kv_nope.new_empty(*kv_nope.shape[:-1], nope + rope)   # (B, heads, T, nope + rope)
    key_states[..., :nope].copy_(k_nope)                               # head-sharded after kv_b_proj
    key_states[..., nope:].copy_(k_rot)                                # one rope key for every head

Propagation runs forward, so the buffer's layout is fixed where it is made, before the copies
that fill it. A ``new_*`` tensor holds no data of its ``self`` (only its dtype and device), so it
may take any layout; it takes ``self``'s shard when its size on ``self``'s sharded dim is
``self``'s (the same heads): every rank makes its slice of the buffer (the size literal made
local), and a copy of the head-sharded value into a slice of it stays on the rank. Otherwise it
is replicated, as before. A shard of an uninitialized, zero, one or constant tensor is the slice
of the single device's, so either layout is exact; where a later op needs the buffer whole, that
op's rule refuses and the planner keeps the producing layer replicated, as for any other value.

``copy(self, src)`` returns ``src`` broadcast to ``self``'s shape: a shard of ``self`` is met by
the same shard of ``src`` (a replicated ``src`` is sliced; one broadcast along the sharded dim,
size 1 or missing, is used whole); a sharded ``src`` into a replicated ``self`` gives ``src``'s
shard. ``copy_`` is answered by this rule through NOTE: [mutated layout] in
``passes/rules/variants.py``: it writes in place only where ``self`` already has the result's
layout (a sharded value into a replicated buffer is a conflict there; a state buffer may be
stored sharded, NOTE: [sharded state]). DTensor (the fallback) has no strategy for ``copy``, and
its ``new_*`` strategies replicate unless the sizes are ``self``'s and fail on symbolic sizes.
"""

from __future__ import annotations

import torch

from fxtp.core.placement import REPLICATE, Replicate, Shard
from passes.registry import GATHER_INSTEAD, Conflict, Decision, RuleContext, overlap_ok, register_rule, shape_of, uneven_ok
from passes.rules._common import activation_placement, local_size, local_sizes, ndim, norm_dim

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
        raise Conflict("layout-mismatch", f"index_copy of {placements[1]} into {placements[0]}", GATHER_INSTEAD)
    if isinstance(ctx.placement(index), Shard):
        raise Conflict("unsupported-op", "index_copy with a sharded index", GATHER_INSTEAD)
    if shard.dim == dim:
        raise Conflict(
            "unsupported-op",
            f"index_copy along dim {dim}, the sharded dim: the written rows belong to other ranks",
            GATHER_INSTEAD,
        )
    return Decision(shard, wants={target: shard, source: shard})



@register_rule(aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default)
@overlap_ok
@uneven_ok
def new_tensor_rule(ctx: RuleContext) -> Decision:
    """``self.new_*(sizes, ...)``: ``self``'s shard when ``sizes`` keep its sharded dim (NOTE:
    [filled buffers]), the size literal made local; else replicated (global sizes; ``self`` is
    read for its dtype and device only)."""
    self_, sizes = ctx.node.args[0], list(ctx.node.args[1])
    p = ctx.placement(self_)
    if not isinstance(p, Shard) or p.overlaps or len(sizes) != ndim(self_):
        return Decision(REPLICATE)
    if not isinstance(sizes[p.dim], int) or sizes[p.dim] != shape_of(self_)[p.dim]:
        return Decision(REPLICATE)
    local = local_sizes(sizes, p.dim, local_size(p, ctx.world_size))
    return Decision(p, {self_: p}, local_args=(self_, local, *ctx.node.args[2:]))


@register_rule(aten.copy.default)
@overlap_ok
@uneven_ok
def copy_rule(ctx: RuleContext) -> Decision:
    """``copy(self, src, non_blocking)``: ``src`` broadcast to ``self``'s shape (NOTE: [filled
    buffers]). The result is ``self``'s shard if it has one, else ``src``'s (on ``self``'s dims)."""
    dst, src = ctx.node.args[0], ctx.node.args[1]
    lead = ndim(dst) - ndim(src)  # src's dim j is the result's dim j + lead (broadcasting)
    pd, ps = activation_placement(ctx, dst), activation_placement(ctx, src)
    if isinstance(pd, Shard):
        out = pd
    elif isinstance(ps, Shard):
        out = ps.with_dim(ps.dim + lead)
    else:
        return Decision(REPLICATE)
    wants = {dst: out}
    j = out.dim - lead
    if j >= 0 and shape_of(src)[j] != 1:  # src has the dim: it must hold the same rows
        if isinstance(ps, Shard) and ps != out.with_dim(j):
            raise Conflict("layout-mismatch", f"copy of {ps} into {pd}", GATHER_INSTEAD)
        wants[src] = out.with_dim(j)
    elif isinstance(ps, Shard):
        raise Conflict("layout-mismatch", f"copy of {ps} broadcast along the sharded dim {out.dim} of {pd}", GATHER_INSTEAD)
    return Decision(out, wants)
