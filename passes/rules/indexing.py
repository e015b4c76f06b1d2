"""Indexing along a sharded dim: ``slice``, ``narrow``, ``select``, ``split``/``chunk``, ``unbind``, ``glu``.

A fused projection (NOTE: [segments] in ``fxtp/core/placement.py``) is taken apart by
``chunk``/``split`` or by index (Phi-3's ``qkv[..., :q_pos]``, ``narrow``, an interleaved
``gate_up[..., ::2]``). Each piece that is a run of whole segments is local: every rank holds its
block of each of those segments, so the rank's bounds are the local sizes of the segments before
and inside the piece (NOTE: [slices of segments]). A piece that cuts a segment proposes the
refinement (``Conflict.refine``) under which it would not, and the planner re-cuts the layer.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Optional

import torch
from torch.fx import Node

from fxtp.core.placement import REPLICATE, Replicate, Shard, local_ranges
from passes.registry import (
    GATHER_INSTEAD,
    WHOLE_KV_HEADS,
    Conflict,
    Decision,
    LocalSize,
    RuleContext,
    is_tensor_node,
    overlap_ok,
    register_rule,
    shape_of,
    source_line,
    uneven_ok,
)
from passes.rules._common import local_size, ndim, norm_dim
from passes.rules.dtensor_fallback import dtensor_rule

__all__ = ["split_pieces", "slice_bounds", "glu_segments"]

aten = torch.ops.aten

# NOTE: [slices of segments]
# ``x[..., a:b]`` on ``Shard(d, segments)`` is local when ``a`` and ``b`` are segment bounds: the
# piece is ``Shard(d, segments[i:j])`` and the rank's bounds are the local sizes of
# ``segments[:i]`` and ``segments[:j]`` (numbers when even, ``LocalSize`` when a segment splits
# unevenly, NOTE: [uneven shards]). Phi-3's ``qkv_proj`` of (32 + 2 * 32) heads sharded with
# segments (3072, 3072, 3072) at world_size 8 gives each rank ``[Q_r | K_r | V_r]`` of 384
# columns each, and ``qkv[..., 3072:6144]`` becomes ``qkv_r[..., 384:768]``. A strided slice
# ``x[..., a::s]`` (``a < s``, an interleaved gate/up) is local when every rank's blocks start and
# end on multiples of ``s``: the piece holds ``1/s`` of every block. Bounds that cut a segment
# raise a Conflict refining the segments at the cut (even when every piece divides world_size,
# else uneven in units of 1: ``Conflict.unit``). Grouped segments (kv heads, NOTE: [grouped
# shards]) are taken whole the same way, their groups kept on the piece and the rank's bounds
# counting the kv heads it holds; a cut inside one is refused.


def slice_bounds(size: int, start: Any, end: Any, step: Any) -> Optional[tuple[int, int, int]]:
    """``(start, end, step)`` of ``x[start:end:step]`` on a dim of ``size``, clamped as Python
    slices are; ``None`` if a bound is not a plain int (a symbol of a dynamic shape)."""
    bounds = []
    for value, default in ((start, 0), (end, size), (step, 1)):
        if value is None:
            value = default
        if not isinstance(value, int):
            return None
        bounds.append(value)
    a, b, s = bounds
    a, b = (v + size if v < 0 else v for v in (a, b))
    return min(max(a, 0), size), min(max(b, 0), size), s


def _cuts(segments: tuple[int, ...]) -> list[int]:
    """The bounds of the segments: ``(64, 32, 32)`` -> ``[0, 64, 96, 128]``."""
    return [0, *itertools.accumulate(segments)]


def _prefix_size(shard: Shard, count: int, ws: int) -> Any:
    """The rank's local size of the first ``count`` segments of ``shard``."""
    if count == 0:
        return 0
    return local_size(_segments(shard, 0, count), ws)


def _segments(shard: Shard, i: int, j: int) -> Shard:
    """Segments ``i:j`` of ``shard``, with their kv groups (NOTE: [grouped shards])."""
    return Shard(shard.dim, shard.segments[i:j], shard.unit, shard.groups[i:j])


def _fix(ctx: RuleContext, pieces: tuple[int, ...], what: str) -> str:
    """What the user can do about a piece that no layout of the fused dim makes local."""
    g = math.gcd(*pieces)
    sizes = [w for w in range(2, 17) if g % w == 0]
    where = source_line(ctx.node)
    change = f" at {where}" if where else ""
    return (
        f"use a world_size that divides {g} ({', '.join(map(str, sizes)) or 'none from 2 to 16'}), or change the "
        f"{what}{change} to take whole segments of the fused dim"
    )


def _refined(ctx: RuleContext, p: Shard, cuts: set[int], what: str) -> Conflict:
    """A Conflict for a piece of ``p`` whose bounds ``cuts`` are not segment bounds, proposing the
    segments cut there too (even if every piece divides world_size, else uneven in ``p``'s unit)."""
    merged = sorted(set(_cuts(p.segments)) | cuts)
    refined = tuple(b - a for a, b in zip(merged, merged[1:]))
    ws = ctx.world_size
    even = all(s % ws == 0 for s in refined)
    units = all(s % p.unit == 0 and s // p.unit >= ws for s in refined)
    return Conflict(
        "indexes-sharded-dim" if even else "not-divisible",
        f"{what} cuts the segments {list(p.segments)} of the sharded dim {p.dim} (pieces {list(refined)} at world_size {ws})",
        _fix(ctx, refined, what),
        refine=refined if even else None,
        unit=None if even or not units else p.unit,
        unit_segments=None if even or not units else refined,
    )


def _strided(ctx: RuleContext, x: Node, p: Shard, a: int, b: int, step: int, dim_arg: Any) -> Decision:
    """``x[..., a::step]`` with ``a < step`` on the sharded dim (NOTE: [slices of segments])."""
    ws, n = ctx.world_size, shape_of(x)[p.dim]
    what = f"slice [{a}:{b}:{step}]"
    if a >= step or b < n:
        raise Conflict("indexes-sharded-dim", f"{what} of the sharded dim {p.dim} (size {n}) picks a part of its blocks",
                       _fix(ctx, p.segments, what))
    if all(s % step == 0 for s in p.segments) and p.unit % step == 0:
        out = Shard(p.dim, tuple(s // step for s in p.segments), p.unit // step)
    else:
        out = Shard(p.dim, tuple(s // step for s in p.segments)) if all(s % step == 0 for s in p.segments) else None
    if out is None or any(
        start % step or length % step or length // step != got
        for r in range(ws)
        for (start, length), (_, got) in zip(local_ranges(p, r, ws), local_ranges(out, r, ws))
    ):
        unit = math.lcm(p.unit, step)
        ok = all(s % unit == 0 and s // unit >= ws for s in p.segments)
        raise Conflict("not-divisible", f"{what} of the sharded dim {p.dim} needs every rank's block to hold whole groups "
                       f"of {step} ({p} at world_size {ws})", _fix(ctx, p.segments, what), unit=unit if ok else None)
    return Decision(out, local_args=(x, dim_arg, a, local_size(p, ws), step))


@register_rule(aten.slice.Tensor)
@overlap_ok
@uneven_ok
def slice_rule(ctx: RuleContext) -> Decision:
    """``x[..., start:end:step]``: on the sharded dim, a run of whole segments (NOTE: [slices of segments])."""
    x, *rest = ctx.node.args
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    dim_arg = rest[0] if rest else 0
    dim = norm_dim(dim_arg, ndim(x))
    n = shape_of(x)[dim]
    if dim != p.dim or n == ctx.out_shape[dim]:
        return Decision(p)
    bounds = slice_bounds(n, *(list(rest[1:]) + [None] * (3 - len(rest[1:]))))
    if bounds is None:
        raise Conflict("indexes-sharded-dim", f"slice of the sharded dim {dim} with bounds that depend on a dynamic size",
                       _fix(ctx, p.segments, "slice"))
    a, b, step = bounds
    cuts = _cuts(p.segments)
    if step != 1 or a not in cuts or b not in cuts:
        _refuse_grouped(p, "slice")  # whole segments of a fused projection with kv heads are local
    if step != 1:
        return _strided(ctx, x, p, a, b, step, dim_arg)
    if a not in cuts or b not in cuts:
        raise _refined(ctx, p, {a, b}, f"slice [{a}:{b}]")
    i, j = cuts.index(a), cuts.index(b)
    out = _segments(p, i, j)
    return Decision(out, local_args=(x, dim_arg, _prefix_size(p, i, ctx.world_size), _prefix_size(p, j, ctx.world_size)))


@register_rule(aten.narrow.default)
@overlap_ok
@uneven_ok
def narrow_rule(ctx: RuleContext) -> Decision:
    """``x.narrow(dim, start, length)``: as ``x[start:start + length]`` on that dim."""
    x, dim_arg, start, length = ctx.node.args
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    dim = norm_dim(dim_arg, ndim(x))
    n = shape_of(x)[dim]
    if dim != p.dim or n == ctx.out_shape[dim]:
        return Decision(p)
    if not isinstance(start, int) or not isinstance(length, int):
        _refuse_grouped(p, "narrow")
        raise Conflict("indexes-sharded-dim", f"narrow of the sharded dim {dim} with a dynamic start or length",
                       _fix(ctx, p.segments, "narrow"))
    a = start + n if start < 0 else start
    cuts = _cuts(p.segments)
    if a not in cuts or a + length not in cuts:
        _refuse_grouped(p, "narrow")
        raise _refined(ctx, p, {a, a + length}, f"narrow({dim}, {start}, {length})")
    i, j = cuts.index(a), cuts.index(a + length)
    out = _segments(p, i, j)
    return Decision(out, local_args=(x, dim_arg, _prefix_size(p, i, ctx.world_size), local_size(out, ctx.world_size)))


def _refuse_grouped(p: Shard, what: str) -> None:
    """NOTE: [grouped shards]: kv units several ranks hold are taken whole, never cut on their dim."""
    if p.overlaps:
        raise Conflict("indexes-sharded-dim", f"{what} of kv heads held by several ranks ({p})", WHOLE_KV_HEADS)


def _whole_index_fix(ctx: RuleContext, what: str) -> str:
    where = source_line(ctx.node)
    return (
        "none needed: fxtp keeps the producing layer replicated; to shard it, take the fused dim apart with "
        f"chunk/split or a slice instead of {what}" + (f" at {where}" if where else "")
    )


@register_rule(aten.select.int)
@overlap_ok
@uneven_ok
def select_rule(ctx: RuleContext) -> Decision:
    x, dim, _ = ctx.node.args
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    dim = norm_dim(dim, ndim(x))
    if dim == p.dim:
        raise Conflict("indexes-sharded-dim", f"select on the sharded dim {dim}", _whole_index_fix(ctx, "an index"))
    return Decision(p.with_dim(p.dim - (dim < p.dim)))


@register_rule(aten.index.Tensor)
def index_rule(ctx: RuleContext) -> Decision:
    """``x[..., idx, ...]`` with a tensor of positions: refused on the sharded dim (the positions
    are global, and may fall on other ranks). Positions of the leading dims only, before the
    sharded one (``W[expert_ids]``, NOTE: [gathered experts] in passes/propagate.py), keep the
    shard, segments included, on the dim it lands on; elsewhere DTensor's rule (NOTE: [DTensor
    fallback])."""
    x, indices = ctx.node.args[:2]
    p = ctx.placement(x)
    leading = isinstance(p, Shard) and 0 < len(indices) <= p.dim and all(is_tensor_node(i) for i in indices)
    if leading and all(isinstance(ctx.placement(i), Replicate) for i in indices):
        # the positions broadcast to one shape, which replaces the indexed dims
        return Decision(p.with_dim(p.dim + len(ctx.out_shape) - ndim(x)), {x: p})
    if isinstance(p, Shard) and p.dim < len(indices) and indices[p.dim] is not None:
        where = source_line(ctx.node)
        raise Conflict(
            "indexes-sharded-dim",
            f"index with a tensor of positions along the sharded dim {p.dim} (segments {list(p.segments)})",
            "none needed: fxtp keeps the producing layer replicated; to shard it, take whole segments with a slice "
            f"or split{f' at {where}' if where else ''}; a part every rank needs whole (the one kv head of multi-query "
            "attention) can be its own nn.Linear, which stays replicated beside the sharded rest",
        )
    return dtensor_rule(aten.index.Tensor, ctx)


def split_pieces(shard: Shard, sizes: list[int], ws: int) -> list[Shard]:
    """Segments of each split piece; raise Conflict (with a refinement) if a piece cuts a segment."""
    bounds = set(_cuts(shard.segments))
    cuts = set(_cuts(tuple(sizes)))
    if cuts <= bounds:
        pieces, segs, i = [], list(shard.segments), 0
        for size in sizes:
            take: list[int] = []
            while sum(take) < size:
                take.append(segs[i])
                i += 1
            pieces.append(Shard(shard.dim, tuple(take), shard.unit))
        return pieces
    merged = sorted(bounds | cuts)
    refined = tuple(b - a for a, b in zip(merged, merged[1:]))
    ok = all(seg % ws == 0 for seg in refined)
    units = not ok and all(seg % shard.unit == 0 and seg // shard.unit >= ws for seg in refined)  # uneven pieces
    raise Conflict(
        "split-crosses-shard" if ok else "not-divisible",
        f"split sizes {sizes} cross the shard boundaries of segments {list(shard.segments)} at world_size {ws}",
        "use a world_size that divides every split size",
        refine=refined if ok else None,
        unit=shard.unit if units else None,
        unit_segments=refined if units else None,
    )


@register_rule(aten.split_with_sizes.default, aten.split.Tensor, aten.chunk.default)
@overlap_ok
@uneven_ok
def split_rule(ctx: RuleContext) -> Decision:
    """Split along the sharded dim works segment-wise (fused QKV); sizes become local."""
    x = ctx.node.args[0]
    p = ctx.placement(x)
    pieces_val = ctx.node.meta["val"]
    n = len(pieces_val)
    if not isinstance(p, Shard):
        return Decision((REPLICATE,) * n)
    dim = norm_dim(ctx.node.args[2] if len(ctx.node.args) > 2 else ctx.node.kwargs.get("dim", 0), ndim(x))
    if dim != p.dim:
        return Decision((p,) * n)
    _refuse_grouped(p, "split")
    sizes = [int(v.shape[dim]) for v in pieces_val]
    pieces = split_pieces(p, sizes, ctx.world_size)
    local = [local_size(piece, ctx.world_size) for piece in pieces]
    uneven = any(isinstance(size, LocalSize) for size in local)
    if uneven and any(piece != pieces[0] for piece in pieces):  # equal pieces split equally on every rank
        raise Conflict(
            "not-divisible",
            f"split into {sizes} of a dim sharded unevenly at world_size {ctx.world_size} into pieces of different layouts",
            GATHER_INSTEAD,
        )
    if ctx.node.target is aten.split_with_sizes.default:
        return Decision(tuple(pieces), local_args=(x, local, *ctx.node.args[2:]))
    if not uneven and (len(set(local[:-1])) > 1 or local[-1] > local[0]):
        raise Conflict("split-crosses-shard", f"split into {sizes} has no equal local split", GATHER_INSTEAD)
    if ctx.node.target is aten.split.Tensor:
        return Decision(tuple(pieces), local_args=(x, local[0], *ctx.node.args[2:]))
    return Decision(tuple(pieces))  # chunk: the count is unchanged


@register_rule(aten.unbind.int)
@overlap_ok
@uneven_ok
def unbind_rule(ctx: RuleContext) -> Decision:
    x = ctx.node.args[0]
    p = ctx.placement(x)
    n = len(ctx.node.meta["val"])
    if not isinstance(p, Shard):
        return Decision((REPLICATE,) * n)
    dim = norm_dim(ctx.node.args[1] if len(ctx.node.args) > 1 else 0, ndim(x))
    if dim == p.dim:
        raise Conflict("indexes-sharded-dim", f"unbind of the sharded dim {dim}", _whole_index_fix(ctx, "unbind"))
    return Decision((p.with_dim(p.dim - (dim < p.dim)),) * n)


# NOTE: [glu of a fused projection]
# ``glu``: a gated linear unit on a fused projection (Dauphin et al. 2017; torchtitan's w12).
#
# ``glu(x, dim)`` splits ``dim`` into halves ``a | b`` and returns ``a * sigmoid(b)``: element
# ``i`` of the output pairs ``x[i]`` with ``x[i + n/2]``. On another dim a shard flows through.
# On the halved dim the rank's local ``glu`` pairs the first half of its local block with the
# second half, which is right exactly when the segments (NOTE: [segments]) are the same in both
# halves: a fused ``w12`` projection sharded with segments ``(h, h)`` gives each rank
# ``[w1_r | w2_r]``, and the output is sharded with segments ``(h,)``. Any other layout raises a
# Conflict whose ``refine`` proposes the common refinement of the segments and their mirror
# image across the middle, so the planner re-cuts the producing layer.


def glu_segments(segments: tuple[int, ...]) -> tuple[int, ...]:
    """The coarsest refinement of ``segments`` whose first half equals its second half.

    Example: ``(256,)`` -> ``(128, 128)``; ``(64, 192)`` -> ``(64, 64, 64, 64)``.
    """
    total = sum(segments)
    half = total // 2
    bounds, acc = {0, half, total}, 0
    for seg in segments:
        acc += seg
        bounds.add(acc)
    bounds |= {b + half for b in bounds if b < half} | {b - half for b in bounds if b > half}
    cuts = sorted(bounds)
    return tuple(b - a for a, b in zip(cuts, cuts[1:]))


@register_rule(aten.glu.default)
def glu_rule(ctx: RuleContext) -> Decision:
    """NOTE: [glu of a fused projection]."""
    x = ctx.node.args[0]
    dim = ctx.node.args[1] if len(ctx.node.args) > 1 else ctx.node.kwargs.get("dim", -1)
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    if norm_dim(dim, ndim(x)) != p.dim:
        return Decision(p)
    k = len(p.segments)
    if k % 2 == 0 and p.segments[: k // 2] == p.segments[k // 2 :]:
        return Decision(Shard(p.dim, p.segments[: k // 2]))
    refined = glu_segments(p.segments)
    ok = all(s % ctx.world_size == 0 for s in refined)
    raise Conflict(
        "split-crosses-shard" if ok else "not-divisible",
        f"glu halves dim {p.dim} of size {shape_of(x)[p.dim]}, which crosses the shard of segments {list(p.segments)} "
        f"at world_size {ctx.world_size}",
        "use a world_size that divides both halves",
        refine=refined if ok else None,
    )
