"""Full checkpoints for a :class:`~fxtp.runtime.module.ParallelModule`: gather, load, and safetensors.

A tensor-parallel rank holds *local* tensors: a ``Shard`` parameter is this rank's slice
(``fxtp.core.placement.shard_tensor`` of the full one), everything else is a full copy. A *full* state
dict is the original model's: the same keys (tied parameters under every FQN, persistent
buffers included), full tensors. This module converts between the two:

* :func:`full_state_dict` all_gathers the shards over the tensor-parallel group (and, after
  FSDP2's ``fully_shard``, over the data-parallel mesh first);
* :func:`load_full_state_dict` slices a full state dict into this rank's tensors;
* :func:`load_safetensors` reads only this rank's slices from a ``.safetensors`` file or a
  Hugging Face checkpoint directory (``model.safetensors.index.json`` and its files) with
  ``safe_open(...).get_slice(name)[ranges]``, which also materializes a model compiled on the
  ``meta`` device, so no rank ever holds a full copy of a sharded weight.

``pm`` is a ``ParallelModule``; this module reads its ``placements``, ``_rank``,
``_world_size``, ``_group_name`` and ``_state_keys`` (it does not import ``fxtp.runtime.module``:
``runtime`` imports it). Sharded checkpoints for ``torch.distributed.checkpoint`` are
``fxtp.runtime.layout``'s.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fxtp.core.collectives import all_gather
from fxtp.core.errors import FxtpInputError, FxtpRuntimeError
from fxtp.runtime import sharded
from fxtp.runtime.blocks import model_fqn
from fxtp.runtime.layout import local_form
from fxtp.runtime.sharded import local_tensor
from fxtp.core.placement import REPLICATE, Placement, Shard, local_ranges, owned_part, shard_tensor

__all__ = ["LoadStats", "bind_state_keys", "full_state_dict", "load_full_state_dict", "load_safetensors"]

_CONSTANTS = "_fxtp_constants."
_INDEX = "model.safetensors.index.json"  # Hugging Face's sharded-checkpoint index


@dataclass(frozen=True)
class LoadStats:
    """What :func:`load_safetensors` read on this rank.

    Attributes:
        bytes_read: bytes of tensor data read from the files (all tensors).
        sharded_bytes_read: the part of ``bytes_read`` that belongs to sharded parameters.
        sharded_bytes_full: full size in the files of those sharded parameters; on an even split
            ``sharded_bytes_read == sharded_bytes_full / world_size``.
        file_bytes: total size of the checkpoint's files.
        files: how many files were opened.
    """

    bytes_read: int
    sharded_bytes_read: int
    sharded_bytes_full: int
    file_bytes: int
    files: int = 1


def bind_state_keys(pm: nn.Module, model: nn.Module) -> None:
    """Record on ``pm`` how the original model's state-dict keys map to ``pm``'s tensors.

    Called by ``fxtp.compile``. Tensors the graph does not use (a parameter of an unused module)
    become persistent buffers of ``pm`` under their FQNs, so every key of ``model.state_dict()``
    is in ``pm.state_dict()`` and ``pm.full_state_dict()``.
    """
    own = {fqn for fqn, _ in _named_tensors(pm)}
    owner_of: dict[int, str] = {}
    original = model.state_dict(keep_vars=True)
    for key, t in original.items():
        if key in own:
            owner_of.setdefault(id(t), key)
    pm._state_keys = {}
    for key, t in original.items():
        if id(t) not in owner_of:
            pm._register(key, t.detach().clone())
            owner_of[id(t)] = key
        pm._state_keys[key] = owner_of[id(t)]


def full_state_dict(pm: nn.Module) -> dict[str, torch.Tensor]:
    """The original model's state dict, gathered from every rank's shards (a collective).

    Every rank of the tensor-parallel group (and of the data-parallel mesh after FSDP2's
    ``fully_shard``) must call it. Keys are the original model's (``model.state_dict()``: tied
    parameters under each FQN, as one tensor; persistent buffers); values are full, detached
    tensors on the device of the local ones, with their dtypes.

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
            if owner not in gathered:
                local = local_tensor(tensors[owner]).detach()  # NOTE: [sharded parameters]
                if local.is_meta:
                    raise FxtpRuntimeError(
                        f"{owner} is on the meta device: load the weights first (pm.load_safetensors(path) or "
                        "pm.load_full_state_dict(sd))"
                    )
                if isinstance(local, DTensor):  # FSDP2's shard of the tensor-parallel local tensor
                    local = local.full_tensor()
                placement = pm.placements.get(owner, REPLICATE)
                if isinstance(placement, Shard) and pm._world_size > 1:
                    owned = owned_part(local, placement, pm._rank, pm._world_size)  # NOTE: [grouped shards]
                    gathered[owner] = all_gather(owned, placement.dim, placement.segments, pm._world_size, pm._group_name,
                                                 placement.unit, placement.groups)
                else:
                    gathered[owner] = local.clone()
            out[key] = gathered[owner]
    return out


def load_full_state_dict(
    pm: nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True, device: Union[str, torch.device, None] = None
) -> None:
    """Slice a full state dict (the original model's keys and shapes) into ``pm``'s tensors.

    No communication: every rank reads the full tensors it is given and keeps its slice.
    Parameters keep their identity (optimizers stay valid) unless they are on the ``meta``
    device, where they are replaced by real ones on ``device`` (default ``"cpu"``). A tied
    parameter may be given under any of its FQNs; non-persistent buffers may be given too.

    Raises:
        FxtpInputError: missing keys, unexpected keys (``strict=True``), a tensor whose shape
            is not the full shape, or tensors no checkpoint holds still on ``meta``.
    """
    targets = _targets(pm)
    present = set(state_dict)
    unexpected = sorted(present - set(_state_keys(pm)) - {k for ks in targets.values() for k in ks})
    required = set(_state_keys(pm).values())
    missing = [keys[0] for owner, keys in targets.items() if owner in required and not present & set(keys)]
    if missing or (strict and unexpected):
        raise FxtpInputError(
            f"the state dict does not fit the model: missing keys {missing}, unexpected keys {unexpected if strict else []}. "
            "fix: pass the original model's full state dict (model.state_dict() or pm.full_state_dict()); "
            "strict=False ignores unexpected keys"
        )
    _check_meta(pm, present)
    for owner, keys in targets.items():
        key = next((k for k in keys if k in present), None)
        if key is not None:  # else an optional non-persistent buffer
            _check_shape(pm, owner, key, tuple(state_dict[key].shape))
            _assign(pm, owner, _slice(pm, owner, state_dict[key]), device)


def load_safetensors(
    pm: nn.Module,
    path: Union[str, os.PathLike],
    *,
    device: Union[str, torch.device, None] = None,
    extra: Optional[Mapping[str, torch.Tensor]] = None,
) -> LoadStats:
    """Read this rank's tensors from a full-model ``.safetensors`` file or checkpoint directory.

    ``path`` is a ``.safetensors`` file, or a directory with Hugging Face's
    ``model.safetensors.index.json`` (``{"weight_map": {name: file}}``, the layout of
    ``save_pretrained``'s sharded checkpoints) or a single ``model.safetensors``. Only this
    rank's slices of sharded parameters are read (``get_slice(name)[ranges]``); replicated
    tensors are read whole; only the files holding this rank's tensors are opened. Tensors on
    the ``meta`` device (a model compiled on ``meta``) become real ones on ``device`` (default
    ``"cpu"``; under NCCL pass this rank's GPU); others are copied into in place. A tied
    parameter may be stored under any of its FQNs (``safetensors.torch.save_model`` keeps one).
    ``extra`` supplies full tensors the files do not hold.

    Returns:
        :class:`LoadStats`: the bytes this rank read.

    Raises:
        FxtpInputError: no checkpoint at ``path``; a tensor with the wrong shape; or, for a
            ``meta`` model, tensors no checkpoint holds (non-persistent buffers, constants) on
            ``meta`` (all listed in one error, before anything is read) or a parameter that
            neither the files nor ``extra`` hold.
    """
    from safetensors import safe_open

    extra = dict(extra or {})
    weight_map = _weight_map(os.fspath(path))
    _check_meta(pm, set(extra))
    read = sharded_read = sharded_full = 0
    with ExitStack() as stack:
        files: dict[str, Any] = {}
        for owner, keys in _targets(pm).items():
            in_file = next((k for k in keys if k in weight_map), None)
            if in_file is None:
                given = next((k for k in keys if k in extra), None)
                if given is not None:  # else reported below if it stays on meta; a real tensor keeps its value
                    _check_shape(pm, owner, given, tuple(extra[given].shape))
                    _assign(pm, owner, _slice(pm, owner, extra[given]), device)
                continue
            name = weight_map[in_file]
            if name not in files:
                files[name] = stack.enter_context(safe_open(name, framework="pt", device="cpu"))
            piece = files[name].get_slice(in_file)
            shape = tuple(piece.get_shape())
            _check_shape(pm, owner, in_file, shape)
            placement = pm.placements.get(owner, REPLICATE)
            if isinstance(placement, Shard):
                lead = (slice(None),) * placement.dim
                parts = [piece[lead + (slice(start, start + n),)] for start, n in local_ranges(placement, pm._rank, pm._world_size)]
                local = torch.cat(parts, dim=placement.dim) if len(parts) > 1 else parts[0]
                sharded_read += local.numel() * local.element_size()
                sharded_full += _numel(shape) * local.element_size()
            else:
                local = files[name].get_tensor(in_file)
            read += local.numel() * local.element_size()
            _assign(pm, owner, local_form(_get(pm, owner), local), device)
    still_meta = [fqn for fqn, t in _named_tensors(pm) if t.is_meta]
    if still_meta:
        raise FxtpInputError(
            f"{path} does not hold {still_meta} and they are still on the meta device. fix: load a checkpoint of "
            "this model (every parameter and persistent buffer), or pass them with extra={fqn: full tensor}"
        )
    sizes = sorted(set(weight_map.values()))
    return LoadStats(read, sharded_read, sharded_full, sum(os.path.getsize(f) for f in sizes), len(files))


# --- internals --------------------------------------------------------------------------------


def _weight_map(path: str) -> dict[str, str]:
    """``{tensor name: file}`` of a ``.safetensors`` file or a checkpoint directory."""
    from safetensors import safe_open

    if os.path.isdir(path):
        index = os.path.join(path, _INDEX)
        if os.path.exists(index):
            with open(index) as f:
                return {name: os.path.join(path, file) for name, file in json.load(f)["weight_map"].items()}
        path = os.path.join(path, "model.safetensors")
    if not os.path.isfile(path):
        raise FxtpInputError(
            f"no safetensors checkpoint at {path}: pass a .safetensors file or a directory with {_INDEX} or model.safetensors"
        )
    with safe_open(path, framework="pt", device="cpu") as f:
        return {name: path for name in f.keys()}


def _check_meta(pm: nn.Module, supplied: set[str]) -> None:
    """One error for every tensor on ``meta`` that no checkpoint holds (non-persistent buffers,
    constants) and ``supplied`` does not name: loading cannot give them a value."""
    saved = set(_state_keys(pm))
    constants = getattr(pm, "_constant_targets", {})
    lost = []
    for fqn, t in _named_tensors(pm, constants=True):
        if t.is_meta and fqn not in saved and fqn not in supplied:
            lost.append(f"{fqn} (the model's tensor attribute {constants[fqn]})" if fqn in constants else fqn)
    if lost:
        raise FxtpInputError(
            f"{lost} are on the meta device and no checkpoint holds them (non-persistent buffers and tensor "
            "attributes are not saved), so loading cannot give them values. fix: put only the parameters on meta "
            "(accelerate's init_empty_weights(), whose include_buffers=False keeps buffers real, or build the "
            "model under torch.device('meta') and then recompute these buffers on the cpu, e.g. the rotary "
            "inv_freq), compile that model, then load; or pass them as full tensors (extra= / in the state dict)"
        )


def _named_tensors(pm: nn.Module, constants: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers of ``pm`` under every FQN (tied ones repeated), without fxtp's constants;
    a block replaced by its ``torch.compile`` (torchtitan's ``apply_compile``) under the model's FQNs."""
    named = [*pm.named_parameters(remove_duplicate=False), *pm.named_buffers(remove_duplicate=False)]
    return [(model_fqn(fqn), t) for fqn, t in named if constants or not fqn.startswith(_CONSTANTS)]


def _state_keys(pm: nn.Module) -> dict[str, str]:
    """``{original state-dict key: the FQN in pm of its tensor}`` (``bind_state_keys``)."""
    keys = getattr(pm, "_state_keys", None)
    if keys is None:  # built without fxtp.compile: pm's own persistent keys
        keys = {k: k for k in nn.Module.state_dict(pm, keep_vars=True)}
        pm._state_keys = keys
    return keys


def _targets(pm: nn.Module) -> dict[str, list[str]]:
    """``{owner FQN in pm: [keys that may supply it]}``: original aliases first, then every pm FQN
    of the same tensor (tied), so non-persistent buffers can be supplied by their FQN too."""
    by_id: dict[int, list[str]] = {}
    for fqn, t in _named_tensors(pm):
        by_id.setdefault(id(t), []).append(fqn)
    aliases: dict[str, list[str]] = {}
    for key, owner in _state_keys(pm).items():
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


def _check_shape(pm: nn.Module, owner: str, key: str, shape: tuple[int, ...]) -> None:
    expected = _global_shape(_get(pm, owner), pm.placements.get(owner, REPLICATE))
    if shape != expected:
        raise FxtpInputError(
            f"{key} has shape {shape} but the model's full {owner} is {expected}. fix: load a checkpoint of the "
            "same model configuration (full tensors, not another rank's shards)"
        )


def _slice(pm: nn.Module, owner: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full``, in the form of ``pm``'s tensor at ``owner``."""
    current = _get(pm, owner)
    return local_form(current, shard_tensor(full, pm.placements.get(owner, REPLICATE), pm._rank, pm._world_size))


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
        value = sharded.like(current, nn.Parameter(value, requires_grad=current.requires_grad))
    for fqn, t in _named_tensors(pm):
        if t is current:
            module_path, _, leaf = fqn.rpartition(".")
            module = pm.get_submodule(module_path)
            if isinstance(value, nn.Parameter):
                module._parameters[leaf] = value
            else:
                module._buffers[leaf] = value


def _check_group(pm: nn.Module) -> None:
    if pm._world_size > 1 and pm._group_name is None:
        raise FxtpRuntimeError(
            f"this module is rank {pm._rank} of a world_size {pm._world_size} model compiled without a process group; "
            "gathering needs one. fix: call torch.distributed.init_process_group(...) before fxtp.compile"
        )
