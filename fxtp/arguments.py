"""The arguments of ``fxtp.compile`` / ``fxtp.analyze``, checked: each function returns the
value in the form the pipeline uses or raises ``FxtpConfigError`` / ``FxtpInputError`` saying
what was given and what is expected; :class:`CompileOptions` carries them through the pipeline."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from fxtp.capture.frontends import FRONTENDS
from fxtp.core.errors import FxtpConfigError, FxtpInputError
from fxtp.core.strategy import TensorParallelStrategy
from passes.regions.checkpointing import MODES as CHECKPOINTING
from passes.plan import STYLES

__all__ = [
    "CompileOptions",
    "Group",
    "check_capture",
    "check_checkpointing",
    "check_flag",
    "check_inputs",
    "check_plan",
    "check_same_model",
    "check_strategy",
    "check_world_size",
    "resolve_group",
]

Group = Union["dist.ProcessGroup", "torch.distributed.device_mesh.DeviceMesh", None]


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """One compile's options and context, for every graph of one module (the compiled mode's,
    the other mode's, sizes 0 and 1), as torch.export's ``ExportedProgram`` and inductor's config
    carry theirs. ``compile`` fills the user's options; ``_compile`` adds the context as it is
    known (``dataclasses.replace``): rank, group and shapes, then from the first capture its
    frontend, the repeated blocks and the parameter placements later graphs must keep."""

    world_size: int
    capture: str = "auto"  # "fx", "export", "dynamo" or "auto"; after the first capture, the frontend that captured
    plan: Optional[Mapping[str, str]] = None  # the user's layer styles {fqn_or_glob: style}
    sequence: bool = False  # sequence parallelism
    experts: bool = False  # expert parallelism
    kv_heads: bool = False  # a decoder's cache keeps the kv heads each rank needs (passes/kv_heads.py)
    checkpointing: Optional[str] = None  # activation_checkpointing: None, "blocks" or "selective"
    rank: int = 0
    group_name: Optional[str] = None  # the tp group in the rank graphs; None without a process group
    shapes: Any = None  # torch.export's dynamic_shapes spec of the capture; None: static
    blocks: tuple[str, ...] = ()  # the model's repeated blocks (passes.checkpointing.repeated_blocks)
    want: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # the compiled graph's {fqn: placement}


def check_capture(how: Any) -> str:
    """``capture=``: a frontend's name (``fxtp.capture.frontends.FRONTENDS``) or ``"auto"``."""
    if how not in (*FRONTENDS, "auto"):
        raise FxtpConfigError(f"capture must be one of {', '.join(repr(f) for f in (*FRONTENDS, 'auto'))}, not {how!r}")
    return how


def check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise FxtpConfigError(f"{name} must be True or False, got {value!r}")
    return value


def check_checkpointing(value: Any) -> Optional[str]:
    if value is not None and value not in CHECKPOINTING:
        raise FxtpConfigError(f"activation_checkpointing must be None, {' or '.join(map(repr, CHECKPOINTING))}, got {value!r}")
    return value


def check_world_size(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise FxtpConfigError(f"world_size must be an int >= 1 (the tensor-parallel degree), got {world_size!r}")
    return world_size


def check_inputs(model: Any, example_inputs: Any, example_kwargs: Any) -> tuple[tuple, dict]:
    if not isinstance(model, nn.Module):
        raise FxtpConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if example_inputs is None and not example_kwargs:
        raise FxtpInputError("example_inputs are required: fxtp captures the model by running it on them, e.g. example_inputs=(x,)")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if example_inputs is not None and not isinstance(example_inputs, (tuple, list)):
        raise FxtpInputError(f"example_inputs must be a tuple of positional inputs, got {type(example_inputs).__name__}")
    return tuple(example_inputs or ()), dict(example_kwargs or {})


def check_plan(plan: Any) -> dict[str, str]:
    if plan is None:
        return {}
    if not isinstance(plan, Mapping):
        raise FxtpConfigError(f"plan must be a dict {{fqn_or_glob: style}}, got {type(plan).__name__}")
    for key, style in plan.items():
        if style not in STYLES:
            raise FxtpConfigError(f"plan[{key!r}] = {style!r}: style must be one of {', '.join(STYLES)}")
    return dict(plan)


def resolve_group(ws: int, rank: Optional[int], group: Group) -> tuple[Optional[str], int]:
    """(group name for the collectives or None, this rank)."""
    if group is not None and not isinstance(group, dist.ProcessGroup) and not hasattr(group, "get_group"):
        raise FxtpConfigError(f"group must be a ProcessGroup or a 1-D DeviceMesh, got {type(group).__name__}")
    if group is not None and hasattr(group, "get_group"):  # DeviceMesh
        if group.ndim != 1:
            raise FxtpConfigError(f"group must be a 1-D DeviceMesh (the tp sub-mesh), got {group.ndim}-D; pass mesh['tp']")
        group = group.get_group()
    if group is None and ws > 1 and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    if group is None or ws == 1:
        rank = 0 if rank is None else rank
        if not 0 <= rank < ws:
            raise FxtpConfigError(f"rank {rank} is outside world_size {ws}")
        return None, rank
    size = dist.get_world_size(group)
    if size != ws:
        sub = f", or group= a sub-group of {ws} ranks" if ws < size else ""
        raise FxtpConfigError(f"world_size is {ws} but the process group has {size} ranks; pass world_size={size}{sub}")
    group_rank = dist.get_rank(group)
    if rank is not None and rank != group_rank:
        raise FxtpConfigError(f"rank={rank} but this process is rank {group_rank} of the group; drop rank=")
    return group.group_name, group_rank

def check_same_model(model: nn.Module, group: "dist.ProcessGroup") -> None:
    """Raise unless every rank of ``group`` holds the same ``model`` (a collective: one
    ``all_gather_object`` of each parameter's and buffer's float64 sum and 2-norm;
    a complex tensor is compared by its real view).

    Each rank slices its shards from its own copy of the model, so ranks that built it from
    different seeds, or loaded different weights, would run a model that is none of theirs.
    Identical tensors give bit-identical reductions; a relative 1e-9 allows another device type's
    summation order. Tensors on the meta device (not materialized) are not compared.

    Raises:
        FxtpConfigError: a parameter or buffer (named by FQN) that differs, or models whose
            parameter and buffer names differ, between the ranks.
    """
    mine = []
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.is_meta:
            continue
        t = t.detach()
        t = torch.view_as_real(t) if t.is_complex() else t  # a complex buffer (rotary freqs_cis): its real view
        floats = t if t.is_floating_point() else t.double()
        mine.append((name, float(floats.sum(dtype=torch.float64)), float(torch.linalg.vector_norm(floats, dtype=torch.float64))))
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    for r, theirs in enumerate(every):
        if [n for n, *_ in theirs] != [n for n, *_ in mine]:
            raise FxtpConfigError(f"the model's parameters and buffers differ between this rank and rank {r} of the "
                                  "tensor-parallel group (other names); fix: build the same model on every rank")
        for (name, *a), (_, *b) in zip(mine, theirs):
            if any(abs(x - y) > 1e-9 * max(abs(x), abs(y)) for x, y in zip(a, b)):
                raise FxtpConfigError(
                    f"the model differs between the ranks: {name!r} has sum {a[0]:.6g} here (rank "
                    f"{dist.get_rank(group)}) and {b[0]:.6g} on rank {r} of the tensor-parallel group; every rank "
                    "slices its shards from its own copy, so they must start from one model. fix: seed every rank "
                    "the same before building the model (torch.manual_seed(0)), or load the same weights on each")


def check_strategy(
    strategy: Any, world_size: int, sequence_parallel: bool, activation_checkpointing: Optional[str], plan: dict[str, str]
) -> tuple[bool, Optional[str], dict[str, str]]:
    """``compile``'s ``(sequence_parallel, activation_checkpointing, plan)`` under ``strategy``
    (a ``fxtp.ParallelPlan``, or its ``tensor_parallel``): the strategy's, with the caller's
    ``plan=`` entries applied after its layer styles (so they win). The caller's other options
    must be left at their defaults or agree with the strategy.

    Raises:
        FxtpConfigError: not a plan, a ``world_size`` other than the plan's ``tp``, or an
            option the plan sets otherwise.
    """
    if strategy is None:
        return sequence_parallel, activation_checkpointing, plan
    part = getattr(strategy, "tensor_parallel", strategy)
    if not isinstance(part, TensorParallelStrategy):
        raise FxtpConfigError(f"strategy must be a fxtp.ParallelPlan (from fxtp.plan), got {type(strategy).__name__}")
    if world_size != part.tp:
        raise FxtpConfigError(
            f"world_size is {world_size} but the plan's tensor-parallel degree is {part.tp}: pass world_size=plan.tp "
            "and group= the plan's tp sub-mesh (mesh['tp'] of init_device_mesh(..., (plan.dp, plan.tp)))"
        )
    if sequence_parallel and not part.sequence_parallel:
        raise FxtpConfigError("sequence_parallel=True, but the plan runs without it: drop the flag, or plan again")
    if activation_checkpointing not in (None, part.activation_checkpointing):
        raise FxtpConfigError(
            f"activation_checkpointing={activation_checkpointing!r}, but the plan's is {part.activation_checkpointing!r}: "
            "drop the argument, or plan again"
        )
    styles = check_plan(dict(part.layer_styles))
    return part.sequence_parallel, check_checkpointing(part.activation_checkpointing), styles | plan
