"""Bytes still allocated after a forward, read from the allocator through ``torch.profiler``.

The one instrument the tests, ``tools/bench.py`` and the docs use for memory, beside fxtp's own
counter (``fxtp.core.activations.measure``): a figure fxtp reports must be what the allocator
holds, measured by code that is not fxtp's.

NOTE: [allocator bytes on the calling thread]
``torch.profiler.profile(profile_memory=True)`` records every allocation and free the CPU
(and CUDA caching) allocator reports while profiling, with its address and its thread.
Summing ``self_cpu_memory_usage`` over all events is what a user would do first, and on gloo
it is wrong: a gloo all_gather runs on gloo's worker thread, which allocates its flat output
buffer under the caller's profiler state (``ThreadLocalStateGuard``) and frees it after that
state is gone, so the profiler sees the allocation and never the free, and every all_gather
reads as one more gathered tensor held (0.72 of the single device's bytes where 0.50 are held,
on torch's reference Transformer, ws 2). glibc's own count (``mallinfo2``) agrees with 0.50.
The figure here is therefore: the blocks the *calling thread* allocated during ``fn`` whose
address no free (on any thread) released before ``fn`` returned. A tensor the caller allocated
and gloo's thread freed counts as freed; gloo's scratch buffers, which never leave its thread,
are not counted. The events are read from the profiler's public chrome-trace export (its
``[memory]`` events carry ``Addr``, ``Bytes`` and the thread id).

One race is left: a buffer the caller hands to a gloo collective (its contiguous input, the
flat output) is freed by whichever thread drops it last; when gloo's worker thread releases
its finished work after the caller let go, that free happens outside any profiler state and
is never recorded, so the block reads as held. The error only ever adds bytes (one collective's
buffers, on a loaded machine), so ``repeat=`` runs ``fn`` that many times and keeps the least.

Also here, the heap instrument of ``fxtp.planner.measure`` (NOTE: [predicted against measured]
in fxtp/planner/measurement.py): glibc's bytes in use (:func:`in_use`, ``mallinfo2``; the few
lines of ``shared/tools/heap.py``), sampled on a thread (:class:`Peak`), or the CUDA caching
allocator's on a GPU; and the storage bytes of a module's state and its optimizer's
(:func:`storage_bytes`).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["Allocation", "Peak", "allocated_after_forward", "in_use", "storage_bytes"]

_MARK = "fxtp.memory.caller"


@dataclass(frozen=True)
class Allocation:
    """What :func:`allocated_after_forward` measured.

    Attributes:
        result: what ``fn`` returned.
        allocated: bytes allocated by the calling thread during ``fn`` and still allocated
            when it returned (NOTE: [allocator bytes on the calling thread]).
        outputs: of those, the bytes of the storages ``fn`` returned (each storage once).
    """

    result: Any
    allocated: int
    outputs: int

    @property
    def held(self) -> int:
        """Bytes held besides the outputs: for a forward, the activations saved for backward."""
        return self.allocated - self.outputs


def allocated_after_forward(fn: Callable[[], Any], *, repeat: int = 1) -> Allocation:
    """Run ``fn()`` under ``torch.profiler`` and return the bytes it left allocated.

    Example::

        m = fxtp.runtime.memory.allocated_after_forward(lambda: pm(ids))
        m.result.sum().backward()
        print(m.held)  # bytes saved for backward, as the allocator holds them

    Args:
        fn: a call with no arguments, e.g. ``lambda: model(x)``; its result (any pytree of
            tensors, a Hugging Face ``ModelOutput`` included) is returned in ``result``.
        repeat: run ``fn`` this many times (each result dropped before the next call, the
            last one returned) and report the least bytes (NOTE: [allocator bytes on the
            calling thread]: the one error there adds bytes).

    Returns:
        An :class:`Allocation`; bytes are the allocator's block sizes (CPU, and CUDA where
        profiled), so they include the allocator's rounding.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    least: Optional[tuple[int, int]] = None  # (allocated, outputs) of the call that held the least
    result: Any = None
    for _ in range(repeat):
        result = None  # the previous call's outputs and graph are freed before the next call
        measured = _measure(fn)
        result = measured.result
        if least is None or measured.held < least[0] - least[1]:
            least = (measured.allocated, measured.outputs)
        del measured
    assert least is not None
    return Allocation(result, *least)


def _measure(fn: Callable[[], Any]) -> Allocation:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, profile_memory=True) as prof:
        with record_function(_MARK):
            pass
        result = fn()
    live = _live_blocks(prof)
    storages = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)}
    outputs = sum(size for addr, size in live.items() if addr in storages)
    return Allocation(result, sum(live.values()), outputs)


def _live_blocks(prof: profile) -> dict[int, int]:
    """``{address: bytes}`` of the blocks the marked thread allocated and nobody freed."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    caller = next(e["tid"] for e in events if e.get("name") == _MARK)
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    live: dict[int, int] = {}
    for e in memory:
        addr, size = int(e["args"]["Addr"]), int(e["args"]["Bytes"])
        if size > 0 and e["tid"] == caller:
            live[addr] = size
        elif size < 0:
            live.pop(addr, None)
    return live


def storage_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the storages behind ``module``'s parameters and buffers (a DTensor's local shard)
    and ``optimizer``'s state tensors, each storage once."""
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.lru_cache(maxsize=None)
def _libc() -> Any:
    libc = ctypes.CDLL("libc.so.6")  # glibc only (Linux): another C library raises OSError
    libc.mallinfo2.restype = _MallInfo2
    return libc


def in_use(device: torch.device) -> int:
    """Bytes in use: glibc's heap (``mallinfo2().uordblks + hblkhd``, shared/tools/heap.py's
    instrument), or the CUDA caching allocator's allocated bytes on a GPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    m = _libc().mallinfo2()
    return m.uordblks + m.hblkhd


class Peak:
    """The most bytes in use while inside, sampled every 0.2 ms on a thread (CPU; a GPU's
    allocator keeps its own peak)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> "Peak":
        gc.collect()
        self.peak, self._stop = in_use(self.device), False
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, in_use(self.device))
            time.sleep(0.0002)

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, in_use(self.device))
        if self.device.type == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))
