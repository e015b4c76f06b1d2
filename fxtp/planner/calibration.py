"""``fxtp.planner.calibrate``: a :class:`~fxtp.planner.hardware.Hardware` measured on the local
devices and process groups, for ``fxtp.plan(..., hardware=)``.

NOTE: [calibration]
The datasheet table prices every GEMM at the device's efficiency by GEMM size (``mfu`` times
the wave quantization, NOTE: [GEMM efficiency] in fxtp/planner/hardware.py) and every
collective with NCCL's constants. A calibration replaces them with what the ranks that will run the model
achieve, measured on all of them at once (so ranks sharing a host's cores or links contend as
they will in the run; NOTE: [contended window] in fxtp/local_ranks.py), each figure the slowest rank's:

- compute: for each tensor-parallel degree ``tp`` dividing the ranks, the local GEMMs of one
  micro-batch of the model (``batch / dp`` sequences of ``seq`` tokens, ``dp = ranks / tp``):
  per block q, k, v, o and the MLP's matrices, sharded by ``tp`` as Megatron's plan shards them
  (colwise on the output features, rowwise on the input features), and the vocab-sharded head;
  each as its forward ``x @ W.T`` and its backward's two GEMMs (``dy @ W``, ``dy.T @ x``). The
  FLOPs over the median seconds (of ``repeats``) is ``Hardware.achieved_flops[tp]``; the cost
  model divides the step's FLOPs (attention's included, NOTE: [FLOPs] in
  fxtp/planner/model.py) by it. Elementwise ops, norms and the optimizer are not in it: their
  share is what a measured step shows beyond it (``fxtp.planner.measure``).
- collectives: all_reduce, all_gather and reduce_scatter over every group size dividing the
  ranks (the tp and dp groups a plan can use), all groups of a size at once, at two payloads,
  fitted to ``latency + payload x steps / n / bus_bw`` (NOTE: [collective time] in
  fxtp/planner/comm.py): ``Hardware.collectives``. On GPUs a small one (the latency) and the
  model's (an activation all_reduce or a block's parameters, the larger). On CPU ranks the
  model's activation all_reduce itself (so its time is measured, not fitted) and 16 times it,
  at least 8 MB (a bandwidth term that shows above the latency's noise; none measured:
  ``_NO_BANDWIDTH_COST``), each what it adds to a window of calls after half a block's forward
  of work (the largest GEMM and ``_BETWEEN_OPS`` elementwise ops) and, for groups smaller than
  the world, an all_reduce over the other mesh dim's group, as FSDP2's traffic runs beside
  tp's in a step (NOTE: [contended window] in fxtp/local_ranks.py). Then, per group size,
  the activation all_reduce again after 4 half blocks: the seconds of wait a second of work
  adds (``Hardware.collective_wait``, NOTE: [collective wait] in fxtp/planner/comm.py). Where
  the model has weights, each tp group size's collectives are also timed inside the model's own
  tp program, and FSDP2's in the same program sharded over the mesh's dp groups; those figures
  price the tp and dp groups' (NOTE: [collectives in the model], below).
- host (CPU ranks): the seconds a dispatched op costs the host, forward and backward, fixed and
  per byte it writes; an optimizer step per parameter tensor (plain, and FSDP2's DTensor shards)
  and per element; FSDP2's own work per collective, per unit and per parameter tensor
  (:func:`~fxtp.planner.host.host_costs`; NOTE: [host time] in fxtp/planner/host.py). The op figures come from a
  chain of ``aten.mul`` and are then scaled by one factor so that, with the tp 1 GEMM rate,
  they price the model's own tp 1 forward and backward as measured (a model's ops cost
  1.9-2.3x a ``mul`` chain's here), and the optimizer figures by another so that they price
  what its AdamW step adds to them (1.6x the figures timed alone, 2026-12-07;
  :func:`~fxtp.planner.host.host_on_the_model`); a model without weights (a
  config.json's, on ``meta``) keeps the chain's. On GPUs they are not priced.
- memory: per rank, a GPU's free memory (``torch.cuda.mem_get_info``), or on a CPU the host's
  ``MemAvailable`` (``/proc/meminfo``) shared by the local ranks: ``Hardware.memory_bytes``.
- doubts (:func:`~fxtp.planner.hardware.doubts`): what the figures themselves say about a
  host busy with other jobs, the plan prints each: a degree's GEMM rate under a third of the others' median (the same
  GEMMs, split finer); a collective fitted with no latency; FSDP2 or an op measured as free
  (a difference of two timings that came out negative, clamped); a load average above the
  cores and the ranks' own load; a calibration over a minute (on this repository's 2 shared
  cores at a load under 2 it takes 30-33 s; at loads of 10-25, 59-234 s, with a tp 2 rate of
  2.35 GFLOP/s beside ~30).

On CPU ranks (gloo) the GEMMs and the payloads are fp32 (``compute_bytes = 4``) and FSDP2's
collectives are priced as exposed (``overlap_fsdp = False``): with no CUDA streams FSDP2 issues
and waits them on the thread that computes (torch ``fsdp/_fully_shard/_fsdp_param_group.py``:
the streams it overlaps on are CUDA's). On GPUs (NCCL) they are bf16 and overlapped as
NOTE: [fsdp overlap] prices it.

NOTE: [collectives in the model]
On CPU ranks that share a host's cores, a collective's cost in a step depends on what runs
around it: its peers reach it after their own share of the cores, and the scheduler decides
which ran last (NOTE: [contended window] in fxtp/local_ranks.py, NOTE: [collective wait] in
fxtp/planner/comm.py). A collective fitted after synthetic work (half a block's GEMM and
elementwise ops, NOTE: [calibration]) priced a hidden-128 Llama's tp communication 0.75-1.5x
what its steps measured, and the layouts' order flipped with it (docs/plan_command.md).
So where the model has weights, a CPU calibration also times, for each tensor-parallel degree
``n`` (1 included), the model's own tp ``n`` training forward and backward on a ``(ranks / n,
n)`` mesh (``fxtp.compile`` over its tp groups, one rank's micro-batch of the dp ``ranks / n``
layout), with torchtitan's FSDP2 wrapping over its dp groups where ``ranks / n > 1``
(``fully_shard`` on each block, then the root), every group at once (:class:`ModelProgram`):
its seconds in a window (:func:`~fxtp.local_ranks.per_call_each`), and the shares of them
inside fxtp's collectives and inside FSDP2's own ranges from 3 more calls under
``torch.profiler`` (their medians; :func:`~fxtp.local_ranks.profiled`, the instrument
``fxtp.planner.measure`` splits a step with), which split what it takes beyond its compute
(below). Every degree's program (and :func:`~fxtp.planner.host.host_on_the_model`'s
plain tp 1 step, with and without its optimizer) is built first, so that a rank holds 2 + the
degrees' copies of the model at once, then timed taking turns, 5
windows each (:func:`~fxtp.local_ranks.per_call_each`): this host's other load comes in bursts
of 0.5-1 s that slow a single-threaded loop by 25-85% (a 60 s trace, 2026-12-07), which one
figure's 5 windows back to back (0.5 s) could fall inside (docs/plan_command.md, 2026-12-07).

The communication's seconds are what the program takes beyond its compute as the cost model
prices it (its GEMMs' FLOPs at the degree's calibrated rate; the model's ops, counted once on
the plain tp 1 step, at the host's figures, the bytes of the tensors tp shards over the
degree, as ``host_seconds`` prices a step's: :func:`~fxtp.planner.host.priced_ops`), split
between fxtp's collectives and FSDP2 in proportion to their profiled shares. So what fxtp's tp
program dispatches beyond the model's own ops (at tp 2, 290 forward ops against 205) is priced
as its communication, where the plan has it. The shares alone are time each
rank's thread spends inside them, and on shared cores its peers compute meanwhile: summed with
the compute priced as every rank computing at once they count that overlap twice. So a
calibration prices each of these programs at its measured seconds, by construction, with one
gap left: the plan counts the model's ops on the captured program (``count_ops``), this on the
compiled step (228 forward ops and 6.3 MB against 205 and 5.1 MB for a hidden-128 Llama at 2 x
64 tokens, 2026-12-07), so the plan prices a step's ops above the ones timed here.

- tp groups (``n > 1``): the collectives' seconds over the collectives issued are one
  collective's seconds in the model. Each kind's fitted figure over ``n`` ranks is scaled so
  that one collective of the model's activation costs it, as a tp group's entry
  (``"tp:all_reduce"``, ``"tp:all_gather"``, ``"tp:reduce_scatter"``:
  ``Hardware.collective(..., role="tp")``): on shared cores a collective's time is mostly its
  wait for peers, once a collective, so sequence parallelism's all_gathers and reduce_scatters
  cost what the all_reduces did (scaled by the all_reduce's fitted ratio instead, they moved
  between calibrations and the plan chose sp where one under-priced it; docs/plan_command.md).
- dp groups (``ranks / n > 1``): FSDP2's seconds (its hooks, copy-in and copy-out, its
  collectives and their waits: its share of the rest) less its host work as priced (``fsdp_unit`` and
  ``fsdp_tensor``, NOTE: [host time] in fxtp/planner/host.py). Each kind's fitted figure over
  ``ranks / n`` ranks is scaled by one factor so that FSDP2's collectives on the units' shards
  on a rank, as ``fxtp.planner.costs`` prices them (each block's all_gather in forward and
  again in backward and its reduce_scatter, the root's all_gather and reduce_scatter), cost
  that, as a dp group's entry (``"dp:all_gather"`` ...; ``fxtp.planner.comm.with_dp_collectives``):
  bare collectives and ``Linear(8, 8)`` units had priced FSDP2 0.6-0.76x what runs measured.

Each entry holds the waits for peers at the model's own spacing of collectives, so groups with
one add no ``collective_wait``. This is the model's own program at one micro-batch, not a
candidate's step: no optimizer, no accumulation, no checkpointing or sequence parallelism (2-6
s a degree here). Another micro-batch, checkpointing, accumulation or another mesh is priced
from these figures by the cost model; on this host's full meshes (tp x dp = the ranks) the
programs timed are the ones ``fxtp.planner.measure`` runs, less their optimizer, so its
check there is of the pricing around them (the compute, the optimizer, the fits) and of the
host's drift between the calibration and the run, more than of the collectives' model.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from fxtp.core.errors import FxtpConfigError
from fxtp.local_ranks import (FSDP_RANGES, FXTP_COLLECTIVES, Profiled, groups_of, per_call, per_call_each, profiled, slowest,
                               spawn_ranks, usable_memory)
from fxtp.planner.comm import KINDS, with_dp_collectives, with_tp_collectives
from fxtp.planner.hardware import CalibrationRun, Hardware, HostCosts, doubts
from fxtp.planner.host import TrainingStep, host_costs, host_on_the_model, host_seconds, priced_ops, step_ops
from fxtp.planner.model import TransformerShape
from fxtp.planner.params import repeated_blocks

__all__ = ["calibrate", "calibrate_on_ranks", "communication", "gemm_shapes", "host_costs", "spawn_ranks"]

_SMALL = 16 << 10  # bytes: a payload whose time is mostly latency
_LARGE_CPU = 8 << 20  # bytes: on CPU ranks, a payload whose bandwidth term shows above the latency's noise
# on CPU ranks, the elementwise ops before each timed collective: about half a block's forward, the
# compute between two of Megatron's collectives (a hidden-128 Llama block's forward: ~2.5 ms on 4 ranks here)
_BETWEEN_OPS = 200
_WAIT_HALVES = 4  # the all_reduce timed again after this many times ``between``'s work (NOTE: [collective wait])
_NO_BANDWIDTH_COST = 1e12  # bytes/s where a larger payload took no longer: the latency is all of it
_PROFILED = 3  # profiled calls of the model's tp program, their median share kept (NOTE: [collectives in the model])
_MODEL_REPEATS = 5  # windows of each of the model's programs, taking turns (NOTE: [collectives in the model])


def calibrate(model: nn.Module, devices: int, *, batch: int, seq: int, repeats: int = 5, timeout_s: int = 300) -> Hardware:
    """Measure ``devices`` local ranks running ``model``'s GEMMs and collectives (NOTE: [calibration]).

    Spawns ``devices`` processes on 127.0.0.1 (NCCL, one GPU each, when this host has that many
    GPUs; else gloo on the CPU, one thread each) and runs :func:`calibrate_on_ranks` on them.

    Args:
        model: a Hugging Face decoder (as ``fxtp.plan`` takes); only its config's sizes are read.
        devices: ranks to measure (the plan's ``tp x dp``).
        batch: global batch, sequences per step; ``seq``: tokens per sequence.
        repeats: timed repetitions of each measurement (the median is kept).
        timeout_s: the process groups' timeout, seconds.

    Returns:
        A :class:`Hardware` with ``achieved_flops`` (FLOP/s per device, per tp degree),
        ``collectives`` (latency in s, bus bandwidth in bytes/s, per kind and group size),
        ``memory_bytes`` (per rank) and, on CPUs, ``compute_bytes=4``, ``overlap_fsdp=False``.

    Raises:
        FxtpConfigError: not a decoder with repeated blocks; ``devices`` GPUs asked on a host
            with fewer (CPU ranks are used when it has none).
    """
    _shape(model)  # raises FxtpConfigError here for a model it cannot price, not inside every rank
    return spawn_ranks(calibrate_on_ranks, devices, timeout_s, model, batch=batch, seq=seq, repeats=repeats)


def calibrate_on_ranks(model: nn.Module, *, batch: int, seq: int, repeats: int = 5) -> Hardware:
    """:func:`calibrate` on the initialized default process group (every rank calls it; each gets
    the same :class:`Hardware`)."""
    start = time.perf_counter()
    ranks = dist.get_world_size()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = _shape(model)
    tps = [t for t in range(1, ranks + 1) if ranks % t == 0]
    rates = []
    for tp in tps:
        shapes = gemm_shapes(shape, max(1, batch // (ranks // tp)) * seq, tp)
        seconds = _gemm_seconds(shapes, device, dtype, repeats)
        rates.append((tp, sum(6 * m * k * n * count for m, k, n, count in shapes) / seconds))
    element = torch.finfo(dtype).bits // 8
    large = max(batch // ranks * seq * shape.hidden, shape.block_params) * element
    collectives, waits, act_bytes = [], [], {}
    for n in tps[1:]:
        group = groups_of(n, ranks)
        tokens = max(1, batch // (ranks // n)) * seq
        # on CPU ranks the model's own activation payload, whose time is then measured, not fitted
        act_bytes[n] = tokens * shape.hidden * element
        payloads = (_SMALL, max(large, 16 * _SMALL)) if cuda else (act_bytes[n], max(16 * act_bytes[n], _LARGE_CPU))
        m, k, f, _ = max(gemm_shapes(shape, tokens, n), key=lambda g: g[0] * g[1] * g[2])
        x, w = torch.randn(m, k, device=device, dtype=dtype), torch.randn(f, k, device=device, dtype=dtype)
        act = torch.randn(tokens * shape.hidden // n, device=device, dtype=dtype)
        across = groups_of(n, ranks, strided=True) if not cuda and n < ranks else None

        def between(halves: int = 1) -> None:  # half a block's forward: its largest GEMM and its elementwise ops
            for _ in range(halves):
                torch.mm(x, w.t())
                y = act
                for _ in range(_BETWEEN_OPS):
                    y = y * 1.0001
            if across is not None:  # the other mesh dim's traffic (FSDP2's beside tp's): NOTE: [contended window]
                dist.all_reduce(act[:1], group=across)

        base = 0.0 if cuda else per_call(between, repeats)  # the work alone, timed once for every fit below
        for kind in KINDS:
            latency, bw = _fit(kind, group, n, payloads, device, dtype, repeats, between, base)
            collectives.append((kind, n, latency, bw))
        if not cuda:
            waits.append((n, base, _wait(group, n, payloads[0], dtype, repeats, between, base)))
    memory = slowest(usable_memory(device, ranks), op=dist.ReduceOp.MIN)
    host = HostCosts() if cuda else host_costs(dict(((k, n), lat) for k, n, lat, _ in collectives), repeats)
    model_s = 0.0  # the model's own programs' seconds, summed over the tp degrees (CalibrationRun.model_s)
    if not cuda and all(p.device.type != "meta" for p in model.parameters()):  # a model with weights runs
        tokens = (max(1, batch // ranks), seq)
        gemm_s = shape.flops_per_token(seq) * math.prod(tokens) / rates[0][1]  # the tp 1 GEMMs' seconds
        # every program built first, then timed taking turns (per_call_each): a burst of the host's
        # other load falls on one timing of each, not on all of one degree's
        from fxtp.runtime.clipping import FsdpClippingWarning

        own = TrainingStep(model, tokens)
        ops = step_ops(own.pm, own.ids, shape.hidden)  # the same on every rank: the whole model at tp 1
        programs = [ModelProgram(model, tp, (max(1, batch // (ranks // tp)), seq)) for tp in tps]
        with warnings.catch_warnings():  # FSDP2 over fxtp's parameters warns about clipping, which this never does
            warnings.filterwarnings("ignore", category=FsdpClippingWarning)
            seconds, with_optimizer, *model_seconds = per_call_each(
                [own.step, lambda: own.step(True)] + [p.step for p in programs], _MODEL_REPEATS)
            runs = [[profiled(p.step, (FXTP_COLLECTIVES, FSDP_RANGES)) for p in programs] for _ in range(_PROFILED)]
        host = host_on_the_model(host, own, ops, gemm_s, seconds, max(0.0, with_optimizer - seconds))
        del own  # every degree's program holds a copy of the model too
        for i, (tp, program) in enumerate(zip(tps, programs)):  # NOTE: [collectives in the model]
            # its compute as the cost model prices it: its GEMMs' FLOPs at the degree's rate, the model's ops at
            # the host's figures (their sharded bytes over tp), as host_seconds prices a step's
            tokens_s = math.prod(program.ids.shape)
            compute = shape.flops_per_token(seq) * tokens_s / tp / rates[i][1] + priced_ops(host, ops, tokens_s, tp)
            timed, dp = program.timed(model_seconds[i], [r[i] for r in runs], compute), ranks // tp
            model_s += timed.seconds
            fsdp_host = host_seconds(host, None, layers=0, tokens=0, tp=tp, dp=dp, checkpointing=None, micro_batches=1,
                                     tensors=0, elements=0, units=tuple(t for _, t in timed.units))["fsdp"]
            if tp > 1:
                collectives += with_tp_collectives(collectives, tp, timed.tp_collective_s, act_bytes[tp])
            collectives += with_dp_collectives(collectives, dp, timed.fsdp_s - fsdp_host, [e for e, _ in timed.units])
    widest = [c for c in collectives if c[0] == "all_reduce"][-1:] or [("", 1, 0.0, 1e9)]
    hw = Hardware(
        name=f"calibrated {ranks} x {torch.cuda.get_device_name(device) if cuda else 'CPU'} ({dist.get_backend()})",
        peak_flops=max(r for _, r in rates), memory_bytes=int(memory), intra_node_bw=widest[0][3],
        inter_node_bw=widest[0][3], devices_per_node=ranks, mfu=1.0, collective_latency=widest[0][2],
        nvlink_step_latency=0.0, network_step_latency=0.0, achieved_flops=tuple(rates),
        collectives=tuple(collectives), overlap_fsdp=cuda, compute_bytes=element, host=host,
        collective_wait=tuple(waits),
    )
    # the slowest rank's seconds and the highest load any rank read: every rank's Hardware is the same
    run = CalibrationRun(slowest(time.perf_counter() - start), slowest(os.getloadavg()[0]), os.cpu_count() or 1, 0 if cuda else ranks,
                         model_s)
    hw = dataclasses.replace(hw, calibration=run)
    return dataclasses.replace(hw, doubts=doubts(hw))


def gemm_shapes(shape: TransformerShape, tokens: int, tp: int) -> list[tuple[int, int, int, int]]:
    """The forward GEMMs ``(m, k, n, count)`` a tp rank runs for ``tokens`` tokens: ``x (m, k) @
    W.T (k, n)``, ``count`` times a step (NOTE: [calibration]). A dim that ``tp`` does not
    divide stays whole (fxtp replicates such a layer)."""
    h, d = shape.hidden, shape.hidden // shape.heads

    def cut(features: int) -> int:
        return features // tp if features % tp == 0 else features

    q, kv = cut(shape.heads) * d, cut(shape.kv_heads) * d
    f, layers = cut(shape.intermediate), shape.layers
    blocks = [(tokens, h, q, layers), (tokens, h, kv, 2 * layers), (tokens, q, h, layers),
              (tokens, h, f, (2 if shape.gated_mlp else 1) * layers), (tokens, f, h, layers)]
    return blocks + [(tokens, h, cut(shape.vocab), 1)]


def _shape(model: nn.Module) -> TransformerShape:
    blocks = repeated_blocks(model)
    if blocks is None:
        raise FxtpConfigError(f"fxtp.planner.calibrate found no stack of blocks in {type(model).__name__}: it measures "
                              "Hugging Face decoder models. fix: pass a transformers model or its config.json")
    return TransformerShape.of(model, blocks.fqn)


def _gemm_seconds(shapes: list, device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    """Seconds of one step's GEMMs ``shapes``, forward and backward, on this rank, end to end
    (the slowest rank's median, :func:`~fxtp.local_ranks.per_call`)."""
    g = torch.Generator(device=device).manual_seed(0)
    operands = [(torch.randn(m, k, device=device, dtype=dtype, generator=g), torch.randn(n, k, device=device, dtype=dtype, generator=g),
                 torch.randn(m, n, device=device, dtype=dtype, generator=g), count) for m, k, n, count in shapes]

    def once() -> None:
        for x, w, dy, count in operands:
            for _ in range(count):
                torch.mm(x, w.t()), torch.mm(dy, w), torch.mm(dy.t(), x)

    return per_call(once, repeats, device)


def _fit(kind: str, group: Any, n: int, payloads: tuple[int, int], device: torch.device, dtype: torch.dtype,
         repeats: int, between: Callable[[], Any], base: float) -> tuple[float, float]:
    """``(latency_s, bus_bytes_per_s)`` of ``kind`` over ``group`` from its times at two payloads
    (bytes, the smaller first); a bandwidth of ``_NO_BANDWIDTH_COST`` where the larger was not slower.

    On a GPU each is timed alone after a barrier, the slowest rank's. On CPU ranks it is what
    the collective adds to ``between`` (half a block's forward, NOTE: [calibration]) run before
    it, back to back in a window on every rank (:func:`~fxtp.local_ranks.per_call`), as
    collectives follow a block's compute in a step: ranks sharing a host's cores reach it at
    different times, and that wait is part of what a collective costs there (NOTE: [contended
    window] in fxtp/local_ranks.py); ``base``: ``between``'s own seconds there (0 on a GPU)."""
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    element = torch.finfo(dtype).bits // 8
    small, large = (max(element * n, p // (n * element) * n * element) for p in payloads)
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # torch 2.13 renames them
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    cpu = device.type != "cuda"
    times = []
    for payload in (small, large):
        full = torch.ones(payload // element, device=device, dtype=dtype)
        part = torch.ones(payload // element // n, device=device, dtype=dtype)

        def once() -> None:
            if cpu:
                between()
            if kind == "all_reduce":
                dist.all_reduce(full, group=group)
            elif kind == "all_gather":
                gather(full, part, group=group)
            else:
                scatter(part, full, group=group)

        times.append(max(0.0, per_call(once, repeats, device) - base))
    per_byte = max(0.0, (times[1] - times[0]) / (large - small))  # 0: the large payload was not slower
    return max(0.0, times[0] - small * per_byte), steps / n / per_byte if per_byte else _NO_BANDWIDTH_COST


def _wait(group: Any, n: int, payload: int, dtype: torch.dtype, repeats: int,
          between: Callable[[int], Any], base: float) -> float:
    """``per_s`` of ``Hardware.collective_wait`` for groups of ``n`` on CPU ranks (NOTE:
    [collective wait] in fxtp/planner/comm.py): the seconds a ``payload``-byte all_reduce adds
    per second of work more before it, timed after 1 and after ``_WAIT_HALVES`` half blocks
    (each the slowest rank's median in a window; ``base``: one half block's own seconds, which
    every collective of :func:`_fit` follows); 0 where more work did not make it slower."""
    element = torch.finfo(dtype).bits // 8
    full = torch.ones(max(n, payload // element), dtype=dtype)
    works, adds = [base], []
    for halves in (1, _WAIT_HALVES):
        def once(halves: int = halves) -> None:
            between(halves)
            dist.all_reduce(full, group=group)

        if halves > 1:
            works.append(per_call(lambda halves=halves: between(halves), repeats))
        adds.append(max(0.0, per_call(once, repeats) - works[-1]))
    more = works[1] - works[0]
    return max(0.0, (adds[1] - adds[0]) / more) if more > 0 else 0.0


@dataclass(frozen=True)
class InModel:
    """What :meth:`ModelProgram.timed` made: the program's seconds (a forward and backward), one
    of fxtp's collectives' seconds (0: none issued), FSDP2's seconds (0 at dp 1), and its units'
    ``(elements, tensors)`` on a rank, the blocks' then the root's."""

    seconds: float
    tp_collective_s: float
    fsdp_s: float
    units: tuple[tuple[int, int], ...]


class ModelProgram:
    """The model's own tp ``tp`` training forward and backward on a ``(ranks / tp, tp)`` mesh,
    ``tokens = (batch, seq)`` a rank's micro-batch (every rank builds each, in the same order;
    NOTE: [collectives in the model]): ``fxtp.compile`` over the tp groups, with torchtitan's
    wrapping over the dp groups (``fully_shard`` on each block, then the root, as
    ``fxtp.planner.measure``'s layouts). ``step()`` runs it; :meth:`timed` makes the figures."""

    def __init__(self, model: nn.Module, tp: int, tokens: tuple[int, int]) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        import fxtp
        from fxtp.runtime.clipping import FsdpClippingWarning

        dp = dist.get_world_size() // tp
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        self.ids = torch.randint(0, model.config.vocab_size, tokens, generator=torch.Generator().manual_seed(0))
        self.pm = fxtp.compile(copy.deepcopy(model).train(), tp, (self.ids,), example_kwargs={"labels": self.ids},
                               group=mesh["tp"] if tp > 1 else None, dynamic=False)
        found = repeated_blocks(model)
        blocks = [self.pm.get_submodule(f"{found.fqn}.{i}" if found.fqn else str(i)) for i in range(found.count)] if found else []
        params = [p for p in self.pm.parameters() if p.requires_grad]
        units = [(sum(p.numel() for p in b.parameters()), len(list(b.parameters()))) for b in blocks]
        units.append((sum(p.numel() for p in params) - sum(e for e, _ in units), len(params) - sum(t for _, t in units)))
        # the largest rank's shard (FSDP2 pads to it; uneven tp shards differ): every rank's Hardware is the same
        self.units = tuple((int(slowest(e)), t) for e, t in units)
        with warnings.catch_warnings():  # FSDP2 over fxtp's parameters warns about clipping, which this never does
            warnings.filterwarnings("ignore", category=FsdpClippingWarning)
            if dp > 1:
                for block in blocks:
                    fully_shard(block, mesh=mesh["dp"])
                fully_shard(self.pm, mesh=mesh["dp"])

    def step(self) -> None:
        self.pm(self.ids, labels=self.ids).loss.backward()
        self.pm.zero_grad(set_to_none=True)

    def timed(self, seconds: float, runs: list[Profiled], compute: float) -> InModel:
        """The figures of a step of ``seconds`` in a window (:func:`~fxtp.local_ranks.per_call`)
        whose compute is priced at ``compute`` seconds: the rest is its communication's, split
        between fxtp's collectives (``_c10d_functional::*``, per collective issued) and FSDP2's own
        ranges (``FSDP::*``) in proportion to their shares of ``runs``, profiled steps (their
        medians; the instruments ``fxtp.planner.measure`` splits a step with). NOTE:
        [collectives in the model]: the shares themselves also hold peers' compute."""
        tp_s, fsdp_s = communication(seconds, compute, *(statistics.median(r.shares[prefix] for r in runs)
                                                         for prefix in (FXTP_COLLECTIVES, FSDP_RANGES)))
        issued = int(slowest(runs[0].issued[FXTP_COLLECTIVES]))
        return InModel(seconds, tp_s / issued if issued else 0.0, fsdp_s, self.units)


def communication(seconds: float, compute: float, tp_share: float, fsdp_share: float) -> tuple[float, float]:
    """``(tp_s, fsdp_s)``: what a program of ``seconds`` takes beyond its priced ``compute``,
    split between fxtp's collectives and FSDP2 in proportion to their profiled shares of its
    seconds (NOTE: [collectives in the model]); none where it took no longer than its compute
    or neither has a share."""
    shares, rest = tp_share + fsdp_share, max(0.0, seconds - compute)
    return (rest * (tp_share / shares), rest * (fsdp_share / shares)) if shares > 0 else (0.0, 0.0)
