"""The module-level state of torch that fxtp adjusts, each in one place: the type lists of its
``_foreach_`` paths, and argument defaults that hold the default process group.

NOTE: [foreach types]
fxtp's tensor types on torch's multi-tensor (``_foreach_``) paths.

torch's optimizers take their ``_foreach_`` path by default (``_default_to_fused_or_foreach`` in
``torch/optim/optimizer.py``, on CUDA), and ``clip_grad_norm_`` and ``get_total_norm`` theirs
(``torch/utils/_foreach_utils.py``, on the CPU too), only for the exact types in two lists;
DTensor appends itself to both (``torch/distributed/tensor/__init__.py``). Both lists are
private: this module is the one place fxtp touches them. fxtp's ``ShardedParameter`` and
``ShardedTensor`` run every ``_foreach_`` op on the shard (NOTE: [sharded parameters] in
fxtp/runtime/sharded.py), so they join: without it an AdamW over ``pm.parameters()`` on GPUs
silently ran its per-tensor loop, where the same model under DTensor's plan runs the foreach
kernels, and ``clip_grad_norm_`` all_reduced once per sharded parameter instead of once.

NOTE: [world defaults]
``torch/distributed/nn/functional.py`` (torch 2.13) declares its autograd collectives with the
default group as an argument default, ``def all_reduce(tensor, op=ReduceOp.SUM,
group=group.WORLD)``: evaluated when the module is imported. Imported after
``init_process_group``, ten functions keep that ``ProcessGroup`` in their ``__defaults__``
for the life of the process: ``destroy_process_group()`` cannot free it, its gloo threads run on
at exit, and the process sometimes aborts there ("terminate called without an active
exception", exit -6; NCCL would keep its communicator). ``torch._dynamo`` imports that module
(through ``torch.distributed.fsdp`` and ``torch.distributed._shard``), and fxtp imports
``torch._dynamo`` on first use, usually after a script's ``init_process_group``: the README's
quickstart under torchrun aborted at exit in 2 of about 130 runs (2026-12-06; none of 120 with
this and the group held by name in ``pm``, fxtp/api.py's ``_mode_graphs``), a plain-torch
script that imports ``torch.distributed.fsdp`` after ``init_process_group`` in 6 of 25.
Imported before ``init_process_group`` the defaults are ``None``, which every one of these
functions reads as the default group at call time. :func:`unbind_world_defaults` sets what the
late import bound back to that ``None``: the same group while it lives, and none held after
it is destroyed. The module and its functions are torch's own; this is the one place fxtp
touches them.
"""

from __future__ import annotations

__all__ = ["join_foreach_types", "unbind_world_defaults"]


def join_foreach_types(*types: type) -> None:
    """Add ``types`` to torch's lists of types its ``_foreach_`` paths take (idempotent)."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for listed in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        for cls in types:
            if cls not in listed:
                listed.append(cls)


def unbind_world_defaults() -> None:
    """Replace each ``ProcessGroup`` in ``torch.distributed.nn.functional``'s argument defaults
    with ``None`` (NOTE: [world defaults]; idempotent)."""
    import torch.distributed as dist

    if not dist.is_available():  # a torch built without distributed has no such module
        return
    from torch.distributed.nn import functional

    for fn in vars(functional).values():
        defaults = getattr(fn, "__defaults__", None)
        if getattr(fn, "__module__", None) == functional.__name__ and defaults:
            if any(isinstance(d, dist.ProcessGroup) for d in defaults):
                fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)
