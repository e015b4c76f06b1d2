"""``fxtp.planner.measure`` / ``fxtp plan --measure``: the plan's predictions against a run on the
local ranks, term by term, and the plan made again with the measured figures.

NOTE: [predicted against measured]
On ``devices`` local ranks (spawned, as :func:`fxtp.local_ranks.spawn_ranks` starts
them), with a calibrated :class:`~fxtp.planner.hardware.Hardware` (NOTE: [calibration] in
fxtp/planner/calibration.py) unless one is given:

1. ``fxtp.plan`` plans the model; for each tensor-parallel degree its best row (the plan's
   choice, or that degree's fastest configuration that fits) is run: ``fxtp.compile`` on the
   mesh's ``tp`` group with the row's sequence parallelism and checkpointing, then FSDP2's
   ``fully_shard`` on each block and on the root over the ``dp`` group, as torchtitan wraps
   them (NOTE: [FSDP2 units inside a ParallelModule] in fxtp/runtime/fsdp.py); the row's
   micro-batches of random token ids, the model's own loss (``labels=``: fxtp's vocab-parallel cross
   entropy, as the plan prices it), ``backward`` and the optimizer's step.
2. The calibration runs ``calibrations`` times first; the one whose prices of every tp x dp
   layout (their geometric mean) are the median (of two, the higher) is kept whole
   (:func:`~fxtp.planner.hardware.pooled`), and the plan made with it is the one printed: its
   rows are the ones run, priced as they are compared. A calibration's figures are coupled
   (FSDP2's dp entries are its in-model seconds less its own host figures' pricing; its op
   figures are scaled to its own GEMM rate): a median per figure broke those sums; the median
   of their programs' seconds printed the cheapest price (docs/plan_command.md, 2026-12-07).
   Each calibration's price of each row is printed beside where the run fell: the
   host's own spread, often wider here than the 15% bound. Calibrations run between the rounds
   (tried again 2026-12-07: no gain seen in 4 runs) print a plan whose rows are not all the ones run.
   Step time: the median over ``steps`` steps (9: a median of 3 moved up to 12% between groups
   of 3 steps, 2026-12-07) of the slowest rank's seconds, each after a barrier; the layouts take
   turns, a step each a round, each timed step after an untimed one of its own layout, as in a
   training loop (a hidden-128 Llama's tp 1 step: 106 ms after another's, 94 ms after its own).
3. Per term, from one more step under ``torch.profiler`` (CPU op times on the ranks' own
   thread), as shares of that step's seconds applied to the median step (a step the host's
   load slows as a whole keeps its shares): tensor-parallel communication is the union of
   fxtp's collectives' intervals (``_c10d_functional::*`` ops, ``wait_tensor`` included: fxtp
   issues its collectives through them, fxtp/core/collectives.py); FSDP communication is the
   union of FSDP2's own ``record_function`` ranges (``FSDP::*``: its hooks, copy-in and
   copy-out and its collectives), what the plan prices as FSDP2's (its collectives and its
   host work, NOTE: [host time] in fxtp/planner/host.py). Both are time the computing thread
   spends in them, so exposed time, and each includes waiting for a slower peer. Compute is
   the rest. Each share is the mean over the ranks.
4. Peak memory, from one more step: what the step starts from plus glibc's heap in use
   (``mallinfo2``: arena and mmap'd blocks, which hold torch's CPU tensors), sampled every 0.2
   ms on a thread, the most seen above the step's entry; the largest rank's. glibc's counter,
   not fxtp's (``shared/tools/heap.py``'s few lines, kept in fxtp/runtime/memory.py). What the
   step starts from is the storage bytes of the parameters, buffers and optimizer state
   (torch's, after a warm-up step): the heap there also holds the compiled program's Python
   objects, which a GPU keeps in host memory, and the layout's process groups, which the plan's
   runtime reserve covers (NOTE: [runtime reserve] in fxtp/planner/hardware.py). On GPUs,
   ``torch.cuda.max_memory_allocated`` above the allocated bytes before the layout was built.
5. The measured figures make a second ``Hardware``: each degree's rate scaled by predicted over
   measured compute (its host seconds, NOTE: [host time], kept), each collective of a tp group
   of ``n`` ranks (sequence parallelism's too) by the tp ``n`` layout's measured over predicted
   tp time, of a dp group by the dp ``n`` layout's FSDP time, apart by role (``"tp:all_gather"``:
   dp 2 x tp 2's groups both have 2 ranks), each less the waits priced in it (NOTE: [collective
   wait] in fxtp/planner/comm.py); ``fxtp.plan`` runs again with it: is the choice the same?
6. Each pair of degrees measured in the other order than predicted gets a sentence: a close
   call where they were priced within the model's measured error of each other, the plan's
   close-call threshold, else a miss (NOTE: [close calls] in fxtp/planner/close_call.py).

On CPU ranks FSDP2 has no streams to overlap on (NOTE: [calibration]), so the run cannot show
NOTE: [fsdp overlap]'s hiding of FSDP communication behind compute, and the calibrated
Hardware prices it as exposed; on GPUs the overlap term is the one priced.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch import nn

from fxtp.core.errors import FxtpConfigError
from fxtp.local_ranks import FSDP_RANGES, FXTP_COLLECTIVES, profiled, slowest, spawn_ranks, sync
from fxtp.planner.calibration import calibrate_on_ranks
from fxtp.planner.close_call import swapped
from fxtp.planner.costs import Choice, Estimate
from fxtp.planner.hardware import Hardware, pooled
from fxtp.planner.parallel_plan import ParallelPlan, fmt_size, fmt_time
from fxtp.planner.params import repeated_blocks
from fxtp.runtime.memory import Peak, in_use, storage_bytes

__all__ = ["measure", "measure_on_ranks", "Measurement", "TERMS", "unreproduced"]

# the step's terms, as Estimate.step names them, and the measured ones' names
TERMS = ("total", "compute", "tp_comm", "fsdp_exposed")


@dataclass(frozen=True)
class Measurement:
    """A plan's rows, predicted and measured (NOTE: [predicted against measured]).

    Attributes:
        plan: ``fxtp.plan``'s plan with ``hardware``; ``replan``: with ``measured_hardware``.
        rows: per tensor-parallel degree, ``(estimate, measured)``: the predicted
            :class:`~fxtp.planner.costs.Estimate` and ``{"total", "compute", "tp_comm",
            "fsdp_exposed"}`` seconds per step and ``"peak"`` bytes per rank, measured.
        prices: per row, each calibration's price of its step (s), where more than one ran.
        calibrate_s: seconds the ``calibrations`` took (0 when a Hardware was given); ``run_s``: the runs';
            ``wall_s``: :func:`measure`'s, all told (the ranks' start, the plans and the builds too).
    """

    plan: ParallelPlan
    replan: ParallelPlan
    hardware: Hardware
    measured_hardware: Hardware
    rows: tuple[tuple[Estimate, dict[str, float]], ...]
    steps: int
    calibrate_s: float
    run_s: float
    wall_s: float = 0.0
    calibrations: int = 1
    prices: tuple[tuple[float, ...], ...] = ()

    choice_changed = property(lambda self: self.plan.chosen.choice != self.replan.chosen.choice)

    def order(self, measured: bool) -> list[int]:
        """The degrees ``tp`` from fastest to slowest, predicted or measured."""
        return [e.choice.tp for e, m in sorted(self.rows, key=lambda r: r[1]["total"] if measured else r[0].step["total"])]

    def swapped(self) -> tuple[str, ...]:
        """Each pair of degrees measured in the other order than predicted, a close call or a miss
        (:func:`~fxtp.planner.close_call.swapped`)."""
        predicted = {e.choice.tp: e.step["total"] for e, _ in self.rows}
        return swapped(predicted, {e.choice.tp: m["total"] for e, m in self.rows})

    def to_dict(self) -> dict[str, Any]:
        return {"hardware": self.hardware.to_dict(), "measured_hardware": self.measured_hardware.to_dict(),
                "rows": [{"mesh": {"tp": e.choice.tp, "dp": e.choice.dp}, "choice": dataclasses.asdict(e.choice),
                          "predicted": {**{k: e.step[k] for k in TERMS}, "peak": e.peak, "waits": _priced_waits(e)},
                          "measured": dict(m)} for e, m in self.rows],
                "predicted_order": self.order(False), "measured_order": self.order(True), "swapped": list(self.swapped()),
                "chosen": dataclasses.asdict(self.plan.chosen.choice),
                "replanned": dataclasses.asdict(self.replan.chosen.choice), "choice_changed": self.choice_changed,
                "prices": [list(p) for p in self.prices], "steps": self.steps, "calibrate_s": self.calibrate_s, "calibrations": self.calibrations, "run_s": self.run_s, "wall_s": self.wall_s}

    def __str__(self) -> str:
        slowest = max(max(e.step["total"], m["total"]) for e, m in self.rows)
        largest = max(max(e.peak, m["peak"]) for e, m in self.rows)
        table = []
        for layout, e, m in ((_layout(e.choice), e, m) for e, m in self.rows):
            predicted = [e.step[k] for k in TERMS] + [e.peak]
            measured = [m[k] for k in TERMS] + [m["peak"]]
            table.append([layout, "predicted"] + [fmt_time(v, like=slowest) for v in predicted[:-1]] + [fmt_size(predicted[-1], like=largest)])
            table.append([layout, "measured"] + [fmt_time(v, like=slowest) for v in measured[:-1]] + [fmt_size(measured[-1], like=largest)])
            table.append([layout, "measured / predicted"] + [f"{b / a:.2f}" if a else "-" for a, b in zip(predicted, measured)])
        names = lambda order: " < ".join(f"tp {tp}" for tp in order)  # noqa: E731
        new, swaps = _layout(self.replan.chosen.choice), self.swapped()
        lines = [
            f"fxtp plan --measure: {self.plan.model} on {self.plan.devices} local ranks ({self.hardware.name}), "
            f"{self.plan.batch} x {self.plan.seq} tokens a step, median of {self.steps} steps "
            f"({self.wall_s:.1f} s in all: {_calibrated(self.calibrations, self.calibrate_s)}, ran in {self.run_s:.1f} s, the rest "
            "starting the ranks, planning and building the layouts)" if self.wall_s else
            f"(calibrated in {self.calibrate_s:.1f} s, ran in {self.run_s:.1f} s)",
            tabulate(table, headers=["layout", "", "step", "compute", "tp comm", "fsdp exposed", "peak memory"],
                     colalign=("left", "left", "right", "right", "right", "right", "right")),
            *_waits(self.rows),
            *self._spread(),
            f"fastest first: predicted {names(self.order(False))}; measured {names(self.order(True))}"
            + (" (the order differs)" if swaps else " (the same order)"),
            *swaps,
            f"re-planned with the measured figures: {new}"
            + (" (the choice changes)" if self.choice_changed else " (the choice does not change)"),
            *unreproduced(self.rows),
        ]
        return "\n".join(lines)

    def _spread(self) -> list[str]:
        """The line giving each row's prices by the calibrations, and where its run fell against them."""
        if not self.prices:
            return []
        like = max(max(p) for p in self.prices)

        fell = lambda got, low, high: "inside" if low <= got <= high else (  # noqa: E731
            f"{got / high - 1:.0%} above the highest" if got > high else f"{1 - got / low:.0%} under the lowest")
        return [f"the {len(self.prices[0])} calibrations priced a step at: " + "; ".join(
            f"{_layout(e.choice)} {fmt_time(min(p), like=like)} to {fmt_time(max(p), like=like)} "
            f"(ran {fmt_time(m['total'], like=like)}: {fell(m['total'], min(p), max(p))})" for (e, m), p in zip(self.rows, self.prices))]


def _calibrated(n: int, seconds: float) -> str:
    """How many calibrations ran and their seconds, in words (none where a Hardware was given)."""
    return f"calibrated {({1: 'once', 2: 'twice'}.get(n, f'{n} times'))} in {seconds:.1f} s" if n else "a Hardware given"


def _priced_waits(e: Estimate) -> float:
    """Seconds of ``e``'s communication priced as waiting for peers (NOTE: [collective wait])."""
    return e.step.get("tp_wait", 0.0) + e.step.get("fsdp_wait", 0.0)


def _waits(rows: tuple[tuple[Estimate, dict[str, float]], ...]) -> list[str]:
    """The line saying what of each row's predicted communication is waiting for peers on shared
    cores (NOTE: [collective wait] in fxtp/planner/comm.py); none where nothing waits (GPUs)."""
    waits = [(e, _priced_waits(e)) for e, _ in rows]
    if not any(w for _, w in waits):
        return []
    return ["of the predicted tp comm and fsdp exposed, waiting for peers on shared cores: "
            + ", ".join(f"{_layout(e.choice)} {fmt_time(w, like=max(w for _, w in waits))}" for e, w in waits)]


def unreproduced(rows: tuple[tuple[Estimate, dict[str, float]], ...]) -> list[str]:
    """The terms :func:`measured_hardware` cannot reproduce, a sentence each: it keeps the host
    seconds priced in them, and the run measured less than those (a loaded host's profile)."""
    out = []
    for e, m in rows:
        for term, got, host in (("compute", m["compute"], _host_s(e)),
                                ("fsdp exposed", m["fsdp_exposed"], e.step.get("fsdp_host", 0.0))):
            if host and got <= host:
                out.append(f"{_layout(e.choice)}: measured {term} {fmt_time(got)} is under the host seconds priced in "
                           f"it ({fmt_time(host)}): the re-plan keeps the prediction's {term}")
    return out


def _host_s(e: Estimate) -> float:
    """The host seconds priced in ``e``'s compute (NOTE: [host time]), which the measured Hardware keeps."""
    return e.step["compute"] - e.step.get("gemm", e.step["compute"])


def _layout(c: Choice) -> str:
    """``tp 2 x dp 2`` and what else the configuration sets (sequence parallelism, checkpointing,
    micro-batches)."""
    return f"tp {c.tp} x dp {c.dp}" + (", sp" if c.sequence_parallel else "") + (
        f", {c.activation_checkpointing}" if c.activation_checkpointing else "") + (
        f", micro-batch {c.micro_batch} x {c.accumulation}" if c.accumulation > 1 else "")


def measure(model: nn.Module, devices: int, *, batch: int, seq: int, device_memory: Optional[int] = None,
            hardware: Optional[Hardware] = None, optimizer: str = "adamw", steps: int = 9, calibrations: int = 3,
            timeout_s: int = 600) -> Measurement:
    """Plan ``model`` for ``devices`` local ranks, run each degree's best row on them, and compare
    (NOTE: [predicted against measured]).

    Args:
        model: a Hugging Face decoder with weights (it runs); never mutated.
        devices: local ranks to spawn (GPUs with NCCL when the host has them, else gloo CPU ranks).
        batch: global batch, sequences per step; ``seq``: tokens per sequence.
        device_memory: bytes per rank the plan may use; default the calibrated usable memory.
        hardware: the figures to predict with; default :func:`fxtp.planner.calibrate` on the same ranks.
        optimizer: ``"adamw"``, ``"adam"`` or ``"sgd"``, priced and run.
        steps: timed steps per layout, each after an untimed one (after one warm-up; two more run for
            the profile and the memory).
        calibrations: calibrations pooled into the Hardware (:func:`~fxtp.planner.hardware.pooled`; none when ``hardware``
            is given), 31-58 s each on 4 CPU ranks on two 2-core hosts here (2026-12-07).
        timeout_s: the process groups' timeout, seconds.

    Returns:
        A :class:`Measurement`: ``str()`` prints predicted and measured side by side.

    Raises:
        FxtpConfigError: as ``fxtp.plan`` and :func:`fxtp.planner.calibrate` raise; ``calibrations``
            under 1 without a ``hardware``.
    """
    _check_calibrations(calibrations, hardware)
    start = time.perf_counter()
    result = spawn_ranks(measure_on_ranks, devices, timeout_s, model, batch=batch, seq=seq, device_memory=device_memory,
                         hardware=hardware, optimizer=optimizer, steps=steps, calibrations=calibrations)
    return dataclasses.replace(result, wall_s=time.perf_counter() - start)


def measure_on_ranks(model: nn.Module, *, batch: int, seq: int, device_memory: Optional[int] = None,
                     hardware: Optional[Hardware] = None, optimizer: str = "adamw", steps: int = 9,
                     calibrations: int = 3) -> Measurement:
    """:func:`measure` on the initialized default process group (every rank calls it; each gets
    the result)."""
    from fxtp.runtime.clipping import FsdpClippingWarning

    _check_calibrations(calibrations, hardware)
    with warnings.catch_warnings():  # on every rank, about what the layouts never do: clip their gradients
        warnings.filterwarnings("ignore", category=FsdpClippingWarning)
        return _measured(model, batch=batch, seq=seq, device_memory=device_memory, hardware=hardware, optimizer=optimizer,
                         steps=steps, calibrations=calibrations)


def _measured(model: nn.Module, *, batch: int, seq: int, device_memory: Optional[int], hardware: Optional[Hardware],
              optimizer: str, steps: int, calibrations: int) -> Measurement:
    start = time.perf_counter()
    # NOTE: [predicted against measured], 2: the calibrations first, so that the plan printed is
    # the one whose rows run, priced as they are compared
    found = [hardware] if hardware is not None else [calibrate_on_ranks(model, batch=batch, seq=seq) for _ in range(calibrations)]
    calibrate_s = time.perf_counter() - start if hardware is None else 0.0
    memory = device_memory or min(h.memory_bytes for h in found)
    hw, plan, prices = pooled_plan(found, lambda h: _plan_on_rank0(model, memory, batch, seq, h, optimizer))
    start = time.perf_counter()
    _Layout(model, _rows(plan)[0].choice, seq, optimizer).close()  # the process's one-time caches, not a layout's
    layouts = [_Layout(model, e.choice, seq, optimizer) for e in _rows(plan)]
    times: list[list[float]] = [[] for _ in layouts]
    for _ in range(steps):  # rounds: each layout a step a round, against the host's drift
        for layout, seconds in zip(layouts, times):
            seconds.append(layout.timed())
    figures = []
    for layout, seconds in zip(layouts, times):
        tp_share, fsdp_share = layout.profiled()
        total = statistics.median(seconds)
        figures.append({"total": total, "compute": total * (1 - tp_share - fsdp_share), "tp_comm": total * tp_share,
                        "fsdp_exposed": total * fsdp_share, "peak": layout.peak()})
        layout.close()
    rows = tuple(zip(_rows(plan), figures))
    again = measured_hardware(hw, rows)
    return Measurement(plan, _plan_on_rank0(model, memory, batch, seq, again, optimizer), hw, again, rows, steps,
                       calibrate_s, time.perf_counter() - start, calibrations=len(found) if hardware is None else 0,
                       prices=prices)


def pooled_plan(found: list[Hardware], plan_with: Callable[[Hardware], ParallelPlan]) -> tuple[Hardware, ParallelPlan, tuple]:
    """Calibrations pooled by their prices (NOTE: [predicted against measured], 2): each one's plan
    (``plan_with``) prices every layout; the one whose prices (their geometric mean) are the
    median is kept whole (:func:`~fxtp.planner.hardware.pooled`). Returns it, its plan, and each
    of the plan's rows' layouts as each calibration priced it (none for one)."""
    if len(found) == 1:
        return found[0], plan_with(found[0]), ()
    # by layout, its fastest: each calibration's plan picks its own micro-batches (search._best_micro_batch)
    layout = lambda c: dataclasses.replace(c, micro_batch=0, accumulation=0)  # noqa: E731
    priced = [{layout(e.choice): e.step["total"] for e in sorted([p.chosen] + [a.estimate for a in p.alternatives],
                                                                 key=lambda e: -e.step["total"])} for p in map(plan_with, found)]
    hw = pooled(found, [statistics.geometric_mean([t for c, t in p.items() if c.pp == 1]) for p in priced])
    plan = plan_with(hw)
    return hw, plan, tuple(tuple(p[layout(e.choice)] for p in priced) for e in _rows(plan))


def _check_calibrations(calibrations: int, hardware: Optional[Hardware]) -> None:
    if hardware is None and (isinstance(calibrations, bool) or not isinstance(calibrations, int) or calibrations < 1):
        raise FxtpConfigError(f"fxtp.planner.measure(calibrations={calibrations!r}): it prices the rows with a calibration "
                              "of the ranks. fix: calibrations=1 or more (3 by default), or pass hardware=")


def measured_hardware(hw: Hardware, rows: tuple[tuple[Estimate, dict[str, float]], ...]) -> Hardware:
    """``hw`` with the figures the rows measured (NOTE: [predicted against measured], 5)."""
    rates = dict(hw.achieved_flops)
    tp_factor, fsdp_factor = {}, {}
    for e, m in rows:
        c = e.choice
        host = _host_s(e)  # kept as priced (NOTE: [host time])
        if m["compute"] > host:  # the rate the row's GEMMs were priced at, rescaled
            rates[c.tp] = e.rate * (e.step["compute"] - host) / (m["compute"] - host)
        # the waits for peers (NOTE: [collective wait]) are in the measured collectives' figures
        if e.step["tp_comm"] > e.step.get("tp_wait", 0.0) and m["tp_comm"] > 0:
            tp_factor[c.tp] = m["tp_comm"] / (e.step["tp_comm"] - e.step.get("tp_wait", 0.0))
        wire = e.step["fsdp_exposed"] - e.step.get("fsdp_host", 0.0) - e.step.get("fsdp_wait", 0.0)  # host work kept as priced
        if wire > 0 and m["fsdp_exposed"] > e.step.get("fsdp_host", 0.0):
            fsdp_factor[c.dp] = (m["fsdp_exposed"] - e.step.get("fsdp_host", 0.0)) / wire
    # per role: dp 2 x tp 2's two groups both have 2 ranks; each the role's figure as priced (a
    # calibration's in-model tp entries, NOTE: [collectives in the model]), which it replaces
    rescaled = [(f"{role}:{kind}", n, found[0] * f, found[1] / f) for role, factors in (("tp", tp_factor), ("dp", fsdp_factor))
                for n, f in sorted(factors.items()) for kind in ("all_reduce", "all_gather", "reduce_scatter")
                for found in [hw.collective(kind, n, role)] if found is not None]
    replaced = {(kind, n) for kind, n, _, _ in rescaled}
    collectives = [c for c in hw.collectives if (c[0], c[1]) not in replaced] + rescaled
    return dataclasses.replace(hw, name=f"{hw.name}, measured", achieved_flops=tuple(sorted(rates.items())),
                               collectives=tuple(collectives), collective_wait=())


def _plan_on_rank0(model: nn.Module, memory: int, batch: int, seq: int, hw: Hardware, optimizer: str) -> ParallelPlan:
    """``fxtp.plan`` on rank 0 (its analysis runs once), sent to every rank."""
    from fxtp.planner.search import plan

    box: list[Any] = [None]
    if dist.get_rank() == 0:
        box[0] = plan(model, dist.get_world_size(), device_memory=memory, batch=batch, seq=seq,
                      devices_per_node=dist.get_world_size(), hardware=hw, optimizer=optimizer, pp=1)  # measures tp x FSDP2
        box[0] = dataclasses.replace(box[0], pinned_by="--measure, which runs tp x FSDP2 layouts, no pipeline")
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rows(p: ParallelPlan) -> list[Estimate]:
    """Each degree's best row: the choice, and every other degree's (NOTE: [predicted against measured])."""
    return sorted([p.chosen] + [a.estimate for a in p._per_tp().values()], key=lambda e: e.choice.tp)


class _Layout:
    """One row's configuration built on this rank (NOTE: [predicted against measured], 1): its
    step, timed, profiled and its memory."""

    def __init__(self, model: nn.Module, choice: Choice, seq: int, optimizer: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        import fxtp

        c, cuda = choice, dist.get_backend() == "nccl"
        self.choice, self.device = c, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        mesh = init_device_mesh(self.device.type, (c.dp, c.tp), mesh_dim_names=("dp", "tp"))
        gc.collect()
        base = in_use(self.device)
        g = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
        # the labels are the ids (Hugging Face shifts them): the loss inside the model, as the plan prices it
        # (fxtp's vocab-parallel cross entropy, the logits gathered for the output; NOTE: [activation bytes])
        self.ids = torch.randint(0, model.config.vocab_size, (c.accumulation, c.micro_batch, seq), generator=g).to(self.device)
        self.pm = fxtp.compile(copy.deepcopy(model).to(self.device).train(), c.tp, (self.ids[0],),
                               example_kwargs={"labels": self.ids[0]},
                               group=mesh["tp"] if c.tp > 1 else None, dynamic=False,
                               sequence_parallel=c.sequence_parallel, activation_checkpointing=c.activation_checkpointing)
        if c.dp > 1:  # torchtitan's wrapping: each block, then the root
            blocks = repeated_blocks(model)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else MixedPrecisionPolicy()
            for i in range(blocks.count if blocks else 0):  # none: the root is the one unit, as the plan prices it
                fully_shard(self.pm.get_submodule(f"{blocks.fqn}.{i}" if blocks.fqn else str(i)), mesh=mesh["dp"], mp_policy=policy)
            fully_shard(self.pm, mesh=mesh["dp"], mp_policy=policy)
        self.opt = {"sgd": torch.optim.SGD}.get(optimizer, torch.optim.AdamW)(self.pm.parameters(), lr=1e-4)
        self.step()  # warm-up: lazy state, the optimizer's included
        gc.collect()
        # what the step starts from: on a GPU the allocator's bytes, the tensors the layout holds; the
        # CPU heap also holds the compiled program's Python objects (FX nodes, their fake-tensor
        # metadata and stack traces: 0.6-0.9 MB for a hidden-128 Llama), host memory on a GPU, so
        # there the tensors' own storage bytes (NOTE: [predicted against measured], 4)
        self.held = in_use(self.device) - base if cuda else storage_bytes(self.pm, self.opt)

    def step(self) -> None:
        for micro in self.ids:
            self.pm(micro, labels=micro).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed(self) -> float:
        """Seconds of one step, the slowest rank's, started after a barrier and after an untimed
        step of its own (NOTE: [predicted against measured], 2)."""
        self.step()
        dist.barrier()
        sync(self.device)
        start = time.perf_counter()
        self.step()
        sync(self.device)
        return slowest(time.perf_counter() - start)

    def profiled(self) -> tuple[float, float]:
        """The shares of one step's seconds spent in fxtp's collectives and in FSDP2's, the
        ranks' mean (NOTE: [predicted against measured], 3)."""
        shares = profiled(lambda: (self.step(), sync(self.device)), (FXTP_COLLECTIVES, FSDP_RANGES)).shares
        return shares[FXTP_COLLECTIVES], shares[FSDP_RANGES]

    def peak(self) -> int:
        """Peak bytes of a step, the largest rank's: what it starts from (``held``) plus the most in
        use above its entry (NOTE: [predicted against measured], 4)."""
        gc.collect()
        before = in_use(self.device)
        with Peak(self.device) as peak:
            self.step()
        return int(slowest(self.held + peak.peak - before))

    def close(self) -> None:
        del self.pm, self.opt
        gc.collect()
