"""Deferred reductions: an all_reduce moved past the ops that are linear in the partial sum.

NOTE: [deferred reduction]
A rowwise layer's output is ``Partial``: rank ``r`` holds a summand ``y_r``, the value is
``sum_r y_r``. For an op ``g`` linear in that value (a view, a row gather, a sum over a dim, a
product with a replicated value, a bias-free linear layer with a replicated weight, the sum of
two partial values), ``g(sum_r y_r) ==
sum_r g(y_r)``, so the all_reduce can run after ``g`` instead of before it, on the (often
smaller) result. MoE experts are the case that matters: the experts' down projection gives a
partial ``(tokens x top_k, hidden)`` output, then the routing weights multiply it, a gather
restores the token order and a sum over the top-k combines it to ``(tokens, hidden)``; reducing
after the combine moves ``1 / top_k`` of the bytes (Megatron-LM reduces the combined output
too). Qwen2-MoE's shared expert output is partial as well and is added to the routed one: the
sum of the two is reduced once. A LoRA pair beside a rowwise base layer (PEFT's and
torchtitan's plan: ``lora_A`` rowwise, ``lora_B`` replicated) is the other: ``A``'s partial
``(tokens, r)`` output goes through ``B`` partial and is added to the base layer's partial
output, one all_reduce for the two (a biased base layer keeps its own: its bias is added after
it). Past a product with a replicated weight the reduction is a trade: the forward all_reduce
of the ``(tokens, r)`` value goes, the weight's gradient (each rank's is a partial sum) is
all_reduced in backward instead; fxtp defers only when the weight has no more elements than
the value (``r x out <= tokens x r``: a micro-batch of at least ``out`` tokens), which also
removes a collective from the forward's critical path.

A replicated float operand of such a product (the routing weights, a sigmoid gate) meets a
partial value: its gradient on each rank is only the part from that rank's summand, so it
enters through Megatron's ``f`` (identity forward, all_reduce backward), like any replicated
value entering a sharded region (NOTE: [replicated parameter in a sharded region]). The
forward saves ``(top_k - 1) x tokens x hidden`` elements per block; the backward adds an
all_reduce of the ``(tokens x top_k,)`` routing weights.

A partial value is moved only into its single user (a value also used elsewhere is reduced
where it is). The same holds for in-place ops (``mlp_output += attention_output`` in Falcon's
parallel attention and MLP: the two partial outputs of a block are summed, then reduced once)
and ``index_add`` (expert-choice MoE: each expert's partial rows are added
into one output, whose zeros every rank holds alike: a zero is a summand too).

NOTE: [bias share]
A rowwise layer's bias is added once, after its all_reduce; deferring that all_reduce would
leave the bias inside the sum of the ranks' values, added ``ws`` times. Instead each rank adds
``bias / ws`` to its own summand (``fxtp.core.local_ops.add_bias_share``), and the deferred
all_reduce adds the ``ws`` shares back to the bias. Backward, the gradient arriving there is
whole on every rank (the all_reduce's backward is the identity, the ops in between are linear
with replicated operands), so the bias's gradient is that gradient summed, as on one device:
the op's backward does not divide it by ``ws``. ``bias / ws`` is exact for a power-of-two
``ws``; otherwise the sum of the shares may differ from the bias in the last bit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.fx import Graph, Node

from fxtp.core.placement import Partial, Replicate
from passes.plan import ShardingPlan
from passes.propagate import EdgeAction
from passes.registry import is_tensor_node, shape_of
from passes.rules.variants import functional_variant

__all__ = ["defer_reductions"]

aten = torch.ops.aten

# Ops linear in their first argument, the others being shapes or dims.
_LINEAR_IN_FIRST = frozenset(
    {
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.transpose.int,
        aten.permute.default,
        aten.sum.dim_IntList,
        aten.clone.default,
        aten.neg.default,
    }
)


# Shape queries a dynamic-shape capture adds (``sym_size.int(x, 0)``): not uses of the values,
# and a Partial value has its full shape, so they do not stop a deferral.
_SHAPE_QUERIES = frozenset({aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default})


def _uses(node: Node) -> list[Node]:
    return [u for u in node.users if u.target not in _SHAPE_QUERIES]


# Values every rank holds as zeros: a zero is a summand of a partial sum on every rank (the sum
# of ws zeros is zero), so ``out = zeros_like(x); out.index_add_(0, ids, partial)`` stays partial.
_ZEROS = frozenset({aten.zeros_like.default, aten.zeros.default, aten.new_zeros.default})
_FILLS = frozenset({aten.full.default, aten.full_like.default, aten.new_full.default})


def _is_zeros(node: Node) -> bool:
    if node.op != "call_function" or not is_tensor_node(node) or not node.meta["val"].is_floating_point():
        return False
    if node.target in _ZEROS:
        return True
    fill = node.args[2] if node.target is aten.new_full.default else node.args[1] if len(node.args) > 1 else None
    return node.target in _FILLS and isinstance(fill, (int, float)) and fill == 0


def _dropout_is_identity(node: Node) -> bool:
    """``dropout(x, p, train)`` with ``p == 0`` or ``train`` off returns ``x`` (GPT-NeoX's
    ``post_attention_dropout`` with ``hidden_dropout=0``)."""
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return (isinstance(p, (int, float)) and p == 0) or train is False


def _linear_in(node: Node, partial: set[Node], plan: ShardingPlan) -> bool:
    """Is ``node`` linear in its inputs that are in ``partial`` (the others replicated)?

    An in-place op (``add_``, ``mul_``, ``index_add_``) answers as its functional op, provided it
    writes into a partial value (a replicated tensor written with a summand would be read as
    the whole value by its other uses)."""
    target, args = node.target, node.args
    ins = [a for a in node.all_input_nodes if a in partial]
    functional = functional_variant(target) if isinstance(target, torch._ops.OpOverload) else None
    if functional is not None:
        if not args or args[0] not in partial:
            return False
        target = functional
    others = [a for a in node.all_input_nodes if a not in partial and is_tensor_node(a)]  # not sym sizes
    if any(not isinstance(plan.placements.get(a.name), Replicate) for a in others):
        return False
    first = args[0] if args else None
    if target in _LINEAR_IN_FIRST:
        return ins == [first] and not others and not node.kwargs
    if target is aten.index.Tensor:  # a gather of rows by replicated integer indices
        return ins == [first] and all(not a.meta["val"].is_floating_point() for a in others)
    if target is aten.to.dtype:  # a no-op cast only: rounding summands is not rounding their sum
        return ins == [first] and args[1] == first.meta["val"].dtype and not node.kwargs
    if target is aten.mul.Tensor:
        return len(ins) == 1 and ins[0] in args[:2] and args.count(ins[0]) == 1
    if target is aten.div.Tensor:
        return ins == [first] and args[1] is not first
    if target is aten.linear.default:  # (sum_r x_r) W^T == sum_r x_r W^T; a bias is added once, not per summand
        plain = ins == [first] and (len(args) < 3 or args[2] is None) and node.kwargs.get("bias") is None
        return plain and _cheaper_past(first, args[1])
    if target in (aten.mm.default, aten.matmul.default):
        return len(ins) == 1 and ins[0] in args[:2] and args[0] is not args[1] and _cheaper_past(ins[0], args[1] if ins[0] is first else first)
    if target in (aten.add.Tensor, aten.sub.Tensor):  # sum_r a_r + sum_r b_r == sum_r (a_r + b_r)
        return len(ins) == 2 and set(args[:2]) == set(ins) and node.kwargs.get("alpha", 1) == 1
    if target is aten.dropout.default:
        return ins == [first] and _dropout_is_identity(node)
    if target is aten.index_add.default:  # out.index_add(dim, ids, src): a sum of out and scattered rows of src
        return len(ins) == 2 and ins == [first, args[3]] and not args[2].meta["val"].is_floating_point()
    return False


def _cheaper_past(value: Node, weight: Any) -> bool:
    """Is moving ``value``'s all_reduce past a product with the replicated ``weight`` no dearer?
    The forward all_reduce of ``value`` goes; the weight's gradient, a partial sum on each rank,
    is all_reduced in backward instead (its ``f``): worth it when the weight has no more
    elements than ``value`` (NOTE: [deferred reduction])."""
    if not isinstance(weight, Node) or not isinstance(weight.meta.get("val"), torch.Tensor):
        return False
    # the example's sizes, without a guard (registry.shape_of): either choice is correct, only its cost differs
    return math.prod(shape_of(weight)) <= math.prod(shape_of(value))


def defer_reductions(graph: Graph, plan: ShardingPlan) -> ShardingPlan:
    """Move each all_reduce of a ``Partial`` value past the ops linear in it (NOTE: [deferred
    reduction]); returns the updated plan (placements, reductions, ``f`` entries, bias shares).

    A rowwise output with a bias is moved only where its reduction then merges with another
    partial value's (one all_reduce fewer, NOTE: [bias share]); elsewhere it keeps its own.

    Reads ``node.meta["val"]`` and the plan; does not modify the graph.
    """
    nodes = {n.name: n for n in graph.nodes}
    biased = {nodes[name] for name, bias in plan.reduces.items() if bias is not None}
    starts = {nodes[name] for name in plan.reduces}
    while True:
        partial, moved, into = _deferred(graph, starts, plan)
        # A bias share or a no-op dropout is taken only where the reduction then merges with another.
        lone = {n for n in moved if _merged_starts(n, into, starts) == {n} and (n in biased or _through_dropout(n, into))}
        if not lone:
            break
        starts -= lone
    if not moved:
        return plan
    placements: dict[str, Any] = dict(plan.placements)
    edges = dict(plan.edges)
    accepted = set(into.values())
    for node in partial - starts:  # the ops the reductions moved past, and zero summands
        placements[node.name] = Partial()
    for node in accepted:
        for a in node.all_input_nodes:
            if a not in partial and is_tensor_node(a) and a.meta["val"].is_floating_point():
                edges.setdefault((node.name, a.name), EdgeAction("enter"))
    reduces = {name: bias for name, bias in plan.reduces.items() if nodes[name] not in moved}
    reduces.update({n.name: None for n in partial if n not in moved and n.name not in reduces})
    shares = {name: bias for name, bias in plan.reduces.items() if bias is not None and nodes[name] in moved}  # NOTE: [bias share]
    return dataclasses.replace(plan, placements=placements, edges=edges, reduces=reduces, bias_shares={**plan.bias_shares, **shares})


def _deferred(graph: Graph, starts: set[Node], plan: ShardingPlan) -> tuple[set[Node], set[Node], dict[Node, Node]]:
    """From the partial values ``starts``: every partial value once the reductions move, the
    moved ones, and each moved value's user that took its reduction."""
    partial = set(starts)
    into: dict[Node, Node] = {}
    for node in graph.nodes:
        if node.op != "call_function" or not any(a in partial for a in node.all_input_nodes):
            continue
        zeros = {a for a in node.all_input_nodes if a not in partial and _is_zeros(a) and len(_uses(a)) == 1}
        ins = [a for a in node.all_input_nodes if a in partial or a in zeros]
        if any(len(_uses(a)) != 1 for a in ins) or not _linear_in(node, partial | zeros, plan):
            continue
        partial |= zeros | {node}
        into.update((a, node) for a in ins)
    return partial, set(into), into


def _through_dropout(node: Node, into: dict[Node, Node]) -> bool:
    while node in into:
        node = into[node]
        if node.target is aten.dropout.default:
            return True
    return False


def _merged_starts(node: Node, into: dict[Node, Node], starts: set[Node]) -> set[Node]:
    """The starting partial values whose reduction ends in the same all_reduce as ``node``'s."""
    root = node
    while root in into:
        root = into[root]
    out, todo = set(), [root]
    while todo:
        n = todo.pop()
        if n in starts:
            out.add(n)
        todo.extend(a for a, user in into.items() if user is n)
    return out
