"""The fxtp exception hierarchy.

Every error fxtp raises on purpose is an :class:`FxtpError`. Messages locate the problem (the
FX node, the module FQN, the source line when known) and say what the user can do about it.
``assert`` is reserved for internal invariants.
"""

from __future__ import annotations

__all__ = [
    "FxtpError",
    "FxtpConfigError",
    "FxtpInputError",
    "FxtpCaptureError",
    "FxtpPlanError",
    "FxtpRuntimeError",
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
