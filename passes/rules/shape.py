"""Shape ops: views, permutations, expand and cat (indexing and splits: ``rules/indexing.py``).

The view rule is the general one (NOTE: [view of a sharded dim]); squeeze/unsqueeze/flatten/
unflatten are views and use it too. The size of the sharded dim in views, expands and splits is
rewritten to its local size (a ``-1`` there becomes explicit); the other sizes stay as captured
(``sym_size`` nodes under dynamic shapes).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from fxtp.core.placement import REPLICATE, Shard
from passes.registry import GATHER_INSTEAD, WHOLE_KV_HEADS, Conflict, Decision, RuleContext, overlap_ok, register_rule, shape_of, uneven_ok
from passes.rules._common import activation_placement, local_size, local_sizes, ndim, norm_dim
from passes.rules.repeat import repeat_kv_decision, repeats_kv_heads

__all__ = ["view_placement", "group_dims"]

aten = torch.ops.aten


def group_dims(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of dims of ``a`` and ``b`` with equal products (how a view regroups dims)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        ins: list[int] = []
        outs: list[int] = []
        pa = pb = 1
        if i < len(a):
            ins.append(i)
            pa *= a[i]
            i += 1
        if j < len(b):
            outs.append(j)
            pb *= b[j]
            j += 1
        while pa != pb:
            if pa < pb and i < len(a):
                ins.append(i)
                pa *= a[i]
                i += 1
            elif j < len(b):
                outs.append(j)
                pb *= b[j]
                j += 1
            else:
                raise AssertionError(f"shapes {a} and {b} have different numel")
        groups.append((ins, outs))
    return groups


# NOTE: [view of a sharded dim]
# Think of the flat index of the dims a view regroups. With equal segments of size s, the
# sharded input dim d contributes the digits (segment, rank, local) and the rank digit has flat
# stride R = (s / world_size) * inner, inner = product of the grouped input dims after d. The
# view is local iff one output dim j holds the whole rank digit: stride_j <= R, stride_j | R,
# and the block q*ws (q = R / stride_j) divides size_j. The output is then Shard(j) with
# segments of size q*ws. Example: (L, N, 64) S(2) -> (L, N*4, 16) at ws 2 gives S(1) with
# segments (4, 4): each batch element's 4 heads split 2 | 2.


def view_placement(shard: Shard, in_shape: tuple[int, ...], out_shape: tuple[int, ...], ws: int) -> Shard:
    """Placement of ``x.view(out_shape)`` for ``x`` of ``in_shape`` sharded as ``shard``.

    Raises:
        Conflict: the view splits the shard unevenly; ``refine`` proposes finer segments when
            they would make it local.
    """
    group = next(g for g in group_dims(in_shape, out_shape) if shard.dim in g[0])
    ins, outs = group
    if ins == [shard.dim] and len(outs) == 1:
        return shard.with_dim(outs[0])
    big_in = [i for i in ins if in_shape[i] != 1]
    big_out = [o for o in outs if out_shape[o] != 1]
    if big_in == [shard.dim] and len(big_out) == 1:
        if shard.overlaps and shard.size == shard.unit == out_shape[big_out[0]] and big_out[0] - 1 in outs:
            return Shard(big_out[0] - 1, (1,), 1, shard.groups)  # one kv head of E: (.., E) -> (.., 1, E)
        return shard.with_dim(big_out[0])
    if shard.unit != 1 or not shard.divisible(ws):
        return _uneven_view(shard, in_shape, out_shape, ins, big_out, ws)
    s = shard.segments[0]
    if any(seg != s for seg in shard.segments):
        raise Conflict(
            "view-crosses-shard",
            f"view {list(in_shape)} -> {list(out_shape)} regroups a dim with unequal segments {list(shard.segments)}",
            GATHER_INSTEAD,
        )
    inner = math.prod(in_shape[i] for i in ins if i > shard.dim)
    rank_stride = (s // ws) * inner
    strides = {o: math.prod(out_shape[k] for k in outs if k > o) for o in outs}
    for i, o in enumerate(outs):
        st, n = strides[o], out_shape[o]
        if st <= rank_stride < st * n:
            q, rem = divmod(rank_stride, st)
            if rem == 0 and n % (q * ws) == 0:
                return Shard(o, (q * ws,) * (n // (q * ws)))
            break
    else:  # pragma: no cover - the rank digit always lies in some output dim
        raise AssertionError((shard, in_shape, out_shape))
    spills = rem == 0 and q * ws > n and i > 0  # the ranks run on into the next outer dim
    if spills:
        o, n = outs[i - 1], out_shape[outs[i - 1]]
    code = "not-divisible" if spills or n % ws else "view-crosses-shard"
    raise Conflict(
        code,
        f"view {list(in_shape)} -> {list(out_shape)} would split output dim {o} of size {n} "
        f"(e.g. a head count) across world_size {ws} inside its elements",
        f"use a world_size that divides {_outer_count(shard, out_shape, big_in, big_out) or n}",
        refine=_refine_for_view(shard, in_shape, out_shape, group, ws),
        unit=_head_unit(shard, out_shape, big_in, big_out, ws),
    )


# NOTE: [uneven views]
# An uneven shard (NOTE: [uneven shards] in fxtp/core/placement.py) goes through the views
# attention needs, and no others: a 1:1 pass (above); a split of the sharded dim into
# (segments, heads, head_dim, ...) whose leading dims count its equal segments and whose inner
# span I divides the unit (``(B, T, 96)`` in units of 16 -> ``(B, T, 6, 16)`` sharded on the 6
# heads in units of 1; a timm ViT's ``(B, N, 288)`` with segments (96, 96, 96) ->
# ``(B, N, 3, 6, 16)``, sharded on the 6 heads of each of q, k, v); and the merge back (the sharded
# dim outermost of the merged dims: the unit grows by the inner span). Splitting whole units
# front-loaded over the outer dim gives the same rows as over the merged dim. Anything else
# conflicts: a split whose inner span is a multiple of the unit asks the producing layer for
# whole heads (``Conflict.unit``), else one that counts whole outer elements asks for one segment
# per element (``Conflict.unit_segments``: a gate/up pair ``(B, T, 2F) -> (B, T, 2, F)`` wants (F, F)).


def _outer_count(shard: Shard, out_shape, big_in: list[int], big_out: list[int]) -> Optional[int]:
    """The size of the outermost output dim of a view that splits a one-segment sharded dim
    alone into several (Falcon-40B's ``(B, T, G * (g + 2) * E) -> (B, T, G, g + 2, E)``: the
    ``G`` kv groups), else ``None``. A world_size dividing it gives each rank whole elements of
    it, so the view is local: the fix to name where the view conflicts, rather than the inner dim
    the rank boundary falls in (``g + 2``, whose divisors do not help)."""
    if big_in != [shard.dim] or len(big_out) < 2 or len(shard.segments) != 1:
        return None
    return out_shape[big_out[0]]


def _segment_dims(shard: Shard, out_shape, big_in: list[int], big_out: list[int]) -> Optional[list[int]]:
    """The output dims that index within one segment, when the view splits the sharded dim alone
    and its leading output dims count the segments (all equal); else ``None``."""
    k, s = len(shard.segments), shard.segments[0]
    if big_in != [shard.dim] or any(seg != s for seg in shard.segments):
        return None
    for j in range(len(big_out)):
        if math.prod(out_shape[o] for o in big_out[:j]) == k and math.prod(out_shape[o] for o in big_out[j:]) == s:
            return big_out[j:]
    return None


def _head_unit(shard: Shard, out_shape, big_in: list[int], big_out: list[int], ws: int) -> Optional[int]:
    """The split unit (a head's span) under which a view that splits the sharded dim into
    ``(segments, heads, head_dim, ...)`` is local with whole heads per rank, or ``None``."""
    dims = _segment_dims(shard, out_shape, big_in, big_out)
    if dims is None or len(dims) < 2:
        return None
    inner = math.prod(out_shape[o] for o in dims[1:])
    if inner % shard.unit or inner == shard.unit or shard.segments[0] // inner < ws:
        return None
    return inner


def _uneven_view(shard: Shard, in_shape, out_shape, ins: list[int], big_out: list[int], ws: int) -> Shard:
    """NOTE: [uneven views]."""
    big_in = [i for i in ins if in_shape[i] != 1]
    dims = _segment_dims(shard, out_shape, big_in, big_out)
    if dims is not None and (len(dims) >= 2 or len(shard.segments) > 1) and not (shard.overlaps and len(shard.segments) > 1):
        inner = math.prod(out_shape[o] for o in dims[1:])
        if shard.unit % inner == 0:
            return Shard(dims[0], (out_shape[dims[0]],), shard.unit // inner, shard.groups)
    heads = _heads_view(shard, out_shape, big_in, big_out)
    if heads is not None:
        return heads
    if len(shard.segments) == 1 and len(big_out) == 1 and big_in and big_in[0] == shard.dim:
        inner = math.prod(in_shape[i] for i in big_in[1:])
        return Shard(big_out[0], (shard.size * inner,), shard.unit * inner, shard.groups)
    unit = _head_unit(shard, out_shape, big_in, big_out, ws)
    outer = None  # one segment per element of the outermost split dim
    if unit is None and len(shard.segments) == 1 and big_in == [shard.dim] and len(big_out) >= 2:
        span = math.prod(out_shape[o] for o in big_out[1:])
        outer = (span,) * out_shape[big_out[0]] if span % shard.unit == 0 and span // shard.unit >= ws else None
    raise Conflict(
        "not-divisible",
        f"view {list(in_shape)} -> {list(out_shape)} regroups a dim sharded unevenly ({shard}, size {shard.size}) "
        f"at world_size {ws}",
        f"use a world_size that divides {_outer_count(shard, out_shape, big_in, big_out) or shard.size}",
        unit=unit if outer is None else shard.unit,
        unit_segments=outer,
    )


def _heads_view(shard: Shard, out_shape, big_in: list[int], big_out: list[int]) -> Optional[Shard]:
    """A split of the sharded dim alone into ``(heads, ...)`` whose inner span divides the unit:
    every segment (of any size, kv groups kept) becomes whole heads of the outer dim (Falcon's
    ``fused_qkv.view(B, T, H + 2, E)`` of Q | K | V segments ``(H * E, E, E)``); else ``None``."""
    if big_in != [shard.dim] or len(big_out) < 2:
        return None
    inner = math.prod(out_shape[o] for o in big_out[1:])
    if shard.unit % inner or out_shape[big_out[0]] * inner != shard.size:
        return None
    return Shard(big_out[0], tuple(s // inner for s in shard.segments), shard.unit // inner, shard.groups)


def _refine_for_view(shard: Shard, in_shape, out_shape, group, ws: int) -> Optional[tuple[int, ...]]:
    """Largest finer equal segmentation of the sharded dim under which the view is local."""
    ins, outs = group
    inner = math.prod(in_shape[i] for i in ins if i > shard.dim)
    s = shard.segments[0]
    for o in outs:  # outer to inner: the first hit is the largest segment
        span = math.prod(out_shape[k] for k in outs if k >= o)
        if span % inner:
            continue
        s2 = span // inner
        if s2 < s and s % s2 == 0 and s2 % ws == 0 and out_shape[o] % ws == 0:
            refined = Shard(shard.dim, (s2,) * (shard.size // s2))
            try:
                view_placement(refined, in_shape, out_shape, ws)
            except Conflict:
                continue
            return refined.segments
    return None


def _view_decision(ctx: RuleContext, size_arg: Optional[int]) -> Decision:
    x = ctx.node.args[0]
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    if p.overlaps and size_arg is not None and repeats_kv_heads(p, shape_of(x), ctx.out_shape):
        return repeat_kv_decision(ctx, x, p, merged=True)
    out = view_placement(p, shape_of(x), ctx.out_shape, ctx.world_size)
    if size_arg is None:
        return Decision(out)
    args = list(ctx.node.args)
    args[size_arg] = local_sizes(args[size_arg], out.dim, local_size(out, ctx.world_size))
    return Decision(out, local_args=tuple(args))


@register_rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
@overlap_ok
@uneven_ok
def view_rule(ctx: RuleContext) -> Decision:
    """``view(x, size)``: sizes become the local output shape (no ``-1`` left)."""
    return _view_decision(ctx, size_arg=1)


@register_rule(aten.unsqueeze.default, aten.flatten.using_ints)
@overlap_ok
@uneven_ok
def squeeze_rule(ctx: RuleContext) -> Decision:
    """Dim-only views: the args name dims, not sizes, so nothing is rewritten."""
    return _view_decision(ctx, size_arg=None)


@register_rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
@overlap_ok
@uneven_ok
def global_squeeze_rule(ctx: RuleContext) -> Decision:
    """``squeeze``: only dims of global size 1. A sharded dim whose local size is 1 (4 heads
    at world_size 4) must not be squeezed on the rank, so a sharded input's squeeze becomes
    ``squeeze.dims`` of the global singletons (DTensor's ``_adjust_squeeze_to_global_singletons``)."""
    dec = _view_decision(ctx, size_arg=None)
    x = ctx.node.args[0]
    if not isinstance(ctx.placement(x), Shard):
        return dec
    shape, nd = shape_of(x), ndim(x)
    if ctx.node.target is aten.squeeze.default:
        asked = range(nd)
    else:
        dims = ctx.node.args[1] if len(ctx.node.args) > 1 else ctx.node.kwargs["dim"]
        asked = [dims] if isinstance(dims, int) else dims
    singletons = sorted({norm_dim(d, nd) for d in asked if shape[norm_dim(d, nd)] == 1})
    return Decision(dec.out, local_args=(x, singletons), local_target=aten.squeeze.dims)


@register_rule(aten.unflatten.int)
@overlap_ok
@uneven_ok
def unflatten_rule(ctx: RuleContext) -> Decision:
    """``unflatten(x, dim, sizes)``: sizes become local."""
    x, dim, sizes = ctx.node.args[:3]
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    out = view_placement(p, shape_of(x), ctx.out_shape, ctx.world_size)
    start = norm_dim(dim, ndim(x))
    if not start <= out.dim < start + len(sizes):
        return Decision(out)
    return Decision(out, local_args=(x, dim, local_sizes(sizes, out.dim - start, local_size(out, ctx.world_size))))


@register_rule(aten.transpose.int)
@overlap_ok
@uneven_ok
def transpose_rule(ctx: RuleContext) -> Decision:
    x, d0, d1 = ctx.node.args
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    nd = ndim(x)
    d0, d1 = norm_dim(d0, nd), norm_dim(d1, nd)
    swap = {d0: d1, d1: d0}
    return Decision(p.with_dim(swap.get(p.dim, p.dim)))


@register_rule(aten.t.default, aten.numpy_T.default)
@overlap_ok
@uneven_ok
def t_rule(ctx: RuleContext) -> Decision:
    p = ctx.placement(ctx.node.args[0])
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    return Decision(p.with_dim(1 - p.dim) if ndim(ctx.node.args[0]) == 2 else p)


@register_rule(aten.permute.default)
@overlap_ok
@uneven_ok
def permute_rule(ctx: RuleContext) -> Decision:
    x, dims = ctx.node.args
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    nd = ndim(x)
    return Decision(p.with_dim([norm_dim(d, nd) for d in dims].index(p.dim)))


@register_rule(aten.expand.default, aten.broadcast_to.default)
@overlap_ok
@uneven_ok
def expand_rule(ctx: RuleContext) -> Decision:
    """``expand(x, sizes)``, ``broadcast_to(x, sizes)`` (Falcon-40B's k and v over their query
    heads): the sharded dim keeps its local size."""
    x = ctx.node.args[0]
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    out = p.with_dim(p.dim + len(ctx.out_shape) - ndim(x))
    sizes = local_sizes(ctx.node.args[1], out.dim, local_size(out, ctx.world_size))
    return Decision(out, local_args=(x, sizes, *ctx.node.args[2:]))


@register_rule(aten.cat.default)
@overlap_ok
@uneven_ok
def cat_rule(ctx: RuleContext) -> Decision:
    """Cat along the sharded dim concatenates segments; along another dim the shard is kept."""
    tensors = list(ctx.node.args[0])
    dim = norm_dim(ctx.node.args[1] if len(ctx.node.args) > 1 else 0, len(ctx.out_shape))
    placements = [activation_placement(ctx, t) for t in tensors]
    shards = [p for p in placements if isinstance(p, Shard)]
    if not shards:
        return Decision(REPLICATE)
    if any(p.dim != shards[0].dim for p in shards):
        raise Conflict("layout-mismatch", "cat of tensors sharded on different dims", GATHER_INSTEAD)
    if shards[0].dim == dim:
        if any(p.overlaps for p in shards):
            raise Conflict("layout-mismatch", "cat along kv heads held by several ranks", WHOLE_KV_HEADS)
        if len(shards) != len(tensors):
            raise Conflict("layout-mismatch", "cat along the sharded dim of sharded and replicated tensors", GATHER_INSTEAD)
        if len({p.unit for p in shards}) > 1:
            raise Conflict("layout-mismatch", "cat along the sharded dim of shards split in different units", GATHER_INSTEAD)
        return Decision(Shard(dim, tuple(s for p in shards for s in p.segments), shards[0].unit), dict(zip(tensors, shards)))
    if any(p != shards[0] for p in shards):
        raise Conflict("layout-mismatch", "cat of tensors sharded differently", GATHER_INSTEAD)
    return Decision(shards[0], {t: shards[0] for t in tensors})


@register_rule(aten.view_as_complex.default, aten.view_as_real.default)
@overlap_ok
@uneven_ok
def complex_view_rule(ctx: RuleContext) -> Decision:
    """``view_as_complex`` (``(..., 2)`` float pairs -> ``(...)`` complex) and ``view_as_real``
    (the reverse), e.g. Llama-4's rotary embedding on ``(B, T, heads, head_dim / 2, 2)``: a shard
    of any dim but the pairs' keeps its dim, segments and unit (heads sharded, or kv heads held
    by the ranks that read them: NOTE: [grouped shards]), and the rank views its own block."""
    x = ctx.node.args[0]
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    if ctx.node.target is aten.view_as_complex.default and p.dim == ndim(x) - 1:
        raise Conflict("splits-head", "view_as_complex of a value sharded on its (real, imaginary) pairs", GATHER_INSTEAD)
    return Decision(p)
