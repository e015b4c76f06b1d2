"""Index lists of a ``meta`` model kept as values while it is captured.

NOTE: [index lists on meta]
``x[..., [-2], :]`` turns the list into an index tensor on ``x``'s device, which torch.export
lifts as a constant of the program. On a model whose parameters are on ``meta`` (NOTE: [meta
models] in ``passes/normalize.py``) that constant is a ``meta`` tensor: its values are gone, and
``passes/normalize.py`` cannot read Falcon's ``fused_qkv[..., [-2], :]`` as the slice of the key
head. While :func:`cpu_index_lists` is active, an index list of Python ints given to
``Tensor.__getitem__`` becomes a CPU ``int64`` tensor first: the same advanced indexing (torch
takes CPU index tensors for a tensor on any device, ``meta`` included), and the lifted constant
keeps its values. Only the ``meta`` capture uses it; a model with real weights lifts real values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cpu_index_lists"]


def _as_tensor(index: Any) -> Any:
    if isinstance(index, list) and index and all(type(i) is int for i in index):
        return torch.tensor(index, dtype=torch.int64, device="cpu")
    return index


class cpu_index_lists(TorchFunctionMode):  # noqa: N801 - used as a context manager, as torch's modes are
    """``with cpu_index_lists(): torch.export.export(model, ...)`` (NOTE: [index lists on meta])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is torch.Tensor.__getitem__ and len(args) == 2:
            index = args[1]
            args = (args[0], tuple(map(_as_tensor, index)) if isinstance(index, tuple) else _as_tensor(index))
        return func(*args, **(kwargs or {}))
