"""``fxtp.plan``: the mesh, sequence parallelism, checkpointing and micro-batches, by predicted
step time under a memory budget.

The search is exhaustive and small: the pipeline degree ``pp`` over the divisors of ``devices``
up to the block count (training only; 1 is no pipelining), ``tp`` over the divisors of
``devices_per_node`` that divide ``devices / pp`` (at pp 1 plus the first degree that would
cross nodes, shown rejected), ``dp = devices / (pp x tp)`` with FSDP2, sequence parallelism on
or off, checkpointing ``None``, ``"selective"`` or ``"blocks"``, at pp > 1 torch's 1F1B and
Interleaved1F1B (2 stages a rank) schedules, and micro-batches over the divisors of a dp rank's
share of the global batch (at pp > 1 the pipeline's micro-batches, at least pp: torch's 1F1B
asks it). Each is priced by :func:`fxtp.planner.costs.estimate` (pipelined ones by
:func:`fxtp.planner.pipeline_costs.estimate_pipeline`, NOTE: [pipeline costs]); the parameters
come from fxtp's own analysis (NOTE: [repeated blocks]), the rest from the config
(NOTE: [activation bytes]).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from fxtp.core.errors import FxtpConfigError, FxtpInputError
from fxtp.planner.close_call import close_calls
from fxtp.planner.costs import OPTIMIZER_BYTES, TP_OVERLAP, Choice, Estimate, Workload, estimate
from fxtp.planner.experts import MoeShape, choose_experts
from fxtp.planner.hardware import Hardware, reserve_bytes, resolve_hardware
from fxtp.planner.model import AC_POLICIES, TransformerShape
from fxtp.planner.parallel_plan import Alternative, ParallelPlan, Units
from fxtp.planner.params import ParamShapes, parameter_shapes, repeated_blocks
from fxtp.planner.pipeline_costs import SCHEDULES, estimate_pipeline, schedule_runs

__all__ = ["plan", "check_pinned_tp", "check_pinned_pp"]


def plan(
    model: nn.Module,
    devices: int,
    *,
    device_memory: int,
    example_inputs: Optional[tuple[Any, ...]] = None,
    example_kwargs: Optional[dict[str, Any]] = None,
    batch: Optional[int] = None,
    seq: Optional[int] = None,
    devices_per_node: Optional[int] = None,
    hardware: Union[str, Hardware] = "h100",
    optimizer: str = "adamw",
    training: bool = True,
    tp: Optional[int] = None,
    pp: Optional[int] = None,
    reserve: Union[int, float, None] = None,
    tp_overlap: Optional[str] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> ParallelPlan:
    """Choose how to run ``model`` on ``devices`` devices: fastest predicted step that fits.

    Args:
        model: a Hugging Face decoder (``transformers`` model, any device, ``meta`` included);
            never mutated.
        devices: devices in the job, ``pp x tp x dp``.
        device_memory: bytes each device may use (e.g. ``80 * 2**30``).
        example_inputs: inputs the analysis captures the model with; default token ids
            ``(1, 128)`` (their size does not change a parameter's shard).
        example_kwargs: keyword inputs, likewise.
        batch: global batch, sequences per optimizer step; default the first example
            input's dim 0.
        seq: tokens per sequence; default the first example input's dim 1.
        devices_per_node: devices one NVLink domain holds; ``tp`` stays inside it.
            Default: the hardware's (8).
        hardware: a name of :data:`fxtp.planner.HARDWARE` (``"a100"``, ``"h100"``, ``"h200"``)
            or a :class:`fxtp.planner.Hardware`.
        optimizer: ``"adamw"``, ``"adam"`` or ``"sgd"`` (its state, NOTE: [mixed precision]).
        training: price a training step (else a forward with a KV cache).
        tp: pin the tensor-parallel degree (e.g. torchtitan's tp 8 for Llama-3-70B on 64
            devices): the search then chooses only ``dp = devices / tp`` (no pipelining unless
            ``pp`` is pinned too: ``dp = devices / (pp x tp)``), sequence
            parallelism, checkpointing and micro-batches. The other degrees stay in
            ``alternatives`` with their figures, so the plan says what the pin costs.
        pp: pin the pipeline degree (e.g. torchtitan's pp 8 for Llama-3.1-405B on 512 devices;
            1: no pipelining), alone or with ``tp``; the others stay in ``alternatives`` likewise.
            The pipelined rows price torch's schedules (NOTE: [pipeline costs] in
            fxtp/planner/pipeline_costs.py); ``fxtp.pipeline`` runs a chosen one.
        reserve: memory kept for the runtime (CUDA context, NCCL's buffers, fragmentation;
            NOTE: [runtime reserve] in fxtp/planner/hardware.py): bytes (an int), or a share
            of ``device_memory`` (a float in ``[0, 1)``); default 10%. A configuration fits
            when its predicted peak fits ``device_memory`` less the reserve.
        tp_overlap: price tensor-parallel collectives as hidden behind the block's matmuls
            (under sequence parallelism), as the named runtime runs them: ``"async-tp"``
            (torch's async TP) or ``"megatron"`` (Megatron-LM ``--tp-comm-overlap``); NOTE:
            [tp overlap] in fxtp/planner/costs.py. Default ``None``: not overlapped.
        progress: called with each stage's name as it starts (the CLI prints them).

    Returns:
        A :class:`ParallelPlan`; ``fits`` False (with the smallest configuration's memory)
        when nothing fits ``device_memory`` less the reserve. ``close_calls`` says when the
        runner-up is within the model's measured error or the winner flips within an
        assumption's plausible range (NOTE: [close calls] in fxtp/planner/close_call.py).

    Raises:
        FxtpConfigError: bad arguments, a model the cost model does not cover; a pinned
            ``tp`` that does not divide ``devices`` or whose ``dp`` does not divide ``batch``; a
            pinned ``pp`` as :func:`check_pinned_pp` refuses it.
        FxtpInputError: no batch/seq given and no example input to read them from.
    """
    start = time.perf_counter()
    say = progress or (lambda stage: None)
    hw = resolve_hardware(hardware)
    per_node = _positive("devices_per_node", devices_per_node or hw.devices_per_node)
    devices = _positive("devices", devices)
    memory = _positive("device_memory", device_memory)
    held = reserve_bytes(reserve, memory)
    budget = memory - held  # what the priced tensors may use (NOTE: [runtime reserve])
    if tp_overlap is not None and tp_overlap not in TP_OVERLAP:
        raise FxtpConfigError(f"tp_overlap must be None or one of {', '.join(TP_OVERLAP)}, got {tp_overlap!r}")
    if optimizer not in OPTIMIZER_BYTES:
        raise FxtpConfigError(f"optimizer must be one of {', '.join(OPTIMIZER_BYTES)}, got {optimizer!r}")
    blocks = repeated_blocks(model)
    if blocks is None:
        raise FxtpConfigError(
            f"fxtp.plan found no stack of blocks in {type(model).__name__} (an nn.ModuleList of "
            "config.num_hidden_layers blocks): it plans Hugging Face decoder models. fix: pass a transformers model "
            "or its config.json"
        )
    shape = TransformerShape.of(model, blocks.fqn)
    args, kwargs = _inputs(model, example_inputs, example_kwargs)
    batch, seq = _workload_sizes(args, kwargs, batch, seq)
    work = Workload(batch, seq, training, optimizer, per_node, activation_bytes=hw.compute_bytes, gather_bytes=hw.compute_bytes,
                    tp_overlap=tp_overlap)
    inside = [t for t in range(1, per_node + 1) if per_node % t == 0 and devices % t == 0]
    across = [t for t in range(per_node + 1, devices + 1) if devices % t == 0][:1]
    pin_pp = None if pp is None else check_pinned_pp(pp, devices, blocks.count, tp, batch if training else None)
    pin = None if tp is None else check_pinned_tp(tp, devices, batch if training and pin_pp in (None, 1) else None)
    across += [] if pin is None or pin in inside + across else [pin]
    say("analyze")
    moe = MoeShape.of(model)
    params = parameter_shapes(model, tuple(inside + across), args, kwargs, expert_parallel=moe is not None)
    notes: tuple[str, ...] = ()
    if moe is not None:  # NOTE: [experts in the cost model]
        params, notes = _experts_plans(moe, params, inside + across, devices, work, shape, blocks.fqn)
    say("search")
    estimates, skipped = [], []
    # pipelined where fxtp.pipeline cuts stages: a dense decoder's model.layers, analyzed by block
    pipelined = training and moe is None and blocks.fqn == "model.layers" and params[1].n_blocks > 0
    pps = [1] + [p for p in range(2, blocks.count + 1) if devices % p == 0] if pipelined else [1]
    if pin_pp is not None and pin_pp not in pps:
        why = ("a mixture-of-experts model" if moe is not None else f"its blocks are {blocks.fqn}, not model.layers"
               if blocks.fqn != "model.layers" else f"its {blocks.count} blocks are analyzed whole (3 or more are priced per block)")
        raise FxtpConfigError(f"pp={pin_pp}: fxtp.plan pipelines dense Hugging Face decoders' model.layers, and {type(model).__name__} "
                              f"is not one it can cut: {why}. fix: drop pp=")

    def rows(pp: int, tp: int, hw: Hardware) -> list[Estimate]:
        dp = devices // (pp * tp)
        found = [_best_micro_batch(Choice(tp, dp, sp, ac, 0, 0, pp, schedule, v), shape, params[tp], hw, work, budget)
                 for sp in ((False, True) if tp > 1 and seq % tp == 0 else (False,)) for ac in (AC_POLICIES if training else (None,))
                 for schedule, v in (SCHEDULES if pp > 1 else ((None, 1),))]
        return [e for e in found if e is not None]

    for pp_ in pps:
        for tp_ in (inside + across if pp_ == 1 else [t for t in inside if (devices // pp_) % t == 0]):
            dp = devices // (pp_ * tp_)
            where = {"tp": tp_, "dp": dp, **({"pp": pp_} if pp_ > 1 else {})}
            if training and batch % dp:
                skipped.append({**where, "reason": f"global batch {batch} is not divisible by dp {dp}"})
                continue
            found = rows(pp_, tp_, hw)
            if not found:
                skipped.append({**where, "reason": f"a dp rank's {batch // dp} sequences are fewer than pp {pp_} micro-batches"})
            estimates += found
    if not estimates:
        raise FxtpConfigError(f"no mesh of {devices} devices divides the global batch {batch}: " + "; ".join(s["reason"] for s in skipped))
    only_pp = 1 if pin is not None and pin_pp is None else pin_pp  # a pinned tp alone is a tp x dp layout
    candidates = [e for e in estimates if (e.choice.tp == pin if pin is not None else e.choice.tp <= per_node)
                  and (only_pp is None or e.choice.pp == only_pp)]
    if not candidates:
        raise FxtpConfigError(f"pp={pin_pp} leaves no mesh of {devices} devices that runs: " + "; ".join(s["reason"] for s in skipped))
    fitting = [e for e in candidates if e.peak <= budget]
    best = min(fitting, key=_rank) if fitting else min(candidates, key=lambda e: (e.peak, _rank(e)))
    units = Units.of(estimates)
    close: tuple[str, ...] = ()
    others: dict[Any, float] = {}  # each other degree's fastest row: by tp at pp 1, by pp (its fastest tp) above
    for e in sorted((e for e in estimates if e.peak <= budget and e.choice.tp <= per_node), key=_rank):
        key = _key(e)
        if key != _key(best) and (e.choice.pp == 1 or all(k[0] != e.choice.pp for k in others if isinstance(k, tuple))):
            others.setdefault(key, e.step["total"])
    if pin_pp == 1:  # the tp x dp layouts are the choice (``--measure`` pins pp 1): their close calls
        others = {key: s for key, s in others.items() if not isinstance(key, tuple)}
    if pin is None and pin_pp in (None, 1) and others:

        def price(moved: Hardware, key: Any) -> Optional[float]:
            fit = [e.step["total"] for e in rows(*(key if isinstance(key, tuple) else (1, key)), moved) if e.peak <= budget]
            return min(fit) if fit else None

        close = close_calls(hw, price, _key(best), best.step["total"], others)
    alternatives = tuple(Alternative.of(e, _why(e, best, budget, per_node, units, pin, only_pp))
                         for e in sorted(estimates, key=_rank) if e is not best)
    return ParallelPlan(
        model=type(model).__name__,
        devices=devices,
        devices_per_node=per_node,
        hardware=hw,
        device_memory=memory,
        reserve=held,
        batch=batch,
        seq=seq,
        training=training,
        optimizer=optimizer,
        chosen=best,
        fits=bool(fitting),
        alternatives=alternatives,
        skipped=tuple(skipped),
        tp_param_bytes={tp: p.bytes() for tp, p in params.items()},
        analyzed_blocks=params[1].analyzed_blocks,
        n_blocks=blocks.count,
        block_kinds=max(blocks.kinds, default=0) + 1,
        solve_s=time.perf_counter() - start,
        notes=notes,
        layer_styles=dict(params[best.choice.tp].styles),
        pinned_tp=pin,
        pinned_pp=pin_pp,
        close_calls=close,
        tp_overlap=tp_overlap,
    )


def _experts_plans(moe: MoeShape, params: dict[int, ParamShapes], tps: list[int], devices: int, work: Workload,
                   shape: TransformerShape, blocks_fqn: str) -> tuple[dict[int, ParamShapes], tuple[str, ...]]:
    """Each degree's parameters under the experts' plan :func:`choose_experts` picks, and its
    reasons. Where a few blocks were analyzed for many, the MoE layers beyond them (in a stack
    of dense and MoE blocks, NOTE: [block kinds], only those) add their plan's bytes to
    ``outside_sent`` (the analysis counted the analyzed ones')."""
    out, notes = {}, []
    for tp in tps:
        payload = max(1, work.batch // (devices // tp)) * work.seq * shape.hidden * work.activation_bytes
        ep = params.get(-tp)
        choice = choose_experts(moe, tp, payload, params[tp].bytes(), ep.bytes() if ep is not None else None, work.training)
        chosen = ep if choice.expert and ep is not None else params[tp]
        extra = sum(1 for name in moe.modules if _block_of(name, blocks_fqn) >= chosen.analyzed_blocks) if chosen.n_blocks else 0
        if extra > 0 and tp > 1:
            sent = moe.sent(tp, choice.expert)
            outside = tuple(max(0.0, o + extra * s) for o, s in zip(chosen.outside_sent, sent))
            chosen = dataclasses.replace(chosen, outside_sent=outside)
        out[tp] = chosen
        if tp > 1:
            notes.append(choice.reason)
    return out, tuple(notes)


def _block_of(fqn: str, blocks_fqn: str) -> int:
    """The index of the block holding module ``fqn`` (-1 outside the stack)."""
    head = f"{blocks_fqn}." if blocks_fqn else ""
    index = fqn[len(head):].partition(".")[0] if fqn.startswith(head) else ""
    return int(index) if index.isdigit() else -1


def _rank(e: Estimate) -> tuple:
    """Faster first; then less memory; then the smaller degrees."""
    return (round(e.step["total"], 9), e.peak, e.choice.tp, e.choice.pp)


def _key(e: Estimate) -> Any:
    """A row's layout for the close calls: its ``tp`` at pp 1, else ``(pp, tp)``."""
    return e.choice.tp if e.choice.pp == 1 else (e.choice.pp, e.choice.tp)


def _why(e: Estimate, best: Estimate, budget: int, per_node: int, units: Units, pinned: Optional[int] = None,
         pinned_pp: Optional[int] = None) -> str:
    """Why ``e`` is not the plan, its figures in the plan table's ``units`` (one per column)."""
    c = e.choice
    pins = [f"pp {pinned_pp}"] * (pinned_pp is not None and c.pp != pinned_pp) + [f"tp {pinned}"] * (pinned is not None and c.tp != pinned)
    if pins:
        fits = "fits" if e.peak <= budget else f"needs {units.size(e.peak)}"
        what = f"tp {pinned} without pipelining" if pinned_pp == 1 != c.pp and pinned is not None else " x ".join(pins)
        return f"not the pinned {what}: {fits}, {units.time(e.step['total'])}"
    if c.tp > per_node:
        return f"tp {c.tp} crosses nodes ({per_node} devices per node)"
    if e.peak > budget:
        return f"needs {units.size(e.peak)}"
    if e.step["total"] > best.step["total"]:
        bubble = f" (bubble {units.time(e.step['bubble'])})" if c.pp > 1 else ""
        return f"slower: {units.time(e.step['total'])} vs {units.time(best.step['total'])}{bubble}"
    return f"as fast, but {units.size(e.peak)} vs {units.size(best.peak)}"


def _best_micro_batch(c: Choice, shape, params, hw, work: Workload, budget: int) -> Optional[Estimate]:
    """The fastest micro-batch that fits for this mesh, policy and schedule; the smallest if none
    fits; None when the schedule runs none (NOTE: [pipeline costs]). Between equally fast ones,
    the fewest micro-batches: each accumulation step costs what the model does not price
    (launches, collective latency), and with dp 1 the time ties."""
    share = work.batch // c.dp if work.training else -(-work.batch // c.dp)
    sizes = [b for b in range(1, share + 1) if share % b == 0] if work.training else [share]
    if c.pp > 1:
        sizes = [b for b in sizes if schedule_runs(c.schedule, c.pp, c.stages_per_rank, share // b, shape.layers)]
    found: list[Estimate] = []
    for b in sizes:
        price = estimate_pipeline if c.pp > 1 else estimate
        found.append(price(dataclasses.replace(c, micro_batch=b, accumulation=share // b), shape, params, hw, work))
        if c.pp > 1 and found[-1].peak > budget:  # a pipeline's peak grows with b (NOTE: [pipeline costs]): none larger fits
            break
    fitting = [e for e in found if e.peak <= budget]
    if not found:
        return None
    return min(fitting, key=lambda e: (round(e.step["total"], 9), e.choice.accumulation)) if fitting else found[0]


def check_pinned_tp(tp: Any, devices: int, batch: Optional[int]) -> int:
    """A pinned ``tp`` (``fxtp.plan(..., tp=)``) checked against ``devices`` and, in training,
    the global ``batch`` (``None``: not checked); returns it.

    Raises:
        FxtpConfigError: ``tp`` is not an int >= 1, is more than ``devices`` or does not divide
            them, or leaves a ``dp`` that does not divide ``batch``.
    """
    tp = _positive("tp", tp)
    if tp > devices:
        raise FxtpConfigError(f"tp={tp} is more than the {devices} devices. fix: pin at most {devices}, or plan more devices")
    if devices % tp:
        divisors = ", ".join(str(t) for t in range(1, devices + 1) if devices % t == 0)
        raise FxtpConfigError(f"tp={tp} does not divide the {devices} devices. fix: pin one of {divisors}")
    if batch is not None and batch % (devices // tp):
        raise FxtpConfigError(f"tp={tp} leaves dp {devices // tp}, which does not divide the global batch {batch}. "
                              f"fix: a batch that is a multiple of {devices // tp}, or another tp")
    return tp


def check_pinned_pp(pp: Any, devices: int, blocks: int, tp: Any, batch: Optional[int]) -> int:
    """A pinned ``pp`` (``fxtp.plan(..., pp=)``) checked against ``devices``, the model's
    ``blocks``, a pinned ``tp`` (``None``: not pinned) and, in training, the global ``batch``
    (``None``: not checked); returns it.

    Raises:
        FxtpConfigError: ``pp`` is not an int >= 1, does not divide ``devices``, is more than the
            blocks, is above 1 for inference, or leaves with ``tp`` a ``dp`` that does not divide
            ``batch``.
    """
    pp = _positive("pp", pp)
    if devices % pp:
        divisors = ", ".join(str(p) for p in range(1, min(devices, blocks) + 1) if devices % p == 0)
        raise FxtpConfigError(f"pp={pp} does not divide the {devices} devices. fix: pin one of {divisors}")
    if pp > blocks:
        raise FxtpConfigError(f"pp={pp} is more than the model's {blocks} blocks. fix: pin at most {blocks}")
    if pp > 1 and batch is None:
        raise FxtpConfigError(f"pp={pp}: fxtp.plan pipelines training steps only. fix: pp=1 or training=True")
    if tp is not None and (devices // pp) % _positive("tp", tp):
        raise FxtpConfigError(f"tp={tp} does not divide the {devices // pp} devices of a pipeline stage (pp={pp}). fix: another tp or pp")
    if tp is not None and batch is not None and batch % (devices // (pp * tp)):
        dp = devices // (pp * tp)
        raise FxtpConfigError(f"pp={pp} x tp={tp} leaves dp {dp}, which does not divide the global batch {batch}. fix: a batch "
                              f"that is a multiple of {dp}, or other degrees")
    return pp


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FxtpConfigError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _inputs(model: nn.Module, args: Any, kwargs: Any) -> tuple[tuple, dict]:
    """The example inputs, by default a Hugging Face model's token ids (on its device); with
    ``use_cache=False`` when the config caches (a KV cache is not a tensor output: the
    analysis prices the training graph, the cache is priced by formula)."""
    if args is None and not kwargs:
        from fxtp.capture.hf_config import example_inputs

        args, kwargs = example_inputs(model)
        device = next(model.parameters()).device  # the example's are on meta
        args = tuple(torch.zeros_like(a, device=device) for a in args)
        kwargs = {k: torch.zeros_like(v, device=device) for k, v in kwargs.items()}
    args = (args,) if not isinstance(args, (tuple, list)) else tuple(args)
    kwargs = dict(kwargs or {})
    if getattr(getattr(model, "config", None), "use_cache", False) and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


def _workload_sizes(args: tuple, kwargs: dict, batch: Optional[int], seq: Optional[int]) -> tuple[int, int]:
    first = next(iter(args), None)
    if batch is None or seq is None:
        if first is None or getattr(first, "dim", lambda: 0)() < 2:
            raise FxtpInputError("fxtp.plan needs batch= and seq= (or example token ids of shape (batch, seq))")
        batch = first.shape[0] if batch is None else batch
        seq = first.shape[1] if seq is None else seq
    return _positive("batch", int(batch)), _positive("seq", int(seq))
