"""``TensorParallelStrategy``: the tensor-parallel part of a plan, as ``fxtp.compile`` applies it.

``fxtp.plan`` returns a ``ParallelPlan`` (the mesh, FSDP2's micro-batches, predicted figures);
``plan.tensor_parallel`` is this type, what ``fxtp.compile(..., strategy=plan)`` reads. It lives
in the core so that the pipeline (``fxtp.api``) and the planner (``fxtp.planner``, which runs
the pipeline) both use it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

__all__ = ["TensorParallelStrategy"]


@dataclass(frozen=True)
class TensorParallelStrategy:
    """How one tensor-parallel group runs the model.

    Attributes:
        tp: the tensor-parallel degree (``fxtp.compile``'s ``world_size``).
        sequence_parallel: Megatron-LM's sequence parallelism (``compile``'s flag).
        activation_checkpointing: ``None``, ``"selective"`` or ``"blocks"`` (``compile``'s).
        layer_styles: ``{layer name or glob: "colwise" | "rowwise" | "replicate"}``, valid as
            ``compile``'s ``plan=``; the repeated blocks' layers as globs over the block index
            (``"model.layers.*.mlp.up_proj"``) when the planner analyzed two of them
            (NOTE: [repeated blocks] in fxtp/planner/params.py).
    """

    tp: int
    sequence_parallel: bool = False
    activation_checkpointing: Optional[str] = None
    layer_styles: Mapping[str, str] = field(default_factory=dict)
