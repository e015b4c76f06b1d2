"""GradScaler's found-inf over every mesh dim a gradient is split over, also under FSDP2.

NOTE: [found-inf over dp x tp]
``torch.amp.GradScaler.unscale_`` calls ``torch._amp_foreach_non_finite_check_and_unscale_(grads,
found_inf, inv_scale)`` once per device and dtype, and ``step`` skips when ``found_inf`` is set.
Every rank must see the same flag, or some step while others skip and replicated parameters
drift apart. Where the flag is combined:

* fxtp's own parameters (alone, or under DDP on a data-parallel group): a sharded gradient is a
  ``ShardedTensor`` and the op all_reduces the flag (max) over the tensor-parallel group (NOTE:
  [sharded parameters] in fxtp/runtime/sharded.py); DDP makes the gradients, and so the flag,
  equal over data-parallel replicas.
* FSDP2 (``fully_shard(pm, mesh=mesh["dp"])``, also over blocks): the gradients are FSDP2's
  DTensors over the data-parallel mesh, made from plain tensors, and DTensor's handler of the op
  (``found_inf_reduce_handler`` in ``torch/distributed/tensor/_dispatch.py``) combines the flag
  over the non-replicated dims of that mesh only: over dp, never over tp. An inf in one rank's
  shard of a sharded gradient left the tensor-parallel peers stepping while it skipped.
* FSDP2 over tensor-parallel DTensors (``to_dtensor_parameters``, NOTE: [DTensor parameters for
  FSDP2]): 2-D DTensors; DTensor's handler reads the placements of the *first* gradient only, so
  a list led by a tensor-parallel-replicated gradient (a norm's weight) skipped tp as well.

So fxtp wraps DTensor's handler once (:func:`combine_found_inf_over_tp`: the first forward of a
``ParallelModule`` under FSDP2 installs it and registers the module): after DTensor's own
reduction, where the list holds the gradient of a registered module's parameter (FSDP2 reshards
after backward, so its parameters then are its DTensors and their ``.grad`` the very tensors
GradScaler passes), the flag is combined (max) over that module's tensor-parallel group too. A
max over ranks whose flags already agree changes nothing, so this is exact whatever the
placements, and every rank of a group makes the same calls (the same parameters, so the same
lists). Lists of other DTensors (not fxtp's) get DTensor's handler unchanged. DTensor keeps its handlers in a private table
(``DTensor._op_dispatcher._custom_op_handlers``, which torch's own ``loss_parallel`` edits the
same way); this module is its one user in fxtp.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fxtp.runtime.sharded import resolve_group

__all__ = ["combine_found_inf_over_tp"]

_OP = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default
_MODULES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # ParallelModules under FSDP2, tp > 1
_TORCH_HANDLER: list[Callable[..., Any]] = []  # DTensor's own, once wrapped


def combine_found_inf_over_tp(pm: nn.Module) -> None:
    """Make GradScaler's found-inf on ``pm``'s FSDP2 gradients span ``pm``'s tensor-parallel
    group too (NOTE: [found-inf over dp x tp]). Called by the first forward under FSDP2; a
    module on one rank needs nothing."""
    if pm._world_size <= 1 or pm._group_name is None:
        return
    _MODULES.add(pm)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    if not _TORCH_HANDLER:
        _TORCH_HANDLER.append(handlers[_OP])
        handlers[_OP] = _found_inf_over_tp_too


def _found_inf_over_tp_too(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """DTensor's handler of the found-inf op, then the flag's max over the tensor-parallel group
    of each registered module whose gradients the list holds."""
    out = _TORCH_HANDLER[0](op_call, args, kwargs)
    grads, found_inf = list(args[0]), args[1]
    ids = {id(g) for g in grads}
    names = {pm._group_name for pm in list(_MODULES) if any(id(p.grad) in ids for p in pm.parameters() if p.grad is not None)}
    for name in sorted(names):
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=resolve_group(name))
    return out
