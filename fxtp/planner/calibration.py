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
  tp program, and those figures price the tp groups' (NOTE: [collectives in the model],
  below).
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
elementwise ops, NOTE: [calibration]) priced a hidden-128
Llama's tensor-parallel communication at 4 ranks 0.75-0.85x what the step measured, and at 2
ranks, two tp groups beside two dp groups, 1.2-1.5x (2026-12-07: tp 4 58.7 ms against 74.4
measured, dp 2 x tp 2 47.2 ms against 30.7; the order of the three layouts flipped with it).
So where the model has weights, a CPU calibration also times, for each tensor-parallel degree
``n``, the model's own tp ``n`` training forward and backward (``fxtp.compile`` over the tp
groups of a ``(ranks / n, n)`` mesh, every group at once, one rank's micro-batch of a dp ``ranks
/ n`` layout): its seconds in a window (:func:`~fxtp.local_ranks.per_call`), the share of them
inside fxtp's collectives from 3 more calls under ``torch.profiler`` (their median) (:func:`~fxtp.local_ranks.profiled`,
the instrument ``fxtp.planner.measure`` splits a step with), over the collectives it issued.
That is one collective's seconds in the model; each kind's fitted figure over ``n`` ranks is
scaled so that the model's activation all_reduce costs it, as a tp group's entry
(``"tp:all_reduce"``, ``"tp:all_gather"``, ``"tp:reduce_scatter"``: ``Hardware.collective(...,
role="tp")``; sequence parallelism's are priced with it). Each already holds the waits for
peers at the model's own spacing of collectives, so tp groups with it add no
``collective_wait`` (FSDP2's dp groups keep theirs). On the same host the in-model figures were
34.7 ms (tp 2, against 30.7 measured in dp 2 x tp 2) and 79.8 ms (tp 4, against 74.4).

This is the model's own program at one micro-batch, not a candidate's step: no FSDP2, no
optimizer, no accumulation, and one forward and backward per degree (2-6 s here); the layouts
that ``fxtp.planner.measure`` runs are built the same way but add all three.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from fxtp.core.errors import FxtpConfigError
from fxtp.local_ranks import FXTP_COLLECTIVES, per_call, profiled, slowest, spawn_ranks
from fxtp.planner.comm import fitted_time
from fxtp.planner.hardware import CalibrationRun, Hardware, HostCosts, doubts
from fxtp.planner.host import host_costs, host_on_the_model
from fxtp.planner.model import TransformerShape
from fxtp.planner.params import repeated_blocks

__all__ = ["calibrate", "calibrate_on_ranks", "gemm_shapes", "host_costs", "spawn_ranks"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
_SMALL = 16 << 10  # bytes: a payload whose time is mostly latency
_LARGE_CPU = 8 << 20  # bytes: on CPU ranks, a payload whose bandwidth term shows above the latency's noise
# on CPU ranks, the elementwise ops before each timed collective: about half a block's forward, the
# compute between two of Megatron's collectives (a hidden-128 Llama block's forward: ~2.5 ms on 4 ranks here)
_BETWEEN_OPS = 200
_WAIT_HALVES = 4  # the all_reduce timed again after this many times ``between``'s work (NOTE: [collective wait])
_NO_BANDWIDTH_COST = 1e12  # bytes/s where a larger payload took no longer: the latency is all of it
_PROFILED = 3  # profiled calls of the model's tp program, their median share kept (NOTE: [collectives in the model])


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
    collectives, waits, groups = [], [], {}
    for n in tps[1:]:
        group = _groups_of(n, ranks)
        tokens = max(1, batch // (ranks // n)) * seq
        # on CPU ranks the model's own activation payload, whose time is then measured, not fitted
        act_bytes = tokens * shape.hidden * element
        groups[n] = group, act_bytes
        payloads = (_SMALL, max(large, 16 * _SMALL)) if cuda else (act_bytes, max(16 * act_bytes, _LARGE_CPU))
        m, k, f, _ = max(gemm_shapes(shape, tokens, n), key=lambda g: g[0] * g[1] * g[2])
        x, w = torch.randn(m, k, device=device, dtype=dtype), torch.randn(f, k, device=device, dtype=dtype)
        act = torch.randn(tokens * shape.hidden // n, device=device, dtype=dtype)
        across = _groups_of(n, ranks, strided=True) if not cuda and n < ranks else None

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
    memory = slowest(_usable_memory(device, ranks), op=dist.ReduceOp.MIN)
    host = HostCosts() if cuda else host_costs(dict(((k, n), lat) for k, n, lat, _ in collectives), repeats)
    if not cuda and all(p.device.type != "meta" for p in model.parameters()):  # a model with weights runs
        tokens = (max(1, batch // ranks), seq)
        gemm_s = shape.flops_per_token(seq) * math.prod(tokens) / rates[0][1]  # the tp 1 GEMMs' seconds
        host = host_on_the_model(host, model, shape.hidden, tokens, gemm_s, repeats)
        for n, (group, act_bytes) in groups.items():  # NOTE: [collectives in the model]
            seconds = tp_collective_on_the_model(model, group, n, (max(1, batch // (ranks // n)), seq), repeats)
            collectives += with_tp_collectives(collectives, n, seconds, act_bytes)
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
    run = CalibrationRun(slowest(time.perf_counter() - start), slowest(os.getloadavg()[0]), os.cpu_count() or 1, 0 if cuda else ranks)
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


def _groups_of(n: int, ranks: int, strided: bool = False) -> Any:
    """This rank's group of ``n`` consecutive ranks (a tp group of a ``(ranks / n, n)`` mesh), or
    with ``strided`` of the ``ranks / n`` ranks ``n`` apart (its dp group); every rank creates
    every group, as torch asks."""
    if n == ranks and not strided:
        return dist.group.WORLD
    mine = None
    for members in ([list(range(i, ranks, n)) for i in range(n)] if strided else
                    [list(range(first, first + n)) for first in range(0, ranks, n)]):
        group = dist.new_group(members)
        if dist.get_rank() in members:
            mine = group
    return mine


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


def _usable_memory(device: torch.device, ranks: int) -> int:
    """Bytes this rank may use: the GPU's free memory, or the host's available memory over the ranks."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // ranks


def tp_collective_on_the_model(model: nn.Module, group: Any, n: int, tokens: tuple[int, int], repeats: int) -> float:
    """Seconds of one of fxtp's collectives inside the model's tp ``n`` training forward and
    backward over ``group`` (this rank's tp group; every rank calls this), ``tokens = (batch,
    seq)`` a rank's micro-batch: the call's seconds in a window times the share of them in
    fxtp's collectives, over the collectives issued (NOTE: [collectives in the model]); 0 where
    it issued none."""
    import fxtp

    ids = torch.randint(0, model.config.vocab_size, tokens, generator=torch.Generator().manual_seed(0))
    pm = fxtp.compile(copy.deepcopy(model).train(), n, (ids,), example_kwargs={"labels": ids}, group=group, dynamic=False)

    def step() -> None:
        pm(ids, labels=ids).loss.backward()
        pm.zero_grad(set_to_none=True)

    seconds = per_call(step, repeats)
    runs = [profiled(step, (FXTP_COLLECTIVES,)) for _ in range(_PROFILED)]
    issued = runs[0].issued[FXTP_COLLECTIVES]
    share = statistics.median(r.shares[FXTP_COLLECTIVES] for r in runs)
    return seconds * share / issued if issued else 0.0


def with_tp_collectives(collectives: list[tuple[str, int, float, float]], n: int, seconds: float,
                        payload: int) -> list[tuple[str, int, float, float]]:
    """The tp role's entries over ``n`` ranks (``"tp:all_reduce"`` ...): each kind's fitted
    ``(latency_s, bus_bytes_per_s)`` in ``collectives`` scaled by one factor, so that an
    all_reduce of ``payload`` bytes (the model's activation) costs ``seconds`` (NOTE:
    [collectives in the model]); none where ``seconds`` is 0."""
    fitted = {kind: (lat, bw) for kind, ranks, lat, bw in collectives if ranks == n}
    if not seconds or "all_reduce" not in fitted:
        return []
    factor = seconds / fitted_time("all_reduce", payload, n, *fitted["all_reduce"])
    return [(f"tp:{kind}", n, fitted[kind][0] * factor, fitted[kind][1] / factor) for kind in KINDS if kind in fitted]
