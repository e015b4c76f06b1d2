"""The public entry points: ``fxtp.compile`` and ``fxtp.analyze``."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import time
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from fxtp.arguments import (CompileOptions, Group, check_capture, check_checkpointing, check_flag, check_inputs, check_plan,
                             check_same_model, check_strategy, check_world_size, resolve_group)
from fxtp.capture.hf_defaults import call_defaults, spec_with_defaults
from fxtp.capture.frontends import Captured, auto_dynamic_shapes, capture, capture as _capture  # _capture: where `capture=` shadows it
from fxtp.capture.isolation import independent_inputs
from fxtp.runtime.checkpoint import bind_state_keys
from fxtp.core.autocast import autocast_as
from fxtp.core.errors import FxtpConfigError, FxtpPlanError
from fxtp.runtime.generation import generation_for
from fxtp.explain.recompute import add_recompute
from fxtp.explain.report import Report, build_report, parameter_placements
from fxtp.core.rng import draws_random, sync_generators
from fxtp.planning import normalized, plan_program
from fxtp.runtime.blocks import module_templates
from fxtp.runtime.module import ParallelModule
from fxtp.runtime import layout
from fxtp.runtime.variants import SizeGraphs, in_mode, meta_copy, mode_of
from fxtp.capture.shapes import input_specs, specialized_shapes
from passes.dynamic import plan_symbols
from passes.regions.blocks import outline_blocks, program_code
from passes.regions.checkpointing import checkpoint_regions, recompute_regions, repeated_blocks
from passes.normalize import causal_attention
from passes.plan import ShardingPlan
from passes.rewrite import rewrite

__all__ = ["compile", "analyze", "plan_world_sizes"]


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
    strategy: Any = None,
    expert_parallel: bool = False,
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
        strategy: a ``fxtp.ParallelPlan`` (``fxtp.plan``): its tensor-parallel part is applied,
            ``world_size`` must be its ``tp`` (``group``: the tp sub-mesh), and its
            ``sequence_parallel``, ``activation_checkpointing`` and layer styles are used
            (``plan=`` entries override layer styles; the other two must be left unset or agree).
            FSDP2 over the ``dp`` sub-mesh is the caller's ``fully_shard``, or the whole plan in one
            call: ``fxtp.parallelize(model, mesh, ..., strategy=plan)``.
        expert_parallel: every routed-experts block (Hugging Face's ``grouped_mm`` and
            ``batched_mm`` experts) holds whole experts per rank, ``E // world_size`` of them
            (front-loaded), and sends each (token, expert) pair to its expert's rank by
            all_to_all and back (NOTE: [expert parallelism] in fxtp/core/expert_dispatch.py);
            the router, shared experts, attention and dense layers keep their plan.
            ``plan={module: "expert"}`` does this for one block. Not with ``sequence_parallel``.

    Returns:
        A :class:`ParallelModule`: same call signature and outputs as ``model``. Its
        ``train()``/``eval()`` switch the graph like the model's own switch (NOTE: [modes]).

    Raises:
        FxtpConfigError: bad ``world_size``, ``capture``, ``plan``, ``group`` or ``strategy``.
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
    sequence, checkpointing, overrides = check_strategy(
        strategy, check_world_size(world_size), check_flag("sequence_parallel", sequence_parallel),
        check_checkpointing(activation_checkpointing), check_plan(plan),
    )
    options = CompileOptions(world_size, capture=capture, plan=overrides or plan, sequence=sequence,
                             experts=check_flag("expert_parallel", expert_parallel), checkpointing=checkpointing)
    return _compile(model, example_inputs, example_kwargs, options, rank=rank, group=group, dynamic=dynamic,
                    dynamic_shapes=dynamic_shapes, modes=("train", "eval"))


def _compile(model: nn.Module, example_inputs: Optional[tuple], example_kwargs: Optional[dict], options: CompileOptions, *,
             rank: Optional[int], group: Group, dynamic: bool, dynamic_shapes: Any, modes: tuple[str, ...]) -> ParallelModule:
    """``compile``, capturing the graphs of ``modes`` besides the model's own (NOTE: [modes]);
    a decoder for ``generate`` runs in eval mode only and needs no other, and keeps of its
    cache the kv heads each rank needs (``options.kv_heads``, passes/kv_heads.py)."""
    ws = check_world_size(options.world_size)
    args, kwargs = check_inputs(model, example_inputs, example_kwargs)
    defaults, left_out = call_defaults(model, kwargs)  # NOTE: [Hugging Face call defaults]
    kwargs |= defaults
    group_name, rank = resolve_group(ws, rank, group)
    tp_group = (group.get_group() if hasattr(group, "get_group") else group or dist.group.WORLD) if group_name is not None else None
    if tp_group is not None:
        check_same_model(model, tp_group)  # each rank slices its shards from its own copy
    shapes = _shapes_spec(args, kwargs, dynamic, spec_with_defaults(dynamic_shapes, defaults))
    options = dataclasses.replace(options, world_size=ws, rank=rank, group_name=group_name, shapes=shapes)
    devices = frozenset(t.device.type for t in itertools.chain(model.parameters(), model.buffers(), pytree.tree_leaves((args, kwargs)))
                        if isinstance(t, torch.Tensor))
    with autocast_as((), devices):  # every graph is of one autocast state; this one of none (NOTE: [autocast graphs])
        captured, sharding, report = _analyze(model, args, kwargs, options)
    report.left_out = left_out
    program = captured.program
    start = time.perf_counter()
    options = dataclasses.replace(options, capture=captured.frontend, blocks=repeated_blocks(model),
                                  want=parameter_placements(program, sharding))
    regions = checkpoint_regions(program.graph, options.checkpointing, options.blocks, frozenset(captured.context_fns))
    gm = outline_blocks(_rewrite(program, sharding, options), program, options.blocks, regions, captured.context_fns)
    add_recompute(report, regions, gm)
    report.timings["rewrite_s"] = time.perf_counter() - start
    compiled = mode_of(model)
    report.modes = {compiled: "captured at compile (the model's mode)"}
    copied = meta_copy(model)  # for the graphs captured on first use: other modes, sizes 0 and 1
    graphs = {compiled: (program, gm)}
    start = time.perf_counter()
    for mode in modes:  # NOTE: [modes]
        if mode == compiled:
            continue
        if copied is None:  # a model that cannot be copied: its other mode is captured now
            with autocast_as((), devices):
                other = _other_mode(model, mode, args, kwargs, options)
            same = program_code(other[1]) == program_code(gm) and input_specs(other[0]) == input_specs(program)
            graphs[mode] = graphs[compiled] if same else other
            report.modes[mode] = "captured at compile" + (": the same graph" if same else ": its own graph")
        else:
            report.modes[mode] = "captured at the first switch to it (pm.train() / pm.eval())"
    report.timings["modes_s"] = time.perf_counter() - start
    # The captured graphs, not the rank graphs: there a random op on a shard is fxtp's own call.
    report.generator_check = any(draws_random(prog.graph) for prog, _ in graphs.values())
    code = program_code(gm)  # before the module binds its blocks (NOTE: [modes])
    if tp_group is not None and report.generator_check:  # NOTE: [dropout across ranks]
        sync_generators(tp_group)
    pm = ParallelModule(
        program, gm, sharding, report, rank=rank, world_size=ws, group_name=group_name, graphs=graphs, mode=compiled,
        templates=module_templates(model),
    )
    pm._call_defaults = defaults
    bind_state_keys(pm, model)
    if copied is not None and any(mode not in graphs for mode in modes):
        pm._mode_graphs = _mode_graphs(copied, args, kwargs, options, compiled, code, input_specs(program))
    if copied is not None and not options.kv_heads:  # NOTE: [size-1 graphs] in fxtp/runtime/variants.py, [autocast graphs]
        pm._size_graphs = _size_graphs(copied, options, (report.plan, options.plan), dynamic_shapes is not None or dynamic, devices)
    pm._generation = generation_for(model, _compile_decoder)  # NOTE: [generation]
    return pm


def _compile_decoder(model: nn.Module, world_size: int, example_inputs: tuple, *, example_kwargs: dict, rank: Optional[int],
                     group: Group, dynamic_shapes: Any, plan: Mapping[str, str]) -> ParallelModule:
    """``compile`` for fxtp.runtime.generation's static-cache decoder: its eval-mode graph only."""
    return _compile(model, example_inputs, example_kwargs, CompileOptions(world_size, plan=plan, kv_heads=True),
                    rank=rank, group=group, dynamic=True, dynamic_shapes=dynamic_shapes, modes=())


# NOTE: [modes]
# ``pm.train()`` / ``pm.eval()`` must do what ``model.train()`` / ``model.eval()`` do, and the model's Python may
# branch on ``self.training`` anywhere (dropout_p of an attention, batch-norm statistics, Hugging Face's ``0.0 if not
# self.training``), so a graph captured in one mode is not the other's. fxtp captures the model's own mode at compile,
# and the other mode at the first switch to it: from the model's ``meta`` copy taken at compile (every module's flag
# set for the capture; no weight held or touched, as for the size-1 graphs), planned, and bound to the module's own
# shards. Most loops never switch, and a capture is most of a compile's time, so compile captures once. Every mode's
# plan must shard the parameters alike (one set of shards); a mode that would shard one differently is an
# ``FxtpPlanError`` at that switch. A mode whose graph is the compiled one's shares it. A graph that draws random
# numbers where the compiled one did not syncs the generators at that switch, a collective (every rank switches at the
# same call). A model compiled in a mixed state (a frozen batch norm) keeps that graph until the first ``train()``/
# ``eval()``. A model that cannot be deep-copied gets its other mode captured at compile. Later switches cost nothing.


def _other_mode(model: nn.Module, mode: str, args: tuple, kwargs: dict,
                options: CompileOptions) -> tuple[torch.export.ExportedProgram, torch.fx.GraphModule]:
    """Capture, plan and rewrite ``model`` in ``mode`` with the compiled graph's ``options``;
    its parameters must be sharded as in the compiled mode's plan, ``options.want`` (NOTE: [modes])."""
    with in_mode(model, mode == "train"):
        captured, other, _ = _analyze(model, args, kwargs, options, report=False)
    _check_same_shards(options.want, captured.program, other, f"in {mode} mode", "compile in the other mode")
    return captured.program, _recomputed(captured, other, options)


def _mode_graphs(copied: nn.Module, args: tuple, kwargs: dict, options: CompileOptions, compiled: str, code: str,
                 specs: Any) -> Callable[[ParallelModule, str], Any]:
    """What ``pm.train()`` / ``pm.eval()`` calls to capture a mode's graph on the first switch
    to it (NOTE: [modes]): the pipeline on the model's ``meta`` copy ``copied`` with ``meta``
    inputs shaped like the example, bound to the module's own parameters. ``compiled``, ``code``
    and ``specs``: the compiled graph's mode, code and input specs (a graph equal to it is
    shared). Holds neither the user's model nor its weights, nor the process group: its name
    (NOTE: [group by name] in fxtp/runtime/layout.py; a group held here outlived
    ``destroy_process_group()``, and its gloo threads ran on at exit)."""
    meta_args, meta_kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), (args, kwargs)
    )
    if isinstance(options.shapes, torch.export.ShapesCollection):  # keyed by the example tensors: by position instead
        options = dataclasses.replace(options, shapes=options.shapes.dynamic_shapes(copied, args, kwargs))

    def capture_mode(pm: ParallelModule, mode: str) -> Any:
        start = time.perf_counter()
        program, gm = _other_mode(copied, mode, meta_args, meta_kwargs, options)
        same = program_code(gm) == code and input_specs(program) == specs
        pm.report.modes[mode] = "captured at the first switch to it" + (": the same graph" if same else ": its own graph")
        pm.report.timings["modes_s"] = time.perf_counter() - start
        if same:
            return pm.mode_graph(compiled)
        group = layout.tp_group(pm)
        if group is not None and draws_random(program.graph) and not pm.report.generator_check:
            pm.report.generator_check = True  # NOTE: [dropout across ranks]: every rank switches at the same call
            sync_generators(group)
        return pm.bind_graph(program, gm)

    return capture_mode


def _recomputed(captured: Captured, sharding: ShardingPlan, options: CompileOptions,
                report: Optional[Report] = None) -> torch.fx.GraphModule:
    """The rank graph with its checkpointed regions recomputed in backward (NOTE: [recomputed
    regions]): ``options.checkpointing`` over ``options.blocks``; listed in ``report`` if given."""
    regions = checkpoint_regions(captured.program.graph, options.checkpointing, options.blocks, frozenset(captured.context_fns))
    gm = outline_blocks(_rewrite(captured.program, sharding, options), captured.program, options.blocks, regions,
                        captured.context_fns)
    if report is not None:
        add_recompute(report, regions, gm)
    return gm


def _check_same_shards(want: Mapping[str, Any], program, sharding: ShardingPlan, where: str, alternative: str) -> None:
    """Refuse a graph whose plan shards a parameter otherwise than ``want`` (the compiled
    graph's ``{fqn: placement}``): every graph of a module runs on one set of shards."""
    for fqn, placement in parameter_placements(program, sharding).items():
        if fqn in want and want[fqn] != placement:
            raise FxtpPlanError(
                f"{where} the plan would shard {fqn} as {placement}, but the compiled graph's plan as {want[fqn]}: "
                f"one set of shards cannot serve both. fix: pass plan= to force the layer's style, or {alternative}"
            )


def _size_graphs(copied: nn.Module, options: CompileOptions, plans: tuple[Optional[Mapping[str, str]], ...], dynamic: bool,
                 devices: frozenset[str]) -> SizeGraphs:
    """What makes the graphs for sizes 0 and 1 and autocast states on first use (NOTE: [size-1
    graphs] in fxtp/runtime/variants.py): the pipeline above on the model's ``meta`` copy ``copied``.
    ``plans``: the plans to try in order, the compiled graph's layer styles first (a layer the
    compiled graph kept replicated stays so), then the user's ``plan=``; ``dynamic``: the compile's
    (static: an autocast state's graph at the compiled sizes only); ``devices``: its device types."""

    def build(meta_model: nn.Module, args: tuple, kwargs: dict, mode: str):
        error: Optional[FxtpPlanError] = None
        for plan in plans:
            attempt = dataclasses.replace(options, plan=plan, shapes=auto_dynamic_shapes(args, kwargs) if dynamic else None)
            try:
                with contextlib.nullcontext() if mode == "mixed" else in_mode(meta_model, mode == "train"):
                    captured, sharding, report = _analyze(meta_model, args, kwargs, attempt)
                _check_same_shards(options.want, captured.program, sharding, "for these input sizes or autocast", "call with the compiled sizes")
            except FxtpPlanError as exc:  # e.g. a layer name of the compiled graph this graph lacks
                error = error or exc
                continue
            return captured.program, _recomputed(captured, sharding, attempt, report), report
        raise error

    return SizeGraphs(copied, build, dynamic, devices)


def _rewrite(program, sharding: ShardingPlan, options: CompileOptions) -> torch.fx.GraphModule:
    gm = (copy.deepcopy(program.graph_module) if options.world_size == 1
          else rewrite(program.graph_module, sharding, rank=options.rank, group_name=options.group_name or ""))
    causal_attention(gm.graph)  # NOTE: [causal masks] in fxtp/core/local_ops.py
    gm.recompile()
    return gm


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
    activation_checkpointing: Optional[str] = None,
    expert_parallel: bool = False,
) -> Report:
    """The :class:`Report` ``compile`` would give, without creating any shard.

    Works on models on the ``meta`` device. Arguments and errors as in :func:`compile`
    (one mode: the model's); ``rank``: the rank the report is for (its parameter bytes: uneven
    shards hold more on the first ranks, NOTE: [uneven shards]). The report lists the regions
    recomputed in backward (the model's ``torch.utils.checkpoint`` calls, or those
    ``activation_checkpointing=`` makes) and counts their collectives again in the backward.
    """
    ws = check_world_size(world_size)
    checkpointing = check_checkpointing(activation_checkpointing)
    args, kwargs = check_inputs(model, example_inputs, example_kwargs)
    defaults, left_out = call_defaults(model, kwargs)  # NOTE: [Hugging Face call defaults]
    kwargs |= defaults
    shapes = _shapes_spec(args, kwargs, dynamic, spec_with_defaults(dynamic_shapes, defaults))
    options = CompileOptions(ws, capture=capture, plan=plan, sequence=check_flag("sequence_parallel", sequence_parallel),
                             experts=check_flag("expert_parallel", expert_parallel), checkpointing=checkpointing,
                             rank=rank, shapes=shapes)
    captured, sharding, report = _analyze(model, args, kwargs, options)
    regions = checkpoint_regions(captured.program.graph, checkpointing, repeated_blocks(model), frozenset(captured.context_fns))
    if regions:  # the rank graph of a meta model holds meta tensors: nothing is materialized
        gm = recompute_regions(_rewrite(captured.program, sharding, options), regions, captured.context_fns)
        add_recompute(report, regions, gm)
    report.left_out = left_out
    return report


def _analyze(model: nn.Module, args: tuple, kwargs: dict, options: CompileOptions,
             report: bool = True) -> tuple[Captured, ShardingPlan, Optional[Report]]:
    """Capture and plan ``model`` with ``options`` (its frontend, plan, rank, shapes, sequence,
    kv heads and experts); with ``report``, also the :class:`Report`."""
    check_capture(options.capture)
    overrides = check_plan(options.plan)
    start = time.perf_counter()
    args, kwargs, shapes = independent_inputs(args, kwargs, options.shapes)  # one set for every capture and the respec below
    options = options if shapes is options.shapes else dataclasses.replace(options, shapes=shapes)
    captured, sharding, capture_s = _capture_and_plan(model, args, kwargs, options, overrides)
    symbols = plan_symbols(captured.program.graph, sharding)
    notes = list(captured.notes)
    if symbols:  # NOTE: [dynamic shapes]: a decision reads a dynamic size: specialize it, capture again
        flat, specs = pytree.tree_leaves((args, kwargs)), input_specs(captured.program)
        dims = {d.symbol: f"{s.name} dim {i} ({d.symbol}) specialized to {d.example}" for s in specs for i, d in enumerate(s.dims) if d.dynamic}
        notes += [f"{dims.get(sym, sym + ' specialized')}: the plan depends on its size ({why})" for sym, why in symbols.items()]
        respec = specialized_shapes(flat, specs, set(symbols))
        first = captured
        again = dataclasses.replace(options, capture=first.frontend, shapes=respec)
        captured, sharding, again_s = _capture_and_plan(model, args, kwargs, again, overrides)
        captured = dataclasses.replace(captured, attempts=first.attempts + captured.attempts)
        capture_s += again_s
        notes += list(captured.notes)
    if not report:
        return captured, sharding, None
    program = captured.program
    rep = build_report(program, sharding, captured.frontend, captured.attempts, options.rank)
    rep.inputs = input_specs(program)
    rep.shape_notes = tuple(notes)
    rep.timings = {"capture_s": capture_s, "passes_s": time.perf_counter() - start - capture_s}
    return captured, sharding, rep


def _capture_and_plan(model: nn.Module, args: tuple, kwargs: dict, options: CompileOptions,
                      overrides: Mapping[str, str]) -> tuple[Captured, ShardingPlan, float]:
    """Capture with ``options.capture`` and ``options.shapes``, normalize and plan with
    ``overrides`` (sequence parallelism, a cache's needed kv heads and expert parallelism as
    ``options`` says); also the seconds the capture took."""
    start = time.perf_counter()
    captured = capture(model, args, kwargs, options.capture, dynamic_shapes=options.shapes)
    capture_s = time.perf_counter() - start
    program = captured.program
    param_fqns, written = normalized(program)
    sharding = plan_program(program, param_fqns, written, options.world_size, overrides, options.sequence,
                            options.kv_heads, options.experts)
    return captured, sharding, capture_s


def plan_world_sizes(
    model: nn.Module,
    world_sizes: tuple[int, ...],
    example_inputs: Optional[tuple[Any, ...]] = None,
    *,
    example_kwargs: Optional[dict[str, Any]] = None,
    capture: str = "auto",
    expert_parallel: bool = False,
) -> tuple[torch.export.ExportedProgram, dict[int, ShardingPlan]]:
    """The captured program and its plan at each of ``world_sizes``, from one capture with
    static shapes: ``fxtp.plan`` compares tensor-parallel degrees, and the passes are cheap
    next to a capture. Arguments and errors as in :func:`analyze`; the program's parameters
    are the model's own tensors (on ``meta`` for a meta model): read them, never write them.
    With ``expert_parallel``, also the expert-parallel plans, under ``-ws`` (none at a degree
    with fewer experts than ranks, or for experts fxtp cannot dispatch).
    """
    sizes = tuple(check_world_size(ws) for ws in world_sizes)
    args, kwargs = check_inputs(model, example_inputs, example_kwargs)
    check_capture(capture)
    program = _capture(model, args, kwargs, capture, dynamic_shapes=None).program
    param_fqns, written = normalized(program)
    plans = {ws: plan_program(program, param_fqns, written, ws, {}) for ws in sizes}
    for ws in sizes if expert_parallel else ():
        try:
            plans[-ws] = plan_program(program, param_fqns, written, ws, {}, experts=True)
        except (FxtpConfigError, FxtpPlanError):  # fewer experts than ranks; experts fxtp cannot dispatch
            continue
    return program, plans


