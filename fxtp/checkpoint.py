"""Full checkpoints for a :class:`~fxtp.runtime.ParallelModule`: gather, load, and safetensors.

A tensor-parallel rank holds *local* tensors: a ``Shard`` parameter is this rank's slice
(``fxtp.placement.shard_tensor`` of the full one), everything else is a full copy. A *full* state
dict is the original model's: the same keys (tied parameters under every FQN, persistent
buffers included), full tensors. This module converts between the two:

* :func:`full_state_dict` all_gathers the shards over the tensor-parallel group;
* :func:`load_full_state_dict` slices a full state dict into this rank's tensors;
* :func:`load_safetensors` reads only this rank's slices from a ``.safetensors`` file
  (``safe_open(...).get_slice(name)[ranges]``), which also materializes a model compiled on the
  ``meta`` device, so no rank ever holds a full copy of a sharded weight.

Slicing and gathering go through ``fxtp.placement`` (``shard_tensor``, ``local_ranges``) and
``fxtp.collectives.all_gather`` only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional, Union

import torch
from torch import nn

from fxtp.collectives import all_gather
from fxtp.errors import FxtpInputError, FxtpRuntimeError
from fxtp.placement import REPLICATE, Placement, Shard, local_ranges, shard_tensor

if TYPE_CHECKING:
    from fxtp.runtime import ParallelModule

__all__ = ["LoadStats", "bind_state_keys", "full_state_dict", "load_full_state_dict", "load_safetensors"]

_CONSTANTS = "_fxtp_constants."


@dataclass(frozen=True)
class LoadStats:
    """What :func:`load_safetensors` read on this rank.

    Attributes:
        bytes_read: bytes of tensor data read from the file (all tensors).
        sharded_bytes_read: the part of ``bytes_read`` that belongs to sharded parameters.
        sharded_bytes_full: full size in the file of those sharded parameters; on an even split
            ``sharded_bytes_read == sharded_bytes_full / world_size``.
        file_bytes: size of the file.
    """

    bytes_read: int
    sharded_bytes_read: int
    sharded_bytes_full: int
    file_bytes: int


def bind_state_keys(pm: "ParallelModule", model: nn.Module) -> None:
    """Record on ``pm`` how the original model's state-dict keys map to ``pm``'s tensors.

    Called by ``fxtp.compile``. Keys of tensors the graph does not use (a parameter of an unused
    module) are kept as copies so the full state dict has every key of ``model.state_dict()``.
    """
    own = {fqn for fqn, _ in _named_tensors(pm)}
    owner_of: dict[int, str] = {}
    original = model.state_dict(keep_vars=True)
    for key, t in original.items():
        if key in own:
            owner_of.setdefault(id(t), key)
    pm._state_keys = {key: owner_of.get(id(t)) for key, t in original.items()}
    pm._unused_state = {key: t.detach().clone() for key, t in original.items() if pm._state_keys[key] is None}


def full_state_dict(pm: "ParallelModule") -> dict[str, torch.Tensor]:
    """The original model's state dict, gathered from every rank's shards (a collective).

    Every rank of the tensor-parallel group must call it. Keys are the original model's
    (``model.state_dict()``: tied parameters under each FQN, as one tensor; persistent
    buffers); values are full, detached tensors on the device of the local ones, with their dtypes.

    Raises:
        FxtpRuntimeError: ``pm`` has no process group (``world_size > 1``), or its weights are
            still on the ``meta`` device (load them first).
    """
    _check_group(pm)
    gathered: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    tensors = dict(_named_tensors(pm))
    with torch.no_grad():
        for key, owner in _state_keys(pm).items():
            if owner is None:
                out[key] = pm._unused_state[key].clone()
                continue
            if owner not in gathered:
                local = tensors[owner].detach()
                if local.is_meta:
                    raise FxtpRuntimeError(
                        f"{owner} is on the meta device: load the weights first (pm.load_safetensors(path) or "
                        "pm.load_full_state_dict(sd))"
                    )
                placement = pm.placements.get(owner, REPLICATE)
                if isinstance(placement, Shard) and pm._world_size > 1:
                    gathered[owner] = all_gather(local, placement.dim, placement.segments, pm._world_size, pm._group_name)
                else:
                    gathered[owner] = local.clone()
            out[key] = gathered[owner]
    return out


def load_full_state_dict(
    pm: "ParallelModule", state_dict: Mapping[str, torch.Tensor], *, strict: bool = True, device: Union[str, torch.device, None] = None
) -> None:
    """Slice a full state dict (the original model's keys and shapes) into ``pm``'s tensors.

    No communication: every rank reads the full tensors it is given and keeps its slice.
    Parameters keep their identity (optimizers stay valid) unless they are on the ``meta``
    device, where they are replaced by real ones on ``device`` (default ``"cpu"``). A tied
    parameter may be given under any of its FQNs; non-persistent buffers may be given too.

    Raises:
        FxtpInputError: missing keys, unexpected keys (``strict=True``), or a tensor whose
            shape is not the full shape.
    """
    targets = _targets(pm)
    present = set(state_dict)
    unexpected = sorted(present - set(_state_keys(pm)) - set(targets) - {k for ks in targets.values() for k in ks})
    required = {owner for owner in _state_keys(pm).values() if owner is not None}
    missing = [keys[0] for owner, keys in targets.items() if owner in required and not present & set(keys)]
    missing += [k for k, owner in _state_keys(pm).items() if owner is None and k not in present]
    if missing or (strict and unexpected):
        raise FxtpInputError(
            f"the state dict does not fit the model: missing keys {missing}, unexpected keys {unexpected if strict else []}. "
            "fix: pass the original model's full state dict (model.state_dict() or pm.full_state_dict()); "
            "strict=False ignores unexpected keys"
        )
    for owner, keys in targets.items():
        key = next((k for k in keys if k in present), None)
        if key is None:
            continue  # an optional non-persistent buffer
        full = state_dict[key]
        placement = pm.placements.get(owner, REPLICATE)
        _check_shape(pm, owner, key, tuple(full.shape))
        _assign(pm, owner, shard_tensor(full, placement, pm._rank, pm._world_size), device)
    for key, owner in _state_keys(pm).items():
        if owner is None:
            pm._unused_state[key] = state_dict[key].detach().clone()


def load_safetensors(
    pm: "ParallelModule",
    path: Union[str, os.PathLike],
    *,
    device: Union[str, torch.device, None] = None,
    extra: Optional[Mapping[str, torch.Tensor]] = None,
) -> LoadStats:
    """Read this rank's tensors from a ``.safetensors`` file of the full model.

    Only this rank's slices of sharded parameters are read (``get_slice(name)[ranges]``);
    replicated tensors are read whole. Tensors on the ``meta`` device (a model compiled on
    ``meta``) become real ones on ``device`` (default ``"cpu"``; under NCCL pass this rank's
    GPU); others are copied into in place. A tied parameter may be stored under any of its FQNs
    (``safetensors.torch.save_model`` keeps one). ``extra`` supplies full tensors the file does
    not hold, e.g. non-persistent buffers of a ``meta``-built model (rotary ``inv_freq``).

    Returns:
        :class:`LoadStats`: the bytes this rank read.

    Raises:
        FxtpInputError: a tensor of the model is in neither the file nor ``extra``, or has the
            wrong shape; or, for a ``meta`` model, a tensor (a non-persistent buffer, a constant)
            is still on ``meta`` after loading (pass it in ``extra``).
    """
    from safetensors import safe_open

    extra = dict(extra or {})
    read = sharded_read = sharded_full = 0
    with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
        names = set(f.keys())
        for owner, keys in _targets(pm).items():
            placement = pm.placements.get(owner, REPLICATE)
            in_file = next((k for k in keys if k in names), None)
            if in_file is None:
                given = next((k for k in keys if k in extra), None)
                if given is None:
                    continue  # reported below if it stays on meta; a real tensor keeps its value
                _check_shape(pm, owner, given, tuple(extra[given].shape))
                _assign(pm, owner, shard_tensor(extra[given], placement, pm._rank, pm._world_size), device)
                continue
            piece = f.get_slice(in_file)
            shape = tuple(piece.get_shape())
            _check_shape(pm, owner, in_file, shape)
            if isinstance(placement, Shard):
                lead = (slice(None),) * placement.dim
                parts = [piece[lead + (slice(start, start + n),)] for start, n in local_ranges(placement, pm._rank, pm._world_size)]
                local = torch.cat(parts, dim=placement.dim) if len(parts) > 1 else parts[0]
                sharded_read += local.numel() * local.element_size()
                sharded_full += _numel(shape) * local.element_size()
            else:
                local = f.get_tensor(in_file)
            read += local.numel() * local.element_size()
            _assign(pm, owner, local, device)
    still_meta = [fqn for fqn, t in _named_tensors(pm, constants=True) if t.is_meta]
    if still_meta:
        raise FxtpInputError(
            f"{path} does not hold {still_meta} and they are still on the meta device. fix: pass them as full "
            "tensors with extra={fqn: tensor} (non-persistent buffers and constants are not saved in checkpoints)"
        )
    return LoadStats(read, sharded_read, sharded_full, os.path.getsize(path))


# --- internals --------------------------------------------------------------------------------


def _named_tensors(pm: nn.Module, constants: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers of ``pm`` under every FQN (tied ones repeated), without fxtp's constants."""
    named = [*pm.named_parameters(remove_duplicate=False), *pm.named_buffers(remove_duplicate=False)]
    return [(fqn, t) for fqn, t in named if constants or not fqn.startswith(_CONSTANTS)]


def _state_keys(pm: "ParallelModule") -> dict[str, Optional[str]]:
    keys = getattr(pm, "_state_keys", None)
    if keys is None:  # built without fxtp.compile: pm's own persistent keys
        keys = {k: k for k in pm.state_dict(keep_vars=True)}
        pm._state_keys, pm._unused_state = keys, {}
    return keys


def _targets(pm: "ParallelModule") -> dict[str, list[str]]:
    """``{owner FQN in pm: [keys that may supply it]}``: original aliases first, then every pm FQN
    of the same tensor (tied), so non-persistent buffers can be supplied by their FQN too."""
    by_id: dict[int, list[str]] = {}
    for fqn, t in _named_tensors(pm):
        by_id.setdefault(id(t), []).append(fqn)
    aliases: dict[str, list[str]] = {}
    for key, owner in _state_keys(pm).items():
        if owner is not None:
            aliases.setdefault(owner, []).append(key)
    targets: dict[str, list[str]] = {}
    for fqns in by_id.values():
        owner = next((f for f in fqns if f in aliases), fqns[0])
        keys = aliases.get(owner, [])
        targets[owner] = keys + [f for f in fqns if f not in keys]
    return targets


def _global_shape(local: torch.Tensor, placement: Placement) -> tuple[int, ...]:
    shape = list(local.shape)
    if isinstance(placement, Shard):
        shape[placement.dim] = placement.size
    return tuple(shape)


def _check_shape(pm: "ParallelModule", owner: str, key: str, shape: tuple[int, ...]) -> None:
    expected = _global_shape(_get(pm, owner), pm.placements.get(owner, REPLICATE))
    if shape != expected:
        raise FxtpInputError(
            f"{key} has shape {shape} but the model's full {owner} is {expected}. fix: load a checkpoint of the "
            "same model configuration (full tensors, not another rank's shards)"
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _get(pm: nn.Module, fqn: str) -> torch.Tensor:
    module_path, _, leaf = fqn.rpartition(".")
    owner = pm.get_submodule(module_path)
    return owner._parameters[leaf] if leaf in owner._parameters else owner._buffers[leaf]


def _assign(pm: nn.Module, owner: str, local: torch.Tensor, device: Union[str, torch.device, None]) -> None:
    """Write ``local`` into the tensor at ``owner`` (every FQN that shares it); a ``meta`` tensor
    is replaced by a real one on ``device``."""
    current = _get(pm, owner)
    with torch.no_grad():
        if not current.is_meta:
            current.copy_(local)
            return
    value = local.to(device=device or "cpu", dtype=current.dtype).detach().clone()
    if isinstance(current, nn.Parameter):
        value = nn.Parameter(value, requires_grad=current.requires_grad)
    for fqn, t in _named_tensors(pm):
        if t is current:
            module_path, _, leaf = fqn.rpartition(".")
            module = pm.get_submodule(module_path)
            if isinstance(value, nn.Parameter):
                module._parameters[leaf] = value
            else:
                module._buffers[leaf] = value


def _check_group(pm: "ParallelModule") -> None:
    if pm._world_size > 1 and pm._group_name is None:
        raise FxtpRuntimeError(
            f"this module is rank {pm._rank} of a world_size {pm._world_size} model compiled without a process group; "
            "gathering needs one. fix: call torch.distributed.init_process_group(...) before fxtp.compile"
        )
