"""A ``ParallelModule``'s module tree: the model's classes, and blocks that run their part.

NOTE: [blocks of a ParallelModule]
``pm``'s submodules answer as the model's: each is an instance of the model's class at the same
FQN (``isinstance(pm.get_submodule("transformer.h.0.ln_1"), nn.LayerNorm)``), made with
``cls.__new__`` and ``nn.Module.__init__`` (the class's own ``__init__`` would build its full
weights), holding the same parameters and buffers (this rank's shards) and the model's plain
attributes (sizes, flags, ``eps``: what ``repr`` and type-based code read). So Hugging Face's
``Trainer.get_decay_parameter_names``, Megatron-style optimizer builders and any code that groups
parameters by module type group ``pm``'s as the model's.

A block (NOTE: [rank program by block] in passes/regions/blocks.py) also runs: its ``forward`` (set on
the instance) runs its body of the rank graph that runs now (the mode's, or a size-1 graph's,
NOTE: [size-1 graphs]), reading its parameters and buffers as its own attributes at call time,
so FSDP2's ``fully_shard(block)`` (which swaps them for the gathered ones in its pre-forward
hook), ``block.compile()`` and other module hooks act on it as on the model's block. Called
alone (``pm.get_submodule("model.layers.3")(hidden, ...)``), a block runs the body of ``pm``'s
current mode on this rank's activations (token shards under sequence parallelism). Every other
submodule refuses to run (``FxtpRuntimeError``): its weights are shards, so its class's own
``forward`` would be silently wrong.

The root graph calls a block through :class:`BlockCall`, which looks the block up in ``pm`` at
each call, so a block the user replaced (``torchtitan``'s ``model.layers.register_module(i,
torch.compile(block))``) is the one that runs.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.fx import GraphModule

from fxtp.core.errors import FxtpRuntimeError
from passes.regions.blocks import layout_of

__all__ = ["BlockBody", "BlockCall", "Template", "bind_blocks", "is_block", "module_templates", "new_module", "rank_graphs", "run_block"]

_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.Size, torch.device)


@dataclass(frozen=True)
class Template:
    """How to make the module at one FQN: the model's class and its plain attributes."""

    cls: type
    attrs: tuple[tuple[str, Any], ...]


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def module_templates(model: nn.Module) -> dict[str, Template]:
    """``{fqn: Template}`` for every submodule of ``model`` (``model`` itself excluded); holds no
    tensor and no reference to the model."""
    out = {}
    for fqn, module in model.named_modules():
        if fqn:
            attrs = tuple((k, v) for k, v in vars(module).items() if not k.startswith("_") and k != "training" and _plain(v))
            out[fqn] = Template(type(module), attrs)
    return out


def _refuse(fqn: str, *args: Any, **kwargs: Any) -> Any:
    raise FxtpRuntimeError(
        f"{fqn} of a ParallelModule holds this rank's shards and runs inside the rank graph, not on its own: its "
        "class's forward would compute on shards, silently wrong. fix: call the ParallelModule (or a block, "
        "pm.get_submodule('<block fqn>'))"
    )


def new_module(fqn: str, templates: dict[str, Template]) -> nn.Module:
    """An empty module for ``fqn``: an instance of the model's class with its plain attributes
    (NOTE: [blocks of a ParallelModule]), else a plain ``nn.Module``."""
    template = templates.get(fqn)
    if template is None:
        return nn.Module()
    try:
        module = template.cls.__new__(template.cls)
        nn.Module.__init__(module)
    except Exception:  # noqa: BLE001 - a class that cannot be made empty: a plain module holds the tensors
        return nn.Module()
    for key, value in template.attrs:
        module.__dict__[key] = value
    module.__dict__["forward"] = functools.partial(_refuse, fqn)
    module.__dict__["extra_repr"] = functools.partial(_extra_repr, module)
    return module


def _extra_repr(module: nn.Module) -> str:
    """The class's ``extra_repr``, or ``""`` where it reads state the template does not keep."""
    try:
        return type(module).extra_repr(module)
    except Exception:  # noqa: BLE001 - repr must not raise
        return ""


@dataclass(eq=False)
class BlockBody:
    """One block's body in one rank graph, and its own state as ``(kind, pm FQN)`` in the order
    the body takes it after the activations."""

    module: nn.Module
    state: list[tuple[str, str]]
    slots: dict[int, list[tuple[nn.Module, str]]] = field(default_factory=dict)  # id(block) -> owners

    def read(self, block: nn.Module, fqn: str) -> list[torch.Tensor]:
        """The block's state now (read at call time: FSDP2's gathered parameters)."""
        slots = self.slots.get(id(block))
        if slots is None:
            slots = []
            for _, key in self.state:
                path, _, leaf = key[len(fqn) + 1:].rpartition(".")
                slots.append((block.get_submodule(path), leaf))
            self.slots = {id(block): slots}
        return [getattr(owner, leaf) for owner, leaf in slots]


class BlockCall(nn.Module):
    """The root graph's submodule at a block's FQN: calls ``pm``'s block of that FQN (NOTE:
    [blocks of a ParallelModule])."""

    def __init__(self, pm: nn.Module, fqn: str) -> None:
        super().__init__()
        object.__setattr__(self, "_pm", pm)  # not a child: pm's tree must not loop
        self.fqn = fqn

    def forward(self, *args: Any) -> Any:
        return self._pm.get_submodule(self.fqn)(*args)


def is_block(module: nn.Module) -> bool:
    """Whether ``module`` is a block of a ``ParallelModule`` (NOTE: [blocks of a ParallelModule])."""
    return "_fxtp_fqn" in module.__dict__


def _block_forward(self: nn.Module, *args: Any) -> Any:
    return run_block(self.__dict__["_fxtp_pm"], self.__dict__["_fxtp_fqn"], self, args)


def run_block(pm: Any, fqn: str, block: nn.Module, args: tuple) -> Any:
    """Run ``block``'s body of the graph ``pm`` runs now (its current mode's when called alone)."""
    from fxtp.runtime import sharded

    graph = pm._running if pm._running is not None else pm.mode_graph(pm.mode)
    body = graph.blocks.get(fqn)
    if body is None:
        raise FxtpRuntimeError(f"{fqn}: the {pm.mode}-mode graph keeps this block in its root graph (a checkpoint "
                               "region spans it); fix: call the ParallelModule")
    state = body.read(block, fqn)
    if torch.compiler.is_compiling():  # NOTE: [blocks under torch.compile]
        state = sharded.plain_views(state)
    elif any(isinstance(t, (sharded.ShardedTensor, DTensor)) for t in state):
        state = sharded.plain_inputs(state)
    # NOTE: [block bodies run without module hooks]: a body is no submodule of ``pm`` (its
    # ``BlockCall`` stands in the root graph), so tools that name modules by their place in the tree
    # see every body as ``GraphModule``; torch's ``CommDebugMode`` keys the forward hooks it adds per
    # call by that name, so all bodies but one keep a hook after its exit, which pops from the closed
    # tracker's empty stack on the next forward (``IndexError``). The block itself (``pm``'s submodule,
    # what users hook) is called through ``__call__``; its body is an implementation detail, called
    # through ``forward`` (a checkpointed body's ``Recompute`` calls its graph the same way).
    return body.module.forward(*args, *state)


# NOTE: [blocks under torch.compile]
# A block reads its state at call time (FSDP2's gathered parameters), so under tensor parallelism
# it reads ``ShardedParameter`` s inside the rank graph. ``sharded.plain_inputs`` makes them plain
# eagerly, but it is ``torch.compiler.disable``d: called there under ``torch.compile(pm)`` it
# broke the rank graph at every block (2 Llama blocks: 4 graphs, 3 breaks). While compiling, a
# block takes ``sharded.plain_views`` instead, which Dynamo traces: the rank graph is one graph
# again (NOTE: [hooks under torch.compile] in fxtp/core/activations.py), and ``block.compile()``
# traces the same path. Eagerly, the aliases of ``plain_inputs`` (no autograd node) stay.


def _make_block(pm: Any, fqn: str) -> nn.Module:
    """``pm``'s submodule at ``fqn`` made a block: its ``forward`` runs its body."""
    block = pm._module_at(fqn)
    if block.__dict__.get("_fxtp_fqn") != fqn:
        block.__dict__["_fxtp_pm"] = pm
        block.__dict__["_fxtp_fqn"] = fqn
        block.__dict__["forward"] = types.MethodType(_block_forward, block)
    return block


def bind_blocks(pm: Any, gm: GraphModule, inputs: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], dict[str, BlockBody]]:
    """Split ``inputs`` (``(kind, key)`` per placeholder of the program) between ``gm``'s root graph and its
    blocks' bodies, make those blocks of ``pm`` and have ``gm`` call them (NOTE: [rank program by
    block] in passes/regions/blocks.py). Returns the root's inputs and ``{fqn: BlockBody}``."""
    layout = layout_of(gm)
    if layout is None:
        return inputs, {}
    bodies = {}
    for fqn, state in layout.blocks:
        body = gm.get_submodule(fqn)
        if isinstance(body, BlockCall):  # a graph bound before (shared by two modes)
            raise AssertionError(f"fxtp internal error: graph bound twice at {fqn}")
        bodies[fqn] = BlockBody(body, [inputs[i] for i in state])
        _make_block(pm, fqn)
        path, _, leaf = fqn.rpartition(".")
        gm.get_submodule(path)._modules[leaf] = BlockCall(pm, fqn)
    return [inputs[i] for i in layout.inputs], bodies


def rank_graphs(pm: Any, mode: Optional[str] = None) -> dict[str, GraphModule]:
    """``{"": root graph, block FQN: its body graph, ...}`` of ``mode``'s graph (default: the
    current one); a checkpointed body's graph is its ``Recompute``'s."""
    graph = pm.mode_graph(mode or pm.mode)
    out = {"": graph.gm}
    for fqn, body in graph.blocks.items():
        module = body.module
        out[fqn] = getattr(module, "body", module)
    return out
