"""fxtp's tensor types on torch's multi-tensor (``_foreach_``) paths.

torch's optimizers take their ``_foreach_`` path by default (``_default_to_fused_or_foreach`` in
``torch/optim/optimizer.py``, on CUDA), and ``clip_grad_norm_`` and ``get_total_norm`` theirs
(``torch/utils/_foreach_utils.py``, on the CPU too), only for the exact types in two lists;
DTensor appends itself to both (``torch/distributed/tensor/__init__.py``). Both lists are
private: this module is the one place fxtp touches them. fxtp's ``ShardedParameter`` and
``ShardedTensor`` run every ``_foreach_`` op on the shard (NOTE: [sharded parameters] in
fxtp/runtime/sharded.py), so they join: without it an AdamW over ``pm.parameters()`` on GPUs
silently ran its per-tensor loop, where the same model under DTensor's plan runs the foreach
kernels, and ``clip_grad_norm_`` all_reduced once per sharded parameter instead of once.
"""

from __future__ import annotations

__all__ = ["join_foreach_types"]


def join_foreach_types(*types: type) -> None:
    """Add ``types`` to torch's lists of types its ``_foreach_`` paths take (idempotent)."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for listed in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        for cls in types:
            if cls not in listed:
                listed.append(cls)
