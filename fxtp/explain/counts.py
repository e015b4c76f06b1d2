"""Where the report's figures come from: collectives per forward and backward with their
payload bytes, parameter bytes per rank, the regions between replicated points, and the notes
on non-layer nodes.

Every count here is read off the captured program and the plan, the same data the rewrite
emits from; the tests check the counts against collectives counted on real runs
(``tests/_helpers.assert_report_counts``). Bytes are at the example input's sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx.experimental.symbolic_shapes import optimization_hint

from fxtp.core import local_ops, losses, norms  # noqa: F401 (the last two register their ops' collectives)
from fxtp.core.placement import Partial, Placement, Shard, holder_layout, is_sharded
from fxtp.core.rng import is_random, sharded_call
from passes.plan import LayerDecision, ShardingPlan, module_of
from passes.propagate import param_root
from passes.registry import located
from passes.rules.matmul import layer_weight
from passes.sequence import reduce_scatters, saving_layers

__all__ = [
    "CollectiveStat",
    "expert_comms",
    "Note",
    "collectives",
    "fmt_bytes",
    "local_bytes",
    "nbytes_of",
    "grad_inputs",
    "notes",
    "other_parameters",
    "regions",
    "sequence_comms",
]

_aten = torch.ops.aten

def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


_OTHER_MATMULS = (_aten.mm.default, _aten.addmm.default, _aten.matmul.default, _aten.bmm.default, _aten.einsum.default)


_VIEWS = (_aten.t.default, _aten.transpose.int, _aten.permute.default, _aten.view.default, _aten.reshape.default, _aten.expand.default)


def param_operand(node, param_names: set[str]) -> bool:
    """Is ``node`` a parameter, seen through transposes and views?"""
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node.op == "placeholder" and node.name in param_names


@dataclass(frozen=True)
class CollectiveStat:
    """Collectives of one kind in one pass over the example input."""

    phase: str  # "forward" | "backward"
    kind: str  # "all_reduce" | "all_gather"
    count: int
    bytes: int  # total payload, full (global) tensor sizes


@dataclass(frozen=True)
class Note:
    """A non-layer node that forced a rejection or a collective."""

    code: str
    node: str  # format_node()
    module: str
    message: str
    layers: tuple[str, ...]


def nbytes_of(val: Any) -> int:
    """Bytes of ``val`` at the example's sizes (a dynamic size counts its example value)."""
    if not isinstance(val, torch.Tensor):
        return 0
    return math.prod(optimization_hint(s) for s in val.shape) * val.element_size()


def live_nodes(program: ExportedProgram) -> set[str]:
    """The names of the program's nodes that the rewrite keeps: those the output or an impure
    node (a random op, an in-place write) reads, directly or through others. ``passes.rewrite``
    ends with FX's ``eliminate_dead_code``, which drops the rest with their collectives (e.g.
    ``nn.MultiheadAttention``'s head-averaged weights with ``need_weights=True`` when the model
    uses only its output): the report counts what runs."""
    todo = [n for n in program.graph.nodes if n.op == "output" or n.op == "call_function" and n.is_impure()]
    seen: set[str] = set()
    while todo:
        node = todo.pop()
        if node.name not in seen:
            seen.add(node.name)
            todo.extend(node.all_input_nodes)
    return seen


def collectives(program: ExportedProgram, plan: ShardingPlan, nodes: dict[str, Any], needs_grad: set[str]) -> tuple[CollectiveStat, ...]:
    """Collectives per forward and backward on the example, as the rewrite emits them: one per
    value and kind (the rewrite shares an ``f``, a gather, a slice among consumers). The first
    three keep their places in ``to_dict()["collectives"]`` (the kinds tensor parallelism
    alone uses); sequence parallelism's follow."""
    def nbytes(names) -> int:
        return sum(nbytes_of(nodes[n].meta["val"]) for n in names)

    alive = live_nodes(program)  # a dead value's collective is dropped with it
    reduces = [name for name in plan.reduces if name not in plan.scatters and name in alive]
    reduce_scattered = [name for name in plan.scatters if name in plan.reduces and name in alive]
    sliced_out = [name for name in plan.scatters if name not in plan.reduces and name in needs_grad and name in alive]
    edges = {(c, p): a for (c, p), a in plan.edges.items() if c in alive}
    tp_gathered = {p for (_, p), a in edges.items() if a.kind == "gather"}
    # NOTE: [sequence parallelism]: a token shard is gathered once per kind of backward it needs
    sp_gathered = {(p, a.enter) for (_, p), a in edges.items() if a.kind == "sp_gather"}
    def enters(a) -> bool:  # the edge work wraps its value in f (all_reduce backward)
        return a.kind == "enter" or a.kind in ("slice", "gather") and a.enter

    entered = {p for (_, p), a in edges.items() if enters(a) and p in needs_grad}
    entered |= {b for n, b in plan.reduces.items() if n in plan.scatters and n in alive and b is not None and b in needs_grad}  # the bias's f
    # an f on a gathered token shard (its consumer's own edge work): one more per value
    entered_gathered = {p for (_, p), a in edges.items() if a.kind == "sp_gather" and a.then is not None and enters(a.then) and p in needs_grad}
    scattered_back = {p for p, summed in sp_gathered if summed and p in needs_grad}
    sliced_in = {p for (_, p), a in edges.items() if a.kind == "sp_scatter" and a.enter and p in needs_grad}
    regathered = regathered_values(program, plan, nodes)
    # NOTE: [grouped shards]: copy_to_holders all_reduces the gradient of a grouped parameter's grouped segments
    held = [[p for p in names if p in needs_grad] for names in plan.holders]
    held = [names for names in held if names]

    def held_bytes(names) -> int:
        return sum(nbytes_of(nodes[n].meta["val"]) * holder_layout(plan.params[n], 0, plan.world_size)[1] // plan.params[n].size
                   for n in names)

    # Emitted ops that all_reduce themselves: a vocab-parallel loss, a norm over a sharded dim.
    inside = [
        (plan.local_args.get(name, ()), local_ops.EMITTED_COLLECTIVES[target])
        for name, target in plan.local_targets.items()
        if target in local_ops.EMITTED_COLLECTIVES and name in alive
    ]
    inside = [(args, emitted) for args, emitted in inside if emitted.kind == "all_reduce"]
    inside_count = sum(emitted.forward for _, emitted in inside)
    inside_bytes = sum(emitted.payload(args)[0] for args, emitted in inside)
    inside_back = [(args, emitted) for args, emitted in inside if emitted.backward and args[0].name in needs_grad]
    back_count = sum(emitted.backward for _, emitted in inside_back)
    back_bytes = sum(emitted.payload(args)[1] for args, emitted in inside_back)
    return (
        CollectiveStat("forward", "all_reduce", len(reduces) + inside_count, nbytes(reduces) + inside_bytes),
        CollectiveStat("forward", "all_gather", len(tp_gathered) + len(sp_gathered), nbytes(tp_gathered) + nbytes(p for p, _ in sp_gathered)),
        CollectiveStat(
            "backward", "all_reduce", len(entered) + len(entered_gathered) + len(held) + back_count,
            nbytes(entered) + nbytes(entered_gathered) + sum(held_bytes(names) for names in held) + back_bytes,
        ),
        CollectiveStat("forward", "reduce_scatter", len(reduce_scattered), nbytes(reduce_scattered)),
        CollectiveStat(
            "backward",
            "all_gather",
            len([n for n in reduce_scattered if n in needs_grad]) + len(sliced_out) + len(sliced_in) + len(regathered),
            nbytes(n for n in reduce_scattered if n in needs_grad) + nbytes(sliced_out) + nbytes(sliced_in)
            + nbytes(p for p, _ in regathered),
        ),
        CollectiveStat("backward", "reduce_scatter", len(scattered_back), nbytes(scattered_back)),
        *expert_comms(plan, nodes, needs_grad),
    )


def expert_comms(plan: ShardingPlan, nodes: dict[str, Any], needs_grad: set[str]) -> tuple[CollectiveStat, ...]:
    """The collectives of the expert-parallel blocks (NOTE: [expert parallelism] in
    fxtp/core/expert_dispatch.py), per block: forward, the all_to_all of the pairs' rows to
    their experts and of the experts' rows back; backward, the two again (reversed) and the
    all_gathers of the token blocks' gradients of ``hidden`` and ``top_k_weights``. Payload:
    every pair's row once, ``T * top_k`` rows of ``H``, the ones a rank keeps included."""
    sent = back = gathered = 0
    count = {"forward": 0, "backward": 0, "gather": 0}
    for block in plan.experts:
        hidden, result = nodes[block.hidden].meta["val"], nodes[block.result].meta["val"]
        rows = optimization_hint(hidden.shape[0]) * block.top_k * optimization_hint(hidden.shape[-1])
        sent += rows * (hidden.element_size() + result.element_size())
        count["forward"] += 2
        if block.result in needs_grad:
            count["backward"] += 1
            back += rows * result.element_size()
        for name in (block.hidden, block.top_k_weights):
            if name in needs_grad:
                count["gather"] += 1
                gathered += nbytes_of(nodes[name].meta["val"])
        if block.hidden in needs_grad:
            count["backward"] += 1
            back += rows * hidden.element_size()
    if not plan.experts:
        return ()
    return (
        CollectiveStat("forward", "all_to_all", count["forward"], sent),
        CollectiveStat("backward", "all_to_all", count["backward"], back),
        CollectiveStat("backward", "all_gather", count["gather"], gathered),
    )


def regathered_values(program: ExportedProgram, plan: ShardingPlan, nodes: dict[str, Any]) -> set[tuple[str, bool]]:
    """The gathered token shards a layer with a trainable weight saves: backward gathers each
    again, once (NOTE: [regathered activations])."""
    specs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.PARAMETER]
    params = frozenset(s.arg.name for s in specs)
    trainable = frozenset(s.arg.name for s in specs if program.state_dict[s.target].requires_grad)
    out = set()
    for (c, p), a in plan.edges.items():
        if a.kind != "sp_gather" or not a.regather:
            continue
        layers = saving_layers(nodes[c], lambda n: param_root(n, params) is not None) or set()
        if any(layer_weight(n, lambda w: param_root(w, trainable) is not None) is not None for n in layers):
            out.add((p, a.enter))
    return out


def sequence_comms(program: ExportedProgram, plan: ShardingPlan) -> dict[str, str]:
    """Layer node -> its communication under sequence parallelism (NOTE: [sequence parallelism])."""
    if not plan.scatters:
        return {}
    nodes = {n.name: n for n in program.graph.nodes}
    out = {}
    for layer in plan.layers:
        node = nodes[layer.node]
        if layer.style == "rowwise" and reduce_scatters(node, plan.scatters):
            out[layer.node] = "reduce_scatter fwd, all_gather bwd"
        elif layer.style == "colwise" and any(a.kind == "sp_gather" for (c, _), a in plan.edges.items() if c == node.name):
            out[layer.node] = "all_gather fwd, reduce_scatter bwd"
    return out


def local_bytes(nbytes: int, placement: Placement, rank: int, world_size: int) -> int:
    """Bytes of rank ``rank``'s piece of a parameter of ``nbytes`` (NOTE: [uneven shards])."""
    if not isinstance(placement, Shard):
        return nbytes
    return nbytes * placement.local_size(world_size, rank) // placement.size


def regions(program: ExportedProgram, plan: ShardingPlan) -> tuple[tuple[str, ...], ...]:
    """The tensor-parallel regions: connected sets of sharded values, between replicated
    points; each as the names of the sharded layers in it, in graph order. Parameters are not
    values here: a tied weight does not join the regions of its uses."""
    placeholders = {n.name for n in program.graph.nodes if n.op == "placeholder"}
    sharded = {
        name
        for name, p in plan.placements.items()
        if (isinstance(p, Partial) or is_sharded(p)) and name not in placeholders
    }
    graph = nx.Graph()
    graph.add_nodes_from(sharded)
    for node in program.graph.nodes:
        if node.name in sharded:
            graph.add_edges_from((node.name, a.name) for a in node.all_input_nodes if a.name in sharded)
    order = {n.name: i for i, n in enumerate(program.graph.nodes)}
    by_node = {layer.node: layer.name for layer in plan.layers if layer.style in ("colwise", "rowwise")}
    regions = []
    for component in nx.connected_components(graph):
        layers = tuple(by_node[n] for n in sorted(component, key=order.__getitem__) if n in by_node)
        if layers:
            regions.append((min(order[n] for n in component), layers))
    return tuple(layers for _, layers in sorted(regions))


def grad_inputs(program: ExportedProgram) -> set[str]:
    """Names of float values that depend on a trainable parameter or on an example input that
    requires grad: only their ``f`` operators all_reduce in backward."""
    examples = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
    trainable = set()
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.PARAMETER and program.state_dict[spec.target].requires_grad:
            trainable.add(spec.arg.name)
        elif spec.kind == InputKind.USER_INPUT and getattr(examples.get(getattr(spec.arg, "name", "")), "requires_grad", False):
            trainable.add(spec.arg.name)
    out: set[str] = set()
    for node in program.graph.nodes:
        vals = node.meta.get("val")
        vals = vals if isinstance(vals, (tuple, list)) else (vals,)  # split, unbind: a list of tensors
        floating = any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals)
        if floating and (node.name in trainable or any(a.name in out for a in node.all_input_nodes)):
            out.add(node.name)
    return out


def other_parameters(program: ExportedProgram, plan: ShardingPlan, placements: dict[str, Placement], rank: int = 0) -> tuple[Note, ...]:
    """Every parameter that is no layer's weight, so the report accounts for all bytes: a note
    per matrix or larger (``not-a-layer``: MoE experts, conv kernels, a parameter used by an op
    fxtp does not shard), one note for the vectors (biases, norm weights, scales)."""
    covered = {layer.weight for layer in plan.layers}
    by_id: dict[int, list[str]] = {}  # a tied tensor is counted once, under its first FQN
    for fqn in placements:
        by_id.setdefault(id(program.state_dict[fqn]), []).append(fqn)
    users = {s.target: s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.PARAMETER}
    nodes = {n.name: n for n in program.graph.nodes}
    notes, vectors, vector_bytes, vector_local = [], 0, 0, 0
    for fqns in by_id.values():
        if covered.intersection(fqns):
            continue
        tensor, placement = program.state_dict[fqns[0]], placements[fqns[0]]
        nbytes = nbytes_of(tensor)
        local = local_bytes(nbytes, placement, rank, plan.world_size)
        if tensor.dim() <= 1:
            vectors, vector_bytes, vector_local = vectors + 1, vector_bytes + nbytes, vector_local + local
            continue
        node = nodes[users[fqns[0]]]
        ops = sorted({str(u.target).replace("aten.", "") for u in node.users}) or ["(unused)"]
        how = f"sharded as {placement}" if isinstance(placement, Shard) else "replicated"
        notes.append(
            Note(
                "not-a-layer",
                node.format_node(),
                module_of(next(iter(node.users), node)),
                f"parameter {fqns[0]} {list(tensor.shape)} ({fmt_bytes(nbytes)}) is used by {', '.join(ops)}, "
                f"not a layer fxtp plans; it is {how}, {fmt_bytes(local)} per rank",
                (),
            )
        )
    if vectors:
        notes.append(
            Note(
                "other-params",
                "-",
                "",
                f"{vectors} other parameter{'' if vectors == 1 else 's'} (biases, norm weights, scales) outside the layer rows: "
                f"{fmt_bytes(vector_bytes)} in all, {fmt_bytes(vector_local)} per rank",
                (),
            )
        )
    return tuple(notes)


def notes(plan: ShardingPlan, nodes, param_names: set[str]) -> tuple[Note, ...]:
    by_culprit: dict[tuple[str, str], list[LayerDecision]] = {}
    for layer in plan.layers:
        if layer.code and layer.culprit and layer.code not in ("tied", "user-plan"):
            by_culprit.setdefault((layer.code, layer.culprit), []).append(layer)
    notes = [
        Note(code, culprit, group[0].culprit_module or "", group[0].reason, tuple(layer.name for layer in group))
        for (code, culprit), group in by_culprit.items()
    ]
    for name, placement in plan.placements.items():
        node = nodes[name]
        shard = (placement[0] if placement else None) if isinstance(placement, tuple) else placement
        if not isinstance(shard, Shard) or not is_random(node.target, node.args, node.kwargs):
            continue
        if sharded_call(node.target, node.args, node.kwargs, shard, 0, plan.world_size) is not None:
            why = ("random op on a sharded value: every rank draws the mask of the full value and keeps its slice "
                   "(one global mask, as on one device; replicated values get the identical mask on every rank: "
                   "fxtp.compile syncs the generators from rank 0)")
            notes.append(Note("dropout-on-shard", node.format_node(), module_of(node), why, ()))
        else:
            why = ("random op on a sharded value that fxtp cannot draw as one global mask: each rank draws its own "
                   "(independent masks per rank, not the single device's; the generators fall out of step)")
            notes.append(Note("random-per-rank", node.format_node(), module_of(node), why, ()))
    layer_nodes = {layer.node for layer in plan.layers}
    for node in nodes.values():
        if node.name in layer_nodes:
            continue
        if node.op == "call_function" and node.target in _OTHER_MATMULS and any(param_operand(a, param_names) for a in node.all_input_nodes):
            notes.append(
                Note(
                    "unsupported-layer",
                    node.format_node(),
                    module_of(node),
                    f"{node.target.__name__} with a parameter operand fxtp does not shard (only x @ W, x @ W.T, addmm and "
                    "linear with a 2-D parameter W on the right are layers); it stays replicated. "
                    + located("fix: write it as F.linear(x, weight) at {line}", node),
                    (),
                )
            )
    for (consumer, producer), action in plan.edges.items():
        if action.kind == "gather":
            node = nodes[consumer]
            why = "the model output" if node.op == "output" else node.name
            notes.append(Note("gather", node.format_node(), module_of(node), f"all_gather of {producer}: {why} needs it whole", ()))
    return tuple(notes)

