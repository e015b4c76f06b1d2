"""Matmul-like layers (``linear``, ``embedding``) and matmuls between activations.

A ``linear`` with a replicated input is a colwise candidate: it shards its weight on
out_features and its output on the last dim. A ``linear`` whose input arrives sharded on the
last dim is rowwise: it shards its weight on in_features and its output is ``Partial``; the
rewrite all_reduces it and then adds the bias (NOTE: [rowwise bias]). These are Megatron-LM's
column- and row-parallel linear layers (Shoeybi et al. 2019, section 3).

NOTE: [rowwise bias]
``y = x_r @ W_r.T`` summed over ranks is the full product; a bias added on every rank before the
sum would count ``world_size`` times. The rule returns the bias as ``after_reduce`` and drops it
from the local args; the rewrite adds it once after the all_reduce, so its gradient is the
single-device one.
"""

from __future__ import annotations

import torch

from fxtp.placement import REPLICATE, Partial, Shard
from passes.registry import Conflict, Decision, LayerNote, RuleContext, register_rule, shape_of
from passes.rules._common import activation_placement, ndim

__all__ = ["LAYER_WEIGHT_ARG"]

aten = torch.ops.aten

# Matmul-like layers and the position of their weight argument.
LAYER_WEIGHT_ARG = {aten.linear.default: 1, aten.embedding.default: 0}


def _arg(node, i, name, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


@register_rule(aten.linear.default)
def linear_rule(ctx: RuleContext) -> Decision:
    x, w = ctx.node.args[:2]
    b = _arg(ctx.node, 2, "bias")
    out_features, in_features = shape_of(w)
    px = ctx.placement(x)
    last = ndim(x) - 1
    state = ctx.layer()
    whole = {t: REPLICATE for t in (w, b) if t is not None}  # a replicated layer needs its full weight
    if isinstance(px, Shard) and px.dim < last:
        return Decision(px, whole, layer=LayerNote("replicate", f"input is sharded on dim {px.dim}, not on features"))
    if isinstance(px, Shard) and (state.demoted is not None or state.forced == "colwise"):
        # The user's plan wants this layer's input whole: keep the producers replicated.
        if state.demoted is not None:
            code, why = state.demoted.code or "user-plan", f"consumer stays replicated ({state.demoted.reason})"
        else:
            code, why = "user-plan", "the plan makes the consumer colwise"
        raise Conflict(code, f"{why}, so its input must be replicated", "drop the plan entry for the consumer")
    if isinstance(px, Shard) or state.forced == "rowwise":
        shard = px if isinstance(px, Shard) else Shard(last, (in_features,))
        if not shard.divisible(ctx.world_size):
            return Decision(REPLICATE, whole, layer=_not_divisible("in_features", in_features, ctx.world_size))
        wants = {w: Shard(1, shard.segments)}
        if not isinstance(px, Shard):
            wants[x] = shard
        reason = "all_reduce after it, bias added once after that"
        return Decision(Partial(), wants, local_args=(x, w), after_reduce=b, layer=LayerNote("rowwise", reason))
    if state.demoted is not None:
        return Decision(REPLICATE, whole, layer=state.demoted)
    segments = state.segments or (out_features,)
    if any(s % ctx.world_size for s in segments):
        return Decision(REPLICATE, whole, layer=_not_divisible("out_features", out_features, ctx.world_size))
    out = Shard(last, segments)
    wants = {w: Shard(0, segments)}
    if b is not None:
        wants[b] = Shard(0, segments)
    reason = "output stays sharded until a rowwise layer"
    if len(segments) > 1:
        reason += f"; fused output, each rank holds its block of every segment {list(segments)}"
    return Decision(out, wants, layer=LayerNote("colwise", reason))


def _not_divisible(what: str, size: int, ws: int) -> LayerNote:
    options = [d for d in range(2, min(size, 64) + 1) if size % d == 0][:4]
    hint = f"use world_size {' or '.join(map(str, options))}" if options else "use world_size 1"
    return LayerNote(
        "replicate",
        f"{what} {size} is not divisible by world_size {ws}",
        code="not-divisible",
        fix=f"{hint}, or pad {what} to a multiple of {ws}",
    )


@register_rule(aten.embedding.default)
def embedding_rule(ctx: RuleContext) -> Decision:
    """The table stays replicated; sharded indices (batch-like dims) keep their shard."""
    weight, indices = ctx.node.args[:2]
    if isinstance(ctx.placement(weight), Shard):
        raise Conflict("tied", "the embedding table is also used by a sharded layer", "keep the tied layer replicated")
    note = ctx.layer().demoted or LayerNote(
        "replicate",
        "vocab-parallel embedding is not supported yet",
        code="replicated-embedding",
        fix="none needed: a replicated lookup needs no communication",
    )
    p = ctx.placement(indices)
    return Decision(p if isinstance(p, Shard) else REPLICATE, {weight: REPLICATE}, layer=note)


@register_rule(aten.matmul.default, aten.bmm.default, aten.mm.default)
def matmul_rule(ctx: RuleContext) -> Decision:
    """``a @ b`` between activations: a shard on batch dims, rows of ``a`` or columns of ``b``
    flows to the output; a sharded contraction dim is refused (``contracts-sharded-dim``)."""
    a, b = ctx.node.args[:2]
    pa, pb = activation_placement(ctx, a), activation_placement(ctx, b)
    na, nb, nout = ndim(a), ndim(b), len(ctx.out_shape)
    if na < 2 or nb < 2:
        if isinstance(pa, Shard) or isinstance(pb, Shard):
            raise Conflict("unsupported-op", "matmul with a 1-D sharded operand", "keep the producer replicated")
        return Decision(REPLICATE)
    # Map each operand dim to an output dim (None for the contraction dim).
    amap = {d: d + nout - na for d in range(na - 1)}
    bmap = {d: d + nout - nb for d in range(nb - 2)}
    bmap[nb - 1] = nout - 1
    if isinstance(pa, Shard) and pa.dim == na - 1 or isinstance(pb, Shard) and pb.dim == nb - 2:
        # A Partial product would need an all_reduce of activations (e.g. attention scores):
        # dearer than keeping the producers replicated.
        raise Conflict("contracts-sharded-dim", "matmul contracts over the sharded dim", "keep the producing layers replicated")
    out = None
    for p, dmap in ((pa, amap), (pb, bmap)):
        if isinstance(p, Shard):
            if p.dim not in dmap:
                raise Conflict("layout-mismatch", "matmul contracts over a dim sharded on one side only", "keep the producer replicated")
            cand = Shard(dmap[p.dim], p.segments)
            if out is not None and cand != out:
                raise Conflict("layout-mismatch", f"matmul operands sharded as {out} and {cand}", "keep one producer replicated")
            out = cand
    if out is None:
        return Decision(REPLICATE)
    wants = {}
    for node, p, dmap, n in ((a, pa, amap, na), (b, pb, bmap, nb)):
        if isinstance(p, Shard):
            wants[node] = p
            continue
        inv = {o: d for d, o in dmap.items()}
        d = inv.get(out.dim)
        if d is not None and shape_of(node)[d] != 1:
            wants[node] = Shard(d, out.segments)
    return Decision(out, wants)
