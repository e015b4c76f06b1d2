"""The fallback rule: ask DTensor's sharding propagation what an op does with a shard.

fxtp's own rules cover the ops it knows more about (layers, segments, local shape literals);
the long tail of ATen ops is answered by the table torch maintains for DTensor
(``torch.distributed.tensor._ops``: 1,164 ops in torch 2.13). For an op without an fxtp rule,
:func:`dtensor_rule` hands DTensor the placements of the node's inputs on a one-dimensional
mesh of ``world_size`` devices and maps its answer back:

* the output placement DTensor chooses becomes the Decision's ``out``;
* a replicated input DTensor wants sharded is sliced locally (``wants``), as fxtp's own rules do;
* a sharded input DTensor would redistribute, an output fxtp cannot hold (``Partial`` other than
  a sum, a strided shard, a shard of a size the world size does not divide) or an op whose
  shape arguments DTensor would rewrite to local sizes (``view``-like ops; those need fxtp's own
  rules) is a :class:`Conflict` naming the op, so the producer stays replicated. So is an op
  with a size list (``SymInt[]``) that DTensor answers by its decomposition into other ops
  (``broadcast_to`` before fxtp had a rule for it): DTensor runs the decomposed ops, each
  rewriting its own sizes, where fxtp would run the op itself with the global sizes.

NOTE: [DTensor fallback]
This is the one place fxtp uses DTensor's private sharding propagation
(``DTensor._op_dispatcher.sharding_propagator``, ``OpSchema``, ``DTensorSpec``; no public API
exposes "what would this op do with these placements" in torch 2.13). It runs on a
``DeviceMesh`` built with ``_init_backend=False``: the propagation needs only the mesh's shape,
and a mesh without a process group neither needs nor disturbs the user's (a fake default group
would replace it). Inputs that are parameters are offered as replicated: a parameter is sharded
because an activation it meets is, as in the pointwise rule.

DTensor's ``Shard(d)`` is one contiguous block per rank; fxtp's ``Shard`` may have several
segments (NOTE: [segments] in ``fxtp/core/placement.py``). A multi-segment input is offered as
``Shard(d)`` and accepted only where DTensor's output shard is on a dim of the same size: an op
that is correct on a block of every size for every world size maps each index of that dim to
the same index of the output, so it is correct on any union of blocks too.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.fx import Node
from torch.utils import _pytree as pytree

from fxtp.core.placement import REPLICATE, Partial, Placement, Shard
from passes.registry import GATHER_INSTEAD, Conflict, Decision, RuleContext, is_tensor_node, shape_of
from passes.rules._common import activation_placement

__all__ = ["dtensor_ops", "dtensor_rule"]

OpOverload = torch._ops.OpOverload


@functools.cache
def _propagator() -> Any:
    from torch.distributed.tensor import DTensor  # registers every strategy; ~1 s, so on first use

    return DTensor._op_dispatcher.sharding_propagator


@functools.cache
def _mesh(world_size: int) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(world_size), _init_backend=False, _rank=0)


def dtensor_ops() -> frozenset[OpOverload]:
    """Every op DTensor has a sharding strategy or rule for."""
    sp = _propagator()
    return frozenset(sp.op_strategy_funcs) | frozenset(sp.op_to_rules) | frozenset(sp.op_single_dim_strategy_funcs)


def dtensor_rule(op: OpOverload, ctx: RuleContext, skip: frozenset[str] = frozenset()) -> Decision:
    """What DTensor does with ``op`` on ``ctx.node``'s input placements; see the module docstring.

    Args:
        op: the op to ask about (the node's own, or the functional op of an in-place node).
        ctx: the node's rule context.
        skip: keyword arguments left out (the ``out=`` tensors of an ``out`` variant).

    Raises:
        Conflict: ``unsupported-op`` (DTensor redistributes a sharded input, fails, or answers
            with a placement fxtp cannot hold) or ``not-divisible``.
    """
    node = ctx.node
    if not torch.distributed.is_available():
        raise _unsupported(op, "has no fxtp rule, and this torch build has no torch.distributed.tensor to ask")
    if torch.Tag.nondeterministic_seeded in op.tags:
        raise _unsupported(op, "draws random numbers; a shard would draw a different stream than one device")
    kwargs = {k: v for k, v in node.kwargs.items() if k not in skip}
    args, kwargs = _nonnegative_dims(op, node, kwargs)
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensors = [a for a in flat if is_tensor_node(a)]
    given = {a: activation_placement(ctx, a) for a in tensors}
    if any(isinstance(p, Shard) for p in given.values()) and _decomposed_with_sizes(op, args, kwargs):
        raise _unsupported(op, "has size arguments that only the ops DTensor decomposes it into would make local "
                               "(no fxtp rule rewrites them)")
    segments = _common_segments(op, given)
    try:
        answer = _ask(op, ctx.world_size, tuple(_arg_key(a, given) for a in flat), spec)
    except Exception as e:  # an unhashable argument, a spec fxtp cannot build: no answer
        raise _unsupported(op, f"has arguments fxtp cannot pass to DTensor ({type(e).__name__}: {e})") from None
    if isinstance(answer, str):
        raise _unsupported(op, answer)
    expected, outs = answer
    wants: dict[Node, Placement] = {}
    for a, want in zip(tensors, expected):
        p = given[a]
        if isinstance(p, Shard):
            if want != ("S", p.dim):
                raise _unsupported(op, f"needs input {a.name} ({p}) redistributed to {_show(want)}")
            wants[a] = p
        elif want != ("R",):
            if want[0] != "S":
                raise _unsupported(op, f"needs input {a.name} as {_show(want)}")
            shard = _shard(op, want[1], shape_of(a), segments, ctx.world_size)
            if wants.setdefault(a, shard) != shard:
                raise _unsupported(op, f"wants input {a.name} sharded two ways")
    out_vals = node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else (node.meta["val"],)
    if len(outs) != len(out_vals):
        raise _unsupported(op, f"has {len(out_vals)} outputs but DTensor places {len(outs)}")
    placements = tuple(_output(op, o, v, segments, ctx.world_size) for o, v in zip(outs, out_vals))
    if any(isinstance(p, Partial) for p in placements) and len(placements) > 1:
        raise _unsupported(op, "returns partial sums among several outputs")
    return Decision(placements if isinstance(node.meta["val"], (tuple, list)) else placements[0], wants)


def _decomposed_with_sizes(op: OpOverload, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether DTensor answers ``op`` only by its decomposition (no strategy of its own) and the
    call gives a size list (a ``SymInt[]`` argument, not ``None``): DTensor's decomposed ops
    would each make their sizes local, fxtp's call of ``op`` would pass the global ones."""
    sp = _propagator()
    if op in sp.op_strategy_funcs or op in sp.op_single_dim_strategy_funcs or op in sp.op_to_rules:
        return False
    names = set(re.findall(r"SymInt\[\d*\]\??\s+(\w+)", str(op._schema).partition(") ->")[0]))
    for i, a in enumerate(op._schema.arguments):
        value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        if a.name in names and value is not None:
            return True
    return False


_DIM_ARGS = frozenset({"dim", "dims", "dim0", "dim1", "dim2"})


def _nonnegative_dims(op: OpOverload, node: Node, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``node``'s args and ``kwargs`` with negative dim arguments made non-negative.

    Not every DTensor strategy normalizes them: torch 2.13's ``scan_strategy`` (``cumsum``,
    ``cumprod``, ``logcumsumexp``) compares ``dim=-1`` with ``Shard(2)`` and keeps a shard it
    scans over. A dim counts from ``self``'s rank, unless the op adds dims (``unsqueeze``-like:
    left as is).
    """
    self_val = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], Node) else None
    out_val = node.meta.get("val")
    if not isinstance(self_val, torch.Tensor) or not isinstance(out_val, torch.Tensor) or out_val.dim() > self_val.dim():
        return tuple(node.args), kwargs
    rank = max(self_val.dim(), 1)

    def fix(value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return value + rank if value < 0 else value
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
            return type(value)(v + rank if v < 0 else v for v in value)
        return value

    args = list(node.args)
    for i, a in enumerate(op._schema.arguments):
        if a.name not in _DIM_ARGS:
            continue
        if i < len(args) and not a.kwarg_only:
            args[i] = fix(args[i])
        elif a.name in kwargs:
            kwargs = {**kwargs, a.name: fix(kwargs[a.name])}
    return tuple(args), kwargs


# A spec as plain data: ("R",), ("S", dim), ("P", reduce_op), ("?", text); None: not a tensor.
_Spec = tuple


@dataclass(frozen=True)
class _TensorArg:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    placement: Placement


def _arg_key(a: Any, given: dict[Node, Placement]) -> Any:
    """An argument as hashable data: a tensor by its metadata and placement, a non-tensor node
    by its value."""
    if is_tensor_node(a):
        val = a.meta["val"]
        shape = shape_of(a)
        stride = tuple(val.stride())
        if not all(isinstance(s, int) for s in stride):  # symbolic: strides do not decide a shard
            stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        return _TensorArg(shape, stride, val.dtype, given[a])
    if isinstance(a, Node):
        return a.meta.get("val")
    return a


@functools.lru_cache(maxsize=4096)
def _ask(op: OpOverload, world_size: int, flat: tuple, spec: Any) -> "str | tuple[tuple[_Spec, ...], tuple[Optional[_Spec], ...]]":
    """DTensor's answer for ``op`` on the flattened ``(args, kwargs)`` (tensors as
    :class:`_TensorArg`): ``(wanted input specs, output specs)``, or why it has none."""
    from torch.distributed.tensor import Partial as DPartial, Replicate as DReplicate, Shard as DShard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema

    sp = _propagator()
    mesh = _mesh(world_size)
    placements = [a.placement for a in flat if isinstance(a, _TensorArg)]

    def to_spec(a: Any) -> Any:
        if not isinstance(a, _TensorArg):
            return a
        p = a.placement
        dp = DShard(p.dim) if isinstance(p, Shard) else DPartial() if isinstance(p, Partial) else DReplicate()
        return DTensorSpec(mesh, (dp,), TensorMeta(torch.Size(a.shape), a.stride, a.dtype))

    args, kwargs = pytree.tree_unflatten([to_spec(a) for a in flat], spec)
    info = sp.op_to_schema_info.get(op) or sp.op_to_schema_info_for_single_dim_strategy.get(op)
    try:
        out = sp.propagate_op_sharding_non_cached(OpSchema(op, tuple(args), kwargs, schema_info=info))
    except Exception as e:  # DTensor has no strategy, or its strategy fails on these inputs
        return f"has no DTensor sharding strategy for these inputs ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    if out.use_val_from_redistribute_schema:
        return "has shape arguments that would need local sizes (no fxtp rule rewrites them)"
    chosen = out.redistribute_schema if out.needs_redistribute and out.redistribute_schema is not None else None
    if chosen is None:
        expected = tuple(_plain(p) for p in placements)
    else:
        leaves = pytree.tree_leaves((chosen.args_schema, chosen.kwargs_schema), is_leaf=lambda x: isinstance(x, DTensorSpec))
        expected = tuple(_spec_of(s) for s in leaves if isinstance(s, DTensorSpec))
        if len(expected) != len(placements):
            return "changes its argument structure under DTensor"
    specs = out.output_spec if isinstance(out.output_spec, (tuple, list)) else (out.output_spec,)
    return expected, tuple(_spec_of(s) if s is not None else None for s in specs)


def _plain(p: Placement) -> _Spec:
    return ("S", p.dim) if isinstance(p, Shard) else ("P", "sum") if isinstance(p, Partial) else ("R",)


def _spec_of(spec: Any) -> _Spec:
    from torch.distributed.tensor import Partial as DPartial, Replicate as DReplicate, Shard as DShard

    (p,) = spec.placements
    if type(p) is DShard:  # not _StridedShard, a subclass
        return ("S", p.dim)
    if isinstance(p, DReplicate):
        return ("R",)
    if isinstance(p, DPartial):
        return ("P", p.reduce_op)
    return ("?", str(p))


def _show(spec: _Spec) -> str:
    return {"R": "Replicate", "S": "Shard({})", "P": "Partial({})"}.get(spec[0], "{}").format(*spec[1:])


def _common_segments(op: OpOverload, given: dict[Node, Placement]) -> Optional[tuple[int, ...]]:
    """The segments of the multi-segment sharded inputs (all must agree); ``None`` if none."""
    multi = {p.segments for p in given.values() if isinstance(p, Shard) and len(p.segments) > 1}
    if len(multi) > 1:
        raise _unsupported(op, f"gets inputs sharded in different segments {sorted(map(list, multi))}")
    return next(iter(multi), None)


def _shard(op: OpOverload, dim: int, shape: tuple[int, ...], segments: Optional[tuple[int, ...]], ws: int) -> Shard:
    size = shape[dim]
    if segments is not None and sum(segments) != size:
        raise _unsupported(op, f"moves a fused dim with segments {list(segments)} to a dim of size {size}")
    shard = Shard(dim, segments or (size,))
    if not shard.divisible(ws):
        raise Conflict("not-divisible", f"{op} shards a dim of size {size}, not divisible by world_size {ws}", GATHER_INSTEAD)
    return shard


def _output(op: OpOverload, spec: Optional[_Spec], val: Any, segments: Optional[tuple[int, ...]], ws: int) -> Placement:
    if val is None:
        return REPLICATE
    if not isinstance(val, torch.Tensor):  # is_same_size, sym sizes: a number of the local shard
        raise _unsupported(op, f"returns a {type(val).__name__} that a rank would compute from its shard only")
    if spec is None:
        raise _unsupported(op, "returns a value DTensor computes outside the op (e.g. a scalar)")
    if spec[0] == "R":
        return REPLICATE
    if spec[0] == "S":
        return _shard(op, spec[1], tuple(val.shape), segments, ws)
    if spec == ("P", "sum") and val.is_floating_point():
        return Partial()
    raise _unsupported(op, f"returns {_show(spec)}, which fxtp does not represent")


def _unsupported(op: OpOverload, why: str) -> Conflict:
    return Conflict(
        "unsupported-op",
        f"op {op} {why}",
        f"{GATHER_INSTEAD}; or file an issue for the op",
    )
