"""The public entry points: ``fxtp.compile`` and ``fxtp.analyze``."""

from __future__ import annotations

import copy
import time
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.export.graph_signature import InputKind

from fxtp.capture import FRONTENDS, Captured, capture
from fxtp.checkpoint import bind_state_keys
from fxtp.errors import FxtpConfigError, FxtpInputError
from fxtp.report import Report, build_report
from fxtp.rng import draws_random, sync_generators
from fxtp.runtime import ParallelModule
from passes.normalize import normalize
from passes.partial import defer_reductions
from passes.plan import STYLES, ShardingPlan, plan_sharding
from passes.rewrite import rewrite

__all__ = ["compile", "analyze"]

Group = Union["dist.ProcessGroup", "torch.distributed.device_mesh.DeviceMesh", None]


def compile(  # noqa: A001 - the name users expect, as torch.compile
    model: nn.Module,
    world_size: int,
    example_inputs: Optional[tuple[Any, ...]] = None,
    *,
    example_kwargs: Optional[dict[str, Any]] = None,
    rank: Optional[int] = None,
    group: Group = None,
    capture: str = "auto",
    plan: Optional[Mapping[str, str]] = None,
) -> ParallelModule:
    """Turn ``model`` into this rank's part of a ``world_size``-way tensor-parallel model.

    Colwise and rowwise layers are chosen by analysis (Megatron-LM's column/row-parallel
    linears, Shoeybi et al. 2019); the communication is torch's functional collectives.

    Args:
        model: any ``nn.Module``; never mutated (parameters are copied into the result).
        world_size: the tensor-parallel degree, an int >= 1; 1 is an exact no-op.
        example_inputs: positional inputs, used for capture and shapes; the result runs on
            inputs of these shapes.
        example_kwargs: keyword inputs, likewise.
        rank: this rank; defaults to the rank in ``group``, or 0 without a process group.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``world_size`` ranks; defaults to
            the initialized default group. Without one, the result can be inspected, and
            running it raises ``FxtpRuntimeError``.
        capture: ``"fx"``, ``"export"``, ``"dynamo"`` or ``"auto"`` (see ``fxtp.capture``).
        plan: overrides ``{fqn_or_glob: "colwise" | "rowwise" | "replicate"}``.

    Returns:
        A :class:`ParallelModule`: same call signature and outputs as ``model``.

    Raises:
        FxtpConfigError: bad ``world_size``, ``capture``, ``plan`` or ``group``.
        FxtpInputError: example inputs that do not fit the model.
        FxtpCaptureError: no frontend could capture the model.
        FxtpPlanError: a ``plan`` entry that cannot be honoured.

    Example::

        dist.init_process_group("gloo")
        pm = fxtp.compile(model, world_size=2, example_inputs=(x,))
        torch.testing.assert_close(pm(x), model(x))
        print(pm.report)
    """
    ws = _check_world_size(world_size)
    args, kwargs = _check_inputs(model, example_inputs, example_kwargs)
    group_name, rank = _resolve_group(ws, rank, group)
    captured, sharding, report = _analyze(model, ws, args, kwargs, capture, plan, rank)
    program = captured.program
    if ws == 1:
        gm = copy.deepcopy(program.graph_module)
    else:
        start = time.perf_counter()
        gm = rewrite(program.graph_module, sharding, rank=rank, group_name=group_name or "")
        report.timings["rewrite_s"] = time.perf_counter() - start
        if group_name is not None and draws_random(gm.graph):  # NOTE: [dropout across ranks]
            sync_generators(group.get_group() if hasattr(group, "get_group") else group or dist.group.WORLD)
    pm = ParallelModule(
        program, gm, sharding, report, rank=rank, world_size=ws, group_name=group_name, example=(args, kwargs)
    )
    bind_state_keys(pm, model)
    return pm


def analyze(
    model: nn.Module,
    world_size: int,
    example_inputs: Optional[tuple[Any, ...]] = None,
    *,
    example_kwargs: Optional[dict[str, Any]] = None,
    capture: str = "auto",
    plan: Optional[Mapping[str, str]] = None,
) -> Report:
    """The :class:`Report` ``compile`` would give, without creating any shard.

    Works on models on the ``meta`` device. Arguments and errors as in :func:`compile`.
    """
    ws = _check_world_size(world_size)
    args, kwargs = _check_inputs(model, example_inputs, example_kwargs)
    return _analyze(model, ws, args, kwargs, capture, plan, 0)[2]


def _analyze(model, ws, args, kwargs, how, plan, rank) -> tuple[Captured, ShardingPlan, Report]:
    if how not in (*FRONTENDS, "auto"):
        raise FxtpConfigError(f"capture must be one of {', '.join(repr(f) for f in (*FRONTENDS, 'auto'))}, not {how!r}")
    overrides = _check_plan(plan)
    start = time.perf_counter()
    captured = capture(model, args, kwargs, how)
    captured_at = time.perf_counter()
    program = captured.program
    normalize(program.graph_module.graph)
    program.graph_module.recompile()
    param_fqns = {
        spec.arg.name: spec.target for spec in program.graph_signature.input_specs if spec.kind == InputKind.PARAMETER
    }
    sharding = defer_reductions(program.graph, plan_sharding(program.graph, param_fqns, ws, overrides))
    report = build_report(program, sharding, captured.frontend, captured.attempts, rank)
    report.timings = {"capture_s": captured_at - start, "passes_s": time.perf_counter() - captured_at}
    return captured, sharding, report


def _check_world_size(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise FxtpConfigError(f"world_size must be an int >= 1 (the tensor-parallel degree), got {world_size!r}")
    return world_size


def _check_inputs(model: Any, example_inputs: Any, example_kwargs: Any) -> tuple[tuple, dict]:
    if not isinstance(model, nn.Module):
        raise FxtpConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if example_inputs is None and not example_kwargs:
        raise FxtpInputError("example_inputs are required: fxtp captures the model by running it on them, e.g. example_inputs=(x,)")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if example_inputs is not None and not isinstance(example_inputs, (tuple, list)):
        raise FxtpInputError(f"example_inputs must be a tuple of positional inputs, got {type(example_inputs).__name__}")
    return tuple(example_inputs or ()), dict(example_kwargs or {})


def _check_plan(plan: Any) -> dict[str, str]:
    if plan is None:
        return {}
    if not isinstance(plan, Mapping):
        raise FxtpConfigError(f"plan must be a dict {{fqn_or_glob: style}}, got {type(plan).__name__}")
    for key, style in plan.items():
        if style not in STYLES:
            raise FxtpConfigError(f"plan[{key!r}] = {style!r}: style must be one of {', '.join(STYLES)}")
    return dict(plan)


def _resolve_group(ws: int, rank: Optional[int], group: Group) -> tuple[Optional[str], int]:
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
