"""The fxtp exception hierarchy.

Every error fxtp raises on purpose is an :class:`FxtpError`. Messages locate the problem (the
FX node, the module FQN, the source line when known) and say what the user can do about it.
``assert`` is reserved for internal invariants.
"""

from __future__ import annotations

import os

__all__ = [
    "FxtpError",
    "FxtpConfigError",
    "FxtpInputError",
    "FxtpCaptureError",
    "FxtpPlanError",
    "FxtpRuntimeError",
    "raised_by_an_op",
]


class FxtpError(Exception):
    """Base class of every error fxtp raises on purpose."""


class FxtpConfigError(FxtpError, ValueError):
    """A bad argument to ``fxtp.compile``/``fxtp.analyze`` (world_size, capture, plan, group)."""


class FxtpInputError(FxtpError, ValueError):
    """Example inputs that do not fit the model, or runtime inputs that do not fit the compiled graph."""


class FxtpCaptureError(FxtpError):
    """No capture frontend could turn the model into a graph; the message lists each attempt."""


class FxtpPlanError(FxtpError):
    """A user ``plan=`` override that cannot be honoured, with the reason."""


class FxtpRuntimeError(FxtpError, RuntimeError):
    """The parallel module was run in a setting it cannot run in (e.g. no process group)."""


def raised_by_an_op(exc: BaseException) -> bool:
    """Whether ``exc`` came from an operator the graph called (an embedding or index lookup: its
    innermost Python frame is the generated graph code or torch's op dispatch), not from Python code
    such as a hook or fxtp's own (NOTE: [block bodies run without module hooks] in
    fxtp/runtime/blocks.py). ``ParallelModule.forward`` reports only the former as the user's
    ``FxtpInputError``."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename
    return filename.startswith("<eval_with_key>") or filename.endswith(os.path.join("torch", "_ops.py"))
