"""``repeat_interleave(x, repeats: int, dim)``: every element repeated ``repeats`` times.

Grouped-query attention broadcasts its kv heads this way (``k.repeat_interleave(n, dim=1)``,
neuronx-nemo-megatron, tpu-inference). Input index ``i`` becomes outputs ``[i*n, (i+1)*n)``, so
a rank's block of the input dim becomes its block of the output dim: a segment ``s`` becomes a
segment ``s*n`` (NOTE: [segments]) and the op runs locally; a global ``output_size`` is
dropped (``fxtp.core.local_ops.repeat_interleave``). A shard on another dim flows through. Tensor ``repeats`` (``self_Tensor``) are not handled here.

On kv heads held as a grouped shard (NOTE: [grouped shards] in ``fxtp/core/placement.py``) the
repeat, and Hugging Face's ``repeat_kv`` (expand + reshape, the view rule asks here), give each
rank its query heads' kv heads: NOTE: [repeated kv heads] below.
"""

from __future__ import annotations

import torch

from fxtp.core import local_ops
from fxtp.core.placement import REPLICATE, Shard
from passes.registry import Conflict, Decision, RuleContext, ShardStart, overlap_ok, register_rule, uneven_ok
from passes.rules._common import local_size, ndim, norm_dim

__all__ = ["repeats_kv_heads", "repeat_kv_decision"]

aten = torch.ops.aten


# NOTE: [repeated kv heads]
# Hugging Face's ``repeat_kv`` (``x[:, :, None].expand(B, Hkv, g, S, E).reshape(B, Hkv * g, S, E)``)
# and ``x.repeat_interleave(g, dim=1)`` give query head ``h`` kv head ``h // g``. On kv heads held
# as a grouped shard (NOTE: [grouped shards] in fxtp/core/placement.py) rank ``r`` holds kv heads
# ``[q0 // g, ...)`` for its query heads ``[q0, q0 + n)``: the repetition of its kv heads starts at
# query head ``(q0 // g) * g``, so it keeps ``n`` heads from ``q0 % g`` on
# (``local_ops.repeat_kv_heads``, a per-rank start, not a uniform repeat). The result is a plain
# shard of the query heads, the query's own layout.


def repeats_kv_heads(p: Shard, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> bool:
    """``(.., Hkv, g, ..) -> (.., Hkv * g, ..)`` merging the grouped dim with its group."""
    d = p.dim
    return (
        len(p.segments) == 1 and p.unit == 1 and d + 1 < len(in_shape) and in_shape[d + 1] == p.groups[0]
        and tuple(out_shape) == (*in_shape[:d], in_shape[d] * in_shape[d + 1], *in_shape[d + 2:])
    )


def repeat_kv_decision(ctx: RuleContext, x, p: Shard, *, merged: bool) -> Decision:
    """NOTE: [repeated kv heads]: the query heads' layout, each rank's start filled in."""
    out = Shard(p.dim, (p.size * p.groups[0],))
    args = (x, p.dim, ShardStart(ctx.node), local_size(out, ctx.world_size), p.groups[0], merged)
    return Decision(out, local_args=args, local_target=local_ops.repeat_kv_heads)


@register_rule(aten.repeat_interleave.self_int)
@overlap_ok
@uneven_ok
def repeat_interleave_rule(ctx: RuleContext) -> Decision:
    args = list(ctx.node.args) + [None] * (4 - len(ctx.node.args))
    x, repeats = args[0], args[1]
    dim = args[2] if args[2] is not None else ctx.node.kwargs.get("dim")
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    if dim is None:
        raise Conflict("view-crosses-shard", "repeat_interleave without dim flattens the sharded input", "keep the producing layer replicated")
    if norm_dim(dim, ndim(x)) != p.dim:
        return Decision(p)
    if p.overlaps and len(p.segments) == 1 and p.unit == 1 and repeats == p.groups[0]:
        return repeat_kv_decision(ctx, x, p, merged=False)  # NOTE: [repeated kv heads]
    if not p.divisible(ctx.world_size):
        raise Conflict(
            "not-divisible",
            f"repeat_interleave({repeats}) of heads split unevenly ({p}) at world_size {ctx.world_size}",
            "use a world_size that divides the kv head count, or keep the producing layer replicated",
        )
    out = Shard(p.dim, tuple(s * repeats for s in p.segments))
    if args[3] is None and "output_size" not in ctx.node.kwargs:
        return Decision(out)
    # output_size (export passes it as a keyword) is the global size: run without it.
    return Decision(out, local_args=(x, repeats, dim), local_target=local_ops.repeat_interleave)
