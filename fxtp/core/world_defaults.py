"""torch's argument defaults that hold the default process group, unbound.

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
quickstart under torchrun aborted at exit in 2 of about 130 runs (2026-12-06), a plain-torch
script that imports ``torch.distributed.fsdp`` after ``init_process_group`` in 6 of 25.
Imported before ``init_process_group`` the defaults are ``None``, which every one of these
functions reads as the default group at call time. :func:`unbind_world_defaults` sets what the
late import bound back to that ``None``: the same group while it lives, and none held after
it is destroyed. The module and its functions are torch's own; this is the one place fxtp
touches them.
"""

from __future__ import annotations

__all__ = ["unbind_world_defaults"]


def unbind_world_defaults() -> None:
    """Replace each ``ProcessGroup`` in ``torch.distributed.nn.functional``'s argument defaults
    with ``None`` (NOTE: [world defaults]; idempotent)."""
    import torch.distributed as dist
    from torch.distributed.nn import functional

    for fn in vars(functional).values():
        defaults = getattr(fn, "__defaults__", None)
        if getattr(fn, "__module__", None) == functional.__name__ and defaults:
            if any(isinstance(d, dist.ProcessGroup) for d in defaults):
                fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)
