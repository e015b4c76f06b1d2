"""Matmul-like layers and matmuls between activations.

A layer is a ``linear``, an ``addmm``/``mm``/``matmul`` whose right operand is a parameter or
its transpose (GPT-2's ``Conv1D``, ``x @ W.T``), or an ``embedding``. A layer with a replicated input is a colwise candidate: it shards its weight on
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

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.fx import Node

from fxtp.core import local_ops
from fxtp.core.placement import REPLICATE, Partial, Shard, local_ranges
from passes.registry import (
    GATHER_INSTEAD,
    WHOLE_KV_HEADS,
    Conflict,
    Decision,
    LayerNote,
    RuleContext,
    ShardStart,
    module_of,
    overlap_ok,
    register_rule,
    shape_of,
    uneven_ok,
)
from passes.rules._common import activation_placement, ndim
from passes.rules.experts import batched_operands, experts_layer, grouped_operands

__all__ = ["LayerOperands", "layer_operands", "layer_weight"]

aten = torch.ops.aten


def _arg(node, i, name, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


@dataclass(frozen=True)
class LayerOperands:
    """The operands of a matmul-like layer, whatever op computes it.

    ``weight`` is the operand as the op sees it: ``(out, in)`` for ``linear`` (``out_dim=0``),
    ``(in, out)`` for ``x @ W`` / ``addmm(b, x, W)`` (``out_dim=1``; GPT-2's ``Conv1D``, or a
    parameter's ``.T``), ``(experts, in, out)`` for a grouped matmul of MoE experts
    (``out_dim=2``, ``rules/experts.py``), ``(pairs, out, in)`` or ``(pairs, in, out)`` for a
    batched one (``out_dim`` 1 or 2). ``bias`` has shape ``(out,)``.
    """

    x: Node
    weight: Node
    bias: Optional[Node]
    out_dim: int


def layer_operands(node: Node, is_param: Callable[[Node], bool]) -> Optional[LayerOperands]:
    """The layer operands of ``node`` if it is a matmul-like layer with a 2-D parameter weight
    (``linear``; ``addmm``/``mm``/``matmul`` whose right operand is a parameter or its
    transpose) or a grouped or batched matmul with a 3-D expert weight, else ``None``. Embeddings are layers too, see :func:`layer_weight`."""
    if node.op != "call_function":
        return None
    if node.target is aten.linear.default:
        return LayerOperands(node.args[0], node.args[1], _arg(node, 2, "bias"), 0)
    if node.target is aten.addmm.default:
        b, x, w = node.args[:3]
        plain = node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1
        if plain and isinstance(w, Node) and is_param(w) and isinstance(b, Node) and ndim(b) == 1:
            return LayerOperands(x, w, b, 1)
        return None
    if node.target in (aten.mm.default, aten.matmul.default):
        x, w = node.args[:2]
        if isinstance(w, Node) and is_param(w) and ndim(w) == 2 and ndim(x) >= 2:
            return LayerOperands(x, w, None, 1)
    grouped = grouped_operands(node, is_param)
    if grouped is not None:
        return LayerOperands(grouped.x, grouped.weight, None, 2)
    batched = batched_operands(node, is_param)
    if batched is not None:
        return LayerOperands(batched.x, batched.weight, None, batched.dims.n)
    return None


def layer_weight(node: Node, is_param: Callable[[Node], bool]) -> Optional[Node]:
    """The weight operand of a matmul-like layer (``linear``, ``addmm``/``mm``/``matmul`` with
    a parameter, ``embedding``), or ``None`` if ``node`` is not one."""
    if node.op == "call_function" and node.target is aten.embedding.default:
        return node.args[0]
    ops = layer_operands(node, is_param)
    return ops.weight if ops is not None else None


@register_rule(aten.linear.default)
@overlap_ok
@uneven_ok
def linear_rule(ctx: RuleContext) -> Decision:
    ops = layer_operands(ctx.node, ctx.is_param)
    assert ops is not None
    return _layer_rule(ctx, ops)


@register_rule(aten.addmm.default)
@overlap_ok
@uneven_ok
def addmm_rule(ctx: RuleContext) -> Decision:
    """GPT-2's ``Conv1D``: ``addmm(bias, x, W)`` with ``W`` of shape ``(in, out)``."""
    ops = layer_operands(ctx.node, ctx.is_param)
    if ops is None:  # no parameter: a matmul between activations plus a term
        b, x, w = ctx.node.args[:3]
        if any(isinstance(ctx.placement(a), Shard) for a in (b, x, w)):
            raise Conflict("unsupported-op", "addmm of activations with a sharded operand", GATHER_INSTEAD)
        return Decision(REPLICATE)
    return _layer_rule(ctx, ops)


def _layer_rule(ctx: RuleContext, ops: LayerOperands) -> Decision:
    x, w, b = ops.x, ops.weight, ops.bias
    in_dim = 1 - ops.out_dim
    out_features, in_features = shape_of(w)[ops.out_dim], shape_of(w)[in_dim]
    px = ctx.placement(x)
    last = ndim(x) - 1
    state = ctx.layer()
    whole = {t: REPLICATE for t in (w, b) if t is not None}  # a replicated layer needs its full weight
    if isinstance(px, Shard) and px.dim < last:
        return Decision(px, whole, layer=_on_other_dim(f"input is sharded on dim {px.dim}, not on features"))
    if isinstance(px, Shard) and state.whole_input is not None and state.demoted is None:
        note = state.whole_input  # NOTE: [tied uses] in passes/plan.py
        raise Conflict(note.code or "tied", note.reason, note.fix or "untie the weights")
    if isinstance(px, Shard) and (state.demoted is not None or state.forced == "colwise"):
        # The user's plan wants this layer's input whole: keep the producers replicated.
        if state.demoted is not None:
            code, why = state.demoted.code or "user-plan", f"consumer stays replicated ({state.demoted.reason})"
        else:
            code, why = "user-plan", "the plan makes the consumer colwise"
        raise Conflict(code, f"{why}, so its input must be replicated", "drop the plan entry for the consumer")
    if isinstance(px, Shard) and px.overlaps:
        raise Conflict(  # NOTE: [grouped shards]: the holders of a kv head would each add its part
            "contracts-sharded-dim",
            f"a layer contracts over kv heads held by several ranks ({px})",
            WHOLE_KV_HEADS,
        )
    if isinstance(px, Shard) or state.forced == "rowwise" or state.slice_input and state.demoted is None:
        shard = px if isinstance(px, Shard) else Shard(last, (in_features,))
        if not isinstance(px, Shard) and in_features < ctx.world_size:
            return Decision(REPLICATE, whole, layer=_not_divisible("in_features", in_features, ctx.world_size))
        wants = {w: shard.with_dim(in_dim)}  # uneven: the producer's offsets (NOTE: [uneven shards])
        if not isinstance(px, Shard):
            wants[x] = shard
        reason = "all_reduce after it, bias added once after that" if b is not None else "all_reduce after it"
        if state.slice_input and not isinstance(px, Shard):
            reason = "input replicated and sliced locally (colwise cannot hold, NOTE: [rowwise fallback]); " + reason
        local_target = aten.mm.default if ctx.node.target is aten.addmm.default else None
        local_args = (x, w) if b is not None else None
        return Decision(
            Partial(), wants, local_args=local_args, after_reduce=b, layer=LayerNote("rowwise", reason), local_target=local_target
        )
    if state.demoted is not None:
        return Decision(REPLICATE, whole, layer=state.demoted)
    segments = state.segments or (out_features,)
    unit = state.unit if all(s % state.unit == 0 for s in segments) else 1
    # kv heads, per segment (NOTE: [grouped shards]); a layout refined since drops them
    groups = state.groups if unit > 1 and len(state.groups) == len(segments) else (1,) * len(segments)
    if any(s * g < unit * ctx.world_size for s, g in zip(segments, groups)):  # a rank would hold nothing
        return Decision(REPLICATE, whole, layer=_not_divisible("out_features", out_features, ctx.world_size))
    out = Shard(last, segments, unit, groups)  # uneven when the units do not divide ws, NOTE: [uneven shards]
    wants = {w: out.with_dim(ops.out_dim)}
    if b is not None:
        wants[b] = out.with_dim(0)
    reason = "output stays sharded until a rowwise layer"
    if len(segments) > 1:
        reason += f"; fused output, each rank holds its block of every segment {list(segments)}"
    if out.overlaps:
        kv = [i for i, g in enumerate(groups) if g > 1]  # the kv segments; each rank holds the same heads of each
        first = sum(segments[:kv[0]])
        held = [local_ranges(out, r, ctx.world_size)[kv[0]] for r in range(ctx.world_size)]
        held_text = " ".join(f"[{(a - first) // unit}:{(a - first + n) // unit}]" for a, n in held)
        what = "" if len(segments) == 1 else f" (of segment{'s' * (len(kv) > 1)} {', '.join(map(str, kv))})"
        reason += (f"; kv heads{what} {held_text} per rank: each rank holds the {unit}-wide heads its query heads "
                   f"read ({groups[kv[0]]} per kv head), their gradient summed over the holders (NOTE: [grouped shards])")
    elif not out.divisible(ctx.world_size):
        rows = "/".join(str(out.local_size(ctx.world_size, r)) for r in range(ctx.world_size))
        heads = f", whole units of {unit} (heads)" if unit > 1 else ""
        reason += f"; uneven: {rows} output features per rank{heads}"
    return Decision(out, wants, layer=LayerNote("colwise", reason))


def _on_other_dim(why: str) -> LayerNote:
    return LayerNote(
        "replicate",
        f"{why}: the layer runs on the rank's shard with its whole weight, whose gradient is summed over the "
        "ranks (NOTE: [replicated parameter in a sharded region])",
        code="shard-on-other-dim",
        fix="none needed",
    )


def _not_divisible(what: str, size: int, ws: int) -> LayerNote:
    return LayerNote(
        "replicate",
        f"{what} {size} is smaller than world_size {ws}: a rank would hold nothing",
        code="not-divisible",
        fix="none needed (too small to shard)" + (f"; a world_size of at most {size} shards it" if size > 1 else ""),
    )


@register_rule(aten.embedding.default)
@uneven_ok
def embedding_rule(ctx: RuleContext) -> Decision:
    """A vocab-parallel lookup (Megatron-LM's ``VocabParallelEmbedding``, DTensor's rowwise
    embedding): each rank holds a block of rows, looks up the ids that fall in it, zeroes the
    others; the output is ``Partial`` and is all_reduced. Sharded indices (batch-like dims) keep
    their shard with the table replicated."""
    weight, indices = ctx.node.args[:2]
    padding_idx = _arg(ctx.node, 2, "padding_idx", -1)
    state = ctx.layer()
    p = ctx.placement(indices)
    if isinstance(p, Shard) or state.demoted is not None:
        note = state.demoted or _on_other_dim("the indices are sharded")
        return Decision(p if isinstance(p, Shard) else REPLICATE, {weight: REPLICATE}, layer=note)
    vocab, dim = shape_of(weight)
    if state.columns or state.forced == "colwise":
        return _by_columns(ctx, weight, dim)
    if vocab < ctx.world_size:
        return Decision(REPLICATE, {weight: REPLICATE}, layer=_not_divisible("num_embeddings", vocab, ctx.world_size))
    if _arg(ctx.node, 4, "sparse", False):
        note = LayerNote("replicate", "sparse gradients are not sharded", code="unsupported-op", fix="use sparse=False to shard it")
        return Decision(REPLICATE, {weight: REPLICATE}, layer=note)
    reason = "vocab-parallel: each rank looks up the ids in its rows, zeroes the rest; all_reduce after it"
    return Decision(
        Partial(),
        {weight: Shard(0, (vocab,))},
        local_args=(weight, indices, ShardStart(weight), vocab, module_of(ctx.node), padding_idx, *((True,) if _arg(ctx.node, 3, "scale_grad_by_freq", False) else ())),
        local_target=local_ops.vocab_parallel_embedding,
        layer=LayerNote("rowwise", reason),
    )


def _by_columns(ctx: RuleContext, weight: Node, dim: int) -> Decision:
    """NOTE: [column-sharded embedding] in ``passes/layers/columns.py``: every rank holds a block of
    each row and looks up its columns; the output is sharded on the last dim, no communication."""
    if dim < ctx.world_size:
        return Decision(REPLICATE, {weight: REPLICATE}, layer=_not_divisible("embedding_dim", dim, ctx.world_size))
    out = Shard(len(ctx.out_shape) - 1, (dim,))
    reason = "sharded by columns: each rank looks up its block of every row, as its consumers take the output sharded"
    if not out.divisible(ctx.world_size):
        reason += "; uneven: " + "/".join(str(out.local_size(ctx.world_size, r)) for r in range(ctx.world_size)) + " columns per rank"
    return Decision(out, {weight: Shard(1, (dim,))}, layer=LayerNote("colwise", reason))


@register_rule(aten.matmul.default, aten.bmm.default, aten.mm.default)
@overlap_ok
@uneven_ok
def matmul_rule(ctx: RuleContext) -> Decision:
    """``a @ b`` between activations: a shard on batch dims, rows of ``a`` or columns of ``b``
    flows to the output; a sharded contraction dim is refused (``contracts-sharded-dim``). A
    ``bmm`` with a 3-D parameter is a layer of MoE experts (``rules/experts.py``)."""
    batched = batched_operands(ctx.node, ctx.is_param)
    if batched is not None:
        return experts_layer(ctx, batched.x, batched.weight, batched.dims)
    ops = layer_operands(ctx.node, ctx.is_param)
    if ops is not None:  # x @ W with a parameter W (or W.T): a layer
        return _layer_rule(ctx, ops)
    a, b = ctx.node.args[:2]
    pa, pb = activation_placement(ctx, a), activation_placement(ctx, b)
    na, nb, nout = ndim(a), ndim(b), len(ctx.out_shape)
    if na < 2 or nb < 2:
        if isinstance(pa, Shard) or isinstance(pb, Shard):
            raise Conflict("unsupported-op", "matmul with a 1-D sharded operand", GATHER_INSTEAD)
        return Decision(REPLICATE)
    # Map each operand dim to an output dim (None for the contraction dim).
    amap = {d: d + nout - na for d in range(na - 1)}
    bmap = {d: d + nout - nb for d in range(nb - 2)}
    bmap[nb - 1] = nout - 1
    if isinstance(pa, Shard) and pa.dim == na - 1 or isinstance(pb, Shard) and pb.dim == nb - 2:
        # A Partial product would need an all_reduce of activations (e.g. attention scores):
        # dearer than keeping the producers replicated.
        raise Conflict("contracts-sharded-dim", "matmul contracts over the sharded dim", GATHER_INSTEAD)
    out = None
    for p, dmap in ((pa, amap), (pb, bmap)):
        if isinstance(p, Shard):
            if p.dim not in dmap:
                raise Conflict("layout-mismatch", "matmul contracts over a dim sharded on one side only", GATHER_INSTEAD)
            cand = p.with_dim(dmap[p.dim])
            if out is not None and cand != out:
                raise Conflict("layout-mismatch", f"matmul operands sharded as {out} and {cand}", GATHER_INSTEAD)
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
            wants[node] = out.with_dim(d)
    return Decision(out, wants)
