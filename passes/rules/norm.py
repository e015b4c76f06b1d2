"""Norms, softmax and reductions: local unless they reduce over the sharded dim.

Over the sharded dim, a sum or a mean is a ``Partial`` value (each rank sums its own elements)
and a ``layer_norm``/``rms_norm`` becomes a distributed norm: the per-rank statistics are
summed over the ranks and each rank normalizes its own features (NOTE: [distributed norm] in
``fxtp/core/norms.py``). A softmax or another reduction over it raises ``reduces-sharded-dim``
and the planner keeps the producer replicated instead; a ``cross_entropy`` on logits sharded on
the classes is vocab-parallel (NOTE: [vocab-parallel cross entropy] in ``fxtp/core/losses.py``).
"""

from __future__ import annotations

import math

import torch
from torch.fx import Node

from fxtp.core import losses, norms
from fxtp.core.placement import REPLICATE, Partial, Shard
from passes.registry import (
    GATHER_INSTEAD,
    Conflict,
    Decision,
    GroupName,
    RuleContext,
    ShardStart,
    module_of,
    overlap_ok,
    register_rule,
    shape_of,
    uneven_ok,
)
from passes.rules._common import local_size, local_sizes, ndim, norm_dim
from passes.rules.matmul import layer_operands
from passes.rules.pointwise import POINTWISE_OPS

__all__: list[str] = []

aten = torch.ops.aten


def _reduces(ctx: RuleContext, what: str, dim: int) -> Conflict:
    return Conflict(
        "reduces-sharded-dim",
        f"{what} reduces over dim {dim}, which is sharded",
        f"none needed (the producing layer stays replicated); plan={{'{{layer}}': 'colwise'}} shards it and "
        f"all_gathers its output before the {what} at {module_of(ctx.node) or 'the root module'}",
    )


def _refuse_grouped(what: str, p: Shard) -> None:
    """NOTE: [grouped shards] in ``fxtp/core/placement.py``: units several ranks hold would be
    counted once per holder by summed statistics, so a norm or sum over that dim is refused."""
    if p.overlaps:
        raise Conflict(
            "reduces-sharded-dim",
            f"{what} over kv heads held by several ranks ({p}): their summed statistics would count a head once per holder",
            "use a world_size that divides the kv head count",
        )


# Ops through which normalized features reach their consumer unchanged in layout (NOTE: [norm
# into a layer]): elementwise ops and views.
_PASS_THROUGH = frozenset(POINTWISE_OPS) | {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.clone.default, aten.contiguous.default,
}

# NOTE: [norm into a layer]
# A distributed norm keeps the producing layer colwise. Where the normalized features go
# straight into another layer (through elementwise ops and views: Linear -> LayerNorm -> Linear,
# an MLA latent's kv_a -> RMSNorm -> kv_b), that layer would become rowwise: its all_reduce
# would come on top of the norm's, where keeping the producer replicated lets that layer be
# colwise with no collective at all (Megatron-LM's norms run on replicated values before a
# colwise layer). So the norm is refused there and the producer stays replicated. Where the
# features go on to a head view and attention (OLMo-2's q/k norm), no layer is gained by
# replicating the producer, and the norm is distributed.


def _layer_fed(ctx: RuleContext, start: Node) -> "Node | None":
    """The first layer whose input ``start``'s values reach through elementwise ops and views
    (NOTE: [norm into a layer]), or ``None``."""
    frontier, seen = [start], {start}
    for _ in range(8):
        nxt = []
        for node in frontier:
            for user in node.users:
                ops = layer_operands(user, ctx.is_param)
                if ops is not None and ops.x is node:
                    return user
                if user.op == "call_function" and user.target in _PASS_THROUGH and user not in seen:
                    seen.add(user)
                    nxt.append(user)
        frontier = nxt
    return None


def _into_layer(ctx: RuleContext, what: str, dim: int, layer: Node) -> Conflict:
    return Conflict(
        "reduces-sharded-dim",
        f"{what} over the sharded dim {dim} feeds the layer {module_of(layer) or layer.name}: a distributed norm would make "
        "that layer rowwise, its all_reduce on top of the norm's; with this layer replicated it is colwise, with none "
        "(NOTE: [norm into a layer])",
        GATHER_INSTEAD,
    )


def _static(node: Node, dims: list[int]) -> bool:
    """Are ``node``'s sizes along ``dims`` numbers (not dynamic)? A count baked into the rank graph must be."""
    return all(isinstance(node.meta["val"].shape[d], int) for d in dims)


@register_rule(aten.layer_norm.default, aten.rms_norm.default)
@overlap_ok
@uneven_ok
def norm_rule(ctx: RuleContext) -> Decision:
    """``layer_norm``/``rms_norm`` over the last ``len(normalized_shape)`` dims: local on a shard
    of another dim; over the sharded dim, a distributed norm with the weight and bias sliced
    like the features (NOTE: [distributed norm])."""
    x, normalized_shape = ctx.node.args[:2]
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    first = ndim(x) - len(normalized_shape)
    if p.dim < first:
        return Decision(p)
    _refuse_grouped(ctx.node.target.__name__, p)
    layer = _layer_fed(ctx, ctx.node)
    if layer is not None:
        raise _into_layer(ctx, ctx.node.target.__name__, p.dim, layer)
    rms = ctx.node.target is aten.rms_norm.default
    names = ("weight", "eps") if rms else ("weight", "bias", "eps")
    given = dict(zip(names, ctx.node.args[2:]), **ctx.node.kwargs)
    on_weight = Shard(p.dim - first, p.segments, p.unit)
    affine = [given.get("weight")] if rms else [given.get("weight"), given.get("bias")]
    wants = {x: p, **{t: on_weight for t in affine if isinstance(t, Node)}}
    local_shape = local_sizes(normalized_shape, p.dim - first, local_size(p, ctx.world_size))
    features = math.prod(shape_of(x)[first:])
    if rms:
        args = (x, local_shape, given.get("weight"), given.get("eps"), features, GroupName())
        return Decision(p, wants, local_args=args, local_target=norms.distributed_rms_norm)
    args = (x, local_shape, given.get("weight"), given.get("bias"), given.get("eps", 1e-5), features, GroupName())
    return Decision(p, wants, local_args=args, local_target=norms.distributed_layer_norm)


@register_rule(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
@overlap_ok
@uneven_ok
def softmax_rule(ctx: RuleContext) -> Decision:
    x, dim = ctx.node.args[:2]
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    if norm_dim(dim, ndim(x)) == p.dim:
        raise _reduces(ctx, "softmax", p.dim)
    return Decision(p)


@register_rule(
    aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.var.correction, aten.std.correction
)
@overlap_ok
@uneven_ok
def reduction_rule(ctx: RuleContext) -> Decision:
    """Reductions over a dim list; ``keepdim`` decides whether the sharded dim moves. A sum or
    a mean over the sharded dim is ``Partial`` (NOTE: [distributed norm])."""
    x = ctx.node.args[0]
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    nd = ndim(x)
    dims = ctx.node.args[1] if len(ctx.node.args) > 1 else ctx.node.kwargs.get("dim")
    dims = list(range(nd)) if dims is None or dims == [] else [norm_dim(d, nd) for d in dims]
    keepdim = len(ctx.out_shape) == nd
    if p.dim in dims:
        return _partial_sum(ctx, x, p, dims, keepdim)
    return Decision(p if keepdim else p.with_dim(p.dim - sum(d < p.dim for d in dims)))


def _partial_sum(ctx: RuleContext, x: Node, p: Shard, dims: list[int], keepdim: bool) -> Decision:
    """A float sum (or mean) over ``dims``, the sharded dim among them: each rank's sum of its
    own elements (a mean's divided by the global count) is a summand of the result."""
    target = ctx.node.target
    means = (aten.mean.dim, aten.mean.default)
    sums = (aten.sum.dim_IntList, aten.sum.default)
    if target not in means + sums or not ctx.node.meta["val"].is_floating_point():
        raise _reduces(ctx, str(target.__name__), p.dim)
    _refuse_grouped(target.__name__, p)
    layer = _layer_fed(ctx, ctx.node)
    if layer is not None:
        raise _into_layer(ctx, target.__name__, p.dim, layer)
    if target in sums:
        return Decision(Partial(), {x: p})
    if not _static(x, dims):
        raise Conflict(
            "reduces-sharded-dim",
            f"{target.__name__} over the sharded dim {p.dim} and a dynamic dim: the count it divides by changes with the input",
            f"compile with dynamic=False, or take the mean over dim {p.dim} alone at {{line}}",
        )
    count = math.prod(shape_of(x)[d] for d in dims)
    return Decision(Partial(), {x: p}, local_args=(x, dims, keepdim, count), local_target=norms.mean_of_shard)


@register_rule(aten.sum.default, aten.mean.default, aten.nll_loss_nd.default)
@uneven_ok
def full_reduction_rule(ctx: RuleContext) -> Decision:
    """Reductions to a scalar: a sum or mean of a shard is ``Partial``; ``nll_loss`` over
    sharded classes is refused (a ``cross_entropy`` is vocab-parallel instead)."""
    x = ctx.node.args[0]
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    return _partial_sum(ctx, x, p, list(range(ndim(x))), False)


@register_rule(aten.cross_entropy_loss.default)
@uneven_ok
def cross_entropy_rule(ctx: RuleContext) -> Decision:
    """``cross_entropy(logits (N, C), target (N,), weight, reduction, ignore_index,
    label_smoothing)`` on logits sharded on the class dim (a colwise head's) is Megatron's
    vocab-parallel cross entropy: three all_reduce of (N,) instead of a gather of the logits,
    the class weights sliced like the classes (NOTE: [vocab-parallel cross entropy])."""
    logits, target = ctx.node.args[:2]
    p = ctx.placement(logits)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    given = dict(zip(names, ctx.node.args[2:]), **ctx.node.kwargs)
    if ndim(logits) != 2 or p.dim != 1 or len(p.segments) != 1 or isinstance(ctx.placement(target), Shard):
        raise Conflict(
            "reduces-sharded-dim",
            f"cross_entropy over sharded classes is vocab-parallel for (N, C) logits and (N,) class ids only; these "
            f"logits are {list(shape_of(logits))}, sharded as {p}",
            "flatten the logits to (N, C) and the targets to (N,) before the loss at {line} "
            "(logits.flatten(0, -2), as Hugging Face's losses do)",
        )
    weight = given.get("weight")
    wants = {logits: p, **({weight: Shard(0, p.segments, p.unit)} if isinstance(weight, Node) else {})}
    args = (
        logits, target, ShardStart(logits), shape_of(logits)[1], module_of(ctx.node), given.get("reduction", 1),
        given.get("ignore_index", -100), GroupName(), weight, given.get("label_smoothing", 0.0),
    )
    return Decision(REPLICATE, wants, local_args=args, local_target=losses.vocab_parallel_cross_entropy)
