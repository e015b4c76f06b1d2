"""fxtp under ``torch.autocast``: the autocast state a graph is captured for, and the dtype
autocast gives an op that fxtp's rewrite replaces with ops of its own.

NOTE: [autocast graphs]
A graph is traced at the dtypes its capture sees, and the model's Python may read them: Hugging
Face's experts cast their sum with ``.to(hidden.dtype)``, a norm upcasts with ``.float()`` and
casts back to the input's dtype, code branches on ``x.dtype``. Captured without autocast, every
such cast is a no-op on float32 values and none is in the graph, so the graph run under the
user's ``torch.autocast`` would return float32 where the model returns bf16 (and round where it
does not). So a graph belongs to one autocast state, :func:`autocast_state` (the device types
with autocast on, and their dtypes), and it is captured under exactly that state
(:func:`autocast_as`): torch.export then records the casts the model's Python makes (``to``,
``float``, a branch's side), while the ops autocast casts itself (``linear``, SDPA, cross entropy)
stay as they are in the graph and get their cast when the graph runs under the same state.
fxtp.runtime.variants keeps a graph per autocast state (NOTE: [low-precision graphs] there).

NOTE: [autocast policy of replaced ops]
Under ``torch.autocast`` each ATen op has a cast policy per device type
(``aten/src/ATen/autocast_mode.cpp``): ``lower_precision_fp`` (``linear``, ``mm``, SDPA),
``fp32`` (``nll_loss``, ``cross_entropy_loss`` on every device type; ``layer_norm`` on CUDA,
XPU and MPS, not on CPU) and ``promote``. A rank graph runs under the user's autocast, so the
ATen ops it keeps get their policy as on one device; an op fxtp replaces with its own (the
vocab-parallel cross entropy, the distributed LayerNorm) must give the dtype the replaced op
would have: these functions say which, from torch's public autocast state, where tracing
(``torch.compile``) can read it too.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch

__all__ = ["ELIGIBLE", "AutocastState", "autocast_as", "autocast_state", "fp32_policy_dtype"]

# ((device type, dtype), ...) for each device type with autocast on, sorted; () for none
AutocastState = tuple[tuple[str, torch.dtype], ...]


# Whether torch.autocast knows a device type, read once per type: ``torch.amp.is_autocast_available``
# is not traceable, and a call of it in ``pm.forward`` broke ``torch.compile(pm)``'s graph in two.
# Seeded at import with the built-in types, so a compiled forward only reads the dict.
_AVAILABLE: dict[str, bool] = {d: torch.amp.is_autocast_available(d) for d in ("cpu", "cuda", "xpu", "mps", "hpu", "meta")}


def _supported(device_types: Iterable[str]) -> list[str]:
    """The device types of ``device_types`` torch.autocast knows (not ``meta``), sorted."""
    for d in set(device_types) - _AVAILABLE.keys():
        _AVAILABLE[d] = torch.amp.is_autocast_available(d)
    return sorted(d for d in set(device_types) if _AVAILABLE[d])


def autocast_state(device_types: Iterable[str]) -> AutocastState:
    """The autocast on now for ``device_types`` (e.g. ``{"cpu"}``, the types a module's tensors
    are on): ``(device type, dtype)`` for each with autocast enabled (NOTE: [autocast graphs])."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in _supported(device_types) if torch.is_autocast_enabled(d))


@contextlib.contextmanager
def autocast_as(state: AutocastState, device_types: Iterable[str]) -> Iterator[None]:
    """Exactly ``state`` for the block: autocast on with its dtype for each device type it
    lists, off for the other ``device_types`` (a capture sees the call's state, not the one
    around it: NOTE: [autocast graphs])."""
    on = dict(state)
    with contextlib.ExitStack() as stack:
        for device in _supported(set(device_types) | set(on)):
            dtype = on.get(device, torch.get_autocast_dtype(device))
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=device in on))
        yield

# The device types whose autocast runs each op in fp32 (the ``fp32`` lists of autocast_mode.cpp).
_FP32_DEVICES: dict[str, frozenset[str]] = {
    "cross_entropy_loss": frozenset({"cpu", "cuda", "xpu", "mps", "hpu"}),  # cpu: its own entry; others: nll_loss, log_softmax
    "layer_norm": frozenset({"cuda", "xpu", "mps"}),
}
# Autocast casts only these (``is_autocast_eligible``: floating, not float64).
ELIGIBLE = frozenset({torch.float16, torch.bfloat16, torch.float32})


def fp32_policy_dtype(op: str, x: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype of ``op``'s result (``"cross_entropy_loss"``, ``"layer_norm"``) on input
    ``x`` under the autocast state now: ``float32`` where autocast is on for ``x``'s device
    type, lists ``op`` in fp32 there and ``x`` is eligible; ``dtype`` (the op's dtype without
    autocast) otherwise."""
    device = x.device.type
    if device in _FP32_DEVICES[op] and x.dtype in ELIGIBLE and torch.is_autocast_enabled(device):
        return torch.float32
    return dtype
