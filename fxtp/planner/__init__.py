"""The planner: which mesh, sequence parallelism, checkpointing and micro-batches run a model
fastest under a memory budget (``fxtp.plan``).

- ``hardware``: the sourced device and link table, and user overrides.
- ``params``: exact parameter shards per tensor-parallel rank, repeated blocks analyzed once.
- ``model``: a transformer's FLOPs and activation bytes.
- ``comm``: a ring collective's time (NCCL's alpha-beta model) and FSDP2's exposed communication.
- ``costs``: predicted memory and step time of one configuration.
- ``search``: the search, ``plan``.
- ``parallel_plan``: the frozen result, ``ParallelPlan``.
"""

from fxtp.planner.hardware import HARDWARE, Hardware
from fxtp.planner.parallel_plan import ParallelPlan
from fxtp.planner.search import plan

__all__ = ["plan", "ParallelPlan", "Hardware", "HARDWARE"]
