"""Which rule answers an op: fxtp's own, its functional op's, or DTensor's.

``rule_for(op)`` is what propagation asks for every node with a sharded input:

1. the op's own rule in the registry (fxtp knows best: layers, segments, shape literals);
2. for an in-place op (``relu_``, ``add_.Tensor``, ``masked_fill_.Scalar``) or an ``out=``
   variant (``atan2.out``), the rule of its functional op (``relu``, ``add.Tensor``, ...), its
   own or DTensor's, guarded by NOTE: [mutated layout];
3. DTensor's sharding propagation (``passes.rules.dtensor_fallback``).

NOTE: [mutated layout]
An in-place op writes into its ``self``; an ``out=`` op into its ``out`` tensors. The rank's
local op writes into the local tensor, so the written tensor must already have the placement
the functional rule gives the output: ``relu_`` on a ``Shard(2)`` value stays local, while
``x.add_(y)`` with ``x`` replicated and ``y`` sharded would leave ``x`` holding only this
rank's slice of the sum (every later use of ``x`` would read it). That is a Conflict; so is a
rule that would run another op on the rank (``local_target``), which would not write.

NOTE: [sharded state]
One written tensor may take the op's layout instead: a model *state* (a buffer or constant that
the graph writes in place, e.g. a static KV cache's ``index_copy_(2, cache_position, k)``), when
it is replicated and the op's result would be sharded. Such a state is a placeholder that the
planner stores like a parameter (it is in ``param_fqns``, see ``fxtp.api``): the rule *wants* it
in the result's layout, so every rank keeps and updates only its slice (its kv heads' cache).
Its other uses must agree, as a tied parameter's do.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, Optional

import torch
from torch.fx import Node

from fxtp.core.placement import Replicate, Shard
from passes.registry import Conflict, Decision, Rule, RuleContext, get_rule, is_tensor_node, overlap_ok, takes_overlap, takes_uneven, uneven_ok
from passes.rules.dtensor_fallback import dtensor_rule

__all__ = ["rule_for", "functional_variant"]

aten = torch.ops.aten
OpOverload = torch._ops.OpOverload


def rule_for(op: Any) -> Optional[Rule]:
    """The rule for ``op`` (an ``OpOverload`` or another call target), or ``None``: only
    non-ATen targets without a registered rule have none."""
    rule = get_rule(op)
    if rule is not None or not isinstance(op, OpOverload):
        return rule
    functional = functional_variant(op)
    if functional is None:
        return functools.partial(dtensor_rule, op)
    return _variant_rule(op, functional)


def _written(op: OpOverload) -> list[tuple[int, str]]:
    """``(position, name)`` of the arguments ``op`` writes into."""
    return [(i, a.name) for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def _read_signature(op: OpOverload) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in op._schema.arguments if a.alias_info is None or not a.alias_info.is_write]


@functools.cache
def functional_variant(op: OpOverload) -> Optional[OpOverload]:
    """The functional op of an in-place or ``out=`` op, resolved by name; ``None`` for a
    functional op (or a mutating one without a functional twin).

    ``relu_.default`` -> ``relu.default`` (strip the packet's trailing ``_``, same overload);
    ``add.out`` -> ``add.Tensor`` (the overload of the same packet whose arguments are the
    ``out`` overload's, less the written ``out`` tensors).
    """
    written = _written(op)
    if not written:
        return None
    packet = op.overloadpacket.__name__
    names = [a.name for a in op._schema.arguments]
    if not any(op._schema.arguments[i].kwarg_only for i, _ in written):  # in-place: self is written
        base = getattr(aten, packet[:-1], None) if packet.endswith("_") and not packet.endswith("__") else None
        if base is None or op._overloadname not in base.overloads():
            return None
        functional = getattr(base, op._overloadname)
        return functional if [a.name for a in functional._schema.arguments] == names else None
    want = _read_signature(op)  # out= variant: the overload reading the same arguments
    for name in op.overloadpacket.overloads():
        candidate = getattr(op.overloadpacket, name)
        if not _written(candidate) and _read_signature(candidate) == want:
            return candidate
    return None


def _variant_rule(op: OpOverload, functional: OpOverload) -> Rule:
    own = get_rule(functional)
    written = _written(op)
    skip = frozenset(name for i, name in written if op._schema.arguments[i].kwarg_only)

    def variant_rule(ctx: RuleContext) -> Decision:
        dec = own(ctx) if own is not None else dtensor_rule(functional, ctx, skip)
        outs = dec.out if isinstance(dec.out, tuple) else (dec.out,)
        for (i, name), out in zip(written, outs):
            arg = ctx.node.args[i] if i < len(ctx.node.args) else ctx.node.kwargs.get(name)
            if not is_tensor_node(arg):
                continue
            have = ctx.placement(arg)
            if _stored_in_layout(ctx, arg, have, out, dec):  # NOTE: [sharded state]
                dec = replace(dec, wants={**dec.wants, arg: out})
                continue
            if have != out or dec.wants.get(arg, have) != have or dec.local_target is not None:
                raise Conflict(
                    "unsupported-op",
                    f"{op} writes into {arg.name} ({have}) but its result would be {out} (NOTE: [mutated layout])",
                    "keep the producing layer replicated (fxtp does), or use the out-of-place op",
                )
        return dec

    variant_rule.__name__ = f"{functional.overloadpacket.__name__}_variant_rule"
    if takes_uneven(own):
        variant_rule = uneven_ok(variant_rule)
    return overlap_ok(variant_rule) if takes_overlap(own) else variant_rule


def _stored_in_layout(ctx: RuleContext, arg: Node, have: Any, out: Any, dec: Decision) -> bool:
    """A replicated state placeholder written with a sharded result: stored sharded instead."""
    return (
        arg.op == "placeholder"
        and ctx.is_param(arg)
        and isinstance(have, Replicate)
        and isinstance(out, Shard)
        and dec.wants.get(arg, have) in (have, out)
        and dec.local_target is None
    )
