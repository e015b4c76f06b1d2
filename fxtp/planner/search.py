"""``fxtp.plan``: the mesh, sequence parallelism, checkpointing and micro-batches, by predicted
step time under a memory budget.

The search is exhaustive and small: ``tp`` over the divisors of ``devices_per_node`` that
divide ``devices`` (plus the first degree that would cross nodes, shown rejected), ``dp =
devices / tp`` with FSDP2, sequence parallelism on or off, checkpointing ``None``,
``"selective"`` or ``"blocks"``, and micro-batches over the divisors of a dp rank's share of the
global batch. Each is priced by :func:`fxtp.planner.costs.estimate`; the parameters come from
fxtp's own analysis (NOTE: [repeated blocks]), the rest from the config
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

__all__ = ["plan", "check_pinned_tp"]


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
    reserve: Union[int, float, None] = None,
    tp_overlap: Optional[str] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> ParallelPlan:
    """Choose how to run ``model`` on ``devices`` devices: fastest predicted step that fits.

    Args:
        model: a Hugging Face decoder (``transformers`` model, any device, ``meta`` included);
            never mutated.
        devices: devices in the job, ``tp x dp``.
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
            devices): the search then chooses only ``dp = devices / tp``, sequence
            parallelism, checkpointing and micro-batches. The other degrees stay in
            ``alternatives`` with their figures, so the plan says what the pin costs.
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
            ``tp`` that does not divide ``devices`` or whose ``dp`` does not divide ``batch``.
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
    pin = None if tp is None else check_pinned_tp(tp, devices, batch if training else None)
    across += [] if pin is None or pin in inside + across else [pin]
    say("analyze")
    moe = MoeShape.of(model)
    params = parameter_shapes(model, tuple(inside + across), args, kwargs, expert_parallel=moe is not None)
    notes: tuple[str, ...] = ()
    if moe is not None:  # NOTE: [experts in the cost model]
        params, notes = _experts_plans(moe, params, inside + across, devices, work, shape, blocks.fqn)
    say("search")
    estimates, skipped = [], []

    def rows(tp: int, hw: Hardware) -> list[Estimate]:
        dp = devices // tp
        return [_best_micro_batch(tp, dp, sp, ac, shape, params[tp], hw, work, budget)
                for sp in ((False, True) if tp > 1 and seq % tp == 0 else (False,)) for ac in (AC_POLICIES if training else (None,))]

    for tp in inside + across:
        dp = devices // tp
        if training and batch % dp:
            skipped.append({"tp": tp, "dp": dp, "reason": f"global batch {batch} is not divisible by dp {dp}"})
            continue
        estimates += rows(tp, hw)
    if not estimates:
        raise FxtpConfigError(f"no mesh of {devices} devices divides the global batch {batch}: " + "; ".join(s["reason"] for s in skipped))
    candidates = [e for e in estimates if (e.choice.tp == pin if pin is not None else e.choice.tp <= per_node)]
    fitting = [e for e in candidates if e.peak <= budget]
    best = min(fitting, key=_rank) if fitting else min(candidates, key=lambda e: (e.peak, _rank(e)))
    units = Units.of(estimates)
    close: tuple[str, ...] = ()
    others: dict[int, float] = {}
    for e in fitting:  # each other degree's fastest row
        if e.choice.tp != best.choice.tp and e.choice.tp <= per_node:
            others[e.choice.tp] = min(others.get(e.choice.tp, e.step["total"]), e.step["total"])
    if pin is None and others:

        def price(moved: Hardware, tp: int) -> Optional[float]:
            fit = [e.step["total"] for e in rows(tp, moved) if e.peak <= budget]
            return min(fit) if fit else None

        close = close_calls(hw, price, best.choice.tp, best.step["total"], others)
    alternatives = tuple(Alternative.of(e, _why(e, best, budget, per_node, units, pin)) for e in sorted(estimates, key=_rank) if e is not best)
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
    """Faster first; then less memory; then the smaller degree."""
    return (round(e.step["total"], 9), e.peak, e.choice.tp)


def _why(e: Estimate, best: Estimate, budget: int, per_node: int, units: Units, pinned: Optional[int] = None) -> str:
    """Why ``e`` is not the plan, its figures in the plan table's ``units`` (one per column)."""
    c = e.choice
    if pinned is not None and c.tp != pinned:
        fits = "fits" if e.peak <= budget else f"needs {units.size(e.peak)}"
        return f"not the pinned tp {pinned}: {fits}, {units.time(e.step['total'])}"
    if c.tp > per_node:
        return f"tp {c.tp} crosses nodes ({per_node} devices per node)"
    if e.peak > budget:
        return f"needs {units.size(e.peak)}"
    if e.step["total"] > best.step["total"]:
        return f"slower: {units.time(e.step['total'])} vs {units.time(best.step['total'])}"
    return f"as fast, but {units.size(e.peak)} vs {units.size(best.peak)}"


def _best_micro_batch(tp, dp, sp, ac, shape, params, hw, work: Workload, budget: int) -> Estimate:
    """The fastest micro-batch that fits for this mesh and policy; the smallest if none fits.
    Between equally fast ones, the fewest micro-batches: each accumulation step costs what the
    model does not price (launches, collective latency), and with dp 1 the time ties."""
    share = work.batch // dp if work.training else -(-work.batch // dp)
    sizes = [b for b in range(1, share + 1) if share % b == 0] if work.training else [share]
    found = [estimate(Choice(tp, dp, sp, ac, b, share // b), shape, params, hw, work) for b in sizes]
    fitting = [e for e in found if e.peak <= budget]
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
