"""fxtp: automatic tensor parallelism for PyTorch models, explained.

``fxtp.compile(model, world_size, example_inputs=...)`` captures the model as an ATen graph,
analyzes which dims of every tensor can stay sharded, picks colwise/rowwise layers, inserts
Megatron-LM's collectives and returns this rank's :class:`ParallelModule` with a
:class:`Report` saying why each layer got its style.

The package is grouped by stage, and imports run one way (``tests/test_structure.py``):

- ``fxtp.core``: placements, errors and what rank graphs call (local ops, collectives, rng,
  regathered activations). The passes use only this.
- ``fxtp.capture``: the frontends (fx, export, dynamo) and the inputs' dynamic dims.
- ``passes`` (a sibling package): analysis and rewrite.
- ``fxtp.runtime``: the ``ParallelModule``, its parameter layouts, checkpoints, generation.
- ``fxtp.explain``: the report and rendering.
- ``fxtp.api``: the pipeline, ``compile`` and ``analyze`` (the passes between capture and
  rewrite, in order: ``fxtp.planning``).
- ``fxtp.planner``: ``plan``, the mesh and policies by predicted step time under a memory budget.
- ``fxtp.parallelizing``: ``parallelize``, a plan applied in one call on a ``dp x tp`` mesh
  (``compile`` on tp, ``torch.compile`` and FSDP2 per block on dp).
- ``fxtp.cli``: the command line (``fxtp``, ``python -m fxtp``), its built-in examples, ``--verify``
  and the demo; nothing below imports it.

``import fxtp`` loads only the errors (no torch); everything else, the placements included,
loads on first use.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

from fxtp.core.errors import (
    FxtpCaptureError,
    FxtpConfigError,
    FxtpError,
    FxtpInputError,
    FxtpPlanError,
    FxtpRuntimeError,
)

__all__ = [
    "compile",
    "analyze",
    "parallelize",
    "plan",
    "pipeline",
    "ParallelPlan",
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

# Public names that load their stage on first use, so `import fxtp` stays cheap (no torch:
# `fxtp --help` answers without it).
_LAZY = {
    "compile": "fxtp.api",
    "analyze": "fxtp.api",
    "parallelize": "fxtp.parallelizing",
    "plan": "fxtp.planner",
    "pipeline": "fxtp.pipelining",
    "ParallelPlan": "fxtp.planner",
    "ParallelModule": "fxtp.runtime.module",
    "Report": "fxtp.explain.report",
    "Replicate": "fxtp.core.placement",
    "Shard": "fxtp.core.placement",
    "Partial": "fxtp.core.placement",
}

# The flat module paths before the split by stage (README, "Changes to the design contracts"):
# `fxtp.local_ops` and the others stay importable as aliases of their new modules.
_MOVED = {
    "activations": "fxtp.core.activations",
    "collectives": "fxtp.core.collectives",
    "errors": "fxtp.core.errors",
    "local_ops": "fxtp.core.local_ops",
    "placement": "fxtp.core.placement",
    "rng": "fxtp.core.rng",
    "shapes": "fxtp.capture.shapes",
    "checkpoint": "fxtp.runtime.checkpoint",
    "generation": "fxtp.runtime.generation",
    "layout": "fxtp.runtime.layout",
    "demo": "fxtp.cli.demo",
    "examples": "fxtp.cli.examples",
    "hf_config": "fxtp.capture.hf_config",
    "inspection": "fxtp.cli.inspection",
    "render": "fxtp.explain.render",
    "report": "fxtp.explain.report",
    "verify": "fxtp.cli.verify",
    # the CLI's room before it left fxtp.explain (``fxtp.cli`` is now the package itself)
    "explain.cli": "fxtp.cli.main",
    "explain.demo": "fxtp.cli.demo",
    "explain.examples": "fxtp.cli.examples",
    "explain.families": "fxtp.cli.families",
    "explain.hf_config": "fxtp.capture.hf_config",
    "explain.inspection": "fxtp.cli.inspection",
    "explain.progress": "fxtp.cli.progress",
    "explain.verify": "fxtp.cli.verify",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``import fxtp.<old name>`` to the module that now holds it (the same object)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        prefix, _, name = fullname.partition(".")
        if prefix != __name__ or name not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(_MOVED[spec.name.partition(".")[2]])
        spec.loader_state = module.__spec__  # the import system sets __spec__ to the alias's
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = module.__spec__.loader_state  # already executed; keep its own spec


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _MOVED:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'fxtp' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {name for name in _MOVED if "." not in name})
