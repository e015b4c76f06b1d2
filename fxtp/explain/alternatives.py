"""Each layer's alternative styles and their predicted collective and parameter bytes.

NOTE: [layer alternatives]
The passes choose a layer's style and keep no figures for the styles they did not choose, so
the report computes them here from the layer's shapes in the captured graph (its input's and
output's ``meta["val"]``, its weight and bias), in the report's own convention
(:class:`~fxtp.explain.counts.CollectiveStat`: the full tensors' payload bytes, per pass over the
example input; parameter bytes on rank 0, ``ceil`` of an uneven shard). For a linear layer
``y = x W^T (+ b)`` over ``t`` ranks (Megatron, Shoeybi et al. 2019, section 3):

- ``replicate``: no collective; the whole weight and bias on each rank.
- ``colwise (paired)``, its output staying sharded into a rowwise layer: forward none,
  backward an all_reduce of the input's gradient (when the input needs one); ``W`` and ``b``
  by rows.
- ``rowwise (paired)``, its input arriving sharded from a colwise layer: forward an
  all_reduce of the output, backward none; ``W`` by columns, the bias whole.
- ``colwise, gathered`` (alone): the pair's colwise figures plus a forward all_gather of the
  output (and, in backward, the slice of its gradient, no collective).
- ``rowwise, sliced`` (alone): the pair's rowwise figures plus the backward all_gather of the
  input's gradient (the forward slices the input locally).

For an embedding ``y = W[ids]`` (``W`` ``(V, D)``; the ids need no gradient):

- ``replicate``: no collective; the whole table.
- ``rowwise (vocab-parallel)`` (Megatron-LM's ``VocabParallelEmbedding``): rows of ``W``; each
  rank zeroes the ids outside its rows, forward an all_reduce of the output, backward none.
- ``colwise (by columns)``: columns of ``W``, output sharded on ``D`` into consumers that take
  it so (NOTE: [column-sharded embedding]): no collective.
- ``colwise, gathered``: by columns, the output all_gathered in forward for a consumer that
  needs it whole (its gradient is sliced in backward, no collective).

3-D expert weights: NOTE: [expert alternatives] below.

The chosen alternative's figures are the plan's own collectives, each counted on one layer, so
the chosen alternatives sum to the report's collectives (:func:`report_alternatives`, in graph
order): a value's ``f`` (all_reduce of its gradient, one per value: ``passes/propagate.py``) on
the first colwise layer reading it (q, k and v read one input) or, for a replicated value that
meets a layer's sharded output before the next layer (a bias gathered per expert, a gate) or a
rowwise layer's partial value before its all_reduce (the routing weights), on that layer; a
rowwise layer's all_reduce where the plan puts it, past the ops linear in the partial value
(NOTE: [deferred reduction] in passes/moe/reductions.py), on the first layer reaching it (a
shared expert's and the routed experts' sum, a LoRA pair and its base layer: one all_reduce);
the all_reduce of a grouped shard's gradient over its holders (NOTE: [grouped shards]) on the
layer it is a weight of. The other alternatives are priced from shapes, as above, less the
``f`` an earlier layer carries. Layers of other ops (GPT-2's ``Conv1D`` ``addmm``, an ``mm`` or
``matmul`` of a parameter) have no alternatives yet, so their collectives are in no row.

Priced without sequence parallelism (under it an all_reduce becomes an all_gather and
reduce_scatter pair moving the same bytes). The chosen alternative is the one named by the
layer's style; a colwise layer is taken as gathered when it is the output head
(``LayerDecision.output_head``) or, for an embedding, when the plan gathers its output, else as
one of a pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx.experimental.symbolic_shapes import optimization_hint

from fxtp.core.errors import FxtpPlanError
from fxtp.core.placement import holder_layout
from fxtp.explain.counts import fmt_bytes, nbytes_of
from passes.moe.blocks import ExpertBlock, find_expert_blocks
from passes.plan import ShardingPlan

__all__ = ["report_alternatives", "layer_alternatives", "embedding_alternatives", "expert_alternatives", "ExpertLayers",
           "expert_layers", "alternatives_text"]


def _bytes(val: Any) -> int:
    return nbytes_of(val) if val is not None else 0


def _rows(table: list[tuple[str, int, int, int]], chosen: str | None) -> list[dict[str, Any]]:
    return [{"style": s, "forward_bytes": f, "backward_bytes": b, "param_bytes_per_rank": p, "chosen": s == chosen}
            for s, f, b, p in table]


def layer_alternatives(layer: Any, nodes: dict[str, Any], state: dict[str, Any], world_size: int,
                       needs_grad: set[str], carried: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """The alternatives of one ``linear`` layer (NOTE: [layer alternatives]); ``[]`` for others.

    Args:
        layer: its ``LayerDecision``.
        nodes: the captured graph's nodes by name (``meta["val"]`` read).
        state: the captured program's state dict (parameter FQN -> tensor): the weight's dtype.
        world_size: the tensor-parallel degree ``t``.
        needs_grad: the names of the nodes whose value needs a gradient.
        carried: values whose gradient's all_reduce an earlier colwise layer carries.

    Returns:
        Per alternative: ``style``, ``forward_bytes`` and ``backward_bytes`` (collective payload
        bytes, full tensors), ``param_bytes_per_rank`` (rank 0's), ``chosen``.
    """
    node = nodes.get(layer.node)
    if layer.op != "linear" or node is None or len(node.args) < 2 or world_size <= 1:
        return []
    x = node.args[0]
    x_bytes = _bytes(x.meta.get("val")) if hasattr(x, "meta") else 0
    name = getattr(x, "name", None)
    grad_bytes = x_bytes if name in needs_grad and name not in carried else 0
    y_bytes = _bytes(node.meta.get("val"))
    weight = state.get(layer.weight)
    if weight is None or len(layer.weight_shape) != 2:
        return []
    bias_node = node.args[2] if len(node.args) > 2 else None
    bias = _bytes(bias_node.meta.get("val")) if hasattr(bias_node, "meta") else 0
    out_f, in_f = layer.weight_shape  # a split piece's own rows (NOTE: [fused slices])
    size = weight.element_size()
    rows = math.ceil(out_f / world_size) * in_f * size + (math.ceil(bias / size / world_size) * size if bias else 0)
    cols = out_f * math.ceil(in_f / world_size) * size + bias
    chosen = {"replicate": "replicate", "colwise": "colwise, gathered" if layer.output_head else "colwise (paired)",
              "rowwise": "rowwise (paired)"}.get(layer.style)
    return _rows([
        ("replicate", 0, 0, out_f * in_f * size + bias),
        ("colwise (paired)", 0, grad_bytes, rows),
        ("rowwise (paired)", y_bytes, 0, cols),
        ("colwise, gathered", y_bytes, grad_bytes, rows),
        ("rowwise, sliced", y_bytes, x_bytes if name in needs_grad else 0, cols),
    ], chosen)


def embedding_alternatives(layer: Any, nodes: dict[str, Any], state: dict[str, Any], world_size: int,
                           gathered: bool) -> list[dict[str, Any]]:
    """The alternatives of one ``embedding`` layer (NOTE: [layer alternatives]); ``[]`` for others.

    Args:
        layer, nodes, state, world_size: as :func:`layer_alternatives`.
        gathered: the plan all_gathers the layer's output (a colwise table whose consumer needs
            it whole).

    Returns:
        As :func:`layer_alternatives`: ``replicate``, ``rowwise (vocab-parallel)``, ``colwise
        (by columns)``, ``colwise, gathered``.
    """
    node = nodes.get(layer.node)
    weight = state.get(layer.weight)
    if layer.op != "embedding" or node is None or weight is None or len(layer.weight_shape) != 2 or world_size <= 1:
        return []
    vocab, dim = layer.weight_shape
    size = weight.element_size()
    y_bytes = _bytes(node.meta.get("val"))
    chosen = {"replicate": "replicate", "rowwise": "rowwise (vocab-parallel)",
              "colwise": "colwise, gathered" if gathered else "colwise (by columns)"}.get(layer.style)
    cols = vocab * math.ceil(dim / world_size) * size
    return _rows([
        ("replicate", 0, 0, vocab * dim * size),
        ("rowwise (vocab-parallel)", y_bytes, 0, math.ceil(vocab / world_size) * dim * size),
        ("colwise (by columns)", 0, 0, cols),
        ("colwise, gathered", y_bytes, 0, cols),
    ], chosen)


# NOTE: [expert alternatives]
# A routed-experts block (``passes/moe/blocks.py``: ``hidden`` ``(T, H)`` made into ``S = T k``
# rows, the experts' grouped matmuls on them, the ``result`` ``(S, H)`` weighted by the routing
# weights ``(T, k)`` and summed over the top-k into ``output`` ``(T, H)``) has, per layer, in the
# convention of NOTE: [layer alternatives] above (``x`` ``(S, K)`` the layer's input,
#, ``N`` its output features, ``t`` the ranks):
#
# - ``replicate``: no collective; the whole ``E N K`` weight.
# - ``colwise (paired)`` (tensor parallelism inside every expert, ``passes/rules/experts.py``):
#   ``N`` sharded; backward an all_reduce of ``x``'s gradient.
# - ``rowwise (paired)``: ``K`` sharded; forward an all_reduce of the partial sums. For the
#   block's last layer it is deferred past the routing weights and the top-k sum (NOTE:
#   [deferred reduction] in ``passes/moe/reductions.py``): of ``output``, ``(T, H)``, and the
#   routing weights enter through ``f``, whose gradient is all_reduced in backward. Elsewhere, of
#   the layer's output.
# - ``expert`` (``expert_parallel=True``, NOTE: [expert parallelism] in
#   ``fxtp/core/expert_dispatch.py``; only for a block fxtp can dispatch): ``ceil(E / t)`` whole
#   experts on rank 0. The block's collectives (``fxtp.explain.counts.expert_comms``) are split
#   as the pair's are: its first layer carries the dispatch (forward the all_to_all of the
#   ``S H`` rows; backward its reverse and the all_gather of ``hidden``'s gradient), its last
#   the combine (forward the all_to_all of the ``S H`` result rows and the all_reduce of the
#   ``Partial`` ``output``; backward the reverse all_to_all and the all_gather of the routing
#   weights' gradient). A layer between them carries none.
#
# Expert biases (``(E, N)``, gathered by expert) are other parameters, not priced here (the
# ``f`` of a gathered bias is the chosen colwise layer's, NOTE: [layer alternatives]). The
# chosen ``expert`` row's output all_reduce is counted once with a shared expert's that is
# summed with it (Qwen2-MoE).


@dataclass(frozen=True)
class ExpertLayers:
    """The experts blocks and, per block, its layers' nodes in graph order."""

    blocks: tuple[ExpertBlock, ...]
    by_weight: dict[str, int]  # parameter FQN -> index of its block
    layer_nodes: tuple[tuple[str, ...], ...]  # per block: its layers' node names, graph order


def expert_layers(program: ExportedProgram, plan: ShardingPlan) -> ExpertLayers:
    """The plan's expert-parallel blocks, else the graph's experts blocks (none when a module
    with 3-D parameters is not one fxtp can dispatch: its layers then have no ``expert``
    alternative, and their rowwise reduction is priced where the layer is)."""
    fqns = {s.arg.name: s.target for s in program.graph_signature.input_specs if s.kind == InputKind.PARAMETER}
    blocks = plan.experts
    if not blocks:
        try:
            blocks = find_expert_blocks(program.graph, fqns)
        except FxtpPlanError:
            blocks = ()
    by_weight = {fqns[p]: i for i, block in enumerate(blocks) for p in block.params}
    layers = {layer.node for layer in plan.layers}
    return ExpertLayers(blocks, by_weight, tuple(tuple(n for n in b.region if n in layers) for b in blocks))


def expert_alternatives(layer: Any, nodes: dict[str, Any], state: dict[str, Any], world_size: int,
                        needs_grad: set[str], carried: frozenset[str], experts: ExpertLayers) -> list[dict[str, Any]]:
    """The alternatives of one 3-D expert layer (NOTE: [expert alternatives]); ``[]`` for others.

    Args:
        layer: its ``LayerDecision``.
        nodes: the captured graph's nodes by name (``meta["val"]`` read).
        state: the captured program's state dict (parameter FQN -> tensor).
        world_size: the degree ``t``.
        needs_grad: the names of the nodes whose value needs a gradient.
        carried: values whose gradient's all_reduce an earlier colwise layer carries.
        experts: the graph's experts blocks (:func:`expert_layers`).

    Returns:
        As :func:`layer_alternatives`: ``replicate``, ``colwise
        (paired)``, ``rowwise (paired)`` and, in a block fxtp can dispatch, ``expert``.
    """
    node, weight = nodes.get(layer.node), state.get(layer.weight)
    if node is None or weight is None or len(layer.weight_shape) != 3 or world_size <= 1 or not node.args:
        return []
    x, out = node.args[0], node.meta.get("val")
    e, a, b = layer.weight_shape
    n = int(optimization_hint(out.shape[-1])) if out is not None and out.dim() else 0
    if n not in (a, b):
        return []
    k = a * b // n
    size = weight.element_size()
    x_name = getattr(x, "name", None)
    grad = _bytes(x.meta.get("val")) if x_name in needs_grad and x_name not in carried else 0
    index = experts.by_weight.get(layer.weight)
    block = experts.blocks[index] if index is not None else None
    order = experts.layer_nodes[index] if index is not None else ()
    first, last = bool(order) and order[0] == layer.node, bool(order) and order[-1] == layer.node
    table = [("replicate", 0, 0, e * n * k * size), ("colwise (paired)", 0, grad, e * math.ceil(n / world_size) * k * size)]
    rowwise_params = e * n * math.ceil(k / world_size) * size
    if block is not None and last:
        weights = nodes[block.top_k_weights]
        routing_grad = _bytes(weights.meta.get("val")) if block.top_k_weights in needs_grad else 0
        table.append(("rowwise (paired)", _bytes(nodes[block.output].meta.get("val")), routing_grad, rowwise_params))
    else:
        table.append(("rowwise (paired)", _bytes(out), 0, rowwise_params))
    if block is not None:
        table.append(("expert", *_expert_bytes(block, nodes, needs_grad, first, last), math.ceil(e / world_size) * n * k * size))
    chosen: Optional[str] = {"replicate": "replicate", "colwise": "colwise (paired)", "rowwise": "rowwise (paired)",
                             "expert": "expert"}.get(layer.style)
    return [{"style": s, "forward_bytes": f, "backward_bytes": bw, "param_bytes_per_rank": p, "chosen": s == chosen}
            for s, f, bw, p in table]


def _expert_bytes(block: ExpertBlock, nodes: dict[str, Any], needs_grad: set[str], first: bool, last: bool) -> tuple[int, int]:
    """Forward and backward bytes of the block's expert-parallel collectives that the layer
    carries: the dispatch if it is the block's first layer, the combine if its last
    (NOTE: [expert alternatives]; the figures of ``fxtp.explain.counts.expert_comms``)."""
    hidden, result = nodes[block.hidden].meta["val"], nodes[block.result].meta["val"]
    rows = optimization_hint(hidden.shape[0]) * block.top_k * optimization_hint(hidden.shape[-1])
    forward = backward = 0
    if first:
        forward += rows * hidden.element_size()
        if block.hidden in needs_grad:
            backward += rows * hidden.element_size() + nbytes_of(hidden)  # the reverse all_to_all, the all_gather
    if last:
        forward += rows * result.element_size() + _bytes(nodes[block.output].meta.get("val"))
        if block.result in needs_grad:
            backward += rows * result.element_size()
        if block.top_k_weights in needs_grad:
            backward += _bytes(nodes[block.top_k_weights].meta.get("val"))
    return forward, backward


def report_alternatives(program: ExportedProgram, plan: ShardingPlan, nodes: dict[str, Any],
                        needs_grad: set[str]) -> dict[str, list[dict[str, Any]]]:
    """Every layer's alternatives (NOTE: [layer alternatives]), by layer name.

    Args:
        program: the captured program (its graph's ``meta["val"]``, its state dict).
        plan: the sharding plan the report describes.
        nodes: ``program.graph``'s nodes by name.
        needs_grad: the names of the nodes whose value needs a gradient.

    Returns:
        ``{layer name: alternatives}`` for the linear, embedding and 3-D expert layers; empty at
        world_size 1.
    """
    if plan.world_size <= 1:
        return {}
    state = program.state_dict
    gathered = {p for (_, p), a in plan.edges.items() if a.kind == "gather"}
    entered: dict[str, set[str]] = {}  # consumer -> the values it wraps in f (one f per value: counts.collectives)
    for (c, p), a in plan.edges.items():
        if _enters(a) and p in needs_grad:
            entered.setdefault(c, set()).add(p)
    experts: ExpertLayers | None = None  # found on the first 3-D layer
    carried: set[str] = set()  # entered values whose f an earlier layer carries
    owned: set[str] = set()  # reduced values an earlier rowwise layer carries
    layer_nodes = frozenset(layer.node for layer in plan.layers)
    held = _held_bytes(plan, nodes, needs_grad)
    out: dict[str, list[dict[str, Any]]] = {}
    for layer in plan.layers:
        if len(layer.weight_shape) == 3:
            experts = experts or expert_layers(program, plan)
            alts = expert_alternatives(layer, nodes, state, plan.world_size, needs_grad, frozenset(carried), experts)
        elif layer.op == "embedding":
            alts = embedding_alternatives(layer, nodes, state, plan.world_size, layer.node in gathered)
        else:
            alts = layer_alternatives(layer, nodes, state, plan.world_size, needs_grad, frozenset(carried))
        node = nodes.get(layer.node)
        if layer.style == "colwise" and layer.op != "embedding" and node is not None and node.args and hasattr(node.args[0], "name"):
            carried.add(node.args[0].name)
            if alts:
                _price_entries(next(a for a in alts if a["chosen"]), node, plan, nodes, entered, carried, layer_nodes)
        elif layer.style == "rowwise" and layer.op != "embedding" and node is not None and alts:
            _price_reduction(next(a for a in alts if a["chosen"]), node, plan, nodes, entered, carried, owned)
        elif layer.style == "expert" and experts is not None and alts:
            _share_expert_reduction(next(a for a in alts if a["chosen"]), layer, experts, nodes, plan, owned)
        if alts and node is not None and layer.style in ("colwise", "rowwise"):  # NOTE: [grouped shards]
            next(a for a in alts if a["chosen"])["backward_bytes"] += sum(held.pop(a.name, 0) for a in node.all_input_nodes)
        if alts:
            out[layer.name] = alts
    return out


def _held_bytes(plan: ShardingPlan, nodes: dict[str, Any], needs_grad: set[str]) -> dict[str, int]:
    """Per parameter held as grouped shards, the bytes of its gradient's all_reduce over its
    holders (NOTE: [grouped shards] in fxtp/core/placement.py; ``fxtp.explain.counts``'s figure)."""
    return {n: nbytes_of(nodes[n].meta["val"]) * holder_layout(plan.params[n], 0, plan.world_size)[1] // plan.params[n].size
            for names in plan.holders for n in names if n in needs_grad}


def _enters(action: Any) -> bool:
    """The edge wraps its value in Megatron's ``f`` (all_reduce of the gradient), as ``fxtp.explain.counts``."""
    return action.kind == "enter" or action.kind in ("slice", "gather") and action.enter


_SHAPE_QUERIES = ("sym_size", "sym_stride", "sym_numel")
_DEPTH = 16  # ops linear in a partial value between a rowwise layer and its all_reduce (NOTE: [deferred reduction])


def _reduction(node: Any, plan: ShardingPlan) -> tuple[Any, list[Any]] | None:
    """The value whose all_reduce ``node``'s partial value reaches through single-use ops, and
    those ops; ``None`` if it branches first or is not reduced within ``_DEPTH`` ops."""
    chain, n = [], node
    for _ in range(_DEPTH):
        if n.name in plan.reduces:
            return n, chain
        users = [u for u in n.users if not any(q in str(u.target) for q in _SHAPE_QUERIES)]
        if len(users) != 1:
            return None
        n = users[0]
        chain.append(n)
    return None


def _price_reduction(row: dict[str, Any], node: Any, plan: ShardingPlan, nodes: dict[str, Any], entered: dict[str, set[str]],
                     carried: set[str], owned: set[str]) -> None:
    """A chosen rowwise layer's figures from the plan: forward, the all_reduce its partial
    output reaches through single-use ops (deferred past the ops linear in it: NOTE: [deferred
    reduction] in passes/moe/reductions.py), counted on the first layer that reaches it (a
    shared expert's and the routed experts' sum, a LoRA pair and its base layer: one all_reduce);
    backward, the ``f`` of the replicated values that meet the partial value on the way (the
    routing weights). The row is left as priced from shapes where no all_reduce is found."""
    found = _reduction(node, plan)
    if found is None:
        return
    reduced, chain = found
    row["forward_bytes"] = 0 if reduced.name in owned else _bytes(reduced.meta.get("val"))
    owned.add(reduced.name)
    on_chain = {m.name for m in chain}
    met = set().union(*(entered.get(c, ()) for c in on_chain)) - carried
    row["backward_bytes"] = sum(_bytes(nodes[p].meta.get("val")) for p in met)
    carried |= met


def _price_entries(row: dict[str, Any], node: Any, plan: ShardingPlan, nodes: dict[str, Any], entered: dict[str, set[str]],
                   carried: set[str], layer_nodes: frozenset[str]) -> None:
    """A chosen colwise layer's backward adds the ``f`` of the replicated values that meet its
    sharded output before the next layer or all_reduce (a bias gathered per expert, a gate):
    each value's all_reduce once, on the first layer that meets it."""
    seen, todo = set(), [(u, 1) for u in node.users]
    while todo:
        n, depth = todo.pop()
        if n.name in seen or n.name in layer_nodes or depth > _DEPTH:
            continue
        seen.add(n.name)
        if n.name not in plan.reduces:
            todo.extend((u, depth + 1) for u in n.users)
    met = set().union(*(entered.get(c, ()) for c in seen)) - carried
    row["backward_bytes"] += sum(_bytes(nodes[p].meta.get("val")) for p in met)
    carried |= met


def _share_expert_reduction(row: dict[str, Any], layer: Any, experts: ExpertLayers, nodes: dict[str, Any],
                            plan: ShardingPlan, owned: set[str]) -> None:
    """An expert-parallel block's last layer: its ``Partial`` output's all_reduce counted once
    with a rowwise layer's that reaches the same one (Qwen2-MoE's shared expert), as
    :func:`_price_reduction` counts them."""
    index = experts.by_weight.get(layer.weight)
    if index is None or not experts.layer_nodes[index] or experts.layer_nodes[index][-1] != layer.node:
        return
    block = experts.blocks[index]
    found = _reduction(nodes[block.output], plan)
    if found is None:
        return
    reduced, _ = found
    row["forward_bytes"] += _bytes(reduced.meta.get("val")) * (reduced.name not in owned) - _bytes(nodes[block.output].meta.get("val"))
    owned.add(reduced.name)


def alternatives_text(layers: tuple[Any, ...], alternatives: dict[str, list[dict[str, Any]]]) -> str:
    """One line per layer with alternatives: each style's forward+backward collective bytes and
    parameter bytes per rank, the chosen one starred (``--verbose``)."""
    lines = ["alternatives per layer (style: collective bytes fwd+bwd, parameter bytes per rank; * chosen):"]
    for layer in layers:
        alts = alternatives.get(layer.name)
        if alts:
            parts = [f"{'*' if a['chosen'] else ''}{a['style']}: {fmt_bytes(a['forward_bytes'] + a['backward_bytes'])}, "
                     f"{fmt_bytes(a['param_bytes_per_rank'])}" for a in alts]
            lines.append(f"  {layer.name}: " + "; ".join(parts))
    return "\n".join(lines) if len(lines) > 1 else ""
