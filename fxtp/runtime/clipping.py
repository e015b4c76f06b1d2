"""``pm.clip_grad_norm_``: gradient clipping by the single device's total norm, in one all_reduce.

``torch.nn.utils.clip_grad_norm_(pm.parameters(), ...)`` is exact too (NOTE: [sharded
parameters] in fxtp/runtime/sharded.py), in one all_reduce on its ``_foreach_norm`` path (one
per sharded parameter with ``foreach=False``), but after FSDP2's ``fully_shard`` (whose DTensor
parameters span the data-parallel mesh only), it would miss the tensor-parallel dim. :func:`clip_grad_norm_` sums every rank's share once:

* a tensor-parallel shard counts on every rank (its elements are on that rank only; of a grouped
  shard, NOTE: [grouped shards], the rows the rank owns);
* a replicated parameter counts on tensor-parallel rank 0 only (every rank holds it);
* under FSDP2 each rank counts its data-parallel block of the above, and the one all_reduce
  spans the data-parallel x tensor-parallel ranks (the default group, which must be exactly those).

NOTE: [clipping under FSDP2]
FSDP2's ``fully_shard(pm, mesh=mesh["dp"])`` replaces every parameter by its own DTensor over the
data-parallel mesh, made from the rank's tensor-parallel shard as a plain tensor. torch's
``clip_grad_norm_`` and ``get_total_norm`` on those reduce over the data-parallel mesh only, so
each tensor-parallel rank gets the norm of its own shards (too small) and clips by its own
coefficient, and replicated parameters drift apart. DTensor would express the 2-D layout
(``(Shard(0), Shard(d))`` on a ``(dp, tp)`` mesh, torchtitan's parameters) only if fxtp's
parameters were tensor-parallel DTensors before ``fully_shard``, which they are not (NOTE:
[sharded parameters] says why), and a DTensor gradient's reductions cannot be intercepted. So
the first forward of a ``ParallelModule`` wrapped by ``fully_shard`` with sharded parameters
warns (:func:`warn_under_fsdp`, an :class:`FsdpClippingWarning`) that torch's whole-tensor
utilities would be per-rank there, and points to :func:`clip_grad_norm_`, which is exact.
``fxtp.runtime.dtensor_params.to_dtensor_parameters(pm, mesh["tp"])`` before ``fully_shard``
makes them tensor-parallel DTensors where a placement can express them, and FSDP2 then makes
2-D ones over which torch's utilities are exact (NOTE: [DTensor parameters for FSDP2]; no warning).
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fxtp.core.errors import FxtpConfigError
from fxtp.core.placement import REPLICATE, Shard, local_ranges, owned_part, owned_ranges
from fxtp.runtime.blocks import model_fqn
from fxtp.runtime.sharded import local_tensor, resolve_group

__all__ = ["clip_grad_norm_", "FsdpClippingWarning", "norm_share", "scale_by_norm_", "warn_under_fsdp"]


class FsdpClippingWarning(UserWarning):
    """torch's whole-tensor utilities on FSDP2's parameters of a ``ParallelModule`` would miss
    the tensor-parallel dim (NOTE: [clipping under FSDP2])."""


def warn_under_fsdp(pm: nn.Module) -> bool:
    """Warn once when ``pm`` is wrapped by FSDP2's ``fully_shard`` and has sharded parameters
    (NOTE: [clipping under FSDP2]); returns whether it is so wrapped (nothing left to check)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(pm, FSDPModule):
        return False
    sharded = [fqn for fqn, p in pm.placements.items() if isinstance(p, Shard)]
    on_tp = any(isinstance(p, DTensor) and (p.device_mesh.ndim == 2 or p.device_mesh.get_group().group_name == pm._group_name)
                for p in pm.parameters())  # NOTE: [DTensor parameters for FSDP2]: torch's clipping is exact
    if sharded and pm._world_size > 1 and not on_tp:
        warnings.warn(
            f"fxtp: this ParallelModule is wrapped by FSDP2's fully_shard, whose DTensor parameters span the "
            f"data-parallel mesh only; {len(sharded)} parameters (e.g. {sharded[0]!r}) are also sharded over the "
            f"tensor-parallel group ({pm._world_size} ranks), so torch.nn.utils.clip_grad_norm_, get_total_norm or a "
            "norm of these parameters would give each tensor-parallel rank its own shards' value and clip it by its own "
            "coefficient (NOTE: [clipping under FSDP2]). fix: clip with pm.clip_grad_norm_(max_norm), the norm over "
            "both dims in one all_reduce, or call fxtp.runtime.dtensor_params.to_dtensor_parameters(pm, mesh['tp']) "
            "before fully_shard (NOTE: [DTensor parameters for FSDP2])", FsdpClippingWarning, stacklevel=3)
    return True


def _group(pm: nn.Module, grads: list[torch.Tensor]) -> Optional[dist.ProcessGroup]:
    """The group the total norm is reduced over: the tensor-parallel one, or, under FSDP2, the
    default group when it holds exactly the data-parallel x tensor-parallel ranks."""
    tp = pm._world_size if pm._group_name is not None else 1
    # FSDP2's mesh: dp, or (dp, tp) over DTensor parameters (NOTE: [DTensor parameters for FSDP2])
    dp = max((g.device_mesh.size(0) for g in grads if isinstance(g, DTensor)), default=1)
    if dp == 1:
        return resolve_group(pm._group_name) if tp > 1 else None
    if dist.get_world_size() != dp * tp:
        raise FxtpConfigError(
            f"pm.clip_grad_norm_ under FSDP2: the data-parallel mesh ({dp} ranks) times the tensor-parallel group "
            f"({tp} ranks) is not the default group ({dist.get_world_size()} ranks), so one all_reduce cannot sum "
            "the norm over both dims. fix: run dp x tp as the whole job (init_device_mesh over every rank)"
        )
    return dist.group.WORLD


def clip_grad_norm_(pm: nn.Module, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None) -> torch.Tensor:
    """Scale the gradients of ``pm.parameters()`` in place so their total norm is at most
    ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does on the single-device model.

    A collective: every rank of the group calls it. Exactly one all_reduce (sum, or max for the
    inf norm) of one scalar; replicated parameters are counted once; parameters without a
    gradient are skipped.

    Args:
        pm: a ``ParallelModule`` (optionally wrapped in place by DDP or FSDP2's ``fully_shard``).
        max_norm: the largest total norm kept.
        norm_type: the p of the p-norm (``float('inf')`` for the max norm).
        error_if_nonfinite: raise if the total norm is nan or inf (as torch).
        foreach: use the ``_foreach`` kernels (``None``: where the device has them).

    Returns:
        The total norm of the gradients (before clipping), a 0-dim tensor, equal on every rank.

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite (torch's error).
        FxtpConfigError: FSDP2 on a data-parallel mesh that, with the tensor-parallel group, does
            not make up the default group.
    """
    norm_type = float(norm_type)
    share, grads = norm_share(pm, norm_type, foreach=foreach)
    group = _group(pm, [p.grad for p in pm.parameters() if p.grad is not None])
    if group is not None:
        dist.all_reduce(share, op=dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM, group=group)
    return scale_by_norm_(grads, share, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)


def norm_share(pm: nn.Module, norm_type: float, *, skip: frozenset[str] = frozenset(),
               foreach: Optional[bool] = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This rank's share of the total gradient norm of ``pm`` (the sum of its counted elements'
    ``|g|^p``, or their max for ``p = inf``; rules in this module's docstring), and the local
    gradients to scale. Parameters named in ``skip`` are scaled but not counted (a tied copy
    counted elsewhere, as a pipeline's head). A 0-dim float32 tensor; no communication."""
    grads, counted = [], []
    for fqn, p in pm.named_parameters():
        if p.grad is None:
            continue
        grad = p.grad
        grads.append(grad.to_local() if isinstance(grad, DTensor) else local_tensor(grad))
        placement = pm.placements.get(model_fqn(fqn), REPLICATE)  # a torch.compile'd block: under _orig_mod
        if fqn in skip:
            continue
        if isinstance(placement, Shard):
            counted.append(_owned(grads[-1], grad, placement, pm._rank, pm._world_size))
        elif pm._rank == 0:
            counted.append(grads[-1])
    device = grads[0].device if grads else torch.device("cpu")
    norms: list[torch.Tensor] = []
    for tensors in _by_device(counted).values():
        if foreach is not False:
            norms.extend(n.to(device) for n in torch._foreach_norm(tensors, norm_type))
        else:
            norms.extend(torch.linalg.vector_norm(t, norm_type).to(device) for t in tensors)
    norms = [n.float() for n in norms]
    if norm_type == math.inf:
        return (torch.stack(norms).max() if norms else torch.zeros((), device=device)), grads
    return (torch.stack(norms).pow(norm_type).sum() if norms else torch.zeros((), device=device)), grads


def scale_by_norm_(grads: list[torch.Tensor], share: torch.Tensor, max_norm: float, norm_type: float, *,
                   error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:
    """Scale ``grads`` in place by ``min(1, max_norm / (total + 1e-6))`` (torch's coefficient),
    where ``total`` is the norm from the reduced ``share`` of :func:`norm_share`; returns ``total``."""
    total = share if norm_type in (math.inf, 0.0) else share.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for tensors in _by_device(grads).values():
            scale = coef.to(tensors[0].device)
            if foreach is not False:
                torch._foreach_mul_(tensors, scale)
            else:
                for t in tensors:
                    t.mul_(scale)
    return total


def _owned(local: torch.Tensor, grad: torch.Tensor, placement: Shard, rank: int, world_size: int) -> torch.Tensor:
    """The elements of this rank's gradient ``local`` that it counts: all of a shard; of a
    grouped shard (NOTE: [grouped shards]) the rows the tensor-parallel rank owns, and under
    FSDP2 (``grad`` a DTensor whose ``local`` is this data-parallel rank's ``torch.chunk`` block of
    dim 0 of the tensor-parallel shard) those of them inside its block."""
    if not placement.overlaps:
        return local
    dim = placement.dim % local.dim()
    if not isinstance(grad, DTensor) or dim != 0:
        return owned_part(local, placement, rank, world_size)
    rows, pos = [], 0
    for (start, length), (first, count) in zip(local_ranges(placement, rank, world_size), owned_ranges(placement, rank, world_size)):
        rows.append(torch.arange(pos + first - start, pos + first - start + count))
        pos += length
    owned = torch.cat(rows)
    block = -(-grad.shape[0] // grad.device_mesh.size())  # fully_shard's blocks: torch.chunk of dim 0
    low = grad.device_mesh.get_local_rank() * block
    keep = owned[(owned >= low) & (owned < low + local.shape[0])] - low
    return local.index_select(0, keep.to(local.device))


def _by_device(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """``tensors`` grouped by device and dtype, as the ``_foreach`` kernels take them."""
    out: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        out[t.device, t.dtype].append(t)
    return out
