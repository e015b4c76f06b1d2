"""The planner: which mesh, sequence parallelism, checkpointing and micro-batches run a model
fastest under a memory budget (``fxtp.plan``).

- ``hardware``: the sourced device and link table, and user overrides.
- ``params``: exact parameter shards per tensor-parallel rank, repeated blocks analyzed once.
- ``model``: a transformer's FLOPs and activation bytes.
- ``comm``: a ring collective's time (NCCL's alpha-beta model) and FSDP2's exposed communication.
- ``costs``: predicted memory and step time of one configuration.
- ``search``: the search, ``plan``.
- ``parallel_plan``: the frozen result, ``ParallelPlan``.
- ``calibration``: a ``Hardware`` measured on the local ranks (``calibrate``).
- ``measurement``: predicted against measured on the local ranks (``measure``, ``Measurement``).

``plan`` and ``ParallelPlan`` load on first use (as ``fxtp``'s own names do), so the CLI's
parser can read ``HARDWARE`` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from fxtp.planner.hardware import HARDWARE, Hardware

__all__ = ["plan", "ParallelPlan", "Hardware", "HARDWARE", "calibrate", "measure", "Measurement"]

_LAZY = {"plan": "fxtp.planner.search", "ParallelPlan": "fxtp.planner.parallel_plan", "calibrate": "fxtp.planner.calibration",
         "measure": "fxtp.planner.measurement", "Measurement": "fxtp.planner.measurement"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'fxtp.planner' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
