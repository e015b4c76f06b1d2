"""The report: every layer's decision and why, the communication, the memory.

``str(report)`` renders tabulate tables; ``report.to_dict()`` is JSON-serializable. Rejection
codes are stable and documented in the README.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from tabulate import tabulate
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from fxtp.capture.shapes import InputSpec, describe_inputs
from fxtp.core.placement import REPLICATE, Placement, Shard
from fxtp.explain.alternatives import alternatives_text, report_alternatives
from fxtp.explain.counts import (
    CollectiveStat,
    Note,
    collectives,
    fmt_bytes,
    grad_inputs,
    local_bytes,
    nbytes_of,
    notes,
    other_parameters,
    regions,
    sequence_comms,
)
from fxtp.explain.repeats import collapse_blocks
from passes.plan import LayerDecision, ShardingPlan

__all__ = ["Report", "CollectiveStat", "Note", "build_report", "megatron_floor", "parameter_placements", "tied_layers"]

_aten = torch.ops.aten




class Report:
    """What fxtp did to a model and why. Built by ``fxtp.compile``/``fxtp.analyze``."""

    def __init__(
        self,
        *,
        world_size: int,
        rank: int,
        frontend: str,
        attempts: tuple[tuple[str, str], ...],
        layers: tuple[LayerDecision, ...],
        notes: tuple[Note, ...],
        collectives: tuple[CollectiveStat, ...],
        param_bytes: int,
        rounds: int,
        regions: tuple[tuple[str, ...], ...] = (),
        uneven: bool = False,
        parameter_bytes: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        self.world_size = world_size
        self.rank = rank
        self.frontend = frontend
        self.attempts = attempts
        self.layers = layers
        self.notes = notes
        self.collectives = collectives
        self.param_bytes = param_bytes
        self.rounds = rounds
        self.regions = regions
        self.uneven = uneven  # some parameter is sharded unevenly: per-rank bytes differ between ranks
        # parameter FQN -> its bytes on each rank (a tied parameter once, by its first FQN)
        self.parameter_bytes: dict[str, tuple[int, ...]] = dict(parameter_bytes or {})
        self.timings: dict[str, float] = {}  # capture_s, passes_s (normalize, plan, report), rewrite_s, modes_s
        self.inputs: tuple[InputSpec, ...] = ()  # the user inputs and their dims (fxtp.capture.shapes)
        self.shape_notes: tuple[str, ...] = ()  # dims specialized by fxtp or a fallback, and why
        self.modes: dict[str, str] = {}  # mode -> how its graph was captured (NOTE: [modes])
        self.left_out: tuple[str, ...] = ()  # outputs of the model a call leaves out, and why (NOTE: [Hugging Face call defaults])
        self.generator_check = False  # a graph draws random numbers: the runtime checks the generators per call
        # layer node -> its communication where sequence parallelism changed it (NOTE: [sequence parallelism])
        self.layer_comms: dict[str, str] = {}
        self.sequence_parallel = False  # some region is sharded on tokens
        # regions recomputed in backward (fxtp.explain.recompute, NOTE: [recomputed regions])
        self.recompute: tuple[dict[str, Any], ...] = ()
        # layer name -> its alternative styles' predicted bytes (NOTE: [layer alternatives] in fxtp/explain/alternatives.py)
        self.alternatives: dict[str, list[dict[str, Any]]] = {}
        # the report of each graph captured on first use, by its shape note (sizes 0 and 1, parameter dtypes,
        # an autocast state: NOTE: [autocast graphs] in fxtp/core/autocast.py); its counts are that graph's
        self.variants: dict[str, "Report"] = {}

    @property
    def plan(self) -> dict[str, str]:
        """``{layer: style}``, valid as ``fxtp.compile(..., plan=)``."""
        return {layer.name: layer.style for layer in self.layers}

    @property
    def rejections(self) -> list[LayerDecision]:
        """Layers left replicated with a rejection code."""
        return [layer for layer in self.layers if layer.code is not None]

    @property
    def param_bytes_per_rank(self) -> int:
        """Parameter bytes on this report's rank (:attr:`rank`): its entry of :attr:`param_bytes_by_rank`."""
        return sum(per_rank[self.rank] for per_rank in self.parameter_bytes.values())

    @property
    def param_bytes_by_rank(self) -> tuple[int, ...]:
        """Parameter bytes on each rank, rank 0 first (uneven shards: the first ranks hold more,
        and with grouped kv heads a later rank may hold the most, NOTE: [grouped shards])."""
        return tuple(sum(per_rank) for per_rank in zip(*self.parameter_bytes.values())) or (0,) * self.world_size

    def count(self, phase: str, kind: str) -> int:
        """Number of collectives of ``kind`` in ``phase`` ("forward"/"backward")."""
        return sum(c.count for c in self.collectives if c.phase == phase and c.kind == kind)

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "capture": {"frontend": self.frontend, "failed": [{"frontend": f, "reason": r} for f, r in self.attempts]},
            "layers": [dataclasses.asdict(layer) | {"weight_shape": list(layer.weight_shape), "local_weight_shape": list(layer.local_weight_shape),
                                                     "alternatives": [dict(a) for a in self.alternatives.get(layer.name, ())]}
                       for layer in self.layers],
            "notes": [dataclasses.asdict(n) | {"layers": list(n.layers)} for n in self.notes],
            "collectives": [dataclasses.asdict(c) for c in self.collectives],
            "param_bytes": {"total": self.param_bytes, "per_rank": self.param_bytes_per_rank, "by_rank": list(self.param_bytes_by_rank)},
            "planning_rounds": self.rounds,
            "regions": [list(r) for r in self.regions],
            "timings": dict(self.timings),
            "inputs": [_input_dict(spec) for spec in self.inputs],
            "shape_notes": list(self.shape_notes),
            "modes": dict(self.modes),
            "left_out": list(self.left_out),
            "generator_check": self.generator_check,
            "sequence_parallel": self.sequence_parallel,
            "activation_checkpointing": [dict(r) for r in self.recompute],
        }

    def __str__(self) -> str:
        return self.to_text()

    def to_text(self, *, verbose: bool = False, all_layers: bool = True) -> str:
        """The tables and the :meth:`summary` (``verbose``: with each failed frontend's error;
        ``all_layers=False``: a run of identical repeated blocks shows its first block's rows
        and a count, ``fxtp/explain/repeats.py``)."""
        show_module = any(layer.module != layer.name for layer in self.layers)
        rows = []
        for layer in self.layers:
            reason = layer.reason
            if layer.code:
                where = layer.culprit_module if layer.culprit_module not in (None, "", layer.module) else None
                reason = f"{layer.code}: {reason}" + (f" (at {where})" if where else "") + f". fix: {layer.fix}"
            row = [layer.name, layer.module] if show_module else [layer.name]
            row += [layer.op, "x".join(map(str, layer.weight_shape)), layer.style, "x".join(map(str, layer.local_weight_shape))]
            rows.append((*row, self.layer_comms.get(layer.node) or _layer_comm(layer), reason))
        headers = ["layer", "module"] if show_module else ["layer"]
        headers += ["op", "weight", "style", "local weight", "communication", "reason"]
        widths = [None] * (len(headers) - 1) + [64]
        counts: dict[str, str] = {}  # a marker row's first cell -> its line, e.g. "x32 identical blocks: ..."
        if not all_layers:
            shown = collapse_blocks(rows, [layer.name for layer in self.layers])
            rows = []
            for line, row in shown:
                if line is not None:
                    row = (f"@{len(counts)}", *[""] * (len(headers) - 1))  # short: the column keeps its width
                    counts[row[0]] = line
                rows.append(row)
        table = tabulate(rows, headers=headers, tablefmt="simple", maxcolwidths=widths, disable_numparse=True)
        table = "\n".join(counts.get(line.split(" ", 1)[0], line) for line in table.splitlines())
        parts = [f"fxtp: layer styles for world_size {self.world_size}, rank {self.rank}", table]
        if self.notes:
            note_rows = [(n.code, n.module or "-", n.node, n.message, ", ".join(n.layers)) for n in self.notes]
            parts.append(tabulate(note_rows, headers=("code", "module", "node", "why", "layers"), tablefmt="simple", maxcolwidths=[None, None, 50, 50, 40]))
        parts.append(self.summary(verbose=verbose))
        if verbose and (alternatives := alternatives_text(self.layers, self.alternatives)):
            parts.append(alternatives)
        return "\n\n".join(parts)

    def summary(self, *, verbose: bool = False) -> str:
        """Capture, collectives, regions and parameter bytes, one line each. A frontend that
        failed before the one used is the usual fallback (Hugging Face models do not
        symbolic_trace), not a problem: named in one plain line; ``verbose`` adds its error."""
        capture = f"capture: {self.frontend}"
        if self.attempts:
            failed = " and ".join(f for f, _ in self.attempts)
            why = "".join(f"; {f} failed: {r}" for f, r in self.attempts) if verbose else "; why: --verbose, report.attempts"
            capture += f" ({failed} could not capture the model, {self.frontend} could: nothing to fix{why})"
        lines = [capture]
        lines += describe_inputs(self.inputs, notes=bool(self.shape_notes))
        lines += [f"  {note}" for note in self.shape_notes]
        lines += [f"outputs: {line}" for line in self.left_out]
        for phase in ("forward", "backward"):
            stats = [c for c in self.collectives if c.phase == phase and c.count]
            text = ", ".join(f"{c.count} {c.kind} ({fmt_bytes(c.bytes)})" for c in stats) or "none"
            lines.append(f"collectives per {phase}: {text}")
        if self.generator_check and self.world_size > 1:
            lines.append(
                "generator check: before each call of a graph that draws random numbers, 1 all_reduce of 16 bytes "
                "(outside the graph's collectives above) checks that the ranks' generators agree (NOTE: [dropout across ranks])"
            )
        if self.sequence_parallel:
            lines.append(
                "sequence parallelism: the values between a rowwise layer and the next colwise one are sharded on their "
                "tokens (reduce_scatter / all_gather instead of all_reduce); token counts must divide world_size"
            )
        if self.recompute:
            names = ", ".join(r["name"] + (" (selective)" if r["selective"] else "") for r in self.recompute)
            lines.append(
                f"activation checkpointing: {len(self.recompute)} regions recomputed in backward, their forward collectives "
                f"counted in the backward's above: {names}"
            )
        if self.regions:
            lines.append(f"tensor-parallel regions: {len(self.regions)} (sharded stretches between replicated values)")
        frac = self.param_bytes_per_rank / self.param_bytes if self.param_bytes else 1.0
        which = f" on rank {self.rank} (uneven shards: rank 0 holds the most)" if self.uneven else ""
        lines.append(
            f"parameter bytes per rank: {fmt_bytes(self.param_bytes_per_rank)} of {fmt_bytes(self.param_bytes)} ({frac:.1%}){which}"
        )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<fxtp.Report world_size={self.world_size} layers={len(self.layers)} frontend={self.frontend}>"


def parameter_placements(program: ExportedProgram, plan: ShardingPlan) -> dict[str, Placement]:
    """``{parameter FQN: placement}``. Export may give a tied parameter one placeholder per FQN
    and use only one of them: every FQN of one tensor takes the placement of the placeholder
    that is sharded (the others are ``Replicate``)."""
    specs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.PARAMETER]
    sharded = {id(program.state_dict[s.target]): plan.params[s.arg.name] for s in specs if s.arg.name in plan.params}
    return {s.target: sharded.get(id(program.state_dict[s.target]), REPLICATE) for s in specs}


def megatron_floor(report: dict[str, Any], n_blocks: int, input_grad: bool = True) -> tuple[dict[str, int], dict[str, int]]:
    """The collectives Megatron-LM's own model needs for the layers of ``report``
    (``Report.to_dict()``): per forward and backward, ``{kind: count}``.

    2 all_reduce per transformer block each way (Shoeybi et al. 2019, section 3), plus one
    all_reduce after each vocab-parallel embedding (forward) and, per colwise output head, the
    all_gather of its logits (forward) and the all_reduce of its input's gradient (backward).
    ``input_grad=False``: the model's input needs no gradient, so no backward all_reduce at all
    (a lone MLP)."""
    layers = report["layers"]
    embeddings = sum(1 for row in layers if row["op"] == "embedding" and row["style"] == "rowwise")
    heads = sum(1 for row in layers if row["output_head"])
    forward = {"all_reduce": 2 * n_blocks + embeddings} if 2 * n_blocks + embeddings else {}
    if heads:
        forward["all_gather"] = heads
    backward = {"all_reduce": 2 * n_blocks + heads} if input_grad and 2 * n_blocks + heads else {}
    return forward, backward


def _input_dict(spec: InputSpec) -> dict[str, Any]:
    """One user input for ``to_dict``: per dim its static size, or its symbol and range."""
    dims = [
        {"size": d.size} if not d.dynamic else {"symbol": d.symbol, "min": d.lo, "max": d.hi, "example": d.example}
        for d in spec.dims
    ]
    return {"name": spec.name, "dtype": str(spec.dtype) if spec.is_tensor else None, "dims": dims}


def _layer_comm(layer: LayerDecision) -> str:
    if layer.style == "colwise" and layer.op == "embedding":
        return "-"  # sharded by columns: ids need no gradient (NOTE: [column-sharded embedding])
    if layer.style == "colwise":
        return "f: all_reduce bwd"
    if layer.style == "rowwise":
        return "g: all_reduce fwd"
    return "-"


def tied_layers(program: ExportedProgram, layers: tuple[LayerDecision, ...]) -> tuple[LayerDecision, ...]:
    """``layers`` with each row whose weight is the same tensor as an earlier row's of another
    module (tied weights, as Hugging Face's ``tie_word_embeddings``: the output head reads the
    embedding table) saying so in its reason. The parameter bytes count the tensor once
    (:func:`build_report` sums distinct tensors). Rows of one module (a weight split in pieces,
    a module called twice) are not tied."""

    def key(layer: LayerDecision) -> Any:
        tensor = program.state_dict.get(layer.weight)
        return id(tensor) if tensor is not None else layer.weight

    first: dict[Any, LayerDecision] = {}
    out = []
    for layer in layers:
        owner = first.setdefault(key(layer), layer)
        if owner.module != layer.module:
            layer = dataclasses.replace(layer, reason=f"{layer.reason}; weight tied with {owner.name}: one table, counted once")
        out.append(layer)
    return tuple(out)


def build_report(program: ExportedProgram, plan: ShardingPlan, frontend: str, attempts, rank: int) -> Report:
    """Assemble the report from the captured program and the plan (reads ``meta["val"]``)."""
    nodes = {n.name: n for n in program.graph.nodes}
    needs_grad = grad_inputs(program)
    stats = collectives(program, plan, nodes, needs_grad)
    placements = parameter_placements(program, plan)
    tensors: dict[int, tuple[str, torch.Tensor, Placement]] = {}
    for fqn, p in placements.items():
        tensors.setdefault(id(program.state_dict[fqn]), (fqn, program.state_dict[fqn], p))
    by_parameter = {
        fqn: tuple(local_bytes(nbytes_of(tensor), placement, r, plan.world_size) for r in range(plan.world_size))
        for fqn, tensor, placement in tensors.values()
    }
    total = sum(nbytes_of(tensor) for _, tensor, _ in tensors.values())
    param_names = {s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.PARAMETER}
    report = Report(
        world_size=plan.world_size,
        rank=rank,
        frontend=frontend,
        attempts=tuple(attempts),
        layers=tied_layers(program, plan.layers),
        notes=notes(plan, nodes, param_names) + other_parameters(program, plan, placements, rank),
        collectives=stats,
        param_bytes=total,
        rounds=plan.rounds,
        regions=regions(program, plan),
        uneven=any(isinstance(p, Shard) and not p.divisible(plan.world_size) for _, _, p in tensors.values()),
        parameter_bytes=by_parameter,
    )
    report.sequence_parallel = bool(plan.scatters)
    report.layer_comms = sequence_comms(program, plan)
    report.alternatives = report_alternatives(program, plan, nodes, needs_grad)
    return report


