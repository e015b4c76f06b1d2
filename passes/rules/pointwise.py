"""Elementwise ops with broadcasting: a shard flows through unchanged; metadata reads.

A replicated operand that is broadcast along the sharded dim (size 1, or fewer dims) is used as
is; one that has the full size there is sliced locally to the same shard. Two sharded operands
must agree on dim and segments.
"""

from __future__ import annotations

import operator

import torch

from fxtp.core import rng
from fxtp.core.placement import REPLICATE, Placement, Shard
from passes.registry import GATHER_INSTEAD, Conflict, Decision, RuleContext, overlap_ok, register_rule, shape_of, uneven_ok
from passes.rules._common import activation_placement, ndim, norm_dim, tensor_inputs

__all__ = ["broadcast_rule", "SAME_ON_EVERY_RANK"]

aten = torch.ops.aten

_POINTWISE_NAMES = sorted(
    """
    abs.default add.Tensor add.Scalar sub.Tensor sub.Scalar rsub.Scalar rsub.Tensor mul.Tensor
    mul.Scalar div.Tensor div.Scalar div.Tensor_mode neg.default reciprocal.default
    relu.default gelu.default silu.default sigmoid.default tanh.default exp.default log.default
    sqrt.default rsqrt.default pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar erf.default
    sin.default cos.default clamp.default clamp_min.default clamp_max.default maximum.default
    minimum.default eq.Tensor eq.Scalar ne.Tensor ne.Scalar gt.Tensor gt.Scalar lt.Tensor
    lt.Scalar ge.Tensor ge.Scalar le.Tensor le.Scalar logical_not.default logical_and.default
    logical_or.default bitwise_not.default where.self where.ScalarOther where.ScalarSelf where.Scalar
    masked_fill.Scalar masked_fill.Tensor
    dropout.default alpha_dropout.default feature_dropout.default to.dtype to.dtype_layout
    to.device _to_copy.default type_as.default contiguous.default clone.default alias.default
    detach.default lift_fresh_copy.default leaky_relu.default hardtanh.default elu.default
    softplus.default mish.default hardswish.default hardsigmoid.default tanh_backward.default
    """.split()
)


def _overload(name: str) -> "torch._ops.OpOverload | None":
    packet, _, overload = name.partition(".")
    return getattr(getattr(aten, packet, None), overload, None)


POINTWISE_OPS = tuple(op for op in map(_overload, _POINTWISE_NAMES) if op is not None)


@register_rule(*POINTWISE_OPS)
@overlap_ok
@uneven_ok
def broadcast_rule(ctx: RuleContext) -> Decision:
    """Output shard = the activations' common shard, aligned from the right (broadcasting).

    Parameters follow the activations (``activation_placement``): a parameter is sharded
    because an activation it meets is, never on its own.
    """
    out_nd = len(ctx.out_shape)
    placements = {a: activation_placement(ctx, a) for a in tensor_inputs(ctx.node)}
    out: "Shard | None" = None
    for a, p in placements.items():
        if not isinstance(p, Shard):
            continue
        aligned = p.with_dim(p.dim + out_nd - ndim(a))
        if out is None:
            out = aligned
        elif aligned != out:
            raise Conflict(
                "layout-mismatch",
                f"operands of {ctx.node.target} are sharded differently ({out} vs {aligned})",
                GATHER_INSTEAD,
            )
    if out is None:
        return Decision(REPLICATE)
    if out.overlaps and rng.is_random(ctx.node.target, ctx.node.args, ctx.node.kwargs):
        raise Conflict(  # the holders of a kv head would need one mask: not drawn so (NOTE: [grouped shards])
            "dropout-on-shard",
            f"{ctx.node.target} draws on kv heads held by several ranks ({out})",
            "drop the dropout on k/v, or use a world_size that divides the kv head count",
        )
    wants: dict = {}
    for a, p in placements.items():
        if isinstance(p, Shard):
            wants[a] = p
            continue
        dim = out.dim - (out_nd - ndim(a))
        if dim >= 0 and shape_of(a)[dim] != 1:
            wants[a] = out.with_dim(dim)
    return Decision(out, wants)


@register_rule(aten.native_dropout.default)
def native_dropout_rule(ctx: RuleContext) -> Decision:
    """``(out, mask)``: both keep the input's placement."""
    p: Placement = ctx.placement(ctx.node.args[0])
    return Decision((p, p))


@register_rule(operator.getitem)
@overlap_ok
@uneven_ok
def getitem_rule(ctx: RuleContext) -> Decision:
    """An element of a multi-output node keeps that output's placement (recorded by the producer)."""
    source, index = ctx.node.args
    return Decision(ctx.tuple_placement(source)[index])


# Metadata reads: a shard has the device, dtype, layout and ``requires_grad`` of the whole
# tensor, and the sizes of its unsharded dims; reading them does not depend on how (or how
# unevenly, NOTE: [uneven shards]) the tensor is split, so these reads never block a shard.
# Only the size of the sharded dim differs between ranks: a ``sym_size`` of it is refused (a
# sharded dim is static, ``passes/dynamic.py``, so a capture with that dim static holds the
# number instead). ``getattr(p_word_embeddings_weight, 'device')`` is what ``passes/normalize.py``
# inserts for device literals; BERT-large's uneven vocabulary at world_size 8 reaches it, and so
# do kv heads several ranks hold (NOTE: [grouped shards]: Falcon's fused query_key_value).
# Tensor attributes a shard shares with the whole tensor.
SAME_ON_EVERY_RANK = frozenset(
    {"device", "dtype", "layout", "requires_grad", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "ndim"}
)


@register_rule(aten._assert_tensor_metadata.default)
@uneven_ok
def assert_metadata_rule(ctx: RuleContext) -> Decision:
    """Export's ``.to()`` checks (dtype, device, layout): the same on every shard."""
    return Decision(REPLICATE)


@register_rule(getattr)
@overlap_ok
@uneven_ok
def getattr_rule(ctx: RuleContext) -> Decision:
    """``getattr(x, name)`` of an attribute in :data:`SAME_ON_EVERY_RANK`.

    Raises:
        Conflict: ``unsupported-op`` for another attribute of a sharded tensor (its shape).
    """
    x, name = ctx.node.args[:2]
    if name in SAME_ON_EVERY_RANK or not isinstance(ctx.placement(x), Shard):
        return Decision(REPLICATE)
    raise Conflict(
        "unsupported-op",
        f"getattr(x, {name!r}) of a sharded tensor may read the rank's shard, not the whole tensor",
        f"read .{name} of a replicated value (e.g. before the projection) at {{line}}",
    )


@register_rule(aten.sym_size.int)
@uneven_ok
def sym_size_rule(ctx: RuleContext) -> Decision:
    """``x.shape[d]`` (a dynamic dim's size): the same on every rank unless ``d`` is sharded.

    Raises:
        Conflict: ``unsupported-op`` when ``d`` is the sharded dim.
    """
    x, dim = ctx.node.args[:2]
    p = ctx.placement(x)
    if not isinstance(p, Shard) or norm_dim(dim, ndim(x)) != p.dim:
        return Decision(REPLICATE)
    raise Conflict(
        "unsupported-op",
        f"the size of dim {dim}, which is sharded, is read as a dynamic size: a rank would read its shard's size",
        "compile with dynamic=False (the sharded dim's size is then a number)",
    )
