"""The routed-experts blocks of a captured graph: what expert parallelism cuts and reconnects.

Hugging Face's experts modules (``@use_experts_implementation``: ``MixtralExperts``,
``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ``DeepseekV2Experts``, ``GptOssExperts``) take
``(hidden (T, H), top_k_index (T, k), top_k_weights (T, k))`` and keep every expert in
parameters whose dim 0 is the expert (``gate_up_proj`` ``(E, 2I, H)`` or transposed, biases
``(E, 2I)``). Their ``grouped_mm`` and ``batched_mm`` implementations
(``transformers/integrations/moe.py``) both:

* make one row per (token, expert) pair, ``rows`` ``(S, H)``, ``S = T * k``
  (``hidden[perm // k]`` sorted by expert, or ``hidden.repeat_interleave(k, 0)``);
* run the experts on the rows (the *region*: grouped matmuls or gathered ``bmm``s, the gate,
  biases gathered by expert), reading integer ``row_ids`` ``(S,)`` and/or ``offsets`` ``(E,)``;
* multiply the result ``(S, H)`` by the routing weights, restore the pair order, sum the top-k.

:func:`find_expert_blocks` finds those parts by data flow (not by class names), so that
``passes/moe/parallel.py`` can feed the region rows received from other ranks. A block that
does not have this shape raises ``FxtpPlanError`` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch.fx import Graph, Node

from fxtp.core.errors import FxtpPlanError

__all__ = ["ExpertBlock", "find_expert_blocks"]

aten = torch.ops.aten
_PER_ROW = (aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.contiguous.default, aten.unsqueeze.default)
_SHAPE_QUERIES = (aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default)
_COMBINE = (aten.index.Tensor, aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.sum.dim_IntList, aten.to.dtype)


@dataclass(frozen=True)
class ExpertBlock:
    """One experts module of the captured graph; names are the captured graph's node names."""

    module: str  # the experts module's FQN
    num_experts: int
    top_k: int
    params: tuple[str, ...]  # placeholders of its parameters (dim 0: the experts), in graph order
    hidden: str  # (T, H) input
    top_k_index: str  # (T, k) input
    top_k_weights: str  # (T, k) input
    rows: str  # (S, H): one row per pair, made from ``hidden``
    row_ids: tuple[str, ...]  # (S,) expert of each row, where the region reads it
    offsets: tuple[str, ...]  # (E,) cumulative rows per expert, where the region reads it
    result: str  # (S, H): the experts' output per row, before the routing weights
    output: str  # (T, H): the module's output
    region: tuple[str, ...]  # the nodes from ``rows`` to ``result`` (``rows`` excluded), graph order


def _in_module(node: Node, module: str) -> bool:
    return any(path == module for path, _ in (node.meta.get("nn_module_stack") or {}).values())


def _descendants(starts: Iterable[Node], within: set[Node]) -> set[Node]:
    out: set[Node] = set()
    todo = list(starts)
    while todo:
        for user in todo.pop().users:
            if user in within and user not in out:
                out.add(user)
                todo.append(user)
    return out


def _ancestors(node: Node, within: set[Node]) -> set[Node]:
    out, todo = {node}, [node]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a in within and a not in out:
                out.add(a)
                todo.append(a)
    return out


def _refuse(module: str, what: str) -> FxtpPlanError:
    return FxtpPlanError(
        f"expert_parallel: the experts module {module} {what}; fxtp dispatches Hugging Face's grouped_mm and batched_mm "
        f"experts (transformers/integrations/moe.py). fix: set config experts_implementation='grouped_mm', or compile "
        f"without expert_parallel (its experts then get tensor parallelism)"
    )


def find_expert_blocks(graph: Graph, param_fqns: Mapping[str, str]) -> tuple[ExpertBlock, ...]:
    """The experts blocks of ``graph`` (a normalized captured graph), in graph order.

    Reads ``meta["val"]`` and ``meta["nn_module_stack"]``; does not modify the graph.

    Raises:
        FxtpPlanError: a module with 3-D parameters whose data flow is not the experts' above.
    """
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    modules: dict[str, list[Node]] = {}
    for name, fqn in param_fqns.items():
        val = placeholders[name].meta.get("val") if name in placeholders else None
        if isinstance(val, torch.Tensor) and val.dim() == 3:
            modules.setdefault(fqn.rpartition(".")[0], []).append(placeholders[name])
    blocks = []
    for module, weights in modules.items():
        experts = weights[0].meta["val"].shape[0]
        params = [placeholders[n] for n, f in param_fqns.items() if f.rpartition(".")[0] == module and n in placeholders
                  and placeholders[n].meta["val"].dim() >= 2 and placeholders[n].meta["val"].shape[0] == experts]
        blocks.append(_block(graph, module, experts, params))
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    return tuple(sorted(blocks, key=lambda b: order[b.output]))


def _block(graph: Graph, module: str, experts: int, params: list[Node]) -> ExpertBlock:
    inside = {n for n in graph.nodes if n.op == "call_function" and _in_module(n, module)}
    inputs = {a for n in inside for a in n.all_input_nodes if a not in inside and a not in params}
    tensors = [a for a in inputs if isinstance(a.meta.get("val"), torch.Tensor)]
    index = [a for a in tensors if not a.meta["val"].is_floating_point() and a.meta["val"].dim() == 2]
    floats = [a for a in tensors if a.meta["val"].is_floating_point() and a.meta["val"].dim() == 2]
    weights = [a for a in floats if index and a.meta["val"].shape == index[0].meta["val"].shape]
    hidden = [a for a in floats if a not in weights]
    if len(index) != 1 or len(weights) != 1 or len(hidden) != 1 or len(tensors) != 3:
        raise _refuse(module, f"takes {sorted(a.name for a in tensors)}, not (hidden, top_k_index, top_k_weights)")
    outputs = [n for n in inside if isinstance(n.meta.get("val"), torch.Tensor) and any(u not in inside for u in n.users)]
    if len(outputs) != 1:
        raise _refuse(module, f"has {len(outputs)} outputs: {[n.format_node() for n in outputs]}")
    from_params = _descendants(params, inside)
    from_weights = _descendants(weights, inside)
    combine = [n for n in inside if n.target is aten.mul.Tensor and len(n.args) == 2 and all(isinstance(a, Node) for a in n.args)
               and {n.args[0] in from_params, n.args[1] in from_params} == {True, False}
               and any(a in from_weights or a is weights[0] for a in n.args)]
    if len(combine) != 1:
        raise _refuse(module, "does not multiply its experts' output by the routing weights once")
    (mul,) = combine
    result = next(a for a in mul.args if a in from_params)
    _check_combine(mul, outputs[0], module)
    region = _ancestors(result, inside) & from_params
    frontier = {a for n in region for a in n.all_input_nodes if a not in region and a not in params}
    rows, row_ids, offsets = None, [], []
    for a in frontier:
        val = a.meta.get("val")
        if isinstance(val, torch.Tensor) and val.is_floating_point():
            chain = []
            while a.target in _PER_ROW and a in inside:
                chain.append(a)
                a = a.args[0]
            if rows is not None or a.args[0] is not hidden[0]:
                raise _refuse(module, f"computes its experts from {a.name}, not from one row per (token, expert) pair")
            rows = a
            region |= set(chain)
        elif isinstance(val, torch.Tensor) and val.dim() == 1 and val.shape[0] == experts and a.meta["val"].dtype == torch.int32:
            offsets.append(a)
        elif isinstance(val, torch.Tensor) and val.dim() == 1 and not val.is_floating_point():
            row_ids.append(a)
        else:
            raise _refuse(module, f"reads {a.format_node()} in its experts' computation, which fxtp cannot rebuild per rank")
    if rows is None or rows.target not in (aten.index.Tensor, aten.repeat_interleave.self_int):
        raise _refuse(module, "does not make one row per (token, expert) pair by a gather or repeat_interleave of its input")
    order = {n: i for i, n in enumerate(graph.nodes)}
    return ExpertBlock(
        module=module, num_experts=experts, top_k=index[0].meta["val"].shape[1], params=tuple(p.name for p in params),
        hidden=hidden[0].name, top_k_index=index[0].name, top_k_weights=weights[0].name, rows=rows.name,
        row_ids=tuple(a.name for a in row_ids), offsets=tuple(a.name for a in offsets), result=result.name,
        output=outputs[0].name, region=tuple(n.name for n in sorted(region, key=order.__getitem__)),
    )


def _check_combine(mul: Node, output: Node, module: str) -> None:
    """From the weighted rows to the output only the pair order's restoring gather, the
    ``(T, k, H)`` view, the top-k sum and a cast (what :func:`combine_from_experts` does)."""
    node, summed = mul, False
    while node is not output:
        users = [u for u in node.users if u.target not in _SHAPE_QUERIES]
        if len(users) != 1 or users[0].target not in _COMBINE:
            raise _refuse(module, f"combines its experts' rows with {[u.format_node() for u in users]}")
        node = users[0]
        summed |= node.target is aten.sum.dim_IntList and list(node.args[1]) == [1]
    if not summed:
        raise _refuse(module, "does not sum its experts' rows over the top-k")
