"""fxtp: automatic tensor parallelism for PyTorch models, explained.

``fxtp.compile(model, world_size, example_inputs=...)`` captures the model as an ATen graph,
analyzes which dims of every tensor can stay sharded, picks colwise/rowwise layers, inserts
Megatron-LM's collectives and returns this rank's :class:`ParallelModule` with a
:class:`Report` saying why each layer got its style.
"""

from fxtp.api import analyze, compile
from fxtp.errors import (
    FxtpCaptureError,
    FxtpConfigError,
    FxtpError,
    FxtpInputError,
    FxtpPlanError,
    FxtpRuntimeError,
)
from fxtp.placement import Partial, Replicate, Shard
from fxtp.report import Report
from fxtp.runtime import ParallelModule

import passes.rules  # noqa: E402,F401  (registers the op rules)

__all__ = [
    "compile",
    "analyze",
    "ParallelModule",
    "Report",
    "Replicate",
    "Shard",
    "Partial",
    "FxtpError",
    "FxtpConfigError",
    "FxtpInputError",
    "FxtpCaptureError",
    "FxtpPlanError",
    "FxtpRuntimeError",
]

__version__ = "0.1.0"
