"""``ParallelPlan``: what ``fxtp.plan`` chose, its predicted figures, and what it rejected."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from tabulate import tabulate

from fxtp.core.strategy import TensorParallelStrategy
from fxtp.planner.costs import Choice, Estimate
from fxtp.planner.hardware import CalibrationRun, GiB, Hardware, tp_fitted_on_cpu

__all__ = ["ParallelPlan", "Alternative", "Units", "fmt_size", "fmt_time"]

_MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "kv_cache", "fsdp_buffers", "total")


@dataclass(frozen=True)
class Alternative:
    """A configuration the planner priced and did not choose, and why."""

    estimate: Estimate
    reason: str

    @classmethod
    def of(cls, estimate: Estimate, reason: str) -> "Alternative":
        return cls(estimate, reason)

    def to_dict(self, budget: int) -> dict[str, Any]:
        return {**_figures(self.estimate, budget), "reason": self.reason}


def fmt_size(nbytes: float, like: Optional[float] = None) -> str:
    """Bytes in the largest binary unit that keeps ``like`` (default: ``nbytes``; pass a
    column's largest figure so the column shares one unit) >= 1, GiB at most: ``1.5 GiB``,
    ``0.25 GiB`` (a small figure in a large unit keeps two significant digits, not ``0.0``)."""
    scale = nbytes if like is None else like
    for unit, factor in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if scale >= factor:
            value = nbytes / factor
            text = f"{value:.1f}"
            if value and not float(text):
                text = f"{value:.2g}"
            return f"{text} {unit}"
    return f"{int(nbytes)} B"


@dataclass(frozen=True)
class Units:
    """One unit per column of the plan table: times in the unit of the slowest step priced,
    sizes in the unit of the largest peak (the reasons use the same)."""

    slowest: float
    largest: float

    @classmethod
    def of(cls, estimates: Sequence[Estimate]) -> "Units":
        return cls(max(e.step["total"] for e in estimates), max(e.peak for e in estimates))

    def time(self, seconds: float) -> str:
        return fmt_time(seconds, like=self.slowest)

    def size(self, nbytes: float) -> str:
        return fmt_size(nbytes, like=self.largest)


def fmt_time(seconds: float, like: Optional[float] = None) -> str:
    """Seconds in s, ms or us, the unit chosen by the magnitude of ``like`` (default: ``seconds``;
    pass a line's largest figure so the whole line shares one unit): ``27.7 us``, ``1.25 ms``,
    ``0.0043 s`` (a small part of a line in seconds keeps two significant digits, not ``0.00``)."""
    scale = seconds if like is None else like
    unit, factor, digits = ("s", 1.0, 2) if scale >= 1 or scale == 0 else ("ms", 1e3, 2) if scale >= 1e-3 else ("us", 1e6, 1)
    value = seconds * factor
    text = f"{value:.{digits}f}"
    if value and not float(text):
        text = f"{value:.2g}"
    return f"{text} {unit}"


def _ac_name(ac: Optional[str]) -> str:
    return ac or "none"


def _figures(e: Estimate, budget: int) -> dict[str, Any]:
    c: Choice = e.choice
    return {
        "mesh": {"tp": c.tp, "dp": c.dp},
        "sequence_parallel": c.sequence_parallel,
        "activation_checkpointing": c.activation_checkpointing,
        "micro_batch": c.micro_batch,
        "accumulation_steps": c.accumulation,
        "fits": e.peak <= budget,
        "memory_per_device": {k: e.memory[k] for k in _MEMORY_KEYS},
        "step_s": dict(e.step),
        "comm_bytes_per_device": dict(e.comm_bytes),
        "pipeline": {"pp": c.pp, "schedule": c.schedule, "stages_per_rank": c.stages_per_rank, "stage_blocks": list(e.stages)},
    }


def _schedule_name(c: Choice) -> str:
    return "-" if c.pp == 1 else c.schedule + (f" x{c.stages_per_rank}" if c.stages_per_rank > 1 else "")


def _layout(c: Choice) -> str:
    """``tp 2 x dp 256``, or ``pp 8 x tp 8 x dp 8`` when pipelined."""
    return (f"pp {c.pp} x " if c.pp > 1 else "") + f"tp {c.tp} x dp {c.dp}"


def _idle(run: Optional[CalibrationRun]) -> str:
    """What an idler host means for a calibration that ran as ``run``: a load average under its
    cores plus the ranks' own (4 ranks on 2 cores load it 4 themselves)."""
    if run is None:
        return ""
    return f" (a load average under {run.cores + run.ranks}: its {run.cores} cores" + (
        f" and the {run.ranks} ranks' own)" if run.ranks else ")")


def _spans(counts: Sequence[int]) -> str:
    """Blocks per stage as index ranges: ``0-14 | 15-30 | ...``."""
    out, start = [], 0
    for n in counts:
        out.append("-" if not n else str(start) if n == 1 else f"{start}-{start + n - 1}")
        start += n
    return " | ".join(out)


@dataclass(frozen=True)
class ParallelPlan:
    """The plan: a ``tp x dp`` mesh (tensor parallelism inside a node, FSDP2 over the rest), or
    a ``pp x tp x dp`` one whose ``pp`` pipeline ranks run torch's ``schedule`` (NOTE: [pipeline
    costs] in fxtp/planner/pipeline_costs.py; ``fxtp.pipeline`` runs it, docs/pipeline.md),
    sequence parallelism, an activation-checkpointing policy and micro-batches, chosen for the
    least predicted step time whose predicted peak memory per device fits ``device_memory``
    less ``reserve``, the bytes kept for the runtime (NOTE: [runtime reserve] in
    fxtp/planner/hardware.py).

    ``str(plan)`` explains the choice as a table; ``plan.to_dict()`` is JSON. Figures are
    predictions of fxtp's cost model (NOTE: [mixed precision] and NOTE: [cost model] in
    fxtp/planner/costs.py); parameter shards are fxtp's analysis of the model itself.
    """

    model: str
    devices: int
    devices_per_node: int
    hardware: Hardware
    device_memory: int
    batch: int
    seq: int
    training: bool
    optimizer: str
    chosen: Estimate
    fits: bool
    alternatives: tuple[Alternative, ...]
    skipped: tuple[dict[str, Any], ...]
    tp_param_bytes: dict[int, int]  # rank 0's parameter bytes at each tp, in the model's dtypes
    analyzed_blocks: int
    n_blocks: int
    solve_s: float
    notes: tuple[str, ...] = field(default=())
    # the chosen tp's layer styles, as plan= entries (NOTE: [repeated blocks] in fxtp/planner/params.py)
    layer_styles: Mapping[str, str] = field(default_factory=dict)
    block_kinds: int = 1  # kinds of block in the stack (NOTE: [block kinds] in fxtp/planner/params.py)
    pinned_tp: Optional[int] = None  # the caller's fxtp.plan(..., tp=): chosen is then that degree's best
    reserve: int = 0  # bytes of device_memory kept for the runtime: CUDA context, NCCL, fragmentation
    # where the runner-up is within the model's error or an assumption flips the winner (NOTE: [close calls])
    close_calls: tuple[str, ...] = ()
    tp_overlap: Optional[str] = None  # the runtime priced as overlapping tp collectives (NOTE: [tp overlap])
    pinned_pp: Optional[int] = None  # the caller's fxtp.plan(..., pp=)
    pinned_by: str = "the caller"  # who pinned them, as the plan says it

    @property
    def usable_memory(self) -> int:
        """``device_memory`` less the ``reserve``: what the priced tensors may use."""
        return self.device_memory - self.reserve

    @property
    def tp(self) -> int:
        return self.chosen.choice.tp

    @property
    def dp(self) -> int:
        return self.chosen.choice.dp

    @property
    def pp(self) -> int:
        """Pipeline ranks (1: not pipelined)."""
        return self.chosen.choice.pp

    @property
    def schedule(self) -> Optional[str]:
        """torch's schedule name for ``fxtp.pipeline(..., schedule=)`` (``None`` at pp 1)."""
        return self.chosen.choice.schedule

    @property
    def stages_per_rank(self) -> int:
        return self.chosen.choice.stages_per_rank

    @property
    def n_microbatches(self) -> int:
        """Micro-batches per step on a dp rank (``fxtp.pipeline(..., n_microbatches=)`` at pp > 1)."""
        return self.chosen.choice.accumulation

    @property
    def stage_blocks(self) -> tuple[int, ...]:
        """Blocks per pipeline stage, in stage order, as priced (empty at pp 1)."""
        return self.chosen.stages

    @property
    def sequence_parallel(self) -> bool:
        return self.chosen.choice.sequence_parallel

    @property
    def activation_checkpointing(self) -> Optional[str]:
        return self.chosen.choice.activation_checkpointing

    @property
    def micro_batch(self) -> int:
        """Sequences per micro-batch on a dp rank."""
        return self.chosen.choice.micro_batch

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (gradient accumulation)."""
        return self.chosen.choice.accumulation

    @property
    def tensor_parallel(self) -> TensorParallelStrategy:
        """What ``fxtp.compile(model, plan.tp, ..., strategy=plan)`` applies on the tp sub-mesh."""
        return TensorParallelStrategy(self.tp, self.sequence_parallel, self.activation_checkpointing, dict(self.layer_styles))

    @property
    def memory_per_device(self) -> dict[str, int]:
        return {k: self.chosen.memory[k] for k in _MEMORY_KEYS}

    @property
    def step_s(self) -> dict[str, float]:
        return dict(self.chosen.step)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable: the choice's figures (bytes, seconds), the alternatives, the inputs."""
        return {
            "model": self.model,
            "devices": self.devices,
            "devices_per_node": self.devices_per_node,
            "hardware": self.hardware.to_dict(),
            "device_memory": self.device_memory,
            "reserve": self.reserve,
            "usable_memory": self.usable_memory,
            "batch": self.batch,
            "seq": self.seq,
            "training": self.training,
            "optimizer": self.optimizer,
            **_figures(self.chosen, self.usable_memory),
            "fits": self.fits,
            "tp_param_bytes": {str(k): v for k, v in self.tp_param_bytes.items()},
            "analyzed_blocks": self.analyzed_blocks,
            "n_blocks": self.n_blocks,
            "block_kinds": self.block_kinds,
            "layer_styles": dict(self.layer_styles),
            "pinned_tp": self.pinned_tp,
            "pinned_pp": self.pinned_pp,
            "tp_overlap": self.tp_overlap,
            "close_calls": list(self.close_calls),
            "notes": list(self.notes),
            "alternatives": [a.to_dict(self.usable_memory) for a in self.alternatives],
            "skipped": [dict(s) for s in self.skipped],
            "solve_s": self.solve_s,
        }

    def __str__(self) -> str:
        c, m = self.chosen.choice, self.chosen.memory
        sp = ", sequence parallel" if c.sequence_parallel else ""
        micro = f"micro-batch {c.micro_batch}" + (f" x {c.accumulation} accumulation steps" if c.accumulation > 1 and c.pp == 1 else
                                                  f" x {c.accumulation} pipeline micro-batches" if c.pp > 1 else "")
        schedule = f", {c.schedule} ({c.stages_per_rank} stage(s) a rank)" if c.pp > 1 else ""
        pinned = [f"pp {self.pinned_pp}"] * (self.pinned_pp is not None) + [f"tp {self.pinned_tp}"] * (self.pinned_tp is not None)
        what = "training step" if self.training else "forward (KV cache)"
        lines = [
            f"fxtp plan: {self.model} on {self.devices} devices of {fmt_size(self.device_memory)} ({self.hardware.name} "
            f"figures, {self.devices_per_node} per node), "
            f"{self.batch} x {self.seq} tokens per {what}" + (f", {self.optimizer}" if self.training else ""),
            f"chosen: {_layout(c)}{sp}{schedule}, activation checkpointing: {_ac_name(c.activation_checkpointing)}, {micro}"
            + (f" ({' and '.join(p.split()[0] for p in pinned)} pinned by {self.pinned_by})" if pinned else ""),
            self._verdict(),
            *([f"calibration doubts its figures: {'; '.join(self.hardware.doubts)}. fix: calibrate again on an idler host"
               f"{_idle(self.hardware.calibration)}, or compare two calibrations"] if self.hardware.doubts else []),
            *(["calibrated without the model's weights: its tensor-parallel collectives and FSDP2's are the fit after synthetic "
               "work, which priced a hidden-128 Llama's tp 4 communication at 0.75-0.85 of its step's here and a hidden-256 "
               "Llama's FSDP2 at 0.6-0.76 (NOTE: [collectives in the model]). fix: --measure (it builds a config.json's model with random weights), or fxtp.planner.calibrate on the "
               "model with weights"] if tp_fitted_on_cpu(self.hardware) else []),
            *self._pipeline_lines(),
            *(f"close call: {line}" for line in self.close_calls),
            "memory per device: " + " + ".join(f"{k.replace('_', ' ')} {fmt_size(m[k], like=m['total'])}" for k in _MEMORY_KEYS[:-1] if m[k])
            + f" = {fmt_size(m['total'])}",
            self._step_line(),
            self._params_line(),
            self._styles_line(),
            "",
            tabulate(self._rows(), headers=["pp", "tp", "dp", "sp", "checkpointing", "micro-batch x accumulation", "schedule", "memory",
                                            "step", ""],
                     colalign=("right", "right", "right", "left", "left", "left", "left", "right", "right", "left")),
        ]
        lines += [f"skipped {'pp ' + str(x['pp']) + ' x ' if 'pp' in x else ''}tp {x['tp']}: {x['reason']}" for x in self.skipped]
        lines += [f"experts: {note}" for note in self.notes]
        lines += [f"solved in {self.solve_s:.1f} s"]
        return "\n".join(lines)

    def _per_tp(self) -> dict[int, Alternative]:
        """Each other tp's best alternative without pipelining: its fastest that fits, else its smallest."""
        return self._best_by(lambda c: c.tp if c.pp == 1 else None)

    def _per_pp(self) -> dict[int, Alternative]:
        """Each other pipeline degree's best alternative (any tp, schedule): likewise."""
        return self._best_by(lambda c: c.pp if c.pp > 1 else None)

    def _best_by(self, key: Any) -> dict[int, Alternative]:
        out: dict[int, Alternative] = {}
        mine = key(self.chosen.choice)
        for a in self.alternatives:  # fastest first
            tp, fits = key(a.estimate.choice), a.estimate.peak <= self.usable_memory
            if tp is None or tp == mine:
                continue
            held = out.get(tp)
            if held is None or (fits and held.estimate.peak > self.usable_memory) or (
                not fits and held.estimate.peak > self.usable_memory and a.estimate.peak < held.estimate.peak
            ):
                out[tp] = a
        return dict(sorted(out.items()))

    def _verdict(self) -> str:
        budget, peak = self.usable_memory, self.chosen.peak
        reserved = f" ({fmt_size(self.device_memory)} less {fmt_size(self.reserve)} reserved for the runtime)" if self.reserve else ""
        if self.fits:
            head = f"fits {fmt_size(budget)}{reserved}: uses {fmt_size(peak)} per device ({peak / budget:.1%})"
        else:
            head = f"does not fit {fmt_size(budget)}{reserved}: the smallest configuration needs {fmt_size(peak)} per device"
        others = []
        rows = [*self._per_tp().values(), *self._per_pp().values()]
        slowest = max((a.estimate.step["total"] for a in rows), default=0.0)
        for a in rows:
            e, c = a.estimate, a.estimate.choice
            name = f"pp {c.pp} x tp {c.tp}" if c.pp > 1 else f"tp {c.tp}"
            if c.tp > self.devices_per_node:
                others.append(f"{name} crosses nodes")
            elif e.peak > self.usable_memory:
                others.append(f"{name} needs {fmt_size(e.peak)}")
            else:
                others.append(f"{name} takes {fmt_time(e.step['total'], like=slowest)}")
        return head + ("; " + "; ".join(others) if others else "")

    def _step_line(self) -> str:
        """The step time and its parts, all in the unit of the total (the largest figure)."""
        s = self.chosen.step

        def t(key: str) -> str:
            return fmt_time(s[key], like=s["total"])

        hidden = f" ({t('tp_comm_hidden')} more hidden by {self.tp_overlap})" if s.get("tp_comm_hidden") else ""
        pipe = f" + stage sends {t('p2p')} + bubble {t('bubble')}" if "bubble" in s else ""
        where = " (the slowest pipeline rank's)" if "bubble" in s else ""
        return (f"step: {t('total')} = compute {t('compute')} (recompute {t('recompute')}) + tp comm {t('tp_comm')}{hidden}{pipe} "
                f"+ fsdp comm not hidden {t('fsdp_exposed')} (of {t('fsdp_comm')}){where}")

    def _pipeline_lines(self) -> list[str]:
        """The stages' blocks, the bubble and the bytes between stages (pp > 1; NOTE: [pipeline costs])."""
        c = self.chosen.choice
        if c.pp == 1:
            return []
        from fxtp.pipelining.report import bubble_fraction

        bubble, source = bubble_fraction(c.schedule, c.pp, c.accumulation, c.stages_per_rank)
        return [f"pipeline: {len(self.chosen.stages)} stages of model.layers {_spans(self.chosen.stages)} (the embedding on the first, "
                f"the head on the last; stage s on pp rank s % {c.pp}); bubble {bubble:.1%} of the pipeline's time, the step "
                f"less its FSDP communication not hidden ({source}); "
                f"sent between stages {fmt_size(self.chosen.comm_bytes['pp'])} a device per step"]

    def _params_line(self) -> str:
        counted = "block 1" if self.block_kinds == 1 else f"an analyzed block of their kind ({self.block_kinds} kinds)"
        how = (f"{self.analyzed_blocks} of {self.n_blocks} blocks analyzed, the rest counted as {counted}"
               if self.analyzed_blocks and self.analyzed_blocks < self.n_blocks else "the whole model analyzed")
        return f"parameters per tp rank ({how}): " + ", ".join(
            f"tp {tp} {fmt_size(b)}" for tp, b in sorted(self.tp_param_bytes.items())
        ) + " (model dtype; FSDP2 keeps them in fp32 over dp)"

    def _styles_line(self) -> str:
        counts = {style: list(self.layer_styles.values()).count(style) for style in ("colwise", "rowwise", "replicate", "expert")}
        return (f"layer styles at tp {self.tp} (plan= patterns, a block's layers once for all blocks): " + ", ".join(f"{n} {style}" for style, n in counts.items() if n)
                + " (plan.layer_styles; fxtp.compile(model, plan.tp, ..., strategy=plan, group=mesh['tp']) applies them)")

    def _rows(self) -> list[list[Any]]:
        """The chosen row, then each other tp's best (``to_dict()`` has every alternative). One
        unit per column, the reasons' included: the units of every configuration priced."""
        units = Units.of([self.chosen, *(a.estimate for a in self.alternatives)])

        def row(e: Estimate, verdict: str) -> list[Any]:
            c = e.choice
            return [c.pp, c.tp, c.dp, "yes" if c.sequence_parallel else "no", _ac_name(c.activation_checkpointing),
                    f"{c.micro_batch} x {c.accumulation}", _schedule_name(c), units.size(e.peak), units.time(e.step["total"]), verdict]

        others = [*self._per_tp().values(), *self._per_pp().values()]
        return [row(self.chosen, "<- chosen" if self.fits else "<- chosen: the smallest")] + [row(a.estimate, a.reason) for a in others]
