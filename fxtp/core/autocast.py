"""The dtype autocast gives an op that fxtp's rewrite replaces with ops of its own.

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

import torch

__all__ = ["fp32_policy_dtype"]

# The device types whose autocast runs each op in fp32 (the ``fp32`` lists of autocast_mode.cpp).
_FP32_DEVICES: dict[str, frozenset[str]] = {
    "cross_entropy_loss": frozenset({"cpu", "cuda", "xpu", "mps", "hpu"}),  # cpu: its own entry; others: nll_loss, log_softmax
    "layer_norm": frozenset({"cuda", "xpu", "mps"}),
}
# Autocast casts only these (``is_autocast_eligible``: floating, not float64).
_ELIGIBLE = frozenset({torch.float16, torch.bfloat16, torch.float32})


def fp32_policy_dtype(op: str, x: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype of ``op``'s result (``"cross_entropy_loss"``, ``"layer_norm"``) on input
    ``x`` under the autocast state now: ``float32`` where autocast is on for ``x``'s device
    type, lists ``op`` in fp32 there and ``x`` is eligible; ``dtype`` (the op's dtype without
    autocast) otherwise."""
    device = x.device.type
    if device in _FP32_DEVICES[op] and x.dtype in _ELIGIBLE and torch.is_autocast_enabled(device):
        return torch.float32
    return dtype
