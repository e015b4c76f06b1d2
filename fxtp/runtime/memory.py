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
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["Allocation", "allocated_after_forward"]

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
