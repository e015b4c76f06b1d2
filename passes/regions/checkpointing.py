"""Activation checkpointing: which ops are recomputed in backward, and the rank graph's regions.

NOTE: [recomputed regions] (fxtp/core/recompute.py) says how a region runs. This pass finds the
regions (:func:`checkpoint_regions`, analysis: returns data) and outlines each one in the rank
graph into a :class:`fxtp.core.recompute.Recompute` submodule (:func:`recompute_regions`, a
rewrite of the rank graph's copy).

A region is found by a predicate on ``node.meta`` that holds on the captured graph and on the
rank graph alike (the rewrite copies the meta of every op it keeps):

* ``"user"``: ``node.meta["custom"]["fxtp_checkpoint"] == tag``, the user's
  ``torch.utils.checkpoint`` call number ``tag`` (NOTE: [checkpoint regions at capture]);
* ``"blocks"`` / ``"selective"`` (``fxtp.compile(activation_checkpointing=...)``, as
  torchtitan's ``apply_ac``): ``node.meta["nn_module_stack"]`` holds the block's FQN, one
  region per child of the model's largest ``nn.ModuleList`` (its repeated blocks).

Reads ``meta["custom"]``, ``meta["nn_module_stack"]``; writes nothing on the captured graph.
In the rank graph, the ops between a region's first and last op (the collectives and slices
the rewrite put among them included) become the body; values from before are its inputs,
values used after its outputs::

    linear = aten.linear.default(gather_from_sp, p_w1);  gelu = aten.gelu.default(linear)
    linear_1 = aten.linear.default(gelu, p_w2);  reduce_scatter_to_sp = ...(linear_1, 1, 2, '0')
becomes
    fxtp_recompute_0 = self.fxtp_recompute_0(gather_from_sp, p_w1, p_w2)
    getitem = fxtp_recompute_0[0]

NOTE: [size-only region inputs]
A region keeps its inputs for backward, so a tensor the model makes before its blocks and hands
to each of them stays allocated until the last backward. When that tensor is made from sizes and
constants alone by deterministic ATen ops (:func:`_from_sizes`: a traced Hugging Face causal mask,
bool ``(B, 1, T, T)``, built from ``arange(T)``; position ids; bool and integer tensors only), the
region recomputes it instead:
the ops that make it are copied into the body (their size and device operands become the
body's inputs), and the outer copies, once nothing else reads them, are erased. The eager single
device makes no such mask (``is_causal``, NOTE: [attention operands] in passes/normalize.py), so
keeping it would be bytes fxtp alone holds: 16,384 B per rank on a tiny Llama (batch 4, seq 64),
over the bound (the checkpointed single device's / ws + 10%) at ws 4. A tensor read from a
parameter, a buffer or an input is kept as an input (saving it costs the bytes it already has).
A floating-point one is kept too: on torch's reference Transformer with sequence parallelism at
ws 2, recomputing its float size-only inputs held 32,768 B more per rank (296,448 against
263,680 B, the allocator through torch.profiler), over the bound; why is not yet understood.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.fx import GraphModule, Node

from fxtp.core import collectives, rng
from fxtp.core.errors import FxtpConfigError
from fxtp.core.recompute import TAG, Recompute, selective_context

__all__ = ["Region", "MODES", "Outlined", "checkpoint_regions", "clone_mutated", "outline_span", "recompute_regions", "region_context",
           "region_of", "region_span", "may_draw_random", "repeated_blocks", "splice"]

MODES = ("blocks", "selective")
aten = torch.ops.aten


@dataclass(frozen=True)
class Region:
    """One recomputed region.

    Attributes:
        name: the module it covers (``layers.0``), or ``checkpoint <tag> (<module>)``.
        source: ``"user"`` (the model's own checkpoint call), ``"blocks"`` or ``"selective"``.
        selective: an op-level policy decides what is saved (the user's ``context_fn``, or
            fxtp's for ``"selective"``), else only the region's inputs are.
        ops: the captured ops it holds.
        tag: the user's checkpoint call number (``source == "user"``).
        module: the block's FQN (``"blocks"``, ``"selective"``).
    """

    name: str
    source: str
    selective: bool
    ops: int
    tag: Optional[int] = None
    module: Optional[str] = None


def repeated_blocks(model: nn.Module) -> tuple[str, ...]:
    """The FQNs of the children of ``model``'s largest ``nn.ModuleList`` (the first of the
    largest), torchtitan's transformer blocks; ``()`` without a non-empty list."""
    lists = [(len(m), fqn) for fqn, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return ()
    size = max(n for n, _ in lists)
    fqn = next(f for n, f in lists if n == size)
    return tuple(f"{fqn}.{name}" if fqn else name for name, _ in model.get_submodule(fqn).named_children())


def _stack(node: Node) -> list[str]:
    return [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]


def region_of(node: Node, regions: tuple[Region, ...]) -> Optional[Region]:
    """The region ``node`` belongs to (placeholders and the output belong to none)."""
    if node.op != "call_function":
        return None
    tag = (node.meta.get("custom") or {}).get(TAG)
    paths = _stack(node)
    for region in regions:
        if region.tag is not None and region.tag == tag:
            return region
        if region.module is not None and any(p == region.module or p.startswith(region.module + ".") for p in paths):
            return region
    return None


def checkpoint_regions(graph: Any, mode: Optional[str], blocks: tuple[str, ...], selective_tags: frozenset[int] = frozenset()) -> tuple[Region, ...]:
    """The regions of the captured ``graph``: the user's checkpoint calls, or with ``mode``
    one per block in ``blocks`` (the FQNs of the largest ``nn.ModuleList``'s children).

    Raises:
        FxtpConfigError: ``mode`` on a model that calls ``torch.utils.checkpoint`` itself, or
            a model without repeated blocks.
    """
    tags: dict[int, int] = {}
    modules: dict[int, list[str]] = {}  # per tag, the module path all its ops share
    for node in graph.nodes:
        tag = (node.meta.get("custom") or {}).get(TAG) if node.op == "call_function" else None
        if tag is not None:
            tags[tag] = tags.get(tag, 0) + 1
            path = (_stack(node) or [""])[-1].split(".")
            common = modules.setdefault(tag, path)
            modules[tag] = common[:next((i for i, (a, b) in enumerate(zip(common, path)) if a != b), min(len(common), len(path)))]
    if tags and mode is not None:
        raise FxtpConfigError(
            f"activation_checkpointing={mode!r}, but the model calls torch.utils.checkpoint itself ({len(tags)} regions); "
            "fxtp recomputes those. fix: drop activation_checkpointing=, or the model's checkpoint calls"
        )
    if tags:
        return tuple(Region(f"checkpoint {t} ({'.'.join(modules[t]) or 'model'})", "user", t in selective_tags, n, tag=t) for t, n in sorted(tags.items()))
    if mode is None:
        return ()
    if not blocks:
        raise FxtpConfigError(
            f"activation_checkpointing={mode!r} checkpoints each repeated block (the children of the model's largest "
            "nn.ModuleList), and this model has none. fix: wrap the blocks' forward in torch.utils.checkpoint.checkpoint, "
            "or compile without activation_checkpointing="
        )
    regions = tuple(Region(b, mode, mode == "selective", 0, module=b) for b in blocks)
    counts = {r.name: 0 for r in regions}
    for node in graph.nodes:
        r = region_of(node, regions)
        if r is not None:
            counts[r.name] += 1
    return tuple(Region(r.name, r.source, r.selective, counts[r.name], module=r.module) for r in regions if counts[r.name])


def recompute_regions(gm: GraphModule, regions: tuple[Region, ...],
                      context_fns: Optional[dict[int, Callable[[], Any]]] = None) -> GraphModule:
    """Outline each region of the rank graph ``gm`` into a ``Recompute`` submodule, in place
    (``gm`` is fxtp's own rank graph); returns ``gm``. ``context_fns``: the user's selective
    policies by checkpoint tag."""
    for index, region in enumerate(regions):
        span = region_span(gm, region, regions)
        context = region_context(region, context_fns or {})
        if span and context is not None:
            span = clone_mutated(span)
        if span:
            _outline(gm, span, f"fxtp_recompute_{index}", context, region.name)
    gm.graph.lint()
    gm.recompile()
    return gm


# graph ops whose output is (a view of) the output of an op a selective policy saves (recompute.SAVED_OPS)
_CACHED = frozenset({aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default,
                     aten.baddbmm.default, aten.einsum.default, aten.scaled_dot_product_attention.default})


def _mutates_first(node: Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not target._schema.arguments:
        return False
    alias = target._schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def clone_mutated(span: list[Node]) -> list[Node]:
    """NOTE: [in-place ops under selective checkpointing]
    A selective policy caches the outputs of the ops it saves (``mm``, ``addmm``) and torch
    refuses a cached tensor that is mutated afterwards ("Tensor cached during selective
    activation checkpoint has been mutated"): the recompute would read the mutated value. So
    where an op of the region writes in place into the output of another op of it (``u =
    self.up(h); u += lora(h)``, recorded in place, NOTE: [in-place arithmetic at fx capture]),
    the write goes to a clone of that output, made just before it, and every later reader of the
    output (inside the region or after it) reads the clone: the values are the same, and the
    cached tensor stays as computed.
    Returns the span with the clones in it."""
    order = {n: i for i, n in enumerate(span)}
    out = list(span)
    for node in span:
        if not _mutates_first(node) or not isinstance(node.args[0], Node):
            continue
        value = node.args[0]
        if value not in order or value.target not in _CACHED:  # only a cached op's output (or its view) is refused
            continue
        with node.graph.inserting_before(node):
            clone = node.graph.call_function(aten.clone.default, (value,))
        clone.meta = dict(value.meta)
        for user in list(value.users):
            if user is not clone and (user not in order or order[user] >= order[node]):  # those outside come after
                user.replace_input_with(value, clone)
        out.insert(out.index(node), clone)
    return out


def region_context(region: Region, context_fns: dict[int, Callable[[], Any]]) -> Optional[Callable[[], Any]]:
    if region.source == "selective":
        return selective_context
    return context_fns.get(region.tag) if region.tag is not None else None


def region_span(gm: GraphModule, region: Region, regions: tuple[Region, ...],
                keep: Optional[Callable[[Node], bool]] = None) -> list[Node]:
    """The rank graph's ops from the region's first to its last. An op among them that is not
    the region's and reads only values from before it (the reduce_scatter of an embedding's
    partial sums, and the block's cast that NOTE: [deferred reduction] put before it; a slice of
    a parameter) moves ahead of the region instead: as an input its operand would be saved
    whole where its result is a shard. Random ops stay, so the generator draws in the captured
    order; so do the ops ``keep`` names."""
    nodes = list(gm.graph.nodes)
    where = [i for i, n in enumerate(nodes) if region_of(n, regions) is region]
    if not where:
        return []
    span: list[Node] = []
    for node in nodes[where[0]:where[-1] + 1]:
        if node.op != "call_function":
            continue
        owner = region_of(node, regions)
        assert owner in (None, region), f"fxtp internal error: region {region.name} interleaves {owner}"
        inside = set(span)
        hoist = owner is None or _cast_before_collective(node)  # NOTE: [deferred reduction] moved it past the cast
        if hoist and not (keep is not None and keep(node)) and not _may_draw_random_node(node) and not any(i in inside for i in node.all_input_nodes):
            if span:
                span[0].prepend(node)
            continue
        span.append(node)
    return span


_CASTS = frozenset({aten.to.dtype, aten._to_copy.default, aten.alias.default})


def _cast_before_collective(node: Node) -> bool:
    return node.target in _CASTS and all(getattr(u.target, "__module__", None) == collectives.__name__ for u in node.users)


@dataclass
class Outlined:
    """A span of a rank graph copied into a graph of its own (:func:`outline_span`).

    Attributes:
        graph: the body: one placeholder per input, returns ``outputs`` (a tuple, or the one
            value with ``single``).
        inputs: the outer values it reads, in placeholder order.
        outputs: the span's values read after it.
        span: the outer ops it copies (erased by :func:`splice`).
        recomputed: the outer size-only ops copied into it too (NOTE: [size-only region inputs]).
    """

    graph: Any
    inputs: list[Node]
    outputs: list[Node]
    span: list[Node]
    recomputed: list[Node]


def outline_span(gm: GraphModule, span: list[Node], *, remake_sizes: bool = True, single: bool = False,
                 order: Optional[Callable[[list[Node]], list[Node]]] = None) -> Outlined:
    """Copy ``span`` (ops of ``gm``, in graph order) into a graph of its own. ``remake_sizes``:
    tensors made from sizes alone are recomputed in it rather than read (NOTE: [size-only region
    inputs]); ``single``: a body with one output returns it bare; ``order``: reorders the inputs
    (the placeholders), given them in first-use order."""
    inside = set(span)
    inputs: list[Node] = []
    remade: dict[Node, bool] = {}
    for node in span:
        for inp in node.all_input_nodes:
            if inp not in inside and inp not in inputs and not (remake_sizes and _from_sizes(inp, remade)):
                inputs.append(inp)
    needed: set[Node] = set()
    todo = [i for node in span for i in node.all_input_nodes if i not in inside and remade.get(i)]
    while todo:
        node = todo.pop()
        if node not in needed:
            needed.add(node)
            todo.extend(i for i in node.all_input_nodes if remade.get(i))
    recomputed = [n for n in gm.graph.nodes if n in needed]  # NOTE: [size-only region inputs]
    for node in recomputed:
        inputs.extend(i for i in node.all_input_nodes if not remade.get(i) and i not in inputs)
    if order is not None:
        inputs = order(inputs)
    outputs = [n for n in span if any(u not in inside for u in n.users)]
    body_graph = type(gm.graph)()
    env: dict[Node, Node] = {}
    for inp in inputs:
        env[inp] = body_graph.placeholder(inp.name)
        env[inp].meta = dict(inp.meta)
    for node in [*recomputed, *span]:
        env[node] = body_graph.node_copy(node, lambda n: env[n])
    body_graph.output(env[outputs[0]] if single and len(outputs) == 1 else tuple(env[n] for n in outputs))
    return Outlined(body_graph, inputs, outputs, span, recomputed)


def splice(gm: GraphModule, outlined: Outlined, name: str, args: list[Node], single: bool = False,
           at: Optional[Node] = None) -> Node:
    """Replace ``outlined.span`` in ``gm`` with ``call_module(name, args)`` (the submodule at
    ``name`` registered by the caller; inserted before ``at``, default the span's first op) and
    its outputs read from the call; returns the call."""
    inside = set(outlined.span)
    graph = gm.graph
    with graph.inserting_before(at or outlined.span[0]):
        call = graph.call_module(name, tuple(args))
        if single and len(outlined.outputs) == 1:
            items = [call]
        else:
            items = [graph.call_function(operator.getitem, (call, i)) for i in range(len(outlined.outputs))]
    for out, item in zip(outlined.outputs, items):
        item.meta.update({k: out.meta[k] for k in ("val", "fxtp_placement") if k in out.meta})
        out.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
    for node in reversed(outlined.span):
        graph.erase_node(node)
    for node in reversed(outlined.recomputed):  # the ones no other op reads any more
        if not node.users:
            graph.erase_node(node)
    return call


def _outline(gm: GraphModule, span: list[Node], name: str, context_fn: Optional[Callable[[], Any]], label: str) -> None:
    outlined = outline_span(gm, span)
    preserve = may_draw_random(outlined.graph)
    gm.add_submodule(name, Recompute(GraphModule(gm, outlined.graph), context_fn, label, preserve_rng_state=preserve))
    splice(gm, outlined, name, outlined.inputs)


def _from_sizes(node: Node, memo: dict[Node, bool]) -> bool:
    """Whether ``node`` is a tensor made from sizes and constants alone, by deterministic ATen
    ops (a causal mask, position ids): a region recomputes it rather than keep it
    (NOTE: [size-only region inputs]). Non-tensor inputs (sizes, a device) may come from anywhere."""
    if node not in memo:
        memo[node] = False  # until shown otherwise (and for cycles, which a graph has none of)
        memo[node] = (
            node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and isinstance(node.meta.get("val"), torch.Tensor) and not node.meta["val"].requires_grad
            and not node.meta["val"].is_floating_point()  # masks and positions (see the NOTE)
            and not _may_draw_random_node(node)
            and all(_from_sizes(i, memo) for i in node.all_input_nodes if isinstance(i.meta.get("val"), torch.Tensor))
        )
    return memo[node]


def may_draw_random(graph: Any) -> bool:
    """Whether a body may draw random numbers: an ATen op that does (``rng.is_random``), or any
    call fxtp does not know to be deterministic (``fxtp.core.rng``'s draws on shards, emitted
    local ops). Else ``torch.utils.checkpoint`` need not keep the generators' states (5 KiB on
    the CPU per region)."""
    return any(node.op == "call_function" and _may_draw_random_node(node) for node in graph.nodes)


def _may_draw_random_node(node: Node) -> bool:
    if node.target is operator.getitem or getattr(node.target, "__module__", None) == collectives.__name__:
        return False
    return not isinstance(node.target, torch._ops.OpOverload) or rng.is_random(node.target, node.args, node.kwargs)
