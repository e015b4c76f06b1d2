"""The rank program by block: each repeated block of the rank graph becomes a submodule call.

NOTE: [rank program by block]
torchtitan applies FSDP2, activation checkpointing and ``torch.compile`` per transformer block:
each engine hooks a block's ``forward``. fxtp's rank graph is one graph; this pass gives it the
model's blocks back. Each repeated block (a child of the model's largest ``nn.ModuleList``,
``passes.regions.checkpointing.repeated_blocks``; found by ``node.meta["nn_module_stack"]``, as
``activation_checkpointing="blocks"`` finds its regions) is outlined from the rank graph into a
body of its own, registered in the rank graph at the block's FQN (``model.layers.3``), and the
root graph calls the blocks in order (``call_module``)::

    model_layers_0 = getattr(self.model.layers, "0")(embedding)
    model_layers_1 = getattr(self.model.layers, "1")(model_layers_0)

A body's placeholders are the block's activations (the values from before it, in first-use
order) and then its own state: the parameters and buffers whose FQN is under the block's. The
``ParallelModule`` binds the body to the block's submodule of its own module tree (NOTE:
[blocks of a ParallelModule] in fxtp/runtime/blocks.py), which reads that state as its own
attributes at call time: that is what lets FSDP2's ``fully_shard`` on the block swap in the
gathered parameters in its pre-forward hook. State of other modules (a tied embedding, fxtp's
lifted constants) is passed by the root graph as an argument. The block's own state is no longer
a placeholder of the root graph. ``gm.meta["fxtp_blocks"]`` (a :class:`BlockLayout`, kept by
``GraphModule``'s deepcopy) says which placeholders each part reads.

The ops between a block's first and last op (the collectives the rewrite put among them
included) are its body (``passes.regions.checkpointing.region_span``): the collectives a block needs
run inside it. A SymInt the body reads (a dynamic size the capture computed once at the top)
is recomputed from the first activation of the body that has that size, so a block can be
called alone on its activations (``pm.get_submodule("model.layers.3")(hidden, ...)``).

Checkpointing: under ``activation_checkpointing="blocks"``/``"selective"`` the block's body is a
``fxtp.core.recompute.Recompute`` (its size-only inputs recomputed in it, NOTE: [size-only
region inputs]); a user's ``torch.utils.checkpoint`` region inside one block is outlined inside
that block's body. A user region that spans blocks (or a block and ops outside) keeps those
blocks in the root graph, as before this pass (the report's ``blocks`` note says which).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule, Node

from fxtp.core.recompute import Recompute
from passes.regions.checkpointing import (
    Region,
    clone_mutated,
    may_draw_random,
    outline_span,
    recompute_regions,
    region_context,
    region_of,
    region_span,
    splice,
)

__all__ = ["BlockLayout", "outline_blocks", "layout_of", "program_code"]

_STATE = (InputKind.PARAMETER, InputKind.BUFFER)


@dataclass(frozen=True)
class BlockLayout:
    """Which of the rank graph's original placeholders (indices into the program's input specs)
    each part reads (NOTE: [rank program by block]).

    Attributes:
        inputs: the root graph's placeholders.
        blocks: per outlined block, in call order: its FQN and the placeholders of its own state,
            in the order its body takes them after its activations.
        kept: blocks left in the root graph (a user checkpoint region spans them).
    """

    inputs: tuple[int, ...]
    blocks: tuple[tuple[str, tuple[int, ...]], ...]
    kept: tuple[str, ...] = ()


def layout_of(gm: GraphModule) -> Optional[BlockLayout]:
    """The layout :func:`outline_blocks` wrote on ``gm``, or ``None`` for a graph without blocks."""
    return gm.meta.get("fxtp_blocks")


def program_code(gm: GraphModule) -> str:
    """The code of a rank graph not yet bound to a module and of its blocks' bodies: what two
    graphs must share to be the same program (NOTE: [modes] in fxtp/api.py)."""
    layout = layout_of(gm)
    bodies = [gm.get_submodule(fqn) for fqn, _ in layout.blocks] if layout is not None else []
    return "\n".join([gm.code, *(getattr(b, "body", b).code for b in bodies)])


def _under(fqn: str, block: str) -> bool:
    return fqn == block or fqn.startswith(block + ".")


def outline_blocks(gm: GraphModule, program: ExportedProgram, blocks: tuple[str, ...], regions: tuple[Region, ...],
                   context_fns: Optional[dict[int, Callable[[], Any]]] = None) -> GraphModule:
    """Outline each block of ``blocks`` in the rank graph ``gm`` (of ``program``) into a body at
    its FQN, checkpointing as ``regions`` say (``passes.regions.checkpointing.checkpoint_regions``), in
    place; returns ``gm``. Without blocks in the graph, this is ``recompute_regions``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    specs = program.graph_signature.input_specs
    block_regions = tuple(Region(b, "block", False, 0, module=b) for b in blocks)
    if not block_regions or len(placeholders) != len(specs):
        return recompute_regions(gm, regions, context_fns)
    index = {node: i for i, node in enumerate(placeholders)}
    state = {node: spec.target for node, spec in zip(placeholders, specs) if spec.kind in _STATE}
    users = [r for r in regions if r.source == "user"]
    whole = {r.module: r for r in regions if r.source != "user"}  # "blocks"/"selective": the block itself
    within: dict[str, list[Region]] = {}
    crossed: set[str] = set()
    for region in users:
        touched = {getattr(region_of(n, block_regions), "module", None) for n in gm.graph.nodes if region_of(n, (region,)) is region}
        if len(touched) == 1 and None not in touched:
            within.setdefault(touched.pop(), []).append(region)
        else:
            crossed |= {b for b in touched if b is not None}
    active = tuple(r for r in block_regions if r.module not in crossed)
    outlined: list[tuple[str, tuple[int, ...]]] = []
    for region in active:
        block = region.module
        assert block is not None
        own = lambda n: n in state and _under(state[n], block)  # noqa: E731
        span = region_span(gm, region, active, keep=lambda n: any(own(i) for i in n.all_input_nodes))
        if not span:
            continue
        at = span[0]
        span = _state_ops(gm, span, own) + span
        checkpointed = whole.get(block)
        if checkpointed is not None and region_context(checkpointed, context_fns or {}) is not None:
            span = clone_mutated(span)  # NOTE: [in-place ops under selective checkpointing]
        body = outline_span(gm, span, remake_sizes=checkpointed is not None, single=True,
                            order=lambda inputs: [i for i in inputs if not own(i)] + [i for i in inputs if own(i)])
        args = [i for i in body.inputs if not own(i)]
        dropped = _sizes_from_activations(body.graph, len(args))
        args = [a for i, a in enumerate(args) if i not in dropped]
        body_gm = GraphModule(gm, body.graph)
        module: torch.nn.Module = body_gm
        if checkpointed is not None:
            module = Recompute(body_gm, region_context(checkpointed, context_fns or {}), checkpointed.name,
                               preserve_rng_state=may_draw_random(body.graph))
        elif block in within:
            recompute_regions(body_gm, tuple(within[block]), context_fns)
        gm.add_submodule(block, module)
        call = splice(gm, body, block, args, single=True, at=at)
        call.meta["fxtp_block"] = block
        outlined.append((block, tuple(index[i] for i in body.inputs if own(i))))
    rest = tuple(r for r in regions if r.source == "user" and not any(r in within.get(b, ()) for b, _ in outlined))
    rest += tuple(r for r in regions if r.source != "user" and r.module not in {b for b, _ in outlined})
    if rest:
        recompute_regions(gm, rest, context_fns)
    for node in list(gm.graph.nodes):  # sizes only the blocks read: each reads its own now
        if node.target is torch.ops.aten.sym_size.int and not node.users and outlined:
            gm.graph.erase_node(node)
    for node in placeholders:
        if node in state and not node.users and any(_under(state[node], b) for b, _ in outlined):
            gm.graph.erase_node(node)
    kept_inputs = tuple(index[n] for n in gm.graph.nodes if n.op == "placeholder")
    if outlined:
        gm.meta["fxtp_blocks"] = BlockLayout(kept_inputs, tuple(outlined), tuple(sorted(crossed)))
    gm.graph.lint()
    gm.recompile()
    return gm


def _state_ops(gm: GraphModule, span: list[Node], own: Callable[[Node], bool]) -> list[Node]:
    """The ops before ``span`` that only it reads and that read the block's own state (the
    ``copy_to_tp`` of a norm weight on token shards, a slice of a parameter), with the ops they
    need that read nothing else, in graph order: they run in the block (NOTE: [rank program by
    block]), so the block reads its parameters itself."""
    inside = set(span)
    first = span[0]
    before: list[Node] = []
    for node in gm.graph.nodes:
        if node is first:
            break
        before.append(node)
    pulled: set[Node] = set()
    changed = True
    while changed:
        changed = False
        for node in reversed(before):
            if node in pulled or node.op != "call_function" or not node.users:
                continue
            if not all(u in inside or u in pulled for u in node.users):
                continue
            if any(own(i) or i in pulled for i in node.all_input_nodes) or any(u in pulled for u in node.users):
                pulled.add(node)
                changed = True
    return [n for n in before if n in pulled]


def _sizes_from_activations(graph: Any, activations: int) -> set[int]:
    """Recompute each SymInt placeholder of ``graph`` from the first of its first
    ``activations`` replicated tensor placeholders that has that size in some dim, and drop the
    placeholder (NOTE: [rank program by block]); returns the positions dropped. One with no
    such tensor stays an input."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"][:activations]
    # a node's "val" holds the global shape; only a replicated value's sizes are the rank's own
    tensors = [p for p in placeholders if isinstance(p.meta.get("val"), torch.Tensor) and p.meta.get("fxtp_placement", "R") == "R"]
    dropped: set[int] = set()
    for position, node in enumerate(placeholders):
        value = node.meta.get("val")
        if not isinstance(value, torch.SymInt):
            continue
        found = next(((t, d) for t in tensors for d, size in enumerate(t.meta["val"].shape)
                      if isinstance(size, torch.SymInt) and size.node.expr == value.node.expr), None)
        if found is None:
            continue
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(last):
            size = graph.call_function(torch.ops.aten.sym_size.int, found)
        size.meta["val"] = value
        node.replace_all_uses_with(size)
        graph.erase_node(node)
        dropped.add(position)
    return dropped
