"""State-dict values that carry their global layout, for ``torch.distributed.checkpoint`` (DCP).

A :class:`~fxtp.runtime.module.ParallelModule` holds local tensors; its ``state_dict()`` values say where
each local tensor sits in the full one, so DCP saves every rank's part once and loads it back at
any world size (see NOTE: [checkpoint layouts]). The hooks here are registered by
``ParallelModule`` on itself (``state_dict`` / ``load_state_dict``) and, through
``ParallelModule.register_optimizer``, on an optimizer, so torch's
``torch.distributed.checkpoint.state_dict`` helpers work unchanged.

NOTE: [checkpoint layouts]
DCP stores a tensor as rectangles (*chunks*) of its global shape, each written by one rank, and
reads any rectangle back, whatever the chunks of the writer were: that is its resharding. A value
of a state dict says which rectangles this rank holds:

* ``Replicate`` or a one-segment ``Shard(d)`` of a tensor-parallel parameter: a ``DTensor`` on the
  tensor-parallel ``DeviceMesh`` (``Replicate()`` / ``Shard(d)``), as torch's own TP gives.
* a ``Shard`` with several segments (Q|K|V of a fused projection, see NOTE: [segments]), an
  uneven ``Shard`` (NOTE: [uneven shards]: front-loaded blocks, where DTensor's are
  ``torch.chunk``'s, 5 rows at world_size 4: 2/1/1/1 against 2/2/1/0), or a
  parameter that FSDP2's ``fully_shard`` sharded again over a data-parallel mesh: rank ``r``
  holds several rectangles, which one ``DTensor`` cannot express (DTensor's ``Shard`` is one
  contiguous block per rank). These become a :class:`LocalChunks`: a tensor of the global shape
  that holds the local tensor and the rectangles, and implements DCP's ``_Checkpointable``
  protocol (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``, the
  three methods ``DTensor`` itself implements for DCP) so the default planners save and reshard
  it (a grouped shard's kv heads, NOTE: [grouped shards], one chunk per head, saved once by
  DCP's deduplication). Keys stay the original model's FQNs and shapes its full shapes, so a checkpoint of one
  layout (any world size, ``fxtp.compile(..., 1)``, the plain model) loads into any other.
* buffers, and everything when there is no process group (``world_size`` 1, inspection): plain
  tensors, the local tensor being the full one.

Every value aliases the live tensor, so ``dcp.load(pm.state_dict(), ...)`` writes straight into
the parameters; ``pm.load_state_dict(sd)`` then checks every value's layout against the module's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard

from fxtp.core.errors import FxtpInputError, FxtpRuntimeError
from fxtp.core.placement import REPLICATE, Placement, Shard, local_ranges, shard_tensor
from fxtp.runtime.sharded import local_tensor, resolve_group

__all__ = ["Chunk", "LocalChunks", "to_checkpoint", "from_checkpoint", "local_form", "state_dict_hook", "load_state_dict_hook",
           "register_optimizer", "tp_group"]

@dataclass(frozen=True)
class Chunk:
    """A rectangle of a global tensor that this rank holds.

    Attributes:
        local: its offset in the rank's local tensor, per dim.
        offsets: its offset in the global tensor, per dim.
        sizes: its size, per dim.
    """

    local: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def view(self, local: torch.Tensor) -> torch.Tensor:
        """The part of ``local`` this chunk covers (a view)."""
        for dim, (start, size) in enumerate(zip(self.local, self.sizes)):
            local = local.narrow(dim, start, size)
        return local


class LocalChunks(torch.Tensor):
    """A rank's chunks of a global tensor, saved and resharded by DCP (NOTE: [checkpoint layouts]).

    Its shape and dtype are the global tensor's; it computes nothing (every op raises). Made by
    ``ParallelModule.state_dict()``, read back by ``ParallelModule.load_state_dict``.

    Attributes:
        local: the rank's local tensor (aliases the parameter or optimizer state).
        chunks: where the parts of ``local`` sit in the global tensor.
    """

    local: torch.Tensor
    chunks: tuple[Chunk, ...]

    @staticmethod
    def __new__(cls, local: torch.Tensor, shape: tuple[int, ...], chunks: list[Chunk]) -> "LocalChunks":
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device)
        self.local, self.chunks = local, tuple(chunks)
        return self

    def __repr__(self) -> str:  # the default repr would compute on the tensor
        return f"LocalChunks(shape={tuple(self.shape)}, dtype={self.dtype}, chunks={[c.offsets for c in self.chunks]})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func is torch.ops.aten.detach.default:
            (self,) = args
            return LocalChunks(self.local.detach(), tuple(self.shape), list(self.chunks))
        raise FxtpRuntimeError(
            f"{func} on a LocalChunks: it only describes this rank's part of a checkpoint. fix: pass the state "
            "dict to torch.distributed.checkpoint or pm.load_state_dict; pm.full_state_dict() gives full tensors"
        )

    # DCP's _Checkpointable protocol (torch/distributed/_checkpointable.py), as DTensor implements it.
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(c.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)), properties=properties,
                    size=self.size(),
                ),
            )
            for c in self.chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for c in self.chunks:
            if torch.Size(c.offsets) == index.offset:
                return c.view(self.local)
        raise ValueError(f"{index.fqn}: no chunk at offset {index.offset}")


# --- layouts ----------------------------------------------------------------------------------


def _replace(values: tuple[int, ...], dim: int, value: int) -> tuple[int, ...]:
    return values[:dim] + (value,) + values[dim + 1 :]


def _tp_chunks(local_shape: tuple[int, ...], placement: Placement, rank: int, world_size: int) -> list[Chunk]:
    """The chunks of a tensor-parallel local tensor: one per segment of a ``Shard`` (NOTE: [segments])."""
    zero = (0,) * len(local_shape)
    if not isinstance(placement, Shard):
        return [Chunk(zero, zero, local_shape)]
    chunks, pos = [], 0
    # NOTE: [grouped shards]: a kv head held by several ranks is one chunk per head, the same
    # rectangle on every holder, which DCP's planner saves once (dedup_save_plans)
    step = placement.unit if placement.overlaps else None
    for start, length in local_ranges(placement, rank, world_size):
        dim = placement.dim
        for offset in range(0, length, step or max(length, 1)):
            size = min(step or length, length - offset)
            chunks.append(Chunk(_replace(zero, dim, pos + offset), _replace(zero, dim, start + offset), _replace(local_shape, dim, size)))
        pos += length
    return chunks


def _fsdp_range(value: DTensor) -> tuple[int, int, int]:
    """``(dim, start, length)`` of FSDP2's local shard in the tensor it sharded (``torch.chunk``
    blocks over a 1-D data-parallel mesh, ``fully_shard``'s layout)."""
    placement = value.placements[0] if len(value.placements) == 1 else None
    if value.device_mesh.ndim != 1 or not isinstance(placement, DShard):
        raise FxtpInputError(
            f"a DTensor parameter on a {value.device_mesh.ndim}-D mesh with {value.placements}: fxtp takes DTensor "
            "parameters only from fully_shard(pm, mesh=mesh['dp']) (Shard on a 1-D data-parallel mesh)"
        )
    dim, n = placement.dim, value.shape[placement.dim]
    block = -(-n // value.device_mesh.size())
    start = min(value.device_mesh.get_local_rank() * block, n)
    return dim, start, value.to_local().shape[dim]


def _restrict(chunks: list[Chunk], dim: int, start: int, length: int) -> list[Chunk]:
    """The parts of ``chunks`` inside ``[start, start + length)`` of their local tensor's ``dim``,
    with local offsets relative to ``start`` (FSDP2's block of the tensor-parallel local tensor)."""
    kept = []
    for c in chunks:
        lo, hi = max(c.local[dim], start), min(c.local[dim] + c.sizes[dim], start + length)
        if hi > lo:
            shift = lo - c.local[dim]
            kept.append(Chunk(_replace(c.local, dim, lo - start), _replace(c.offsets, dim, c.offsets[dim] + shift),
                              _replace(c.sizes, dim, hi - lo)))
    return kept


def _layout(value: torch.Tensor, placement: Placement, rank: int, world_size: int) -> tuple[torch.Tensor, tuple[int, ...], list[Chunk]]:
    """``(local tensor, global shape, chunks)`` of a parameter-shaped ``value`` (plain local, or a
    DTensor of FSDP2 over the local one)."""
    tp_shape = tuple(value.shape)
    chunks = _tp_chunks(tp_shape, placement, rank, world_size)
    local = value
    if isinstance(value, DTensor):
        local = value.to_local()
        chunks = _restrict(chunks, *_fsdp_range(value))
    shape = _replace(tp_shape, placement.dim, placement.size) if isinstance(placement, Shard) else tp_shape
    return local, shape, chunks


def _dtensor_placement(placement: Placement, local: torch.Tensor, shape: tuple[int, ...], world_size: int) -> Any:
    """DTensor's placement for a plain local tensor, or None where one DTensor cannot say it."""
    if not isinstance(placement, Shard):
        return DReplicate()
    if len(placement.segments) == 1 and placement.divisible(world_size) and local.shape[placement.dim] * world_size == shape[placement.dim]:
        return DShard(placement.dim)
    return None  # several segments, or uneven (DTensor's blocks are torch.chunk's, NOTE: [uneven shards])


def to_checkpoint(value: torch.Tensor, placement: Placement, rank: int, world_size: int, mesh: Optional[DeviceMesh]) -> torch.Tensor:
    """The state-dict value of a parameter (or its optimizer state) ``value`` (NOTE: [checkpoint layouts]).

    Args:
        value: this rank's tensor: the local shard, or FSDP2's DTensor over it.
        placement: its tensor-parallel placement.
        mesh: the tensor-parallel mesh; ``None`` (no process group): ``value`` is returned as is.
    """
    value = local_tensor(value)  # NOTE: [sharded parameters]: the plain shard
    if mesh is None or world_size == 1:
        return value.detach()
    local, shape, chunks = _layout(value.detach(), placement, rank, world_size)
    if not isinstance(value, DTensor):
        dplacement = _dtensor_placement(placement, local, shape, world_size)
        if dplacement is not None:
            return DTensor.from_local(local, mesh, [dplacement], run_check=False, shape=torch.Size(shape),
                                      stride=torch.empty(shape, device="meta").stride())
    return LocalChunks(local, shape, chunks)


def local_form(current: torch.Tensor, tp_local: torch.Tensor) -> torch.Tensor:
    """``tp_local`` (this rank's tensor-parallel part) in the form of ``current``: itself, or
    FSDP2's DTensor over this rank's block of it when ``current`` is one."""
    if not isinstance(current, DTensor):
        return tp_local
    dim, start, length = _fsdp_range(current)
    return _like(current, tp_local.narrow(dim, start, length))


def _like(current: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (the local tensor of ``current``'s form) as ``current``: FSDP2's DTensor or plain."""
    if not isinstance(current, DTensor):
        return local
    return DTensor.from_local(local, current.device_mesh, current.placements, run_check=False, shape=current.shape,
                              stride=current.stride())


def from_checkpoint(key: str, value: Any, current: torch.Tensor, placement: Placement, rank: int, world_size: int) -> torch.Tensor:
    """``value`` (a state-dict value for ``current``) in ``current``'s own form: a plain local
    tensor, or FSDP2's DTensor.

    Accepted: the value's own layout (what ``to_checkpoint(current)`` gives, loaded by DCP), the
    full tensor (sliced to this rank's part), or FSDP2's own DTensor of ``current``.

    Raises:
        FxtpInputError: any other layout or shape; the message names ``key``.
    """
    local, shape, chunks = _layout(local_tensor(current).detach(), placement, rank, world_size)

    if isinstance(value, LocalChunks):
        if tuple(value.shape) == shape and value.chunks == tuple(chunks):
            return _like(current, value.local)
        got = f"chunks {[(c.offsets, c.sizes) for c in value.chunks]} of {tuple(value.shape)}"
    elif isinstance(value, DTensor):
        mesh = value.device_mesh
        if isinstance(current, DTensor):  # FSDP2's own value of the parameter
            if (mesh, value.placements, value.shape) == (current.device_mesh, current.placements, current.shape):
                return value
        else:  # the tensor-parallel DTensor to_checkpoint gives
            want = _dtensor_placement(placement, local, shape, world_size)
            if (want is not None and tuple(value.shape) == shape and mesh.ndim == 1 and mesh.size() == world_size
                    and mesh.get_local_rank() == rank and value.placements == (want,)):
                return value.to_local()
        got = f"a DTensor {tuple(value.shape)} {value.placements} on a mesh of {value.device_mesh.size()} ranks"
    elif isinstance(value, torch.Tensor):
        if tuple(value.shape) == shape:
            return local_form(current, shard_tensor(value, placement, rank, world_size))
        got = f"a tensor of shape {tuple(value.shape)}"
    else:
        got = type(value).__name__
    raise FxtpInputError(
        f"{key}: the state dict holds {got}, but this rank's {placement} part of the full {shape} is chunks "
        f"{[(c.offsets, c.sizes) for c in chunks]}. fix: load a checkpoint of another world size with "
        "torch.distributed.checkpoint.load into pm.state_dict() (it reshards), or pass full tensors "
        "(model.state_dict(), pm.full_state_dict())"
    )


def tp_group(pm: nn.Module) -> Optional[dist.ProcessGroup]:
    """The tensor-parallel ``ProcessGroup`` of ``pm`` (``None`` without one); NOTE: [group by name]."""
    if pm._world_size == 1 or pm._group_name is None:
        return None
    return resolve_group(pm._group_name)


# --- hooks ------------------------------------------------------------------------------------


def _meshes(pm: nn.Module) -> Callable[[torch.device], Optional[DeviceMesh]]:
    """``mesh(device)``: the tensor-parallel mesh of ``pm`` for tensors on ``device`` (None
    without a group), made once per device type per call of a hook.

    NOTE: [group by name] ``pm`` keeps its group's *name* (what the functional collectives take;
    a ProcessGroup object would make ``pm`` impossible to deepcopy or pickle).
    ``torch.distributed.distributed_c10d._resolve_process_group`` is the name's inverse; it is
    private, so only ``fxtp.runtime.sharded.resolve_group`` calls it.
    """
    made: dict[str, DeviceMesh] = {}

    def mesh(device: torch.device) -> Optional[DeviceMesh]:
        if pm._world_size == 1 or pm._group_name is None:
            return None
        if device.type not in made:
            made[device.type] = DeviceMesh.from_group(resolve_group(pm._group_name), device.type)
        return made[device.type]

    return mesh


def _owners(pm: nn.Module) -> dict[str, torch.Tensor]:
    return dict(pm.named_parameters(remove_duplicate=False))


def state_dict_hook(pm: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``nn.Module.register_state_dict_post_hook`` of a ParallelModule: parameters become
    :func:`to_checkpoint` values (buffers stay plain; everything stays plain without a group)."""
    mesh = _meshes(pm)
    for fqn, param in _owners(pm).items():
        key = prefix + fqn
        if key in state_dict:
            placement = pm.placements.get(fqn, REPLICATE)
            state_dict[key] = to_checkpoint(param.detach(), placement, pm._rank, pm._world_size, mesh(param.device))


def load_state_dict_hook(pm: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                         missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """``nn.Module.register_load_state_dict_pre_hook`` of a ParallelModule: every parameter's
    value goes through :func:`from_checkpoint`; a tied parameter may be given under any FQN of
    the original model.

    Raises:
        FxtpInputError: a value whose layout does not fit (naming the key), or parameters still
            on the ``meta`` device (``copy_`` into them would silently do nothing).
    """
    owners = _owners(pm)
    for key, owner in getattr(pm, "_state_keys", {}).items():  # a tied key pm does not register
        if key not in owners and key != owner and prefix + key in state_dict:
            state_dict.setdefault(prefix + owner, state_dict.pop(prefix + key))
    meta = [fqn for fqn, p in owners.items() if p.is_meta and prefix + fqn in state_dict]
    if meta:
        raise FxtpInputError(
            f"{meta} are on the meta device, where load_state_dict cannot copy into them. fix: "
            "pm.load_full_state_dict(sd) or pm.load_safetensors(path) materialize a model compiled on meta"
        )
    for fqn, param in owners.items():
        key = prefix + fqn
        if key in state_dict:
            placement = pm.placements.get(fqn, REPLICATE)
            state_dict[key] = from_checkpoint(key, state_dict[key], param, placement, pm._rank, pm._world_size)


def register_optimizer(pm: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.state_dict()`` carry the layouts of ``pm``'s parameters.

    Registers an ``Optimizer.register_state_dict_post_hook`` that turns every state tensor
    shaped like its parameter (SGD's ``momentum_buffer``, Adam's ``exp_avg``/``exp_avg_sq``)
    into a :func:`to_checkpoint` value, and an ``Optimizer.register_load_state_dict_pre_hook``
    that turns them back (:func:`from_checkpoint`). Scalars (``step``) stay plain.
    """

    def param_of(opt: torch.optim.Optimizer, groups: list[dict]) -> dict[Any, tuple[str, torch.Tensor]]:
        fqn_of = {id(p): fqn for fqn, p in pm.named_parameters()}
        ids = [i for g in groups for i in g["params"]]
        params = [p for g in opt.param_groups for p in g["params"]]
        return {i: (fqn_of[id(p)], p) for i, p in zip(ids, params) if id(p) in fqn_of}

    def convert(opt: torch.optim.Optimizer, state_dict: dict[str, Any], saving: bool) -> dict[str, Any]:
        # A new dict: the inner dicts of ``Optimizer.state_dict()`` are the optimizer's own state.
        params = param_of(opt, state_dict["param_groups"])
        mesh = _meshes(pm)
        state = {}
        for pid, entries in state_dict["state"].items():
            state[pid] = dict(entries)
            if pid not in params:
                continue
            fqn, p = params[pid]
            placement = pm.placements.get(fqn, REPLICATE)
            for k, v in entries.items():
                if not isinstance(v, torch.Tensor):
                    continue
                if saving and v.shape == p.shape:  # a local tensor like the parameter
                    state[pid][k] = to_checkpoint(v, placement, pm._rank, pm._world_size, mesh(p.device))
                elif not saving and v.dim() == p.dim():  # global (checkpoint or full) tensors; not a scalar step
                    state[pid][k] = from_checkpoint(f"{fqn}.{k}", v, p, placement, pm._rank, pm._world_size)
        return {**state_dict, "state": state}

    optimizer.register_state_dict_post_hook(lambda opt, sd: convert(opt, sd, saving=True))
    optimizer.register_load_state_dict_pre_hook(lambda opt, sd: convert(opt, sd, saving=False))

