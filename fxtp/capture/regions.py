"""The ``torch.utils.checkpoint`` regions of a model, recorded while it is captured.

NOTE: [checkpoint regions at capture]
Tracing runs ``torch.utils.checkpoint.checkpoint(fn, *args)`` as a plain call: the captured
graph holds ``fn``'s ops inline and nothing says they were to be recomputed, so the rank graph
would silently keep every activation. While :func:`recording_checkpoints` is active, each
checkpoint call runs ``fn`` inside ``torch.fx.traceback.annotate({"fxtp_checkpoint": i})``, so
torch.export writes ``node.meta["custom"]["fxtp_checkpoint"] = i`` on every op ``fn`` made;
``passes/regions/checkpointing.py`` turns the tags into regions and the rewrite runs each region under
``torch.utils.checkpoint`` again (``fxtp.core.recompute``). A selective region's policy
(``context_fn=``) is kept with its number (:attr:`Recorded.context_fns`) and applied again.

``annotate`` works with torch.export's tracers only, not ``torch.fx.symbolic_trace``: a
checkpoint call met during a symbolic trace raises :class:`CheckpointInFxTrace`, so ``"auto"``
moves on to ``"export"``.

NOTE: [private torch API] ``checkpoint`` looks both of its implementations up as module
globals at each call, ``CheckpointFunction`` (``use_reentrant=True``, public) and
``_checkpoint_without_reentrant_generator`` (``use_reentrant=False``, private); replacing those
two names for the capture catches every way a model calls it (``from torch.utils.checkpoint
import checkpoint`` binds the function, not them). They are replaced here only, and restored.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils.checkpoint as torch_checkpoint

from fxtp.core.recompute import TAG

__all__ = ["Recorded", "recording_checkpoints", "CheckpointInFxTrace"]


class CheckpointInFxTrace(RuntimeError):
    """A checkpoint call during ``torch.fx.symbolic_trace``, which cannot tag its region."""


@dataclass
class Recorded:
    """The checkpoint calls met during one capture: their number, and the ``context_fn`` of
    each selective one (NOTE: [checkpoint regions at capture])."""

    calls: int = 0
    context_fns: dict[int, Callable[[], Any]] = field(default_factory=dict)
    symbolic: bool = False  # the capture is a torch.fx.symbolic_trace

    def _next(self, context_fn: Optional[Callable[[], Any]]) -> int:
        if self.symbolic:
            raise CheckpointInFxTrace(
                "torch.utils.checkpoint regions cannot be tagged by torch.fx.symbolic_trace; torch.export captures them"
            )
        index = self.calls
        self.calls += 1
        if context_fn is not None and context_fn is not torch_checkpoint.noop_context_fn:
            self.context_fns[index] = context_fn
        return index


class _TaggedFunction:
    """Stands for ``CheckpointFunction`` during a capture: runs the function in its region."""

    def __init__(self, recorded: Recorded) -> None:
        self.recorded = recorded

    def apply(self, function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        with torch.fx.traceback.annotate({TAG: self.recorded._next(None)}):
            return function(*args)


def _tagged_generator(recorded: Recorded):
    def generator(fn, preserve_rng_state, context_fn, determinism_check, debug, *args, **kwargs) -> Iterator[None]:
        with torch.fx.traceback.annotate({TAG: recorded._next(context_fn)}):
            yield  # checkpoint() runs fn(*args, **kwargs) here

    return generator


@contextlib.contextmanager
def recording_checkpoints(symbolic: bool = False) -> Iterator[Recorded]:
    """For the block, every ``torch.utils.checkpoint.checkpoint`` call tags its region's ops
    (NOTE: [checkpoint regions at capture]); ``symbolic``: a symbolic trace, where a checkpoint
    call raises :class:`CheckpointInFxTrace`."""
    recorded = Recorded(symbolic=symbolic)
    saved = torch_checkpoint.CheckpointFunction, torch_checkpoint._checkpoint_without_reentrant_generator
    torch_checkpoint.CheckpointFunction = _TaggedFunction(recorded)  # type: ignore[misc, assignment]
    torch_checkpoint._checkpoint_without_reentrant_generator = _tagged_generator(recorded)  # type: ignore[assignment]
    try:
        with torch.fx.traceback.preserve_node_meta():  # export copies the annotation into node.meta only then
            yield recorded
    finally:
        torch_checkpoint.CheckpointFunction, torch_checkpoint._checkpoint_without_reentrant_generator = saved
