"""``fxtp.planner.calibrate``: a :class:`~fxtp.planner.hardware.Hardware` measured on the local
devices and process groups, for ``fxtp.plan(..., hardware=)``.

NOTE: [calibration]
The datasheet table prices every GEMM at the device's efficiency by GEMM size (``mfu`` times
the wave quantization, NOTE: [GEMM efficiency] in fxtp/planner/hardware.py) and every
collective with NCCL's constants. A calibration replaces them with what the ranks that will run the model
achieve, measured on all of them at once (so ranks sharing a host's cores or links contend as
they will in the run), each figure the slowest rank's:

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
  ranks (the tp and dp groups a plan can use), all groups of a size at once, at a small payload
  (the latency) and the model's (an activation all_reduce or a block's parameters, the larger),
  fitted to ``latency + payload x steps / n / bus_bw`` (NOTE: [collective time] in
  fxtp/planner/comm.py): ``Hardware.collectives``.
- memory: per rank, a GPU's free memory (``torch.cuda.mem_get_info``), or on a CPU the host's
  ``MemAvailable`` (``/proc/meminfo``) shared by the local ranks: ``Hardware.memory_bytes``.

On CPU ranks (gloo) the GEMMs and the payloads are fp32 (``compute_bytes = 4``) and FSDP2's
collectives are priced as exposed (``overlap_fsdp = False``): with no CUDA streams FSDP2 issues
and waits them on the thread that computes (torch ``fsdp/_fully_shard/_fsdp_param_group.py``:
the streams it overlaps on are CUDA's). On GPUs (NCCL) they are bf16 and overlapped as
NOTE: [fsdp overlap] prices it.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import statistics
import tempfile
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from fxtp.core.errors import FxtpConfigError
from fxtp.planner.hardware import Hardware
from fxtp.planner.model import TransformerShape
from fxtp.planner.params import repeated_blocks

__all__ = ["calibrate", "calibrate_on_ranks", "gemm_shapes", "spawn_ranks"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
_SMALL = 16 << 10  # bytes: a payload whose time is mostly latency


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
    ranks = dist.get_world_size()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = _shape(model)
    tps = [t for t in range(1, ranks + 1) if ranks % t == 0]
    rates = []
    for tp in tps:
        shapes = gemm_shapes(shape, max(1, batch // (ranks // tp)) * seq, tp)
        seconds = _slowest(_gemm_seconds(shapes, device, dtype, repeats))
        rates.append((tp, sum(6 * m * k * n * count for m, k, n, count in shapes) / seconds))
    element = torch.finfo(dtype).bits // 8
    large = max(batch // ranks * seq * shape.hidden, shape.block_params) * element
    collectives = []
    for n in tps[1:]:
        group = _groups_of(n, ranks)
        m, k, f, _ = max(gemm_shapes(shape, max(1, batch // (ranks // n)) * seq, n), key=lambda g: g[0] * g[1] * g[2])
        x, w = torch.randn(m, k, device=device, dtype=dtype), torch.randn(f, k, device=device, dtype=dtype)
        for kind in KINDS:
            latency, bw = _fit(kind, group, n, large, device, dtype, repeats, lambda: torch.mm(x, w.t()))
            collectives.append((kind, n, latency, bw))
    memory = _slowest(_usable_memory(device, ranks), op=dist.ReduceOp.MIN)
    widest = [c for c in collectives if c[0] == "all_reduce"][-1:] or [("", 1, 0.0, 1e9)]
    return Hardware(
        name=f"calibrated {ranks} x {torch.cuda.get_device_name(device) if cuda else 'CPU'} ({dist.get_backend()})",
        peak_flops=max(r for _, r in rates), memory_bytes=int(memory), intra_node_bw=widest[0][3],
        inter_node_bw=widest[0][3], devices_per_node=ranks, mfu=1.0, collective_latency=widest[0][2],
        nvlink_step_latency=0.0, network_step_latency=0.0, achieved_flops=tuple(rates),
        collectives=tuple(collectives), overlap_fsdp=cuda, compute_bytes=element,
    )


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


def spawn_ranks(fn: Callable[..., Any], devices: int, timeout_s: int, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``devices`` spawned local ranks with an initialized default
    process group (NCCL over that many GPUs, else gloo on the CPU); rank 0's result.

    Raises:
        FxtpConfigError: ``devices`` < 1, or more GPUs asked than this host has.
    """
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise FxtpConfigError(f"devices must be an int >= 1, got {devices!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if 0 < gpus < devices:
        raise FxtpConfigError(f"measuring {devices} local ranks needs {devices} GPUs; this host has {gpus}. "
                              f"fix: --devices {gpus} (calibrate the devices you have, then plan the job with that Hardware)")
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pkl")
        mp.spawn(_rank_main, args=(devices, port, timeout_s, bool(gpus), out, fn, args, kwargs), nprocs=devices, join=True)
        with open(out, "rb") as f:
            return pickle.load(f)


def _rank_main(rank: int, devices: int, port: int, timeout_s: int, cuda: bool, out: str, fn: Callable[..., Any],
               args: tuple, kwargs: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # the ranks share the host's cores
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=devices,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(*args, **kwargs)
        if rank == 0:
            with open(out, "wb") as f:
                pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def _shape(model: nn.Module) -> TransformerShape:
    blocks = repeated_blocks(model)
    if blocks is None:
        raise FxtpConfigError(f"fxtp.planner.calibrate found no stack of blocks in {type(model).__name__}: it measures "
                              "Hugging Face decoder models. fix: pass a transformers model or its config.json")
    return TransformerShape.of(model, blocks.fqn)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gemm_seconds(shapes: list, device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    """Median seconds of one step's GEMMs ``shapes``, forward and backward, on this rank, end to end."""
    g = torch.Generator(device=device).manual_seed(0)
    operands = [(torch.randn(m, k, device=device, dtype=dtype, generator=g), torch.randn(n, k, device=device, dtype=dtype, generator=g),
                 torch.randn(m, n, device=device, dtype=dtype, generator=g), count) for m, k, n, count in shapes]

    def once() -> float:  # end to end: ranks sharing cores are also descheduled between GEMMs
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        for x, w, dy, count in operands:
            for _ in range(count):
                torch.mm(x, w.t()), torch.mm(dy, w), torch.mm(dy.t(), x)
        _sync(device)
        return time.perf_counter() - start

    once()  # warm-up
    return statistics.median(once() for _ in range(repeats))


def _slowest(value: float, op: Any = dist.ReduceOp.MAX) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=op)
    return float(t.item())


def _groups_of(n: int, ranks: int) -> Any:
    """This rank's group of ``n`` consecutive ranks (every rank creates every group, as torch asks)."""
    if n == ranks:
        return dist.group.WORLD
    mine = None
    for first in range(0, ranks, n):
        group = dist.new_group(list(range(first, first + n)))
        if first <= dist.get_rank() < first + n:
            mine = group
    return mine


def _fit(kind: str, group: Any, n: int, large: int, device: torch.device, dtype: torch.dtype, repeats: int,
         between: Callable[[], Any]) -> tuple[float, float]:
    """``(latency_s, bus_bytes_per_s)`` of ``kind`` over ``group`` from its times at two payloads.

    On a GPU each is timed after a barrier, the slowest rank's. On CPU ranks each follows
    ``between`` (one of the model's GEMMs) without a barrier, as a collective follows a block's
    compute in a step, and the ranks' mean is kept: ranks sharing a host's cores reach a
    collective at different times, and that wait is part of what a collective costs there."""
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    element = torch.finfo(dtype).bits // 8
    large = max(large, 16 * _SMALL) // (n * element) * n * element
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # torch 2.13 renames them
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    times = []
    for payload in (_SMALL, large):
        full = torch.ones(payload // element, device=device, dtype=dtype)
        part = torch.ones(payload // element // n, device=device, dtype=dtype)

        def once() -> float:
            if device.type == "cuda":
                dist.barrier()
                _sync(device)
            else:
                between()
            start = time.perf_counter()
            if kind == "all_reduce":
                dist.all_reduce(full, group=group)
            elif kind == "all_gather":
                gather(full, part, group=group)
            else:
                scatter(part, full, group=group)
            _sync(device)
            return time.perf_counter() - start

        once()
        seconds = statistics.median(once() for _ in range(repeats))
        times.append(_slowest(seconds) if device.type == "cuda" else _slowest(seconds, op=dist.ReduceOp.SUM) / dist.get_world_size())
    per_byte = (times[1] - times[0]) / (large - _SMALL)
    if per_byte <= 0:  # the large payload was not slower (noise): all of it bandwidth
        return 0.0, large * steps / n / times[1]
    return max(0.0, times[0] - _SMALL * per_byte), steps / n / per_byte


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
