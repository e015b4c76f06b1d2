"""In-place arithmetic under ``torch.fx.symbolic_trace``.

NOTE: [in-place arithmetic at fx capture]
``torch.fx.Proxy`` defines ``__add__`` but no ``__iadd__``, so Python runs ``y += x`` on a
proxy as ``y = y + x`` and the trace records an out-of-place add. That is not the model: an
in-place op keeps ``y``'s dtype (under bf16 autocast a bf16 ``y`` plus a float32 ``x`` stays
bf16, the out-of-place sum is float32) and writes into ``y``, so every other reference to it
(a view, a name bound before) sees the sum. :class:`InPlaceProxy` records each augmented
assignment as its ``operator.i*`` call (``operator.iadd(y, x)``, which torch.fx's codegen writes
back as ``y += x``); torch.export of the traced module then runs ``Tensor.__iadd__`` and records
``aten.add_.Tensor``, as it does for the model itself. The passes take in-place ops by their
functional rule (NOTE: [mutated layout] in passes/rules/variants.py).
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch.fx.graph import inplace_methods

__all__ = ["InPlaceProxy"]


class InPlaceProxy(torch.fx.Proxy):
    """A ``torch.fx.Proxy`` whose augmented assignments (``+=``, ``*=``, ``-=``, ``/=``, ...)
    record the in-place ``operator`` call (NOTE: [in-place arithmetic at fx capture])."""


def _in_place(op: Callable[[Any, Any], Any]) -> Callable[[InPlaceProxy, Any], torch.fx.Proxy]:
    def method(self: InPlaceProxy, other: Any) -> torch.fx.Proxy:
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    method.__name__ = f"__{op.__name__}__"
    return method


for _name in sorted(inplace_methods):
    if _name != "setitem":  # a proxy's __setitem__ is torch.fx's own
        setattr(InPlaceProxy, f"__{_name}__", _in_place(getattr(operator, _name)))
