"""MoE experts: grouped and batched matmuls over 3-D expert weights, sharded inside each expert.

Hugging Face's routed experts (``MixtralExperts``, ``Qwen2MoeExperts``: any class decorated with
``@use_experts_implementation``) store every expert's weights in one 3-D parameter:
``gate_up_proj`` ``(E, 2I, H)`` (gate rows, then up rows) and ``down_proj`` ``(E, H, I)``. Their
default ``grouped_mm`` implementation sorts the (token, expert) pairs by expert and runs, per
MoE block (``S`` = tokens x top_k, ``offs`` the cumulative count of pairs per expert)::

    %transpose_4 = aten.transpose.int(%gate_up_proj, -2, -1)                        # (E, H, 2I)
    %grouped_mm = transformers.grouped_mm_fallback(%x_sorted, %transpose_4, %offs)  # (S, 2I)
    %chunk = aten.chunk(%grouped_mm, 2, -1); ... %mul = silu(gate) * up              # (S, I)
    %transpose_5 = aten.transpose.int(%down_proj, -2, -1)                           # (E, I, H)
    %grouped_mm_1 = transformers.grouped_mm_fallback(%mul, %transpose_5, %offs)     # (S, H)

``transformers::grouped_mm_fallback`` is what ``torch.export`` records for weights other than
bf16 (transformers' ``_can_use_grouped_mm`` refuses ``torch.nn.functional.grouped_mm`` while
compiling non-bf16 weights); with bf16 weights it is ``aten._grouped_mm``. Both compute, for every
expert ``e``, ``out[offs[e-1]:offs[e]] = x[offs[e-1]:offs[e]] @ w[e]``.

Row ``i`` of the output depends on row ``i`` of ``x`` and on one expert's ``(K, N)`` matrix, so
each expert is one Megatron MLP (Shoeybi et al. 2019, section 3), sharded inside itself:

* colwise (a replicated ``x``): ``w`` sharded on ``N`` (``Shard(2)``; the parameter
  ``(E, N, K)`` on dim 1), output ``Shard(1)``. A fused ``gate_up`` gets segments ``(I, I)``
  from the ``chunk`` that follows (NOTE: [segments]), so each rank holds ``[gate_r | up_r]`` of
  every expert;
* rowwise (``x`` sharded on ``K``): ``w`` sharded on ``K``, output ``Partial``, all_reduced
  after the combine (the routing weights, the gather back to token order and the top-k sum are
  linear in it: NOTE: [deferred reduction] in ``passes/moe/reductions.py``).

Their ``batched_mm`` implementation gathers each pair's matrices instead and multiplies them by
``bmm`` (``is_transposed`` weights, gpt-oss's ``(E, H, 2I)``, sit on the right)::

    %index_4 = aten.index.Tensor(%gate_up_proj, [%expert_ids])                      # (S, 2I, H)
    %bmm = aten.bmm.default(%index_4, %unsqueeze_18)                                # (S, 2I, 1)
    %squeeze = aten.squeeze.dim(%bmm, -1); %chunk = aten.chunk(%squeeze, 2, -1) ...  # (S, 2I)
    %index_5 = aten.index.Tensor(%down_proj, [%expert_ids])                         # (S, H, I)
    %bmm_1 = aten.bmm.default(%index_5, %unsqueeze_19)                              # (S, H, 1)

The gathered ``(S, N, K)`` value is the parameter to the planner (NOTE: [gathered experts] in
``passes/propagate.py``), so each ``bmm`` is the same layer, every pair's row one expert's
matrix-vector product: :func:`experts_layer` serves both, told by :class:`ExpertDims` where
each operand keeps its features (the planner reads a ``bmm`` layer's output features from
``PlannerState.features``: they are not its last dim).

The router (a plain ``linear``) stays replicated: its input is replicated and its output feeds
a softmax/topk over the experts. The offsets and the sort are integer values, replicated.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch.fx import Node

from fxtp.core.placement import REPLICATE, Partial, Shard
from passes.registry import GATHER_INSTEAD, Conflict, Decision, LayerNote, RuleContext, register_rule, shape_of
from passes.rules._common import ndim

__all__ = ["BatchedOperands", "ExpertDims", "GroupedOperands", "GROUPED_MM_OPS", "batched_operands", "experts_layer", "grouped_operands", "is_grouped_mm"]

aten = torch.ops.aten

# transformers registers its op on import (transformers/integrations/moe.py); the registry
# matches it by qualified name, so fxtp does not import transformers.
_TRANSFORMERS_GROUPED_MM = "transformers::grouped_mm_fallback"
GROUPED_MM_OPS = (aten._grouped_mm.default, _TRANSFORMERS_GROUPED_MM)


class GroupedOperands(NamedTuple):
    """Operands of a grouped matmul layer: ``x`` ``(S, K)``, ``weight`` ``(E, K, N)`` as the
    op sees it (a 3-D parameter or its transpose), ``offs`` ``(E,)``."""

    x: Node
    weight: Node
    offs: Node


def is_grouped_mm(node: Node) -> bool:
    """Is ``node`` a call of ``aten._grouped_mm`` or transformers' ``grouped_mm_fallback``?"""
    if node.op != "call_function":
        return False
    target = node.target
    return target is aten._grouped_mm.default or (
        isinstance(target, torch._ops.OpOverload) and target.name() == _TRANSFORMERS_GROUPED_MM
    )


def grouped_operands(node: Node, is_param: Callable[[Node], bool]) -> Optional[GroupedOperands]:
    """The operands of ``node`` if it is a grouped matmul of a 2-D input with a 3-D parameter
    weight (no bias, no output dtype), else ``None``."""
    if not is_grouped_mm(node):
        return None
    x, w = node.args[:2]
    offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
    extras = list(node.args[3:]) + [v for k, v in node.kwargs.items() if k != "offs"]
    if not (isinstance(x, Node) and isinstance(w, Node) and isinstance(offs, Node)) or any(e is not None for e in extras):
        return None
    if ndim(x) != 2 or ndim(w) != 3 or not is_param(w):
        return None
    return GroupedOperands(x, w, offs)


class BatchedOperands(NamedTuple):
    """Operands of a batched matmul layer of MoE experts (the module docstring): ``x`` and the
    weight as ``bmm`` sees them, and where each keeps its features."""

    x: Node
    weight: Node
    dims: "ExpertDims"


def batched_operands(node: Node, is_param: Callable[[Node], bool]) -> Optional[BatchedOperands]:
    """The operands of ``node`` if it is a ``bmm`` of an activation with a 3-D parameter (its
    rows gathered by expert, its transpose, or itself), else ``None``.

    ``bmm(w (B, N, K), x (B, K, M))``: ``x``'s features on dim 1, the output's on dim 1;
    ``bmm(x (B, M, K), w (B, K, N))``: ``x``'s on dim 2, the output's on dim 2.
    """
    if node.op != "call_function" or node.target is not aten.bmm.default or len(node.args) != 2:
        return None
    a, b = node.args
    if not (isinstance(a, Node) and isinstance(b, Node)) or is_param(a) == is_param(b):
        return None
    if is_param(a):  # Hugging Face's default layout: (S, 2I, H) @ (S, H, 1)
        return BatchedOperands(b, a, ExpertDims(x=1, k=2, n=1, out=1))
    return BatchedOperands(a, b, ExpertDims(x=2, k=1, n=2, out=2))  # is_transposed (gpt-oss): (S, 1, H) @ (S, H, 2I)


@register_rule(*GROUPED_MM_OPS)
def grouped_mm_rule(ctx: RuleContext) -> Decision:
    """A grouped matmul with a 3-D expert weight: colwise on a replicated input, rowwise on one
    sharded on its features (the module docstring)."""
    ops = grouped_operands(ctx.node, ctx.is_param)
    if ops is None:  # between activations, or with a bias: nothing of it is sharded
        sharded = [a for a in ctx.node.all_input_nodes if isinstance(ctx.placement(a), Shard)]
        if sharded:
            raise Conflict("unsupported-op", f"{ctx.node.target} with a sharded operand and no 3-D parameter weight", GATHER_INSTEAD)
        return Decision(REPLICATE)
    if isinstance(ctx.placement(ops.offs), Shard):  # offs index every row of x
        raise Conflict("layout-mismatch", "grouped matmul with its offsets sharded", GATHER_INSTEAD)
    return experts_layer(ctx, ops.x, ops.weight, ExpertDims(x=1, k=1, n=2, out=1))


class ExpertDims(NamedTuple):
    """Where an experts matmul keeps its features: the contraction dim of ``x`` (``x``) and of
    the weight as the op sees it (``k``), the weight's output features (``n``) and the
    output's (``out``)."""

    x: int
    k: int
    n: int
    out: int


def experts_layer(ctx: RuleContext, x: Node, w: Node, dims: ExpertDims) -> Decision:
    """Every expert one Megatron MLP, sharded inside itself: colwise (``w`` on ``dims.n``, output
    on ``dims.out``, segments from NOTE: [segments]) on a replicated ``x``, rowwise (``w`` on
    ``dims.k``, output ``Partial``) on an ``x`` sharded on ``dims.x``. Any other shard of ``x``
    (its rows, which pick the experts) is refused."""
    k, n = shape_of(w)[dims.k], shape_of(w)[dims.n]
    px, state = ctx.placement(x), ctx.layer()
    whole = {w: REPLICATE}
    if isinstance(px, Shard) and px.dim != dims.x:
        # each row is one (token, expert) pair: a shard of the rows breaks the groups / the gathered weights
        raise Conflict("layout-mismatch", f"experts matmul with its input sharded on dim {px.dim}, not on features", GATHER_INSTEAD)
    if isinstance(px, Shard) and (px.overlaps or not px.divisible(ctx.world_size)):
        raise Conflict("not-divisible", f"experts matmul whose input features come uneven ({px})", f"use a world_size that divides {k}")
    if isinstance(px, Shard) and state.demoted is not None or isinstance(px, Shard) and state.forced == "colwise":
        code = (state.demoted.code if state.demoted is not None else None) or "user-plan"
        raise Conflict(code, "the expert layer stays whole, so its input must be replicated", "drop the plan entry for the consumer")
    if isinstance(px, Shard) or state.forced == "rowwise":
        shard = px if isinstance(px, Shard) else Shard(dims.x, (k,))
        if not shard.divisible(ctx.world_size):
            return Decision(REPLICATE, whole, layer=_not_divisible(k, ctx.world_size))
        wants = {w: shard.with_dim(dims.k)}
        if not isinstance(px, Shard):
            wants[x] = shard
        reason = (
            "every expert rowwise on its intermediate dim; all_reduce of its partial sums, moved past the routing "
            "weights and the top-k sum where they follow (NOTE: [deferred reduction] in passes/moe/reductions.py)"
        )
        return Decision(Partial(), wants, layer=LayerNote("rowwise", reason))
    if state.demoted is not None:
        return Decision(REPLICATE, whole, layer=state.demoted)
    segments = state.segments or (n,)
    if any(s % ctx.world_size for s in segments):
        return Decision(REPLICATE, whole, layer=_not_divisible(n, ctx.world_size))
    reason = "every expert colwise on its intermediate dim; output stays sharded until a rowwise layer"
    if len(segments) > 1:
        reason += f"; fused output, each rank holds its block of every segment {list(segments)}"
    return Decision(Shard(dims.out, segments), {w: Shard(dims.n, segments)}, layer=LayerNote("colwise", reason))


def _not_divisible(size: int, ws: int) -> LayerNote:
    return LayerNote(
        "replicate",
        f"expert intermediate size {size} is not divisible by world_size {ws}",
        code="not-divisible",
        fix=f"use a world_size that divides {size}",
    )
