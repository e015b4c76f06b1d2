"""Local ranks for measuring: spawn them with a process group, time work on all of them at once,
and split a call's time by where its thread spent it (``torch.profiler``'s events, by name).

``fxtp.planner.calibrate`` and ``fxtp.planner.measure`` (and the benchmarks in ``tools/``) run
here: NCCL with one GPU a rank where the host has the GPUs, else gloo with one CPU thread a rank.

NOTE: [contended window]
Local CPU ranks share the host's cores: 4 gloo ranks on 2 cores run a step at about half a
core's rate each, and a collective waits for the peer the scheduler ran last. A call timed
alone, after a barrier, runs within one scheduler time slice at a whole core's rate, and waits
for no one: it measures an idle host, not the step. :func:`per_call` times instead what a call
costs in a step: every rank runs it back to back for ``WINDOW_S`` (the same count on every
rank), between two barriers, less an empty barrier's time, over the count; the slowest rank's
median of ``repeats`` windows. Measured 2026-12-06 on this project's 2-core CI host, 4 gloo ranks:

- a chain of 200 ``aten.mul`` on 64 floats: 1.4 ms alone, 3.2 ms a call in a window;
- a 16 KB all_reduce over the 4 ranks: 0.4-1 ms alone, 4.3-6.3 ms added to a window of
  compute; over groups of 2 (two groups at once), 0.9 ms with nothing between the calls and
  1.6-2.2 ms once each follows 0.6 ms or more of compute (a peer descheduled mid-way): so a
  collective is timed after about half a block's forward of work, as in a step (NOTE:
  [calibration] in fxtp/planner/calibration.py).

On GPUs each call is timed alone after a barrier: each rank has its own device, and the host's
share of a call is queued ahead of it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from fxtp.core.errors import FxtpConfigError

__all__ = ["FSDP_RANGES", "FXTP_COLLECTIVES", "WINDOW_S", "Profiled", "groups_of", "per_call", "per_call_each", "profiled",
           "slowest", "spawn_ranks", "sync", "union", "usable_memory"]

WINDOW_S = 0.1  # seconds a CPU measurement runs: many scheduler time slices (a few ms each)


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


def per_call(work: Callable[[], Any], repeats: int, device: torch.device = torch.device("cpu")) -> float:
    """Seconds of one ``work()`` with every rank of the default group running it at once (every
    rank calls this): the slowest rank's median of ``repeats``, after a warm-up call.

    On CPU ranks, the call's share of a window of calls back to back (NOTE: [contended
    window]); on a GPU (``device``), one call timed alone after a barrier.
    """
    return per_call_each([work], repeats, device)[0]


def per_call_each(works: Sequence[Callable[[], Any]], repeats: int, device: torch.device = torch.device("cpu")) -> list[float]:
    """:func:`per_call`'s seconds for each of ``works``, their ``repeats`` timings taking turns
    (round ``r`` times each work's ``r``-th window, NOTE: [contended window]): a burst of the
    host's other load falls on one timing of each, which the median drops, not on all of one's.
    Every rank calls this with the same works in the same order."""
    for work in works:
        work()  # warm-up
    if device.type == "cuda":
        def alone(work: Callable[[], Any]) -> float:
            dist.barrier()
            sync(device)
            start = time.perf_counter()
            work()
            sync(device)
            return time.perf_counter() - start

        rounds = [[alone(work) for work in works] for _ in range(repeats)]
        return [slowest(statistics.median(r[i] for r in rounds)) for i in range(len(works))]

    def window(fn: Callable[[], Any], n: int) -> float:
        dist.barrier()
        begin = time.perf_counter()
        for _ in range(n):
            fn()
        dist.barrier()
        return time.perf_counter() - begin

    # every figure that sizes the window is the slowest rank's, so every rank runs the same calls
    empty = slowest(statistics.median(window(lambda: None, 1) for _ in range(repeats)))
    sized = []
    for work in works:
        calls, took = 1, 0.0
        while calls < 1 << 20:
            took = slowest(window(work, calls)) - empty
            if took >= WINDOW_S / 4:
                break
            calls *= 4
        sized.append(max(1, round(calls * WINDOW_S / max(took, 1e-9))))
    rounds = [[window(work, calls) for work, calls in zip(works, sized)] for _ in range(repeats)]
    return [slowest(max(0.0, statistics.median(r[i] for r in rounds) - empty) / calls) for i, calls in enumerate(sized)]


def groups_of(n: int, ranks: int, strided: bool = False) -> Any:
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


def usable_memory(device: torch.device, ranks: int) -> int:
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


def slowest(value: float, op: Any = dist.ReduceOp.MAX) -> float:
    """``value`` reduced over the default group's ranks (their largest; ``op`` another reduction)."""
    t = torch.tensor([float(value)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=op)
    return float(t.item())


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a GPU's; nothing on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# fxtp issues its collectives as torch's functional collectives (fxtp/core/collectives.py): each op and
# its wait_tensor; FSDP2 brackets its own work in record_function ranges (its hooks, copy-in and
# copy-out and its collectives: torch/distributed/fsdp/_fully_shard/)
FXTP_COLLECTIVES = "_c10d_functional::"
FSDP_RANGES = "FSDP::"


@dataclass(frozen=True)
class Profiled:
    """One profiled call on every rank.

    Attributes:
        seconds: the call's wall seconds on this rank.
        shares: per name prefix, the share of ``seconds`` inside the union of the events whose
            names start with it (nested and overlapping events counted once), the ranks' mean.
        issued: per name prefix, the outermost events that start with it other than waits
            (``wait_tensor``): the collectives issued, for fxtp's; this rank's count.
    """

    seconds: float
    shares: dict[str, float]
    issued: dict[str, int]


def profiled(call: Callable[[], Any], prefixes: tuple[str, ...]) -> Profiled:
    """Run ``call()`` once under ``torch.profiler`` (CPU activities) on every rank of the default
    group (every rank calls this), after a barrier."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with _stderr_muted(), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        call()
        seconds = time.perf_counter() - start
    spans: dict[str, list[tuple[float, float, bool]]] = {p: [] for p in prefixes}
    for event in prof.events():
        for prefix in prefixes:
            if event.name.startswith(prefix):
                spans[prefix].append((event.time_range.start, event.time_range.end, "wait" not in event.name))
    issued = {p: _outermost(s) for p, s in spans.items()}
    ranks = dist.get_world_size()
    shares = {p: slowest(union([(a, b) for a, b, _ in s]) / 1e6 / seconds, dist.ReduceOp.SUM) / ranks for p, s in spans.items()}
    return Profiled(seconds, shares, issued)


def _outermost(spans: list[tuple[float, float, bool]]) -> int:
    """The events flagged ``True`` that no earlier event of the list encloses or overlaps: an
    op dispatched again inside itself (a functional collective under a mode that re-dispatches
    it: twice per call in the tests' rank pool, once in a spawned rank) is counted once."""
    count, end = 0, float("-inf")
    for a, b, flagged in sorted(spans, key=lambda s: (s[0], -s[1])):
        if a >= end:
            count += flagged
        end = max(end, b)
    return count


def union(spans: list[tuple[float, float]]) -> float:
    """The length of the union of intervals (nested and overlapping events counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


@contextlib.contextmanager
def _stderr_muted() -> Any:
    """File descriptor 2 to /dev/null while inside: the profiler's kineto writes a line there at
    each start and stop, on every rank, past Python's ``sys.stderr``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
