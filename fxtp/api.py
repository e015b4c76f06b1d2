"""The public entry points: ``fxtp.compile`` and ``fxtp.analyze``."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from typing import Any, Iterator, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.export.graph_signature import InputKind

from fxtp.capture.frontends import FRONTENDS, Captured, auto_dynamic_shapes, capture, written_state
from fxtp.runtime.checkpoint import bind_state_keys
from fxtp.core.errors import FxtpConfigError, FxtpInputError, FxtpPlanError
from fxtp.runtime.generation import generation_for
from fxtp.explain.recompute import add_recompute
from fxtp.explain.report import Report, build_report, parameter_placements
from fxtp.core.rng import draws_random, sync_generators
from fxtp.runtime.module import ParallelModule
from fxtp.capture.shapes import input_specs, specialized_shapes
from passes.dynamic import plan_symbols
from passes.kv_heads import keep_needed_kv_heads
from passes.checkpointing import MODES as CHECKPOINTING, checkpoint_regions, recompute_regions, repeated_blocks
from passes.normalize import normalize
from passes.partial import defer_reductions
from passes.plan import STYLES, ShardingPlan, plan_sharding
from passes.rewrite import rewrite
from passes.sequence import sequence_parallel

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
    dynamic: bool = True,
    dynamic_shapes: Any = None,
    sequence_parallel: bool = False,
    activation_checkpointing: Optional[str] = None,
) -> ParallelModule:
    """Turn ``model`` into this rank's part of a ``world_size``-way tensor-parallel model.

    Colwise and rowwise layers are chosen by analysis (Megatron-LM's column/row-parallel
    linears, Shoeybi et al. 2019); the communication is torch's functional collectives.

    Args:
        model: any ``nn.Module``; never mutated (parameters are copied into the result).
        world_size: the tensor-parallel degree, an int >= 1; 1 is an exact no-op.
        example_inputs: positional inputs, used for capture and shapes; the result runs on
            any input the capture allows (``dynamic``), else on inputs of these shapes.
        example_kwargs: keyword inputs, likewise.
        rank: this rank; defaults to the rank in ``group``, or 0 without a process group.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``world_size`` ranks; defaults to
            the initialized default group. Without one, the result can be inspected, and
            running it raises ``FxtpRuntimeError``.
        capture: ``"fx"``, ``"export"``, ``"dynamo"`` or ``"auto"`` (see ``fxtp.capture.frontends``).
        plan: overrides ``{fqn_or_glob: "colwise" | "rowwise" | "replicate"}``.
        dynamic: capture with dynamic shapes (default): every input dim the model allows
            (batch, sequence) stays symbolic, so one module runs every such size; ``False``
            specializes every dim to the example (NOTE: [dynamic shapes] in fxtp/capture/frontends.py).
        dynamic_shapes: torch.export's ``dynamic_shapes`` spec, passed through (overrides
            ``dynamic``), e.g. ``{"ids": {0: Dim("batch", min=1)}}``.
        sequence_parallel: Megatron-LM's sequence parallelism (Korthikanti et al. 2022): the
            values between a rowwise layer and the next colwise one (residuals, norms, dropout)
            are sharded on their token dim (the second-to-last), each rowwise all_reduce
            becomes a reduce_scatter and each colwise entry an all_gather (the same bytes), and
            a rank keeps 1/world_size of those activations (NOTE: [sequence parallelism] in
            passes/sequence.py). Token counts must divide world_size (else ``FxtpInputError``).
        activation_checkpointing: ``None`` (default): the model's own ``torch.utils.checkpoint``
            regions, if any, are recomputed in backward; ``"blocks"``: every repeated block (a
            child of the model's largest ``nn.ModuleList``) is, as torchtitan's ``apply_ac``
            full mode; ``"selective"``: per block, matmul and attention outputs are saved and
            the rest recomputed (torchtitan's op-level selective mode). NOTE: [recomputed
            regions] in fxtp/core/recompute.py; the report lists the regions.

    Returns:
        A :class:`ParallelModule`: same call signature and outputs as ``model``. Its
        ``train()``/``eval()`` switch the graph like the model's own switch (NOTE: [modes]).

    Raises:
        FxtpConfigError: bad ``world_size``, ``capture``, ``plan`` or ``group``.
        FxtpInputError: example inputs whose shapes or dtypes do not fit the model (values are
            not checked: an id out of range compiles and raises at the first call).
        FxtpCaptureError: no frontend could capture the model.
        FxtpPlanError: a ``plan`` entry that cannot be honoured.

    Example::

        dist.init_process_group("gloo")
        pm = fxtp.compile(model, world_size=2, example_inputs=(x,))
        torch.testing.assert_close(pm(x), model(x))
        print(pm.report)
    """
    return _compile(model, world_size, example_inputs, example_kwargs, rank, group, capture, plan, dynamic, dynamic_shapes,
                    modes=("train", "eval"), sequence=_check_flag("sequence_parallel", sequence_parallel),
                    checkpointing=_check_checkpointing(activation_checkpointing))


def _compile(model, world_size, example_inputs, example_kwargs, rank, group, capture, plan, dynamic, dynamic_shapes, *,
             modes: tuple[str, ...], sequence: bool = False, kv_heads: bool = False,
             checkpointing: Optional[str] = None) -> ParallelModule:
    """``compile``, capturing the graphs of ``modes`` besides the model's own (NOTE: [modes]);
    a decoder for ``generate`` runs in eval mode only and needs no other, and keeps of its
    cache the kv heads each rank needs (``kv_heads``, passes/kv_heads.py)."""
    ws = _check_world_size(world_size)
    args, kwargs = _check_inputs(model, example_inputs, example_kwargs)
    group_name, rank = _resolve_group(ws, rank, group)
    shapes = _shapes_spec(args, kwargs, dynamic, dynamic_shapes)
    captured, sharding, report = _analyze(model, ws, args, kwargs, capture, plan, rank, shapes, sequence=sequence,
                                          kv_heads=kv_heads)
    program = captured.program
    start = time.perf_counter()
    blocks = repeated_blocks(model)
    regions = checkpoint_regions(program.graph, checkpointing, blocks, frozenset(captured.context_fns))
    gm = recompute_regions(_rewrite(program, sharding, ws, rank, group_name), regions, captured.context_fns)
    add_recompute(report, regions, gm)
    report.timings["rewrite_s"] = time.perf_counter() - start
    compiled = _mode_of(model)
    graphs = {compiled: (program, gm)}
    report.modes = {compiled: "captured at compile (the model's mode)"}
    start = time.perf_counter()
    for mode in modes:  # NOTE: [modes]
        if mode not in graphs:
            other = _other_mode(model, mode, ws, args, kwargs, captured, plan, rank, shapes, group_name, program, sharding, sequence,
                                (checkpointing, blocks))
            same = other[1].code == gm.code and input_specs(other[0]) == input_specs(program)
            graphs[mode] = graphs[compiled] if same else other
            report.modes[mode] = "captured at compile" + (": the same graph" if same else ": its own graph")
    report.timings["modes_s"] = time.perf_counter() - start
    # The captured graphs, not the rank graphs: there a random op on a shard is fxtp's own call.
    report.generator_check = any(draws_random(prog.graph) for prog, _ in graphs.values())
    if group_name is not None and report.generator_check:  # NOTE: [dropout across ranks]
        sync_generators(group.get_group() if hasattr(group, "get_group") else group or dist.group.WORLD)
    pm = ParallelModule(
        program, gm, sharding, report, rank=rank, world_size=ws, group_name=group_name, graphs=graphs, mode=compiled
    )
    bind_state_keys(pm, model)
    pm._generation = generation_for(model, _compile_decoder)  # NOTE: [generation]
    return pm


def _compile_decoder(model: nn.Module, world_size: int, example_inputs: tuple, *, example_kwargs: dict, rank: Optional[int],
                     group: Group, dynamic_shapes: Any, plan: Mapping[str, str]) -> ParallelModule:
    """``compile`` for fxtp.runtime.generation's static-cache decoder: its eval-mode graph only."""
    return _compile(model, world_size, example_inputs, example_kwargs, rank, group, "auto", plan, True, dynamic_shapes,
                    modes=(), kv_heads=True)


# NOTE: [modes]
# ``pm.train()`` / ``pm.eval()`` must do what ``model.train()`` / ``model.eval()`` do, and the
# model's Python may branch on ``self.training`` anywhere (dropout_p of an attention, batch-norm
# statistics, Hugging Face's ``0.0 if not self.training``), so a graph captured in one mode is
# not the other's. fxtp captures one graph per mode at compile: the model's own mode, then
# every module in train mode and every module in eval mode (the flags are set for the capture
# and restored; no weight is touched). A model compiled in a mixed state (a frozen batch norm)
# keeps that graph until the first ``train()``/``eval()``. Every mode's plan must shard the
# parameters alike (they are one set of shards); a mode that would shard one differently is an
# ``FxtpPlanError``. The cost is one more capture at compile; the graphs are kept, so a switch
# costs nothing.


def _mode_of(model: nn.Module) -> str:
    flags = {m.training for m in model.modules()}
    return "mixed" if len(flags) > 1 else ("train" if flags.pop() else "eval")


@contextlib.contextmanager
def _in_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """Every module's ``training`` flag set for the block, then restored one by one."""
    saved = [(m, m.training) for m in model.modules()]
    try:
        for m, _ in saved:
            m.training = training
        yield
    finally:
        for m, flag in saved:
            m.training = flag


def _other_mode(
    model, mode, ws, args, kwargs, first: Captured, plan, rank, shapes, group_name, program, sharding, sequence, recompute
) -> tuple[torch.export.ExportedProgram, torch.fx.GraphModule]:
    """Capture, plan and rewrite ``model`` in ``mode``; its parameters must be sharded as in
    the compiled mode's plan (NOTE: [modes])."""
    with _in_mode(model, mode == "train"):
        captured, other, _ = _analyze(model, ws, args, kwargs, first.frontend, plan, rank, shapes, report=False, sequence=sequence)
    want = parameter_placements(program, sharding)
    for fqn, placement in parameter_placements(captured.program, other).items():
        if fqn in want and want[fqn] != placement:
            raise FxtpPlanError(
                f"in {mode} mode the plan would shard {fqn} as {placement}, but in the mode it was compiled in as "
                f"{want[fqn]}: one set of shards cannot serve both. fix: pass plan= to force the layer's style, or "
                "compile in the other mode"
            )
    regions = checkpoint_regions(captured.program.graph, *recompute, frozenset(captured.context_fns))
    return captured.program, recompute_regions(_rewrite(captured.program, other, ws, rank, group_name), regions, captured.context_fns)


def _rewrite(program, sharding: ShardingPlan, ws: int, rank: int, group_name: Optional[str]) -> torch.fx.GraphModule:
    if ws == 1:
        return copy.deepcopy(program.graph_module)
    return rewrite(program.graph_module, sharding, rank=rank, group_name=group_name or "")


def _shapes_spec(args: tuple, kwargs: dict, dynamic: bool, dynamic_shapes: Any) -> Any:
    if dynamic_shapes is not None:
        return dynamic_shapes
    if not isinstance(dynamic, bool):
        raise FxtpConfigError(f"dynamic must be True or False, got {dynamic!r}")
    return auto_dynamic_shapes(args, kwargs) if dynamic else None


def analyze(
    model: nn.Module,
    world_size: int,
    example_inputs: Optional[tuple[Any, ...]] = None,
    *,
    example_kwargs: Optional[dict[str, Any]] = None,
    capture: str = "auto",
    plan: Optional[Mapping[str, str]] = None,
    dynamic: bool = True,
    dynamic_shapes: Any = None,
    rank: int = 0,
    sequence_parallel: bool = False,
) -> Report:
    """The :class:`Report` ``compile`` would give, without creating any shard.

    Works on models on the ``meta`` device. Arguments and errors as in :func:`compile`
    (one mode: the model's); ``rank``: the rank the report is for (its parameter bytes: uneven
    shards hold more on the first ranks, NOTE: [uneven shards]).
    """
    ws = _check_world_size(world_size)
    args, kwargs = _check_inputs(model, example_inputs, example_kwargs)
    shapes = _shapes_spec(args, kwargs, dynamic, dynamic_shapes)
    return _analyze(model, ws, args, kwargs, capture, plan, rank, shapes,
                    sequence=_check_flag("sequence_parallel", sequence_parallel))[2]


def _analyze(model, ws, args, kwargs, how, plan, rank, shapes=None, report: bool = True,
             sequence: bool = False, kv_heads: bool = False) -> tuple[Captured, ShardingPlan, Optional[Report]]:
    if how not in (*FRONTENDS, "auto"):
        raise FxtpConfigError(f"capture must be one of {', '.join(repr(f) for f in (*FRONTENDS, 'auto'))}, not {how!r}")
    overrides = _check_plan(plan)
    start = time.perf_counter()
    captured, sharding, capture_s = _capture_and_plan(model, ws, args, kwargs, how, overrides, shapes, sequence, kv_heads)
    symbols = plan_symbols(captured.program.graph, sharding)
    notes = list(captured.notes)
    if symbols:  # NOTE: [dynamic shapes]: a decision reads a dynamic size: specialize it, capture again
        flat, specs = pytree.tree_leaves((args, kwargs)), input_specs(captured.program)
        dims = {d.symbol: f"{s.name} dim {i} ({d.symbol}) specialized to {d.example}" for s in specs for i, d in enumerate(s.dims) if d.dynamic}
        notes += [f"{dims.get(sym, sym + ' specialized')}: the plan depends on its size ({why})" for sym, why in symbols.items()]
        respec = specialized_shapes(flat, specs, set(symbols))
        first = captured
        captured, sharding, again_s = _capture_and_plan(model, ws, args, kwargs, first.frontend, overrides, respec, sequence,
                                                        kv_heads)
        captured = dataclasses.replace(captured, attempts=first.attempts + captured.attempts)
        capture_s += again_s
        notes += list(captured.notes)
    if not report:
        return captured, sharding, None
    program = captured.program
    rep = build_report(program, sharding, captured.frontend, captured.attempts, rank)
    rep.inputs = input_specs(program)
    rep.shape_notes = tuple(notes)
    rep.timings = {"capture_s": capture_s, "passes_s": time.perf_counter() - start - capture_s}
    return captured, sharding, rep


def _capture_and_plan(model, ws, args, kwargs, how, overrides, shapes, sequence: bool,
                      kv_heads: bool = False) -> tuple[Captured, ShardingPlan, float]:
    """Capture, normalize and plan (sequence parallelism with ``sequence``; keep a cache's needed
    kv heads with ``kv_heads``); also the seconds the capture took."""
    start = time.perf_counter()
    captured = capture(model, args, kwargs, how, dynamic_shapes=shapes)
    capture_s = time.perf_counter() - start
    program = captured.program
    normalize(program.graph_module.graph)
    program.graph_module.recompile()
    param_fqns = {
        spec.arg.name: spec.target for spec in program.graph_signature.input_specs if spec.kind == InputKind.PARAMETER
    }
    written = written_state(program)
    param_fqns |= written  # NOTE: [sharded state] in passes/rules/variants.py
    sharding = defer_reductions(program.graph, plan_sharding(program.graph, param_fqns, ws, overrides))
    if kv_heads:  # NOTE: [kv heads kept by the ranks that need them] in passes/kv_heads.py
        sharding = keep_needed_kv_heads(program.graph, sharding, written)
    if sequence:  # NOTE: [sequence parallelism] in passes/sequence.py
        sharding = sequence_parallel(program.graph, sharding, frozenset(param_fqns))
    return captured, sharding, capture_s


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise FxtpConfigError(f"{name} must be True or False, got {value!r}")
    return value


def _check_checkpointing(value: Any) -> Optional[str]:
    if value is not None and value not in CHECKPOINTING:
        raise FxtpConfigError(f"activation_checkpointing must be None, {' or '.join(map(repr, CHECKPOINTING))}, got {value!r}")
    return value


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
