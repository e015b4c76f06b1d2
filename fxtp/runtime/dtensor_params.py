"""DTensor parameters on the tensor-parallel mesh, so that FSDP2 over them makes 2-D DTensors.

NOTE: [DTensor parameters for FSDP2]
FSDP2's ``fully_shard(pm, mesh=mesh["dp"])`` over fxtp's own parameters (plain local shards,
NOTE: [sharded parameters] in fxtp/runtime/sharded.py) makes DTensors over the data-parallel
mesh only, so torch's ``clip_grad_norm_`` there misses the tensor-parallel dim (NOTE: [clipping
under FSDP2] in fxtp/runtime/clipping.py). Given DTensor parameters on ``mesh["tp"]`` (a mesh
cut from the same root as ``mesh["dp"]``), FSDP2 shards them again as torchtitan's: 2-D DTensors
on the ``(dp, tp)`` mesh (``(_StridedShard(0), Shard(d))``, ``(Shard(0), Replicate())``), and
gathers each over dp for the forward into its tensor-parallel DTensor. Then torch's own
``clip_grad_norm_``, ``get_total_norm`` and norms of the parameters reduce over both dims: right
by construction. :func:`to_dtensor_parameters` swaps ``pm``'s parameters for those DTensors
(same local tensors: no copy); the rank graph takes their ``to_local()``
(``fxtp.runtime.sharded.plain_inputs``; its backward makes the gradient a DTensor of the same
placement, and fxtp's graph has already summed a replicated parameter's gradient over the
group, so its copies agree).

DTensor expresses a parameter replicated, or split evenly in one segment (``Shard(d)``); fused
segments (Q|K|V), uneven units and grouped kv heads it cannot, and those raise
(``pm.clip_grad_norm_`` stays exact there). Call it before ``fully_shard``, only for FSDP2:
DDP cannot take DTensor parameters, and fxtp's full and DCP checkpoints read FSDP2's 1-D
layout only (``pm.full_state_dict()`` raises a clear error on the 2-D one).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard

from fxtp.core.errors import FxtpConfigError
from fxtp.core.placement import Shard
from fxtp.runtime.sharded import local_tensor

__all__ = ["to_dtensor_parameters"]


def to_dtensor_parameters(pm: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Make every parameter of ``pm`` a DTensor on the tensor-parallel ``mesh``, in place, for
    FSDP2 over a data-parallel mesh cut from the same root (NOTE: [DTensor parameters for FSDP2]).

    Example::

        mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
        pm = fxtp.compile(model, tp, (x,), group=mesh["tp"])
        fxtp.runtime.dtensor_params.to_dtensor_parameters(pm, mesh["tp"])
        fully_shard(pm, mesh=mesh["dp"])
        ...
        torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0)  # the norm over dp and tp

    Args:
        pm: a ``ParallelModule`` compiled with ``group=mesh``, not yet wrapped by FSDP2 or DDP.
        mesh: the 1-D tensor-parallel ``DeviceMesh``.

    Returns:
        ``pm``.

    Raises:
        FxtpConfigError: ``mesh`` is not ``pm``'s group, or a parameter is sharded in a layout
            DTensor cannot express (fused segments, uneven units, grouped kv heads), named with
            the fix.
    """
    if mesh.ndim != 1 or mesh.size() != pm._world_size or mesh.get_group().group_name != pm._group_name:
        raise FxtpConfigError(
            f"to_dtensor_parameters: {mesh} is not the tensor-parallel group this module was compiled for "
            f"({pm._world_size} ranks). fix: pass the mesh given to fxtp.compile(..., group=mesh['tp'])"
        )
    made: dict[int, nn.Parameter] = {}
    for fqn, p in pm.named_parameters():
        placement = pm.placements.get(fqn)
        if isinstance(placement, Shard):
            if len(placement.segments) != 1 or placement.overlaps or not placement.divisible(pm._world_size):
                raise FxtpConfigError(
                    f"to_dtensor_parameters: parameter {fqn!r} is sharded as {placement} over {pm._world_size} ranks "
                    "(fused segments, uneven units or grouped kv heads), which a DTensor placement cannot express. "
                    f"fix: clip with pm.clip_grad_norm_(max_norm) (exact for every layout), or keep it replicated "
                    f"(fxtp.compile(..., plan={{{fqn.rpartition('.')[0]!r}: 'replicate'}}))"
                )
            dtensor_placement = DShard(placement.dim % p.dim())
        else:
            dtensor_placement = Replicate()
        value = DTensor.from_local(local_tensor(p).detach(), mesh, [dtensor_placement], run_check=False)
        made[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
    for fqn, p in list(pm.named_parameters(remove_duplicate=False)):  # a tied parameter under each of its names
        path, _, leaf = fqn.rpartition(".")
        pm.get_submodule(path)._parameters[leaf] = made[id(p)]
    return pm
