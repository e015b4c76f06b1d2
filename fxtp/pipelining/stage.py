"""The ``PipelineStage`` fxtp hands to torch's schedules: its backward sees sharded parameters plain.

NOTE: [split backward of sharded parameters]
The zero-bubble schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``; Qi et al. 2024, "Zero Bubble Pipeline Parallelism") split a stage's
backward into an input pass and a weight pass (``stage_backward_input`` /
``stage_backward_weight`` in ``torch/distributed/pipelining/_backward.py``). Both find a
parameter's ``AccumulateGrad`` node by a view of it: ``p.view_as(p).grad_fn.next_functions[0][0]``,
and keep the gradients of the autograd nodes between the stage's input and those nodes for the
weight pass. A sharded parameter (NOTE: [sharded parameters] in fxtp/runtime/sharded.py) is a
``__torch_function__`` subclass: its ``view_as`` is a ``ShardedTensor`` made by ``as_subclass``,
whose ``AliasBackward0`` sits on top of the view's ``ViewBackward0``. So torch took the view's own
``ViewBackward0`` (a node of a throwaway tensor, in no stage's graph) for the parameter's
accumulator: the input pass kept nothing for the sharded parameters and the weight pass left
their gradients ``None`` (replicated parameters, plain ``nn.Parameter`` s, were right).

:class:`FxtpStage` runs torch's ``backward_one_chunk`` and ``backward_weight_one_chunk`` with
sharded tensors plain (``fxtp.runtime.sharded.plain``): the view is a plain tensor, the node is the
parameter's ``AccumulateGrad``, and torch's split passes give every gradient. Nothing else in those
calls depends on the subclass: the stage's graph runs on plain tensors (``plain_inputs``), and the
gradients are still stored through ``ShardedParameter.grad``'s setter (the local shard).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import PipelineStage

from fxtp.runtime.sharded import plain

__all__ = ["FxtpStage"]


class FxtpStage(PipelineStage):
    """``torch.distributed.pipelining.PipelineStage`` over an fxtp stage module, whose backward
    passes (full, input and weight) run with sharded tensors plain (NOTE: [split backward of
    sharded parameters]). Same arguments as ``PipelineStage``."""

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        with plain():
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        with plain():
            return super().backward_weight_one_chunk(*args, **kwargs)
