"""Norms, softmax and reductions: local unless they reduce over the sharded dim.

Reducing over the sharded dim would need a collective (or distributed statistics); the rule
raises ``reduces-sharded-dim`` and the planner keeps the producer replicated instead.
"""

from __future__ import annotations

import torch

from fxtp.core import local_ops
from fxtp.core.placement import REPLICATE, Shard
from passes.registry import Conflict, Decision, GroupName, RuleContext, ShardStart, module_of, register_rule, shape_of, overlap_ok, uneven_ok
from passes.rules._common import ndim, norm_dim

__all__: list[str] = []

aten = torch.ops.aten


def _reduces(ctx: RuleContext, what: str, dim: int) -> Conflict:
    return Conflict(
        "reduces-sharded-dim",
        f"{what} reduces over dim {dim}, which is sharded",
        "keep the producing layer replicated (fxtp does this by itself), or reorder the norm",
    )


@register_rule(aten.layer_norm.default, aten.rms_norm.default)
@overlap_ok
@uneven_ok
def norm_rule(ctx: RuleContext) -> Decision:
    """``layer_norm``/``rms_norm`` over the last ``len(normalized_shape)`` dims."""
    x, normalized_shape = ctx.node.args[:2]
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    if p.dim >= ndim(x) - len(normalized_shape):
        raise _reduces(ctx, str(ctx.node.target.__name__), p.dim)
    return Decision(p)


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
    """Reductions over a dim list; ``keepdim`` decides whether the sharded dim moves."""
    x = ctx.node.args[0]
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    nd = ndim(x)
    dims = ctx.node.args[1] if len(ctx.node.args) > 1 else ctx.node.kwargs.get("dim")
    dims = list(range(nd)) if dims is None or dims == [] else [norm_dim(d, nd) for d in dims]
    keepdim = len(ctx.out_shape) == nd
    if p.dim in dims:
        raise _reduces(ctx, str(ctx.node.target.__name__), p.dim)
    return Decision(p if keepdim else p.with_dim(p.dim - sum(d < p.dim for d in dims)))


@register_rule(aten.sum.default, aten.mean.default, aten.nll_loss_nd.default)
@uneven_ok
def full_reduction_rule(ctx: RuleContext) -> Decision:
    """Reductions to a scalar (or over the class dim: ``nll_loss``). A sharded input is refused."""
    p = ctx.placement(ctx.node.args[0])
    if isinstance(p, Shard):
        raise _reduces(ctx, str(ctx.node.target.__name__), p.dim)
    return Decision(REPLICATE)


@register_rule(aten.cross_entropy_loss.default)
@uneven_ok
def cross_entropy_rule(ctx: RuleContext) -> Decision:
    """``cross_entropy(logits (N, C), target (N,))`` on logits sharded on the class dim (a colwise
    head's) is Megatron's vocab-parallel cross entropy: three all_reduce of (N,) instead of a
    gather of the logits (NOTE: [vocab-parallel cross entropy] in ``fxtp/core/local_ops.py``).
    Class weights, label smoothing and extra dims are refused on a sharded input."""
    logits, target = ctx.node.args[:2]
    p = ctx.placement(logits)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    given = dict(zip(names, ctx.node.args[2:]), **ctx.node.kwargs)
    if ndim(logits) != 2 or p.dim != 1 or len(p.segments) != 1 or isinstance(ctx.placement(target), Shard):
        raise _reduces(ctx, "cross_entropy_loss", p.dim)
    if given.get("weight") is not None or given.get("label_smoothing", 0.0) != 0.0:
        raise Conflict(
            "reduces-sharded-dim",
            "cross_entropy with class weights or label smoothing over sharded classes is not vocab-parallel in fxtp",
            "none needed (the head stays replicated); drop weight=/label_smoothing= to keep it colwise",
        )
    args = (logits, target, ShardStart(logits), shape_of(logits)[1], module_of(ctx.node), given.get("reduction", 1), given.get("ignore_index", -100), GroupName())
    return Decision(REPLICATE, {logits: p}, local_args=args, local_target=local_ops.vocab_parallel_cross_entropy)
