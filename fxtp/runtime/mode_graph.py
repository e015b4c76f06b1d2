"""``ModeGraph``: one mode's rank graph of a ``ParallelModule`` and how to call it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch.utils._pytree as pytree
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.fx import GraphModule

from fxtp.capture.shapes import InputSpec, input_specs
from fxtp.core import collectives, rng
from fxtp.runtime.blocks import BlockBody

__all__ = ["ModeGraph"]


@dataclass(eq=False)
class ModeGraph:
    """One mode's rank graph and how to call it (NOTE: [modes] in fxtp/api.py). Holds no
    reference to the captured program (whose state dict is the user's full weights)."""

    gm: GraphModule
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    outputs: list[tuple[OutputKind, Optional[str]]]
    specs: tuple[InputSpec, ...]  # the user inputs it runs on (fxtp.capture.shapes)
    inputs: list[tuple[str, str]]  # (kind, key) per placeholder
    slots: Optional[list[tuple[Optional[nn.Module], str]]] = None
    draws_random: bool = False  # checks the generators before each call (NOTE: [dropout across ranks])
    regathers: bool = False  # saves gathered token shards as shards (NOTE: [regathered activations])
    blocks: dict[str, BlockBody] = dataclasses.field(default_factory=dict)  # NOTE: [blocks of a ParallelModule]

    @classmethod
    def of(cls, program: ExportedProgram, gm: GraphModule, inputs: list[tuple[str, str]],
           blocks: Optional[dict[str, BlockBody]] = None) -> "ModeGraph":
        """``inputs``: ``(kind, key)`` per root placeholder; ``blocks``: the bodies of its blocks."""
        outputs = [(spec.kind, spec.target) for spec in program.graph_signature.output_specs]
        blocks = blocks or {}
        graphs = [gm, *(b.module for b in blocks.values() if isinstance(b.module, GraphModule))]
        return cls(gm, program.call_spec.in_spec, program.call_spec.out_spec, outputs, input_specs(program), inputs,
                   draws_random=rng.draws_random(program.graph),
                   regathers=any(n.target is collectives.gather_from_sp for g in graphs for n in g.graph.nodes),
                   blocks=blocks)
