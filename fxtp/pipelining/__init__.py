"""Pipeline parallelism over fxtp's tensor-parallel stages (``fxtp.pipeline``).

- ``split``: the stage modules of a decoder LM and the cut balanced by predicted FLOPs and bytes.
- ``pipe``: :func:`pipeline`, the stages on a ``("pp", "dp", "tp")`` mesh under
  ``torch.distributed.pipelining``'s schedules, tied embeddings and the global norm.
- ``report``: :class:`PipelineReport`: each stage's blocks, the schedule, the bubble, the bytes.
"""

from fxtp.pipelining.pipe import Pipeline, pipeline
from fxtp.pipelining.report import PipelineReport, bubble_fraction
from fxtp.pipelining.split import StageModule, balance

__all__ = ["Pipeline", "PipelineReport", "StageModule", "balance", "bubble_fraction", "pipeline"]
