"""FSDP2 per block on dp x tp: fxtp's blocks against torchtitan's plan written by hand.

    python tools/bench_fsdp.py            # prints peak MiB per rank, dp 2 x tp 2 (4 gloo ranks)

The model: 8 residual MLP blocks (512 -> 2048 -> 512, no bias; 64 MiB of fp32 weights), batch
2 x 16 per dp rank. Both plans apply ``fully_shard`` to each block, then to the root, with
``reshard_after_forward=True``, on ``mesh["dp"]`` of a dp 2 x tp 2 mesh:

* ``fxtp``: ``fxtp.compile(model, 2, group=mesh["tp"])``, then ``fully_shard`` per block of
  the ``ParallelModule`` (NOTE: [FSDP2 units inside a ParallelModule] in fxtp/runtime/fsdp.py);
* ``hand``: torchtitan's way, ``parallelize_module`` with ``ColwiseParallel`` /
  ``RowwiseParallel`` (``SequenceParallel`` on the norm with ``sequence_parallel``) per block.

The instrument is glibc's ``mallinfo2`` sampled every 0.2 ms on a thread (``shared/tools/heap.py``,
not fxtp's code), over one forward and backward after a warm-up step; the figure is the peak
above the level at entry, the largest over the ranks. :func:`measure` runs on initialized gloo
ranks (``tests/test_fsdp_blocks.py`` asserts the bound with it); :func:`bench` spawns them.
"""

from __future__ import annotations

import copy
import gc
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(os.path.dirname(ROOT), "shared", "tools"), "/work/shared/tools"):
    if path not in sys.path:
        sys.path.insert(0, path)

import fxtp  # noqa: E402
from fxtp.planner.calibration import spawn_ranks  # noqa: E402

__all__ = ["Block", "Net", "measure", "bench", "compile_seconds"]

DIM, HIDDEN, BLOCKS, BATCH, SEQ = 512, 2048, 8, 2, 16


class Block(nn.Module):
    """A residual MLP block: ``x + down(relu(up(norm(x))))``."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, blocks: int = BLOCKS, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, hidden) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _hand_plan(model: Net, mesh: Any, sequence_parallel: bool) -> nn.Module:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    for block in model.layers:
        if sequence_parallel:
            plan = {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                    "down": RowwiseParallel(output_layouts=Shard(1))}
        else:
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        parallelize_module(block, mesh, plan)
    if sequence_parallel:  # the root takes and gives replicated activations
        from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput

        parallelize_module(model.layers[0], mesh, PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                                  use_local_output=True))
        parallelize_module(model.layers[-1], mesh, PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),)))
    return model


def _peak(model: nn.Module, x: torch.Tensor) -> int:
    from heap import Peak

    for _ in range(2):  # the second is measured: lazy inits and first-call allocations done
        gc.collect()
        with Peak() as peak:
            out = model(x)
            (out.float() ** 2).mean().backward()
            del out
        for p in model.parameters():
            p.grad = None
    return peak.peak - peak.base


def measure(sequence_parallel: bool = False, checkpointing: bool = False, blocks: int = BLOCKS) -> dict[str, int]:
    """On 4 initialized gloo ranks, for fxtp and the hand plan, each ``fully_shard`` per block
    then root: ``{name}`` the peak bytes above entry of one forward and backward, and
    ``{name}_resident`` the bytes the wrapped model holds (heap in use after wrapping, less before
    its copy of the model was made, after one compile of a 1-block model has filled the
    process's one-time caches); each the max over the ranks."""
    from heap import in_use
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.checkpoint import checkpoint

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = Net(blocks)
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(mesh["dp"].get_local_rank()))
    fxtp.compile(Net(1), 2, (x,), group=mesh["tp"], dynamic=False, sequence_parallel=sequence_parallel)  # warm-up
    peaks, resident = {}, {}
    for name in ("fxtp", "hand"):
        gc.collect()
        before = in_use()
        model = copy.deepcopy(ref)
        if name == "fxtp":
            model = fxtp.compile(model, 2, (x,), group=mesh["tp"], dynamic=False, sequence_parallel=sequence_parallel,
                                 activation_checkpointing="blocks" if checkpointing else None)
            units = [model.get_submodule(f"layers.{i}") for i in range(blocks)]
        else:
            model = _hand_plan(model, mesh["tp"], sequence_parallel)
            units = list(model.layers)
            if checkpointing:  # torchtitan's apply_ac: each block checkpointed, inside its FSDP2 unit
                for block in units:
                    block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(block.forward)
        for unit in units:
            fully_shard(unit, mesh=mesh["dp"], reshard_after_forward=True)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=True)
        dist.barrier()
        gc.collect()
        resident[name] = in_use() - before
        peaks[name] = _peak(model, x)
        del model, units, unit  # the loop variable holds the last block (and through FSDP2, the model)
        gc.collect()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (peaks, resident))
    return {**{k: max(p[k] for p, _ in gathered) for k in peaks},
            **{f"{k}_resident": max(r[k] for _, r in gathered) for k in resident}}


def compile_seconds(blocks: int) -> dict[str, float]:
    """torch.compile per block, torchtitan's ``apply_compile`` (``block.compile(fullgraph=True)``,
    inductor), one process, world size 1: seconds of the first forward and backward and the graphs
    Dynamo compiled (``counters["stats"]["unique_graphs"]``), for a ``ParallelModule`` and for the
    plain model. Identical blocks share compiled code (NOTE: [identical blocks compile once] in
    fxtp/runtime/blocks.py); the first block is compiled again for its input that needs no grad.
    Each run starts from empty caches (``torch._inductor.utils.fresh_cache``: private, the bench's
    one use), so no run reuses another's kernels, after a warm-up compile of a one-line function."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    with fresh_cache():  # the process's one-time costs (importing inductor, finding the C++ compiler) outside the runs
        torch.compile(lambda t: (t.sin() + 1).sum(), fullgraph=True)(torch.randn(4, requires_grad=True)).backward()
    out: dict[str, float] = {}
    for label in ("fxtp", "plain"):
        with fresh_cache():
            out |= _first_compiled_call(label, blocks, counters)
    return out


def _first_compiled_call(label: str, blocks: int, counters: Any) -> dict[str, float]:
    """One run of :func:`compile_seconds`: ``label`` ``"fxtp"`` (a ``ParallelModule``) or ``"plain"``."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net(blocks, 64, 256)
    x = torch.randn(2, 8, 64)
    ref = model(x)
    target = fxtp.compile(copy.deepcopy(model), 1, (x,), dynamic=False) if label == "fxtp" else model
    for i in range(blocks):
        target.get_submodule(f"layers.{i}").compile(fullgraph=True)
    start = time.perf_counter()
    y = target(x)
    y.sum().backward()
    seconds = time.perf_counter() - start
    torch.testing.assert_close(y, ref)
    return {f"{label}_first_call_s": seconds, f"{label}_graphs": counters["stats"]["unique_graphs"]}


def _all_configs() -> dict[str, Any]:
    return {label: measure(**kw) for label, kw in
            {"tp": {}, "sp": {"sequence_parallel": True}, "ac_blocks": {"checkpointing": True}}.items()}


def bench() -> dict[str, Any]:
    """``{config: {"fxtp_mib", "hand_mib", "ratio", "fxtp_resident_mib", "hand_resident_mib"}}``
    on 4 spawned gloo ranks (dp 2 x tp 2): peak MiB of a step and MiB held by the wrapped model."""
    raw = spawn_ranks(_all_configs, 4, 300)
    return {k: {"fxtp_mib": v["fxtp"] / 2**20, "hand_mib": v["hand"] / 2**20, "ratio": v["fxtp"] / v["hand"],
                "fxtp_resident_mib": v["fxtp_resident"] / 2**20, "hand_resident_mib": v["hand_resident"] / 2**20}
            for k, v in raw.items()}


if __name__ == "__main__":
    for config, row in bench().items():
        print(f"{config:10s} peak: fxtp {row['fxtp_mib']:7.1f} MiB  hand {row['hand_mib']:7.1f} MiB  ratio {row['ratio']:.2f}"
              f"   held: fxtp {row['fxtp_resident_mib']:6.1f} MiB  hand {row['hand_resident_mib']:6.1f} MiB")
